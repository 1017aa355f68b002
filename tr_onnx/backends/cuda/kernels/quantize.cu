// Quantization (tr_onnx/ops/quantize.py): QuantizeLinear, DequantizeLinear, their gradients
// QuantizeLinearGrad / DequantizeLinearGrad, and DynamicQuantizeLinear, in NumPy's float32
// arithmetic operation by operation (round half to even: rintf, as np.rint).
//
// x is compact or channels-last ([N, *S, Cp], pad lanes c >= C written 0); a scale / zero point
// covers x per tensor, per axis or per block (QuantParam in ops/quantize.py), and the
// parameter of element i (physical order) is, with a = (i / inner) % len the physical index
// along the quantization axis, o = i / (inner len), r = i % inner:
//     mode 0 (tensor): 0      mode 1 (axis): a      mode 2 (block): (o blocks + a / bs) inner + r
// (TrQuantAxis; blocked x is compact). zero points may be null (none). The gradients index
// the output gx; gy and x may sit in the other layout (a gradient from a compact op reaching
// a channels-last x): map 0 same layout as gx, 1 compact while gx is channels-last, 2
// channels-last while gx is compact, with (mc, ms, mcp) the channels-last side's C, spatial
// size and Cp (tr_quant_at).
// tr_quantize_<dt>_<q>(x, scale, zp, y, n, axis..., lo, hi)   (scale in x's type <dt>)
//     y = clip(rint(x / scale) + zp, lo, hi), x / scale rounded to <dt>
// tr_dequantize_<q>_<dt>(x, scale, zp, y, n, axis...)   y = (x - zp) * scale, scale in y's type
// tr_quantize_grad_<dt>_<q>(gy, x, scale, zp, gx, n, axis..., lo, hi, gy_map, x_map, mc, ms, mcp)
//     gx = gy / scale where rint(x * (1 / scale)) + zp is in [lo, hi], else 0 (times the mask),
//     1 / scale and its product with x rounded to <dt>
// tr_dequantize_grad_<dt>(gy, scale, gx, n, axis..., gy_map, mc, ms, mcp)   gx = gy * scale
// The scale gradients, one block per scale (fixed order, double sums, then float32; NumPy sums
// float32 pairwise, so these differ from it by the rounding of its sum):
// tr_quantize_grad_scale(gx, x, scale, gscale, params, n, axis..., x_map, mc, ms, mcp)
//     (float32 gx, x)
//     gscale[p] = sum over p's elements of -((gx * x) / scale)   (gx: the QuantizeLinearGrad's)
// tr_dequantize_grad_scale_<q>(gy, x, zp, gscale, params, n, axis..., gy_map, x_map, mc, ms,
//                              mcp)
//     gscale[p] = sum over p's elements of (x - zp) * gy
// DynamicQuantizeLinear (float32 x, uint8 y), as onnx.reference's float32 formulas:
// tr_dynamic_quantize_range(x, n, scale, zp)   one block: the range (with 0), scale and zp
// tr_dynamic_quantize(x, y, n, scale, zp)      y = clip(rint(x / scale) + zp, 0, 255)
// The instantiations (TR_QUANTIZE(T, dt, Q, q), ... lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "layout.cuh"

// the quantized types by name (unsigned char is bool's in the kernels' signatures)
typedef signed char tr_i8;
typedef unsigned char tr_u8;
typedef short tr_i16;
typedef unsigned short tr_u16;

// How parameters line up with x's physical elements, and which lanes are channel padding.
struct TrQuantAxis {
    int mode;
    long long inner, len, bs, blocks, cp, c;
};
TR_HD TrQuantAxis tr_quant_axis(int mode, long long inner, long long len, long long bs,
                                long long blocks, long long cp, long long c) {
    TrQuantAxis q;
    q.mode = mode;
    q.inner = inner;
    q.len = len;
    q.bs = bs;
    q.blocks = blocks;
    q.cp = cp;
    q.c = c;
    return q;
}
TR_HD bool tr_quant_pad(const TrQuantAxis& q, long long i) { return i % q.cp >= q.c; }
TR_HD long long tr_quant_param(const TrQuantAxis& q, long long i) {
    if (q.mode == 0) return 0;
    long long a = (i / q.inner) % q.len;
    if (q.mode == 1) return a;
    long long o = i / (q.inner * q.len);
    return (o * q.blocks + a / q.bs) * q.inner + i % q.inner;
}
// element j of the elements parameter p covers (count: tr_quant_count), as a physical index
TR_HD long long tr_quant_count(const TrQuantAxis& q, long long p, long long n) {
    if (q.mode == 0) return n;
    if (q.mode == 1) return n / q.len;
    long long b = (p / q.inner) % q.blocks;
    return q.len - b * q.bs < q.bs ? q.len - b * q.bs : q.bs;
}
TR_HD long long tr_quant_element(const TrQuantAxis& q, long long p, long long j) {
    if (q.mode == 0) return j;
    if (q.mode == 1) return ((j / q.inner) * q.len + p) * q.inner + j % q.inner;
    long long r = p % q.inner, b = (p / q.inner) % q.blocks, o = p / (q.inner * q.blocks);
    return (o * q.len + b * q.bs + j) * q.inner + r;
}
#define TR_QUANT_AXIS_ARGS                                                                     \
    int mode, long long inner, long long len, long long bs, long long blocks, long long cp,    \
        long long c
#define TR_QUANT_AXIS tr_quant_axis(mode, inner, len, bs, blocks, cp, c)

// the index in an operand of gx's element i, by the operand's map (see the top)
TR_HD long long tr_quant_at(int map, long long i, long long c, long long s, long long cp) {
    return map == 0 ? i : (map == 1 ? tr_nhwc_to_nchw(i, c, s, cp) : tr_nchw_to_nhwc(i, c, s, cp));
}
#define TR_QUANT_MAP_ARGS long long mc, long long ms, long long mcp

// round half to even, add the zero point, clip as np.clip (NaN stays NaN)
TR_HD float tr_quantize_value(float q, float zp, float lo, float hi) {
    return tr_min_nan(tr_max_nan(rintf(q) + zp, lo), hi);
}
template <class Q> TR_HD float tr_zero_point(const Q* zp, long long p) {
    return zp ? (float)zp[p] : 0.0f;
}

// v rounded to T (x / scale is computed in the scale's type, which is x's: NumPy's half
// division rounds the float32 quotient, the correctly rounded one, to half)
template <class T> TR_HD float tr_round_as(const T*, float v) {
    T r;
    tr_from_float(v, &r);
    return tr_to_float(r);
}

#define TR_QUANTIZE(T, dt, Q, q)                                                               \
    TR_KERNEL void tr_quantize_##dt##_##q(const T* x, const T* scale, const Q* zp, Q* y,       \
                                          long long n, TR_QUANT_AXIS_ARGS, float lo,           \
                                          float hi) {                                          \
        TrQuantAxis ax = TR_QUANT_AXIS;                                                        \
        TR_GRID_STRIDE(i, n) {                                                                 \
            if (tr_quant_pad(ax, i)) {                                                         \
                y[i] = (Q)0;                                                                   \
                continue;                                                                      \
            }                                                                                  \
            long long p = tr_quant_param(ax, i);                                               \
            float v = tr_round_as(x, tr_get(x, i) / tr_get(scale, p));                         \
            y[i] = (Q)tr_quantize_value(v, tr_zero_point(zp, p), lo, hi);                      \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_quantize_grad_##dt##_##q(const T* gy, const T* x, const T* scale,        \
                                               const Q* zp, T* gx, long long n,                \
                                               TR_QUANT_AXIS_ARGS, float lo, float hi,         \
                                               int gy_map, int x_map, TR_QUANT_MAP_ARGS) {     \
        TrQuantAxis ax = TR_QUANT_AXIS;                                                        \
        TR_GRID_STRIDE(i, n) {                                                                 \
            if (tr_quant_pad(ax, i)) {                                                         \
                tr_put(gx, i, 0.0f);                                                           \
                continue;                                                                      \
            }                                                                                  \
            long long p = tr_quant_param(ax, i);                                               \
            float s = tr_get(scale, p), inv = tr_round_as(x, 1.0f / s);                        \
            float xi = tr_get(x, tr_quant_at(x_map, i, mc, ms, mcp));                          \
            float v = rintf(tr_round_as(x, xi * inv)) + tr_zero_point(zp, p);                  \
            float inside = v >= lo && v <= hi ? 1.0f : 0.0f;                                   \
            tr_put(gx, i, tr_get(gy, tr_quant_at(gy_map, i, mc, ms, mcp)) / s * inside);       \
        }                                                                                      \
    }

#define TR_DEQUANTIZE(Q, q, T, dt)                                                             \
    TR_KERNEL void tr_dequantize_##q##_##dt(const Q* x, const T* scale, const Q* zp, T* y,     \
                                            long long n, TR_QUANT_AXIS_ARGS) {                 \
        TrQuantAxis ax = TR_QUANT_AXIS;                                                        \
        TR_GRID_STRIDE(i, n) {                                                                 \
            if (tr_quant_pad(ax, i)) {                                                         \
                tr_put(y, i, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            long long p = tr_quant_param(ax, i);                                               \
            float v = (float)x[i] - tr_zero_point(zp, p);                                      \
            tr_put(y, i, v * tr_get(scale, p));                                                \
        }                                                                                      \
    }

#define TR_DEQUANTIZE_GRAD(T, dt)                                                              \
    TR_KERNEL void tr_dequantize_grad_##dt(const T* gy, const T* scale, T* gx, long long n,    \
                                           TR_QUANT_AXIS_ARGS, int gy_map,                     \
                                           TR_QUANT_MAP_ARGS) {                                \
        TrQuantAxis ax = TR_QUANT_AXIS;                                                        \
        TR_GRID_STRIDE(i, n) {                                                                 \
            if (tr_quant_pad(ax, i))                                                           \
                tr_put(gx, i, 0.0f);                                                           \
            else                                                                               \
                tr_put(gx, i, tr_get(gy, tr_quant_at(gy_map, i, mc, ms, mcp)) *                \
                                  tr_get(scale, tr_quant_param(ax, i)));                       \
        }                                                                                      \
    }

// gscale[p] = the sum of TERM over parameter p's elements i (pads skipped), one block each
#define TR_QUANT_SCALE_SUM(TERM)                                                               \
    TR_SHARED double part[TR_RED_BLOCK];                                                       \
    TrQuantAxis ax = TR_QUANT_AXIS;                                                            \
    TR_BLOCK_STRIDE(p, params) {                                                               \
        long long count = tr_quant_count(ax, p, n);                                            \
        TR_LANES(t) {                                                                          \
            double acc = 0.0;                                                                  \
            for (long long j = t; j < count; j += TR_RED_BLOCK) {                              \
                long long i = tr_quant_element(ax, p, j);                                      \
                if (!tr_quant_pad(ax, i)) acc += (double)(TERM);                               \
            }                                                                                  \
            part[t] = acc;                                                                     \
        }                                                                                      \
        tr_block_tree_sum(part, 1);                                                            \
        if (threadIdx.x == 0) gscale[p] = (float)part[0];                                      \
        TR_SYNC();                                                                             \
    }

TR_KERNEL void tr_quantize_grad_scale(const float* gx, const float* x, const float* scale,
                                       float* gscale, long long params, long long n,
                                       TR_QUANT_AXIS_ARGS, int x_map, TR_QUANT_MAP_ARGS) {
    TR_QUANT_SCALE_SUM(-(gx[i] * x[tr_quant_at(x_map, i, mc, ms, mcp)] /
                         scale[tr_quant_param(ax, i)]))
}

#define TR_QUANT_SCALE_GRAD(Q, q)                                                              \
    TR_KERNEL void tr_dequantize_grad_scale_##q(const float* gy, const Q* x, const Q* zp,      \
                                                float* gscale, long long params, long long n,  \
                                                TR_QUANT_AXIS_ARGS, int gy_map, int x_map,     \
                                                TR_QUANT_MAP_ARGS) {                           \
        TR_QUANT_SCALE_SUM(((float)x[tr_quant_at(x_map, i, mc, ms, mcp)] -                     \
                            tr_zero_point(zp, tr_quant_param(ax, i))) *                        \
                           gy[tr_quant_at(gy_map, i, mc, ms, mcp)])                            \
    }

// np.max / np.min fold: a NaN anywhere wins
TR_HD float tr_fold_max(float acc, float v) {
    return acc != acc ? acc : (v != v || v > acc ? v : acc);
}
TR_HD float tr_fold_min(float acc, float v) {
    return acc != acc ? acc : (v != v || v < acc ? v : acc);
}

TR_KERNEL void tr_dynamic_quantize_range(const float* x, long long n, float* scale, tr_u8* zp) {
    TR_SHARED float hi_part[TR_RED_BLOCK], lo_part[TR_RED_BLOCK];
    if (blockIdx.x != 0) return;
    TR_LANES(t) {
        float hi = x[0], lo = x[0];
        for (long long i = t; i < n; i += TR_RED_BLOCK) {
            hi = tr_fold_max(hi, x[i]);
            lo = tr_fold_min(lo, x[i]);
        }
        hi_part[t] = hi;
        lo_part[t] = lo;
    }
    TR_SYNC();
    if (threadIdx.x == 0) {
        float hi = hi_part[0], lo = lo_part[0];
        for (int t = 1; t < TR_RED_BLOCK; ++t) {
            hi = tr_fold_max(hi, hi_part[t]);
            lo = tr_fold_min(lo, lo_part[t]);
        }
        // Python's max(0.0, hi) / min(0.0, lo): 0 unless hi is above / lo below (NaN is neither)
        hi = hi > 0.0f ? hi : 0.0f;
        lo = lo < 0.0f ? lo : 0.0f;
        float s = (hi == lo ? 1.0f : hi - lo) / 255.0f;
        float z = 0.0f - lo / s;
        z = z < 255.0f ? z : 255.0f;
        z = z > 0.0f ? z : 0.0f;
        *scale = s;
        *zp = (tr_u8)rintf(z);
    }
}

TR_KERNEL void tr_dynamic_quantize(const float* x, tr_u8* y, long long n, const float* scale,
                                   const tr_u8* zp) {
    float s = *scale, z = (float)*zp;
    TR_GRID_STRIDE(i, n) y[i] = (tr_u8)tr_quantize_value(x[i] / s, z, 0.0f, 255.0f);
}

// ---- integer contractions (forward only): direct, one thread per output element ------------
// Sums of the centred 8-bit operands in 64-bit integers: the exact integer sum NumPy's float64
// contraction gives, stored as int32 or requantized in double as _requantize does:
// y = clip(rint(acc * m + y_zp)), m = (scale_a * scale_b) / scale_y in float32 then double.
// tr_matmul_integer_<a>_<b>(a, a_zp, b, b_zp, y, total, m, k, n, a_batch, b_batch, a_rows,
//                           b_cols)
//     y[t, i, j] = sum_l (a[t, i, l] - a_zp) (b[t, l, j] - b_zp), a_batch / b_batch the batch
//     strides (0: broadcast), a_rows: a_zp per row, b_cols: b_zp per column (else scalars)
// tr_qlinear_matmul_<a>_<b>_<y>(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp, y, total, m,
//                               k, n, a_batch, b_batch, a_rows, b_cols, b_scale_cols, lo, hi)
// tr_conv_integer_<x>_<w>(x, x_zp, w, w_zp, y, total, conv..., w_per_o)
//     NCHW (1 to 3 spatial axes, as [N, C, D, H, W] with unit axes); taps in the padding add 0
//     (the zero point); w_per_o: w_zp per output channel
// tr_qlinear_conv_<x>_<w>_<y>(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias, y,
//                             total, conv..., w_per_o, w_scale_per_o, lo, hi)   (bias int32,
//                             nullable; lo, hi: y's range)
template <class A>
TR_HD long long tr_centred(const A* v, long long i, const A* zp, long long z) {
    return (long long)v[i] - (zp ? (long long)zp[z] : 0);
}
template <class A, class B>
TR_HD long long tr_int_matmul_at(const A* a, const A* a_zp, const B* b, const B* b_zp,
                                 long long e, long long m, long long k, long long n,
                                 long long a_batch, long long b_batch, int a_rows, int b_cols) {
    long long j = e % n, i = (e / n) % m, t = e / (n * m), acc = 0;
    for (long long l = 0; l < k; ++l)
        acc += tr_centred(a, t * a_batch + i * k + l, a_zp, a_rows ? i : 0) *
               tr_centred(b, t * b_batch + l * n + j, b_zp, b_cols ? j : 0);
    return acc;
}
TR_HD double tr_requantize(double acc, float multiplier, double zp, double lo, double hi) {
    double v = rint(acc * (double)multiplier + zp);
    return v < lo ? lo : (v > hi ? hi : v);
}

#define TR_INT_MATMUL(A, a, B, b)                                                              \
    TR_KERNEL void tr_matmul_integer_##a##_##b(const A* x_a, const A* a_zp, const B* x_b,      \
                                               const B* b_zp, int* y, long long total,         \
                                               long long m, long long k, long long n,          \
                                               long long a_batch, long long b_batch,           \
                                               int a_rows, int b_cols) {                       \
        TR_GRID_STRIDE(e, total)                                                               \
        y[e] = (int)tr_int_matmul_at(x_a, a_zp, x_b, b_zp, e, m, k, n, a_batch, b_batch,       \
                                     a_rows, b_cols);                                          \
    }
#define TR_QLINEAR_MATMUL(A, a, B, b, Y, yq)                                                   \
    TR_KERNEL void tr_qlinear_matmul_##a##_##b##_##yq(                                         \
        const A* x_a, const float* a_scale, const A* a_zp, const B* x_b, const float* b_scale,  \
        const B* b_zp, const float* y_scale, const Y* y_zp, Y* y, long long total, long long m, \
        long long k, long long n, long long a_batch, long long b_batch, int a_rows,            \
        int b_cols, int b_scale_cols, double lo, double hi) {                                  \
        TR_GRID_STRIDE(e, total) {                                                             \
            long long j = e % n;                                                               \
            float mult = a_scale[0] * b_scale[b_scale_cols ? j : 0] / y_scale[0];              \
            double acc = (double)tr_int_matmul_at(x_a, a_zp, x_b, b_zp, e, m, k, n, a_batch,   \
                                                  b_batch, a_rows, b_cols);                    \
            y[e] = (Y)tr_requantize(acc, mult, y_zp ? (double)y_zp[0] : 0.0, lo, hi);          \
        }                                                                                      \
    }

// the window of an integer convolution (NCDHW; unit axes for fewer spatial ones)
struct TrIntConv {
    long long n, c, id, ih, iw, o, od, oh, ow;  // input and output shapes
    long long kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw, group;  // window
};
#define TR_INT_CONV_ARGS                                                                       \
    long long n, long long c, long long id, long long ih, long long iw, long long o,           \
        long long od, long long oh, long long ow, long long kd, long long kh, long long kw,    \
        long long sd, long long sh, long long sw, long long pd, long long ph, long long pw,    \
        long long dd, long long dh, long long dw, long long group
#define TR_INT_CONV                                                                            \
    {n, c, id, ih, iw, o, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw, group}

// the integer sum of output element e ([N, O, OD, OH, OW] order); *oc its output channel
template <class X, class W>
TR_HD long long tr_int_conv_at(const TrIntConv& g, const X* x, const X* x_zp, const W* w,
                               const W* w_zp, int w_per_o, long long e, long long* oc) {
    long long ox = e % g.ow, r = e / g.ow;
    long long oy = r % g.oh;
    r /= g.oh;
    long long oz = r % g.od;
    r /= g.od;
    long long o = r % g.o, nb = r / g.o;
    long long cg = g.c / g.group, c0 = o / (g.o / g.group) * cg, acc = 0;
    for (long long ci = 0; ci < cg; ++ci)
        for (long long kz = 0; kz < g.kd; ++kz) {
            long long iz = oz * g.sd - g.pd + kz * g.dd;
            if (iz < 0 || iz >= g.id) continue;
            for (long long ky = 0; ky < g.kh; ++ky) {
                long long iy = oy * g.sh - g.ph + ky * g.dh;
                if (iy < 0 || iy >= g.ih) continue;
                for (long long kx = 0; kx < g.kw; ++kx) {
                    long long ix = ox * g.sw - g.pw + kx * g.dw;
                    if (ix < 0 || ix >= g.iw) continue;
                    long long xi = (((nb * g.c + c0 + ci) * g.id + iz) * g.ih + iy) * g.iw + ix;
                    long long wi = (((o * cg + ci) * g.kd + kz) * g.kh + ky) * g.kw + kx;
                    acc += tr_centred(x, xi, x_zp, 0) * tr_centred(w, wi, w_zp, w_per_o ? o : 0);
                }
            }
        }
    *oc = o;
    return acc;
}

#define TR_INT_CONV_KERNELS(X, xq, W, wq)                                                      \
    TR_KERNEL void tr_conv_integer_##xq##_##wq(const X* x, const X* x_zp, const W* w,          \
                                               const W* w_zp, int* y, long long total,         \
                                               TR_INT_CONV_ARGS, int w_per_o) {                \
        TrIntConv g = TR_INT_CONV;                                                             \
        long long oc;                                                                          \
        TR_GRID_STRIDE(e, total)                                                               \
        y[e] = (int)tr_int_conv_at(g, x, x_zp, w, w_zp, w_per_o, e, &oc);                      \
    }
#define TR_QLINEAR_CONV(X, xq, W, wq, Y, yq)                                                   \
    TR_KERNEL void tr_qlinear_conv_##xq##_##wq##_##yq(                                         \
        const X* x, const float* x_scale, const X* x_zp, const W* w, const float* w_scale,     \
        const W* w_zp, const float* y_scale, const Y* y_zp, const int* bias, Y* y,             \
        long long total, TR_INT_CONV_ARGS, int w_per_o, int w_scale_per_o, double lo,          \
        double hi) {                                                                           \
        TrIntConv g = TR_INT_CONV;                                                             \
        TR_GRID_STRIDE(e, total) {                                                             \
            long long oc;                                                                      \
            double acc = (double)tr_int_conv_at(g, x, x_zp, w, w_zp, w_per_o, e, &oc);         \
            if (bias) acc = acc + (double)bias[oc];                                            \
            float mult = x_scale[0] * w_scale[w_scale_per_o ? oc : 0] / y_scale[0];            \
            y[e] = (Y)tr_requantize(acc, mult, (double)y_zp[0], lo, hi);                       \
        }                                                                                      \
    }
