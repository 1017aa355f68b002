// Fused optimizer updates over a whole flat span (the PARAM region and its GRAD/state mirrors):
// fp32 master weights and state, gradients of storage type <dt>, and an optional copy of the
// updated weights in <dt> (the fp16/bf16 weights the forward reads) written in the same pass.
// lr (float32) and step (int64) are read from the arena, so a captured graph replays with the
// values of the step; found_inf (nullable, dynamic loss scaling) skips the whole update.
// Null buf/copy pointers: no momentum buffer / no copy.
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
