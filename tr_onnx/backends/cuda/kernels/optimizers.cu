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

// ---- ai.onnx.preview.training Adam / Momentum / Adagrad ----------------------------------------
// The ONNX ops as ops/optimizers.py's preview_*_numpy compute them (functional: new tensors
// out, float32), one (X, G, V[, H]) tuple per launch. NumPy rounds the Python scalars of the
// formulas to float32 (weak scalars) and evaluates each product and sum in float32 in the
// formula's order; so do these (no FMA), and the step's scalars (r_adj, r_t, from R and T read
// on the device) are formed in double as Python forms them, then rounded once.
// tr_preview_adam_f32(x, g, v, h, x_new, v_new, h_new, n, r, t, alpha, beta, eps, norm_coef,
//                     norm_coef_post)
// tr_preview_momentum_f32(x, g, v, x_new, v_new, n, r, t, alpha, beta, norm_coef, nesterov)
// tr_preview_adagrad_f32(x, g, h, x_new, h_new, n, r, t, decay_factor, eps, norm_coef)
TR_KERNEL void tr_preview_adam_f32(const float* x, const float* g, const float* v,
                                   const float* h, float* x_new, float* v_new, float* h_new,
                                   long long n, const float* r, const long long* t,
                                   double alpha, double beta, double eps, double norm_coef,
                                   double norm_coef_post) {
    double rd = *r, td = (double)*t;
    float r_adj = (float)(*t > 0 ? rd * sqrt(1.0 - pow(beta, td)) / (1.0 - pow(alpha, td)) : rd);
    float a = (float)alpha, a1 = (float)(1.0 - alpha), b = (float)beta, b1 = (float)(1.0 - beta);
    float e = (float)eps, nc = (float)norm_coef, keep = (float)(1.0 - norm_coef_post);
    TR_GRID_STRIDE(i, n) {
        float g_reg = nc * x[i] + g[i];
        float vi = a * v[i] + a1 * g_reg;
        float hi = b * h[i] + b1 * g_reg * g_reg;
        float h_sqrt = sqrtf(hi) + e;
        x_new[i] = keep * (x[i] - r_adj * (vi / h_sqrt));
        v_new[i] = vi;
        h_new[i] = hi;
    }
}

TR_KERNEL void tr_preview_momentum_f32(const float* x, const float* g, const float* v,
                                       float* x_new, float* v_new, long long n, const float* r,
                                       const long long* t, double alpha, double beta,
                                       double norm_coef, int nesterov) {
    float rf = *r, a = (float)alpha, b = *t > 0 ? (float)beta : 1.0f, nc = (float)norm_coef;
    TR_GRID_STRIDE(i, n) {
        float g_reg = nc * x[i] + g[i];
        float vi = a * v[i] + b * g_reg;
        x_new[i] = x[i] - rf * (nesterov ? g_reg + a * vi : vi);
        v_new[i] = vi;
    }
}

TR_KERNEL void tr_preview_adagrad_f32(const float* x, const float* g, const float* h,
                                      float* x_new, float* h_new, long long n, const float* r,
                                      const long long* t, double decay_factor, double eps,
                                      double norm_coef) {
    float r_t = (float)((double)*r / (1.0 + (double)*t * decay_factor));
    float e = (float)eps, nc = (float)norm_coef;
    TR_GRID_STRIDE(i, n) {
        float g_reg = nc * x[i] + g[i];
        float hi = h[i] + g_reg * g_reg;
        x_new[i] = x[i] - r_t * g_reg / (sqrtf(hi) + e);
        h_new[i] = hi;
    }
}
