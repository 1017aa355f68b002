// Spatial transforms (tr_onnx/ops/spatial_transform.py): GridSample and GridSampleGrad,
// AffineGrid, RoiAlign and RoiAlignGrad, Col2Im and Col2ImGrad, MaxUnpool. Every tensor is
// compact (the ops' layout rule is PLAIN_ONLY); maps have at most three spatial axes (unused
// leading ones have length 1). Compute is fp32, and where NumPy's kernel stores an
// intermediate in the storage type (GridSample's products and sums, Col2Im's padded buffer,
// RoiAlign's weight matrices) the value is rounded to T at the same step (tr_st), so f16/bf16
// results are NumPy's too. No float atomics: every output element is written by one thread
// that adds its contributions in NumPy's order.
//
// GridSample's taps (tr_gs_axis) repeat _GridTaps operation by operation in fp32: the
// coordinate (u = (g + 1) * scale, or ((g + 1) * L - 1) * 0.5), rint for nearest, the border
// clamp of the coordinate (not for cubic), the reflection by whole bounces, then per tap its
// index with the padding applied (zeros: index 0 and weight 0) and Keys' weights and slopes
// in the numpy kernel's order. A combination of one tap per axis (axis 0 slowest) has the
// flat index sum idx_d * stride_d and the weight ((1 * w_0) * w_1) * w_2.
//
// tr_grid_sample_<dt>(x, grid, y, n, c, q, nd, s0, s1, s2, mode, padding, align)
//     y[n, c, q] = 0 + x[tap] * weight + ... over the combinations in order, each product and
//     sum rounded to T. One thread per (n, q); x [N, C, s0*s1*s2], grid [N, q, nd].
//     mode: 0 nearest, 1 linear, 2 cubic; padding: 0 zeros, 1 border, 2 reflection.
// tr_grid_sample_taps_<dt>(grid, flat, wt, n, q, nd, s0, s1, s2, mode, padding, align)
//     GridSampleGrad's first pass: every (n, combination e, q)'s flat index (int32) and weight
//     into flat/wt [N, E, q], E = taps^nd.
// tr_gs_count(flat, start, n, m, p), tr_gs_scan(start, n, p),
// tr_gs_bucket(flat, start, fill, order, n, m, p)
//     GridSampleGrad's buckets: the m = E * q taps t = e * q + o of each batch item grouped
//     by the map position they read, so the gather reads each tap once: counts (start[n, i+1],
//     start and fill zeroed first), their running sum (start[n, i] = the first of i's taps in
//     order[n, .]; one thread per batch item), then each tap's id into its bucket. Integer
//     atomics only: the counts are exact, a bucket's order is not -- tr_grid_sample_grad_x
//     sorts each bucket before it adds.
// tr_grid_sample_grad_x_<dt>(gy, wt, start, order, gx, n, c, q, p, m)
//     gx[n, :, i] = the sum, over the taps t of i's bucket in increasing t (the combinations e
//     in order and then q in order: np.add.at's order), of gy[n, :, t % q] * wt[n, t]; one
//     thread per (n, i) sorts its bucket (insertion sort: buckets hold a few taps per output
//     position that reads i) and adds. No float atomics: deterministic, NumPy's roundings.
// tr_grid_sample_grad_grid_<dt>(gy, x, grid, ggrid, n, c, q, nd, s0, s1, s2, mode, padding,
//                               align)
//     ggrid[n, q, nd-1-d] = (sum over combinations of dweight_d * (sum_c x[tap] * gy)) * du_d,
//     the accumulator in T; zero for nearest. One thread per (n, q).
// tr_affine_grid_<dt>(theta, grid, n, nd, s0, s1, s2, align)
//     grid[n, q, j] = sum_k base[q, k] * theta[n, j, k] (k = 0..nd, base[q, nd] = 1), the base
//     positions computed in float64 as numpy.linspace / (2i + 1) / L - 1 and rounded to T.
// tr_roi_align_matrix_<dt>(rois, ay, ax, count, r, oh, ow, h, w, scale, ratio, half)
//     One thread per (box, row): row ph < oh builds ay[box, ph, :] ([R, oh, h]), the rest
//     ax[box, pw, :] ([R, ow, w]): each bin's summed bilinear sample weights per pixel
//     (_roi_matrix: the low taps of the samples in order, then the high ones, each rounded to
//     T); count[box] = samples per bin (0: a box without samples). Sample positions in
//     float64 as _roi_axis places them.
// tr_roi_align_avg_<dt>(x, batch, ay, ax, count, y, r, c, oh, ow, h, w)
//     y[r, c, ph, pw] = sum_h ay[r, ph, h] * (sum_w x[batch[r], c, h, w] * ax[r, pw, w]) / count
// tr_roi_align_max_<dt>(x, rois, batch, y, r, c, oh, ow, h, w, scale, ratio, half)
//     The largest weighted corner x * (wy * wx) (products rounded to T) of any sample of the
//     bin; NaN propagates as np.maximum's.
// tr_roi_align_grad_<dt>(gy, batch, ay, ax, count, gx, n, r, c, oh, ow, h, w)
//     gx[n, c, h, w] = sum over the boxes of batch item n, in order, of
//     (sum_ph ay[., ph, h] * sum_pw gy[., c, ph, pw] * ax[., pw, w]) / count.
// tr_col2im_<dt>(cols, y, n, c, i0, i1, i2, k0, k1, k2, t0, t1, t2, d0, d1, d2, b0, b1, b2,
//                o0, o1, o2)
//     Col2Im as a gather: y[n, c, p] = 0 + the column entries of the taps (row-major order)
//     whose window position lands on p, each sum rounded to T (NumPy's padded buffer). Image
//     i, kernel k, strides t, dilations d, pads begin b, window positions o; cols
//     [N, C * k0*k1*k2, o0*o1*o2].
// tr_col2im_grad_<dt>(gy, gcols, ...same geometry)
//     Col2ImGrad (im2col): gcols[n, c*K + k, l] = gy at the tap's pixel, 0 in the padding.
// tr_max_unpool_winner(idx, win, m, total)
//     win[j] = 1 + the last (largest) position i of the indices naming j (np.put: the last
//     write wins), by integer atomicMax (deterministic); indices counted from the end when
//     negative, skipped when outside [0, total). win starts zeroed.
// tr_max_unpool_b<bytes>(x, idx, win, y, m, total, f0..f4, y0..y4)
//     y[corner(j)] = x[i] for the winning i of j = idx[i]; f: the window-given (full) shape
//     the indices address, y: the output's shape (>= f, the full shape in its leading corner),
//     both left-padded to rank 5. y starts zeroed.
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// v rounded to storage type T and back: NumPy storing an intermediate in a T array
template <class T> TR_HD float tr_st(float v) {
    T t;
    tr_from_float(v, &t);
    return tr_to_float(t);
}

// ---- GridSample ------------------------------------------------------------------------------

#define TR_GS_MAX_TAPS 4
#define TR_GS_MAX_DIMS 3

// _GridTaps._reflect: v reflected by the near border into [lo, hi]; *dv negated where an even
// number of whole bounces reflected it (dv may be null)
TR_HD float tr_gs_reflect(float v, float lo, float hi, float* dv) {
    float span = hi - lo;
    if (span <= 0.0f) {
        if (dv != 0) *dv = 0.0f;
        return lo;
    }
    bool below = v < lo, outside = below || v > hi;
    float dist = below ? lo - v : v - hi;
    float bounces = floorf(dist / span);
    dist = dist - bounces * span;
    bool even = fmodf(bounces, 2.0f) == 0.0f;
    float value = (even == below) ? dist + lo : hi - dist;
    if (!outside) return v;
    if (dv != 0 && even) *dv = -*dv;
    return value;
}

// _keys_weights (and _keys_slopes) of fraction t, in the numpy kernel's operation order
TR_HD void tr_gs_keys(float t, float* w, float* dw, bool slopes) {
    const float a = -0.75f;
    const float shift[4] = {1.0f, 0.0f, 1.0f, 2.0f}, sign[4] = {1.0f, 1.0f, -1.0f, -1.0f};
    for (int k = 0; k < 4; ++k) {
        float s = t * sign[k];
        s = s + shift[k];
        float v;
        if (k == 0 || k == 3) {
            v = s * a;
            v = v - 5.0f * a;
            v = v * s;
            v = v + 8.0f * a;
            v = v * s;
            v = v - 4.0f * a;
        } else {
            v = s * (a + 2.0f);
            v = v - (a + 3.0f);
            v = v * s;
            v = v * s;
            v = v + 1.0f;
        }
        w[k] = v;
        if (!slopes) continue;
        float d;
        if (k == 0 || k == 3) {
            d = s * (3.0f * a);
            d = d - 10.0f * a;
            d = d * s;
            d = d + 8.0f * a;
        } else {
            d = s * (3.0f * (a + 2.0f));
            d = d - 2.0f * (a + 3.0f);
            d = d * s;
        }
        dw[k] = d * sign[k];
    }
}

// _GridTaps._axis for one grid value g along an axis of length len: the taps' indices, weights
// and d weight / d coordinate; returns d coordinate / d grid value
TR_HD float tr_gs_axis(float g, long long len, int mode, int padding, int align, bool slopes,
                       long long* idx, float* w, float* dw) {
    float lo = align ? 0.0f : -0.5f;
    float hi = align ? (float)(len - 1) : (float)((double)len - 0.5);
    float scale = align ? (float)((double)(len - 1) / 2.0) : (float)((double)len / 2.0);
    float u = g + 1.0f;
    if (align) {
        u = u * scale;
    } else {
        u = u * (float)len;
        u = u - 1.0f;
        u = u * 0.5f;
    }
    float du = scale;
    if (mode == 0) u = rintf(u);
    if (padding == 1 && mode != 2) {
        if (u < lo || u > hi) {
            float top = (float)(len - 1);
            u = u < 0.0f ? 0.0f : (u > top ? top : u);  // np.clip(u, 0, len - 1)
            du = 0.0f;
        }
    } else if (padding == 2) {
        u = tr_gs_reflect(u, lo, hi, &du);
    }
    long long first;
    int taps, offset;
    if (mode == 0) {
        first = (long long)u;
        w[0] = 1.0f;
        dw[0] = 0.0f;
        taps = 1;
        offset = 0;
    } else {
        float fl = floorf(u);
        first = (long long)fl;
        float frac = u - fl;
        if (mode == 1) {
            w[0] = 1.0f - frac;
            w[1] = frac;
            dw[0] = -1.0f;
            dw[1] = 1.0f;
            taps = 2;
            offset = 0;
        } else {
            tr_gs_keys(frac, w, dw, slopes);
            taps = 4;
            offset = -1;
        }
    }
    for (int k = 0; k < taps; ++k) {
        long long i = first + offset + k;
        if (padding == 0) {
            if (i < 0 || i >= len) {
                i = 0;
                w[k] = 0.0f;
                dw[k] = 0.0f;
            }
        } else if (padding == 1) {
            i = i < 0 ? 0 : (i > len - 1 ? len - 1 : i);
        } else {
            i = (long long)tr_gs_reflect((float)i, lo, hi, 0);
        }
        idx[k] = i;
    }
    return du;
}

// The taps of grid point row g (nd values, g[nd - 1 - d] addresses axis d) along every axis
struct TrGridTaps {
    long long idx[TR_GS_MAX_DIMS][TR_GS_MAX_TAPS];
    float w[TR_GS_MAX_DIMS][TR_GS_MAX_TAPS], dw[TR_GS_MAX_DIMS][TR_GS_MAX_TAPS];
    float du[TR_GS_MAX_DIMS];
    long long stride[TR_GS_MAX_DIMS];
    int nd, k, combos;
};

template <class G>
TR_HD void tr_gs_taps(TrGridTaps* t, const G* g, int nd, const long long* s, int mode,
                      int padding, int align, bool slopes) {
    t->nd = nd;
    t->k = mode == 0 ? 1 : (mode == 1 ? 2 : 4);
    t->combos = 1;
    long long stride = 1;
    for (int d = nd - 1; d >= 0; --d) {
        t->du[d] = tr_gs_axis(tr_get(g, nd - 1 - d), s[d], mode, padding, align, slopes,
                              t->idx[d], t->w[d], t->dw[d]);
        t->stride[d] = stride;
        stride *= s[d];
        t->combos *= t->k;
    }
}

// combination e: its axis-d tap (axis 0 slowest, as itertools.product)
TR_HD int tr_gs_tap(const TrGridTaps* t, int e, int d) {
    for (int a = t->nd - 1; a > d; --a) e /= t->k;
    return e % t->k;
}

TR_HD long long tr_gs_flat(const TrGridTaps* t, int e, float* weight) {
    long long flat = 0;
    float wt = 1.0f;
    for (int d = 0; d < t->nd; ++d) {
        int k = tr_gs_tap(t, e, d);
        flat += t->idx[d][k] * t->stride[d];
        wt = wt * t->w[d][k];
    }
    *weight = wt;
    return flat;
}

#define TR_GS_SHAPE long long s0, long long s1, long long s2
#define TR_GS_GEOMETRY                                                                         \
    const long long s[3] = {s0, s1, s2};                                                       \
    long long p = s0 * s1 * s2;                                                                \
    (void)p;

TR_KERNEL void tr_gs_count(const int* flat, int* start, long long n, long long m,
                           long long p) {
    TR_GRID_STRIDE(j, n * m) {
        int* counts = start + (j / m) * (p + 1) + 1;
#if defined(__CUDACC__)
        atomicAdd(counts + flat[j], 1);
#else
        counts[flat[j]] += 1;
#endif
    }
}

TR_KERNEL void tr_gs_scan(int* start, long long n, long long p) {
    TR_GRID_STRIDE(b, n) {
        int* s = start + b * (p + 1);
        for (long long i = 1; i <= p; ++i) s[i] += s[i - 1];
    }
}

TR_KERNEL void tr_gs_bucket(const int* flat, const int* start, int* fill, int* order,
                            long long n, long long m, long long p) {
    TR_GRID_STRIDE(j, n * m) {
        long long b = j / m;
        int f = flat[j];
#if defined(__CUDACC__)
        int k = atomicAdd(fill + b * p + f, 1);
#else
        int k = fill[b * p + f]++;
#endif
        order[b * m + start[b * (p + 1) + f] + k] = (int)(j % m);
    }
}

#define TR_GRID_SAMPLE(T, dt)                                                                  \
    TR_KERNEL void tr_grid_sample_##dt(const T* x, const T* grid, T* y, long long n,          \
                                       long long c, long long q, long long nd, TR_GS_SHAPE,    \
                                       int mode, int padding, int align) {                     \
        TR_GS_GEOMETRY                                                                         \
        TR_GRID_STRIDE(j, n * q) {                                                             \
            long long b = j / q, o = j % q;                                                    \
            TrGridTaps t;                                                                      \
            tr_gs_taps(&t, grid + j * nd, (int)nd, s, mode, padding, align, false);            \
            for (long long ch = 0; ch < c; ++ch) {                                             \
                const T* xc = x + (b * c + ch) * p;                                            \
                float acc = 0.0f;                                                              \
                for (int e = 0; e < t.combos; ++e) {                                           \
                    float wt;                                                                  \
                    long long f = tr_gs_flat(&t, e, &wt);                                      \
                    acc = tr_st<T>(acc + tr_st<T>(tr_get(xc, f) * wt));                        \
                }                                                                              \
                tr_put(y, (b * c + ch) * q + o, acc);                                          \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_grid_sample_taps_##dt(const T* grid, int* flat, float* wt, long long n,  \
                                            long long q, long long nd, TR_GS_SHAPE, int mode,  \
                                            int padding, int align) {                          \
        TR_GS_GEOMETRY                                                                         \
        TR_GRID_STRIDE(j, n * q) {                                                             \
            long long b = j / q, o = j % q;                                                    \
            TrGridTaps t;                                                                      \
            tr_gs_taps(&t, grid + j * nd, (int)nd, s, mode, padding, align, false);            \
            for (int e = 0; e < t.combos; ++e) {                                               \
                long long at = (b * t.combos + e) * q + o;                                     \
                flat[at] = (int)tr_gs_flat(&t, e, wt + at);                                    \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_grid_sample_grad_x_##dt(const T* gy, const float* wt, const int* start, \
                                              int* order, T* gx, long long n, long long c,     \
                                              long long q, long long p, long long m) {         \
        TR_GRID_STRIDE(j, n * p) {                                                             \
            long long b = j / p, i = j % p;                                                    \
            int* bucket = order + b * m + start[b * (p + 1) + i];                              \
            int size = start[b * (p + 1) + i + 1] - start[b * (p + 1) + i];                    \
            for (int k = 1; k < size; ++k) {                                                   \
                int t = bucket[k], u = k;                                                      \
                for (; u > 0 && bucket[u - 1] > t; --u) bucket[u] = bucket[u - 1];             \
                bucket[u] = t;                                                                 \
            }                                                                                  \
            for (long long ch = 0; ch < c; ++ch) {                                             \
                float acc = 0.0f;                                                              \
                for (int k = 0; k < size; ++k) {                                               \
                    long long t = bucket[k];                                                   \
                    float v = tr_st<T>(tr_get(gy, (b * c + ch) * q + t % q) * wt[b * m + t]);  \
                    acc = tr_st<T>(acc + v);                                                   \
                }                                                                              \
                tr_put(gx, (b * c + ch) * p + i, acc);                                         \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_grid_sample_grad_grid_##dt(const T* gy, const T* x, const T* grid,      \
                                                 T* ggrid, long long n, long long c,           \
                                                 long long q, long long nd, TR_GS_SHAPE,       \
                                                 int mode, int padding, int align) {           \
        TR_GS_GEOMETRY                                                                         \
        TR_GRID_STRIDE(j, n * q) {                                                             \
            long long b = j / q, o = j % q;                                                    \
            TrGridTaps t;                                                                      \
            tr_gs_taps(&t, grid + j * nd, (int)nd, s, mode, padding, align, true);             \
            float acc[TR_GS_MAX_DIMS] = {0.0f, 0.0f, 0.0f};                                    \
            for (int e = 0; mode != 0 && e < t.combos; ++e) {                                  \
                float wt;                                                                      \
                long long f = tr_gs_flat(&t, e, &wt);                                          \
                float dot = 0.0f;                                                              \
                for (long long ch = 0; ch < c; ++ch)                                           \
                    dot += tr_get(x, (b * c + ch) * p + f) * tr_get(gy, (b * c + ch) * q + o); \
                dot = tr_st<T>(dot);                                                           \
                for (int d = 0; d < t.nd; ++d) {                                               \
                    float dws = t.dw[d][tr_gs_tap(&t, e, d)];                                  \
                    for (int a = 0; a < t.nd; ++a)                                             \
                        if (a != d) dws = dws * t.w[a][tr_gs_tap(&t, e, a)];                   \
                    acc[d] = tr_st<T>(acc[d] + dws * dot);                                     \
                }                                                                              \
            }                                                                                  \
            for (int d = 0; d < t.nd; ++d) tr_put(ggrid, j * nd + nd - 1 - d, acc[d] * t.du[d]); \
        }                                                                                      \
    }

// ---- AffineGrid ------------------------------------------------------------------------------

// affine_base_grid: position i of an axis of length len in [-1, 1] (float64)
TR_HD double tr_affine_position(long long i, long long len, int align) {
    if (len <= 1) return 0.0;
    if (align) {
        if (i == len - 1) return 1.0;  // numpy.linspace sets the end point exactly
        return (double)i * (2.0 / (double)(len - 1)) + -1.0;
    }
    return (double)(2 * i + 1) / (double)len - 1.0;
}

#define TR_AFFINE_GRID(T, dt)                                                                  \
    TR_KERNEL void tr_affine_grid_##dt(const T* theta, T* grid, long long n, long long nd,     \
                                       TR_GS_SHAPE, int align) {                               \
        TR_GS_GEOMETRY                                                                         \
        TR_GRID_STRIDE(j, n * p * nd) {                                                        \
            long long col = j % nd, o = (j / nd) % p, b = j / (nd * p);                        \
            const T* row = theta + (b * nd + col) * (nd + 1);                                  \
            float acc = 0.0f;                                                                  \
            long long rest = o;                                                                \
            float pos[TR_GS_MAX_DIMS];                                                         \
            for (int d = (int)nd - 1; d >= 0; --d) {                                           \
                pos[d] = tr_st<T>((float)tr_affine_position(rest % s[d], s[d], align));        \
                rest /= s[d];                                                                  \
            }                                                                                  \
            for (long long k = 0; k < nd; ++k) acc += pos[nd - 1 - k] * tr_get(row, k);        \
            acc += tr_get(row, nd);                                                            \
            tr_put(grid, j, acc);                                                              \
        }                                                                                      \
    }

// ---- RoiAlign --------------------------------------------------------------------------------

// _roi_sampler for box r: the bins' start and size along y and x (float64), and the samples
// per bin (gh, gw); false for a box without samples
template <class T>
TR_HD bool tr_roi_box(const T* rois, long long r, long long oh, long long ow, double scale,
                      long long ratio, int half, double* y0, double* x0, double* bh, double* bw,
                      long long* gh, long long* gw) {
    double off = half ? 0.5 : 0.0;
    double bx0 = (double)tr_get(rois, r * 4 + 0) * scale - off;
    double by0 = (double)tr_get(rois, r * 4 + 1) * scale - off;
    double bx1 = (double)tr_get(rois, r * 4 + 2) * scale - off;
    double by1 = (double)tr_get(rois, r * 4 + 3) * scale - off;
    double w = bx1 - bx0, h = by1 - by0;
    if (!half) {
        w = w < 1.0 ? 1.0 : w;
        h = h < 1.0 ? 1.0 : h;
    }
    *gh = ratio > 0 ? ratio : (long long)ceil(h / (double)oh);
    *gw = ratio > 0 ? ratio : (long long)ceil(w / (double)ow);
    *y0 = by0;
    *x0 = bx0;
    *bh = h;
    *bw = w;
    return *gh > 0 && *gw > 0;
}

// _roi_axis: sample s of bin b -> low / high index and their weights (float64, valid-masked)
TR_HD void tr_roi_sample(double start, double extent, long long bins, long long samples,
                         long long b, long long s, long long len, long long* low,
                         long long* high, double* wl, double* wh) {
    double size = extent / (double)bins;
    double pos = start + (double)b * size + ((double)s + 0.5) * size / (double)samples;
    double valid = (pos >= -1.0 && pos <= (double)len) ? 1.0 : 0.0;
    pos = pos < 0.0 ? 0.0 : pos;
    long long lo = (long long)pos;
    bool edge = lo >= len - 1;
    if (edge) lo = len - 1;
    double frac = edge ? 0.0 : pos - (double)lo;
    *low = lo;
    *high = edge ? lo : lo + 1;
    *wl = (1.0 - frac) * valid;
    *wh = frac * valid;
}

#define TR_ROI_ARGS long long r, long long c, long long oh, long long ow, long long h, long long w
#define TR_ROI_BOX_ARGS double scale, long long ratio, int half

#define TR_ROI_ALIGN(T, dt)                                                                    \
    TR_KERNEL void tr_roi_align_matrix_##dt(const T* rois, float* ay, float* ax, float* count, \
                                            long long r, long long oh, long long ow,           \
                                            long long h, long long w, TR_ROI_BOX_ARGS) {       \
        TR_GRID_STRIDE(j, r * (oh + ow)) {                                                     \
            long long box = j / (oh + ow), row = j % (oh + ow);                                \
            double y0, x0, bh, bw;                                                             \
            long long gh, gw;                                                                  \
            bool any = tr_roi_box(rois, box, oh, ow, scale, ratio, half, &y0, &x0, &bh, &bw,   \
                                  &gh, &gw);                                                   \
            bool is_y = row < oh;                                                              \
            long long bin = is_y ? row : row - oh, len = is_y ? h : w;                         \
            float* m = is_y ? ay + (box * oh + bin) * h : ax + (box * ow + bin) * w;           \
            for (long long i = 0; i < len; ++i) m[i] = 0.0f;                                   \
            if (row == 0) count[box] = any ? (float)(gh * gw) : 0.0f;                          \
            if (!any) continue;                                                                \
            long long samples = is_y ? gh : gw;                                                \
            for (int side = 0; side < 2; ++side)                                               \
                for (long long s = 0; s < samples; ++s) {                                      \
                    long long lo, hi;                                                          \
                    double wl, wh;                                                             \
                    tr_roi_sample(is_y ? y0 : x0, is_y ? bh : bw, is_y ? oh : ow, samples,     \
                                  bin, s, len, &lo, &hi, &wl, &wh);                            \
                    long long at = side ? hi : lo;                                             \
                    m[at] = tr_st<T>(m[at] + tr_st<T>((float)(side ? wh : wl)));               \
                }                                                                              \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_roi_align_avg_##dt(const T* x, const long long* batch, const float* ay,  \
                                         const float* ax, const float* count, T* y,            \
                                         TR_ROI_ARGS) {                                        \
        TR_GRID_STRIDE(j, r * c * oh * ow) {                                                   \
            long long pw = j % ow, ph = (j / ow) % oh, ch = (j / (ow * oh)) % c;               \
            long long box = j / (ow * oh * c);                                                 \
            float cnt = count[box];                                                            \
            if (cnt == 0.0f) {                                                                 \
                tr_put(y, j, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            const T* xc = x + (batch[box] * c + ch) * h * w;                                   \
            const float* my = ay + (box * oh + ph) * h;                                        \
            const float* mx = ax + (box * ow + pw) * w;                                        \
            float acc = 0.0f;                                                                  \
            for (long long i = 0; i < h; ++i) {                                                \
                if (my[i] == 0.0f) continue;                                                   \
                float row = 0.0f;                                                              \
                for (long long k = 0; k < w; ++k) row += tr_get(xc, i * w + k) * mx[k];        \
                acc += my[i] * row;                                                            \
            }                                                                                  \
            tr_put(y, j, acc / cnt);                                                           \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_roi_align_max_##dt(const T* x, const T* rois, const long long* batch,    \
                                         T* y, TR_ROI_ARGS, TR_ROI_BOX_ARGS) {                 \
        TR_GRID_STRIDE(j, r * c * oh * ow) {                                                   \
            long long pw = j % ow, ph = (j / ow) % oh, ch = (j / (ow * oh)) % c;               \
            long long box = j / (ow * oh * c);                                                 \
            double y0, x0, bh, bw;                                                             \
            long long gh, gw;                                                                  \
            if (!tr_roi_box(rois, box, oh, ow, scale, ratio, half, &y0, &x0, &bh, &bw, &gh,    \
                            &gw)) {                                                            \
                tr_put(y, j, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            const T* xc = x + (batch[box] * c + ch) * h * w;                                   \
            float best = 0.0f;                                                                 \
            bool first = true;                                                                 \
            for (long long sy = 0; sy < gh; ++sy) {                                            \
                long long yi[2], xi[2];                                                        \
                double wyd[2], wxd[2];                                                         \
                tr_roi_sample(y0, bh, oh, gh, ph, sy, h, &yi[0], &yi[1], &wyd[0], &wyd[1]);    \
                for (long long sx = 0; sx < gw; ++sx) {                                        \
                    tr_roi_sample(x0, bw, ow, gw, pw, sx, w, &xi[0], &xi[1], &wxd[0],          \
                                  &wxd[1]);                                                    \
                    float m = 0.0f;                                                            \
                    for (int a = 0; a < 4; ++a) {                                              \
                        float wy = tr_st<T>((float)wyd[a / 2]), wx = tr_st<T>((float)wxd[a % 2]); \
                        float v = tr_st<T>(tr_get(xc, yi[a / 2] * w + xi[a % 2]) *             \
                                           tr_st<T>(wy * wx));                                 \
                        m = (a == 0 || v != v || v > m) ? (m != m ? m : v) : m;                \
                    }                                                                          \
                    best = (first || m != m || m > best) ? (best != best ? best : m) : best;   \
                    first = false;                                                             \
                }                                                                              \
            }                                                                                  \
            tr_put(y, j, best);                                                                \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_roi_align_grad_##dt(const T* gy, const long long* batch, const float* ay, \
                                          const float* ax, const float* count, T* gx,          \
                                          long long n, TR_ROI_ARGS) {                          \
        TR_GRID_STRIDE(j, n * c * h * w) {                                                     \
            long long k = j % w, i = (j / w) % h, ch = (j / (w * h)) % c, b = j / (w * h * c); \
            float acc = 0.0f;                                                                  \
            for (long long box = 0; box < r; ++box) {                                          \
                float cnt = count[box];                                                        \
                if (batch[box] != b || cnt == 0.0f) continue;                                  \
                const T* g = gy + (box * c + ch) * oh * ow;                                    \
                float part = 0.0f;                                                             \
                for (long long ph = 0; ph < oh; ++ph) {                                        \
                    float my = ay[(box * oh + ph) * h + i];                                    \
                    if (my == 0.0f) continue;                                                  \
                    float row = 0.0f;                                                          \
                    for (long long pw = 0; pw < ow; ++pw)                                      \
                        row += tr_get(g, ph * ow + pw) * ax[(box * ow + pw) * w + k];          \
                    part += my * row;                                                          \
                }                                                                              \
                acc = tr_st<T>(acc + tr_st<T>(part / cnt));                                    \
            }                                                                                  \
            tr_put(gx, j, acc);                                                                \
        }                                                                                      \
    }

// ---- Col2Im ----------------------------------------------------------------------------------

#define TR_COL2IM_GEOMETRY                                                                     \
    long long n, long long c, long long i0, long long i1, long long i2, long long k0,          \
        long long k1, long long k2, long long t0, long long t1, long long t2, long long d0,    \
        long long d1, long long d2, long long b0, long long b1, long long b2, long long o0,    \
        long long o1, long long o2
#define TR_COL2IM_ARRAYS                                                                       \
    const long long img[3] = {i0, i1, i2}, ker[3] = {k0, k1, k2}, st[3] = {t0, t1, t2};        \
    const long long dil[3] = {d0, d1, d2}, pb[3] = {b0, b1, b2}, win[3] = {o0, o1, o2};        \
    long long kk = k0 * k1 * k2, ll = o0 * o1 * o2, pp = i0 * i1 * i2;

#define TR_COL2IM(T, dt)                                                                       \
    TR_KERNEL void tr_col2im_##dt(const T* cols, T* y, TR_COL2IM_GEOMETRY) {                   \
        TR_COL2IM_ARRAYS                                                                       \
        TR_GRID_STRIDE(j, n * c * pp) {                                                        \
            long long pix = j % pp, nc = j / pp;                                               \
            long long pos[3] = {pix / (i1 * i2), (pix / i2) % i1, pix % i2};                   \
            float acc = 0.0f;                                                                  \
            for (long long tap = 0; tap < kk; ++tap) {                                         \
                long long kt[3] = {tap / (k1 * k2), (tap / k2) % k1, tap % k2};                \
                long long l = 0;                                                               \
                bool hit = true;                                                               \
                for (int a = 0; a < 3 && hit; ++a) {                                           \
                    long long at = pos[a] + pb[a] - kt[a] * dil[a];                            \
                    hit = at >= 0 && at % st[a] == 0 && at / st[a] < win[a];                   \
                    l = l * win[a] + (hit ? at / st[a] : 0);                                   \
                }                                                                              \
                if (hit) acc = tr_st<T>(acc + tr_get(cols, (nc * kk + tap) * ll + l));         \
            }                                                                                  \
            (void)img;                                                                         \
            (void)ker;                                                                         \
            tr_put(y, j, acc);                                                                 \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_col2im_grad_##dt(const T* gy, T* gcols, TR_COL2IM_GEOMETRY) {            \
        TR_COL2IM_ARRAYS                                                                       \
        TR_GRID_STRIDE(j, n * c * kk * ll) {                                                   \
            long long l = j % ll, tap = (j / ll) % kk, nc = j / (ll * kk);                     \
            long long kt[3] = {tap / (k1 * k2), (tap / k2) % k1, tap % k2};                    \
            long long lt[3] = {l / (o1 * o2), (l / o2) % o1, l % o2};                          \
            long long pix = 0;                                                                 \
            bool inside = true;                                                                \
            for (int a = 0; a < 3; ++a) {                                                      \
                long long at = lt[a] * st[a] + kt[a] * dil[a] - pb[a];                         \
                inside = inside && at >= 0 && at < img[a];                                     \
                pix = pix * img[a] + (inside ? at : 0);                                        \
            }                                                                                  \
            (void)ker;                                                                         \
            (void)win;                                                                         \
            tr_put(gcols, j, inside ? tr_get(gy, nc * pp + pix) : 0.0f);                       \
        }                                                                                      \
    }

// ---- MaxUnpool -------------------------------------------------------------------------------

TR_KERNEL void tr_max_unpool_winner(const long long* idx, long long* win, long long m,
                                    long long total) {
    TR_GRID_STRIDE(i, m) {
        long long j = idx[i] < 0 ? idx[i] + total : idx[i];
        if (j < 0 || j >= total) continue;
#if defined(__CUDACC__)
        atomicMax(win + j, i + 1);
#else
        if (win[j] < i + 1) win[j] = i + 1;
#endif
    }
}

#define TR_MAX_UNPOOL(U, bytes)                                                                \
    TR_KERNEL void tr_max_unpool_b##bytes(                                                     \
            const U* x, const long long* idx, const long long* win, U* y, long long m,         \
            long long total, long long f0, long long f1, long long f2, long long f3,           \
            long long f4, long long y0, long long y1, long long y2, long long y3,              \
            long long y4) {                                                                    \
        const long long f[5] = {f0, f1, f2, f3, f4}, ys[5] = {y0, y1, y2, y3, y4};             \
        TR_GRID_STRIDE(i, m) {                                                                 \
            long long j = idx[i] < 0 ? idx[i] + total : idx[i];                                \
            if (j < 0 || j >= total || win[j] != i + 1) continue;                              \
            long long rest = j, to = 0, scale = 1;                                             \
            for (int a = 4; a >= 0; --a) {                                                     \
                to += (rest % f[a]) * scale;                                                   \
                rest /= f[a];                                                                  \
                scale *= ys[a];                                                                \
            }                                                                                  \
            y[to] = x[i];                                                                      \
        }                                                                                      \
    }
