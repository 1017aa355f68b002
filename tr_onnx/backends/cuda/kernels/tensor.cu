// Data movement (tr_onnx/ops/tensor.py): kernels that copy or zero elements without arithmetic.
// The bit-pattern ones are instantiated per element size (_b<bytes>, U an unsigned type of
// that size) and serve every storage type; the others per storage type (_<dt>).
// tr_strided_copy_b<bytes>(x, y, n, xo, yo, d0..d5, xs0..xs5, ys0..ys5)
//     y[yo + off_y(j)] = x[xo + off_x(j)] over an output of collapsed dims d (strided.cuh):
//     Transpose, Slice, Concat into a strided view of its output.
// tr_expand_<dt>(x, y, n, inner, repeat)
//     Expand along one run of broadcast axes: y[i] = x[(i / (inner * repeat)) * inner +
//     i % inner].
// tr_zero_lanes_b<bytes>(y, rows, c, cp)
//     zero the padded lanes [c, cp) of every row of a padded buffer of rows * cp elements;
//     c = 0 zeroes everything (ZeroFill, and the 4-byte flags of the training step).
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "strided.cuh"

#define TR_STRIDED_COPY(U, bytes)                                                              \
    TR_KERNEL void tr_strided_copy_b##bytes(const U* x, U* y, long long n, long long xo,      \
                                            long long yo, TR_DIMS6, TR_STRIDES6(xs),           \
                                            TR_STRIDES6(ys)) {                                 \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long sx[6] = {xs0, xs1, xs2, xs3, xs4, xs5};                                \
        const long long sy[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        TR_GRID_STRIDE(j, n) y[yo + tr_strided_offset(j, d, sy)] = x[xo + tr_strided_offset(j, d, sx)]; \
    }

#define TR_EXPAND(T, dt)                                                                       \
    TR_KERNEL void tr_expand_##dt(const T* x, T* y, long long n, long long inner,             \
                                  long long repeat) {                                          \
        TR_GRID_STRIDE(i, n) y[i] = x[(i / (inner * repeat)) * inner + i % inner];            \
    }

#define TR_ZERO_LANES(U, bytes)                                                                \
    TR_KERNEL void tr_zero_lanes_b##bytes(U* y, long long rows, long long c, long long cp) {  \
        TR_GRID_STRIDE(j, rows * cp) if (j % cp >= c) y[j] = 0;                               \
    }
