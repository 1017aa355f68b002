// LRN (tr_onnx/ops/lrn.py): local response normalization across channels, and its backward
// LRNGrad. x is a [N, S, C] map (S the spatial axes flattened) with element strides
// (sn, ss, sc): channels-last [N, *S, Cp] is (S * Cp, Cp, 1), compact NCHW (C * S, 1, S).
// One thread per element of the [N, S, Cp] map (cp = c when compact); the padded lanes ch >= c
// are written 0. Channel ch's window is [ch - lo, ch + hi] (lo = (size-1)/2,
// hi = size-1-lo), cut at the map's channels.
// tr_lrn_fwd_<dt>(x, y, n, s, c, cp, sn, ss, sc, lo, hi, alpha_over_size, bias, neg_beta)
//     y = x * (bias + alpha/size * sum over the window of x^2) ^ -beta
// tr_lrn_bwd_<dt>(gy, x, gx, n, s, c, cp, sn, ss, sc, lo, hi, alpha_over_size, bias, neg_beta,
//                 neg_beta_1, coef)
//     with d(ch) that denominator: gx = gy d^-beta + coef x sum over the windows holding ch
//     of gy x d^(-beta-1), coef = -2 beta alpha/size
// fp32/fp16/bf16 storage, fp32 compute in the numpy kernel's order (the window sums added
// from the lowest channel up, the scalars rounded to float32 as NumPy rounds them), so the
// result differs from NumPy's by powf's rounding only.
// The instantiations (TR_LRN(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// bias + alpha/size * the sum of x^2 over channel ch's window [ch - lo, ch + hi] of the row
// at x + base (channel stride sc)
template <class T>
TR_HD float tr_lrn_denominator(const T* x, long long base, long long sc, long long ch,
                               long long c, int lo, int hi, float alpha_over_size, float bias) {
    float acc = 0.0f;
    for (long long k = ch - lo; k <= ch + hi; ++k) {
        if (k < 0 || k >= c) continue;
        float v = tr_get(x, base + k * sc);
        acc += v * v;
    }
    return acc * alpha_over_size + bias;
}

#define TR_LRN(T, dt)                                                                          \
    TR_KERNEL void tr_lrn_fwd_##dt(const T* x, T* y, long long n, long long s, long long c,    \
                                   long long cp, long long sn, long long ss, long long sc,     \
                                   int lo, int hi, float alpha_over_size, float bias,          \
                                   float neg_beta) {                                           \
        TR_GRID_STRIDE(e, n * s * cp) {                                                        \
            long long ch = e % cp, r = e / cp;                                                 \
            long long base = (r / s) * sn + (r % s) * ss;                                      \
            if (ch >= c) {                                                                     \
                tr_put(y, base + ch * sc, 0.0f);                                               \
                continue;                                                                      \
            }                                                                                  \
            float d = tr_lrn_denominator(x, base, sc, ch, c, lo, hi, alpha_over_size, bias);   \
            tr_put(y, base + ch * sc, tr_get(x, base + ch * sc) * powf(d, neg_beta));          \
        }                                                                                      \
    }                                                                                          \
    /* the windows holding ch are those of channels [ch - hi, ch + lo] */                      \
    TR_KERNEL void tr_lrn_bwd_##dt(const T* gy, const T* x, T* gx, long long n, long long s,   \
                                   long long c, long long cp, long long sn, long long ss,      \
                                   long long sc, int lo, int hi, float alpha_over_size,        \
                                   float bias, float neg_beta, float neg_beta_1, float coef) { \
        TR_GRID_STRIDE(e, n * s * cp) {                                                        \
            long long ch = e % cp, r = e / cp;                                                 \
            long long base = (r / s) * sn + (r % s) * ss;                                      \
            if (ch >= c) {                                                                     \
                tr_put(gx, base + ch * sc, 0.0f);                                              \
                continue;                                                                      \
            }                                                                                  \
            float u = 0.0f;                                                                    \
            for (long long k = ch - hi; k <= ch + lo; ++k) {                                   \
                if (k < 0 || k >= c) continue;                                                 \
                float dk = tr_lrn_denominator(x, base, sc, k, c, lo, hi, alpha_over_size,      \
                                              bias);                                           \
                u += powf(dk, neg_beta_1) * tr_get(gy, base + k * sc) * tr_get(x, base + k * sc); \
            }                                                                                  \
            long long j = base + ch * sc;                                                      \
            u = u * tr_get(x, j) * coef;                                                       \
            float d = tr_lrn_denominator(x, base, sc, ch, c, lo, hi, alpha_over_size, bias);   \
            tr_put(gx, j, powf(d, neg_beta) * tr_get(gy, j) + u);                              \
        }                                                                                      \
    }
