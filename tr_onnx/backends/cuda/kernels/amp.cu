// Dynamic loss scaling, as torch.amp.GradScaler with torch's kernels:
// 1. tr_unscale_check_<dt>(g, n, inv_scale, found_inf): found_inf = 1 if any g is not finite;
//    g *= inv_scale (_amp_foreach_non_finite_check_and_unscale_). One launch per region.
//    A null inv_scale only checks (g is not written): the cuda executor's all_finite clears a
//    4-byte flag in WORKSPACE (tr_zero_lanes_b4), launches this over the tensor and reads
//    back the flag alone.
// 2. tr_step_advance(step, found_inf): step += 1 unless found_inf (a skipped step is no step).
// 3. the optimizer update (skips itself when found_inf).
// 4. tr_loss_scale_update(...): backoff on found_inf, growth after growth_interval good steps
//    (_amp_update_scale_); writes inv_scale = 1/scale (in double, as GradScaler). found_inf is
//    left set, so the host can read the 4 bytes after the step to learn it was skipped; the
//    cuda executor clears it (tr_zero_lanes_b4) at the start of the next apply phase. Flags
//    and scale live in the arena.
#include "elementwise.cuh"

#define TR_UNSCALE_CHECK(T, dt)                                                                \
    TR_KERNEL void tr_unscale_check_##dt(T* g, long long n, const float* inv_scale,           \
                                         float* found_inf) {                                   \
        float inv = inv_scale ? *inv_scale : 1.0f;                                             \
        TR_GRID_STRIDE(i, n) {                                                                 \
            float v = tr_get(g, i);                                                            \
            if (!tr_isfinite(v)) *found_inf = 1.0f;                                            \
            if (inv != 1.0f) tr_put(g, i, v * inv);                                            \
        }                                                                                      \
    }

TR_KERNEL void tr_step_advance(long long* step, const float* found_inf) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !(found_inf && *found_inf != 0.0f)) *step += 1;
}

TR_KERNEL void tr_loss_scale_update(float* scale, float* inv_scale, int* growth_tracker,
                                    const float* found_inf, double growth_factor,
                                    double backoff_factor, int growth_interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (*found_inf != 0.0f) {
        *scale = (float)(*scale * backoff_factor);
        *growth_tracker = 0;
    } else {
        int successful = *growth_tracker + 1;
        if (successful == growth_interval) {
            float grown = (float)(*scale * growth_factor);
            if (tr_isfinite(grown)) *scale = grown;
            *growth_tracker = 0;
        } else {
            *growth_tracker = successful;
        }
    }
    *inv_scale = (float)(1.0 / (double)*scale);
}
