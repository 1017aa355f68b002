// Small kernels the cuda executor needs besides the op families: elementwise ops whose operands
// sit in different physical layouts, Greater/Less/Equal, Where, Expand, GlobalAveragePool, column sums
// (bias gradients), BatchNorm running statistics, the gradient scale/clip of the apply phase
// and zeroing of padded lanes. Storage fp32/fp16/bf16, compute fp32, as the other families.
//
// Operand indexing ("spec"), output element j of n (the output's physical order):
//   spec > 0   the operand is read at j % spec (spec = n: same layout; 1: a scalar);
//   spec == -1 the operand is compact NCHW ([N, C, S], m elements), the output padded NHWC
//              ([N', S, Cp]): j maps through tr_nhwc_to_nchw; a pad lane or a padded row
//              (N' > N, conv weights OHWI padded in O) reads 0;
//   spec == -2 the operand is padded NHWC, the output compact NCHW (tr_nchw_to_nhwc).
#include "layout.cuh"

#if defined(__CUDACC__)
#define TR_X_SHARED __shared__
#define TR_X_SYNC() __syncthreads()
#else
#define TR_X_SHARED static
#define TR_X_SYNC() ((void)0)
#endif
#define TR_X_BLOCK 256  // the block size tr_scale_clip_norm_<dt> must be launched with

TR_HD long long tr_x_index(long long j, long long spec, long long m, long long c, long long s,
                           long long cp) {
    if (spec > 0) return spec == 1 ? 0 : j % spec;
    if (spec == -1) {
        long long i = tr_nhwc_to_nchw(j, c, s, cp);
        return i < m ? i : -1;
    }
    return tr_nchw_to_nhwc(j, c, s, cp);
}

template <class T> TR_HD float tr_x_load(const T* p, long long i) {
    return i < 0 ? 0.0f : tr_get(p, i);
}

template <class T> TR_HD T tr_x_raw(const T* p, long long i) {  // the bits, or a zero
    if (i >= 0) return p[i];
    T z;
    tr_from_float(0.0f, &z);
    return z;
}

#define TR_X_SPEC_ARGS long long n, long long sa, long long sb, long long m, long long c, \
                       long long s, long long cp

#define TR_MIXED_BINARY(op, T, dt)                                                             \
    TR_KERNEL void tr_##op##_mixed_##dt(const T* a, const T* b, T* y, TR_X_SPEC_ARGS) {      \
        TR_GRID_STRIDE(j, n)                                                                   \
            tr_put(y, j, tr_##op(tr_x_load(a, tr_x_index(j, sa, m, c, s, cp)),                \
                                 tr_x_load(b, tr_x_index(j, sb, m, c, s, cp))));              \
    }

#define TR_COMPARE(name, cmp, T, dt)                                                           \
    TR_KERNEL void tr_##name##_##dt(const T* a, const T* b, unsigned char* y, TR_X_SPEC_ARGS) { \
        TR_GRID_STRIDE(j, n)                                                                   \
            y[j] = tr_x_load(a, tr_x_index(j, sa, m, c, s, cp)) cmp                           \
                   tr_x_load(b, tr_x_index(j, sb, m, c, s, cp));                              \
    }

#define TR_EXTRA(T, dt)                                                                        \
    TR_COMPARE(greater, >, T, dt)                                                              \
    TR_COMPARE(less, <, T, dt)                                                                 \
    TR_COMPARE(equal, ==, T, dt)                                                               \
    /* y = cond ? a : b, copying bit patterns (as the numpy kernel) */                         \
    TR_KERNEL void tr_where_##dt(const unsigned char* cond, const T* a, const T* b, T* y,     \
                                 long long n, long long sc, long long sa, long long sb,       \
                                 long long m, long long c, long long s, long long cp) {       \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long k = tr_x_index(j, sc, m, c, s, cp);                                      \
            bool take_a = k >= 0 && cond[k] != 0;                                              \
            y[j] = take_a ? tr_x_raw(a, tr_x_index(j, sa, m, c, s, cp))                        \
                          : tr_x_raw(b, tr_x_index(j, sb, m, c, s, cp));                       \
        }                                                                                      \
    }                                                                                          \
    /* one run of broadcast axes: y[i] = x[(i / (inner * repeat)) * inner + i % inner] */     \
    TR_KERNEL void tr_expand_##dt(const T* x, T* y, long long n, long long inner,             \
                                  long long repeat) {                                          \
        TR_GRID_STRIDE(i, n) y[i] = x[(i / (inner * repeat)) * inner + i % inner];            \
    }                                                                                          \
    /* y[b, ch] = mean over si of x[b * s * cp + si * sstride + ch * cstride], total = N * cp; \
       NHWC: sstride = cp, cstride = 1; NCHW: sstride = 1, cstride = s (cp = C) */             \
    TR_KERNEL void tr_gap_##dt(const T* x, T* y, long long total, long long s, long long cp,  \
                               long long sstride, long long cstride) {                        \
        TR_GRID_STRIDE(o, total) {                                                             \
            long long b = o / cp, ch = o % cp;                                                 \
            const T* xb = x + b * s * cp + ch * cstride;                                       \
            float acc = 0.0f;                                                                  \
            for (long long si = 0; si < s; ++si) acc += tr_get(xb, si * sstride);              \
            tr_put(y, o, acc / (float)s);                                                      \
        }                                                                                      \
    }                                                                                          \
    /* y[col] = sum over rows of x[row * ld + col], col < cols (bias gradients) */             \
    TR_KERNEL void tr_sum_rows_##dt(const T* x, T* y, long long rows, long long cols,         \
                                    long long ld) {                                            \
        TR_GRID_STRIDE(col, cols) {                                                            \
            float acc = 0.0f;                                                                  \
            for (long long r = 0; r < rows; ++r) acc += tr_get(x, r * ld + col);               \
            tr_put(y, col, acc);                                                               \
        }                                                                                      \
    }                                                                                          \
    /* running statistics from channels-last x ([rows, ld], c channels) and its batch mean:    \
       new_rm = rm * momentum + mean * mean_coef, new_rv = rv * momentum + var * var_coef,     \
       var the biased batch variance (ONNX); var_coef carries PyTorch's count / (count - 1) */ \
    TR_KERNEL void tr_bn_running_##dt(const T* x, const float* mean, const float* rm,         \
                                      const float* rv, float* new_rm, float* new_rv,           \
                                      long long rows, long long c, long long ld,               \
                                      float momentum, float mean_coef, float var_coef) {      \
        TR_GRID_STRIDE(ch, c) {                                                                \
            float mu = mean[ch];                                                               \
            double acc = 0.0;                                                                  \
            for (long long r = 0; r < rows; ++r) {                                             \
                double d = (double)(tr_get(x, r * ld + ch) - mu);                              \
                acc += d * d;                                                                  \
            }                                                                                  \
            float var = (float)(acc / (double)rows);                                           \
            new_rm[ch] = rm[ch] * momentum + mu * mean_coef;                                   \
            new_rv[ch] = rv[ch] * momentum + var * var_coef;                                   \
        }                                                                                      \
    }                                                                                          \
    /* inference BatchNormalization over rows of ld lanes (channels-last, or [N, C] with       \
       ld = C): a = scale / sqrt(var + eps), b = bias - mean * a, y = x * a + b as the numpy  \
       kernel; lanes ch >= c are written 0 */                                                 \
    TR_KERNEL void tr_bn_infer_##dt(const T* x, const float* scale, const float* bias,        \
                                    const float* mean, const float* var, T* y, long long n,   \
                                    long long c, long long ld, float eps) {                   \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long ch = j % ld;                                                             \
            float a = ch < c ? scale[ch] / sqrtf(var[ch] + eps) : 0.0f;                       \
            float b = ch < c ? bias[ch] - mean[ch] * a : 0.0f;                                 \
            tr_put(y, j, ch < c ? tr_get(x, j) * a + b : 0.0f);                                \
        }                                                                                      \
    }                                                                                          \
    /* g *= *scale (when not 1); *norm = ||g||; if max_norm > 0 and the norm exceeds it,       \
       g *= max_norm / (norm + 1e-6) (clip_grad_norm_). One block of TR_X_BLOCK threads: the   \
       whole GRAD span in one launch, no grid-wide sync needed. */                             \
    TR_KERNEL void tr_scale_clip_norm_##dt(T* g, long long n, const float* scale, float* norm, \
                                           double max_norm) {                                  \
        TR_X_SHARED double part[TR_X_BLOCK];                                                   \
        TR_X_SHARED float coef_shared;                                                         \
        if (blockIdx.x != 0) return;                                                           \
        unsigned t = threadIdx.x;                                                              \
        float sc = *scale;                                                                     \
        double acc = 0.0;                                                                      \
        for (long long i = t; i < n; i += blockDim.x) {                                        \
            if (sc != 1.0f) tr_put(g, i, tr_get(g, i) * sc);                                   \
            double v = (double)tr_get(g, i);                                                   \
            acc += v * v;                                                                      \
        }                                                                                      \
        part[t] = acc;                                                                         \
        TR_X_SYNC();                                                                           \
        if (t == 0) {                                                                          \
            double total = 0.0;                                                                \
            for (unsigned k = 0; k < blockDim.x; ++k) total += part[k];                        \
            double nrm = sqrt(total);                                                          \
            *norm = (float)nrm;                                                                \
            double coef = max_norm > 0.0 ? max_norm / (nrm + 1e-6) : 1.0;                      \
            coef_shared = coef < 1.0 ? (float)coef : 1.0f;                                     \
        }                                                                                      \
        TR_X_SYNC();                                                                           \
        float cf = coef_shared;                                                                \
        if (cf != 1.0f)                                                                        \
            for (long long i = t; i < n; i += blockDim.x) tr_put(g, i, tr_get(g, i) * cf);     \
    }

// Zero the padded lanes [c, cp) of every row of a padded buffer of rows * cp elements of
// 1, 2 or 4 bytes (bit patterns: any storage type). c = 0 zeroes everything (ZeroFill).
#define TR_ZERO_LANES(U, bytes)                                                                \
    TR_KERNEL void tr_zero_lanes_b##bytes(U* y, long long rows, long long c, long long cp) {  \
        TR_GRID_STRIDE(j, rows * cp) if (j % cp >= c) y[j] = 0;                               \
    }
TR_ZERO_LANES(unsigned char, 1)
TR_ZERO_LANES(unsigned short, 2)
TR_ZERO_LANES(unsigned int, 4)
