// Recurrent layers (tr_onnx/ops/recurrent.py): the per-step gate kernels of LSTM, GRU and RNN,
// forwards and backwards through time, and the row moves of the time loop. The matrix products
// (X W^T over all steps, H_{t-1} R^T per step, the weight gradients over all steps) are
// tr_matmul_<dt> launches of kernels/matmul.cu; the binding (backends/cuda/ops/recurrent.py)
// sequences them. Every kernel runs one thread per (batch row n, hidden unit j) of one step (or
// per element for the moves): a thread owns every gate of its unit, so nothing is shared and
// nothing is atomic. Each formula follows the NumPy kernel's operations in its order; storage
// T, compute fp32.
//
// Saved rows (the training variants' last output, a workspace in inference): per direction and
// step s, [gates N*G*H | mid N*H | h N*H] (RNN: no mid); mid is LSTM's C_t, GRU's
// H_{t-1} Rh^T + Rbh (linear_before_reset, else 0). Gate order: LSTM i,o,f,c; GRU z,r,h.
// A row n is past its end at step s when lens and s >= lens[n]: its state carries over.
//
// Activations: act codes (ACTIVATION_CODES in the binding) with alpha, beta; TR_ACTS(k) are the
// parameters f<k>, fa<k>, fb<k> of activation k (LSTM f, g, h; GRU f, g; RNN f).
//
// tr_recurrent_gather_<dt>(time, seq, lens, steps, batch, width, seq_step, dirs, d, reverse,
//                          layout, mask)
//     seq[s * seq_step + n * width + k] = time[row(s, n) * width + k]: a [T, D, N, width]
//     (layout 0) or [N, T, D, width] (layout 1) tensor in processing order of direction d
//     (X: dirs 1; initial states: steps 1); mask: 0 for rows past their end.
// tr_recurrent_scatter_<dt>(seq, time, lens, steps, batch, width, seq_step, dirs, d, reverse,
//                           layout, mask, accumulate)
//     the inverse move (Y, Y_h, gX, the initial states' gradients); accumulate adds.
// tr_lstm_fwd_<dt>(xw, hr, bias, p, hp, cp, gates, c, h, lens, s, batch, hidden, clip,
//                  input_forget, TR_ACTS(0..2))
// tr_gru_fwd_gates_<dt>(xw, hr, bias, hp, gates, mid, q, batch, hidden, clip, lbr, TR_ACTS(0))
//     z, r; mid; q = r * H_{t-1} (without linear_before_reset: the candidate's matmul operand)
// tr_gru_fwd_state_<dt>(xw, bias, qr, hp, gates, mid, h, lens, s, batch, hidden, clip, lbr,
//                       TR_ACTS(0..1))
//     the candidate (qr = (r * H_{t-1}) Rh^T without linear_before_reset) and H_t
// tr_rnn_fwd_<dt>(xw, hr, bias, hp, gates, h, lens, s, batch, hidden, clip, TR_ACTS(0))
//     xw: step s of X W^T [N, G*H]; hr: H_{t-1} R^T [N, G*H]; bias: B[d] (W's then R's) or
//     null; p: P[d] or null; hp, cp: the previous state.
// tr_lstm_bwd_<dt>(gates, c, cp, dh, gy, dc, gx, p, lens, s, batch, hidden, clip, input_forget,
//                  TR_ACTS(0..2))
//     gx: the gates' pre-activation gradients of step s; dc in place (the previous step's).
// tr_lstm_peephole_grad_<dt>(gx, c, cp, gp, batch, hidden)
//     gp[slot * H + j] += sum over n in order of gx[n, slot, j] * (slot 1 ? C_t : C_{t-1}).
// tr_gru_bwd_gates_<dt>(gates, mid, hp, dh, gy, gx, grh, q, gr3, t1, lens, s, batch, hidden,
//                       clip, lbr, TR_ACTS(0..1))
//     gx, the candidate's recurrent-side gradient grh and its matmul operand q (for gR), gr3
//     (the recurrent side's gradients, for dH_{t-1} = gr3 R), t1 = dh * z.
// tr_gru_bwd_reset_<dt>(gates, hp, t0, gx, gr3, t1, batch, hidden, clip, TR_ACTS(0))
//     without linear_before_reset: the reset gate's gradient from t0 = grh Rh.
// tr_rnn_bwd_<dt>(gates, dh, gy, gx, lens, s, batch, hidden, clip, TR_ACTS(0))
// tr_recurrent_carry_dh_<dt>(dhr, extra, dh, lens, s, batch, hidden)
//     dh = dhr (+ extra) for rows inside their sequence at step s; the others keep dh.
// tr_recurrent_col_sum_<dt>(a, y, rows, cols, lda)
//     y[j] = sum over rows in order of a[r * lda + j] (the bias gradients).
// The instantiations are appended by tr_onnx/backends/cuda/sources.py.
#include "elementwise.cuh"

// ---- activations (codes: ACTIVATION_CODES in backends/cuda/ops/recurrent.py) ---------------
#define TR_ACTS(k) int f##k, float fa##k, float fb##k

TR_HD float tr_recurrent_sigmoid(float x) { return 1.0f / (expf(-x) + 1.0f); }

TR_HD float tr_recurrent_act(int kind, float a, float b, float x) {
    switch (kind) {
        case 0: return tr_recurrent_sigmoid(x);
        case 1: return tanhf(x);
        case 2: return tr_max_nan(x, 0.0f);
        case 3: return x * a + b;
        case 4: return x >= 0.0f ? x : x * a;
        case 5: return (x > a ? 1.0f : 0.0f) * x;
        case 6: return tanhf(x * b) * a;
        case 7: return tr_clip01(x * a + b);
        case 8: return x >= 0.0f ? x : expm1f(x) * a;
        case 9: return x / (fabsf(x) + 1.0f);
        default:  // softplus: np.logaddexp(0, x)
            return x == 0.0f ? 0.693147182f : x < 0.0f ? log1pf(expf(x)) : x + log1pf(expf(-x));
    }
}

// the derivative at x, given y = act(x)
TR_HD float tr_recurrent_act_d(int kind, float a, float b, float x, float y) {
    switch (kind) {
        case 0: return (1.0f - y) * y;
        case 1: return 1.0f - y * y;
        case 2: return x > 0.0f ? 1.0f : 0.0f;
        case 3: return a;
        case 4: return (x >= 0.0f ? 1.0f : 0.0f) * (1.0f - a) + a;
        case 5: return x > a ? 1.0f : 0.0f;
        case 6: {
            float t = tanhf(x * b);
            return (1.0f - t * t) * (a * b);
        }
        case 7: return (y > 0.0f ? 1.0f : 0.0f) * (y < 1.0f ? 1.0f : 0.0f) * a;
        case 8: return x >= 0.0f ? 1.0f : y + a;
        case 9: {
            float s = fabsf(x) + 1.0f;
            return 1.0f / (s * s);
        }
        default: return tr_recurrent_sigmoid(x);
    }
}

// clip (0: none) keeps NaN; the derivative's factor is 1 strictly inside the bounds
TR_HD float tr_recurrent_clip(float v, float clip) {
    return clip > 0.0f ? tr_min_nan(tr_max_nan(v, -clip), clip) : v;
}
TR_HD float tr_recurrent_inside(float v, float clip) {
    return clip > 0.0f && !(fabsf(v) < clip) ? 0.0f : 1.0f;
}

// act and its derivative (times the clip's) of pre-activation x
TR_HD float tr_recurrent_act_dx(int kind, float a, float b, float x, float clip, float* d) {
    float y = tr_recurrent_act(kind, a, b, x);
    *d = tr_recurrent_act_d(kind, a, b, x, y) * tr_recurrent_inside(x, clip);
    return y;
}

// ---- processing order ----------------------------------------------------------------------

TR_HD bool tr_recurrent_past(const int* lens, long long s, long long n) {
    return lens != 0 && s >= (long long)lens[n];
}

// the row of (processing step s, batch row n, direction d) in a [T, D, N, .] / [N, T, D, .]
// tensor; a length outside [0, steps] is clamped (the NumPy kernel refuses it)
TR_HD long long tr_recurrent_row(const int* lens, long long steps, long long batch, long long s,
                                 long long n, long long dirs, long long d, int reverse,
                                 int layout) {
    long long len = lens ? (long long)lens[n] : steps;
    len = len < 0 ? 0 : len > steps ? steps : len;
    long long t = (reverse && s < len) ? len - 1 - s : s;
    return layout == 0 ? (t * dirs + d) * batch + n : (n * steps + t) * dirs + d;
}

#define TR_RECURRENT_MOVES(T, dt)                                                              \
    TR_KERNEL void tr_recurrent_gather_##dt(                                                   \
        const T* time, T* seq, const int* lens, long long steps, long long batch,              \
        long long width, long long seq_step, long long dirs, long long d, int reverse,         \
        int layout, int mask) {                                                                \
        TR_GRID_STRIDE(i, steps * batch * width) {                                             \
            long long k = i % width, n = (i / width) % batch, s = i / (width * batch);         \
            long long row = tr_recurrent_row(lens, steps, batch, s, n, dirs, d, reverse,       \
                                             layout);                                          \
            long long at = s * seq_step + n * width + k;                                       \
            if (mask && tr_recurrent_past(lens, s, n))                                         \
                tr_put(seq, at, 0.0f);                                                         \
            else                                                                               \
                seq[at] = time[row * width + k];                                               \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_recurrent_scatter_##dt(                                                  \
        const T* seq, T* time, const int* lens, long long steps, long long batch,              \
        long long width, long long seq_step, long long dirs, long long d, int reverse,         \
        int layout, int mask, int accumulate) {                                                \
        TR_GRID_STRIDE(i, steps * batch * width) {                                             \
            long long k = i % width, n = (i / width) % batch, s = i / (width * batch);         \
            long long at = tr_recurrent_row(lens, steps, batch, s, n, dirs, d, reverse,        \
                                            layout) * width + k;                               \
            long long from = s * seq_step + n * width + k;                                     \
            if (mask && tr_recurrent_past(lens, s, n))                                         \
                tr_put(time, at, 0.0f);                                                        \
            else if (accumulate)                                                               \
                tr_put(time, at, tr_get(time, at) + tr_get(seq, from));                        \
            else                                                                               \
                time[at] = seq[from];                                                          \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_recurrent_carry_dh_##dt(const T* dhr, const T* extra, T* dh,             \
                                              const int* lens, long long s, long long batch,   \
                                              long long hidden) {                              \
        TR_GRID_STRIDE(i, batch * hidden) {                                                    \
            if (tr_recurrent_past(lens, s, i / hidden)) continue;                              \
            tr_put(dh, i, extra ? tr_get(dhr, i) + tr_get(extra, i) : tr_get(dhr, i));         \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_recurrent_col_sum_##dt(const T* a, T* y, long long rows, long long cols, \
                                             long long lda) {                                  \
        TR_GRID_STRIDE(j, cols) {                                                              \
            float sum = 0.0f;                                                                  \
            for (long long r = 0; r < rows; ++r) sum = sum + tr_get(a, r * lda + j);           \
            tr_put(y, j, sum);                                                                 \
        }                                                                                      \
    }

// x W^T of gate k at (n, j) with the biases NumPy folds into it (W's, then R's unless
// rb = 0: GRU's candidate under linear_before_reset)
template <class T>
TR_HD float tr_recurrent_xp(const T* xw, const T* bias, long long n, long long k, long long j,
                            long long hidden, long long gh, int rb) {
    float x = tr_get(xw, n * gh + k * hidden + j);
    if (bias) {
        x = x + tr_get(bias, k * hidden + j);
        if (rb) x = x + tr_get(bias, gh + k * hidden + j);
    }
    return x;
}

// ---- LSTM ----------------------------------------------------------------------------------

template <class T>
TR_HD void tr_lstm_fwd(const T* xw, const T* hr, const T* bias, const T* p, const T* hp,
                       const T* cp, T* gates, T* c, T* h, const int* lens, long long s,
                       long long n, long long j, long long hidden, float clip, int input_forget,
                       TR_ACTS(0), TR_ACTS(1), TR_ACTS(2)) {
    const long long H = hidden, G = 4 * H, at = n * H + j;
    float pre[4];
    for (int k = 0; k < 4; ++k)
        pre[k] = tr_get(hr, n * G + k * H + j) + tr_recurrent_xp(xw, bias, n, k, j, H, G, 1);
    float cpv = tr_get(cp, at);
    if (p) {
        pre[0] = pre[0] + cpv * tr_get(p, j);
        pre[2] = pre[2] + cpv * tr_get(p, 2 * H + j);
    }
    pre[0] = tr_recurrent_clip(pre[0], clip);
    pre[2] = tr_recurrent_clip(pre[2], clip);
    pre[3] = tr_recurrent_clip(pre[3], clip);
    float ai = tr_recurrent_act(f0, fa0, fb0, pre[0]);
    float ac = tr_recurrent_act(f1, fa1, fb1, pre[3]);
    float af = input_forget ? 1.0f - ai : tr_recurrent_act(f0, fa0, fb0, pre[2]);
    float cv = af * cpv;
    cv = cv + ai * ac;
    if (p) pre[1] = pre[1] + cv * tr_get(p, H + j);
    pre[1] = tr_recurrent_clip(pre[1], clip);
    float hv = tr_recurrent_act(f0, fa0, fb0, pre[1]) * tr_recurrent_act(f2, fa2, fb2, cv);
    for (int k = 0; k < 4; ++k) tr_put(gates, n * G + k * H + j, pre[k]);
    if (tr_recurrent_past(lens, s, n)) {  // the state carries over, bit for bit
        c[at] = cp[at];
        h[at] = hp[at];
    } else {
        tr_put(c, at, cv);
        tr_put(h, at, hv);
    }
}

template <class T>
TR_HD void tr_lstm_bwd(const T* gates, const T* c, const T* cp, const T* dh, const T* gy, T* dc,
                       T* gx, const T* p, const int* lens, long long s, long long n, long long j,
                       long long hidden, float clip, int input_forget, TR_ACTS(0), TR_ACTS(1),
                       TR_ACTS(2)) {
    const long long H = hidden, G = 4 * H, at = n * H + j;
    const bool past = tr_recurrent_past(lens, s, n);
    // rows past their end: no gradient reaches this step's gates (dh, dc pass to the one before)
    float dhv = past ? 0.0f : gy ? tr_get(dh, at) + tr_get(gy, at) : tr_get(dh, at);
    float dcv = past ? 0.0f : tr_get(dc, at);
    float gi = tr_get(gates, n * G + j), go = tr_get(gates, n * G + H + j);
    float gf = tr_get(gates, n * G + 2 * H + j), gc = tr_get(gates, n * G + 3 * H + j);
    float di, dout, df = 0.0f, dg;
    float ai = tr_recurrent_act_dx(f0, fa0, fb0, gi, clip, &di);
    float ao = tr_recurrent_act_dx(f0, fa0, fb0, go, clip, &dout);
    float ac = tr_recurrent_act_dx(f1, fa1, fb1, gc, clip, &dg);
    float af = input_forget ? 1.0f - ai : tr_recurrent_act_dx(f0, fa0, fb0, gf, clip, &df);
    float cv = tr_get(c, at), cpv = tr_get(cp, at);
    float hc = tr_recurrent_act(f2, fa2, fb2, cv);
    float dhc = tr_recurrent_act_d(f2, fa2, fb2, cv, hc);
    float dao = dhv * hc;
    dao = dao * dout;
    float dct = dhv * ao;
    dct = dct * dhc;
    dct = dcv + dct;
    if (p) dct = dct + dao * tr_get(p, H + j);
    float dai = dct * ac;
    float dac = dct * ai;
    dac = dac * dg;
    float daf;
    if (input_forget) {  // f = 1 - i: the forget path's gradient reaches i, negated
        dai = dai - dct * cpv;
        daf = 0.0f;
    } else {
        daf = dct * cpv;
        daf = daf * df;
    }
    dai = dai * di;
    float dcn = dct * af;
    if (p) {
        dcn = dcn + dai * tr_get(p, j);
        dcn = dcn + daf * tr_get(p, 2 * H + j);
    }
    tr_put(gx, n * G + j, dai);
    tr_put(gx, n * G + H + j, dao);
    tr_put(gx, n * G + 2 * H + j, daf);
    tr_put(gx, n * G + 3 * H + j, dac);
    if (!past) tr_put(dc, at, dcn);
}

#define TR_LSTM(T, dt)                                                                         \
    TR_KERNEL void tr_lstm_fwd_##dt(const T* xw, const T* hr, const T* bias, const T* p,       \
                                    const T* hp, const T* cp, T* gates, T* c, T* h,            \
                                    const int* lens, long long s, long long batch,             \
                                    long long hidden, float clip, int input_forget,            \
                                    TR_ACTS(0), TR_ACTS(1), TR_ACTS(2)) {                      \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_lstm_fwd(xw, hr, bias, p, hp, cp, gates, c, h, lens, s, i / hidden, i % hidden,     \
                    hidden, clip, input_forget, f0, fa0, fb0, f1, fa1, fb1, f2, fa2, fb2);     \
    }                                                                                          \
    TR_KERNEL void tr_lstm_bwd_##dt(const T* gates, const T* c, const T* cp, const T* dh,      \
                                    const T* gy, T* dc, T* gx, const T* p, const int* lens,    \
                                    long long s, long long batch, long long hidden,            \
                                    float clip, int input_forget, TR_ACTS(0), TR_ACTS(1),      \
                                    TR_ACTS(2)) {                                              \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_lstm_bwd(gates, c, cp, dh, gy, dc, gx, p, lens, s, i / hidden, i % hidden, hidden,  \
                    clip, input_forget, f0, fa0, fb0, f1, fa1, fb1, f2, fa2, fb2);             \
    }                                                                                          \
    TR_KERNEL void tr_lstm_peephole_grad_##dt(const T* gx, const T* c, const T* cp, T* gp,     \
                                              long long batch, long long hidden) {             \
        TR_GRID_STRIDE(i, 3 * hidden) {                                                        \
            long long slot = i / hidden, j = i % hidden;                                       \
            const T* state = slot == 1 ? c : cp;                                               \
            float sum = 0.0f;                                                                  \
            for (long long n = 0; n < batch; ++n)                                              \
                sum = sum + tr_get(gx, n * 4 * hidden + i) * tr_get(state, n * hidden + j);    \
            tr_put(gp, i, tr_get(gp, i) + sum);                                                \
        }                                                                                      \
    }

// ---- GRU -----------------------------------------------------------------------------------

template <class T>
TR_HD void tr_gru_fwd_gates(const T* xw, const T* hr, const T* bias, const T* hp, T* gates,
                            T* mid, T* q, long long n, long long j, long long hidden, float clip,
                            int lbr, TR_ACTS(0)) {
    const long long H = hidden, G = 3 * H, at = n * H + j;
    float ar = 0.0f;
    for (int k = 0; k < 2; ++k) {
        float pre = tr_get(hr, n * G + k * H + j) + tr_recurrent_xp(xw, bias, n, k, j, H, G, 1);
        pre = tr_recurrent_clip(pre, clip);
        tr_put(gates, n * G + k * H + j, pre);
        ar = tr_recurrent_act(f0, fa0, fb0, pre);  // k = 1: the reset gate
    }
    if (lbr) {  // H Rh^T + Rbh, kept for the candidate and its gradient
        float m = tr_get(hr, n * G + 2 * H + j);
        tr_put(mid, at, bias ? m + tr_get(bias, G + 2 * H + j) : m);
    } else {
        tr_put(mid, at, 0.0f);
        tr_put(q, at, ar * tr_get(hp, at));
    }
}

template <class T>
TR_HD void tr_gru_fwd_state(const T* xw, const T* bias, const T* qr, const T* hp, T* gates,
                            const T* mid, T* h, const int* lens, long long s, long long n,
                            long long j, long long hidden, float clip, int lbr, TR_ACTS(0),
                            TR_ACTS(1)) {
    const long long H = hidden, G = 3 * H, at = n * H + j;
    float x = tr_recurrent_xp(xw, bias, n, 2, j, H, G, !lbr);
    float az = tr_recurrent_act(f0, fa0, fb0, tr_get(gates, n * G + j));
    float pre;
    if (lbr) {  // g(Xh + r * (H Rh^T + Rbh))
        float ar = tr_recurrent_act(f0, fa0, fb0, tr_get(gates, n * G + H + j));
        pre = ar * tr_get(mid, at) + x;
    } else {  // g(Xh + (r * H) Rh^T + Rbh)
        pre = tr_get(qr, at) + x;
    }
    pre = tr_recurrent_clip(pre, clip);
    tr_put(gates, n * G + 2 * H + j, pre);
    float ah = tr_recurrent_act(f1, fa1, fb1, pre);
    float t0 = tr_get(hp, at) - ah;  // H = h~ + z (H_prev - h~)
    t0 = t0 * az;
    if (tr_recurrent_past(lens, s, n))
        h[at] = hp[at];
    else
        tr_put(h, at, ah + t0);
}

template <class T>
TR_HD void tr_gru_bwd_gates(const T* gates, const T* mid, const T* hp, const T* dh,
                            const T* gy, T* gx, T* grh, T* q, T* gr3, T* t1, const int* lens,
                            long long s, long long n, long long j, long long hidden, float clip,
                            int lbr, TR_ACTS(0), TR_ACTS(1)) {
    const long long H = hidden, G = 3 * H, at = n * H + j;
    float dhv = tr_recurrent_past(lens, s, n) ? 0.0f
                : gy ? tr_get(dh, at) + tr_get(gy, at) : tr_get(dh, at);
    float dz, dr, dhd;
    float az = tr_recurrent_act_dx(f0, fa0, fb0, tr_get(gates, n * G + j), clip, &dz);
    float ar = tr_recurrent_act_dx(f0, fa0, fb0, tr_get(gates, n * G + H + j), clip, &dr);
    float ah = tr_recurrent_act_dx(f1, fa1, fb1, tr_get(gates, n * G + 2 * H + j), clip, &dhd);
    float hpv = tr_get(hp, at);
    float daz = dhv * (hpv - ah);
    float dah = dhv * (1.0f - az);
    dah = dah * dhd;
    float gz = daz * dz;
    tr_put(gx, n * G + j, gz);
    tr_put(gx, n * G + 2 * H + j, dah);
    tr_put(gr3, n * G + j, gz);
    tr_put(t1, at, dhv * az);  // the previous state's gradient through z
    if (lbr) {
        float dar = dah * tr_get(mid, at), g = dah * ar, gr = dar * dr;
        tr_put(grh, at, g);
        q[at] = hp[at];
        tr_put(gx, n * G + H + j, gr);
        tr_put(gr3, n * G + H + j, gr);
        tr_put(gr3, n * G + 2 * H + j, g);
    } else {  // the reset gate's gradient needs grh Rh first (tr_gru_bwd_reset)
        tr_put(grh, at, dah);
        tr_put(q, at, ar * hpv);
        tr_put(gr3, n * G + 2 * H + j, 0.0f);
    }
}

template <class T>
TR_HD void tr_gru_bwd_reset(const T* gates, const T* hp, const T* t0, T* gx, T* gr3, T* t1,
                            long long n, long long j, long long hidden, float clip,
                            TR_ACTS(0)) {
    const long long H = hidden, G = 3 * H, at = n * H + j;
    float dr;
    float ar = tr_recurrent_act_dx(f0, fa0, fb0, tr_get(gates, n * G + H + j), clip, &dr);
    float d = tr_get(t0, at);  // d(r * H) = grh Rh
    float gr = d * tr_get(hp, at);
    gr = gr * dr;
    tr_put(t1, at, tr_get(t1, at) + d * ar);
    tr_put(gx, n * G + H + j, gr);
    tr_put(gr3, n * G + H + j, gr);
}

#define TR_GRU(T, dt)                                                                          \
    TR_KERNEL void tr_gru_fwd_gates_##dt(const T* xw, const T* hr, const T* bias, const T* hp, \
                                         T* gates, T* mid, T* q, long long batch,              \
                                         long long hidden, float clip, int lbr, TR_ACTS(0)) {  \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_gru_fwd_gates(xw, hr, bias, hp, gates, mid, q, i / hidden, i % hidden, hidden,      \
                         clip, lbr, f0, fa0, fb0);                                             \
    }                                                                                          \
    TR_KERNEL void tr_gru_fwd_state_##dt(const T* xw, const T* bias, const T* qr, const T* hp, \
                                         T* gates, const T* mid, T* h, const int* lens,        \
                                         long long s, long long batch, long long hidden,       \
                                         float clip, int lbr, TR_ACTS(0), TR_ACTS(1)) {        \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_gru_fwd_state(xw, bias, qr, hp, gates, mid, h, lens, s, i / hidden, i % hidden,     \
                         hidden, clip, lbr, f0, fa0, fb0, f1, fa1, fb1);                       \
    }                                                                                          \
    TR_KERNEL void tr_gru_bwd_gates_##dt(const T* gates, const T* mid, const T* hp,            \
                                         const T* dh, const T* gy, T* gx, T* grh, T* q,        \
                                         T* gr3, T* t1, const int* lens, long long s,          \
                                         long long batch, long long hidden, float clip,        \
                                         int lbr, TR_ACTS(0), TR_ACTS(1)) {                    \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_gru_bwd_gates(gates, mid, hp, dh, gy, gx, grh, q, gr3, t1, lens, s, i / hidden,     \
                         i % hidden, hidden, clip, lbr, f0, fa0, fb0, f1, fa1, fb1);           \
    }                                                                                          \
    TR_KERNEL void tr_gru_bwd_reset_##dt(const T* gates, const T* hp, const T* t0, T* gx,      \
                                         T* gr3, T* t1, long long batch, long long hidden,     \
                                         float clip, TR_ACTS(0)) {                             \
        TR_GRID_STRIDE(i, batch * hidden)                                                      \
        tr_gru_bwd_reset(gates, hp, t0, gx, gr3, t1, i / hidden, i % hidden, hidden, clip,     \
                         f0, fa0, fb0);                                                        \
    }

// ---- RNN -----------------------------------------------------------------------------------

#define TR_RNN(T, dt)                                                                          \
    TR_KERNEL void tr_rnn_fwd_##dt(const T* xw, const T* hr, const T* bias, const T* hp,       \
                                   T* gates, T* h, const int* lens, long long s,               \
                                   long long batch, long long hidden, float clip,              \
                                   TR_ACTS(0)) {                                               \
        TR_GRID_STRIDE(i, batch * hidden) {                                                    \
            long long n = i / hidden, j = i % hidden;                                          \
            float pre = tr_get(hr, i) + tr_recurrent_xp(xw, bias, n, 0, j, hidden, hidden, 1); \
            pre = tr_recurrent_clip(pre, clip);                                                \
            tr_put(gates, i, pre);                                                             \
            if (tr_recurrent_past(lens, s, n))                                                 \
                h[i] = hp[i];                                                                  \
            else                                                                               \
                tr_put(h, i, tr_recurrent_act(f0, fa0, fb0, pre));                             \
        }                                                                                      \
    }                                                                                          \
    TR_KERNEL void tr_rnn_bwd_##dt(const T* gates, const T* dh, const T* gy, T* gx,            \
                                   const int* lens, long long s, long long batch,              \
                                   long long hidden, float clip, TR_ACTS(0)) {                 \
        TR_GRID_STRIDE(i, batch * hidden) {                                                    \
            float dhv = tr_recurrent_past(lens, s, i / hidden) ? 0.0f                          \
                        : gy ? tr_get(dh, i) + tr_get(gy, i) : tr_get(dh, i);                  \
            float d;                                                                           \
            tr_recurrent_act_dx(f0, fa0, fb0, tr_get(gates, i), clip, &d);                     \
            tr_put(gx, i, d * dhv);                                                            \
        }                                                                                      \
    }
