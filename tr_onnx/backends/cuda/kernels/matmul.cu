// Batched MatMul (tr_onnx/ops/matmul.py), for the nodes no cuDNN matmul graph describes:
// fp32/fp16/bf16 storage, fp64 accumulation, one thread per output element.
// tr_matmul_<dt>(a, b, y, batch, M, K, N, a_batch_stride, a_row_stride, a_col_stride,
//                b_batch_stride, b_row_stride, b_col_stride)
//     y[bt, i, j] = sum_k a[bt, i, k] b[bt, k, j], y compact [batch, M, N]; a batch stride
//     of 0 broadcasts an operand, and a transposed operand swaps its row and column strides.
// tr_einsum_<dt>(x0, x1, x2, x3, y, n, m, d0..d5, e0..e5, then per operand k its strides
//                over the output's dims (ok0..ok5) and over the summed dims (sk0..sk5))
//     Einsum of up to four operands (null past the last): y[j] = sum over the m points r of
//     the summed letters' space of prod_k x_k[off_k(j) + sum_k(r)], every operand read through
//     its own strides (a repeated letter's strides added: a diagonal; 0 on a broadcast axis);
//     y compact over the output letters (dims d), the summed letters' dims e. fp64
//     accumulation, one thread per output element.
// The instantiations (TR_MATMUL(T, dt), TR_EINSUM(T, dt) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "strided.cuh"

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

#define TR_EINSUM_OPERAND(k) TR_STRIDES6(o##k), TR_STRIDES6(s##k)
#define TR_EINSUM_ARRAYS(k)                                                                    \
    const long long ok##k[6] = {o##k##0, o##k##1, o##k##2, o##k##3, o##k##4, o##k##5};         \
    const long long sk##k[6] = {s##k##0, s##k##1, s##k##2, s##k##3, s##k##4, s##k##5};

#define TR_EINSUM(T, dt)                                                                       \
    TR_KERNEL void tr_einsum_##dt(const T* x0, const T* x1, const T* x2, const T* x3, T* y,    \
                                  long long n, long long m, TR_DIMS6, TR_STRIDES6(e),          \
                                  TR_EINSUM_OPERAND(0), TR_EINSUM_OPERAND(1),                  \
                                  TR_EINSUM_OPERAND(2), TR_EINSUM_OPERAND(3)) {                \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long e[6] = {e0, e1, e2, e3, e4, e5};                                       \
        TR_EINSUM_ARRAYS(0) TR_EINSUM_ARRAYS(1) TR_EINSUM_ARRAYS(2) TR_EINSUM_ARRAYS(3)        \
        const T* xs[4] = {x0, x1, x2, x3};                                                     \
        const long long* outs[4] = {ok0, ok1, ok2, ok3};                                       \
        const long long* sums[4] = {sk0, sk1, sk2, sk3};                                       \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long base[4];                                                                 \
            for (int k = 0; k < 4; ++k) base[k] = tr_strided_offset(j, d, outs[k]);            \
            double acc = 0.0;                                                                  \
            for (long long r = 0; r < m; ++r) {                                                \
                double p = 1.0;                                                                \
                for (int k = 0; k < 4 && xs[k]; ++k)                                           \
                    p *= (double)tr_get(xs[k], base[k] + tr_strided_offset(r, e, sums[k]));    \
                acc += p;                                                                      \
            }                                                                                  \
            tr_put(y, j, (float)acc);                                                          \
        }                                                                                      \
    }
