// Per-element math of tr_onnx's CUDA kernels, compiled both by NVRTC (device) and by the host
// C++ compiler (tests compare it with the NumPy kernels). Every function takes and returns
// float: storage types (float, fp16, bf16) are converted on load and store, compute is fp32.
//
// The formulas follow tr_onnx/ops/unary.py and ops/elementwise.py (and the gradient rules
// there), ops/losses.py and ops/optimizers.py operation by operation, in the same order, so
// that with FMA contraction off (NVRTC --fmad=false, host -ffp-contract=off) the plain
// arithmetic rounds exactly as NumPy does; only the libm functions (expf, tanhf, erff, ...)
// differ by their few ulp. Every family's .cu includes this header (the host/device shim
// below); helpers that only one family uses live in that family's file.
#pragma once

#if defined(__CUDACC__)  // NVRTC or nvcc
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define TR_HD __host__ __device__ __forceinline__
#define TR_KERNEL extern "C" __global__
typedef __half tr_f16;
typedef __nv_bfloat16 tr_bf16;
TR_HD float tr_to_float(tr_f16 v) { return __half2float(v); }
TR_HD float tr_to_float(tr_bf16 v) { return __bfloat162float(v); }
TR_HD void tr_from_float(float v, tr_f16* out) { *out = __float2half_rn(v); }
TR_HD void tr_from_float(float v, tr_bf16* out) { *out = __float2bfloat16_rn(v); }
#else  // host C++: the tests' build; one "thread" runs every grid-stride loop to the end
#include <math.h>
#include <string.h>
#define TR_HD inline
#define TR_KERNEL extern "C"
typedef _Float16 tr_f16;
struct tr_bf16 { unsigned short bits; };
struct tr_host_dim3 { unsigned x, y, z; };
static const tr_host_dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0};
static const tr_host_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
TR_HD float tr_to_float(tr_f16 v) { return (float)v; }
TR_HD void tr_from_float(float v, tr_f16* out) { *out = (tr_f16)v; }  // round to nearest even
TR_HD float tr_to_float(tr_bf16 v) {
    unsigned u = (unsigned)v.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
TR_HD void tr_from_float(float v, tr_bf16* out) {  // round to nearest even, NaN stays NaN
    unsigned u;
    memcpy(&u, &v, 4);
    out->bits = (v != v) ? (unsigned short)0x7fc0
                         : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

TR_HD float tr_to_float(float v) { return v; }
TR_HD void tr_from_float(float v, float* out) { *out = v; }

// Load element i of any storage type as float; store a float with round-to-nearest-even.
template <class T> TR_HD float tr_get(const T* p, long long i) { return tr_to_float(p[i]); }
template <class T> TR_HD void tr_put(T* p, long long i, float v) { tr_from_float(v, p + i); }

#define TR_GRID_STRIDE(i, n)                                                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// Block reductions in a fixed order (deterministic: no float atomics), that the host build
// runs in the same order. A block works on units TR_BLOCK_STRIDE hands out (all of them in
// turn on the host); its TR_RED_BLOCK lanes (TR_LANES: one per thread when launched with
// TR_RED_BLOCK threads, several per thread with fewer, all of them in turn on the host) fill
// a shared array that tr_block_tree_sum folds. The result depends on TR_RED_BLOCK and the
// units only, never on the launch's grid or block size.
#define TR_RED_BLOCK 256
#if defined(__CUDACC__)
#define TR_SHARED __shared__
#define TR_SYNC() __syncthreads()
#else  // the host build's single "thread"
#define TR_SHARED static
#define TR_SYNC() ((void)0)
#endif
#define TR_LANES(t) for (unsigned t = threadIdx.x; t < TR_RED_BLOCK; t += blockDim.x)
#define TR_BLOCK_STRIDE(u, n) for (long long u = blockIdx.x; u < (n); u += gridDim.x)

// part[t] for t < width: its sum with part[t + k * width], k < TR_RED_BLOCK / width (a power
// of two), folded as a tree (halves at distance TR_RED_BLOCK / 2, / 4, ..., width); every
// thread of the block calls it, after filling part (it syncs before and after)
TR_HD void tr_block_tree_sum(double* part, unsigned width) {
    for (unsigned s = TR_RED_BLOCK / 2; s >= width; s >>= 1) {
        TR_SYNC();
        TR_LANES(t) {
            if (t < s) part[t] += part[t + s];
        }
    }
    TR_SYNC();
}

// -inf (max-pooling's padding, attention's hidden keys)
#if defined(__CUDACC__)
TR_HD float tr_neg_inf() { return __int_as_float(0xff800000); }
#else
TR_HD float tr_neg_inf() {
    unsigned u = 0xff800000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

// ---- helpers that keep NaN where NumPy keeps it -----------------------------------------
TR_HD float tr_max_nan(float x, float lo) { return x < lo ? lo : x; }   // np.maximum(x, lo)
TR_HD float tr_min_nan(float x, float hi) { return x > hi ? hi : x; }   // np.minimum(x, hi)
TR_HD float tr_clip01(float v) { return tr_min_nan(tr_max_nan(v, 0.0f), 1.0f); }
TR_HD bool tr_isfinite(float v) { return fabsf(v) <= 3.40282347e38f; }  // false for inf, NaN

// Constants as NumPy rounds them to float32 (np.float32(math.sqrt(2 / math.pi)), ...).
#define TR_SQRT_2_OVER_PI 0.797884583473205566f   // gelu tanh form
#define TR_GELU_CUBIC 0.0447149984538555145f      // 0.044715
#define TR_GELU_3KC 0.107032224535942078f         // 3 * 0.044715 * sqrt(2/pi)
#define TR_SQRT1_2 0.707106769084930420f          // 1/sqrt(2)
#define TR_SQRT1_2_LO 1.21016175e-08f             // 1/sqrt(2) - TR_SQRT1_2
#define TR_INV_SQRT_2PI 0.398942291736602783f     // 1/sqrt(2 pi)
#define TR_ONE_SIXTH 0.166666671633720398f
#define TR_ONE_THIRD 0.333333343267440796f

// ---- unary forward: f(x, a, b); a, b are the op's float attributes (alpha, beta, min, max) -----
TR_HD float tr_relu(float x, float, float) { return x < 0.0f ? 0.0f : x; }
TR_HD float tr_leaky_relu(float x, float alpha, float) { return x > 0.0f ? x : x * alpha; }
TR_HD float tr_elu(float x, float alpha, float) { return x > 0.0f ? x : expm1f(x) * alpha; }
TR_HD float tr_sigmoid(float x, float, float) {
    float e = expf(-fabsf(x));  // never overflows: 1/(1+e) for x >= 0, e/(1+e) below
    float y = 1.0f / (e + 1.0f);
    return x < 0.0f ? y * e : y;
}
TR_HD float tr_hardsigmoid(float x, float alpha, float beta) { return tr_clip01(x * alpha + beta); }
TR_HD float tr_hardswish(float x, float, float) { return tr_clip01(x * TR_ONE_SIXTH + 0.5f) * x; }
TR_HD float tr_tanh(float x, float, float) { return tanhf(x); }
// x Phi(x), Phi(x) = erfc(z)/2 with z = -x/sqrt(2): no cancellation in the negative tail
// (NumPy computes Gelu in float64). The rounding error dz of z (the product's and the
// constant's) costs |2 z dz| relative there, so it is put back to first order:
// erfc(z + dz) = erfc(z) - 2/sqrt(pi) exp(-z^2) dz.
TR_HD float tr_gelu(float x, float, float) {
    float z = -x * TR_SQRT1_2;
    float dz = tr_isfinite(z) ? fmaf(-x, TR_SQRT1_2, -z) + -x * TR_SQRT1_2_LO : 0.0f;
    float phi2 = erfcf(z) - 1.12837917f * expf(-z * z) * dz;
    return 0.5f * x * phi2;
}
TR_HD float tr_gelu_tanh(float x, float, float) {
    float u = x * x * TR_GELU_CUBIC + 1.0f;  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    u = tanhf(u * x * TR_SQRT_2_OVER_PI) + 1.0f;
    return u * x * 0.5f;
}
TR_HD float tr_softplus(float x, float, float) {  // log1p(exp(-|x|)) + max(x, 0)
    return log1pf(expf(-fabsf(x))) + tr_max_nan(x, 0.0f);
}
TR_HD float tr_exp(float x, float, float) { return expf(x); }
TR_HD float tr_log(float x, float, float) { return logf(x); }
TR_HD float tr_sqrt(float x, float, float) { return sqrtf(x); }
TR_HD float tr_neg(float x, float, float) { return -x; }
TR_HD float tr_abs(float x, float, float) { return fabsf(x); }
TR_HD float tr_sign(float x, float, float) {  // as np.sign: +0 for +-0, NaN stays NaN
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x));
}
TR_HD float tr_clip(float x, float lo, float hi) { return tr_min_nan(tr_max_nan(x, lo), hi); }

// ---- unary backward: gx = g(x, y, gy, a, b), y the forward output (either may be unused) ---
TR_HD float tr_relu_grad(float, float y, float gy, float, float) { return y > 0.0f ? gy : 0.0f; }
TR_HD float tr_leaky_relu_grad(float x, float, float gy, float alpha, float) {
    return x > 0.0f ? gy : gy * alpha;
}
TR_HD float tr_elu_grad(float x, float y, float gy, float alpha, float) {  // alpha e^x = y + alpha
    return x > 0.0f ? gy : gy * (y + alpha);
}
TR_HD float tr_sigmoid_grad(float, float y, float gy, float, float) { return gy * (y * (1.0f - y)); }
TR_HD float tr_hardsigmoid_grad(float, float y, float gy, float alpha, float) {
    return (y > 0.0f && y < 1.0f) ? gy * alpha : 0.0f;
}
TR_HD float tr_hardswish_grad(float x, float, float gy, float, float) {
    if (x < -3.0f) return 0.0f;
    return x > 3.0f ? gy : gy * (x * TR_ONE_THIRD + 0.5f);
}
TR_HD float tr_tanh_grad(float, float y, float gy, float, float) { return gy * (1.0f - y * y); }
TR_HD float tr_gelu_grad(float x, float, float gy, float, float) {  // Phi(x) + x phi(x)
    float cdf = erff(x * TR_SQRT1_2) + 1.0f;
    float pdf = expf(x * x * -0.5f) * TR_INV_SQRT_2PI;
    return gy * (cdf * 0.5f + x * pdf);
}
TR_HD float tr_gelu_tanh_grad(float x, float, float gy, float, float) {
    // y = x/2 (1 + t), t = tanh(c (x + k x^3)): y' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3k x^2)
    float x2 = x * x;
    float t = tanhf(x * (x2 * TR_GELU_CUBIC + 1.0f) * TR_SQRT_2_OVER_PI);
    float slope = (1.0f - t * t) * (x2 * TR_GELU_3KC + TR_SQRT_2_OVER_PI);
    float d = (t + 1.0f) + x * slope;
    return gy * (d * 0.5f);
}
TR_HD float tr_softplus_grad(float x, float, float gy, float, float) {
    return gy * tr_sigmoid(x, 0.0f, 0.0f);
}
TR_HD float tr_sqrt_grad(float, float y, float gy, float, float) { return gy * 0.5f / y; }
TR_HD float tr_abs_grad(float x, float, float gy, float, float) {  // gy * sign(x)
    return gy * (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x));  // sign(+-0) = +-0, sign(NaN) = NaN
}
TR_HD float tr_clip_grad(float x, float y, float gy, float, float) { return x == y ? gy : 0.0f; }

// ---- binary (broadcasting is the caller's: it picks the operands' indices) ----------------
TR_HD float tr_add(float a, float b) { return a + b; }
TR_HD float tr_sub(float a, float b) { return a - b; }
TR_HD float tr_mul(float a, float b) { return a * b; }
TR_HD float tr_div(float a, float b) { return a / b; }

// ---- losses -------------------------------------------------------------------------------
// Softmax cross-entropy over one row of c classes (stride 1): max m and log(sum exp(x - m)).
template <class T> TR_HD void tr_row_log_softmax_stats(const T* x, long long c, long long cs,
                                                        float* m, float* log_s) {
    float mx = tr_get(x, 0);
    for (long long j = 1; j < c; ++j) mx = tr_max_nan(tr_get(x, j * cs), mx);
    float s = 0.0f;
    for (long long j = 0; j < c; ++j) s += expf(tr_get(x, j * cs) - mx);
    *m = mx;
    *log_s = logf(s);
}
TR_HD float tr_log_softmax(float x, float m, float log_s) { return (x - m) - log_s; }
// d loss / d x_j for a row whose loss is -w log_softmax(x)[label], scaled: coef = w * scale.
// As NumPy: G = -coef at the label, 0 elsewhere; gx = G - softmax * sum(G), sum(G) = -coef.
TR_HD float tr_sce_grad(float x, float m, float log_s, bool is_label, float coef) {
    float g = is_label ? -coef : 0.0f;
    return g - expf(tr_log_softmax(x, m, log_s)) * -coef;
}

// ---- optimizers: torch.optim arithmetic in torch's order (as ops/optimizers.py) ------------
// The step's scalars are computed once, in double as Python does, then rounded to float32
// as NumPy rounds them (t(...) in optimizers.py). lr is the float32 arena value.
struct TrSgd {
    float wd, momentum, one_minus_dampening, neg_lr;
    bool use_wd, use_momentum, use_dampening, nesterov, first;
};
TR_HD TrSgd tr_sgd_scalars(float lr, long long step, double momentum, double dampening,
                           int nesterov, double wd) {
    TrSgd s;
    s.wd = (float)wd;
    s.momentum = (float)momentum;
    s.one_minus_dampening = (float)(1.0 - dampening);
    s.neg_lr = (float)(-(double)lr);
    s.use_wd = wd != 0.0;
    s.use_momentum = momentum != 0.0;
    s.use_dampening = dampening != 0.0;
    s.nesterov = nesterov != 0;
    s.first = step == 1;
    return s;
}
TR_HD void tr_sgd_update(const TrSgd& s, float& p, float g, float& buf) {
    float d = s.use_wd ? g + p * s.wd : g;
    if (s.use_momentum) {
        if (s.first) {
            buf = d;
        } else {
            buf = buf * s.momentum;
            buf = buf + (s.use_dampening ? s.one_minus_dampening * d : d);
        }
        d = s.nesterov ? d + s.momentum * buf : buf;
    }
    p = p + d * s.neg_lr;
}

struct TrAdam {
    float decay, wd, one_minus_beta1, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
    bool decoupled_decay, l2;
};
TR_HD TrAdam tr_adam_scalars(float lr, long long step, double beta1, double beta2, double eps,
                             double wd, int decoupled) {
    TrAdam s;
    double lr_d = lr, step_d = (double)step;
    s.decay = (float)(1.0 - lr_d * wd);
    s.wd = (float)wd;
    s.one_minus_beta1 = (float)(1.0 - beta1);
    s.beta2 = (float)beta2;
    s.one_minus_beta2 = (float)(1.0 - beta2);
    s.bias2_sqrt = (float)sqrt(1.0 - pow(beta2, step_d));
    s.eps = (float)eps;
    s.neg_step_size = (float)(-(lr_d / (1.0 - pow(beta1, step_d))));
    s.decoupled_decay = wd != 0.0 && decoupled;
    s.l2 = wd != 0.0 && !decoupled;
    return s;
}
TR_HD void tr_adam_update(const TrAdam& s, float& p, float grad, float& m, float& v) {
    if (s.decoupled_decay) p = p * s.decay;
    float g = s.l2 ? grad + p * s.wd : grad;
    m = m + (g - m) * s.one_minus_beta1;        // m.lerp_(g, 1 - beta1)
    v = v * s.beta2 + g * g * s.one_minus_beta2;  // v.mul_(beta2).addcmul_(g, g, 1 - beta2)
    float denom = sqrtf(v) / s.bias2_sqrt + s.eps;
    p = p + m / denom * s.neg_step_size;          // p.addcdiv_(m, denom, -lr / bias1)
}

struct TrAdagrad {
    float wd, eps, neg_clr;
    bool use_wd;
};
TR_HD TrAdagrad tr_adagrad_scalars(float lr, long long step, double lr_decay, double wd,
                                   double eps) {
    TrAdagrad s;
    s.wd = (float)wd;
    s.eps = (float)eps;
    s.neg_clr = (float)(-((double)lr / (1.0 + (double)(step - 1) * lr_decay)));
    s.use_wd = wd != 0.0;
    return s;
}
TR_HD void tr_adagrad_update(const TrAdagrad& s, float& p, float grad, float& sum) {
    float g = s.use_wd ? grad + p * s.wd : grad;
    sum = sum + g * g;
    p = p + g / (sqrtf(sum) + s.eps) * s.neg_clr;
}

// ---- NumPy's Philox stream (elementwise.cu's Dropout, random.cu) ----------------------------
// NumPy's Philox4x64-10 (Random123's constants), so the device draws the numpy kernels' numbers
// bit for bit (Dropout's masks, ops/random.py's uniforms): Philox(key=seed).jumped(step) is the
// counter {0, 0, step, 0} (step << 128) and key {seed, 0}; each draw first steps the counter,
// so 64-bit value j of the stream is word j % 4 of the block at counter {j / 4 + 1, 0, step,
// 0}, and NumPy's uniform of it is (bits >> 11) * 2^-53.
TR_HD unsigned long long tr_mulhi64(unsigned long long a, unsigned long long b) {
#if defined(__CUDACC__)
    return __umul64hi(a, b);
#else
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
#endif
}

TR_HD void tr_philox4x64(unsigned long long block, unsigned long long step,
                         unsigned long long seed, unsigned long long out[4]) {
    unsigned long long c0 = block + 1, c1 = 0, c2 = step, c3 = 0, k0 = seed, k1 = 0;
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B97F4A7C15ull;
            k1 += 0xBB67AE8584CAA73Bull;
        }
        unsigned long long lo0 = 0xD2E7470EE14C6C93ull * c0, lo1 = 0xCA5A826395121157ull * c2;
        unsigned long long hi0 = tr_mulhi64(0xD2E7470EE14C6C93ull, c0);
        unsigned long long hi1 = tr_mulhi64(0xCA5A826395121157ull, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// NumPy's uniform double of a 64-bit draw (Generator.random: the top 53 bits times 2^-53).
TR_HD double tr_philox_uniform(unsigned long long bits) {
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}
