// Layout conversion (tr_onnx/ops/layout_convert.py): NHWC pad/unpad between the compact NCHW
// host layout and the padded NHWC device layout (index math in layout.cuh),
// converting the storage type on the way (fp32 host batch -> fp16 device input, ...).
// tr_pad_nhwc_<src>_<dst>(x_nchw, y_nhwc, total_padded, c, s, cp): every padded element is
//     written, pad lanes as zero.
// tr_unpad_nhwc_<src>_<dst>(x_nhwc, y_nchw, total_compact, c, s, cp)
// The instantiations (TR_PAD(S, sdt, D, ddt) lines, one per STORAGE_PAIRS pair) are appended
// by tr_onnx/backends/cuda/sources.py.
#include "layout.cuh"

#define TR_PAD(S, sdt, D, ddt)                                                                 \
    TR_KERNEL void tr_pad_nhwc_##sdt##_##ddt(const S* x, D* y, long long total, long long c,  \
                                             long long s, long long cp) {                     \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long i = tr_nhwc_to_nchw(j, c, s, cp);                                        \
            tr_put(y, j, i < 0 ? 0.0f : tr_get(x, i));                                         \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_unpad_nhwc_##sdt##_##ddt(const S* x, D* y, long long total, long long c, \
                                               long long s, long long cp) {                   \
        TR_GRID_STRIDE(i, total) tr_put(y, i, tr_get(x, tr_nchw_to_nhwc(i, c, s, cp)));       \
    }
