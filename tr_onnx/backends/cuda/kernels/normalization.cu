// Normalizations (tr_onnx/ops/normalization.py): LayerNormalization and its backward
// (LayerNormGrad), Instance/GroupNormalization and GroupNormGrad, MeanVarianceNormalization,
// LpNormalization, and BatchNormalization beside cuDNN's training graph: inference with fixed
// statistics, ONNX's running statistics (biased variance) from x and the batch mean cuDNN
// saved, and synchronised BatchNorm's training kernels (sync_batchnorm, no cuDNN).
// fp32/fp16/bf16 storage of x and y, float32 statistics and BatchNorm parameters, fp32
// compute (fp64 sums).
// LayerNormalization over rows of m elements (the normalized axes flattened, compact):
// tr_layernorm_fwd_<dt>(x, scale, bias, y, mean_out, inv_out, rows, m, eps)
// tr_layernorm_bwd_dx_<dt>(gy, x, scale, gx, mean_out, inv_out, rows, m, eps)
// tr_layernorm_bwd_params_<dt>(gy, x, mean, inv, gscale, gbias, rows, m)
//     one thread per row (fwd, bwd_dx) or per normalized element (bwd_params); the row's mean
//     and 1/sqrt(var + eps) pass from bwd_dx to bwd_params through float32 scratch.
// BatchNormalization, channels-last x as rows of ld lanes, c channels (fp64 per-chunk sums,
// chunks of chunk_rows rows: one block per (chunk, 32 channels), a fixed-order block reduction,
// so deterministic; tr_bn_sum_chunks adds a channel's chunks in order):
// tr_bn_running_<dt>(x, mean, partial, rows, c, ld, chunks, chunk_rows)
//     each chunk's sum of (x - mean)^2 per channel into fp64 partial[chunks, c]
// tr_bn_running_finish(partial, mean, rm, rv, new_rm, new_rv, rows, c, chunks, momentum,
//                      mean_coef, var_coef)   one thread per channel, the chunks in order
// tr_bn_infer_<dt>(x, scale, bias, mean, var, y, n, c, ld, eps)   one thread per element
// Synchronised BatchNorm (sync_batchnorm: statistics over every rank's batch; the bindings put
// an NCCL all-reduce of the fp64 sums between these kernels):
// tr_bn_sums_<dt>(x, partial, rows, c, ld, chunks, chunk_rows)     partial[chunks, c] of x
// tr_bn_sum_chunks(partial, out, width, chunks, n, count)
//     out[j] = the chunks' total of column j < width; out[width] = count when n > width
// tr_bn_sync_mean(sums, mean, c)                                   mean = sums[:c] / sums[c]
// tr_bn_sync_finish(sums, sq, mean, rm, rv, inv, new_rm, new_rv, c, momentum, mean_coef,
//                   var_coef, unbiased, eps)   inv_std and the running statistics
// tr_bn_normalize_<dt>(x, scale, bias, mean, inv, y, n, c, ld)     y = (x - mean) scale inv + bias
// tr_bn_grad_sums_<dt>(gy, x, mean, partial, rows, c, ld, chunks, chunk_rows)
//     partial[chunks, 2c]: sums of gy (x - mean), then of gy
// tr_bn_grad_params(sums, inv, gscale, gbias, c)   this rank's gscale, gbias (either may be null)
// tr_bn_grad_dx_<dt>(gy, x, scale, mean, inv, sums, gx, n, c, ld)
//     gx from the world's [sum gy (x - mean) | sum gy | count]
// Instance/GroupNormalization over [N, S, C] maps, each operand by its element strides
// (<p>n, <p>s, <p>c: channels-last or compact), groups of cg channels, scale / bias one per
// per_param channels; one block per (sample, group) unit, fp64 lane sums and a fixed-order tree
// (deterministic); an output's padded lanes (<p>cp lanes) written 0:
// tr_groupnorm_fwd_<dt>(x, scale, bias, y, n, s, c, cg, per_param, eps, x*, y*, ycp)
// tr_groupnorm_bwd_dx_<dt>(gy, x, scale, gx, mean_out, inv_out, n, s, c, cg, per_param, eps,
//                          x*, gy*, gx*, gxcp)  the units' mean / inv into float32 scratch
// tr_groupnorm_bwd_params_<dt>(gy, x, mean, inv, gscale, gbias, n, s, c, cg, per_param, lanes,
//                              x*, gy*)         one block per scale entry (or padded lane)
// MeanVarianceNormalization and LpNormalization over any axes: one block per unit of the kept
// axes (six collapsed dims and x's strides), the reduced axes likewise (TR_AXES_SPLIT_ARGS):
// tr_mvn_<dt>(x, y, units, m, kd0..5, ks0..5, rd0..5, rs0..5)
// tr_lp_norm_<dt>(x, y, units, m, p, kd0..5, ks0..5, rd0..5, rs0..5)
// The instantiations (TR_LAYERNORM(T, dt), TR_BATCHNORM(T, dt), TR_GROUPNORM(T, dt),
// TR_AXES_NORM(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"
#include "layout.cuh"
#include "strided.cuh"

// The two-pass moments every normalization here computes: fp64 sums of x, then of the fp32
// difference x - mean squared; the mean and the biased variance rounded to float32.
TR_HD double tr_centred_square(float v, float mu) {
    float d = v - mu;
    return (double)d * (double)d;
}
TR_HD float tr_mean_of(double sum, long long m) { return (float)(sum / (double)m); }

// mean and 1/sqrt(var + eps) of one row of m elements (the biased variance of x - mean)
template <class T>
TR_HD void tr_row_moments(const T* x, long long m, float eps, float* mean, float* inv) {
    double acc = 0.0;
    for (long long j = 0; j < m; ++j) acc += (double)tr_get(x, j);
    float mu = tr_mean_of(acc, m);
    double sq = 0.0;
    for (long long j = 0; j < m; ++j) sq += tr_centred_square(tr_get(x, j), mu);
    *mean = mu;
    *inv = 1.0f / sqrtf(tr_mean_of(sq, m) + eps);
}

// the block-per-unit loops stay rolled: unrolled, the kernels' loads and index arithmetic
// triple NVRTC's compile time of this family and gain nothing on memory-bound passes
#if defined(__CUDACC__)
#define TR_NO_UNROLL _Pragma("unroll 1")
#else
#define TR_NO_UNROLL
#endif

// The same moments of m values at(j) by one block (Instance/Group normalization, MVN): each
// lane adds its elements j = lane, lane + TR_RED_BLOCK, ... in order, then a fixed-order tree
// (deterministic). Every thread of the block calls it and gets the mean and the biased variance.
template <class At>
TR_HD void tr_block_moments(const At& at, long long m, float* mean, float* var) {
    TR_SHARED double part[TR_RED_BLOCK];
    TR_LANES(t) {
        double acc = 0.0;
        TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) acc += (double)at(j);
        part[t] = acc;
    }
    tr_block_tree_sum(part, 1);
    float mu = tr_mean_of(part[0], m);
    TR_SYNC();  // every thread has read part[0] before the lanes refill it
    TR_LANES(t) {
        double sq = 0.0;
        TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {
            sq += tr_centred_square(at(j), mu);
        }
        part[t] = sq;
    }
    tr_block_tree_sum(part, 1);
    *mean = mu;
    *var = tr_mean_of(part[0], m);
    TR_SYNC();
}

// The block's fixed-order totals of two per-lane fp64 values (lanes fill a[t], b[t] first)
TR_HD void tr_block_sums2(double* a, double* b, double* sa, double* sb) {
    tr_block_tree_sum(a, 1);
    tr_block_tree_sum(b, 1);
    *sa = a[0];
    *sb = b[0];
    TR_SYNC();
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

// the per-chunk sums: a block's 256 lanes are TR_BN_TILE consecutive channels (one row's
// channels read together) by TR_BN_ROW_LANES rows
#define TR_BN_TILE 32
#define TR_BN_ROW_LANES (TR_RED_BLOCK / TR_BN_TILE)

// partial[k * width + ch] (fp64) = the sum of term(r, ch) over chunk k's rows (chunk_rows of
// them, the last chunk ragged), ch < c: one block per (chunk, TR_BN_TILE channels),
// grid-stride, each lane's rows in order, then a fixed-order block reduction (deterministic)
template <class Term>
TR_HD void tr_bn_chunk_sums(const Term& term, double* partial, long long width, long long rows,
                            long long c, long long chunks, long long chunk_rows) {
    TR_SHARED double part[TR_RED_BLOCK];
    long long tiles = (c + TR_BN_TILE - 1) / TR_BN_TILE;
    TR_BLOCK_STRIDE(u, chunks * tiles) {
        long long k = u / tiles, ch0 = (u % tiles) * TR_BN_TILE;
        long long lo = k * chunk_rows, hi = lo + chunk_rows < rows ? lo + chunk_rows : rows;
        TR_LANES(t) {
            long long ch = ch0 + t % TR_BN_TILE;
            double acc = 0.0;
            if (ch < c) {
                for (long long r = lo + t / TR_BN_TILE; r < hi; r += TR_BN_ROW_LANES) {
                    acc += term(r, ch);
                }
            }
            part[t] = acc;
        }
        tr_block_tree_sum(part, TR_BN_TILE);
        TR_LANES(t) {
            if (t < TR_BN_TILE && ch0 + t < c) partial[k * width + ch0 + t] = part[t];
        }
        TR_SYNC();
    }
}

// the terms tr_bn_chunk_sums adds, over a channels-last map of rows of ld lanes: v itself,
// (x - mean)^2 and gy (x - mean) (the difference in fp32, as the kernels read x)
template <class T> struct tr_bn_value {
    const T* v;
    long long ld;
    TR_HD double operator()(long long r, long long ch) const {
        return (double)tr_get(v, r * ld + ch);
    }
};
template <class T> struct tr_bn_square {
    const T* x;
    const float* mean;
    long long ld;
    TR_HD double operator()(long long r, long long ch) const {
        double d = (double)(tr_get(x, r * ld + ch) - mean[ch]);
        return d * d;
    }
};
template <class T> struct tr_bn_product {
    const T* gy;
    const T* x;
    const float* mean;
    long long ld;
    TR_HD double operator()(long long r, long long ch) const {
        return (double)tr_get(gy, r * ld + ch) * (double)(tr_get(x, r * ld + ch) - mean[ch]);
    }
};

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

// the chunks' totals of partial[chunks, width], each column's chunks in order; then the row
// count (the all-reduce that follows sums the ranks' counts with their sums)
TR_KERNEL void tr_bn_sum_chunks(const double* partial, double* out, long long width,
                                long long chunks, long long n, long long count) {
    TR_GRID_STRIDE(j, n) {
        double acc = 0.0;
        for (long long k = 0; k < chunks && j < width; ++k) acc += partial[k * width + j];
        out[j] = j < width ? acc : (double)count;
    }
}

// the world's batch mean from its [sums | count]
TR_KERNEL void tr_bn_sync_mean(const double* sums, float* mean, long long c) {
    TR_GRID_STRIDE(ch, c) mean[ch] = (float)(sums[ch] / sums[c]);
}

// from the world's count (sums[c]) and sums of squares sq: the biased variance, its
// 1 / sqrt(var + eps) (inv) and, where new_rm / new_rv are not null, the running statistics
// rm * momentum + mean * mean_coef and rv * momentum + var * (var_coef [* count / (count - 1)
// when unbiased]), the factor in fp64 and then rounded, as the NumPy kernel's
TR_KERNEL void tr_bn_sync_finish(const double* sums, const double* sq, const float* mean,
                                 const float* rm, const float* rv, float* inv, float* new_rm,
                                 float* new_rv, long long c, float momentum, float mean_coef,
                                 double var_coef, int unbiased, float eps) {
    TR_GRID_STRIDE(ch, c) {
        double count = sums[c];
        float var = (float)(sq[ch] / count);
        inv[ch] = 1.0f / sqrtf(var + eps);
        double factor = unbiased ? var_coef * (count / fmax(count - 1.0, 1.0)) : var_coef;
        if (new_rm) new_rm[ch] = rm[ch] * momentum + mean[ch] * mean_coef;
        if (new_rv) new_rv[ch] = rv[ch] * momentum + var * (float)factor;
    }
}

// this rank's gscale = inv * sum gy (x - mean), gbias = sum gy (torch.nn.SyncBatchNorm's: the
// gradient all-reduce averages them over the ranks with the other parameters' gradients)
TR_KERNEL void tr_bn_grad_params(const double* sums, const float* inv, float* gscale,
                                 float* gbias, long long c) {
    TR_GRID_STRIDE(ch, c) {
        if (gscale) gscale[ch] = (float)sums[ch] * inv[ch];
        if (gbias) gbias[ch] = (float)sums[c + ch];
    }
}

#define TR_BATCHNORM(T, dt)                                                                    \
    /* sums of (x - mean)^2 of channels-last x ([rows, ld], c channels) over row chunks of     \
       chunk_rows: partial[k, ch] (fp64) for chunk k; tr_bn_running_finish turns them into   \
       the running statistics, tr_bn_sum_chunks into a synchronised BatchNorm's variance */   \
    TR_KERNEL void tr_bn_running_##dt(const T* x, const float* mean, double* partial,          \
                                      long long rows, long long c, long long ld,               \
                                      long long chunks, long long chunk_rows) {                \
        tr_bn_chunk_sums(tr_bn_square<T>{x, mean, ld}, partial, c, rows, c, chunks,            \
                         chunk_rows);                                                          \
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
    /* per-chunk sums of x: partial[k, ch] (fp64), as tr_bn_running_##dt's */                 \
    TR_KERNEL void tr_bn_sums_##dt(const T* x, double* partial, long long rows, long long c,  \
                                   long long ld, long long chunks, long long chunk_rows) {    \
        tr_bn_chunk_sums(tr_bn_value<T>{x, ld}, partial, c, rows, c, chunks, chunk_rows);     \
    }                                                                                          \
    /* training BatchNormalization with given statistics, as the numpy kernel:                \
       y = (x - mean) * (scale * inv) + bias; lanes ch >= c are written 0 */                  \
    TR_KERNEL void tr_bn_normalize_##dt(const T* x, const float* scale, const float* bias,    \
                                        const float* mean, const float* inv, T* y,            \
                                        long long n, long long c, long long ld) {             \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long ch = j % ld;                                                             \
            tr_put(y, j, ch < c ? (tr_get(x, j) - mean[ch]) * (scale[ch] * inv[ch]) + bias[ch] \
                                : 0.0f);                                                       \
        }                                                                                      \
    }                                                                                          \
    /* per-chunk sums of gy (x - mean) (columns [0, c)) and of gy (columns [c, 2c)):           \
       partial[k, 2c] (fp64) */                                                                \
    TR_KERNEL void tr_bn_grad_sums_##dt(const T* gy, const T* x, const float* mean,           \
                                        double* partial, long long rows, long long c,         \
                                        long long ld, long long chunks, long long chunk_rows) { \
        tr_bn_chunk_sums(tr_bn_product<T>{gy, x, mean, ld}, partial, 2 * c, rows, c, chunks,   \
                         chunk_rows);                                                          \
        tr_bn_chunk_sums(tr_bn_value<T>{gy, ld}, partial + c, 2 * c, rows, c, chunks,          \
                         chunk_rows);                                                          \
    }                                                                                          \
    /* BatchNormGrad (training) from the world's sums = [sum gy (x - mean) | sum gy | M]:     \
       gx = scale inv (gy - sum gy / M - (x - mean) inv^2 sum gy (x - mean) / M), as the numpy \
       kernel; lanes ch >= c are written 0 */                                                 \
    TR_KERNEL void tr_bn_grad_dx_##dt(const T* gy, const T* x, const float* scale,            \
                                      const float* mean, const float* inv, const double* sums, \
                                      T* gx, long long n, long long c, long long ld) {        \
        double per_row = 1.0 / sums[2 * c];                                                    \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long ch = j % ld;                                                             \
            float v = 0.0f;                                                                    \
            if (ch < c) {                                                                      \
                float k = (float)(sums[ch] * per_row) * inv[ch] * inv[ch];                     \
                float t = (tr_get(x, j) - mean[ch]) * k + (float)(sums[c + ch] * per_row);    \
                v = (tr_get(gy, j) - t) * (scale[ch] * inv[ch]);                               \
            }                                                                                  \
            tr_put(gx, j, v);                                                                  \
        }                                                                                      \
    }

// ---- Instance / Group normalization -------------------------------------------------------
// Each operand is a tr_map (layout.cuh) of its own: the layout pass may hand GroupNormGrad a
// channels-last gy beside a compact x.

// a / b for 0 <= a, b < 2^32 (the bindings check the sizes): 32-bit division, far less code
// than 64-bit division in every loop
TR_HD long long tr_udiv(long long a, long long b) { return (unsigned)a / (unsigned)b; }

// Element j of a unit of s positions by k channels, the unit-stride axis of x fastest:
// j = q * inner + r with r a channel when x is channels-last (sc == 1), else a position.
struct tr_gn_walk {
    long long inner;
    bool channels_inner;
    TR_HD tr_gn_walk(long long s, long long k, const tr_map& x)
        : inner(x.sc == 1 ? k : s), channels_inner(x.sc == 1) {}
    // (position, channel offset within the unit) of element j
    TR_HD void pos(long long j, long long* si, long long* ci) const {
        long long q = tr_udiv(j, inner), r = j - q * inner;
        *si = channels_inner ? q : r;
        *ci = channels_inner ? r : q;
    }
};

template <class T> struct tr_gn_values {
    const T* x;
    tr_map map;
    tr_gn_walk walk;
    long long n, ch0;
    TR_HD float operator()(long long j) const {
        long long si, ci;
        walk.pos(j, &si, &ci);
        return tr_get(x, map.at(n, si, ch0 + ci));
    }
};

// the padded lanes [c, cp) of sample n's s positions of a channels-last map, written 0 by the
// block of the sample's last group, so an output in recycled scratch keeps them zero
template <class T>
TR_HD void tr_gn_zero_lanes(T* y, const tr_map& map, long long n, long long s, long long c,
                            long long cp) {
    long long pads = cp - c;
    TR_LANES(t) {
        TR_NO_UNROLL for (long long j = t; j < s * pads; j += TR_RED_BLOCK) {
            long long si = tr_udiv(j, pads);
            tr_put(y, map.at(n, si, c + j - si * pads), 0.0f);
        }
    }
}

#define TR_GROUPNORM(T, dt)                                                                    \
    /* Instance/GroupNormalization: one block per (sample, group) unit of m = s * cg          \
       elements, y = (x - mean) / sqrt(var + eps) * scale + bias as the numpy kernel; scale   \
       and bias hold one value per channel (per_param 1) or per group (per_param cg:          \
       GroupNormalization-18); y has ycp channel lanes */                                     \
    TR_KERNEL void tr_groupnorm_fwd_##dt(const T* x, const T* scale, const T* bias, T* y,      \
                                         long long n, long long s, long long c, long long cg,  \
                                         long long per_param, float eps, TR_MAP_ARGS(x),       \
                                         TR_MAP_ARGS(y), long long ycp) {                      \
        const tr_map xm = TR_MAP(x), ym = TR_MAP(y);                                           \
        const tr_gn_walk walk(s, cg, xm);                                                      \
        long long groups = c / cg, m = s * cg;                                                 \
        TR_BLOCK_STRIDE(u, n * groups) {                                                       \
            long long ni = tr_udiv(u, groups), g = u - ni * groups;                            \
            float mu, var;                                                                     \
            tr_block_moments(tr_gn_values<T>{x, xm, walk, ni, g * cg}, m, &mu, &var);          \
            float sd = sqrtf(var + eps);                                                       \
            TR_LANES(t) {                                                                      \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    long long si, ci;                                                          \
                    walk.pos(j, &si, &ci);                                                     \
                    long long ch = g * cg + ci, p = per_param == 1 ? ch : g;                   \
                    float v = (tr_get(x, xm.at(ni, si, ch)) - mu) / sd * tr_get(scale, p)      \
                              + tr_get(bias, p);                                               \
                    tr_put(y, ym.at(ni, si, ch), v);                                           \
                }                                                                              \
            }                                                                                  \
            if (g == groups - 1) tr_gn_zero_lanes(y, ym, ni, s, c, ycp);                       \
            TR_SYNC();                                                                         \
        }                                                                                      \
    }                                                                                          \
    /* GroupNormGrad, gx per unit: xhat = (x - mean) inv, g = gy scale,                       \
       gx = (g - xhat mean(g xhat) - mean(g)) inv as the numpy kernel; the unit's mean and    \
       inv (float32) into mean_out / inv_out for tr_groupnorm_bwd_params (gx may be null) */  \
    TR_KERNEL void tr_groupnorm_bwd_dx_##dt(const T* gy, const T* x, const T* scale, T* gx,   \
                                            float* mean_out, float* inv_out, long long n,     \
                                            long long s, long long c, long long cg,           \
                                            long long per_param, float eps, TR_MAP_ARGS(x),   \
                                            TR_MAP_ARGS(gy), TR_MAP_ARGS(gx), long long gxcp) { \
        TR_SHARED double sg[TR_RED_BLOCK], sgx[TR_RED_BLOCK];                                  \
        const tr_map xm = TR_MAP(x), gym = TR_MAP(gy), gxm = TR_MAP(gx);                       \
        const tr_gn_walk walk(s, cg, xm);                                                      \
        long long groups = c / cg, m = s * cg;                                                 \
        TR_BLOCK_STRIDE(u, n * groups) {                                                       \
            long long ni = tr_udiv(u, groups), g = u - ni * groups;                            \
            float mu, var;                                                                     \
            tr_block_moments(tr_gn_values<T>{x, xm, walk, ni, g * cg}, m, &mu, &var);          \
            float inv = 1.0f / sqrtf(var + eps);                                               \
            TR_LANES(t) {                                                                      \
                if (t == 0) {                                                                  \
                    mean_out[u] = mu;                                                          \
                    inv_out[u] = inv;                                                          \
                }                                                                              \
            }                                                                                  \
            if (!gx) continue;                                                                 \
            TR_LANES(t) {                                                                      \
                double a = 0.0, b = 0.0;                                                       \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    long long si, ci;                                                          \
                    walk.pos(j, &si, &ci);                                                     \
                    long long ch = g * cg + ci, p = per_param == 1 ? ch : g;                   \
                    float gv = tr_get(gy, gym.at(ni, si, ch)) * tr_get(scale, p);              \
                    a += (double)gv;                                                           \
                    b += (double)(gv * ((tr_get(x, xm.at(ni, si, ch)) - mu) * inv));           \
                }                                                                              \
                sg[t] = a;                                                                     \
                sgx[t] = b;                                                                    \
            }                                                                                  \
            double tg, tgx;                                                                    \
            tr_block_sums2(sg, sgx, &tg, &tgx);                                                \
            float m1 = (float)(tg / (double)m), m2 = (float)(tgx / (double)m);                 \
            TR_LANES(t) {                                                                      \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    long long si, ci;                                                          \
                    walk.pos(j, &si, &ci);                                                     \
                    long long ch = g * cg + ci, p = per_param == 1 ? ch : g;                   \
                    float gv = tr_get(gy, gym.at(ni, si, ch)) * tr_get(scale, p);              \
                    float xh = (tr_get(x, xm.at(ni, si, ch)) - mu) * inv;                      \
                    tr_put(gx, gxm.at(ni, si, ch), ((gv - xh * m2) - m1) * inv);               \
                }                                                                              \
            }                                                                                  \
            if (g == groups - 1) tr_gn_zero_lanes(gx, gxm, ni, s, c, gxcp);                    \
            TR_SYNC();                                                                         \
        }                                                                                      \
    }                                                                                          \
    /* gscale[p] = sum gy xhat, gbias[p] = sum gy over the samples, the spatial axes and the  \
       per_param channels of parameter p (either output may be null), one block per p, from   \
       the units' mean / inv of tr_groupnorm_bwd_dx; the vectors' padded lanes p < lanes      \
       written 0 */                                                                           \
    TR_KERNEL void tr_groupnorm_bwd_params_##dt(const T* gy, const T* x, const float* mean,   \
                                                const float* inv, T* gscale, T* gbias,         \
                                                long long n, long long s, long long c,         \
                                                long long cg, long long per_param,             \
                                                long long lanes, TR_MAP_ARGS(x),               \
                                                TR_MAP_ARGS(gy)) {                             \
        TR_SHARED double ss_[TR_RED_BLOCK], sb_[TR_RED_BLOCK];                                 \
        const tr_map xm = TR_MAP(x), gym = TR_MAP(gy);                                         \
        const tr_gn_walk walk(s, per_param, xm);                                               \
        long long groups = c / cg, per_sample = s * per_param;                                 \
        TR_BLOCK_STRIDE(p, lanes) {                                                            \
            long long count = p < c / per_param ? n * per_sample : 0;                          \
            TR_LANES(t) {                                                                      \
                double a = 0.0, b = 0.0;                                                       \
                TR_NO_UNROLL for (long long j = t; j < count; j += TR_RED_BLOCK) {             \
                    long long ni = tr_udiv(j, per_sample), si, ci;                             \
                    walk.pos(j - ni * per_sample, &si, &ci);                                   \
                    long long ch = p * per_param + ci, u = ni * groups + tr_udiv(ch, cg);      \
                    float gv = tr_get(gy, gym.at(ni, si, ch));                                 \
                    a += (double)(gv * ((tr_get(x, xm.at(ni, si, ch)) - mean[u]) * inv[u]));  \
                    b += (double)gv;                                                           \
                }                                                                              \
                ss_[t] = a;                                                                    \
                sb_[t] = b;                                                                    \
            }                                                                                  \
            double ts, tb;                                                                     \
            tr_block_sums2(ss_, sb_, &ts, &tb);                                                \
            TR_LANES(t) {                                                                      \
                if (t == 0 && gscale) tr_put(gscale, p, (float)ts);                            \
                if (t == 0 && gbias) tr_put(gbias, p, (float)tb);                              \
            }                                                                                  \
        }                                                                                      \
    }

// ---- MeanVarianceNormalization, LpNormalization over any set of axes -----------------------
// x's elements as units (the kept axes, collapsed to six dims kd with x's strides ks) by
// reductions (the reduced axes, dims rd, strides rs): one block per unit; y is laid out as x.
struct tr_axes_split {
    long long kd[6], ks[6], rd[6], rs[6];
    TR_HD long long unit(long long u) const { return tr_strided_offset(u, kd, ks); }
    TR_HD long long at(long long base, long long j) const {
        return base + tr_strided_offset(j, rd, rs);
    }
};
template <class T> struct tr_split_values {
    const T* x;
    const tr_axes_split* ax;
    long long base;
    TR_HD float operator()(long long j) const { return tr_get(x, ax->at(base, j)); }
};
// the dims and strides as scalar parameters (TR_STRIDES6 names six long longs)
#define TR_AXES_SPLIT_ARGS TR_STRIDES6(kd), TR_STRIDES6(ks), TR_STRIDES6(rd), TR_STRIDES6(rs)
#define TR_AXES_SPLIT                                                                          \
    {{kd0, kd1, kd2, kd3, kd4, kd5}, {ks0, ks1, ks2, ks3, ks4, ks5},                           \
     {rd0, rd1, rd2, rd3, rd4, rd5}, {rs0, rs1, rs2, rs3, rs4, rs5}}

#define TR_AXES_NORM(T, dt)                                                                    \
    /* MeanVarianceNormalization: y = (x - mean) / (sqrt(var) + 1e-9) per unit of m            \
       elements (the ONNX function body's epsilon), as the numpy kernel */                     \
    TR_KERNEL void tr_mvn_##dt(const T* x, T* y, long long units, long long m,                 \
                               TR_AXES_SPLIT_ARGS) {                                           \
        const tr_axes_split ax = TR_AXES_SPLIT;                                                \
        TR_BLOCK_STRIDE(u, units) {                                                            \
            long long base = ax.unit(u);                                                       \
            float mu, var;                                                                     \
            tr_block_moments(tr_split_values<T>{x, &ax, base}, m, &mu, &var);                  \
            float sd = sqrtf(var) + 1e-9f;                                                     \
            TR_LANES(t) {                                                                      \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    long long k = ax.at(base, j);                                              \
                    tr_put(y, k, (tr_get(x, k) - mu) / sd);                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* LpNormalization: y = x / ||x||_p per unit of m elements (p = 1 or 2), 0 where the       \
       norm is 0, as the numpy kernel (the fp64 sum of |x| or x^2 rounded to float32) */       \
    TR_KERNEL void tr_lp_norm_##dt(const T* x, T* y, long long units, long long m, int p,      \
                                   TR_AXES_SPLIT_ARGS) {                                       \
        TR_SHARED double part[TR_RED_BLOCK];                                                   \
        const tr_axes_split ax = TR_AXES_SPLIT;                                                \
        TR_BLOCK_STRIDE(u, units) {                                                            \
            long long base = ax.unit(u);                                                       \
            TR_LANES(t) {                                                                      \
                double acc = 0.0;                                                              \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    float v = tr_get(x, ax.at(base, j));                                       \
                    acc += p == 1 ? (double)fabsf(v) : (double)(v * v);                        \
                }                                                                              \
                part[t] = acc;                                                                 \
            }                                                                                  \
            tr_block_tree_sum(part, 1);                                                        \
            float norm = (float)part[0];                                                       \
            if (p == 2) norm = sqrtf(norm);                                                    \
            TR_SYNC();                                                                         \
            TR_LANES(t) {                                                                      \
                TR_NO_UNROLL for (long long j = t; j < m; j += TR_RED_BLOCK) {                 \
                    long long k = ax.at(base, j);                                              \
                    tr_put(y, k, norm != 0.0f ? tr_get(x, k) / norm : 0.0f);                   \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
