// Losses (tr_onnx/ops/losses.py), over rows. Both read scores x [N, C, *S] in any layout
// whose spatial axes are contiguous with each other (compact, or channels-last [N, *S, Cp]):
// row r = (n, sp) starts at n * ns + sp * ss (s spatial positions per n), its classes cs
// apart (1 for [N, C] and channels-last maps; S for a compact [N, C, *S], as PyTorch's
// cross-entropy takes [N, C, L] sequence scores). int64 labels per row, optional float32
// class weights, optional ignore_index (weight 0, as ops/losses.py).
// Softmax cross-entropy: tr_sce_fwd_<dt>: per-row loss and weight; tr_sce_reduce: the sum or
// mean into one scalar (and the mean's denominator, which the backward reads);
// tr_sce_bwd_<dt>: gradient of the scores, pad lanes (c <= j < lanes) written as zero.
// reduction: 0 none (gloss per row), 1 sum, 2 mean. One thread per row: clear and small; a
// warp-per-row version can replace it for large C.
// tr_sce_fwd_<dt>(x, labels, class_w, row_loss, row_w, rows, c, s, ns, ss, cs, ignore_index,
//                 has_ignore)
// tr_sce_reduce(row_loss, row_w, rows, reduction, weighted, loss, denom)
// tr_sce_bwd_<dt>(x, labels, class_w, gloss, denom, gx, rows, c, s, ns, ss, cs, lanes,
//                 ignore_index, has_ignore, reduction)
//
// Negative log-likelihood over log-probabilities x, rows as above. Labels are
// int64 or int32 (_<it>), class weights are of the scores' storage type. A label equal to
// ignore_index has weight 0 at class 0 (ops/losses.py); a label outside [0, c) otherwise,
// which NumPy cannot read either, counts as ignored (weight 0, loss 0): nothing is read or
// written outside the tensors.
// tr_nll_fwd_<dt>_<it>(x, labels, class_w, row_loss, row_w, out, rows, c, s, ns, ss, cs,
//                      ignore_index, has_ignore)
//     row_loss[r] = -(x[r, label] * w), row_w[r] = w (float scratch), and with out (reduction
//     none, else null) out[r] = row_loss[r] in the storage type.
// tr_nll_reduce_<dt>(row_loss, row_w, rows, reduction, weighted, loss, denom): one thread.
// tr_nll_bwd_<dt>_<it>(labels, class_w, gloss, denom, gx, rows, c, s, ns, ss, cs, lanes,
//                      ignore_index, has_ignore, reduction)
//     gx[r, j] = -coef at the label, 0 at every other of the row's lanes (lanes >= c: the
//     padded ones of a channels-last gx too); coef = w * gloss[r] (none), w * gloss (sum),
//     w * (gloss / denom) in double (mean), as ops/losses.py rounds them.
// The instantiations (TR_LOSS(T, dt), TR_NLL(T, dt, I, it) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

TR_HD void tr_sce_label(long long label, const float* class_w, long long ignore_index,
                        int has_ignore, long long* idx, float* w) {
    bool keep = !(has_ignore && label == ignore_index);
    *idx = keep ? label : 0;  // a safe class for an ignored row, as NumPy's
    *w = (class_w ? class_w[*idx] : 1.0f) * (keep ? 1.0f : 0.0f);
}

// The sum or mean of the rows' losses into *loss (storage T), and the mean's denominator
// (the rows' weights summed, or the row count when every weight is 1), in double.
template <class T> TR_HD void tr_loss_reduce(const float* row_loss, const float* row_w,
                                             long long rows, int reduction, int weighted,
                                             T* loss, float* denom) {
    double sum = 0.0, sum_w = 0.0;
    for (long long r = 0; r < rows; ++r) {
        sum += row_loss[r];
        sum_w += row_w[r];
    }
    *denom = weighted ? (float)sum_w : (float)rows;
    tr_put(loss, 0, reduction == 2 ? (float)(sum / (double)*denom) : (float)sum);
}

TR_KERNEL void tr_sce_reduce(const float* row_loss, const float* row_w, long long rows,
                             int reduction, int weighted, float* loss, float* denom) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    tr_loss_reduce(row_loss, row_w, rows, reduction, weighted, loss, denom);
}

#define TR_LOSS(T, dt)                                                                         \
    TR_KERNEL void tr_sce_fwd_##dt(const T* x, const long long* labels, const float* class_w,  \
                                   float* row_loss, float* row_w, long long rows, long long c, \
                                   long long s, long long ns, long long ss, long long cs,      \
                                   long long ignore_index, int has_ignore) {                   \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + (r / s) * ns + (r % s) * ss;                                     \
            long long label;                                                                   \
            float w, m, log_s;                                                                 \
            tr_sce_label(labels[r], class_w, ignore_index, has_ignore, &label, &w);            \
            tr_row_log_softmax_stats(xr, c, cs, &m, &log_s);                                   \
            row_loss[r] = -(tr_log_softmax(tr_get(xr, label * cs), m, log_s) * w);             \
            row_w[r] = w;                                                                      \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_sce_bwd_##dt(const T* x, const long long* labels, const float* class_w,  \
                                   const float* gloss, const float* denom, T* gx,              \
                                   long long rows, long long c, long long s, long long ns,     \
                                   long long ss, long long cs, long long lanes,                \
                                   long long ignore_index, int has_ignore, int reduction) {    \
        float scale = reduction == 2 ? (float)((double)gloss[0] / (double)denom[0]) : gloss[0]; \
        TR_GRID_STRIDE(r, rows) {                                                              \
            long long at = (r / s) * ns + (r % s) * ss;                                        \
            const T* xr = x + at;                                                              \
            T* gr = gx + at;                                                                   \
            long long label;                                                                   \
            float w, m, log_s;                                                                 \
            tr_sce_label(labels[r], class_w, ignore_index, has_ignore, &label, &w);            \
            tr_row_log_softmax_stats(xr, c, cs, &m, &log_s);                                   \
            float coef = reduction == 0 ? gloss[r] * w : w * scale;                            \
            for (long long j = 0; j < c; ++j)                                                  \
                tr_put(gr, j * cs, tr_sce_grad(tr_get(xr, j * cs), m, log_s, j == label, coef)); \
            for (long long j = c; j < lanes; ++j) tr_put(gr, j * cs, 0.0f);                    \
        }                                                                                      \
    }

// the row's class (0 when ignored or out of range) and weight
template <class T, class I> TR_HD void tr_nll_label(I label_in, const T* class_w, long long c,
                                                    long long ignore_index, int has_ignore,
                                                    long long* idx, float* w) {
    long long label = (long long)label_in;
    bool keep = !(has_ignore && label == ignore_index) && label >= 0 && label < c;
    *idx = keep ? label : 0;
    *w = (class_w ? tr_get(class_w, *idx) : 1.0f) * (keep ? 1.0f : 0.0f);
}

#define TR_NLL_REDUCE(T, dt)                                                                   \
    TR_KERNEL void tr_nll_reduce_##dt(const float* row_loss, const float* row_w,              \
                                      long long rows, int reduction, int weighted, T* loss,    \
                                      float* denom) {                                          \
        if (blockIdx.x != 0 || threadIdx.x != 0) return;                                       \
        tr_loss_reduce(row_loss, row_w, rows, reduction, weighted, loss, denom);               \
    }

#define TR_NLL(T, dt, I, it)                                                                   \
    TR_KERNEL void tr_nll_fwd_##dt##_##it(const T* x, const I* labels, const T* class_w,      \
                                          float* row_loss, float* row_w, T* out,               \
                                          long long rows, long long c, long long s,            \
                                          long long ns, long long ss, long long cs,            \
                                          long long ignore_index, int has_ignore) {            \
        TR_GRID_STRIDE(r, rows) {                                                              \
            long long label;                                                                   \
            float w;                                                                           \
            tr_nll_label(labels[r], class_w, c, ignore_index, has_ignore, &label, &w);         \
            float loss = -(tr_get(x, (r / s) * ns + (r % s) * ss + label * cs) * w);           \
            row_loss[r] = loss;                                                                \
            row_w[r] = w;                                                                      \
            if (out) tr_put(out, r, loss);                                                     \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_nll_bwd_##dt##_##it(const I* labels, const T* class_w, const T* gloss,  \
                                          const float* denom, T* gx, long long rows,           \
                                          long long c, long long s, long long ns,              \
                                          long long ss, long long cs, long long lanes,         \
                                          long long ignore_index, int has_ignore,              \
                                          int reduction) {                                     \
        TR_GRID_STRIDE(r, rows) {                                                              \
            long long label;                                                                   \
            float w, coef;                                                                     \
            tr_nll_label(labels[r], class_w, c, ignore_index, has_ignore, &label, &w);         \
            if (reduction == 0)                                                                \
                coef = w * tr_get(gloss, r);                                                   \
            else if (reduction == 1)                                                           \
                coef = w * tr_get(gloss, 0);                                                   \
            else                                                                               \
                coef = (float)((double)w * ((double)tr_get(gloss, 0) / (double)denom[0]));     \
            T* row = gx + (r / s) * ns + (r % s) * ss;                                         \
            for (long long j = 0; j < lanes; ++j)                                              \
                tr_put(row, j * cs, j == label ? 0.0f - coef : 0.0f);                          \
        }                                                                                      \
    }
