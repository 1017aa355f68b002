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

// ---- Dropout's mask ------------------------------------------------------------------------
// NumPy's Philox4x64-10 (Random123's constants), so the device draws DropoutTraining's masks
// bit for bit as the numpy kernel does: Philox(key=seed).jumped(step) is the counter
// {0, 0, step, 0} (step << 128) and key {seed, 0}; each draw first steps the counter, so
// 64-bit value j of the stream is word j % 4 of the block at counter {j / 4 + 1, 0, step, 0},
// and NumPy's uniform of it is (bits >> 11) * 2^-53.
TR_HD unsigned long long tr_mulhi64(unsigned long long a, unsigned long long b) {
#if defined(__CUDACC__)
    return __umul64hi(a, b);
#else
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
#endif
}

TR_HD void tr_philox4x64(unsigned long long block, unsigned long long step,
                         unsigned long long seed, unsigned long long out[4]) {
    unsigned long long c0 = block + 1, c1 = 0, c2 = step, c3 = 0, k0 = seed, k1 = 0;
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B97F4A7C15ull;
            k1 += 0xBB67AE8584CAA73Bull;
        }
        unsigned long long lo0 = 0xD2E7470EE14C6C93ull * c0, lo1 = 0xCA5A826395121157ull * c2;
        unsigned long long hi0 = tr_mulhi64(0xD2E7470EE14C6C93ull, c0);
        unsigned long long hi1 = tr_mulhi64(0xCA5A826395121157ull, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// one thread per Philox block of 4 values: element i of x is value before + i of the stream,
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
                            (double)(bits[w] >> 11) * (1.0 / 9007199254740992.0) >= ratio;    \
                mask[i] = keep ? 1 : 0;                                                        \
                tr_put(y, i, (tr_get(x, i) * (keep ? 1.0f : 0.0f)) * scale);                   \
            }                                                                                  \
        }                                                                                      \
    }
