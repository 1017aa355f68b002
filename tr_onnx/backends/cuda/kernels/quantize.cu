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
