// Random draws (tr_onnx/ops/random.py): the training form RandomDraw, keyed by its ``key``
// attribute and counted by the step input, from NumPy's Philox stream (elementwise.cuh):
// element i of the output (logical C order) takes 64-bit draw i of Philox(key).jumped(step),
// one thread per Philox block of 4 draws.
// tr_random_uniform_<dt>(y, n, step, key, low, range)
//     y = u * range + low in double (range = high - low, as the numpy kernel forms them), then
//     y's type: NumPy's numbers bit for bit (f16/bf16 round through float32: a double within
//     2^-29 ulp of a half-way point could round the other way, never met in practice)
// tr_random_normal_<dt>(y, n, step, key, mean, scale)
//     y = z * scale + mean, z standard normal by Box-Muller from draws (4k, 4k+1) and
//     (4k+2, 4k+3): NumPy's ziggurat consumes a variable number of draws per value (a
//     rejection chain no thread can place without its predecessors), so these are the same
//     distribution, not NumPy's numbers
// tr_random_bernoulli_<pdt>_b<bytes>(p, y, n, step, key, one)
//     y = one (the bits of 1 in y's type) where u < p (compared in double, as NumPy), else 0;
//     p outside [0, 1] is not checked (NumPy raises): p > 1 draws 1, p < 0 and NaN draw 0
// The instantiations (TR_RANDOM(T, dt), TR_BERNOULLI(P, pdt, U, bytes) lines) are appended by
// tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// store a double into y's type (float types through float32, double as it is)
template <class T> TR_HD void tr_random_put(T* y, long long i, double v) {
    tr_put(y, i, (float)v);
}
TR_HD void tr_random_put(double* y, long long i, double v) { y[i] = v; }
template <class P> TR_HD double tr_random_prob(const P* p, long long i) { return tr_get(p, i); }
TR_HD double tr_random_prob(const double* p, long long i) { return p[i]; }

#define TR_RANDOM(T, dt)                                                                       \
    TR_KERNEL void tr_random_uniform_##dt(T* y, long long n, const long long* step,            \
                                          long long key, double low, double range) {           \
        unsigned long long s = (unsigned long long)*step, bits[4];                             \
        TR_GRID_STRIDE(k, (n + 3) / 4) {                                                       \
            tr_philox4x64((unsigned long long)k, s, (unsigned long long)key, bits);            \
            for (int w = 0; w < 4; ++w) {                                                      \
                long long i = k * 4 + w;                                                       \
                double u = tr_philox_uniform(bits[w]) * range;                                 \
                if (i < n) tr_random_put(y, i, u + low);                                       \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_random_normal_##dt(T* y, long long n, const long long* step,             \
                                         long long key, double mean, double scale) {           \
        unsigned long long s = (unsigned long long)*step, bits[4];                             \
        TR_GRID_STRIDE(k, (n + 3) / 4) {                                                       \
            tr_philox4x64((unsigned long long)k, s, (unsigned long long)key, bits);            \
            for (int w = 0; w < 4; w += 2) {                                                   \
                double r = sqrt(-2.0 * log(1.0 - tr_philox_uniform(bits[w])));                 \
                double t = 6.283185307179586 * tr_philox_uniform(bits[w + 1]);                 \
                double z[2] = {r * cos(t), r * sin(t)};                                        \
                for (int j = 0; j < 2; ++j) {                                                  \
                    long long i = k * 4 + w + j;                                               \
                    if (i < n) tr_random_put(y, i, z[j] * scale + mean);                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

#define TR_BERNOULLI(P, pdt, U, bytes)                                                         \
    TR_KERNEL void tr_random_bernoulli_##pdt##_b##bytes(const P* p, U* y, long long n,         \
                                                        const long long* step, long long key,  \
                                                        long long one) {                       \
        unsigned long long s = (unsigned long long)*step, bits[4];                             \
        TR_GRID_STRIDE(k, (n + 3) / 4) {                                                       \
            tr_philox4x64((unsigned long long)k, s, (unsigned long long)key, bits);            \
            for (int w = 0; w < 4; ++w) {                                                      \
                long long i = k * 4 + w;                                                       \
                if (i < n) y[i] = tr_philox_uniform(bits[w]) < tr_random_prob(p, i) ? (U)one   \
                                                                                     : (U)0;   \
            }                                                                                  \
        }                                                                                      \
    }
