// Unary ops and their backward over a flat range: fp32/fp16/bf16 storage, fp32 compute
// (tr_onnx/ops/unary.py; the per-element math is elementwise.cuh's).
// tr_<op>_fwd_<dt>(x, y, n, a, b):        y = f(x; a, b)           (x == y allowed)
// tr_<op>_bwd_<dt>(x, y, gy, gx, n, a, b): gx = g(x, y, gy; a, b)  (x or y may be null when
//                                          the op's gradient does not read it), for the ops
//                                          whose gradient rule emits a named <Op>Grad node
// a, b: the op's float attributes (alpha, beta; Clip's min, max), unused ones 0.
// tr_erf_<dt>(x, y, n): y = erf(x). Forward only: Erf's gradient rule builds IR nodes (Exp,
//                       Mul) instead of calling a backward kernel.
// The instantiations (TR_UNARY_FWD / TR_UNARY_BWD(op, T, dt), TR_ERF(T, dt) lines) are appended
// from the family's table (KERNELS in tr_onnx/backends/cuda/ops/unary.py).
#include "elementwise.cuh"

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
