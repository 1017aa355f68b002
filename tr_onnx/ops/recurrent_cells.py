"""The cells of ops/recurrent.py's LSTM, GRU and RNN: one step forwards and one step backwards
of each (``_CELLS``), over one direction, and the views of the saved rows they read and write
(``_rows``). The time loop, the processing order and the weight gradients around them are the
layer's kernels, in ops/recurrent.py; the module docstring there says what a saved row holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .recurrent import Spec


def _clip_(a, clip: float):
    if clip > 0:
        np.clip(a, -clip, clip, out=a)


def _clip_mask_(d, a, clip: float):
    """Multiply a derivative by the clip's (1 inside the bounds, 0 where a was clipped)."""
    if clip > 0:
        np.multiply(d, np.abs(a) < clip, out=d)


# ---- cells: one step forwards, one step backwards ----------------------------------------------
# Forward steps write step s's saved blocks (gates, mid, h) from ``xp`` (X W^T + biases folded
# in) and the previous state. Backward steps read them and turn dh (and dc) into the gradients
# of the gate pre-activations (``gx``, one row of ``[T, N, G*H]``) and, in place, the previous
# state's dh (and dc). The input and recurrent sides share ``gx`` except GRU's candidate under
# its reset gate: its recurrent-side gradient (``b.grh``) and the matmul's left operand
# (``b.q``: r * H_prev, or H_prev with linear_before_reset) are kept per step for gR.


class _Buffers:
    """Workspace views of one kernel run, by name (plus per-direction views a run sets)."""

    def __init__(self, ids: dict, ws):
        for k, i in ids.items():
            setattr(self, k, ws[i])


def _rows(sp: Spec, saved_d, n: int):
    """Views of one direction's saved rows ``[T, N, S]`` as (gates [T, N, G*H], mid
    [T, N, H] (LSTM's C_t, GRU's H Rh^T + Rbh; None for RNN), h [T, N, H]). A step's row is
    stored as three contiguous blocks, so the step's matmuls read and write them directly
    (NumPy's matmul on strided operands is several times slower)."""
    t, gh, h = saved_d.shape[0], sp.gates * sp.hidden, sp.hidden
    if not saved_d.flags.c_contiguous:  # a reshape would copy, and the writes be lost
        raise ValueError("the saved rows must be one contiguous buffer")
    flat = saved_d.reshape(t, -1)
    mid = flat[:, n * gh:n * (gh + h)].reshape(t, n, h) if sp.cell != "RNN" else None
    return flat[:, :n * gh].reshape(t, n, gh), mid, flat[:, -n * h:].reshape(t, n, h)


def _lstm_forward(sp, acts, gates, c, hs, xp, hp, cp, r, p, b: _Buffers):
    h, f, g, hact = sp.hidden, acts[0], acts[1], acts[2]
    gi, go, gf, gc = (gates[:, k * h:(k + 1) * h] for k in range(4))
    ai, ao, af, ac = (b.act[:, k * h:(k + 1) * h] for k in range(4))
    np.matmul(hp, r.T, out=gates)
    np.add(gates, xp, out=gates)
    if p is not None:
        for gk, pk in ((gi, p[:h]), (gf, p[2 * h:])):
            np.multiply(cp, pk, out=b.t0)
            np.add(gk, b.t0, out=gk)
    for gk in (gi, gf, gc):
        _clip_(gk, sp.clip)
    f(gi, ai)
    g(gc, ac)
    if sp.input_forget:
        np.subtract(1, ai, out=af)
    else:
        f(gf, af)
    np.multiply(af, cp, out=c)
    np.multiply(ai, ac, out=b.t0)
    np.add(c, b.t0, out=c)
    if p is not None:
        np.multiply(c, p[h:2 * h], out=b.t0)
        np.add(go, b.t0, out=go)
    _clip_(go, sp.clip)
    f(go, ao)
    hact(c, b.t0)
    np.multiply(ao, b.t0, out=hs)


def _lstm_backward(sp, acts, gates, c, hp, cp, dh, dc, gx, r, p, dp, b: _Buffers, s: int):
    h, f, g, hact = sp.hidden, acts[0], acts[1], acts[2]
    gi, go, gf, gc = (gates[:, k * h:(k + 1) * h] for k in range(4))
    ai, ao, af, ac = (b.act[:, k * h:(k + 1) * h] for k in range(4))
    di, do, df, dg = (b.der[:, k * h:(k + 1) * h] for k in range(4))
    dai, dao, daf, dac = (gx[:, k * h:(k + 1) * h] for k in range(4))
    for act, gk, ak, dk in ((f, gi, ai, di), (f, go, ao, do), (g, gc, ac, dg)):
        act(gk, ak)
        act.derivative(gk, ak, dk)
        _clip_mask_(dk, gk, sp.clip)
    if sp.input_forget:
        np.subtract(1, ai, out=af)
    else:
        f(gf, af)
        f.derivative(gf, af, df)
        _clip_mask_(df, gf, sp.clip)
    hact(c, b.t0)  # h(C)
    hact.derivative(c, b.t0, b.t1)
    np.multiply(dh, b.t0, out=dao)
    np.multiply(dao, do, out=dao)
    # dC = dc + dh * o * h'(C) (+ the output gate's peephole)
    np.multiply(dh, ao, out=b.t0)
    np.multiply(b.t0, b.t1, out=b.t0)
    np.add(dc, b.t0, out=b.t0)
    if p is not None:
        np.multiply(dao, p[h:2 * h], out=b.t1)
        np.add(b.t0, b.t1, out=b.t0)
    dct = b.t0
    np.multiply(dct, ac, out=dai)
    np.multiply(dct, ai, out=dac)
    np.multiply(dac, dg, out=dac)
    if sp.input_forget:  # f = 1 - i: the forget path's gradient reaches i, negated
        np.multiply(dct, cp, out=b.t1)
        np.subtract(dai, b.t1, out=dai)
        daf.fill(0)
    else:
        np.multiply(dct, cp, out=daf)
        np.multiply(daf, df, out=daf)
    np.multiply(dai, di, out=dai)
    np.multiply(dct, af, out=dc)  # dc of the previous step
    if p is not None:
        for dak, pk, slot, state in ((dai, p[:h], 0, cp), (dao, None, 1, c),
                                     (daf, p[2 * h:], 2, cp)):
            np.multiply(dak, state, out=b.t1)
            np.sum(b.t1, axis=0, out=b.hsum)
            np.add(dp[slot * h:(slot + 1) * h], b.hsum, out=dp[slot * h:(slot + 1) * h])
            if pk is not None:
                np.multiply(dak, pk, out=b.t1)
                np.add(dc, b.t1, out=dc)
    np.matmul(gx, r, out=dh)


def _gru_forward(sp, acts, gates, hr, hs, xp, hp, cp, r, p, b: _Buffers):
    h, f, g = sp.hidden, acts[0], acts[1]
    gzr, gh = gates[:, :2 * h], gates[:, 2 * h:]
    azr, az, ar, ah = b.act[:, :2 * h], b.act[:, :h], b.act[:, h:2 * h], b.act[:, 2 * h:]
    np.matmul(hp, r.T, out=b.act)  # H R^T of the three gates (scratch in act)
    np.add(b.act, xp, out=gates)
    _clip_(gzr, sp.clip)
    if sp.linear_before_reset:  # g(Xh + r * (H Rh^T + Rbh))
        np.add(b.act[:, 2 * h:], b.rbh, out=hr)  # before act's candidate block is written
        f(gzr, azr)
        np.multiply(ar, hr, out=b.t1)
    else:  # g(Xh + (r * H) Rh^T + Rbh)
        f(gzr, azr)
        np.multiply(ar, hp, out=b.t0)
        np.matmul(b.t0, r[2 * h:].T, out=b.t1)
        hr.fill(0)  # unused: no stale values in the saved rows
    np.add(b.t1, xp[:, 2 * h:], out=gh)
    _clip_(gh, sp.clip)
    g(gh, ah)
    np.subtract(hp, ah, out=b.t0)  # H = h~ + z (H_prev - h~)
    np.multiply(b.t0, az, out=b.t0)
    np.add(ah, b.t0, out=hs)


def _gru_backward(sp, acts, gates, hr, hp, cp, dh, dc, gx, r, p, dp, b: _Buffers, s: int):
    h, f, g = sp.hidden, acts[0], acts[1]
    gzr, gh = gates[:, :2 * h], gates[:, 2 * h:]
    azr, az, ar, ah = b.act[:, :2 * h], b.act[:, :h], b.act[:, h:2 * h], b.act[:, 2 * h:]
    dzr, dhd = b.der[:, :2 * h], b.der[:, 2 * h:]
    daz, dar, dah = gx[:, :h], gx[:, h:2 * h], gx[:, 2 * h:]
    for act, gk, ak, dk in ((f, gzr, azr, dzr), (g, gh, ah, dhd)):
        act(gk, ak)
        act.derivative(gk, ak, dk)
        _clip_mask_(dk, gk, sp.clip)
    np.subtract(hp, ah, out=b.t0)
    np.multiply(dh, b.t0, out=daz)  # dz
    np.subtract(1, az, out=b.t0)
    np.multiply(dh, b.t0, out=dah)
    np.multiply(dah, dhd, out=dah)
    np.multiply(dh, az, out=b.t1)  # the previous state's gradient, through z
    grh, q = b.grh[s], b.q[s]
    # the recurrent side's gradients [dz, dr, candidate's] (contiguous, for one matmul by R)
    grz, gr_h = b.gr3[:, :2 * h], b.gr3[:, 2 * h:]
    if sp.linear_before_reset:
        np.multiply(dah, hr, out=dar)
        np.multiply(dah, ar, out=grh)
        np.copyto(q, hp)
        np.copyto(gr_h, grh)
    else:
        np.copyto(grh, dah)
        np.multiply(ar, hp, out=q)
        np.matmul(grh, r[2 * h:], out=b.t0)  # d(r * H)
        np.multiply(b.t0, hp, out=dar)
        np.multiply(b.t0, ar, out=b.t0)
        np.add(b.t1, b.t0, out=b.t1)
        gr_h.fill(0)
    np.multiply(gx[:, :2 * h], dzr, out=gx[:, :2 * h])
    np.copyto(grz, gx[:, :2 * h])
    np.matmul(b.gr3, r, out=dh)
    np.add(dh, b.t1, out=dh)


def _rnn_forward(sp, acts, a, mid, hs, xp, hp, cp, r, p, b: _Buffers):
    np.matmul(hp, r.T, out=a)
    np.add(a, xp, out=a)
    _clip_(a, sp.clip)
    acts[0](a, hs)


def _rnn_backward(sp, acts, a, mid, hp, cp, dh, dc, gx, r, p, dp, b: _Buffers, s: int):
    f = acts[0]
    f(a, b.t0)
    f.derivative(a, b.t0, gx)
    _clip_mask_(gx, a, sp.clip)
    np.multiply(gx, dh, out=gx)
    np.matmul(gx, r, out=dh)


_CELLS = {"LSTM": (_lstm_forward, _lstm_backward), "GRU": (_gru_forward, _gru_backward),
          "RNN": (_rnn_forward, _rnn_backward)}
