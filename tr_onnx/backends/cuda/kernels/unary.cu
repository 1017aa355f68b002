// Unary ops and their backward over a flat range: fp32/fp16/bf16 storage, fp32 compute
// (tr_onnx/ops/unary.py; the per-element math is elementwise.cuh's).
// tr_<op>_fwd_<dt>(x, y, n, a, b):        y = f(x; a, b)           (x == y allowed)
// tr_<op>_bwd_<dt>(x, y, gy, gx, n, a, b): gx = g(x, y, gy; a, b)  (x or y may be null when
//                                          the op's gradient does not read it), for the ops
//                                          whose gradient rule emits a named <Op>Grad node
// a, b: the op's float attributes (alpha, beta; Clip's min, max), unused ones 0.
// The math of the ops only this family runs (trigonometric, hyperbolic, rounding, Celu, Selu,
// Mish, Softsign, Shrink, ThresholdedRelu) is below, in ops/unary.py's order of operations;
// their gradient rules are chains of standard ops (Cos, Where, Mul, ...), so they have no
// backward kernel.
// tr_erf_<dt>(x, y, n): y = erf(x). Forward only: Erf's gradient rule builds IR nodes (Exp,
//                       Mul) instead of calling a backward kernel.
// The instantiations (TR_UNARY_FWD / TR_UNARY_BWD(op, T, dt), TR_ERF(T, dt) lines) are appended
// from the family's table (KERNELS in tr_onnx/backends/cuda/ops/unary.py).
#include "elementwise.cuh"

TR_HD float tr_sin(float x, float, float) { return sinf(x); }
TR_HD float tr_cos(float x, float, float) { return cosf(x); }
TR_HD float tr_tan(float x, float, float) { return tanf(x); }
TR_HD float tr_asin(float x, float, float) { return asinf(x); }
TR_HD float tr_acos(float x, float, float) { return acosf(x); }
TR_HD float tr_atan(float x, float, float) { return atanf(x); }
TR_HD float tr_sinh(float x, float, float) { return sinhf(x); }
TR_HD float tr_cosh(float x, float, float) { return coshf(x); }
TR_HD float tr_asinh(float x, float, float) { return asinhf(x); }
TR_HD float tr_acosh(float x, float, float) { return acoshf(x); }
TR_HD float tr_atanh(float x, float, float) { return atanhf(x); }
TR_HD float tr_reciprocal(float x, float, float) { return 1.0f / x; }
TR_HD float tr_floor(float x, float, float) { return floorf(x); }
TR_HD float tr_ceil(float x, float, float) { return ceilf(x); }
TR_HD float tr_round(float x, float, float) { return rintf(x); }  // half to even, as np.rint
TR_HD float tr_celu(float x, float alpha, float) {  // max(x, 0) + alpha expm1(min(x, 0) / alpha)
    return x > 0.0f ? x : expm1f(x / alpha) * alpha;
}
TR_HD float tr_selu(float x, float alpha, float gamma) {  // Elu, then times gamma
    return tr_elu(x, alpha, 0.0f) * gamma;
}
TR_HD float tr_mish(float x, float, float) { return tanhf(tr_softplus(x, 0.0f, 0.0f)) * x; }
TR_HD float tr_softsign(float x, float, float) { return x / (fabsf(x) + 1.0f); }
TR_HD float tr_shrink(float x, float bias, float lambd) {
    return x > lambd ? x - bias : (x < -lambd ? x + bias : 0.0f);
}
TR_HD float tr_thresholded_relu(float x, float alpha, float) { return x > alpha ? x : 0.0f; }

#define TR_UNARY_FWD(op, T, dt)                                                               \
    TR_KERNEL void tr_##op##_fwd_##dt(const T* x, T* y, long long n, float a, float b) {     \
        TR_GRID_STRIDE(i, n) tr_put(y, i, tr_##op(tr_get(x, i), a, b));                      \
    }

#define TR_UNARY_BWD(op, T, dt)                                                               \
    TR_KERNEL void tr_##op##_bwd_##dt(const T* x, const T* y, const T* gy, T* gx, long long n, \
                                      float a, float b) {                                     \
        TR_GRID_STRIDE(i, n) {                                                                \
            float xi = x ? tr_get(x, i) : 0.0f, yi = y ? tr_get(y, i) : 0.0f;               \
            tr_put(gx, i, tr_##op##_grad(xi, yi, tr_get(gy, i), a, b));                      \
        }                                                                                     \
    }

#define TR_ERF(T, dt)                                                                          \
    TR_KERNEL void tr_erf_##dt(const T* x, T* y, long long n) {                               \
        TR_GRID_STRIDE(i, n) tr_put(y, i, erff(tr_get(x, i)));                                 \
    }
