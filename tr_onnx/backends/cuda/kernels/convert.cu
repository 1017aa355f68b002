// Storage conversion of a whole region: tr_convert_<src>_<dst>(x, y, n), round to nearest even.
// (fp32 master weights -> fp16/bf16 copies, fp16 gradients -> fp32, ...)
#include "elementwise.cuh"

#define TR_CONVERT(S, sdt, D, ddt)                                                           \
    TR_KERNEL void tr_convert_##sdt##_##ddt(const S* x, D* y, long long n) {                 \
        TR_GRID_STRIDE(i, n) tr_put(y, i, tr_get(x, i));                                     \
    }
