// The training step's loss scaling and step guard (family "amp", its table beside the
// optimizers' in tr_onnx/backends/cuda/ops/optimizers.py): the kernels of the ai.tr_onnx ops
// ScaleClipGrad's unscaling, LossScaleUpdate, StepCheck, StepAdvance, StepReport and of the
// guarded Assign / ZeroFill, whose flags are the nodes' declared inputs
// (tr_onnx/ops/optimizers.py). tr_unscale_check_<dt> reads fp32/fp16/bf16 storage; the others
// work on float32 flags, the float32 scale, the int32 growth tracker, int64 step counters and
// 4-byte words in the arena (C signatures below).
//
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
//    left set, so the host can read it after the step to learn it was skipped; the next step's
//    StepCheck (or, for a plan without the guard, a ZeroFill at the start of the next apply
//    phase) clears it. Flags and scale live in the arena.
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

// Data parallelism (GradAllReduce, tr_onnx/backends/cuda/ops/collective.py): a rank whose
// loss is not finite fills its gradients with NaN before the all-reduce, so every rank's sum
// is NaN and every rank's step guard drops the same step (loss - loss: NaN for inf and NaN).
#define TR_POISON_NONFINITE(T, dt)                                                             \
    TR_KERNEL void tr_poison_nonfinite_##dt(T* g, long long n, const float* loss) {           \
        float v = *loss;                                                                       \
        if (tr_isfinite(v)) return;                                                            \
        TR_GRID_STRIDE(i, n) tr_put(g, i, v - v);                                              \
    }

TR_KERNEL void tr_step_advance(long long* step, const float* found_inf) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && !(found_inf && *found_inf != 0.0f)) *step += 1;
}

TR_KERNEL void tr_loss_scale_update(float* scale, float* inv_scale, int* growth_tracker,
                                    const float* found_inf, double growth_factor,
                                    double backoff_factor, int growth_interval,
                                    const float* reject) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (reject && *reject != 0.0f) return;  // a rejected step (step guard) is no step at all
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

// ---- the step guard: a training step as one graph decides on the device whether the batch
// is kept (tr_onnx/training/train_pass.py add_step_guard, CudaExecutor.run_step). bad is a
// float32 flag in the arena (__bad_batch), set by StepCheck after the backward pass with
// tr_unscale_check and a null inv_scale (the loss; the GRAD span too without loss scaling).
TR_KERNEL void tr_flag_or(float* dst, const float* src) {  // *dst = 1 when *src is set
    if (blockIdx.x == 0 && threadIdx.x == 0 && *src != 0.0f) *dst = 1.0f;
}

// dst = src unless *flag (the commit phase's running statistics), as 4-byte words
TR_KERNEL void tr_copy_unless_b4(unsigned int* dst, const unsigned int* src, long long words,
                                 const float* flag) {
    if (flag && *flag != 0.0f) return;
    TR_GRID_STRIDE(i, words) dst[i] = src[i];
}

// dst = 0 when *flag (a bad batch's gradients, and the micro-batches accumulated before it)
TR_KERNEL void tr_zero_if_b4(unsigned int* dst, long long words, const float* flag) {
    if (*flag == 0.0f) return;
    TR_GRID_STRIDE(i, words) dst[i] = 0u;
}

// A step launched before the host knew whether the previous one was applied carries the
// step number the host assumed: reject = (step != applied + 1), and a rejected step is a bad
// one (nothing committed or applied) that the host launches again with the right inputs.
TR_KERNEL void tr_step_check(const long long* step, const long long* applied, float* reject,
                             float* bad) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *reject = *step != *applied + 1 ? 1.0f : 0.0f;
    if (*reject != 0.0f) *bad = 1.0f;
}

// out[0..4] = loss, bad, found_inf, grad norm, reject (a null pointer reads 0): what the host
// reads back after a step
TR_KERNEL void tr_step_report(const float* loss, const float* bad, const float* found_inf,
                              const float* norm, const float* reject, float* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    out[0] = *loss;
    out[1] = bad ? *bad : 0.0f;
    out[2] = found_inf ? *found_inf : 0.0f;
    out[3] = norm ? *norm : 0.0f;
    out[4] = reject ? *reject : 0.0f;
}
