// Data-dependent ops (tr_onnx/ops/dynamic.py) in the one form a static plan holds: Compress
// whose condition is a plan-time constant (a data-dependent one runs inside a DynamicRegion,
// which the cuda backend does not run). Instantiated per element size (_b<bytes>).
// tr_compress_b<bytes>(x, cond, y, n, kept, inner, axis_len, cond_len)
//     x viewed [outer, axis_len, inner], y [outer, kept, inner]: y[o, k, i] = x[o, pos(k), i],
//     pos(k) the position of the k-th true byte of cond (cond_len <= axis_len bytes). Each
//     thread finds its position by scanning cond: no index table to upload, and the
//     conditions Compress takes are short.
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

#define TR_COMPRESS(U, bytes)                                                                  \
    TR_KERNEL void tr_compress_b##bytes(const U* x, const unsigned char* cond, U* y,          \
                                        long long n, long long kept, long long inner,          \
                                        long long axis_len, long long cond_len) {              \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, k = (j / inner) % kept, o = j / (inner * kept);           \
            long long pos = 0, seen = -1;                                                      \
            for (; pos < cond_len; ++pos)                                                      \
                if (cond[pos] && ++seen == k) break;                                           \
            y[j] = x[(o * axis_len + pos) * inner + i];                                        \
        }                                                                                      \
    }
