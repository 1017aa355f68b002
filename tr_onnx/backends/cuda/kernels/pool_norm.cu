// Pools, row normalisations and the data-movement kernels the LeNet / transformer training
// plans need besides the op families: MaxPool / AveragePool forward and backward (channels-
// last, padded channels), Softmax / LogSoftmax along the last axis, LayerNormalization and
// LayerNormGrad, Erf, reductions over one run of axes (ReduceSum / ReduceMean), batched MatMul,
// a broadcasting binary op, strided copies (Transpose, Slice, Concat pieces), Gather and
// GatherGrad. Storage fp32/fp16/bf16, compute fp32; every kernel a grid-stride loop over the
// elements it writes (one thread per output element or per row), so the host build (the
// tests) runs them as plain loops.
//
// Pools (2-D; a 1-D pool is H = 1). x is [N, H, W, cpx] and y [N, OH, OW, cpy] (channels-last,
// c logical channels, pad lanes written 0). The window: kernel (kh, kw), strides, dilations
// and the leading pads (ph, pw); a tap outside [0, H) x [0, W) reads -inf (max) or 0 (average),
// as the numpy kernels' padded workspace. The average's divisor counts the taps inside
// [lo, hi) per axis (the input, or with count_include_pad the input plus its explicit pads,
// never the ceil_mode overhang): lo_h, hi_h, lo_w, hi_w are passed by the binder.
// Backward: one thread per gx element sums its windows' shares tap by tap, in the numpy
// kernel's order (taps in scan order), so fp32 sums round as NumPy's.
#include "elementwise.cuh"

#if defined(__CUDACC__)
TR_HD float tr_neg_inf() { return __int_as_float(0xff800000); }
#else
TR_HD float tr_neg_inf() {
    unsigned u = 0xff800000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

#define TR_POOL_ARGS                                                                           \
    long long total, long long H, long long W, long long OH, long long OW, long long c,        \
        long long cpx, long long cpy, long long kh, long long kw, long long sh, long long sw,  \
        long long ph, long long pw, long long dh, long long dw

// the average pool's divisor at output (oh, ow): taps inside [lo, hi) per axis
TR_HD float tr_pool_count(long long oh, long long ow, long long kh, long long kw, long long sh,
                          long long sw, long long ph, long long pw, long long dh, long long dw,
                          long long lo_h, long long hi_h, long long lo_w, long long hi_w) {
    long long ch = 0, cw = 0;
    for (long long t = 0; t < kh; ++t) {
        long long p = oh * sh - ph + t * dh;
        ch += (p >= lo_h && p < hi_h) ? 1 : 0;
    }
    for (long long t = 0; t < kw; ++t) {
        long long p = ow * sw - pw + t * dw;
        cw += (p >= lo_w && p < hi_w) ? 1 : 0;
    }
    return (float)(ch * cw);
}

// the tap index of output (n, oh, ow, ch)'s window maximum: the first strictly greater value in
// scan order wins (tap 0 otherwise), padding reads -inf (MaxPoolGrad's argmax)
template <class T>
TR_HD long long tr_pool_argmax(const T* x, long long n, long long oh, long long ow, long long ch,
                               long long H, long long W, long long cpx, long long kh,
                               long long kw, long long sh, long long sw, long long ph,
                               long long pw, long long dh, long long dw) {
    float best = 0.0f;
    long long arg = 0;
    for (long long a = 0; a < kh; ++a) {
        for (long long b = 0; b < kw; ++b) {
            long long ih = oh * sh - ph + a * dh, iw = ow * sw - pw + b * dw;
            float v = (ih >= 0 && ih < H && iw >= 0 && iw < W)
                          ? tr_get(x, ((n * H + ih) * W + iw) * cpx + ch)
                          : tr_neg_inf();
            long long k = a * kw + b;
            if (k == 0 || v > best) {
                best = v;
                arg = k;
            }
        }
    }
    return arg;
}

// y = first-row-max-shifted softmax of one row of c elements (log: log-softmax)
template <class T>
TR_HD void tr_softmax_row(const T* x, T* y, long long c, int log_softmax) {
    float m = tr_get(x, 0);
    for (long long j = 1; j < c; ++j) {  // np.max: NaN propagates
        float v = tr_get(x, j);
        if (m == m && (v != v || v > m)) m = v;
    }
    float s = 0.0f;
    for (long long j = 0; j < c; ++j) s += expf(tr_get(x, j) - m);
    if (log_softmax) {
        float ls = logf(s);
        for (long long j = 0; j < c; ++j) tr_put(y, j, (tr_get(x, j) - m) - ls);
    } else {
        for (long long j = 0; j < c; ++j) tr_put(y, j, expf(tr_get(x, j) - m) / s);
    }
}

// mean and 1/sqrt(var + eps) of one row of m elements (the biased variance of x - mean)
template <class T>
TR_HD void tr_row_moments(const T* x, long long m, float eps, float* mean, float* inv) {
    double acc = 0.0;
    for (long long j = 0; j < m; ++j) acc += (double)tr_get(x, j);
    float mu = (float)(acc / (double)m);
    double sq = 0.0;
    for (long long j = 0; j < m; ++j) {
        float d = tr_get(x, j) - mu;
        sq += (double)d * (double)d;
    }
    float var = (float)(sq / (double)m);
    *mean = mu;
    *inv = 1.0f / sqrtf(var + eps);
}

TR_HD float tr_binop(int op, float a, float b) {
    switch (op) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        default: return a / b;
    }
}

// element j of an output of (collapsed) dims d[0..5] -> the offset sum idx_k * s[k]
TR_HD long long tr_strided_offset(long long j, const long long* d, const long long* s) {
    long long off = 0;
    for (int k = 5; k >= 0; --k) {
        long long i = j % d[k];
        j /= d[k];
        off += i * s[k];
    }
    return off;
}

#define TR_DIMS6 long long d0, long long d1, long long d2, long long d3, long long d4, long long d5
#define TR_STRIDES6(p) long long p##0, long long p##1, long long p##2, long long p##3, \
                       long long p##4, long long p##5

#define TR_POOL_NORM(T, dt)                                                                    \
    TR_KERNEL void tr_maxpool_fwd_##dt(const T* x, T* y, TR_POOL_ARGS) {                      \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long ch = j % cpy, r = j / cpy;                                               \
            long long ow = r % OW, oh = (r / OW) % OH, n = r / (OW * OH);                      \
            if (ch >= c) {                                                                     \
                tr_put(y, j, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            float best = 0.0f;                                                                 \
            for (long long a = 0; a < kh; ++a)                                                 \
                for (long long b = 0; b < kw; ++b) {                                           \
                    long long ih = oh * sh - ph + a * dh, iw = ow * sw - pw + b * dw;          \
                    float v = (ih >= 0 && ih < H && iw >= 0 && iw < W)                         \
                                  ? tr_get(x, ((n * H + ih) * W + iw) * cpx + ch)              \
                                  : tr_neg_inf();                                                 \
                    /* np.maximum: NaN in either operand wins */                               \
                    best = (a == 0 && b == 0) ? v : (best != best ? best                       \
                                                     : (v != v || v > best ? v : best));       \
                }                                                                              \
            tr_put(y, j, best);                                                                \
        }                                                                                      \
    }                                                                                          \
    /* gx (n, ih, iw, ch): sum over taps k (scan order) of gy at the output whose tap k reads  \
       (ih, iw), where that output's argmax is k; total = gx's physical elements */          \
    TR_KERNEL void tr_maxpool_bwd_##dt(const T* gy, const T* x, T* gx, TR_POOL_ARGS) {        \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long ch = j % cpx, r = j / cpx;                                               \
            long long iw = r % W, ih = (r / W) % H, n = r / (W * H);                           \
            float acc = 0.0f;                                                                  \
            for (long long a = 0; ch < c && a < kh; ++a)                                       \
                for (long long b = 0; b < kw; ++b) {                                           \
                    long long th = ih + ph - a * dh, tw = iw + pw - b * dw;                    \
                    if (th < 0 || tw < 0 || th % sh || tw % sw) continue;                      \
                    long long oh = th / sh, ow = tw / sw;                                      \
                    if (oh >= OH || ow >= OW) continue;                                        \
                    if (tr_pool_argmax(x, n, oh, ow, ch, H, W, cpx, kh, kw, sh, sw, ph, pw,   \
                                       dh, dw) != a * kw + b) continue;                        \
                    acc += tr_get(gy, ((n * OH + oh) * OW + ow) * cpy + ch);                   \
                }                                                                              \
            tr_put(gx, j, acc);                                                                \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_avgpool_fwd_##dt(const T* x, T* y, TR_POOL_ARGS, long long lo_h,        \
                                       long long hi_h, long long lo_w, long long hi_w) {      \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long ch = j % cpy, r = j / cpy;                                               \
            long long ow = r % OW, oh = (r / OW) % OH, n = r / (OW * OH);                      \
            if (ch >= c) {                                                                     \
                tr_put(y, j, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            float acc = 0.0f;                                                                  \
            for (long long a = 0; a < kh; ++a)                                                 \
                for (long long b = 0; b < kw; ++b) {                                           \
                    long long ih = oh * sh - ph + a * dh, iw = ow * sw - pw + b * dw;          \
                    float v = (ih >= 0 && ih < H && iw >= 0 && iw < W)                         \
                                  ? tr_get(x, ((n * H + ih) * W + iw) * cpx + ch)              \
                                  : 0.0f;                                                      \
                    acc = (a == 0 && b == 0) ? v : acc + v;                                    \
                }                                                                              \
            tr_put(y, j, acc / tr_pool_count(oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo_h,     \
                                             hi_h, lo_w, hi_w));                               \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_avgpool_bwd_##dt(const T* gy, T* gx, TR_POOL_ARGS, long long lo_h,      \
                                       long long hi_h, long long lo_w, long long hi_w) {      \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long ch = j % cpx, r = j / cpx;                                               \
            long long iw = r % W, ih = (r / W) % H, n = r / (W * H);                           \
            float acc = 0.0f;                                                                  \
            for (long long a = 0; ch < c && a < kh; ++a)                                       \
                for (long long b = 0; b < kw; ++b) {                                           \
                    long long th = ih + ph - a * dh, tw = iw + pw - b * dw;                    \
                    if (th < 0 || tw < 0 || th % sh || tw % sw) continue;                      \
                    long long oh = th / sh, ow = tw / sw;                                      \
                    if (oh >= OH || ow >= OW) continue;                                        \
                    acc += tr_get(gy, ((n * OH + oh) * OW + ow) * cpy + ch) /                  \
                           tr_pool_count(oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo_h, hi_h,   \
                                         lo_w, hi_w);                                          \
                }                                                                              \
            tr_put(gx, j, acc);                                                                \
        }                                                                                      \
    }                                                                                          \
    /* rows of c elements, row stride ld (lanes [c, ld) written 0) */                         \
    TR_KERNEL void tr_softmax_##dt(const T* x, T* y, long long rows, long long c,             \
                                   long long ld, int log_softmax) {                            \
        TR_GRID_STRIDE(r, rows) {                                                              \
            tr_softmax_row(x + r * ld, y + r * ld, c, log_softmax);                            \
            for (long long j = c; j < ld; ++j) tr_put(y, r * ld + j, 0.0f);                    \
        }                                                                                      \
    }                                                                                          \
    /* LayerNormalization over rows of m: y = (x - mean) * inv * scale (+ bias); mean / inv   \
       (float32, one per row) written when not null */                                        \
    TR_KERNEL void tr_layernorm_fwd_##dt(const T* x, const T* scale, const T* bias, T* y,     \
                                         float* mean_out, float* inv_out, long long rows,     \
                                         long long m, float eps) {                             \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            float mu, inv;                                                                     \
            tr_row_moments(xr, m, eps, &mu, &inv);                                             \
            if (mean_out) mean_out[r] = mu;                                                    \
            if (inv_out) inv_out[r] = inv;                                                     \
            for (long long k = 0; k < m; ++k) {                                                \
                float v = (tr_get(xr, k) - mu) * inv * tr_get(scale, k);                       \
                tr_put(y, r * m + k, bias ? v + tr_get(bias, k) : v);                          \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* LayerNormGrad, gx per row: xhat = (x - mean) inv, g = gy scale,                        \
       gx = inv (g - mean(g) - xhat mean((g - mean(g)) xhat)); the row's mean / inv into       \
       mean_out / inv_out (float32) for tr_layernorm_bwd_params */                            \
    TR_KERNEL void tr_layernorm_bwd_dx_##dt(const T* gy, const T* x, const T* scale, T* gx,   \
                                            float* mean_out, float* inv_out, long long rows,  \
                                            long long m, float eps) {                          \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            const T* gr = gy + r * m;                                                          \
            float mu, inv;                                                                     \
            tr_row_moments(xr, m, eps, &mu, &inv);                                             \
            mean_out[r] = mu;                                                                  \
            inv_out[r] = inv;                                                                  \
            if (!gx) continue;                                                                 \
            double sg = 0.0;                                                                   \
            for (long long k = 0; k < m; ++k) sg += (double)(tr_get(gr, k) * tr_get(scale, k)); \
            float mg = (float)(sg / (double)m);                                                \
            double sgx = 0.0;                                                                  \
            for (long long k = 0; k < m; ++k) {                                                \
                float g = tr_get(gr, k) * tr_get(scale, k) - mg;                               \
                sgx += (double)(g * ((tr_get(xr, k) - mu) * inv));                             \
            }                                                                                  \
            float mgx = (float)(sgx / (double)m);                                              \
            for (long long k = 0; k < m; ++k) {                                                \
                float g = tr_get(gr, k) * tr_get(scale, k) - mg;                               \
                float xh = (tr_get(xr, k) - mu) * inv;                                         \
                tr_put(gx, r * m + k, (g - xh * mgx) * inv);                                   \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* gscale[k] = sum_r gy xhat, gbias[k] = sum_r gy (either may be null), from the rows'    \
       mean / inv of tr_layernorm_bwd_dx */                                                    \
    TR_KERNEL void tr_layernorm_bwd_params_##dt(const T* gy, const T* x, const float* mean,   \
                                                const float* inv, T* gscale, T* gbias,         \
                                                long long rows, long long m) {                 \
        TR_GRID_STRIDE(k, m) {                                                                 \
            double ss = 0.0, sb = 0.0;                                                         \
            for (long long r = 0; r < rows; ++r) {                                             \
                float g = tr_get(gy, r * m + k);                                               \
                ss += (double)(g * ((tr_get(x, r * m + k) - mean[r]) * inv[r]));               \
                sb += (double)g;                                                               \
            }                                                                                  \
            if (gscale) tr_put(gscale, k, (float)ss);                                          \
            if (gbias) tr_put(gbias, k, (float)sb);                                            \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_erf_##dt(const T* x, T* y, long long n) {                               \
        TR_GRID_STRIDE(i, n) tr_put(y, i, erff(tr_get(x, i)));                                 \
    }                                                                                          \
    /* y[o, i] = sum_k x[o, k, i] (mean: / r) over x as [outer, r, inner] */                 \
    TR_KERNEL void tr_reduce_mid_##dt(const T* x, T* y, long long outer, long long r,         \
                                      long long inner, int mean) {                             \
        TR_GRID_STRIDE(j, outer * inner) {                                                     \
            long long o = j / inner, i = j % inner;                                            \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < r; ++k) acc += (double)tr_get(x, (o * r + k) * inner + i); \
            tr_put(y, j, mean ? (float)(acc / (double)r) : (float)acc);                        \
        }                                                                                      \
    }                                                                                          \
    /* y[b, i, j] = sum_k a[b, i, k] b[b, k, j]: a batch stride of 0 broadcasts an operand;   \
       (rs, cs) the row and column strides of each operand (a transposed one swaps them) */   \
    TR_KERNEL void tr_matmul_##dt(const T* a, const T* b, T* y, long long batch, long long M,  \
                                  long long K, long long N, long long abs_, long long ars,     \
                                  long long acs, long long bbs, long long brs,                 \
                                  long long bcs) {                                             \
        TR_GRID_STRIDE(j, batch * M * N) {                                                     \
            long long col = j % N, row = (j / N) % M, bt = j / (M * N);                        \
            const T* ap = a + bt * abs_ + row * ars;                                           \
            const T* bp = b + bt * bbs + col * bcs;                                            \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < K; ++k)                                                  \
                acc += (double)tr_get(ap, k * acs) * (double)tr_get(bp, k * brs);              \
            tr_put(y, j, (float)acc);                                                          \
        }                                                                                      \
    }                                                                                          \
    /* y = a op b (0 add, 1 sub, 2 mul, 3 div) broadcast through collapsed dims d0..d5 and    \
       each operand's strides (0 on a broadcast axis) */                                       \
    TR_KERNEL void tr_bcast_binary_##dt(const T* a, const T* b, T* y, long long n, int op,    \
                                        TR_DIMS6, TR_STRIDES6(as), TR_STRIDES6(bs)) {          \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long sa[6] = {as0, as1, as2, as3, as4, as5};                                \
        const long long sb[6] = {bs0, bs1, bs2, bs3, bs4, bs5};                                \
        TR_GRID_STRIDE(j, n)                                                                   \
            tr_put(y, j, tr_binop(op, tr_get(a, tr_strided_offset(j, d, sa)),                  \
                                  tr_get(b, tr_strided_offset(j, d, sb))));                    \
    }                                                                                          \
    /* GatherGrad: gx[o, k, i] = sum over the indices t (in order) equal to k of              \
       gy[o, t, i]; negative indices count from the end; every gx element written */          \
    TR_KERNEL void tr_gather_grad_##dt(const T* gy, const long long* idx, T* gx, long long n,  \
                                       long long nidx, long long dim, long long inner) {       \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, k = (j / inner) % dim, o = j / (inner * dim);             \
            float acc = 0.0f;                                                                  \
            for (long long t = 0; t < nidx; ++t) {                                             \
                long long v = idx[t] < 0 ? idx[t] + dim : idx[t];                              \
                if (v == k) acc += tr_get(gy, (o * nidx + t) * inner + i);                     \
            }                                                                                  \
            tr_put(gx, j, acc);                                                                \
        }                                                                                      \
    }

// Bit-pattern movers, by element size: a strided copy (Transpose, Slice, Concat into a
// strided view of its output: y[yo + off_y(j)] = x[xo + off_x(j)]) and Gather along one axis
// (x as [outer, dim, inner], int64 indices, negative ones from the end).
#define TR_MOVE(U, bytes)                                                                      \
    TR_KERNEL void tr_strided_copy_b##bytes(const U* x, U* y, long long n, long long xo,      \
                                            long long yo, TR_DIMS6, TR_STRIDES6(xs),           \
                                            TR_STRIDES6(ys)) {                                 \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long sx[6] = {xs0, xs1, xs2, xs3, xs4, xs5};                                \
        const long long sy[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        TR_GRID_STRIDE(j, n) y[yo + tr_strided_offset(j, d, sy)] = x[xo + tr_strided_offset(j, d, sx)]; \
    }                                                                                          \
    TR_KERNEL void tr_gather_b##bytes(const U* x, const long long* idx, U* y, long long n,    \
                                      long long nidx, long long dim, long long inner) {        \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, t = (j / inner) % nidx, o = j / (inner * nidx);           \
            long long v = idx[t] < 0 ? idx[t] + dim : idx[t];                                  \
            y[j] = x[(o * dim + v) * inner + i];                                               \
        }                                                                                      \
    }
TR_MOVE(unsigned char, 1)
TR_MOVE(unsigned short, 2)
TR_MOVE(unsigned int, 4)
TR_MOVE(unsigned long long, 8)
