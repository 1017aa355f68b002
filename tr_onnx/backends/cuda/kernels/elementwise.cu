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
// tr_bcast_binary_<dt>(a, b, y, n, op, d0..d5, as0..as5, bs0..bs5)   general broadcasting
//     through the collapsed dims of the output and each operand's strides (strided.cuh);
//     op: 0 add, 1 sub, 2 mul, 3 div.
// tr_convert_<src>_<dst>(x, y, n)   Cast between storage types, round to nearest even (fp32
//     master weights -> fp16/bf16 copies, fp16 gradients -> fp32, ...).
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
TR_HD float tr_binop(int op, float a, float b) {
    switch (op) {
        case 0: return tr_add(a, b);
        case 1: return tr_sub(a, b);
        case 2: return tr_mul(a, b);
        default: return tr_div(a, b);
    }
}

#define TR_BCAST_BINARY(T, dt)                                                                 \
    TR_KERNEL void tr_bcast_binary_##dt(const T* a, const T* b, T* y, long long n, int op,    \
                                        TR_DIMS6, TR_STRIDES6(as), TR_STRIDES6(bs)) {          \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long sa[6] = {as0, as1, as2, as3, as4, as5};                                \
        const long long sb[6] = {bs0, bs1, bs2, bs3, bs4, bs5};                                \
        TR_GRID_STRIDE(j, n)                                                                   \
            tr_put(y, j, tr_binop(op, tr_get(a, tr_strided_offset(j, d, sa)),                  \
                                  tr_get(b, tr_strided_offset(j, d, sb))));                    \
    }

// ---- Cast ----------------------------------------------------------------------------------
#define TR_CONVERT(S, sdt, D, ddt)                                                           \
    TR_KERNEL void tr_convert_##sdt##_##ddt(const S* x, D* y, long long n) {                 \
        TR_GRID_STRIDE(i, n) tr_put(y, i, tr_get(x, i));                                     \
    }
