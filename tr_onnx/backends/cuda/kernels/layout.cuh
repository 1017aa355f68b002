// Index arithmetic between the compact NCHW host layout and the padded NHWC device layout
// ([N, *S, Cp] with Cp = round_up(C, 8), tr_onnx.layouts.StridedLayout.channels_last). The
// spatial axes are flattened to one of size s (1 for a [N, C] tensor).
#pragma once
#include "elementwise.cuh"

// NCHW element (n, ch, si) -> its NHWC-padded position.
TR_HD long long tr_nhwc_index(long long n, long long ch, long long si, long long s, long long cp) {
    return (n * s + si) * cp + ch;
}

// Compact NCHW flat index -> NHWC-padded flat index.
TR_HD long long tr_nchw_to_nhwc(long long i, long long c, long long s, long long cp) {
    long long si = i % s, r = i / s;
    return tr_nhwc_index(r / c, r % c, si, s, cp);
}

// NHWC-padded flat index -> compact NCHW flat index, or -1 on a pad lane (ch >= c).
TR_HD long long tr_nhwc_to_nchw(long long j, long long c, long long s, long long cp) {
    long long ch = j % cp, r = j / cp;
    return ch < c ? ((r / s) * c + ch) * s + r % s : -1;
}

// A [N, S, C] feature map (S the spatial axes flattened) read or written through its element
// strides: channels-last [N, *S, Cp] is (S * Cp, Cp, 1), compact NCHW (C * S, 1, S). Kernels
// whose operands may differ in layout (a backward op's gy beside x) take one per operand.
struct tr_map {
    long long sn, ss, sc;
    TR_HD long long at(long long n, long long si, long long ch) const {
        return n * sn + si * ss + ch * sc;
    }
};
#define TR_MAP_ARGS(p) long long p##n, long long p##s, long long p##c
#define TR_MAP(p) tr_map{p##n, p##s, p##c}
