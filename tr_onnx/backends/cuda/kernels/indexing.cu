// Indexing by an int64 index tensor (tr_onnx/ops/indexing.py): Gather along one axis and its
// backward. x is viewed as [outer, dim, inner], the indices as a flat list of nidx (negative
// ones count from the end); one thread per output element j of n.
// tr_gather_b<bytes>(x, idx, y, n, nidx, dim, inner)
//     y[o, t, i] = x[o, idx[t], i]; bit patterns by element size (any storage type).
// tr_gather_grad_<dt>(gy, idx, gx, n, nidx, dim, inner)
//     GatherGrad: gx[o, k, i] = sum over the indices t (in order) equal to k of gy[o, t, i];
//     every gx element written. fp32/fp16/bf16 storage, fp32 accumulation.
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

#define TR_GATHER(U, bytes)                                                                    \
    TR_KERNEL void tr_gather_b##bytes(const U* x, const long long* idx, U* y, long long n,    \
                                      long long nidx, long long dim, long long inner) {        \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, t = (j / inner) % nidx, o = j / (inner * nidx);           \
            long long v = idx[t] < 0 ? idx[t] + dim : idx[t];                                  \
            y[j] = x[(o * dim + v) * inner + i];                                               \
        }                                                                                      \
    }

#define TR_GATHER_GRAD(T, dt)                                                                  \
    TR_KERNEL void tr_gather_grad_##dt(const T* gy, const long long* idx, T* gx, long long n,  \
                                       long long nidx, long long dim, long long inner) {       \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, k = (j / inner) % dim, o = j / (inner * dim);             \
            float acc = 0.0f;                                                                  \
            for (long long t = 0; t < nidx; ++t) {                                             \
                long long v = idx[t] < 0 ? idx[t] + dim : idx[t];                              \
                if (v == k) acc += tr_get(gy, (o * nidx + t) * inner + i);                     \
            }                                                                                  \
            tr_put(gx, j, acc);                                                                \
        }                                                                                      \
    }
