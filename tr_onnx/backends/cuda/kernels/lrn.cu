// LRN (tr_onnx/ops/lrn.py): local response normalization across channels, and its backward
// LRNGrad. Each operand is a [N, S, C] map (S the spatial axes flattened) by its own element
// strides (<p>n, <p>s, <p>c: tr_map, layout.cuh), channels-last or compact. One thread per
// element of the output's [N, S, Cp] lanes (cp = c when compact); the padded lanes ch >= c are
// written 0. Channel ch's window is [ch - lo, ch + hi] (lo = (size-1)/2, hi = size-1-lo), cut
// at the map's channels.
// tr_lrn_fwd_<dt>(x, y, n, s, c, x*, y*, ycp, lo, hi, alpha_over_size, bias, neg_beta)
//     y = x * (bias + alpha/size * sum over the window of x^2) ^ -beta
// tr_lrn_bwd_<dt>(gy, x, gx, n, s, c, gy*, x*, gx*, gxcp, lo, hi, alpha_over_size, bias,
//                 neg_beta, neg_beta_1, coef)
//     with d(ch) that denominator: gx = gy d^-beta + coef x sum over the windows holding ch
//     of gy x d^(-beta-1), coef = -2 beta alpha/size
// fp32/fp16/bf16 storage, fp32 compute in the numpy kernel's order (the window sums added
// from the lowest channel up, the scalars rounded to float32 as NumPy rounds them), so the
// result differs from NumPy's by powf's rounding only.
// The instantiations (TR_LRN(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"
#include "layout.cuh"

// bias + alpha/size * the sum of x^2 over channel ch's window [ch - lo, ch + hi] at position
// si of sample n
template <class T>
TR_HD float tr_lrn_denominator(const T* x, const tr_map& xm, long long n, long long si,
                               long long ch, long long c, int lo, int hi,
                               float alpha_over_size, float bias) {
    float acc = 0.0f;
    for (long long k = ch - lo; k <= ch + hi; ++k) {
        if (k < 0 || k >= c) continue;
        float v = tr_get(x, xm.at(n, si, k));
        acc += v * v;
    }
    return acc * alpha_over_size + bias;
}

#define TR_LRN(T, dt)                                                                          \
    TR_KERNEL void tr_lrn_fwd_##dt(const T* x, T* y, long long n, long long s, long long c,    \
                                   TR_MAP_ARGS(x), TR_MAP_ARGS(y), long long ycp, int lo,      \
                                   int hi, float alpha_over_size, float bias,                  \
                                   float neg_beta) {                                           \
        const tr_map xm = TR_MAP(x), ym = TR_MAP(y);                                           \
        TR_GRID_STRIDE(e, n * s * ycp) {                                                       \
            long long ch = e % ycp, r = e / ycp, ni = r / s, si = r % s;                       \
            float v = 0.0f;                                                                    \
            if (ch < c) {                                                                      \
                float d = tr_lrn_denominator(x, xm, ni, si, ch, c, lo, hi, alpha_over_size,    \
                                             bias);                                            \
                v = tr_get(x, xm.at(ni, si, ch)) * powf(d, neg_beta);                          \
            }                                                                                  \
            tr_put(y, ym.at(ni, si, ch), v);                                                   \
        }                                                                                      \
    }                                                                                          \
    /* the windows holding ch are those of channels [ch - hi, ch + lo] */                      \
    TR_KERNEL void tr_lrn_bwd_##dt(const T* gy, const T* x, T* gx, long long n, long long s,   \
                                   long long c, TR_MAP_ARGS(gy), TR_MAP_ARGS(x),               \
                                   TR_MAP_ARGS(gx), long long gxcp, int lo, int hi,            \
                                   float alpha_over_size, float bias, float neg_beta,          \
                                   float neg_beta_1, float coef) {                             \
        const tr_map gym = TR_MAP(gy), xm = TR_MAP(x), gxm = TR_MAP(gx);                       \
        TR_GRID_STRIDE(e, n * s * gxcp) {                                                      \
            long long ch = e % gxcp, r = e / gxcp, ni = r / s, si = r % s;                     \
            float v = 0.0f;                                                                    \
            if (ch < c) {                                                                      \
                float u = 0.0f;                                                                \
                for (long long k = ch - hi; k <= ch + lo; ++k) {                               \
                    if (k < 0 || k >= c) continue;                                             \
                    float dk = tr_lrn_denominator(x, xm, ni, si, k, c, lo, hi,                 \
                                                  alpha_over_size, bias);                      \
                    u += powf(dk, neg_beta_1) * tr_get(gy, gym.at(ni, si, k))                  \
                         * tr_get(x, xm.at(ni, si, k));                                        \
                }                                                                              \
                u = u * tr_get(x, xm.at(ni, si, ch)) * coef;                                   \
                float d = tr_lrn_denominator(x, xm, ni, si, ch, c, lo, hi, alpha_over_size,    \
                                             bias);                                            \
                v = powf(d, neg_beta) * tr_get(gy, gym.at(ni, si, ch)) + u;                    \
            }                                                                                  \
            tr_put(gx, gxm.at(ni, si, ch), v);                                                 \
        }                                                                                      \
    }
