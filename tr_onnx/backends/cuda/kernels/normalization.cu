// Normalizations (tr_onnx/ops/normalization.py): LayerNormalization and its backward
// (LayerNormGrad), and BatchNormalization beside cuDNN's training graph: inference with fixed
// statistics, and ONNX's running statistics (biased variance) from x and the batch mean cuDNN
// saved. fp32/fp16/bf16 storage of x and y, float32 statistics and BatchNorm parameters, fp32
// compute (fp64 sums).
// LayerNormalization over rows of m elements (the normalized axes flattened, compact):
// tr_layernorm_fwd_<dt>(x, scale, bias, y, mean_out, inv_out, rows, m, eps)
// tr_layernorm_bwd_dx_<dt>(gy, x, scale, gx, mean_out, inv_out, rows, m, eps)
// tr_layernorm_bwd_params_<dt>(gy, x, mean, inv, gscale, gbias, rows, m)
//     one thread per row (fwd, bwd_dx) or per normalized element (bwd_params); the row's mean
//     and 1/sqrt(var + eps) pass from bwd_dx to bwd_params through float32 scratch.
// BatchNormalization, channels-last x as rows of ld lanes, c channels:
// tr_bn_running_<dt>(x, mean, partial, rows, c, ld, chunks, chunk_rows)
//     each chunk's sum of (x - mean)^2 per channel into fp64 partial[chunks, c]: one block per
//     (chunk of rows, 32 channels), a fixed-order block reduction (deterministic)
// tr_bn_running_finish(partial, mean, rm, rv, new_rm, new_rv, rows, c, chunks, momentum,
//                      mean_coef, var_coef)   one thread per channel, the chunks in order
// tr_bn_infer_<dt>(x, scale, bias, mean, var, y, n, c, ld, eps)   one thread per element
// The instantiations (TR_LAYERNORM(T, dt), TR_BATCHNORM(T, dt) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// mean and 1/sqrt(var + eps) of one row of m elements (the biased variance of x - mean)
template <class T>
TR_HD void tr_row_moments(const T* x, long long m, float eps, float* mean, float* inv) {
    double acc = 0.0;
    for (long long j = 0; j < m; ++j) acc += (double)tr_get(x, j);
    float mu = (float)(acc / (double)m);
    double sq = 0.0;
    for (long long j = 0; j < m; ++j) {
        float d = tr_get(x, j) - mu;
        sq += (double)d * (double)d;
    }
    float var = (float)(sq / (double)m);
    *mean = mu;
    *inv = 1.0f / sqrtf(var + eps);
}

#define TR_LAYERNORM(T, dt)                                                                    \
    /* LayerNormalization over rows of m: y = (x - mean) * inv * scale (+ bias); mean / inv   \
       (float32, one per row) written when not null */                                        \
    TR_KERNEL void tr_layernorm_fwd_##dt(const T* x, const T* scale, const T* bias, T* y,     \
                                         float* mean_out, float* inv_out, long long rows,     \
                                         long long m, float eps) {                             \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            float mu, inv;                                                                     \
            tr_row_moments(xr, m, eps, &mu, &inv);                                             \
            if (mean_out) mean_out[r] = mu;                                                    \
            if (inv_out) inv_out[r] = inv;                                                     \
            for (long long k = 0; k < m; ++k) {                                                \
                float v = (tr_get(xr, k) - mu) * inv * tr_get(scale, k);                       \
                tr_put(y, r * m + k, bias ? v + tr_get(bias, k) : v);                          \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* LayerNormGrad, gx per row: xhat = (x - mean) inv, g = gy scale,                        \
       gx = inv (g - mean(g) - xhat mean((g - mean(g)) xhat)); the row's mean / inv into       \
       mean_out / inv_out (float32) for tr_layernorm_bwd_params */                            \
    TR_KERNEL void tr_layernorm_bwd_dx_##dt(const T* gy, const T* x, const T* scale, T* gx,   \
                                            float* mean_out, float* inv_out, long long rows,  \
                                            long long m, float eps) {                          \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            const T* gr = gy + r * m;                                                          \
            float mu, inv;                                                                     \
            tr_row_moments(xr, m, eps, &mu, &inv);                                             \
            mean_out[r] = mu;                                                                  \
            inv_out[r] = inv;                                                                  \
            if (!gx) continue;                                                                 \
            double sg = 0.0;                                                                   \
            for (long long k = 0; k < m; ++k) sg += (double)(tr_get(gr, k) * tr_get(scale, k)); \
            float mg = (float)(sg / (double)m);                                                \
            double sgx = 0.0;                                                                  \
            for (long long k = 0; k < m; ++k) {                                                \
                float g = tr_get(gr, k) * tr_get(scale, k) - mg;                               \
                sgx += (double)(g * ((tr_get(xr, k) - mu) * inv));                             \
            }                                                                                  \
            float mgx = (float)(sgx / (double)m);                                              \
            for (long long k = 0; k < m; ++k) {                                                \
                float g = tr_get(gr, k) * tr_get(scale, k) - mg;                               \
                float xh = (tr_get(xr, k) - mu) * inv;                                         \
                tr_put(gx, r * m + k, (g - xh * mgx) * inv);                                   \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* gscale[k] = sum_r gy xhat, gbias[k] = sum_r gy (either may be null), from the rows'    \
       mean / inv of tr_layernorm_bwd_dx */                                                    \
    TR_KERNEL void tr_layernorm_bwd_params_##dt(const T* gy, const T* x, const float* mean,   \
                                                const float* inv, T* gscale, T* gbias,         \
                                                long long rows, long long m) {                 \
        TR_GRID_STRIDE(k, m) {                                                                 \
            double ss = 0.0, sb = 0.0;                                                         \
            for (long long r = 0; r < rows; ++r) {                                             \
                float g = tr_get(gy, r * m + k);                                               \
                ss += (double)(g * ((tr_get(x, r * m + k) - mean[r]) * inv[r]));               \
                sb += (double)g;                                                               \
            }                                                                                  \
            if (gscale) tr_put(gscale, k, (float)ss);                                          \
            if (gbias) tr_put(gbias, k, (float)sb);                                            \
        }                                                                                      \
    }

// the running statistics' sums of squares: a block's 256 lanes are TR_BN_TILE consecutive
// channels (one row's channels read together) by TR_BN_ROW_LANES rows
#define TR_BN_TILE 32
#define TR_BN_ROW_LANES (TR_RED_BLOCK / TR_BN_TILE)

// ONNX's running statistics from tr_bn_running_<dt>'s per-chunk sums (one thread per channel,
// the chunks in order): var = sum / rows, the biased batch variance;
// new_rm = rm * momentum + mean * mean_coef, new_rv = rv * momentum + var * var_coef
// (var_coef carries PyTorch's count / (count - 1) where asked)
TR_KERNEL void tr_bn_running_finish(const double* partial, const float* mean, const float* rm,
                                    const float* rv, float* new_rm, float* new_rv,
                                    long long rows, long long c, long long chunks,
                                    float momentum, float mean_coef, float var_coef) {
    TR_GRID_STRIDE(ch, c) {
        double acc = 0.0;
        for (long long k = 0; k < chunks; ++k) acc += partial[k * c + ch];
        float var = (float)(acc / (double)rows);
        new_rm[ch] = rm[ch] * momentum + mean[ch] * mean_coef;
        new_rv[ch] = rv[ch] * momentum + var * var_coef;
    }
}

#define TR_BATCHNORM(T, dt)                                                                    \
    /* sums of (x - mean)^2 of channels-last x ([rows, ld], c channels) over row chunks of     \
       chunk_rows: partial[k, ch] (fp64) for chunk k; one block per (chunk, TR_BN_TILE          \
       channels), grid-stride; tr_bn_running_finish turns them into the running statistics */ \
    TR_KERNEL void tr_bn_running_##dt(const T* x, const float* mean, double* partial,          \
                                      long long rows, long long c, long long ld,               \
                                      long long chunks, long long chunk_rows) {                \
        TR_SHARED double part[TR_RED_BLOCK];                                                   \
        long long tiles = (c + TR_BN_TILE - 1) / TR_BN_TILE;                                   \
        TR_BLOCK_STRIDE(u, chunks * tiles) {                                                   \
            long long k = u / tiles, ch0 = (u % tiles) * TR_BN_TILE;                           \
            long long lo = k * chunk_rows, hi = lo + chunk_rows < rows ? lo + chunk_rows : rows; \
            TR_LANES(t) {                                                                      \
                long long ch = ch0 + t % TR_BN_TILE;                                           \
                double acc = 0.0;                                                              \
                if (ch < c) {                                                                  \
                    float mu = mean[ch];                                                       \
                    for (long long r = lo + t / TR_BN_TILE; r < hi; r += TR_BN_ROW_LANES) {    \
                        double d = (double)(tr_get(x, r * ld + ch) - mu);                      \
                        acc += d * d;                                                          \
                    }                                                                          \
                }                                                                              \
                part[t] = acc;                                                                 \
            }                                                                                  \
            tr_block_tree_sum(part, TR_BN_TILE);                                               \
            TR_LANES(t) {                                                                      \
                if (t < TR_BN_TILE && ch0 + t < c) partial[k * c + ch0 + t] = part[t];         \
            }                                                                                  \
            TR_SYNC();                                                                         \
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
    }
