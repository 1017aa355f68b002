// Binary ops over a flat range with NHWC-friendly broadcasting: operand k is read at
// i % period_k, so period n = same shape, period Cp = a per-channel vector on the (padded)
// last axis, period 1 = a scalar. Either operand may be the broadcast one.
// tr_<op>_<dt>(a, b, y, n, period_a, period_b)
#include "elementwise.cuh"

TR_HD long long tr_bcast(long long i, long long n, long long period) {
    return period == n ? i : i % period;
}

#define TR_BINARY(op, T, dt)                                                                  \
    TR_KERNEL void tr_##op##_##dt(const T* a, const T* b, T* y, long long n, long long pa,   \
                                  long long pb) {                                             \
        TR_GRID_STRIDE(i, n)                                                                  \
            tr_put(y, i, tr_##op(tr_get(a, tr_bcast(i, n, pa)), tr_get(b, tr_bcast(i, n, pb)))); \
    }
