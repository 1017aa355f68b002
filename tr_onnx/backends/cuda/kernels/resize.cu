// Resize / Upsample and ResizeGrad (tr_onnx/ops/resize.py). The numpy kernel's separable
// (index, weight) tables, rebuilt on the device every step (a step holds no plan-time data, and
// the tables are tiny: one row per output position of one axis), then applied one axis at a
// time as the numpy kernel applies them.
//
// tr_resize_table(idx, w, outside, n_out, n_in, taps, mode, coord, rule, exclude, antialias,
//                 scale, a, r0, r1)
//     One thread per output position o of one axis: row o of ``axis_table``: the source
//     coordinate, the window and its coefficients computed in float64 with the numpy
//     reference's expressions in its order (so nearest picks and every weight are its bits),
//     exclude_outside / antialias renormalisation with NumPy's pairwise sum, tf_crop_and_resize
//     extrapolation (outside[o] = 1, the row empty), indices clamped to the edge, equal indices
//     merged (summed in float64 in window order, as np.bincount does), zero weights dropped.
//     idx/w are [n_out, taps]: the entries in increasing index order, then padding taps
//     (index -1: read index 0 with weight 0, as the numpy table's padding does); w as float32.
//     mode: 0 nearest, 1 linear, 2 cubic; coord: 0 half_pixel, 1 half_pixel_symmetric,
//     2 pytorch_half_pixel, 3 align_corners, 4 asymmetric, 5 tf_half_pixel_for_nn,
//     6 tf_crop_and_resize; rule (nearest): 0 round_prefer_floor, 1 round_prefer_ceil,
//     2 floor, 3 ceil. outside may be null unless coord is 6.
// tr_resize_transpose(idx, w, tidx, tw, n_out, taps, n_in, ttaps)
//     The adjoint table (ResizeGrad), gather form: one thread per input position i scans the
//     forward table and lists the outputs o that read i (increasing o, as transpose_table's
//     sort) with their weights; no atomics, deterministic.
// tr_resize_apply_<sdt>_<ddt>(x, y, idx, w, total, n_in, n_out, inner, taps, c, cp)
//     One axis: x is [outer, n_in, inner] and y [outer, n_out, inner] (physical, row-major);
//     y[., o, .] = x[., idx[o, 0], .] * w[o, 0] + ... + x[., idx[o, taps-1], .] * w[o, taps-1]
//     summed left to right in fp32 (NumPy's take / multiply / add sequence). Elements whose
//     physical lane (j % cp) is a channel pad (>= c) are written 0 (compact: c = cp = 1).
// tr_resize_fill_<dt>(y, outside, total, n_out, inner, c, cp, value)
//     tf_crop_and_resize: y[., o, .] = value where outside[o] (channel pads left 0).
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

#define TR_RESIZE_WINDOW 64  // the most taps one window holds (resize.py WINDOW)

// np.add.reduce of n float64 values along a contiguous axis: NumPy's pairwise summation
// (numpy/_core/src/umath/loops_utils.h.src), for n <= 128
TR_HD double tr_pairwise_sum(const double* a, long long n) {
    if (n < 8) {
        double res = 0.0;
        for (long long i = 0; i < n; ++i) res += a[i];
        return res;
    }
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    long long i = 8;
    for (; i < n - (n % 8); i += 8)
        for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
}

// Keys' cubic convolution kernel (resize.py _cubic), both branches as np.where evaluates them
TR_HD double tr_resize_cubic(double x, double a) {
    x = fabs(x);
    double near_ = ((a + 2) * x - (a + 3)) * x * x + 1;
    double far_ = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
    return x <= 1 ? near_ : (x < 2 ? far_ : 0.0);
}

// resize.py _source_coordinates at output position o; *out = tf_crop_and_resize's extrapolation
TR_HD double tr_resize_source(long long o, long long coord, double s, long long n_in,
                              long long n_out, double r0, double r1, int* out) {
    double y = (double)o, width = s * (double)n_in, n1 = (double)(n_in - 1);
    *out = 0;
    switch (coord) {
        case 0: return (y + 0.5) / s - 0.5;
        case 1: {
            double offset = (double)n_in / 2 * (1 - (double)n_out / width);
            return offset + (y + 0.5) / s - 0.5;
        }
        case 2: return width == 1 ? -0.5 : (y + 0.5) / s - 0.5;
        case 3: return width == 1 ? 0.0 : y * n1 / (width - 1);
        case 4: return y / s;
        case 5: return (y + 0.5) / s;
        default: {
            double x = (width == 1 ? (r1 - r0) * n1 / 2 : y * (r1 - r0) * n1 / (width - 1)) +
                       r0 * n1;
            *out = (x < 0 || x > n1) ? 1 : 0;
            return x;
        }
    }
}

TR_KERNEL void tr_resize_table(long long* idx, float* w, long long* outside, long long n_out,
                               long long n_in, long long taps, long long mode, long long coord,
                               long long rule, long long exclude, long long antialias,
                               double scale, double a, double r0, double r1) {
    TR_GRID_STRIDE(o, n_out) {
        int out;
        double x = tr_resize_source(o, coord, scale, n_in, n_out, r0, r1, &out);
        double k = floor(x);
        int integer = x == k;
        double r = integer ? 1.0 : x - k;
        double c[TR_RESIZE_WINDOW];
        long long n = 2;
        double s = scale < 1.0 ? scale : 1.0;
        if (mode == 0) {  // resize.py _coefficients: nearest
            int right = rule == 0 ? r > 0.5 : rule == 1 ? r >= 0.5 : rule == 2 ? r == 1 : 1;
            right = right || r == 1;
            c[0] = right ? 0.0 : 1.0;
            c[1] = right ? 1.0 : 0.0;
        } else if (mode == 1 && !antialias) {
            c[0] = 1 - r;
            c[1] = r;
        } else if (mode == 2 && !antialias) {
            n = 4;
            for (long long j = 0; j < 4; ++j) c[j] = tr_resize_cubic((double)(j - 1) - r, a);
        } else {  // antialias: the kernel stretched by 1 / s over a wider window, normalised
            long long start = (long long)floor((mode == 1 ? -1.0 : -2.0) / s) + 1;
            n = 2 - 2 * start;
            if (n > TR_RESIZE_WINDOW) n = TR_RESIZE_WINDOW;  // the binding refuses wider ones
            for (long long j = 0; j < n; ++j) {
                double d = (double)(start + j) - r;
                if (mode == 1) {
                    double v = 1 - fabs(d * s);
                    c[j] = v < 0 ? 0.0 : (v > 1 ? 1.0 : v);
                } else {
                    c[j] = tr_resize_cubic(s * d, a);
                }
            }
            double total = tr_pairwise_sum(c, n);
            for (long long j = 0; j < n; ++j) c[j] = c[j] / total;
        }
        long long first = (long long)(k + (integer ? -(double)(n / 2) : -(double)(n / 2) + 1));
        if (exclude) {
            for (long long j = 0; j < n; ++j)
                if (first + j < 0 || first + j >= n_in) c[j] = 0.0;
            double total = tr_pairwise_sum(c, n);
            for (long long j = 0; j < n; ++j) c[j] = c[j] / (total == 0 ? 1.0 : total);
        }
        if (outside != 0) outside[o] = out;
        long long count = 0, j = 0;
        while (j < n && !out) {
            long long p = first + j, col = p < 0 ? 0 : (p > n_in - 1 ? n_in - 1 : p);
            double sum = 0.0;
            for (; j < n; ++j) {
                long long q = first + j;
                if ((q < 0 ? 0 : (q > n_in - 1 ? n_in - 1 : q)) != col) break;
                sum += c[j];
            }
            if (sum != 0 && count < taps) {
                idx[o * taps + count] = col;
                w[o * taps + count] = (float)sum;
                ++count;
            }
        }
        for (; count < taps; ++count) {
            idx[o * taps + count] = -1;
            w[o * taps + count] = 0.0f;
        }
    }
}

TR_KERNEL void tr_resize_transpose(const long long* idx, const float* w, long long* tidx,
                                   float* tw, long long n_out, long long taps, long long n_in,
                                   long long ttaps) {
    TR_GRID_STRIDE(i, n_in) {
        long long count = 0;
        for (long long o = 0; o < n_out; ++o)
            for (long long t = 0; t < taps; ++t)
                if (idx[o * taps + t] == i && count < ttaps) {
                    tidx[i * ttaps + count] = o;
                    tw[i * ttaps + count] = w[o * taps + t];
                    ++count;
                }
        for (; count < ttaps; ++count) {
            tidx[i * ttaps + count] = -1;
            tw[i * ttaps + count] = 0.0f;
        }
    }
}

#define TR_RESIZE_APPLY(S, sdt, D, ddt)                                                        \
    TR_KERNEL void tr_resize_apply_##sdt##_##ddt(const S* x, D* y, const long long* idx,      \
                                                 const float* w, long long total,              \
                                                 long long n_in, long long n_out,              \
                                                 long long inner, long long taps, long long c, \
                                                 long long cp) {                               \
        TR_GRID_STRIDE(j, total) {                                                             \
            if (j % cp >= c) {                                                                 \
                tr_put(y, j, 0.0f);                                                            \
                continue;                                                                      \
            }                                                                                  \
            long long e = j % inner, o = (j / inner) % n_out, base = j / (inner * n_out);      \
            const S* src = x + base * n_in * inner + e;                                        \
            float acc = 0.0f;                                                                  \
            for (long long t = 0; t < taps; ++t) {                                             \
                long long q = idx[o * taps + t];                                               \
                float v = tr_get(src, (q < 0 ? 0 : q) * inner) * w[o * taps + t];              \
                acc = t == 0 ? v : acc + v;                                                    \
            }                                                                                  \
            tr_put(y, j, acc);                                                                 \
        }                                                                                      \
    }

#define TR_RESIZE_FILL(T, dt)                                                                  \
    TR_KERNEL void tr_resize_fill_##dt(T* y, const long long* outside, long long total,       \
                                       long long n_out, long long inner, long long c,          \
                                       long long cp, float value) {                            \
        TR_GRID_STRIDE(j, total) {                                                             \
            if (j % cp < c && outside[(j / inner) % n_out]) tr_put(y, j, value);               \
        }                                                                                      \
    }
