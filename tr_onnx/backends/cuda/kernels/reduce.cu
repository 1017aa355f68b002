// Reductions (tr_onnx/ops/reduce.py, which holds Softmax / LogSoftmax too): fp32/fp16/bf16
// storage, fp32 compute; one thread per output row or element.
// tr_softmax_<dt>(x, y, rows, c, ld, log_softmax)
//     Softmax (log_softmax = 0) or LogSoftmax (1) along the last axis: rows of c elements,
//     row stride ld; lanes [c, ld) written 0.
// tr_reduce_mid_<dt>(x, y, outer, r, inner, mean)
//     ReduceSum / ReduceMean (mean = 1) over one run of axes: y[o, i] = sum_k x[o, k, i],
//     x as [outer, r, inner]; fp64 accumulation.
// tr_sum_rows_<dt>(x, y, rows, cols, ld)
//     ReduceSum over leading rows (the bias gradients of Gemm and Conv): y[col] = sum over
//     rows of x[row * ld + col], col < cols.
// The instantiations (TR_REDUCE(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// y = first-row-max-shifted softmax of one row of c elements (log: log-softmax)
template <class T>
TR_HD void tr_softmax_row(const T* x, T* y, long long c, int log_softmax) {
    float m = tr_get(x, 0);
    for (long long j = 1; j < c; ++j) {  // np.max: NaN propagates
        float v = tr_get(x, j);
        if (m == m && (v != v || v > m)) m = v;
    }
    float s = 0.0f;
    for (long long j = 0; j < c; ++j) s += expf(tr_get(x, j) - m);
    if (log_softmax) {
        float ls = logf(s);
        for (long long j = 0; j < c; ++j) tr_put(y, j, (tr_get(x, j) - m) - ls);
    } else {
        for (long long j = 0; j < c; ++j) tr_put(y, j, expf(tr_get(x, j) - m) / s);
    }
}

#define TR_REDUCE(T, dt)                                                                       \
    /* rows of c elements, row stride ld (lanes [c, ld) written 0) */                         \
    TR_KERNEL void tr_softmax_##dt(const T* x, T* y, long long rows, long long c,             \
                                   long long ld, int log_softmax) {                            \
        TR_GRID_STRIDE(r, rows) {                                                              \
            tr_softmax_row(x + r * ld, y + r * ld, c, log_softmax);                            \
            for (long long j = c; j < ld; ++j) tr_put(y, r * ld + j, 0.0f);                    \
        }                                                                                      \
    }                                                                                          \
    /* y[o, i] = sum_k x[o, k, i] (mean: / r) over x as [outer, r, inner] */                 \
    TR_KERNEL void tr_reduce_mid_##dt(const T* x, T* y, long long outer, long long r,         \
                                      long long inner, int mean) {                             \
        TR_GRID_STRIDE(j, outer * inner) {                                                     \
            long long o = j / inner, i = j % inner;                                            \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < r; ++k) acc += (double)tr_get(x, (o * r + k) * inner + i); \
            tr_put(y, j, mean ? (float)(acc / (double)r) : (float)acc);                        \
        }                                                                                      \
    }                                                                                          \
    /* y[col] = sum over rows of x[row * ld + col], col < cols (bias gradients) */             \
    TR_KERNEL void tr_sum_rows_##dt(const T* x, T* y, long long rows, long long cols,         \
                                    long long ld) {                                            \
        TR_GRID_STRIDE(col, cols) {                                                            \
            float acc = 0.0f;                                                                  \
            for (long long r = 0; r < rows; ++r) acc += tr_get(x, r * ld + col);               \
            tr_put(y, col, acc);                                                               \
        }                                                                                      \
    }
