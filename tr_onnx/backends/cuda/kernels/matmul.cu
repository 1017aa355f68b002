// Batched MatMul (tr_onnx/ops/matmul.py), for the nodes no cuDNN matmul graph describes:
// fp32/fp16/bf16 storage, fp64 accumulation, one thread per output element.
// tr_matmul_<dt>(a, b, y, batch, M, K, N, a_batch_stride, a_row_stride, a_col_stride,
//                b_batch_stride, b_row_stride, b_col_stride)
//     y[bt, i, j] = sum_k a[bt, i, k] b[bt, k, j], y compact [batch, M, N]; a batch stride
//     of 0 broadcasts an operand, and a transposed operand swaps its row and column strides.
// The instantiations (TR_MATMUL(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

#define TR_MATMUL(T, dt)                                                                       \
    TR_KERNEL void tr_matmul_##dt(const T* a, const T* b, T* y, long long batch, long long M,  \
                                  long long K, long long N, long long abs_, long long ars,     \
                                  long long acs, long long bbs, long long brs,                 \
                                  long long bcs) {                                             \
        TR_GRID_STRIDE(j, batch * M * N) {                                                     \
            long long col = j % N, row = (j / N) % M, bt = j / (M * N);                        \
            const T* ap = a + bt * abs_ + row * ars;                                           \
            const T* bp = b + bt * bbs + col * bcs;                                            \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < K; ++k)                                                  \
                acc += (double)tr_get(ap, k * acs) * (double)tr_get(bp, k * brs);              \
            tr_put(y, j, (float)acc);                                                          \
        }                                                                                      \
    }
