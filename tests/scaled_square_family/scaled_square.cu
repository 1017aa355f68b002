// ScaledSquare and ScaledSquareGrad (tests/scaled_square_family/ops.py) over a flat range:
// fp32/fp16/bf16 storage, fp32 compute; the intermediate product lives in float scratch.
// tr_scaled_square_mul_<dt>(a, b, t, n):        t = a * b        (forward: x * x; backward: x * gy)
// tr_scaled_square_scale_<dt>(t, y, n, alpha):  y = t * alpha    (forward: alpha; backward: 2 alpha)
// The instantiations (TR_SCALED_SQUARE(T, dt) lines) are appended by
// tests/scaled_square_family/cuda.py.
#include "elementwise.cuh"

#define TR_SCALED_SQUARE(T, dt)                                                               \
    TR_KERNEL void tr_scaled_square_mul_##dt(const T* a, const T* b, float* t, long long n) {  \
        TR_GRID_STRIDE(i, n) t[i] = tr_get(a, i) * tr_get(b, i);                             \
    }                                                                                         \
    TR_KERNEL void tr_scaled_square_scale_##dt(const float* t, T* y, long long n, float alpha) { \
        TR_GRID_STRIDE(i, n) tr_put(y, i, t[i] * alpha);                                     \
    }
