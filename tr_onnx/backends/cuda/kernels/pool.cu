// Pools (tr_onnx/ops/pool.py): MaxPool / AveragePool and their backward (MaxPoolGrad /
// AveragePoolGrad), GlobalAveragePool. fp32/fp16/bf16 storage, fp32 compute; one thread per
// element written, so the host build (the tests) runs them as plain loops.
//
// Windowed pools (2-D; a 1-D pool is H = 1). x is [N, H, W, cpx] and y [N, OH, OW, cpy]
// (channels-last, c logical channels, pad lanes written 0). TR_POOL_ARGS: total (elements
// written), H, W, OH, OW, c, cpx, cpy, the window's kernel (kh, kw), strides (sh, sw), leading
// pads (ph, pw) and dilations (dh, dw); a tap outside [0, H) x [0, W) reads -inf (max) or 0
// (average), as the numpy kernels' padded workspace. The average's divisor counts the taps
// inside [lo, hi) per axis (the input, or with count_include_pad the input plus its explicit
// pads, never the ceil_mode overhang): lo_h, hi_h, lo_w, hi_w are passed by the binder.
// tr_maxpool_fwd_<dt>(x, y, TR_POOL_ARGS)
// tr_maxpool_argmax_<dt>(x, arg, TR_POOL_ARGS)   total = N * OH * OW * c (int32 taps)
// tr_maxpool_bwd_<dt>(gy, arg, gx, TR_POOL_ARGS)
// tr_avgpool_fwd_<dt>(x, y, TR_POOL_ARGS, lo_h, hi_h, lo_w, hi_w)
// tr_avgpool_bwd_<dt>(gy, gx, TR_POOL_ARGS, lo_h, hi_h, lo_w, hi_w)
// tr_lppool_fwd_<dt>(x, y, TR_POOL_ARGS, p)
//     LpPool: (sum over the window's taps of |x|^p)^(1/p), taps in scan order (padding adds 0)
// tr_lppool_bwd_<dt>(gy, x, y, gx, TR_POOL_ARGS, p)
//     LpPoolGrad: gx = (sum over its windows of gy y^(1-p)) sign(x)|x|^(p-1)
// fp32 in NumPy's order and special cases (p = 1, 2: no pow), as ops/pool.py's _abs_pow, _root
// and _signed_pow.
// Backward: one thread per gx element sums its windows' shares tap by tap, in the numpy
// kernel's order (taps in scan order), so fp32 sums round as NumPy's (a gather: no atomics,
// deterministic). MaxPool's windows' argmax is computed once per output element first
// (tr_maxpool_argmax, into the binding's int32 scratch), not once per tap that reads it.
//
// tr_gap_<dt>(x, y, total, s, cp, sstride, cstride)
//     GlobalAveragePool: y[b, ch] = mean over the s spatial positions, total = N * cp.
// The instantiations (TR_POOL(T, dt), TR_GAP(T, dt) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

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

// |x|^p, the root acc^(1/p), and sign(x)|x|^q as ops/pool.py's _abs_pow, _root, _signed_pow
TR_HD float tr_abs_pow(float x, float p) {
    if (p == 2.0f) return x * x;
    return p == 1.0f ? fabsf(x) : powf(fabsf(x), p);
}
TR_HD float tr_lp_root(float acc, float p) {
    if (p == 2.0f) return sqrtf(acc);
    return p == 1.0f ? acc : powf(acc, 1.0f / p);
}
TR_HD float tr_signed_pow(float x, float q) {
    if (q == 1.0f) return x;
    if (q == 0.0f) return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x));  // np.sign
    return copysignf(powf(fabsf(x), q), x);
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

#define TR_POOL(T, dt)                                                                         \
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
    /* arg[((n OH + oh) OW + ow) c + ch] = the tap of output (n, oh, ow, ch)'s window maximum \
       (tr_pool_argmax; logical channels only), total = N OH OW c */                          \
    TR_KERNEL void tr_maxpool_argmax_##dt(const T* x, int* arg, TR_POOL_ARGS) {               \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long ch = j % c, r = j / c;                                                   \
            long long ow = r % OW, oh = (r / OW) % OH, n = r / (OW * OH);                      \
            arg[j] = (int)tr_pool_argmax(x, n, oh, ow, ch, H, W, cpx, kh, kw, sh, sw, ph, pw,  \
                                         dh, dw);                                              \
        }                                                                                      \
    }                                                                                          \
    /* gx (n, ih, iw, ch): sum over taps k (scan order) of gy at the output whose tap k reads  \
       (ih, iw), where that output's argmax (arg, of tr_maxpool_argmax) is k; total = gx's     \
       physical elements */                                                                   \
    TR_KERNEL void tr_maxpool_bwd_##dt(const T* gy, const int* arg, T* gx, TR_POOL_ARGS) {    \
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
                    long long o = (n * OH + oh) * OW + ow;                                     \
                    if (arg[o * c + ch] != a * kw + b) continue;                               \
                    acc += tr_get(gy, o * cpy + ch);                                           \
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
    TR_KERNEL void tr_lppool_fwd_##dt(const T* x, T* y, TR_POOL_ARGS, float p) {               \
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
                    if (ih >= 0 && ih < H && iw >= 0 && iw < W)                                \
                        acc += tr_abs_pow(tr_get(x, ((n * H + ih) * W + iw) * cpx + ch), p);   \
                }                                                                              \
            tr_put(y, j, tr_lp_root(acc, p));                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_lppool_bwd_##dt(const T* gy, const T* x, const T* y, T* gx,              \
                                      TR_POOL_ARGS, float p) {                                 \
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
                    long long o = ((n * OH + oh) * OW + ow) * cpy + ch;                        \
                    float g = tr_get(gy, o);                                                   \
                    acc += p == 1.0f ? g : powf(tr_get(y, o), 1.0f - p) * g;                   \
                }                                                                              \
            tr_put(gx, j, ch < c ? acc * tr_signed_pow(tr_get(x, j), p - 1.0f) : 0.0f);        \
        }                                                                                      \
    }

// y[b, ch] = mean over si of x[b * s * cp + si * sstride + ch * cstride], total = N * cp;
// NHWC: sstride = cp, cstride = 1; NCHW: sstride = 1, cstride = s (cp = C)
#define TR_GAP(T, dt)                                                                          \
    TR_KERNEL void tr_gap_##dt(const T* x, T* y, long long total, long long s, long long cp,  \
                               long long sstride, long long cstride) {                        \
        TR_GRID_STRIDE(o, total) {                                                             \
            long long b = o / cp, ch = o % cp;                                                 \
            const T* xb = x + b * s * cp + ch * cstride;                                       \
            float acc = 0.0f;                                                                  \
            for (long long si = 0; si < s; ++si) acc += tr_get(xb, si * sstride);              \
            tr_put(y, o, acc / (float)s);                                                      \
        }                                                                                      \
    }
