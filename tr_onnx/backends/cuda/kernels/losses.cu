// Losses (tr_onnx/ops/losses.py), over rows. Softmax cross-entropy: scores as rows of c
// classes with row stride ld (class-last: [N, C] or channels-last [N, *S, Cp],
// rows = N * prod(S), ld = Cp), int64 labels per row, optional float32 class weights,
// optional ignore_index (weight 0, as ops/losses.py).
// tr_sce_fwd_<dt>: per-row loss and weight; tr_sce_reduce: the sum or mean into one scalar
// (and the mean's denominator, which the backward reads); tr_sce_bwd_<dt>: gradient of the
// scores, pad lanes written as zero. reduction: 0 none (gloss per row), 1 sum, 2 mean.
// One thread per row: clear and small; a warp-per-row version can replace it for large C.
// tr_sce_fwd_<dt>(x, labels, class_w, row_loss, row_w, rows, c, ld, ignore_index, has_ignore)
// tr_sce_reduce(row_loss, row_w, rows, reduction, weighted, loss, denom)
// tr_sce_bwd_<dt>(x, labels, class_w, gloss, denom, gx, rows, c, ld, ignore_index,
//                 has_ignore, reduction)
// The instantiations (TR_LOSS(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

TR_HD void tr_sce_label(long long label, const float* class_w, long long ignore_index,
                        int has_ignore, long long* idx, float* w) {
    bool keep = !(has_ignore && label == ignore_index);
    *idx = keep ? label : 0;  // a safe class for an ignored row, as NumPy's
    *w = (class_w ? class_w[*idx] : 1.0f) * (keep ? 1.0f : 0.0f);
}

TR_KERNEL void tr_sce_reduce(const float* row_loss, const float* row_w, long long rows,
                             int reduction, int weighted, float* loss, float* denom) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double sum = 0.0, sum_w = 0.0;
    for (long long r = 0; r < rows; ++r) {
        sum += row_loss[r];
        sum_w += row_w[r];
    }
    *denom = weighted ? (float)sum_w : (float)rows;
    *loss = reduction == 2 ? (float)(sum / (double)*denom) : (float)sum;
}

#define TR_LOSS(T, dt)                                                                         \
    TR_KERNEL void tr_sce_fwd_##dt(const T* x, const long long* labels, const float* class_w,  \
                                   float* row_loss, float* row_w, long long rows, long long c, \
                                   long long ld, long long ignore_index, int has_ignore) {     \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * ld;                                                          \
            long long label;                                                                   \
            float w, m, log_s;                                                                 \
            tr_sce_label(labels[r], class_w, ignore_index, has_ignore, &label, &w);            \
            tr_row_log_softmax_stats(xr, c, &m, &log_s);                                       \
            row_loss[r] = -(tr_log_softmax(tr_get(xr, label), m, log_s) * w);                  \
            row_w[r] = w;                                                                      \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_sce_bwd_##dt(const T* x, const long long* labels, const float* class_w,  \
                                   const float* gloss, const float* denom, T* gx,              \
                                   long long rows, long long c, long long ld,                  \
                                   long long ignore_index, int has_ignore, int reduction) {    \
        float scale = reduction == 2 ? (float)((double)gloss[0] / (double)denom[0]) : gloss[0]; \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * ld;                                                          \
            T* gr = gx + r * ld;                                                               \
            long long label;                                                                   \
            float w, m, log_s;                                                                 \
            tr_sce_label(labels[r], class_w, ignore_index, has_ignore, &label, &w);            \
            tr_row_log_softmax_stats(xr, c, &m, &log_s);                                       \
            float coef = reduction == 0 ? gloss[r] * w : w * scale;                            \
            for (long long j = 0; j < c; ++j)                                                  \
                tr_put(gr, j, tr_sce_grad(tr_get(xr, j), m, log_s, j == label, coef));         \
            for (long long j = c; j < ld; ++j) tr_put(gr, j, 0.0f);                            \
        }                                                                                      \
    }
