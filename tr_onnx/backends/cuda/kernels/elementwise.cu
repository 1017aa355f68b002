// Elementwise ops of two or three operands, and Cast (tr_onnx/ops/elementwise.py): fp32/fp16/
// bf16 storage, fp32 compute, one thread per output element j of n (the output's physical
// order). The kinds differ in how an operand's element is found:
// tr_<op>_<dt>(a, b, y, n, period_a, period_b)          op: add, sub, mul, div. NHWC-friendly
//     broadcasting: operand k is read at j % period_k (period n: same shape; Cp: a per-channel
//     vector on the padded last axis; 1: a scalar); either operand may be the broadcast one.
// tr_<op>_mixed_<dt>(a, b, y, n, sa, sb, m, c, s, cp)   operands in different physical
//     layouts, by operand spec (below).
// tr_<greater|less|equal>_<dt>(a, b, y, n, sa, sb, m, c, s, cp)   y: bool (unsigned char).
// tr_where_<dt>(cond, a, b, y, n, sc, sa, sb, m, c, s, cp)   y = cond ? a : b, bit patterns.
// tr_bcast_binary_<dt>(a, b, y, n, op, c, d0..d5, as0..as5, bs0..bs5, ys0..ys5)   general
//     broadcasting: the output's n logical elements walked through its collapsed dims d, each
//     operand (and the output) through its own element strides (0 on a broadcast axis), so
//     any mix of compact and padded channels-last layouts broadcasts (padded output lanes
//     are not written: the binding zeroes them). op (tr_binop): 0 add, 1 sub, 2 mul, 3 div,
//     4 pow, 5 max, 6 min, 7 fmod, 8 remainder (np.remainder), 9 prelu (a: x, b: slope),
//     10 (a + b) / c (Mean's last input).
// tr_bcast_compare_<t>(a, b, y, n, op, dims, as, bs, ys)   y: bool; t: a storage type or an
//     integer / bool type (bool i8 u8 i16 u16 i32 u32 i64 u64), compared as floats or as the
//     integers themselves; op (tr_cmpop): 0 >, 1 <, 2 ==, 3 >=, 4 <=.
// tr_bcast_int_<t>(a, b, y, n, op, dims, as, bs, ys)   integer (and bool: u8) arithmetic and
//     logic (bool: And, Or, Xor), op (tr_intop): 0 add, 1 sub, 2 mul, 3 div (truncating), 4 fmod (C %), 5 mod
//     (floored, np.remainder), 6 max, 7 min, 8 and, 9 or, 10 xor, 11 <<, 12 >>; division by
//     zero gives 0 (as NumPy), shifts by the width or more give 0.
// tr_bcast_where_b<bytes>(cond, a, b, y, n, dims, cs, as, bs, ys)   Where of any broadcast and
//     layout mix, on bit patterns (cond: bool): a [N,1,1,S] attention mask against [N,H,S,S].
// tr_int_unary_<t>(x, y, n, op)   op 0: logical not (Not on bool), 1: bitwise not.
// tr_float_test_<dt>(x, y, n, op)   y: bool; op 0 isnan, 1 isinf, 2 == +inf, 3 == -inf,
//     4 false (IsInf with both detections off).
// tr_convert_<src>_<dst>(x, y, n) also for the integer and bool types of Cast (i32, i64,
//     bool): float -> int truncates (C conversion, as onnxruntime and NumPy), int -> float
//     rounds to nearest even (through float for fp16/bf16), x -> bool is x != 0.
// tr_convert_<src>_<dst>(x, y, n)   Cast between storage types, round to nearest even (fp32
//     master weights -> fp16/bf16 copies, fp16 gradients -> fp32, ...).
// tr_dropout_<dt>(x, y, mask, n, step, rows_before, per_row, seed, ratio, scale)   compact x:
//     mask = u >= ratio for NumPy's Philox uniforms (tr_philox4x64), y = (x * mask) * scale;
//     ratio <= 0 keeps everything without drawing (inference Dropout's y = x, mask = 1).
//
// Operand spec (sa, sb, sc) of the mixed kinds, for output element j:
//   spec > 0   the operand is read at j % spec (spec = n: same layout; 1: a scalar);
//   spec == -1 the operand is compact NCHW ([N, C, S], m elements), the output padded NHWC
//              ([N', S, Cp]): j maps through tr_nhwc_to_nchw; a pad lane or a padded row
//              (N' > N, conv weights OHWI padded in O) reads 0;
//   spec == -2 the operand is padded NHWC, the output compact NCHW (tr_nchw_to_nhwc).
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "layout.cuh"
#include "strided.cuh"

// ---- period broadcasting ------------------------------------------------------------------
TR_HD long long tr_bcast(long long i, long long n, long long period) {
    return period == n ? i : i % period;
}

#define TR_BINARY(op, T, dt)                                                                  \
    TR_KERNEL void tr_##op##_##dt(const T* a, const T* b, T* y, long long n, long long pa,   \
                                  long long pb) {                                             \
        TR_GRID_STRIDE(i, n)                                                                  \
            tr_put(y, i, tr_##op(tr_get(a, tr_bcast(i, n, pa)), tr_get(b, tr_bcast(i, n, pb)))); \
    }

// ---- operand specs: mixed layouts, compares, Where -----------------------------------------
TR_HD long long tr_spec_index(long long j, long long spec, long long m, long long c, long long s,
                              long long cp) {
    if (spec > 0) return spec == 1 ? 0 : j % spec;
    if (spec == -1) {
        long long i = tr_nhwc_to_nchw(j, c, s, cp);
        return i < m ? i : -1;
    }
    return tr_nchw_to_nhwc(j, c, s, cp);
}

template <class T> TR_HD float tr_spec_load(const T* p, long long i) {
    return i < 0 ? 0.0f : tr_get(p, i);
}

template <class T> TR_HD T tr_spec_raw(const T* p, long long i) {  // the bits, or a zero
    if (i >= 0) return p[i];
    T z;
    tr_from_float(0.0f, &z);
    return z;
}

#define TR_SPEC_ARGS long long n, long long sa, long long sb, long long m, long long c, \
                     long long s, long long cp

#define TR_MIXED_BINARY(op, T, dt)                                                             \
    TR_KERNEL void tr_##op##_mixed_##dt(const T* a, const T* b, T* y, TR_SPEC_ARGS) {        \
        TR_GRID_STRIDE(j, n)                                                                   \
            tr_put(y, j, tr_##op(tr_spec_load(a, tr_spec_index(j, sa, m, c, s, cp)),          \
                                 tr_spec_load(b, tr_spec_index(j, sb, m, c, s, cp))));        \
    }

#define TR_COMPARE(name, cmp, T, dt)                                                           \
    TR_KERNEL void tr_##name##_##dt(const T* a, const T* b, unsigned char* y, TR_SPEC_ARGS) { \
        TR_GRID_STRIDE(j, n)                                                                   \
            y[j] = tr_spec_load(a, tr_spec_index(j, sa, m, c, s, cp)) cmp                     \
                   tr_spec_load(b, tr_spec_index(j, sb, m, c, s, cp));                        \
    }

// y = cond ? a : b, copying bit patterns (as the numpy kernel)
#define TR_WHERE(T, dt)                                                                        \
    TR_KERNEL void tr_where_##dt(const unsigned char* cond, const T* a, const T* b, T* y,     \
                                 long long n, long long sc, long long sa, long long sb,       \
                                 long long m, long long c, long long s, long long cp) {       \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long k = tr_spec_index(j, sc, m, c, s, cp);                                   \
            bool take_a = k >= 0 && cond[k] != 0;                                              \
            y[j] = take_a ? tr_spec_raw(a, tr_spec_index(j, sa, m, c, s, cp))                  \
                          : tr_spec_raw(b, tr_spec_index(j, sb, m, c, s, cp));                 \
        }                                                                                      \
    }

// ---- strided broadcasting ------------------------------------------------------------------
TR_HD float tr_pow(float a, float b) {  // x^2 (RMS norms, variances) as the exact product
    return b == 2.0f ? a * a : powf(a, b);
}
TR_HD float tr_maximum(float a, float b) { return (a != a || a >= b) ? a : b; }  // np.maximum
TR_HD float tr_minimum(float a, float b) { return (a != a || a <= b) ? a : b; }  // np.minimum
TR_HD float tr_remainder(float a, float b) {  // np.remainder: NumPy's npy_divmodf
    float m = fmodf(a, b);
    if (b == 0.0f) return m;
    if (m != 0.0f) {
        if ((b < 0.0f) != (m < 0.0f)) m += b;
    } else {
        m = copysignf(0.0f, b);
    }
    return m;
}
// PRelu as ops/elementwise.py computes it: max(x, 0) + min(x, 0) * slope
TR_HD float tr_prelu(float x, float slope) {
    float neg = tr_min_nan(x, 0.0f) * slope;
    return tr_max_nan(x, 0.0f) + neg;
}

TR_HD float tr_binop(int op, float a, float b, float c) {
    switch (op) {
        case 0: return tr_add(a, b);
        case 1: return tr_sub(a, b);
        case 2: return tr_mul(a, b);
        case 3: return tr_div(a, b);
        case 4: return tr_pow(a, b);
        case 5: return tr_maximum(a, b);
        case 6: return tr_minimum(a, b);
        case 7: return fmodf(a, b);
        case 8: return tr_remainder(a, b);
        case 9: return tr_prelu(a, b);
        default: return (a + b) / c;
    }
}

template <class T> TR_HD bool tr_cmpop(int op, T a, T b) {
    switch (op) {
        case 0: return a > b;
        case 1: return a < b;
        case 2: return a == b;
        case 3: return a >= b;
        default: return a <= b;
    }
}

// integer arithmetic in the type's own width, wrapping as NumPy's (through the unsigned type U
// of the last argument, a tag)
template <class T, class U> TR_HD T tr_intop(int op, T a, T b, U) {
    const int bits = (int)(8 * sizeof(T));
    const bool negative_one = (T)-1 < (T)0 && b == (T)-1;  // signed types only
    switch (op) {
        case 0: return (T)((U)a + (U)b);
        case 1: return (T)((U)a - (U)b);
        case 2: return (T)((U)a * (U)b);
        case 3:  // truncating; x / -1 by negation (no overflow trap on the host)
            if (b == 0) return 0;
            return negative_one ? (T)((U)0 - (U)a) : (T)(a / b);
        case 4:
            return (b == 0 || negative_one) ? (T)0 : (T)(a % b);
        case 5: {
            if (b == 0 || negative_one) return 0;
            T m = (T)(a % b);
            return (m != 0 && ((m < 0) != (b < 0))) ? (T)(m + b) : m;
        }
        case 6: return a >= b ? a : b;
        case 7: return a <= b ? a : b;
        case 8: return (T)(a & b);
        case 9: return (T)(a | b);
        case 10: return (T)(a ^ b);
        case 11: return (b < 0 || b >= bits) ? (T)0 : (T)((U)a << b);
        default: return (b < 0 || b >= bits) ? (T)0 : (T)(a >> b);
    }
}

typedef unsigned char tr_u8;  // uint8 (bool is unsigned char)

// an element as the comparisons read it: float storage as float, integers as themselves
template <class T> TR_HD T tr_native(const T* p, long long i) { return p[i]; }
TR_HD float tr_native(const tr_f16* p, long long i) { return tr_to_float(p[i]); }
TR_HD float tr_native(const tr_bf16* p, long long i) { return tr_to_float(p[i]); }

// element j of the collapsed output -> the offsets of both operands and the output, in one
// walk over the dims
TR_HD void tr_bcast_offsets(long long j, const long long* d, const long long* sa,
                            const long long* sb, const long long* sy, long long* oa,
                            long long* ob, long long* oy) {
    long long a = 0, b = 0, y = 0;
    for (int k = 5; k >= 0; --k) {
        long long i = j % d[k];
        j /= d[k];
        a += i * sa[k];
        b += i * sb[k];
        y += i * sy[k];
    }
    *oa = a;
    *ob = b;
    *oy = y;
}

#define TR_BCAST_ARGS TR_DIMS6, TR_STRIDES6(as), TR_STRIDES6(bs), TR_STRIDES6(ys)
#define TR_BCAST_SETUP                                                                         \
    const long long d[6] = {d0, d1, d2, d3, d4, d5};                                           \
    const long long sa[6] = {as0, as1, as2, as3, as4, as5};                                    \
    const long long sb[6] = {bs0, bs1, bs2, bs3, bs4, bs5};                                    \
    const long long sy[6] = {ys0, ys1, ys2, ys3, ys4, ys5};

// y[iy] = expr over a[ia], b[ib], for every element j of the output
#define TR_BCAST_BODY(expr)                                                                    \
    TR_BCAST_SETUP                                                                             \
    TR_GRID_STRIDE(j, n) {                                                                     \
        long long ia, ib, iy;                                                                  \
        tr_bcast_offsets(j, d, sa, sb, sy, &ia, &ib, &iy);                                     \
        expr;                                                                                  \
    }

#define TR_BCAST_BINARY(T, dt)                                                                 \
    TR_KERNEL void tr_bcast_binary_##dt(const T* a, const T* b, T* y, long long n, int op,    \
                                        float c, TR_BCAST_ARGS) {                              \
        TR_BCAST_BODY(tr_put(y, iy, tr_binop(op, tr_get(a, ia), tr_get(b, ib), c)))            \
    }

#define TR_BCAST_COMPARE(T, t)                                                                 \
    TR_KERNEL void tr_bcast_compare_##t(const T* a, const T* b, unsigned char* y, long long n, \
                                        int op, TR_BCAST_ARGS) {                               \
        TR_BCAST_BODY(y[iy] = tr_cmpop(op, tr_native(a, ia), tr_native(b, ib)))                \
    }

#define TR_BCAST_INT(T, U, t)                                                                  \
    TR_KERNEL void tr_bcast_int_##t(const T* a, const T* b, T* y, long long n, int op,        \
                                    TR_BCAST_ARGS) {                                           \
        TR_BCAST_BODY(y[iy] = tr_intop(op, a[ia], b[ib], (U)0))                                \
    }

#define TR_BCAST_WHERE(U, bytes)                                                               \
    TR_KERNEL void tr_bcast_where_b##bytes(const unsigned char* cond, const U* a, const U* b,  \
                                           U* y, long long n, TR_DIMS6, TR_STRIDES6(cs),       \
                                           TR_STRIDES6(as), TR_STRIDES6(bs),                   \
                                           TR_STRIDES6(ys)) {                                  \
        const long long sc[6] = {cs0, cs1, cs2, cs3, cs4, cs5};                                \
        TR_BCAST_BODY(y[iy] = cond[tr_strided_offset(j, d, sc)] ? a[ia] : b[ib])               \
    }

#define TR_INT_UNARY(T, t)                                                                     \
    TR_KERNEL void tr_int_unary_##t(const T* x, T* y, long long n, int op) {                  \
        TR_GRID_STRIDE(i, n) y[i] = op == 0 ? (T)(x[i] == 0) : (T)~x[i];                      \
    }

#define TR_FLOAT_TEST(T, dt)                                                                   \
    TR_KERNEL void tr_float_test_##dt(const T* x, unsigned char* y, long long n, int op) {    \
        TR_GRID_STRIDE(i, n) {                                                                 \
            float v = tr_get(x, i);                                                            \
            bool inf = v != v ? false : !tr_isfinite(v);                                       \
            y[i] = op == 0 ? v != v : op == 1 ? inf : op == 2 ? inf && v > 0.0f                \
                                                         : op == 3 ? inf && v < 0.0f : false; \
        }                                                                                      \
    }

// ---- Cast ----------------------------------------------------------------------------------
#define TR_CONVERT(S, sdt, D, ddt)                                                           \
    TR_KERNEL void tr_convert_##sdt##_##ddt(const S* x, D* y, long long n) {                 \
        TR_GRID_STRIDE(i, n) tr_put(y, i, tr_get(x, i));                                     \
    }

// Cast with an integer or bool side: the value as float (float storage) or as long long
// (integers), then stored as the destination reads it
template <class S> TR_HD long long tr_cast_src(const S* p, long long i) { return (long long)p[i]; }
TR_HD float tr_cast_src(const float* p, long long i) { return p[i]; }
TR_HD float tr_cast_src(const tr_f16* p, long long i) { return tr_to_float(p[i]); }
TR_HD float tr_cast_src(const tr_bf16* p, long long i) { return tr_to_float(p[i]); }
template <class V> TR_HD void tr_cast_put(float* p, long long i, V v) { *(p + i) = (float)v; }
template <class V> TR_HD void tr_cast_put(tr_f16* p, long long i, V v) {
    tr_from_float((float)v, p + i);
}
template <class V> TR_HD void tr_cast_put(tr_bf16* p, long long i, V v) {
    tr_from_float((float)v, p + i);
}
template <class V> TR_HD void tr_cast_put(unsigned char* p, long long i, V v) { p[i] = v != 0; }
template <class V> TR_HD void tr_cast_put(int* p, long long i, V v) { p[i] = (int)v; }
template <class V> TR_HD void tr_cast_put(long long* p, long long i, V v) {
    p[i] = (long long)v;
}

#define TR_CAST(S, sdt, D, ddt)                                                              \
    TR_KERNEL void tr_convert_##sdt##_##ddt(const S* x, D* y, long long n) {                 \
        TR_GRID_STRIDE(i, n) tr_cast_put(y, i, tr_cast_src(x, i));                           \
    }

// ---- Dropout's mask ------------------------------------------------------------------------
// NumPy's Philox stream (elementwise.cuh: tr_philox4x64, tr_philox_uniform), so the device
// draws DropoutTraining's masks bit for bit as the numpy kernel does; one thread per Philox
// block of 4 values: element i of x is value before + i of the stream,
// before = rows_before * per_row (data parallelism: the global batch's rows on earlier ranks)
#define TR_DROPOUT(T, dt)                                                                      \
    TR_KERNEL void tr_dropout_##dt(const T* x, T* y, unsigned char* mask, long long n,        \
                                   const long long* step, const long long* rows_before,       \
                                   long long per_row, long long seed, double ratio,           \
                                   float scale) {                                             \
        unsigned long long s = step ? (unsigned long long)*step : 0ull;                        \
        long long before = rows_before ? *rows_before * per_row : 0;                           \
        long long first = before / 4, blocks = (before + n + 3) / 4 - first;                   \
        TR_GRID_STRIDE(k, blocks) {                                                            \
            unsigned long long bits[4] = {0ull, 0ull, 0ull, 0ull};                             \
            if (ratio > 0.0)                                                                   \
                tr_philox4x64((unsigned long long)(first + k), s, (unsigned long long)seed,   \
                              bits);                                                           \
            for (int w = 0; w < 4; ++w) {                                                      \
                long long i = (first + k) * 4 + w - before;                                    \
                if (i < 0 || i >= n) continue;                                                 \
                bool keep = ratio <= 0.0 ||                                                    \
                            tr_philox_uniform(bits[w]) >= ratio;                              \
                mask[i] = keep ? 1 : 0;                                                        \
                tr_put(y, i, (tr_get(x, i) * (keep ? 1.0f : 0.0f)) * scale);                   \
            }                                                                                  \
        }                                                                                      \
    }
