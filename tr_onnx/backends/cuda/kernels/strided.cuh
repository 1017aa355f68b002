// Index arithmetic of the kernels that walk an output of up to six (collapsed) dims and read
// each operand through its own strides (0 on a broadcast axis): the broadcasting binary ops
// (elementwise.cu) and the strided copy (tensor.cu). The binder collapses and left-pads the
// dims to six; d0..d5 are passed as scalars, then copied into arrays for tr_strided_offset.
#pragma once
#include "elementwise.cuh"

// element j of an output of (collapsed) dims d[0..5] -> the offset sum idx_k * s[k]
TR_HD long long tr_strided_offset(long long j, const long long* d, const long long* s) {
    long long off = 0;
    for (int k = 5; k >= 0; --k) {
        long long i = j % d[k];
        j /= d[k];
        off += i * s[k];
    }
    return off;
}

#define TR_DIMS6 long long d0, long long d1, long long d2, long long d3, long long d4, long long d5
#define TR_STRIDES6(p) long long p##0, long long p##1, long long p##2, long long p##3, \
                       long long p##4, long long p##5
