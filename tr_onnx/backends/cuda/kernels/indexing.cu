// Indexing by an index tensor (tr_onnx/ops/indexing.py). Index tensors are int64 or int32
// (I, kernel suffix _i64 / _i32); a negative index counts from the end of its axis (+dim). An
// index still outside [0, dim) after that, which the NumPy kernels raise on, cannot raise on
// the device: a gather writes 0 for it, a scatter skips it (nothing is written outside the
// output). Data movement is by bit pattern (_b<bytes>: any storage type); the scatter
// reductions compute in fp32 and round every step to the storage type, as NumPy's ufunc.at
// on that dtype does (_<dt>). No float atomics: every output element is written by one thread
// that applies its updates in the updates' C order (the order of np.add.at), so results are
// deterministic and equal NumPy's.
//
// tr_gather_b<bytes>(x, idx, y, n, nidx, dim, inner)                      [int64 indices]
//     Gather: x viewed as [outer, dim, inner], y[o, t, i] = x[o, idx[t], i].
// tr_gather_grad_<dt>(gy, idx, gx, n, nidx, dim, inner)                   [int64 indices]
//     GatherGrad: gx[o, k, i] = sum over the indices t (in order) equal to k of gy[o, t, i];
//     every gx element written. fp32/fp16/bf16 storage, fp32 accumulation.
// tr_gather_elements_b<bytes>_<it>(x, idx, y, n, dim, x_axis_stride, d0..d5, xs, is, ys)
//     GatherElements over the indices' (collapsed) dims d: y[ys.c] = x[xs.c + v * x_axis]
//     with v = idx[is.c] (xs has 0 on the gather axis); strided, so channels-last tensors too.
// tr_scatter_elements_b<bytes>_<it>(x, idx, upd, y, n, axis, d0..d5, u0..u5, xs, ys, is, us)
// tr_scatter_elements_<dt>_<it>(..., reduction)
//     ScatterElements: y = x with, along axis (of the six left-padded dims), the updates
//     whose index names the element reduced into it in order (none: the last one wins).
//     One thread per y element (data dims d), looping over the updates' axis (dims u): an
//     update at (o, t, i) only reaches (o, idx, i). reduction: 1 add, 2 mul, 3 max, 4 min.
// tr_gather_nd_b<bytes>_<it>(x, idx, y, n, nuple, k, slice, rows, k0..k5)
//     GatherND: x viewed [batch, rows = k0*...*k(k-1), slice], the index tuples [batch,
//     nuple, k]: y[b, u, s] = x[b, row(idx[b, u, :]), s]. n = batch * nuple * slice.
// tr_scatter_nd_b<bytes>_<it>(idx, upd, y, lanes, nuple, k, slice, rows, k0..k5)
// tr_scatter_nd_<dt>_<it>(..., reduction)
//     ScatterND / GatherNDGrad into y, which already holds the data (a copy) or zeros: one
//     thread per (batch, slice lane), lanes = batch * slice, walking the batch's nuple index
//     tuples in order: y[b, row(u), s] = upd[b, u, s] (none), or reduced with it. Its
//     parallelism is batch * slice; a scatter of single elements (slice 1) runs serially.
// tr_top_k_<dt>(x, values, indices, n, len, k, inner, largest)
//     TopK along an axis of len elements, x viewed [outer, len, inner], n = outer*len*inner:
//     each element's rank is the count of the elements ahead of it (larger, or smaller with
//     largest = 0; equal ones by lower index; NaN above every number, as NumPy's sort puts
//     it), and an element of rank < k is written at that rank: sorted, ties as NumPy's stable
//     argsort. O(len) work per element: meant for rows up to a few thousand.
// tr_one_hot_b<bytes>_<it>(idx, values, y, n, depth, inner)
//     OneHot: y[o, d, i] = values[1] where idx[o, i] is d or d - depth, else values[0].
// tr_reverse_sequence_b<bytes>_<it>(x, lens, y, n, steps, time_stride, batch, batch_stride)
//     ReverseSequence: y[.., t, .., b, ..] = x[.., src, .., b, ..], src = len - 1 - t for
//     t < len = lens[b] (clamped into [0, steps]), else t.
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "strided.cuh"

// v counted from the end when negative; -1 when it is outside [0, dim) even so
TR_HD long long tr_wrap_index(long long v, long long dim) {
    if (v < 0) v += dim;
    return (v >= 0 && v < dim) ? v : -1;
}

// coordinates c[0..5] of element j of row-major dims d[0..5]
TR_HD void tr_coords6(long long j, const long long* d, long long* c) {
    for (int k = 5; k >= 0; --k) {
        c[k] = j % d[k];
        j /= d[k];
    }
}

TR_HD long long tr_dot6(const long long* c, const long long* s) {
    long long off = 0;
    for (int k = 0; k < 6; ++k) off += c[k] * s[k];
    return off;
}

// one step of a scatter reduction, as NumPy's add / multiply / maximum / minimum (a NaN on
// either side of maximum and minimum wins)
TR_HD float tr_scatter_reduce(int reduction, float a, float b) {
    switch (reduction) {
        case 1: return a + b;
        case 2: return a * b;
        case 3: return (a >= b || a != a) ? a : b;
        default: return (a <= b || a != a) ? a : b;
    }
}

// the row of index tuple q[0..k) in dims k0..k5 (row-major), -1 if an index is out of range
template <class I> TR_HD long long tr_nd_row(const I* q, long long k, const long long* dims) {
    long long row = 0;
    for (long long a = 0; a < k; ++a) {
        long long v = tr_wrap_index((long long)q[a], dims[a]);
        if (v < 0) return -1;
        row = row * dims[a] + v;
    }
    return row;
}

// NaN above every number: a > b as NumPy's sort orders them
TR_HD bool tr_sort_greater(float a, float b) { return a != a ? b == b : (b == b && a > b); }
TR_HD bool tr_sort_equal(float a, float b) { return (a != a && b != b) || a == b; }

#define TR_GATHER(U, bytes)                                                                    \
    TR_KERNEL void tr_gather_b##bytes(const U* x, const long long* idx, U* y, long long n,    \
                                      long long nidx, long long dim, long long inner) {        \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, t = (j / inner) % nidx, o = j / (inner * nidx);           \
            long long v = tr_wrap_index(idx[t], dim);                                          \
            y[j] = v < 0 ? (U)0 : x[(o * dim + v) * inner + i];                                \
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

#define TR_GATHER_ELEMENTS(U, bytes, I, it)                                                    \
    TR_KERNEL void tr_gather_elements_b##bytes##_##it(                                         \
            const U* x, const I* idx, U* y, long long n, long long dim, long long x_axis,      \
            TR_DIMS6, TR_STRIDES6(xs), TR_STRIDES6(is), TR_STRIDES6(ys)) {                     \
        const long long d[6] = {d0, d1, d2, d3, d4, d5};                                       \
        const long long sx[6] = {xs0, xs1, xs2, xs3, xs4, xs5};                                \
        const long long si[6] = {is0, is1, is2, is3, is4, is5};                                \
        const long long sy[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long v = tr_wrap_index((long long)idx[tr_strided_offset(j, d, si)], dim);     \
            y[tr_strided_offset(j, d, sy)] =                                                   \
                v < 0 ? (U)0 : x[tr_strided_offset(j, d, sx) + v * x_axis];                    \
        }                                                                                      \
    }

// The shared body of the ScatterElements kernels: APPLY(acc, o) folds update o into acc.
#define TR_SCATTER_ELEMENTS_BODY(APPLY)                                                        \
    const long long d[6] = {d0, d1, d2, d3, d4, d5};                                           \
    const long long ud[6] = {u0, u1, u2, u3, u4, u5};                                          \
    const long long sx[6] = {xs0, xs1, xs2, xs3, xs4, xs5};                                    \
    const long long sy[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                    \
    const long long si[6] = {is0, is1, is2, is3, is4, is5};                                    \
    const long long su[6] = {us0, us1, us2, us3, us4, us5};                                    \
    TR_GRID_STRIDE(j, n) {                                                                     \
        long long c[6];                                                                        \
        tr_coords6(j, d, c);                                                                   \
        auto acc = x[tr_dot6(c, sx)];                                                          \
        bool inside = true;                                                                    \
        for (int a = 0; a < 6; ++a) inside = inside && (a == axis || c[a] < ud[a]);            \
        if (inside) {                                                                          \
            long long k = c[axis];                                                             \
            for (long long t = 0; t < ud[axis]; ++t) {                                         \
                c[axis] = t;                                                                   \
                if (tr_wrap_index((long long)idx[tr_dot6(c, si)], d[axis]) == k) {            \
                    long long o = tr_dot6(c, su);                                              \
                    APPLY;                                                                     \
                }                                                                              \
            }                                                                                  \
            c[axis] = k;                                                                       \
        }                                                                                      \
        y[tr_dot6(c, sy)] = acc;                                                               \
    }

#define TR_SCATTER_ELEMENTS_MOVE(U, bytes, I, it)                                              \
    TR_KERNEL void tr_scatter_elements_b##bytes##_##it(                                        \
            const U* x, const I* idx, const U* upd, U* y, long long n, int axis, TR_DIMS6,     \
            long long u0, long long u1, long long u2, long long u3, long long u4,              \
            long long u5, TR_STRIDES6(xs), TR_STRIDES6(ys), TR_STRIDES6(is),                   \
            TR_STRIDES6(us)) {                                                                 \
        TR_SCATTER_ELEMENTS_BODY(acc = upd[o])                                                 \
    }

#define TR_SCATTER_ELEMENTS_REDUCE(T, dt, I, it)                                               \
    TR_KERNEL void tr_scatter_elements_##dt##_##it(                                            \
            const T* x, const I* idx, const T* upd, T* y, long long n, int axis, TR_DIMS6,     \
            long long u0, long long u1, long long u2, long long u3, long long u4,              \
            long long u5, TR_STRIDES6(xs), TR_STRIDES6(ys), TR_STRIDES6(is),                   \
            TR_STRIDES6(us), int reduction) {                                                  \
        TR_SCATTER_ELEMENTS_BODY(                                                              \
            tr_put(&acc, 0, tr_scatter_reduce(reduction, tr_get(&acc, 0), tr_get(upd, o))))   \
    }

#define TR_ND_DIMS long long k0, long long k1, long long k2, long long k3, long long k4,       \
                   long long k5

#define TR_GATHER_ND(U, bytes, I, it)                                                          \
    TR_KERNEL void tr_gather_nd_b##bytes##_##it(const U* x, const I* idx, U* y, long long n,  \
                                                long long nuple, long long k, long long slice, \
                                                long long rows, TR_ND_DIMS) {                  \
        const long long dims[6] = {k0, k1, k2, k3, k4, k5};                                    \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long s = j % slice, q = j / slice, b = q / nuple;                             \
            long long row = tr_nd_row(idx + q * k, k, dims);                                   \
            y[j] = row < 0 ? (U)0 : x[(b * rows + row) * slice + s];                           \
        }                                                                                      \
    }

#define TR_SCATTER_ND_BODY(APPLY)                                                              \
    const long long dims[6] = {k0, k1, k2, k3, k4, k5};                                        \
    TR_GRID_STRIDE(lane, lanes) {                                                              \
        long long s = lane % slice, b = lane / slice;                                          \
        for (long long u = 0; u < nuple; ++u) {                                                \
            long long q = b * nuple + u;                                                       \
            long long row = tr_nd_row(idx + q * k, k, dims);                                   \
            if (row < 0) continue;                                                             \
            long long t = (b * rows + row) * slice + s, o = q * slice + s;                     \
            APPLY;                                                                             \
        }                                                                                      \
    }

#define TR_SCATTER_ND_MOVE(U, bytes, I, it)                                                    \
    TR_KERNEL void tr_scatter_nd_b##bytes##_##it(const I* idx, const U* upd, U* y,            \
                                                 long long lanes, long long nuple, long long k, \
                                                 long long slice, long long rows,               \
                                                 TR_ND_DIMS) {                                  \
        TR_SCATTER_ND_BODY(y[t] = upd[o])                                                      \
    }

#define TR_SCATTER_ND_REDUCE(T, dt, I, it)                                                     \
    TR_KERNEL void tr_scatter_nd_##dt##_##it(const I* idx, const T* upd, T* y,                \
                                             long long lanes, long long nuple, long long k,    \
                                             long long slice, long long rows, TR_ND_DIMS,      \
                                             int reduction) {                                  \
        TR_SCATTER_ND_BODY(                                                                    \
            tr_put(y, t, tr_scatter_reduce(reduction, tr_get(y, t), tr_get(upd, o))))         \
    }

#define TR_TOP_K(T, dt)                                                                        \
    TR_KERNEL void tr_top_k_##dt(const T* x, T* values, long long* indices, long long n,      \
                                 long long len, long long k, long long inner, int largest) {   \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, e = (j / inner) % len, o = j / (inner * len);             \
            const T* row = x + o * len * inner + i;                                            \
            float v = tr_get(row, e * inner);                                                  \
            long long rank = 0;                                                                \
            for (long long f = 0; f < len && rank < k; ++f) {                                  \
                float w = tr_get(row, f * inner);                                              \
                bool ahead = largest ? tr_sort_greater(w, v) : tr_sort_greater(v, w);          \
                if (ahead || (f < e && tr_sort_equal(w, v))) ++rank;                           \
            }                                                                                  \
            if (rank < k) {                                                                    \
                long long at = (o * k + rank) * inner + i;                                     \
                values[at] = row[e * inner];                                                   \
                indices[at] = e;                                                               \
            }                                                                                  \
        }                                                                                      \
    }

#define TR_ONE_HOT(U, bytes, I, it)                                                            \
    TR_KERNEL void tr_one_hot_b##bytes##_##it(const I* idx, const U* values, U* y,            \
                                              long long n, long long depth, long long inner) { \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long i = j % inner, p = (j / inner) % depth, o = j / (inner * depth);         \
            long long v = (long long)idx[o * inner + i];                                       \
            y[j] = values[(v == p || v == p - depth) ? 1 : 0];                                 \
        }                                                                                      \
    }

#define TR_REVERSE_SEQUENCE(U, bytes, I, it)                                                   \
    TR_KERNEL void tr_reverse_sequence_b##bytes##_##it(                                        \
            const U* x, const I* lens, U* y, long long n, long long steps,                     \
            long long time_stride, long long batch, long long batch_stride) {                  \
        TR_GRID_STRIDE(j, n) {                                                                 \
            long long t = (j / time_stride) % steps, b = (j / batch_stride) % batch;           \
            long long len = (long long)lens[b];                                                \
            len = len < 0 ? 0 : (len > steps ? steps : len);                                   \
            long long src = t < len ? len - 1 - t : t;                                         \
            y[j] = x[j + (src - t) * time_stride];                                             \
        }                                                                                      \
    }
