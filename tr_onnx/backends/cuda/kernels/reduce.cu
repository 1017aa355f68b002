// Reductions (tr_onnx/ops/reduce.py, which holds Softmax / LogSoftmax too; and the global
// pools of ops/pool.py that are reductions): fp32/fp16/bf16 storage, fp32 compute (fp64 where
// said); one thread per output row or element (tr_reduce_blocks: one block).
// tr_softmax_<dt>(x, y, rows, c, ld, log_softmax)
//     Softmax (log_softmax = 0) or LogSoftmax (1) along the last axis: rows of c elements,
//     row stride ld; lanes [c, ld) written 0.
// tr_reduce_mid_<dt>(x, y, outer, r, inner, mean)
//     ReduceSum / ReduceMean (mean = 1) over one run of axes: y[o, i] = sum_k x[o, k, i],
//     x as [outer, r, inner]; fp64 accumulation.
// tr_sum_rows_<dt>(x, y, rows, cols, ld)
//     ReduceSum over leading rows (the bias gradients of Gemm and Conv): y[col] = sum over
//     rows of x[row * ld + col], col < cols.
// tr_reduce_<dt>(x, y, total, op, p, count, kept dims, x kept strides, y kept strides,
//                reduced dims, x reduced strides)
//     Every Reduce* op (op: a TR_RED_* code) over any set of axes of compact or channels-last
//     tensors: one thread per output element (total of them, the kept dims' product) walks the
//     count reduced elements in logical order; fp64 accumulation and fp64 math (exp, log,
//     sqrt, pow), rounded once at the store, so a result is within 1 ulp of the float64
//     reduction of the stored inputs. The dims are collapsed and left-padded to six
//     (strided.cuh). Empty sets as NumPy: sum 0, prod 1, max -inf, min +inf, mean NaN.
//     op TR_RED_LP (GlobalLpPool): (sum |x|^p)^(1/p).
// tr_reduce_blocks_<dt>(the same arguments)
//     tr_reduce for long reductions: one block per output element, TR_RED_BLOCK lanes folding
//     strided shares of its reduced elements, combined by a fixed tree (deterministic; the
//     host build runs the lanes in turn), the same 1-ulp bound.
// tr_arg_extreme_<dt>(x, y, total, is_min, last, n, stride, kept dims, x strides, y strides)
//     ArgMax / ArgMin along one axis of n elements (stride), int64 y: the first extremum
//     (last = 1: the last), NaN counting as the extremum (np.argmax / np.argmin).
// tr_hardmax_<dt>(x, y, total, kept dims, x/y kept strides, reduced dims, x/y reduced
//                 strides)
//     Hardmax: 1 at the first maximum (np.argmax: the first NaN if any) of each kept index's
//     reduced elements (logical order), 0 elsewhere.
// tr_global_max_pool_grad_<dt>(gy, x, gx, total, kept dims, x/gy/gx kept strides,
//                              reduced dims, x/gx reduced strides)
//     GlobalMaxPoolGrad: gy at each plane's first maximum (as tr_hardmax), 0 elsewhere.
// The instantiations (TR_REDUCE(T, dt) lines) are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"
#include "strided.cuh"

// Reduce* op codes of tr_reduce (the binder's REDUCE_OPS table mirrors them)
#define TR_RED_SUM 0
#define TR_RED_MEAN 1
#define TR_RED_MAX 2
#define TR_RED_MIN 3
#define TR_RED_PROD 4
#define TR_RED_L1 5
#define TR_RED_L2 6
#define TR_RED_SUM_SQUARE 7
#define TR_RED_LOG_SUM 8
#define TR_RED_LOG_SUM_EXP 9
#define TR_RED_LP 10

// The reduced elements of one output: offsets base + the strided offset of k < count over
// dims rd / strides rs; the last dim runs as a plain loop, the others through
// tr_strided_offset (od / os: rd / rs shifted right by one, the last dim dropped).
struct TrReduced {
    long long od[6], os[6], inner, inner_stride, outer;
};
TR_HD TrReduced tr_reduced(const long long* rd, const long long* rs) {
    TrReduced r;
    r.od[0] = 1;
    r.os[0] = 0;
    r.outer = 1;
    for (int k = 0; k < 5; ++k) {
        r.od[k + 1] = rd[k];
        r.os[k + 1] = rs[k];
        r.outer *= rd[k];
    }
    r.inner = rd[5];
    r.inner_stride = rs[5];
    return r;
}
#define TR_FOR_REDUCED(r, base, off)                                                           \
    for (long long o_ = 0; o_ < (r).outer; ++o_)                                               \
        for (long long i_ = 0, off = (base) + tr_strided_offset(o_, (r).od, (r).os);           \
             i_ < (r).inner; ++i_, off += (r).inner_stride)

// np.maximum / np.minimum's NaN rule: once NaN, NaN; a NaN operand wins
TR_HD double tr_max_step(double acc, double v) {
    return acc != acc ? acc : (v != v || v > acc ? v : acc);
}
TR_HD double tr_min_step(double acc, double v) {
    return acc != acc ? acc : (v != v || v < acc ? v : acc);
}

#define TR_DBL_MAX 1.7976931348623157e308
#if defined(__CUDACC__)
TR_HD double tr_f64_bits(unsigned long long u) { return __longlong_as_double((long long)u); }
#else
TR_HD double tr_f64_bits(unsigned long long u) {
    double f;
    memcpy(&f, &u, 8);
    return f;
}
#endif
TR_HD double tr_inf() { return tr_f64_bits(0x7ff0000000000000ull); }
// the mean of no element: NumPy's NaN (positive; x86's 0 / 0 sets the sign bit)
TR_HD double tr_empty_mean(double sum, long long count) {
    return count ? sum / (double)count : tr_f64_bits(0x7ff8000000000000ull);
}

// A reduction folds an accumulator from tr_red_start with tr_red_step per element, combines
// partial accumulators with tr_red_combine and ends with tr_red_finish. LogSumExp is two
// folds: TR_RED_MAX, then TR_RED_SUM over exp(x - shift) (tr_red_value), shift = the max
// clamped to finite values so that +-inf inputs stay exact (NumPy's).
TR_HD double tr_red_start(int fold) {
    if (fold == TR_RED_MIN) return tr_inf();
    if (fold == TR_RED_MAX) return -tr_inf();
    return fold == TR_RED_PROD ? 1.0 : 0.0;
}
TR_HD double tr_red_step(int fold, double acc, double v, double p) {
    switch (fold) {
        case TR_RED_MAX: return tr_max_step(acc, v);
        case TR_RED_MIN: return tr_min_step(acc, v);
        case TR_RED_PROD: return acc * v;
        case TR_RED_L1: return acc + fabs(v);
        case TR_RED_L2:
        case TR_RED_SUM_SQUARE: return acc + v * v;
        case TR_RED_LP: return acc + pow(fabs(v), p);
        default: return acc + v;
    }
}
TR_HD double tr_red_combine(int fold, double a, double b) {
    switch (fold) {
        case TR_RED_MAX: return tr_max_step(a, b);
        case TR_RED_MIN: return tr_min_step(a, b);
        case TR_RED_PROD: return a * b;
        default: return a + b;
    }
}
TR_HD int tr_red_fold(int op) { return op == TR_RED_LOG_SUM_EXP ? TR_RED_SUM : op; }
TR_HD double tr_red_value(int op, double v, double shift) {
    return op == TR_RED_LOG_SUM_EXP ? exp(v - shift) : v;
}
TR_HD double tr_lse_shift(double m) {
    return m < -TR_DBL_MAX ? -TR_DBL_MAX : (m > TR_DBL_MAX ? TR_DBL_MAX : m);
}
TR_HD double tr_red_finish(int op, double acc, long long count, double p, double shift) {
    switch (op) {
        case TR_RED_MEAN: return tr_empty_mean(acc, count);
        case TR_RED_L2: return sqrt(acc);
        case TR_RED_LOG_SUM: return log(acc);
        case TR_RED_LOG_SUM_EXP: return log(acc) + shift;
        case TR_RED_LP: return pow(acc, 1.0 / p);
        default: return acc;
    }
}

// one output of tr_reduce: its reduced elements at base, in logical order
template <class T>
TR_HD double tr_reduce_one(const T* x, long long base, const TrReduced& r, int op, double p,
                           long long count) {
    double shift = 0.0;
    if (op == TR_RED_LOG_SUM_EXP) {
        double m = tr_red_start(TR_RED_MAX);
        TR_FOR_REDUCED(r, base, off) m = tr_max_step(m, tr_get(x, off));
        shift = tr_lse_shift(m);
    }
    int fold = tr_red_fold(op);
    double acc = tr_red_start(fold);
    TR_FOR_REDUCED(r, base, off) {
        acc = tr_red_step(fold, acc, tr_red_value(op, tr_get(x, off), shift), p);
    }
    return tr_red_finish(op, acc, count, p, shift);
}

// lane t's partial fold (tr_reduce_blocks) of the reduced elements at base: long inner runs
// split across the lanes (adjacent lanes read adjacent elements), short ones whole per lane
template <class T>
TR_HD double tr_reduce_lane(const T* x, long long base, const TrReduced& r, int fold, int op,
                            double p, double shift, long long t) {
    double acc = tr_red_start(fold);
    bool split = r.inner >= TR_RED_BLOCK / 4;
    for (long long o = split ? 0 : t; o < r.outer; o += split ? 1 : TR_RED_BLOCK) {
        long long b = base + tr_strided_offset(o, r.od, r.os);
        for (long long i = split ? t : 0; i < r.inner; i += split ? TR_RED_BLOCK : 1) {
            acc = tr_red_step(fold, acc, tr_red_value(op, tr_get(x, b + i * r.inner_stride),
                                                      shift), p);
        }
    }
    return acc;
}

// part[0] = the fold of part[0, TR_RED_BLOCK) (tr_block_tree_sum's tree, with the fold's
// combine); every thread of the block calls it after filling part
TR_HD void tr_block_tree_fold(double* part, int fold) {
    if (fold != TR_RED_MAX && fold != TR_RED_MIN && fold != TR_RED_PROD) {
        tr_block_tree_sum(part, 1);
        return;
    }
    for (unsigned s = TR_RED_BLOCK / 2; s >= 1; s >>= 1) {
        TR_SYNC();
        TR_LANES(t) {
            if (t < s) part[t] = tr_red_combine(fold, part[t], part[t + s]);
        }
    }
    TR_SYNC();
}

// the index (logical order, < count) of the first maximum of the reduced elements at base;
// NaN is the maximum (np.argmax)
template <class T>
TR_HD long long tr_first_max(const T* x, long long base, const TrReduced& r) {
    long long k = 0, arg = 0;
    float best = 0.0f;
    TR_FOR_REDUCED(r, base, off) {
        float v = tr_get(x, off);
        if (k == 0 || (best == best && (v != v || v > best))) {
            best = v;
            arg = k;
        }
        ++k;
    }
    return arg;
}

// y = first-row-max-shifted softmax of one row of c elements (log: log-softmax)
template <class T>
TR_HD void tr_softmax_row(const T* x, T* y, long long c, int log_softmax) {
    float m = tr_get(x, 0);
    for (long long j = 1; j < c; ++j) {  // np.max: NaN propagates
        float v = tr_get(x, j);
        if (m == m && (v != v || v > m)) m = v;
    }
    float s = 0.0f;
    for (long long j = 0; j < c; ++j) s += expf(tr_get(x, j) - m);
    if (log_softmax) {
        float ls = logf(s);
        for (long long j = 0; j < c; ++j) tr_put(y, j, (tr_get(x, j) - m) - ls);
    } else {
        for (long long j = 0; j < c; ++j) tr_put(y, j, expf(tr_get(x, j) - m) / s);
    }
}

#define TR_REDUCE(T, dt)                                                                       \
    /* rows of c elements, row stride ld (lanes [c, ld) written 0) */                         \
    TR_KERNEL void tr_softmax_##dt(const T* x, T* y, long long rows, long long c,             \
                                   long long ld, int log_softmax) {                            \
        TR_GRID_STRIDE(r, rows) {                                                              \
            tr_softmax_row(x + r * ld, y + r * ld, c, log_softmax);                            \
            for (long long j = c; j < ld; ++j) tr_put(y, r * ld + j, 0.0f);                    \
        }                                                                                      \
    }                                                                                          \
    /* y[o, i] = sum_k x[o, k, i] (mean: / r) over x as [outer, r, inner] */                 \
    TR_KERNEL void tr_reduce_mid_##dt(const T* x, T* y, long long outer, long long r,         \
                                      long long inner, int mean) {                             \
        TR_GRID_STRIDE(j, outer * inner) {                                                     \
            long long o = j / inner, i = j % inner;                                            \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < r; ++k) acc += (double)tr_get(x, (o * r + k) * inner + i); \
            tr_put(y, j, mean ? (float)tr_empty_mean(acc, r) : (float)acc);                    \
        }                                                                                      \
    }                                                                                          \
    /* y[col] = sum over rows of x[row * ld + col], col < cols (bias gradients) */             \
    TR_KERNEL void tr_sum_rows_##dt(const T* x, T* y, long long rows, long long cols,         \
                                    long long ld) {                                            \
        TR_GRID_STRIDE(col, cols) {                                                            \
            float acc = 0.0f;                                                                  \
            for (long long r = 0; r < rows; ++r) acc += tr_get(x, r * ld + col);               \
            tr_put(y, col, acc);                                                               \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_reduce_##dt(const T* x, T* y, long long total, int op, double p,         \
                                  long long count, TR_DIMS6, TR_STRIDES6(xs), TR_STRIDES6(ys),  \
                                  long long r0, long long r1, long long r2, long long r3,      \
                                  long long r4, long long r5, TR_STRIDES6(rs)) {               \
        const long long d[6] = {d0, d1, d2, d3, d4, d5}, xk[6] = {xs0, xs1, xs2, xs3, xs4, xs5}; \
        const long long yk[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        const long long rd[6] = {r0, r1, r2, r3, r4, r5}, xr[6] = {rs0, rs1, rs2, rs3, rs4, rs5}; \
        TrReduced red = tr_reduced(rd, xr);                                                    \
        TR_GRID_STRIDE(j, total) {                                                             \
            double v = tr_reduce_one(x, tr_strided_offset(j, d, xk), red, op, p, count);       \
            tr_put(y, tr_strided_offset(j, d, yk), (float)v);                                  \
        }                                                                                      \
    }                                                                                          \
    /* tr_reduce with one block per output: TR_RED_BLOCK lanes, then a fixed tree */        \
    TR_KERNEL void tr_reduce_blocks_##dt(const T* x, T* y, long long total, int op, double p,  \
                                         long long count, TR_DIMS6, TR_STRIDES6(xs),          \
                                         TR_STRIDES6(ys), long long r0, long long r1,          \
                                         long long r2, long long r3, long long r4,             \
                                         long long r5, TR_STRIDES6(rs)) {                      \
        TR_SHARED double part[TR_RED_BLOCK];                                                   \
        const long long d[6] = {d0, d1, d2, d3, d4, d5}, xk[6] = {xs0, xs1, xs2, xs3, xs4, xs5}; \
        const long long yk[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        const long long rd[6] = {r0, r1, r2, r3, r4, r5}, xr[6] = {rs0, rs1, rs2, rs3, rs4, rs5}; \
        TrReduced red = tr_reduced(rd, xr);                                                    \
        int fold = tr_red_fold(op);                                                            \
        TR_BLOCK_STRIDE(u, total) {                                                            \
            long long base = tr_strided_offset(u, d, xk);                                      \
            double shift = 0.0;                                                                \
            if (op == TR_RED_LOG_SUM_EXP) {                                                    \
                TR_LANES(t) part[t] = tr_reduce_lane(x, base, red, TR_RED_MAX, TR_RED_MAX,     \
                                                     p, 0.0, t);                               \
                tr_block_tree_fold(part, TR_RED_MAX);                                          \
                shift = tr_lse_shift(part[0]);                                                 \
                TR_SYNC(); /* every thread has read part[0] */                                 \
            }                                                                                  \
            TR_LANES(t) part[t] = tr_reduce_lane(x, base, red, fold, op, p, shift, t);         \
            tr_block_tree_fold(part, fold);                                                    \
            if (threadIdx.x == 0) {                                                            \
                tr_put(y, tr_strided_offset(u, d, yk),                                         \
                       (float)tr_red_finish(op, part[0], count, p, shift));                    \
            }                                                                                  \
            TR_SYNC(); /* part is refilled for the next output */                              \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_arg_extreme_##dt(const T* x, long long* y, long long total, int is_min,  \
                                       int last, long long n, long long stride, TR_DIMS6,      \
                                       TR_STRIDES6(xs), TR_STRIDES6(ys)) {                     \
        const long long d[6] = {d0, d1, d2, d3, d4, d5}, xk[6] = {xs0, xs1, xs2, xs3, xs4, xs5}; \
        const long long yk[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        TR_GRID_STRIDE(j, total) {                                                             \
            const T* xj = x + tr_strided_offset(j, d, xk);                                     \
            long long arg = last ? n - 1 : 0;                                                  \
            float best = tr_get(xj, arg * stride);                                             \
            for (long long t = 1; t < n; ++t) {                                                \
                long long k = last ? n - 1 - t : t;                                            \
                float v = tr_get(xj, k * stride);                                              \
                bool better = v != v || (is_min ? v < best : v > best);                        \
                if (best == best && better) {                                                  \
                    best = v;                                                                  \
                    arg = k;                                                                   \
                }                                                                              \
            }                                                                                  \
            y[tr_strided_offset(j, d, yk)] = arg;                                              \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_hardmax_##dt(const T* x, T* y, long long total, TR_DIMS6,                \
                                   TR_STRIDES6(xs), TR_STRIDES6(ys), long long r0,             \
                                   long long r1, long long r2, long long r3, long long r4,     \
                                   long long r5, TR_STRIDES6(xrs), TR_STRIDES6(yrs)) {         \
        const long long d[6] = {d0, d1, d2, d3, d4, d5}, xk[6] = {xs0, xs1, xs2, xs3, xs4, xs5}; \
        const long long yk[6] = {ys0, ys1, ys2, ys3, ys4, ys5};                                \
        const long long rd[6] = {r0, r1, r2, r3, r4, r5};                                      \
        const long long xr[6] = {xrs0, xrs1, xrs2, xrs3, xrs4, xrs5};                          \
        const long long yr[6] = {yrs0, yrs1, yrs2, yrs3, yrs4, yrs5};                          \
        TrReduced xred = tr_reduced(rd, xr), yred = tr_reduced(rd, yr);                        \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long arg = tr_first_max(x, tr_strided_offset(j, d, xk), xred), k = 0;         \
            TR_FOR_REDUCED(yred, tr_strided_offset(j, d, yk), off) {                           \
                tr_put(y, off, k++ == arg ? 1.0f : 0.0f);                                      \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_global_max_pool_grad_##dt(const T* gy, const T* x, T* gx,                \
                                                long long total, TR_DIMS6, TR_STRIDES6(xs),    \
                                                TR_STRIDES6(gys), TR_STRIDES6(gxs),            \
                                                long long r0, long long r1, long long r2,      \
                                                long long r3, long long r4, long long r5,      \
                                                TR_STRIDES6(xrs), TR_STRIDES6(gxrs)) {         \
        const long long d[6] = {d0, d1, d2, d3, d4, d5}, xk[6] = {xs0, xs1, xs2, xs3, xs4, xs5}; \
        const long long gyk[6] = {gys0, gys1, gys2, gys3, gys4, gys5};                         \
        const long long gxk[6] = {gxs0, gxs1, gxs2, gxs3, gxs4, gxs5};                         \
        const long long rd[6] = {r0, r1, r2, r3, r4, r5};                                      \
        const long long xr[6] = {xrs0, xrs1, xrs2, xrs3, xrs4, xrs5};                          \
        const long long gxr[6] = {gxrs0, gxrs1, gxrs2, gxrs3, gxrs4, gxrs5};                   \
        TrReduced xred = tr_reduced(rd, xr), gxred = tr_reduced(rd, gxr);                      \
        TR_GRID_STRIDE(j, total) {                                                             \
            long long arg = tr_first_max(x, tr_strided_offset(j, d, xk), xred), k = 0;         \
            float g = tr_get(gy, tr_strided_offset(j, d, gyk));                                \
            TR_FOR_REDUCED(gxred, tr_strided_offset(j, d, gxk), off) {                         \
                tr_put(gx, off, k++ == arg ? g : 0.0f);                                        \
            }                                                                                  \
        }                                                                                      \
    }
