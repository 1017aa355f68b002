// Optimizers (tr_onnx/ops/optimizers.py): the fused parameter updates and the gradient
// scale/clip that precedes them in the apply phase.
// Fused updates over a whole flat span (the PARAM region and its GRAD/state mirrors): fp32
// master weights and state, gradients of storage type <dt>, and an optional copy of the
// updated weights in <dt> (the fp16/bf16 weights the forward reads) written in the same pass.
// lr (float32) and step (int64) are read from the arena, so a captured graph replays with the
// values of the step; found_inf (nullable, dynamic loss scaling) skips the whole update.
// Null buf/copy pointers: no momentum buffer / no copy.
// tr_sgd_<dt>(p, g, buf, copy, n, lr, step, found_inf, momentum, dampening, nesterov, wd)
// tr_adam_<dt>(p, g, m, v, copy, n, lr, step, found_inf, beta1, beta2, eps, wd, decoupled)
// tr_adagrad_<dt>(p, g, sum, copy, n, lr, step, found_inf, lr_decay, wd, eps)
// ScaleClipGrad over the whole GRAD span, deterministic (fixed summation order, no atomics):
// tr_scale_clip_norm_<dt>(g, n, scale, partial, parts, chunk)
//     g *= *scale; partial[p] = sum of g^2 over chunk p (fp64), one block per chunk
// tr_scale_clip_norm_total(partial, parts, norm, coef, max_norm)   one block
//     *norm = ||g||; *coef = the clip_grad_norm_ coefficient (1 when not clipping)
// tr_scale_clip_norm_apply_<dt>(g, n, coef)   g *= *coef unless 1, grid-stride
// The instantiations (TR_OPTIM(G, dt), TR_SCALE_CLIP_NORM(T, dt) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

#define TR_OPTIM(G, dt)                                                                        \
    TR_KERNEL void tr_sgd_##dt(float* p, const G* g, float* buf, G* copy, long long n,         \
                               const float* lr, const long long* step, const float* found_inf, \
                               double momentum, double dampening, int nesterov, double wd) {  \
        if (found_inf && *found_inf != 0.0f) return;                                           \
        TrSgd s = tr_sgd_scalars(*lr, *step, momentum, dampening, nesterov, wd);               \
        TR_GRID_STRIDE(i, n) {                                                                 \
            float pi = p[i], bi = buf ? buf[i] : 0.0f;                                         \
            tr_sgd_update(s, pi, tr_get(g, i), bi);                                            \
            p[i] = pi;                                                                         \
            if (buf) buf[i] = bi;                                                              \
            if (copy) tr_put(copy, i, pi);                                                     \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_adam_##dt(float* p, const G* g, float* m, float* v, G* copy, long long n, \
                                const float* lr, const long long* step, const float* found_inf, \
                                double beta1, double beta2, double eps, double wd,             \
                                int decoupled) {                                               \
        if (found_inf && *found_inf != 0.0f) return;                                           \
        TrAdam s = tr_adam_scalars(*lr, *step, beta1, beta2, eps, wd, decoupled);              \
        TR_GRID_STRIDE(i, n) {                                                                 \
            float pi = p[i], mi = m[i], vi = v[i];                                             \
            tr_adam_update(s, pi, tr_get(g, i), mi, vi);                                       \
            p[i] = pi;                                                                         \
            m[i] = mi;                                                                         \
            v[i] = vi;                                                                         \
            if (copy) tr_put(copy, i, pi);                                                     \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_adagrad_##dt(float* p, const G* g, float* sum, G* copy, long long n,     \
                                   const float* lr, const long long* step,                     \
                                   const float* found_inf, double lr_decay, double wd,         \
                                   double eps) {                                               \
        if (found_inf && *found_inf != 0.0f) return;                                           \
        TrAdagrad s = tr_adagrad_scalars(*lr, *step, lr_decay, wd, eps);                       \
        TR_GRID_STRIDE(i, n) {                                                                 \
            float pi = p[i], si = sum[i];                                                      \
            tr_adagrad_update(s, pi, tr_get(g, i), si);                                        \
            p[i] = pi;                                                                         \
            sum[i] = si;                                                                       \
            if (copy) tr_put(copy, i, pi);                                                     \
        }                                                                                      \
    }

#define TR_SCALE_CLIP_NORM(T, dt)                                                              \
    /* g *= *scale (when not 1) and the sums of squares of g's chunks: partial[p] over         \
       [p chunk, (p + 1) chunk) (fp64, lanes then a tree: tr_block_tree_sum), one block per    \
       chunk (grid-stride over the parts chunks) */                                           \
    TR_KERNEL void tr_scale_clip_norm_##dt(T* g, long long n, const float* scale,             \
                                           double* partial, long long parts, long long chunk) { \
        TR_SHARED double part[TR_RED_BLOCK];                                                   \
        float sc = *scale;                                                                     \
        TR_BLOCK_STRIDE(p, parts) {                                                            \
            long long lo = p * chunk, hi = lo + chunk < n ? lo + chunk : n;                    \
            TR_LANES(t) {                                                                      \
                double acc = 0.0;                                                              \
                for (long long i = lo + t; i < hi; i += TR_RED_BLOCK) {                        \
                    if (sc != 1.0f) tr_put(g, i, tr_get(g, i) * sc);                           \
                    double v = (double)tr_get(g, i);                                           \
                    acc += v * v;                                                              \
                }                                                                              \
                part[t] = acc;                                                                 \
            }                                                                                  \
            tr_block_tree_sum(part, 1);                                                        \
            if (threadIdx.x == 0) partial[p] = part[0];                                        \
            TR_SYNC();                                                                         \
        }                                                                                      \
    }                                                                                          \
    /* g *= *coef unless it is 1 (grid-stride; the coefficient of tr_scale_clip_norm_total) */ \
    TR_KERNEL void tr_scale_clip_norm_apply_##dt(T* g, long long n, const float* coef) {      \
        float cf = *coef;                                                                      \
        if (cf == 1.0f) return;                                                                \
        TR_GRID_STRIDE(i, n) tr_put(g, i, tr_get(g, i) * cf);                                  \
    }

// *norm = sqrt(sum of the parts partials, in a fixed order); *coef = max_norm / (norm + 1e-6)
// when max_norm > 0 and that is below 1 (clip_grad_norm_), else 1. One block (the others
// return).
TR_KERNEL void tr_scale_clip_norm_total(const double* partial, long long parts, float* norm,
                                        float* coef, double max_norm) {
    TR_SHARED double part[TR_RED_BLOCK];
    if (blockIdx.x != 0) return;
    TR_LANES(t) {
        double acc = 0.0;
        for (long long k = t; k < parts; k += TR_RED_BLOCK) acc += partial[k];
        part[t] = acc;
    }
    tr_block_tree_sum(part, 1);
    if (threadIdx.x == 0) {
        double nrm = sqrt(part[0]);
        *norm = (float)nrm;
        double c = max_norm > 0.0 ? max_norm / (nrm + 1e-6) : 1.0;
        *coef = c < 1.0 ? (float)c : 1.0f;
    }
}
