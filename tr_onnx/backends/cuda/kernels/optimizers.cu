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
// tr_scale_clip_norm_<dt>(g, n, scale, norm, max_norm)
//     g *= *scale, *norm = ||g||, then clip_grad_norm_ over the whole GRAD span: one block
//     of TR_CLIP_BLOCK threads (a block reduction; the other blocks return).
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

#if defined(__CUDACC__)
#define TR_SHARED __shared__
#define TR_SYNC() __syncthreads()
#else  // the host build's single "thread"
#define TR_SHARED static
#define TR_SYNC() ((void)0)
#endif
#define TR_CLIP_BLOCK 256  // the block size tr_scale_clip_norm_<dt> must be launched with

#define TR_SCALE_CLIP_NORM(T, dt)                                                              \
    /* g *= *scale (when not 1); *norm = ||g||; if max_norm > 0 and the norm exceeds it,       \
       g *= max_norm / (norm + 1e-6) (clip_grad_norm_). One block of TR_CLIP_BLOCK threads:    \
       the whole GRAD span in one launch, no grid-wide sync needed. */                         \
    TR_KERNEL void tr_scale_clip_norm_##dt(T* g, long long n, const float* scale, float* norm, \
                                           double max_norm) {                                  \
        TR_SHARED double part[TR_CLIP_BLOCK];                                                  \
        TR_SHARED float coef_shared;                                                           \
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
        TR_SYNC();                                                                             \
        if (t == 0) {                                                                          \
            double total = 0.0;                                                                \
            for (unsigned k = 0; k < blockDim.x; ++k) total += part[k];                        \
            double nrm = sqrt(total);                                                          \
            *norm = (float)nrm;                                                                \
            double coef = max_norm > 0.0 ? max_norm / (nrm + 1e-6) : 1.0;                      \
            coef_shared = coef < 1.0 ? (float)coef : 1.0f;                                     \
        }                                                                                      \
        TR_SYNC();                                                                             \
        float cf = coef_shared;                                                                \
        if (cf != 1.0f)                                                                        \
            for (long long i = t; i < n; i += blockDim.x) tr_put(g, i, tr_get(g, i) * cf);     \
    }
