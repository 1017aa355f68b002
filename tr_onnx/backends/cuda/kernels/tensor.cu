// Data movement (tr_onnx/ops/tensor.py): kernels that copy or zero elements without arithmetic,
// the scans (CumSum, CumProd and CumProdGrad), and the fills of plan-time values.
// The bit-pattern ones are instantiated per element size (_b<bytes>, U an unsigned type of
// that size) and serve every storage type; the others per storage type (_<dt>; the scans
// also _i64 / _i32, accumulated in long long).
// tr_strided_copy_b<bytes>(x, y, n, xo, yo, d0..d5, xs0..xs5, ys0..ys5)
//     y[yo + off_y(j)] = x[xo + off_x(j)] over an output of collapsed dims d (strided.cuh):
//     Transpose, Slice, Concat into a strided view of its output, Split, SliceGrad, Expand and
//     Tile (stride 0 on the broadcast / repeat axes), DepthToSpace, SpaceToDepth.
// tr_pad_b<bytes>(x, value, y, n, fill, mode, d0..d5, xs, ys, lo0..lo5, c0..c5, k0..k5)
//     Pad over the output's dims d (rank left-padded to six): along axis a, output index o
//     reads input index c[a] + tr_pad_source(o - lo[a], k[a], mode) (c: what negative pads
//     crop at the front, k: the input elements kept); mode 0 constant (outside: value[0], or
//     the bits ``fill`` when value is null), 1 reflect, 2 edge, 3 wrap.
// tr_pad_grad_<dt>(gy, gx, n, mode, d0..d5, gys, gxs, lo0..lo5, c0..c5, k0..k5, o0..o5)
//     PadGrad over gx's dims d: gx[s] = the fp32 sum of gy over every output position o
//     (gy's dims o) that Pad read from s (0 where the forward cropped s).
// tr_trilu_b<bytes>(x, y, n, cols, k, upper, d0..d5, xs, ys, ms)
//     Trilu: y = x where the element's column - row >= k (upper) or <= k (lower), else 0;
//     ms walks the [rows, cols] matrix (0 on batch axes): row, col = m / cols, m % cols.
// tr_cumsum_<dt>(x, y, lines, len, x_axis, y_axis, exclusive, reverse, d0..d5, xs, ys)
// tr_cumprod_<dt>(...same)
//     One thread per line along the axis (line starts: collapsed dims d, strides xs / ys);
//     the running sum / product in fp32 (long long for integers), rounded at each store.
// tr_cumprod_grad_<dt>(gy, x, gx, n, len, axis strides gy/x/gx, exclusive, reverse, d, gys,
//                      xs, gxs)
//     CumProd's gradient, one thread per element i of a line (d over the element's line
//     start and index, the axis last): gx_i = P_i * sum_{j >= i+e} gy_j prod_{i<k<=j-e} x_k,
//     P_i the product of the elements before i (reverse: positions counted from the end).
// tr_fill_b<bytes>(y, n, bits)
//     y[i] = bits (ConstantOfShape, uniform plan-time values).
// tr_put_b<bytes>(y, first, count, v0..v7)
//     y[first + i] = v_i for i < count <= 8 (small plan-time values: Shape, Size, Constant).
// tr_eye_b<bytes>(y, n, cols, k, one)
//     EyeLike: y[r, c] = one if c - r == k else 0.
// tr_range_<rt>(y, n, start, delta)
//     Range: y[i] = start + i * delta, in double for float32 (as NumPy's float64 then cast),
//     in long long for int64 / int32.
// tr_zero_lanes_b<bytes>(y, rows, c, cp)
//     zero the padded lanes [c, cp) of every row of a padded buffer of rows * cp elements;
//     c = 0 zeroes everything (ZeroFill, and the 4-byte flags of the training step).
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "strided.cuh"

#define TR_ARRAY6(p) {p##0, p##1, p##2, p##3, p##4, p##5}

#define TR_STRIDED_COPY(U, bytes)                                                              \
    TR_KERNEL void tr_strided_copy_b##bytes(const U* x, U* y, long long n, long long xo,      \
                                            long long yo, TR_DIMS6, TR_STRIDES6(xs),           \
                                            TR_STRIDES6(ys)) {                                 \
        const long long d[6] = TR_ARRAY6(d), sx[6] = TR_ARRAY6(xs), sy[6] = TR_ARRAY6(ys);    \
        TR_GRID_STRIDE(j, n) {                                                                 \
            y[yo + tr_strided_offset(j, d, sy)] = x[xo + tr_strided_offset(j, d, sx)];         \
        }                                                                                      \
    }

#define TR_ZERO_LANES(U, bytes)                                                                \
    TR_KERNEL void tr_zero_lanes_b##bytes(U* y, long long rows, long long c, long long cp) {  \
        TR_GRID_STRIDE(j, rows * cp) if (j % cp >= c) y[j] = 0;                               \
    }


// Pad's source along one axis: t counts from the first kept input element, n are kept; the
// index in [0, n) read, or -1 for the constant fill (tr_onnx/ops/tensor.py _pad_source)
TR_HD long long tr_pad_source(long long t, long long n, int mode) {
    if (t >= 0 && t < n) return t;
    if (mode == 0) return -1;
    if (mode == 2) return t < 0 ? 0 : n - 1;
    if (mode == 3) return ((t % n) + n) % n;
    if (n == 1) return 0;
    long long period = 2 * (n - 1);
    t = ((t % period) + period) % period;
    return t >= n ? period - t : t;
}

#define TR_PAD_AXES long long lo0, long long lo1, long long lo2, long long lo3, long long lo4, \
                    long long lo5, long long c0, long long c1, long long c2, long long c3,     \
                    long long c4, long long c5, long long k0, long long k1, long long k2,     \
                    long long k3, long long k4, long long k5
#define TR_PAD_ARRAYS                                                                          \
    const long long d[6] = TR_ARRAY6(d), lo[6] = TR_ARRAY6(lo), crop[6] = TR_ARRAY6(c),       \
                    kept[6] = TR_ARRAY6(k);

#define TR_PAD_MOVE(U, bytes)                                                                  \
    TR_KERNEL void tr_pad_b##bytes(const U* x, const U* value, U* y, long long n,             \
                                   long long fill, int mode, TR_DIMS6, TR_STRIDES6(xs),        \
                                   TR_STRIDES6(ys), TR_PAD_AXES) {                             \
        TR_PAD_ARRAYS                                                                          \
        const long long sx[6] = TR_ARRAY6(xs), sy[6] = TR_ARRAY6(ys);                          \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long rest = j, src = 0, dst = 0;                                              \
            bool inside = true;                                                                \
            for (int a = 5; a >= 0; --a) {                                                     \
                long long o = rest % d[a];                                                     \
                rest /= d[a];                                                                  \
                long long s = tr_pad_source(o - lo[a], kept[a], mode);                         \
                inside = inside && s >= 0;                                                     \
                src += (crop[a] + s) * sx[a];                                                  \
                dst += o * sy[a];                                                              \
            }                                                                                  \
            y[dst] = inside ? x[src] : (value ? value[0] : (U)fill);                           \
        }                                                                                      \
    }

#define TR_PAD_GRAD(T, dt)                                                                     \
    TR_KERNEL void tr_pad_grad_##dt(const T* gy, T* gx, long long n, int mode, TR_DIMS6,      \
                                    TR_STRIDES6(gys), TR_STRIDES6(gxs), TR_PAD_AXES,           \
                                    long long o0, long long o1, long long o2, long long o3,    \
                                    long long o4, long long o5) {                              \
        TR_PAD_ARRAYS                                                                          \
        const long long sgy[6] = TR_ARRAY6(gys), sgx[6] = TR_ARRAY6(gxs),                      \
                        out[6] = TR_ARRAY6(o);                                                 \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long rest = j, dst = 0, r[6], m[6], total = 1;                                \
            bool kept_here = true;                                                             \
            for (int a = 5; a >= 0; --a) {                                                     \
                long long s = rest % d[a];                                                     \
                rest /= d[a];                                                                  \
                dst += s * sgx[a];                                                             \
                r[a] = s - crop[a];                                                            \
                kept_here = kept_here && r[a] >= 0 && r[a] < kept[a];                          \
                /* candidates: the interior position, then (not constant) every border one */ \
                m[a] = mode == 0 ? 1 : 1 + out[a] - kept[a];                                   \
                total *= m[a];                                                                 \
            }                                                                                  \
            float acc = 0.0f;                                                                  \
            for (long long p = 0; kept_here && p < total; ++p) {                               \
                long long q = p, at = 0;                                                       \
                bool hit = true;                                                               \
                for (int a = 5; a >= 0 && hit; --a) {                                          \
                    long long i = q % m[a];                                                    \
                    q /= m[a];                                                                 \
                    long long b = i - 1;                                                       \
                    long long o = i == 0 ? lo[a] + r[a] : b < lo[a] ? b : kept[a] + b;         \
                    hit = i == 0 || tr_pad_source(o - lo[a], kept[a], mode) == r[a];           \
                    at += o * sgy[a];                                                          \
                }                                                                              \
                if (hit) acc += tr_get(gy, at);                                                \
            }                                                                                  \
            tr_put(gx, dst, acc);                                                              \
        }                                                                                      \
    }

#define TR_TRILU(U, bytes)                                                                     \
    TR_KERNEL void tr_trilu_b##bytes(const U* x, U* y, long long n, long long cols,           \
                                     long long k, int upper, TR_DIMS6, TR_STRIDES6(xs),        \
                                     TR_STRIDES6(ys), TR_STRIDES6(ms)) {                       \
        const long long d[6] = TR_ARRAY6(d), sx[6] = TR_ARRAY6(xs), sy[6] = TR_ARRAY6(ys),    \
                        sm[6] = TR_ARRAY6(ms);                                                 \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long at = tr_strided_offset(j, d, sm);                                        \
            long long diff = at % cols - at / cols;                                            \
            bool keep = upper ? diff >= k : diff <= k;                                         \
            y[tr_strided_offset(j, d, sy)] = keep ? x[tr_strided_offset(j, d, sx)] : (U)0;     \
        }                                                                                      \
    }

// The scans' loads and stores: fp32 for the storage types, long long for the integers
TR_HD long long tr_scan_get(const long long* p, long long i) { return p[i]; }
TR_HD long long tr_scan_get(const int* p, long long i) { return p[i]; }
template <class T> TR_HD float tr_scan_get(const T* p, long long i) { return tr_get(p, i); }
TR_HD void tr_scan_put(long long* p, long long i, long long v) { p[i] = v; }
TR_HD void tr_scan_put(int* p, long long i, long long v) { p[i] = (int)v; }
template <class T> TR_HD void tr_scan_put(T* p, long long i, float v) { tr_put(p, i, v); }

#define TR_SCAN(T, dt, name, identity, OP)                                                     \
    TR_KERNEL void tr_##name##_##dt(const T* x, T* y, long long lines, long long len,         \
                                    long long x_axis, long long y_axis, int exclusive,         \
                                    int reverse, TR_DIMS6, TR_STRIDES6(xs), TR_STRIDES6(ys)) { \
        const long long d[6] = TR_ARRAY6(d), sx[6] = TR_ARRAY6(xs), sy[6] = TR_ARRAY6(ys);    \
        TR_GRID_STRIDE(line, lines) {                                                          \
            const T* xl = x + tr_strided_offset(line, d, sx);                                  \
            T* yl = y + tr_strided_offset(line, d, sy);                                        \
            decltype(tr_scan_get(x, 0)) acc = identity;                                        \
            for (long long t = 0; t < len; ++t) {                                              \
                long long i = reverse ? len - 1 - t : t;                                       \
                decltype(acc) v = tr_scan_get(xl, i * x_axis);                                 \
                if (exclusive) tr_scan_put(yl, i * y_axis, acc);                               \
                acc = OP;                                                                      \
                if (!exclusive) tr_scan_put(yl, i * y_axis, acc);                              \
            }                                                                                  \
        }                                                                                      \
    }
#define TR_CUMSUM(T, dt) TR_SCAN(T, dt, cumsum, 0, acc + v)
#define TR_CUMPROD(T, dt) TR_SCAN(T, dt, cumprod, 1, acc * v)

#define TR_CUMPROD_GRAD(T, dt)                                                                 \
    TR_KERNEL void tr_cumprod_grad_##dt(const T* gy, const T* x, T* gx, long long n,          \
                                        long long len, long long gy_axis, long long x_axis,    \
                                        long long gx_axis, int exclusive, int reverse,         \
                                        TR_DIMS6, TR_STRIDES6(gys), TR_STRIDES6(xs),           \
                                        TR_STRIDES6(gxs)) {                                    \
        const long long d[6] = TR_ARRAY6(d), sgy[6] = TR_ARRAY6(gys), sx[6] = TR_ARRAY6(xs),  \
                        sgx[6] = TR_ARRAY6(gxs);                                               \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long line = j / len, i = j % len, e = exclusive;                              \
            const T* gyl = gy + tr_strided_offset(line, d, sgy);                               \
            const T* xl = x + tr_strided_offset(line, d, sx);                                  \
            /* element t of the scan order (reversed: counted from the end) */                 \
            long long step_gy = reverse ? -gy_axis : gy_axis, step_x = reverse ? -x_axis :     \
                                                                             x_axis;           \
            if (reverse) {                                                                     \
                gyl += (len - 1) * gy_axis;                                                    \
                xl += (len - 1) * x_axis;                                                      \
            }                                                                                  \
            float before = 1.0f, sum = 0.0f, q = 1.0f;                                         \
            for (long long k = 0; k < i; ++k) before *= tr_get(xl, k * step_x);               \
            for (long long t = i + e; t < len; ++t) {                                          \
                if (t > i + e) q *= tr_get(xl, (t - e) * step_x);                              \
                sum += tr_get(gyl, t * step_gy) * q;                                           \
            }                                                                                  \
            long long at = tr_strided_offset(line, d, sgx) +                                   \
                           (reverse ? len - 1 - i : i) * gx_axis;                              \
            tr_put(gx, at, i + e < len ? before * sum : 0.0f);                                 \
        }                                                                                      \
    }

#define TR_FILL(U, bytes)                                                                      \
    TR_KERNEL void tr_fill_b##bytes(U* y, long long n, long long bits) {                      \
        TR_GRID_STRIDE(i, n) y[i] = (U)bits;                                                   \
    }

#define TR_PUT(U, bytes)                                                                       \
    TR_KERNEL void tr_put_b##bytes(U* y, long long first, long long count, long long v0,      \
                                   long long v1, long long v2, long long v3, long long v4,     \
                                   long long v5, long long v6, long long v7) {                 \
        const long long v[8] = {v0, v1, v2, v3, v4, v5, v6, v7};                               \
        TR_GRID_STRIDE(i, count) y[first + i] = (U)v[i];                                       \
    }

#define TR_EYE(U, bytes)                                                                       \
    TR_KERNEL void tr_eye_b##bytes(U* y, long long n, long long cols, long long k,            \
                                   long long one) {                                            \
        TR_GRID_STRIDE(i, n) y[i] = (i % cols - i / cols == k) ? (U)one : (U)0;               \
    }

#define TR_RANGE(T, rt, W)                                                                     \
    TR_KERNEL void tr_range_##rt(T* y, long long n, W start, W delta) {                       \
        TR_GRID_STRIDE(i, n) y[i] = (T)(start + (W)i * delta);                                 \
    }
