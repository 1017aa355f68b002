// Transformer ops (tr_onnx/ops/attention.py): RMSNormalization and its backward, Swish,
// RotaryEmbedding (and its inverse, RotaryEmbeddingGrad), Attention and AttentionGrad.
// fp32/fp16/bf16 storage, fp32 compute in the NumPy kernels' order of operations, fp64 sums
// (rows, dot products), so results differ from NumPy's float32 sums by their summation order.
//
// RMSNormalization over rows of m elements (the normalised axes flattened, compact); the scale
// repeats with period sp inside a row (its shape a suffix of the normalised axes):
// tr_rms_norm_fwd_<dt>(x, scale, y, rows, m, sp, eps)
//     y = round(x r) scale, r = 1 / sqrt(mean(x^2) + eps) (round: to the storage type, as
//     NumPy casts the normalised x to y's dtype before the scale)
// tr_rms_norm_bwd_dx_<dt>(gy, x, scale, gx, inv_out, rows, m, sp, eps)
//     g = gy scale, xh = x r: gx = (g - xh mean(g xh)) r (gx may be null); r into inv_out
// tr_rms_norm_bwd_scale_<dt>(gy, x, inv, gscale, rows, m, sp)
//     gscale[k] = sum over rows and the row's lanes j = k (mod sp) of gy (x r)
// tr_swish_<dt>(x, y, n, alpha)              y = x sigmoid(alpha x), one thread per element
// RotaryEmbedding over [batch, seq, heads, d] addressed by element strides (sb, ss, sh; the
// lanes contiguous): 3-D [b, s, heads * d] or 4-D [b, heads, s, d] input, y laid out alike:
// tr_rotary_<dt>(x, cos, sin, pos, y, batch, seq, heads, d, rot, sb, ss, sh, rb, rs,
//                interleaved, inverse)
//     pairs (x1, x2) of the first rot lanes (halves, or even/odd lanes when interleaved):
//     y1 = cos x1 - sin x2, y2 = cos x2 + sin x1 at the cache row of the token's position
//     (pos[b, s] when pos is not null, else the caches are [b, s, rot / 2]; rb, rs: the
//     row strides of that [b, s] index, 0 on an axis of length 1 that broadcasts, as
//     exporters give [1, s, rot / 2] caches); inverse: the sine's sign flipped. Lanes past
//     rot are copied.
// Attention: one thread per query row (b, head, i), recomputing the row's scores in each of
// its passes (max, sum of exponentials, output) rather than keeping them: no scratch.
// q, k, v, y, gq, gk, gv are [b, heads, seq, size] addressed by (batch, head, seq) strides (a
// 3-D [b, seq, heads * size] tensor is such a view); past_k / past_v and present_k /
// present_v compact [b, kv_heads, past or total, size]. Q heads h use kv head h / (hq / hkv).
// The score of key j: s = q.k * scale; qk_matmul_output mode 0 taps it; softcap c > 0:
// c tanh(s / c) (mode 1); plus the bias (mode 2): the float mask (fmask) or -inf where the
// boolean mask (bmask) is false, -inf past the mask's last axis (mn keys), where the causal
// or window frontiers hide the key (key - query > offset; < offset - left; > offset + right,
// offset = past, or nonpad[b] - sq per batch), and past nonpad[b]. Softmax in fp32 (mode 3);
// a row whose bias is -inf everywhere gives zeros. Mask strides (mb, mh, mi) are 0 on its
// broadcast axes; its last axis is contiguous.
// tr_attention_fwd_<dt>(q, k, v, past_k, past_v, fmask, bmask, nonpad, y, qk, <shape>)
//     y = P V and the qk_matmul_output (qk: [b, hq, sq, t], null when not asked for)
// tr_attention_present_<dt>(past, x, present, batch, heads, past_len, t, d, xb, xh, xs)
//     present = past keys (values) then the new ones, [b, heads, t, d]
// tr_attention_bwd_rows_<dt>(gy, q, k, v, past_k, past_v, fmask, bmask, nonpad, gqk, gq,
//                            p_out, gs_out, gz_out, <shape>)
//     per query row: P, gP = gY V^T (+ gqk, mode 3), gZ = P (gP - rowsum(gP P)) (+ gqk, mode
//     2; into gz_out when not null, for the mask's gradient), the softcap's (1 - tanh^2)
//     (+ gqk before it, mode 1, after it, mode 0), gS = scale gZ' into gs_out, P into p_out
//     ([b, hq, sq, t] fp32 scratch), and gQ = gS K
// tr_attention_bwd_kv_<dt>(q, gy, p, gs, g_present_k, g_present_v, gk, gv, g_past_k,
//                          g_past_v, <kv shape>)
//     one thread per key element: gK = sum over the kv head's query group and rows of gS Q,
//     gV of P gY (+ the present key / value gradients); keys before past into g_past_k / v
// tr_attention_bwd_mask_<dt>(gz, gmask, m0, m1, m2, m3, sb, sh, sq, n, t)
//     the mask's gradient: gZ[..., :n] summed over the axes the mask [m0, m1, m2, m3]
//     broadcasts along, against [sb, sh, sq, n]
// The instantiations (TR_RMS_NORM, TR_ROTARY, TR_ATTENTION(T, dt) lines) are appended from the
// family's table (KERNELS in tr_onnx/backends/cuda/ops/attention.py).
#include "elementwise.cuh"

#define TR_ATTENTION_MAX_HEAD 256  // head sizes a query row's fp64 accumulators hold

// v rounded to storage type T (NumPy's cast of an intermediate to the output's dtype)
template <class T> TR_HD float tr_round_to(float v) {
    T s;
    tr_from_float(v, &s);
    return tr_to_float(s);
}

// 1 / sqrt(mean(x^2) + eps) of one row of m, in ops/attention.py's _inv_rms order
template <class T> TR_HD float tr_inv_rms(const T* x, long long m, float eps) {
    double acc = 0.0;
    for (long long k = 0; k < m; ++k) {
        float v = tr_get(x, k);
        acc += (double)(v * v);
    }
    float r = (float)acc / (float)m + eps;
    return 1.0f / sqrtf(r);
}

#define TR_RMS_NORM(T, dt)                                                                     \
    TR_KERNEL void tr_rms_norm_fwd_##dt(const T* x, const T* scale, T* y, long long rows,     \
                                        long long m, long long sp, float eps) {               \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            float inv = tr_inv_rms(xr, m, eps);                                                \
            for (long long k = 0; k < m; ++k)                                                  \
                tr_put(y, r * m + k, tr_round_to<T>(tr_get(xr, k) * inv) * tr_get(scale, k % sp)); \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_rms_norm_bwd_dx_##dt(const T* gy, const T* x, const T* scale, T* gx,    \
                                           float* inv_out, long long rows, long long m,        \
                                           long long sp, float eps) {                          \
        TR_GRID_STRIDE(r, rows) {                                                              \
            const T* xr = x + r * m;                                                           \
            const T* gr = gy + r * m;                                                          \
            float inv = tr_inv_rms(xr, m, eps);                                                \
            inv_out[r] = inv;                                                                  \
            if (!gx) continue;                                                                 \
            double acc = 0.0;                                                                  \
            for (long long k = 0; k < m; ++k)                                                  \
                acc += (double)((tr_get(gr, k) * tr_get(scale, k % sp)) * (tr_get(xr, k) * inv)); \
            float mg = (float)acc / (float)m;                                                  \
            for (long long k = 0; k < m; ++k) {                                                \
                float g = tr_get(gr, k) * tr_get(scale, k % sp);                               \
                tr_put(gx, r * m + k, (g - (tr_get(xr, k) * inv) * mg) * inv);                 \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_rms_norm_bwd_scale_##dt(const T* gy, const T* x, const float* inv,      \
                                              T* gscale, long long rows, long long m,          \
                                              long long sp) {                                  \
        TR_GRID_STRIDE(k, sp) {                                                                \
            double acc = 0.0;                                                                  \
            for (long long r = 0; r < rows; ++r)                                               \
                for (long long j = k; j < m; j += sp)                                          \
                    acc += (double)(tr_get(gy, r * m + j) * (tr_get(x, r * m + j) * inv[r]));  \
            tr_put(gscale, k, (float)acc);                                                     \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_swish_##dt(const T* x, T* y, long long n, float alpha) {                \
        TR_GRID_STRIDE(j, n) {                                                                 \
            float v = tr_get(x, j);                                                            \
            float s = tr_round_to<T>(tr_sigmoid(tr_round_to<T>(v * alpha), 0.0f, 0.0f));       \
            tr_put(y, j, s * v);                                                               \
        }                                                                                      \
    }

#define TR_ROTARY(T, dt)                                                                       \
    TR_KERNEL void tr_rotary_##dt(const T* x, const T* cos_c, const T* sin_c,                 \
                                  const long long* pos, T* y, long long batch, long long seq,  \
                                  long long heads, long long d, long long rot, long long sb,   \
                                  long long ss, long long sh, long long rb, long long rs,      \
                                  int interleaved, int inverse) {                              \
        long long half = rot / 2;                                                              \
        TR_GRID_STRIDE(u, batch * seq * heads * d) {                                           \
            long long e = u % d, h = (u / d) % heads, s = (u / (d * heads)) % seq;             \
            long long b = u / (d * heads * seq);                                               \
            long long at = b * sb + s * ss + h * sh;                                           \
            if (e >= rot) {                                                                    \
                y[at + e] = x[at + e];                                                         \
                continue;                                                                      \
            }                                                                                  \
            bool first = interleaved ? e % 2 == 0 : e < half;                                  \
            long long i = interleaved ? e / 2 : (first ? e : e - half);                        \
            long long other = interleaved ? (first ? e + 1 : e - 1)                            \
                                          : (first ? e + half : e - half);                     \
            long long row = pos ? pos[b * rb + s * rs] : b * rb + s * rs;                      \
            float c = tr_get(cos_c, row * half + i), sn = tr_get(sin_c, row * half + i);       \
            float x1 = tr_get(x, at + (first ? e : other));                                    \
            float x2 = tr_get(x, at + (first ? other : e));                                    \
            float v;                                                                           \
            if (first) {                                                                       \
                float a = tr_round_to<T>(c * x1), t = tr_round_to<T>(sn * x2);                 \
                v = inverse ? a + t : a - t;                                                   \
            } else {                                                                           \
                float a = tr_round_to<T>(c * x2), t = tr_round_to<T>(sn * x1);                 \
                v = inverse ? a - t : a + t;                                                   \
            }                                                                                  \
            tr_put(y, at + e, v);                                                              \
        }                                                                                      \
    }

// One Attention node's geometry and inputs: the scores of a query row, key by key.
template <class T> struct tr_attention {
    const T *q, *k, *v, *past_k, *past_v, *fmask;
    const unsigned char* bmask;
    const long long* nonpad;
    long long b, hq, hkv, sq, past, t, d, dv;
    long long qb, qh, qs, kb, kh, ks, vb, vh, vs;
    long long mn, mb, mh, mi;
    float scale, softcap;
    int causal;
    long long left, right;

    TR_HD long long kv_head(long long h) const { return h / (hq / hkv); }
    // key (value) j of batch n, kv head g: from the past cache or the new keys
    TR_HD const T* key(long long n, long long g, long long j) const {
        return j < past ? past_k + ((n * hkv + g) * past + j) * d
                        : k + n * kb + g * kh + (j - past) * ks;
    }
    TR_HD const T* value(long long n, long long g, long long j) const {
        return j < past ? past_v + ((n * hkv + g) * past + j) * dv
                        : v + n * vb + g * vh + (j - past) * vs;
    }
    // q.k * scale (dot product in fp64, rounded once, as NumPy's float32 matmul then *= scale)
    TR_HD float raw(const T* qi, long long n, long long h, long long j) const {
        const T* kj = key(n, kv_head(h), j);
        double acc = 0.0;
        for (long long e = 0; e < d; ++e) acc += (double)tr_get(qi, e) * (double)tr_get(kj, e);
        return (float)acc * scale;
    }
    TR_HD float capped(float s) const {
        return softcap > 0.0f ? tanhf(s / softcap) * softcap : s;
    }
    // the additive bias of (n, h, i, j): the mask, -inf where a frontier or the padding hides
    TR_HD float bias(long long n, long long h, long long i, long long j) const {
        float z = 0.0f;
        if (fmask || bmask) {
            if (j >= mn) return tr_neg_inf();
            long long at = n * mb + h * mh + i * mi + j;
            if (fmask) z = 0.0f + tr_get(fmask, at);
            else if (!bmask[at]) return tr_neg_inf();
        }
        long long offset = nonpad ? nonpad[n] - sq : past;
        long long dj = j - i;
        if ((causal && dj > offset) || (left >= 0 && dj < offset - left) ||
            (right >= 0 && dj > offset + right) || (nonpad && j >= nonpad[n]))
            return tr_neg_inf();
        return z;
    }
    // the row's softmax statistics: max of the biased scores (0 for -inf), sum of exp, dead
    TR_HD void stats(const T* qi, long long n, long long h, long long i, float* mx,
                     float* sum, bool* dead) const {
        float m = tr_neg_inf(), mb_ = tr_neg_inf();
        for (long long j = 0; j < t; ++j) {
            float bj = bias(n, h, i, j);
            float s = capped(raw(qi, n, h, j)) + bj;
            m = s > m ? s : m;
            mb_ = bj > mb_ ? bj : mb_;
        }
        if (m == tr_neg_inf()) m = 0.0f;
        double acc = 0.0;
        for (long long j = 0; j < t; ++j)
            acc += (double)expf(capped(raw(qi, n, h, j)) + bias(n, h, i, j) - m);
        float s = (float)acc;
        *mx = m;
        *sum = s == 0.0f ? 1.0f : s;
        *dead = mb_ == tr_neg_inf();
    }
};

#define TR_ATTENTION_ARGS(T)                                                                   \
    long long b, long long hq, long long hkv, long long sq, long long past, long long t,       \
        long long d, long long dv, long long qb, long long qh, long long qs, long long kb,     \
        long long kh, long long ks, long long vb, long long vh, long long vs, long long yb,    \
        long long yh, long long ys, long long mn, long long mb, long long mh, long long mi,   \
        float scale, float softcap, int causal, long long left, long long right, int mode
#define TR_ATTENTION_INIT(T)                                                                   \
    tr_attention<T> at = {q,  k,  v,  past_k, past_v, fmask, bmask, nonpad, b,  hq, hkv,      \
                          sq, past, t, d, dv, qb, qh, qs, kb, kh, ks, vb, vh, vs, mn, mb,     \
                          mh, mi, scale, softcap, causal, left, right}

#define TR_ATTENTION(T, dt)                                                                    \
    TR_KERNEL void tr_attention_fwd_##dt(const T* q, const T* k, const T* v, const T* past_k, \
                                         const T* past_v, const T* fmask,                      \
                                         const unsigned char* bmask, const long long* nonpad,  \
                                         T* y, T* qk, TR_ATTENTION_ARGS(T)) {                  \
        TR_ATTENTION_INIT(T);                                                                  \
        TR_GRID_STRIDE(row, b * hq * sq) {                                                     \
            long long i = row % sq, h = (row / sq) % hq, n = row / (sq * hq);                  \
            const T* qi = q + n * qb + h * qh + i * qs;                                        \
            float mx, sum;                                                                     \
            bool dead;                                                                         \
            at.stats(qi, n, h, i, &mx, &sum, &dead);                                           \
            double acc[TR_ATTENTION_MAX_HEAD];                                                 \
            for (long long e = 0; e < dv; ++e) acc[e] = 0.0;                                   \
            for (long long j = 0; j < t; ++j) {                                                \
                float s0 = at.raw(qi, n, h, j), s1 = at.capped(s0), s2 = s1 + at.bias(n, h, i, j); \
                float p = dead ? 0.0f : expf(s2 - mx) / sum;                                   \
                if (qk)                                                                        \
                    tr_put(qk, row * t + j, mode == 0 ? s0 : mode == 1 ? s1 : mode == 2 ? s2 : p); \
                const T* vj = at.value(n, at.kv_head(h), j);                                   \
                for (long long e = 0; e < dv; ++e) acc[e] += (double)p * (double)tr_get(vj, e); \
            }                                                                                  \
            for (long long e = 0; e < dv; ++e)                                                 \
                tr_put(y, n * yb + h * yh + i * ys + e, (float)acc[e]);                        \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_attention_present_##dt(const T* pst, const T* x, T* present,             \
                                             long long batch, long long heads, long long plen, \
                                             long long t, long long d, long long xb,           \
                                             long long xh, long long xs) {                     \
        TR_GRID_STRIDE(u, batch * heads * t * d) {                                             \
            long long e = u % d, j = (u / d) % t, h = (u / (d * t)) % heads;                   \
            long long n = u / (d * t * heads);                                                 \
            present[u] = j < plen ? pst[((n * heads + h) * plen + j) * d + e]                  \
                                  : x[n * xb + h * xh + (j - plen) * xs + e];                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_attention_bwd_rows_##dt(                                                 \
        const T* gy, const T* q, const T* k, const T* v, const T* past_k, const T* past_v,    \
        const T* fmask, const unsigned char* bmask, const long long* nonpad, const T* gqk,    \
        T* gq, float* p_out, float* gs_out, float* gz_out, TR_ATTENTION_ARGS(T)) {             \
        TR_ATTENTION_INIT(T);                                                                  \
        TR_GRID_STRIDE(row, b * hq * sq) {                                                     \
            long long i = row % sq, h = (row / sq) % hq, n = row / (sq * hq);                  \
            long long g = at.kv_head(h);                                                       \
            const T* qi = q + n * qb + h * qh + i * qs;                                        \
            const T* gyi = gy + n * yb + h * yh + i * ys;                                      \
            float mx, sum;                                                                     \
            bool dead;                                                                         \
            at.stats(qi, n, h, i, &mx, &sum, &dead);                                           \
            double dot = 0.0;                                                                  \
            for (long long j = 0; j < t; ++j) {                                                \
                float s = at.capped(at.raw(qi, n, h, j)) + at.bias(n, h, i, j);               \
                float p = dead ? 0.0f : expf(s - mx) / sum;                                    \
                p_out[row * t + j] = p;                                                        \
                const T* vj = at.value(n, g, j);                                               \
                double gp = 0.0;                                                               \
                for (long long e = 0; e < dv; ++e)                                             \
                    gp += (double)tr_get(gyi, e) * (double)tr_get(vj, e);                      \
                float gpf = (float)gp;                                                         \
                if (gqk && mode == 3) gpf += tr_get(gqk, row * t + j);                         \
                gs_out[row * t + j] = gpf; /* gP until the second pass */                      \
                dot += (double)(gpf * p);                                                      \
            }                                                                                  \
            float dotf = (float)dot;                                                           \
            double acc[TR_ATTENTION_MAX_HEAD];                                                 \
            for (long long e = 0; e < d; ++e) acc[e] = 0.0;                                    \
            for (long long j = 0; j < t; ++j) {                                                \
                float p = p_out[row * t + j];                                                  \
                float gz = (gs_out[row * t + j] - dotf) * p;                                   \
                if (gqk && mode == 2) gz += tr_get(gqk, row * t + j);                          \
                if (gz_out) gz_out[row * t + j] = gz;                                          \
                if (gqk && mode == 1) gz += tr_get(gqk, row * t + j);                          \
                if (softcap > 0.0f) {                                                          \
                    float th = tanhf(at.raw(qi, n, h, j) / softcap);                           \
                    gz *= 1.0f - th * th;                                                      \
                }                                                                              \
                if (gqk && mode == 0) gz += tr_get(gqk, row * t + j);                          \
                float gs = gz * scale;                                                         \
                gs_out[row * t + j] = gs;                                                      \
                const T* kj = at.key(n, g, j);                                                 \
                for (long long e = 0; e < d; ++e) acc[e] += (double)gs * (double)tr_get(kj, e); \
            }                                                                                  \
            for (long long e = 0; e < d; ++e)                                                  \
                tr_put(gq, n * qb + h * qh + i * qs + e, (float)acc[e]);                       \
        }                                                                                      \
    }                                                                                          \
    /* gk, gv: the new keys' gradients in K's / V's layout (kb.. / vb.. strides); g_past_k /  \
       g_past_v compact (null without a past); g_present_k / g_present_v compact or null */  \
    TR_KERNEL void tr_attention_bwd_kv_##dt(                                                   \
        const T* q, const T* gy, const float* p, const float* gs, const T* g_present_k,        \
        const T* g_present_v, T* gk, T* gv, T* g_past_k, T* g_past_v, long long b,             \
        long long hq, long long hkv, long long sq, long long past, long long t, long long d,   \
        long long dv, long long qb, long long qh, long long qs, long long kb, long long kh,   \
        long long ks, long long vb, long long vh, long long vs, long long yb, long long yh,   \
        long long ys) {                                                                        \
        long long w = d + dv, group = hq / hkv;                                                \
        TR_GRID_STRIDE(u, b * hkv * t * w) {                                                   \
            long long e = u % w, j = (u / w) % t, g = (u / (w * t)) % hkv;                     \
            long long n = u / (w * t * hkv);                                                   \
            bool is_k = e < d;                                                                 \
            long long f = is_k ? e : e - d;                                                    \
            const float* src = is_k ? gs : p;                                                  \
            double acc = 0.0;                                                                  \
            for (long long h = g * group; h < (g + 1) * group; ++h)                            \
                for (long long i = 0; i < sq; ++i) {                                           \
                    long long row = (n * hq + h) * sq + i;                                     \
                    float o = is_k ? tr_get(q, n * qb + h * qh + i * qs + f)                   \
                                   : tr_get(gy, n * yb + h * yh + i * ys + f);                 \
                    acc += (double)src[row * t + j] * (double)o;                               \
                }                                                                              \
            float total = (float)acc;                                                          \
            long long size = is_k ? d : dv;                                                    \
            const T* g_present = is_k ? g_present_k : g_present_v;                             \
            if (g_present) total += tr_get(g_present, ((n * hkv + g) * t + j) * size + f);     \
            if (j < past) {                                                                    \
                T* out = is_k ? g_past_k : g_past_v;                                           \
                tr_put(out, ((n * hkv + g) * past + j) * size + f, total);                     \
            } else if (is_k) {                                                                 \
                tr_put(gk, n * kb + g * kh + (j - past) * ks + f, total);                      \
            } else {                                                                           \
                tr_put(gv, n * vb + g * vh + (j - past) * vs + f, total);                      \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_attention_bwd_mask_##dt(const float* gz, T* gmask, long long m0,        \
                                              long long m1, long long m2, long long m3,        \
                                              long long sb, long long sh, long long sq,        \
                                              long long n, long long t) {                      \
        TR_GRID_STRIDE(u, m0 * m1 * m2 * m3) {                                                 \
            long long c3 = u % m3, c2 = (u / m3) % m2, c1 = (u / (m3 * m2)) % m1;              \
            long long c0 = u / (m3 * m2 * m1);                                                 \
            long long e0 = m0 == 1 ? sb : 1, e1 = m1 == 1 ? sh : 1, e2 = m2 == 1 ? sq : 1;     \
            long long e3 = m3 == 1 ? n : 1;                                                    \
            double acc = 0.0;                                                                  \
            for (long long a0 = 0; a0 < e0; ++a0)                                              \
                for (long long a1 = 0; a1 < e1; ++a1)                                          \
                    for (long long a2 = 0; a2 < e2; ++a2)                                      \
                        for (long long a3 = 0; a3 < e3; ++a3) {                                \
                            long long i0 = m0 == 1 ? a0 : c0, i1 = m1 == 1 ? a1 : c1;          \
                            long long i2 = m2 == 1 ? a2 : c2, i3 = m3 == 1 ? a3 : c3;          \
                            acc += (double)gz[((i0 * sh + i1) * sq + i2) * t + i3];            \
                        }                                                                      \
            tr_put(gmask, u, (float)acc);                                                      \
        }                                                                                      \
    }
