"""cuda bindings of ``ops/recurrent.py`` (``kernels/recurrent.cu``): LSTM, GRU and RNN, their
training variants (``ai.tr_onnx`` ``LSTMTraining`` / ``GRUTraining`` / ``RNNTraining``, which
also write the saved rows) and their backward through time (``LSTMGrad`` / ``GRUGrad`` /
``RNNGrad``): every direction, ``sequence_lens``, initial states, peepholes, ``layout`` 0 and
1, the ONNX activations with alpha/beta, ``clip``, ``linear_before_reset``, ``input_forget``.

The time loop is a sequence of launches, as the NumPy kernel's loop is a sequence of calls. Per
direction: X gathered into processing order, ``X W^T`` over all steps as one matrix product;
per step the recurrent product ``H_{t-1} R^T`` and the cell's pointwise kernel (GRU without
``linear_before_reset``: a second product, ``(r * H_{t-1}) Rh^T``, between two pointwise
kernels); then Y, Y_h, Y_c scattered back to time order. Backwards the loop runs from the last
step to the first: the cell's backward kernel writes the step's gate gradients into a
``[T, N, G*H]`` buffer and the previous step's dc in place, ``dH_{t-1} = gates' gradient R``
is one product, and a carry kernel keeps dh of rows past their sequence's end. gX, gW, gR and
gB then come from one product (or one column sum) each over all steps, summed in a fixed order
(no atomics: deterministic).

The matrix products are ``tr_matmul_<dt>`` launches (``kernels/matmul.cu``, one thread per
output, fp64 accumulation). Its operands are raw pointers with row and column strides, so one
step's rows of a saved buffer, a transposed weight or one direction's block of an output are
arena addresses with strides, no copies; the cuDNN matmul graphs describe whole plan tensors
only. Workspaces are of the input's storage type, as the NumPy kernel's; every kernel computes
in fp32. Storage f32, f16, bf16; ``sequence_lens`` int32 (as ONNX types it). The recurrent ops
are planned compact (``PLAIN_ONLY``); another layout raises ``Unbound``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ....ops.recurrent import _N_IN, _N_OUT, _SEQ_LENS, _ctx_spec, _dims, _Spec
from ..bind import (
    INTERNAL,
    BindContext,
    Unbound,
    collapse,
    f32,
    float_dt,
    i32,
    i64,
    move_kernel,
    need_compact,
)
from ..capture import DeviceBuffer
from ..sources import STORAGE, KernelSource, instantiate, kernel_source

# ---- kernels/recurrent.cu: the family's name table ----------------------------------------------


def recurrent_source() -> KernelSource:
    """kernels/recurrent.cu: the cells' step kernels forwards and backwards, and the moves of
    the time loop (gathers into processing order, scatters back, dh's carry, column sums)."""
    return kernel_source(
        "recurrent",
        instantiate("TR_RECURRENT_MOVES({T}, {dt})",
                    ("tr_recurrent_gather_{dt}", "tr_recurrent_scatter_{dt}",
                     "tr_recurrent_carry_dh_{dt}", "tr_recurrent_col_sum_{dt}"), STORAGE),
        instantiate("TR_LSTM({T}, {dt})",
                    ("tr_lstm_fwd_{dt}", "tr_lstm_bwd_{dt}", "tr_lstm_peephole_grad_{dt}"),
                    STORAGE),
        instantiate("TR_GRU({T}, {dt})",
                    ("tr_gru_fwd_gates_{dt}", "tr_gru_fwd_state_{dt}", "tr_gru_bwd_gates_{dt}",
                     "tr_gru_bwd_reset_{dt}"), STORAGE),
        instantiate("TR_RNN({T}, {dt})", ("tr_rnn_fwd_{dt}", "tr_rnn_bwd_{dt}"), STORAGE))


KERNELS = recurrent_source()

ACTIVATION_CODES = {"sigmoid": 0, "tanh": 1, "relu": 2, "affine": 3, "leakyrelu": 4,
                    "thresholdedrelu": 5, "scaledtanh": 6, "hardsigmoid": 7, "elu": 8,
                    "softsign": 9, "softplus": 10}
"""Activation name (``ops/recurrent.py``'s) -> the code ``tr_recurrent_act`` switches on."""


# ---- addressing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    """A tensor or workspace of the node addressed in elements: ``at(offset, count)`` is the
    buffer of ``count`` elements from ``offset`` (the rest when None); at offset 0 it keeps
    the plan's name, so the recorder checks it against the plan's tensor."""

    buf: DeviceBuffer
    itemsize: int

    def at(self, offset: int = 0, count: int | None = None) -> DeviceBuffer:
        total = self.buf.nbytes // self.itemsize
        count = total - offset if count is None else count
        return DeviceBuffer(self.buf.ptr + offset * self.itemsize, count * self.itemsize,
                            self.buf.writes, self.buf.name if offset == 0 else None)


def _act_args(acts, k: int) -> list:
    """The first ``k`` activations as the kernels' (code, alpha, beta) triples."""
    return [a for act in acts[:k] for a in (i32(ACTIVATION_CODES[act.name]), f32(act.alpha),
                                            f32(act.beta))]


class _Layer:
    """One node being bound: its tensors as spans, its geometry, and the launches common to
    the forward and backward bindings, collected in ``calls``."""

    def __init__(self, b: BindContext, node, sp: _Spec, dims: tuple[int, int, int],
                 ws: dict[str, int], n_in: int):
        self.b, self.sp = b, sp
        x = node.inputs[0]
        self.t, self.n, self.x_size = dims
        self.h, self.gh, self.dirs = sp.hidden, sp.gates * sp.hidden, len(sp.reverse)
        self.width = sp.width
        self.ins = list(node.inputs) + [None] * (n_in - len(node.inputs))
        self.outs = list(node.outputs)
        floats = [v for k, v in enumerate(self.ins) if v is not None and k != _SEQ_LENS]
        need_compact(b, *floats, *(v for v in self.outs if v is not None))
        self.dt = float_dt(b, *floats, *(v for v in self.outs if v is not None))
        self.item = np.dtype(b.t(x).dtype).itemsize
        self.move = move_kernel(b, x)
        # the bound as the storage type rounds it: a clipped value stored in float16 then sits
        # on the bound, outside the clip's derivative mask (|a| < clip), as NumPy's does
        self.clip = f32(np.asarray(sp.clip, b.t(x).dtype).astype(np.float32))
        lens = self.ins[_SEQ_LENS]
        if lens is not None and np.dtype(b.t(lens).dtype) != np.int32:
            raise Unbound(f"sequence_lens {lens.name!r} is {np.dtype(b.t(lens).dtype).name}; "
                          "the kernels read int32 (the ONNX type)")
        self.lens = b.buf(lens)
        self.ws = {k: _Span(b.ws(i), self.item) for k, i in ws.items()}
        self.calls: list = []

    def span(self, v, writes: bool = False) -> _Span | None:
        return None if v is None else _Span(self.b.buf(v, writes), self.item)

    def launch(self, kernel: str, count: int, args: list) -> None:
        self.calls.append(self.b.launch(f"{kernel}_{self.dt}", count, args))

    def gemm(self, a, w, y, m: int, k: int, n: int, a_strides, w_strides) -> None:
        """``y`` (compact [m, n]) = ``a`` [m, k] ``w`` [k, n], each read through its (row,
        column) element strides."""
        self.launch("tr_matmul", m * n, [a, w, y, i64(1), i64(m), i64(k), i64(n), i64(0),
                                         i64(a_strides[0]), i64(a_strides[1]), i64(0),
                                         i64(w_strides[0]), i64(w_strides[1])])

    def zero(self, buf: DeviceBuffer) -> None:
        count = buf.nbytes // self.item
        self.calls.append(self.b.launch(f"tr_zero_lanes_{self.move}", count,
                                        [buf, i64(1), i64(0), i64(count)]))

    def gather(self, time, seq, steps: int, width: int, seq_step: int, dirs: int, d: int,
               reverse: bool, mask: bool, lens) -> None:
        """``seq`` [steps, N, width] (steps ``seq_step`` apart) in processing order from a
        time-ordered tensor (``tr_recurrent_gather``)."""
        self.launch("tr_recurrent_gather", steps * self.n * width,
                    [time, seq, lens, i64(steps), i64(self.n), i64(width), i64(seq_step),
                     i64(dirs), i64(d), i32(reverse), i32(self.sp.layout), i32(mask)])

    def scatter(self, seq, time, steps: int, width: int, seq_step: int, dirs: int, d: int,
                reverse: bool, mask: bool, lens, accumulate: bool = False) -> None:
        """The inverse of ``gather`` (``tr_recurrent_scatter``); ``accumulate`` adds."""
        self.launch("tr_recurrent_scatter", steps * self.n * width,
                    [seq, time, lens, i64(steps), i64(self.n), i64(width), i64(seq_step),
                     i64(dirs), i64(d), i32(reverse), i32(self.sp.layout), i32(mask),
                     i32(accumulate)])

    def state_in(self, v, seq: DeviceBuffer, d: int) -> None:
        """Direction ``d``'s [N, H] block of a state tensor (``[D, N, H]``, layout 1
        ``[N, D, H]``) into ``seq``, or zeros without one."""
        if v is None:
            self.zero(seq)
        else:
            self.gather(self.b.buf(v), seq, 1, self.h, self.n * self.h, self.dirs, d, False,
                        False, None)

    def state_out(self, seq: DeviceBuffer, v, d: int) -> None:
        if v is not None:
            self.scatter(seq, self.b.buf(v, True), 1, self.h, self.n * self.h, self.dirs, d,
                         False, False, None)

    # saved rows: per direction and step [gates N*G*H | mid N*H | h N*H] (RNN: no mid)
    def step_at(self, d: int, s: int) -> int:
        return (d * self.t + s) * self.n * self.width

    def mid_at(self, d: int, s: int) -> int:
        return self.step_at(d, s) + self.n * self.gh

    def h_at(self, d: int, s: int) -> int:
        return self.step_at(d, s) + self.n * (self.width - self.h)


# ---- forward ----------------------------------------------------------------------------------


def recurrent_factory(ctx: KernelContext):
    """LSTM / GRU / RNN and their training variants (the saved rows as the last output; the
    standard ops keep them in a workspace)."""
    sp = _ctx_spec(ctx)
    t, n, x_size = _dims(ctx, sp)
    h, gh = sp.hidden, sp.gates * sp.hidden
    shapes = {"xs": (t * n, x_size), "xp": (t * n, gh), "hr": (n, gh), "h0": (n, h)}
    if sp.cell == "LSTM":
        shapes["c0"] = (n, h)
    if sp.cell == "GRU":
        shapes.update(q=(n, h), qr=(n, h))
    if ctx.node.domain != INTERNAL:
        shapes["saved"] = (len(sp.reverse), t, n, sp.width)
    ws = {k: ctx.workspace(s, ctx.inputs[0].dtype) for k, s in shapes.items()}

    def bind(b: BindContext, node) -> list:
        return _forward(_Layer(b, node, sp, (t, n, x_size), ws, _N_IN[sp.cell]), node)

    return bind


def _forward(L: _Layer, node) -> list:
    sp, b = L.sp, L.b
    t, n, h, gh, x_size = L.t, L.n, L.h, L.gh, L.x_size
    ins, n_out = L.ins, _N_OUT[sp.cell]
    outs = L.outs + [None] * (n_out + 1 - len(L.outs))
    saved = L.span(outs[n_out], True) if node.domain == INTERNAL else L.ws["saved"]
    x, w, r, bias = (L.span(v) for v in ins[:4])
    p = L.span(ins[7]) if sp.cell == "LSTM" else None
    ws = L.ws
    for d, reverse in enumerate(sp.reverse):
        L.gather(x.at(), ws["xs"].at(), t, x_size, n * x_size, 1, 0, reverse, False, L.lens)
        L.gemm(ws["xs"].at(), w.at(d * gh * x_size, gh * x_size), ws["xp"].at(), t * n, x_size,
               gh, (x_size, 1), (1, x_size))
        L.state_in(ins[5], ws["h0"].at(), d)
        if sp.cell == "LSTM":
            L.state_in(ins[6], ws["c0"].at(), d)
        rd = r.at(d * gh * h, gh * h)
        bd = bias.at(d * 2 * gh, 2 * gh) if bias is not None else None
        acts = sp.acts[d]
        for s in range(t):
            hp = ws["h0"].at() if s == 0 else saved.at(L.h_at(d, s - 1), n * h)
            xw = ws["xp"].at(s * n * gh, n * gh)
            gates = saved.at(L.step_at(d, s), n * gh)
            hs = saved.at(L.h_at(d, s), n * h)
            L.gemm(hp, rd, ws["hr"].at(), n, h, gh, (h, 1), (1, h))
            step = [i64(s), i64(n), i64(h), L.clip]
            if sp.cell == "LSTM":
                cp = ws["c0"].at() if s == 0 else saved.at(L.mid_at(d, s - 1), n * h)
                L.launch("tr_lstm_fwd", n * h,
                         [xw, ws["hr"].at(), bd, p.at(d * 3 * h, 3 * h) if p else None, hp, cp,
                          gates, saved.at(L.mid_at(d, s), n * h), hs, L.lens, *step,
                          i32(sp.input_forget), *_act_args(acts, 3)])
            elif sp.cell == "GRU":
                mid = saved.at(L.mid_at(d, s), n * h)
                lbr = sp.linear_before_reset
                L.launch("tr_gru_fwd_gates", n * h,
                         [xw, ws["hr"].at(), bd, hp, gates, mid, ws["q"].at(), i64(n), i64(h),
                          L.clip, i32(lbr), *_act_args(acts, 1)])
                if not lbr:  # the candidate's product of the reset state
                    L.gemm(ws["q"].at(), r.at(d * gh * h + 2 * h * h, h * h), ws["qr"].at(),
                           n, h, h, (h, 1), (1, h))
                L.launch("tr_gru_fwd_state", n * h,
                         [xw, bd, None if lbr else ws["qr"].at(), hp, gates, mid, hs, L.lens,
                          *step, i32(lbr), *_act_args(acts, 2)])
            else:
                L.launch("tr_rnn_fwd", n * h, [xw, ws["hr"].at(), bd, hp, gates, hs, L.lens,
                                               *step, *_act_args(acts, 1)])
        if outs[0] is not None:
            L.scatter(saved.at(L.h_at(d, 0)), b.buf(outs[0], True), t, h, n * L.width, L.dirs,
                      d, reverse, True, L.lens)
        L.state_out(saved.at(L.h_at(d, t - 1), n * h), outs[1], d)
        if sp.cell == "LSTM":
            L.state_out(saved.at(L.mid_at(d, t - 1), n * h), outs[2], d)
    return L.calls


# ---- backward through time ----------------------------------------------------------------------


def recurrent_grad_factory(ctx: KernelContext):
    """ai.tr_onnx LSTMGrad / GRUGrad / RNNGrad (inputs: the forward node's, its saved rows,
    the gradients of Y, Y_h[, Y_c]; outputs gX, gW, gR, gB, g_initial_h[, g_initial_c, gP])."""
    sp = _ctx_spec(ctx)
    t, n, x_size = _dims(ctx, sp)
    h, gh = sp.hidden, sp.gates * sp.hidden
    shapes = {"gx": (t, n, gh), "hprev": (t, n, h), "gy": (t, n, h), "dh": (n, h),
              "dhr": (n, h), "xs": (t * n, x_size), "gxs": (t * n, x_size)}
    if sp.cell == "LSTM":
        shapes.update(cprev=(t, n, h), dc=(n, h))
    if sp.cell == "GRU":
        shapes.update(grh=(t, n, h), q=(t, n, h), gr3=(n, gh), t0=(n, h), t1=(n, h))
    ws = {k: ctx.workspace(s, ctx.inputs[0].dtype) for k, s in shapes.items()}

    def bind(b: BindContext, node) -> list:
        n_in = _N_IN[sp.cell]
        return _backward(_Layer(b, node, sp, (t, n, x_size), ws, n_in + 1 + _N_OUT[sp.cell]),
                         n_in)

    return bind


def _previous_states(L: _Layer, saved: _Span, d: int) -> None:
    """hprev (and LSTM's cprev) [T, N, H]: the state before each step -- the initial one,
    then the saved rows' H_t (C_t) of the steps before."""
    t, n, h = L.t, L.n, L.h
    pairs = [("hprev", L.ins[5], L.h_at)]
    if L.sp.cell == "LSTM":
        pairs.append(("cprev", L.ins[6], L.mid_at))
    for name, state, at in pairs:
        L.state_in(state, L.ws[name].at(0, n * h), d)
        if t > 1:
            dims, (xs, ys) = collapse([t - 1, n * h], [[n * L.width, 1], [n * h, 1]])
            L.calls.append(L.b.launch(
                f"tr_strided_copy_{L.move}", (t - 1) * n * h,
                [saved.at(), L.ws[name].at(), i64((t - 1) * n * h), i64(at(d, 0)), i64(n * h),
                 *(i64(v) for v in dims + xs + ys)]))


def _backward(L: _Layer, n_in: int) -> list:
    sp, ins, ws = L.sp, L.ins, L.ws
    t, n, h, gh = L.t, L.n, L.h, L.gh
    lstm, gru = sp.cell == "LSTM", sp.cell == "GRU"
    outs = L.outs + [None] * (7 - len(L.outs))
    x, w, r = (L.span(v) for v in ins[:3])
    p = L.span(ins[7]) if lstm else None
    saved = L.span(ins[n_in])
    g_y, g_yh, g_yc = ins[n_in + 1], ins[n_in + 2], ins[n_in + 3] if lstm else None
    gp = L.span(outs[6], True) if lstm and p is not None else None
    for d, reverse in enumerate(sp.reverse):
        _previous_states(L, saved, d)
        if g_y is not None:  # Y is zero past a row's end: no gradient flows back from there
            L.gather(L.b.buf(g_y), ws["gy"].at(), t, h, n * h, L.dirs, d, reverse, True, L.lens)
        L.state_in(g_yh, ws["dh"].at(), d)
        if lstm:
            L.state_in(g_yc, ws["dc"].at(), d)
        if gp is not None:
            L.zero(gp.at(d * 3 * h, 3 * h))
        rd = r.at(d * gh * h, gh * h)
        acts = sp.acts[d]
        for s in range(t - 1, -1, -1):
            gates = saved.at(L.step_at(d, s), n * gh)
            gx = ws["gx"].at(s * n * gh, n * gh)
            hp = ws["hprev"].at(s * n * h, n * h)
            gy = ws["gy"].at(s * n * h, n * h) if g_y is not None else None
            step = [L.lens, i64(s), i64(n), i64(h), L.clip]
            extra = None
            if lstm:
                c, cp = saved.at(L.mid_at(d, s), n * h), ws["cprev"].at(s * n * h, n * h)
                L.launch("tr_lstm_bwd", n * h,
                         [gates, c, cp, ws["dh"].at(), gy, ws["dc"].at(), gx,
                          p.at(d * 3 * h, 3 * h) if p else None, *step, i32(sp.input_forget),
                          *_act_args(acts, 3)])
                if gp is not None:
                    L.launch("tr_lstm_peephole_grad", 3 * h,
                             [gx, c, cp, gp.at(d * 3 * h, 3 * h), i64(n), i64(h)])
                left = gx
            elif gru:
                lbr = sp.linear_before_reset
                grh = ws["grh"].at(s * n * h, n * h)
                L.launch("tr_gru_bwd_gates", n * h,
                         [gates, saved.at(L.mid_at(d, s), n * h), hp, ws["dh"].at(), gy, gx,
                          grh, ws["q"].at(s * n * h, n * h), ws["gr3"].at(), ws["t1"].at(),
                          *step, i32(lbr), *_act_args(acts, 2)])
                if not lbr:  # d(r * H) = grh Rh, then the reset gate's gradient
                    L.gemm(grh, r.at(d * gh * h + 2 * h * h, h * h), ws["t0"].at(), n, h, h,
                           (h, 1), (h, 1))
                    L.launch("tr_gru_bwd_reset", n * h,
                             [gates, hp, ws["t0"].at(), gx, ws["gr3"].at(), ws["t1"].at(),
                              i64(n), i64(h), L.clip, *_act_args(acts, 1)])
                left, extra = ws["gr3"].at(), ws["t1"].at()
            else:
                L.launch("tr_rnn_bwd", n * h, [gates, ws["dh"].at(), gy, gx, *step,
                                               *_act_args(acts, 1)])
                left = gx
            L.gemm(left, rd, ws["dhr"].at(), n, gh, h, (gh, 1), (h, 1))
            L.launch("tr_recurrent_carry_dh", n * h,
                     [ws["dhr"].at(), extra, ws["dh"].at(), L.lens, i64(s), i64(n), i64(h)])
        _weight_grads(L, d, reverse, x, w, outs)
        L.state_out(ws["dh"].at(), outs[4], d)
        if lstm:
            L.state_out(ws["dc"].at(), outs[5], d)
    return L.calls


def _weight_grads(L: _Layer, d: int, reverse: bool, x: _Span, w: _Span, outs: list) -> None:
    """gX (scattered back to time order, the second direction added), gW, gR and gB of
    direction ``d``, each one product or column sum over every step's gate gradients."""
    ws, t, n, h, gh, x_size = L.ws, L.t, L.n, L.h, L.gh, L.x_size
    rows, gx = t * n, ws["gx"].at()
    gru = L.sp.cell == "GRU"
    if outs[0] is not None:
        L.gemm(gx, w.at(d * gh * x_size, gh * x_size), ws["gxs"].at(), rows, gh, x_size,
               (gh, 1), (x_size, 1))
        L.scatter(ws["gxs"].at(), L.b.buf(outs[0], True), t, x_size, n * x_size, 1, 0, reverse,
                  False, L.lens, accumulate=d > 0)
    if outs[1] is not None:
        L.gather(x.at(), ws["xs"].at(), t, x_size, n * x_size, 1, 0, reverse, False, L.lens)
        L.gemm(gx, ws["xs"].at(), L.span(outs[1], True).at(d * gh * x_size, gh * x_size), gh,
               rows, x_size, (1, gh), (x_size, 1))
    if outs[2] is not None:
        gr = L.span(outs[2], True)
        hprev = ws["hprev"].at()
        if gru:  # the candidate's recurrent product has its own operands (grh, q)
            L.gemm(gx, hprev, gr.at(d * gh * h, 2 * h * h), 2 * h, rows, h, (1, gh), (h, 1))
            L.gemm(ws["grh"].at(), ws["q"].at(), gr.at(d * gh * h + 2 * h * h, h * h), h, rows,
                   h, (1, h), (h, 1))
        else:
            L.gemm(gx, hprev, gr.at(d * gh * h, gh * h), gh, rows, h, (1, gh), (h, 1))
    if outs[3] is not None:
        gb = L.span(outs[3], True)
        base = d * 2 * gh
        sums = [(gx, base, gh, gh), (gx, base + gh, 2 * h if gru else gh, gh)]
        if gru:
            sums.append((ws["grh"].at(), base + gh + 2 * h, h, h))
        for a, at, cols, lda in sums:
            L.launch("tr_recurrent_col_sum", cols,
                     [a, gb.at(at, cols), i64(rows), i64(cols), i64(lda)])


# ---- registration -------------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    defs = []
    for cell in ("LSTM", "GRU", "RNN"):
        defs += [KernelDef(cell, "cuda", recurrent_factory),
                 KernelDef(f"{cell}Training", "cuda", recurrent_factory, domain=INTERNAL),
                 KernelDef(f"{cell}Grad", "cuda", recurrent_grad_factory, domain=INTERNAL)]
    return defs
