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

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ....ops.recurrent import N_IN, N_OUT, SEQ_LENS, Spec, ctx_spec, layer_dims
from ..bind import (
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

    def __init__(self, b: BindContext, node, sp: Spec, dims: tuple[int, int, int],
                 ws: dict[str, int], n_in: int):
        self.b, self.sp = b, sp
        x = node.inputs[0]
        self.t, self.n, self.x_size = dims
        self.h, self.gh, self.dirs = sp.hidden, sp.gates * sp.hidden, len(sp.reverse)
        self.width = sp.width
        self.ins = list(node.inputs) + [None] * (n_in - len(node.inputs))
        self.outs = list(node.outputs)
        floats = [v for k, v in enumerate(self.ins) if v is not None and k != SEQ_LENS]
        need_compact(b, *floats, *(v for v in self.outs if v is not None))
        self.dt = float_dt(b, *floats, *(v for v in self.outs if v is not None))
        self.item = np.dtype(b.t(x).dtype).itemsize
        self.move = move_kernel(b, x)
        # the bound as the storage type rounds it: a clipped value stored in float16 then sits
        # on the bound, outside the clip's derivative mask (|a| < clip), as NumPy's does
        self.clip = f32(np.asarray(sp.clip, b.t(x).dtype).astype(np.float32))
        lens = self.ins[SEQ_LENS]
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
    sp = ctx_spec(ctx)
    t, n, x_size = layer_dims(ctx, sp)
    h, gh = sp.hidden, sp.gates * sp.hidden
    shapes = {"xs": (t * n, x_size), "xp": (t * n, gh), "hr": (n, gh), "h0": (n, h)}
    if sp.cell == "LSTM":
        shapes["c0"] = (n, h)
    if sp.cell == "GRU":
        shapes.update(q=(n, h), qr=(n, h))
    if ctx.node.domain != INTERNAL_DOMAIN:
        shapes["saved"] = (len(sp.reverse), t, n, sp.width)
    ws = {k: ctx.workspace(s, ctx.inputs[0].dtype) for k, s in shapes.items()}

    def bind(b: BindContext, node) -> list:
        return _forward(_Layer(b, node, sp, (t, n, x_size), ws, N_IN[sp.cell]), node)

    return bind


def _forward(layer: _Layer, node) -> list:
    sp, ws, ins = layer.sp, layer.ws, layer.ins
    t, n, h, gh, x_size = layer.t, layer.n, layer.h, layer.gh, layer.x_size
    n_out = N_OUT[sp.cell]
    outs = layer.outs + [None] * (n_out + 1 - len(layer.outs))
    saved = layer.span(outs[n_out], True) if node.domain == INTERNAL_DOMAIN else ws["saved"]
    x, w = layer.span(ins[0]), layer.span(ins[1])
    for d, reverse in enumerate(sp.reverse):
        layer.gather(x.at(), ws["xs"].at(), t, x_size, n * x_size, 1, 0, reverse, False,
                     layer.lens)
        layer.gemm(ws["xs"].at(), w.at(d * gh * x_size, gh * x_size), ws["xp"].at(), t * n,
                   x_size, gh, (x_size, 1), (1, x_size))
        layer.state_in(ins[5], ws["h0"].at(), d)
        if sp.cell == "LSTM":
            layer.state_in(ins[6], ws["c0"].at(), d)
        for s in range(t):
            _FORWARD_STEPS[sp.cell](layer, saved, d, s)
        if outs[0] is not None:
            layer.scatter(saved.at(layer.h_at(d, 0)), layer.b.buf(outs[0], True), t, h,
                          n * layer.width, layer.dirs, d, reverse, True, layer.lens)
        layer.state_out(saved.at(layer.h_at(d, t - 1), n * h), outs[1], d)
        if sp.cell == "LSTM":
            layer.state_out(saved.at(layer.mid_at(d, t - 1), n * h), outs[2], d)
    return layer.calls


class _Step:
    """The buffers of step ``s`` of direction ``d`` that every cell's forward step reads or
    writes: ``xw`` (its rows of X W^T), ``hp`` (H_{t-1}), ``hr`` (H_{t-1} R^T, computed
    here), ``gates``, ``mid``, ``hs`` (its saved blocks), ``bias`` (B[d] or None) and the
    arguments ``args`` (lens, s, batch, hidden, clip) the step kernels share."""

    def __init__(self, layer: _Layer, saved: _Span, d: int, s: int):
        n, h, gh, ws = layer.n, layer.h, layer.gh, layer.ws
        bias = layer.ins[3]
        self.bias = layer.span(bias).at(d * 2 * gh, 2 * gh) if bias is not None else None
        self.hp = ws["h0"].at() if s == 0 else saved.at(layer.h_at(d, s - 1), n * h)
        self.xw = ws["xp"].at(s * n * gh, n * gh)
        self.gates = saved.at(layer.step_at(d, s), n * gh)
        self.mid = saved.at(layer.mid_at(d, s), n * h)
        self.hs = saved.at(layer.h_at(d, s), n * h)
        self.hr = ws["hr"].at()
        self.args = [layer.lens, i64(s), i64(n), i64(h), layer.clip]
        r = layer.span(layer.ins[2]).at(d * gh * h, gh * h)
        layer.gemm(self.hp, r, self.hr, n, h, gh, (h, 1), (1, h))


def _lstm_step(layer: _Layer, saved: _Span, d: int, s: int) -> None:
    st, sp, n, h = _Step(layer, saved, d, s), layer.sp, layer.n, layer.h
    p = layer.ins[7]
    cp = layer.ws["c0"].at() if s == 0 else saved.at(layer.mid_at(d, s - 1), n * h)
    layer.launch("tr_lstm_fwd", n * h,
                 [st.xw, st.hr, st.bias, layer.span(p).at(d * 3 * h, 3 * h) if p else None,
                  st.hp, cp, st.gates, st.mid, st.hs, *st.args, i32(sp.input_forget),
                  *_act_args(sp.acts[d], 3)])


def _gru_step(layer: _Layer, saved: _Span, d: int, s: int) -> None:
    st, sp, n, h, ws = _Step(layer, saved, d, s), layer.sp, layer.n, layer.h, layer.ws
    lbr = sp.linear_before_reset
    layer.launch("tr_gru_fwd_gates", n * h,
                 [st.xw, st.hr, st.bias, st.hp, st.gates, st.mid, ws["q"].at(), i64(n),
                  i64(h), layer.clip, i32(lbr), *_act_args(sp.acts[d], 1)])
    if not lbr:  # the candidate's product of the reset state, (r * H_{t-1}) Rh^T
        rh = layer.span(layer.ins[2]).at(d * layer.gh * h + 2 * h * h, h * h)
        layer.gemm(ws["q"].at(), rh, ws["qr"].at(), n, h, h, (h, 1), (1, h))
    layer.launch("tr_gru_fwd_state", n * h,
                 [st.xw, st.bias, None if lbr else ws["qr"].at(), st.hp, st.gates, st.mid,
                  st.hs, *st.args, i32(lbr), *_act_args(sp.acts[d], 2)])


def _rnn_step(layer: _Layer, saved: _Span, d: int, s: int) -> None:
    st = _Step(layer, saved, d, s)
    layer.launch("tr_rnn_fwd", layer.n * layer.h,
                 [st.xw, st.hr, st.bias, st.hp, st.gates, st.hs, *st.args,
                  *_act_args(layer.sp.acts[d], 1)])


_FORWARD_STEPS = {"LSTM": _lstm_step, "GRU": _gru_step, "RNN": _rnn_step}


# ---- backward through time ----------------------------------------------------------------------


def recurrent_grad_factory(ctx: KernelContext):
    """ai.tr_onnx LSTMGrad / GRUGrad / RNNGrad (inputs: the forward node's, its saved rows,
    the gradients of Y, Y_h[, Y_c]; outputs gX, gW, gR, gB, g_initial_h[, g_initial_c, gP])."""
    sp = ctx_spec(ctx)
    t, n, x_size = layer_dims(ctx, sp)
    h, gh = sp.hidden, sp.gates * sp.hidden
    shapes = {"gx": (t, n, gh), "hprev": (t, n, h), "gy": (t, n, h), "dh": (n, h),
              "dhr": (n, h), "xs": (t * n, x_size), "gxs": (t * n, x_size)}
    if sp.cell == "LSTM":
        shapes.update(cprev=(t, n, h), dc=(n, h))
    if sp.cell == "GRU":
        shapes.update(grh=(t, n, h), q=(t, n, h), gr3=(n, gh), t0=(n, h), t1=(n, h))
    ws = {k: ctx.workspace(s, ctx.inputs[0].dtype) for k, s in shapes.items()}

    def bind(b: BindContext, node) -> list:
        n_in = N_IN[sp.cell]
        return _backward(_Layer(b, node, sp, (t, n, x_size), ws, n_in + 1 + N_OUT[sp.cell]),
                         n_in)

    return bind


def _previous_states(layer: _Layer, saved: _Span, d: int) -> None:
    """hprev (and LSTM's cprev) [T, N, H]: the state before each step -- the initial one,
    then the saved rows' H_t (C_t) of the steps before."""
    t, n, h = layer.t, layer.n, layer.h
    pairs = [("hprev", layer.ins[5], layer.h_at)]
    if layer.sp.cell == "LSTM":
        pairs.append(("cprev", layer.ins[6], layer.mid_at))
    for name, state, at in pairs:
        layer.state_in(state, layer.ws[name].at(0, n * h), d)
        if t > 1:
            dims, (xs, ys) = collapse([t - 1, n * h], [[n * layer.width, 1], [n * h, 1]])
            layer.calls.append(layer.b.launch(
                f"tr_strided_copy_{layer.move}", (t - 1) * n * h,
                [saved.at(), layer.ws[name].at(), i64((t - 1) * n * h), i64(at(d, 0)), i64(n * h),
                 *(i64(v) for v in dims + xs + ys)]))


def _backward(layer: _Layer, n_in: int) -> list:
    sp, ins, ws = layer.sp, layer.ins, layer.ws
    t, n, h = layer.t, layer.n, layer.h
    lstm = sp.cell == "LSTM"
    outs = layer.outs + [None] * (7 - len(layer.outs))
    saved = layer.span(ins[n_in])
    g_y, g_yh, g_yc = ins[n_in + 1], ins[n_in + 2], ins[n_in + 3] if lstm else None
    for d, reverse in enumerate(sp.reverse):
        _previous_states(layer, saved, d)
        if g_y is not None:  # Y is zero past a row's end: no gradient flows back from there
            layer.gather(layer.b.buf(g_y), ws["gy"].at(), t, h, n * h, layer.dirs, d, reverse,
                         True, layer.lens)
        layer.state_in(g_yh, ws["dh"].at(), d)
        if lstm:
            layer.state_in(g_yc, ws["dc"].at(), d)
        gp = outs[6] if lstm and ins[7] is not None else None
        if gp is not None:
            layer.zero(layer.span(gp, True).at(d * 3 * h, 3 * h))
        for s in range(t - 1, -1, -1):
            left, extra = _BACKWARD_STEPS[sp.cell](layer, saved, d, s, g_y is not None, gp)
            # dH_{t-1} = (the recurrent side's gate gradients) R, then rows past their end
            # keep dh
            layer.gemm(left, layer.span(ins[2]).at(d * layer.gh * h, layer.gh * h),
                       ws["dhr"].at(), n, layer.gh, h, (layer.gh, 1), (h, 1))
            layer.launch("tr_recurrent_carry_dh", n * h,
                         [ws["dhr"].at(), extra, ws["dh"].at(), layer.lens, i64(s), i64(n),
                          i64(h)])
        _weight_grads(layer, d, reverse, outs)
        layer.state_out(ws["dh"].at(), outs[4], d)
        if lstm:
            layer.state_out(ws["dc"].at(), outs[5], d)
    return layer.calls


class _BackStep:
    """The buffers of backward step ``s`` of direction ``d``: its saved ``gates`` and
    ``mid``, ``hp`` (H_{t-1}), ``gy`` (Y's gradient, or None), ``gx`` (its rows of the gate
    gradients) and the arguments ``args`` the step kernels share."""

    def __init__(self, layer: _Layer, saved: _Span, d: int, s: int, has_gy: bool):
        n, h, gh, ws = layer.n, layer.h, layer.gh, layer.ws
        self.gates = saved.at(layer.step_at(d, s), n * gh)
        self.mid = saved.at(layer.mid_at(d, s), n * h)
        self.hp = ws["hprev"].at(s * n * h, n * h)
        self.gy = ws["gy"].at(s * n * h, n * h) if has_gy else None
        self.gx = ws["gx"].at(s * n * gh, n * gh)
        self.args = [layer.lens, i64(s), i64(n), i64(h), layer.clip]


def _lstm_back_step(layer: _Layer, saved: _Span, d: int, s: int, has_gy: bool, gp):
    st, sp, n, h, ws = _BackStep(layer, saved, d, s, has_gy), layer.sp, layer.n, layer.h, layer.ws
    p = layer.ins[7]
    cp = ws["cprev"].at(s * n * h, n * h)
    layer.launch("tr_lstm_bwd", n * h,
                 [st.gates, st.mid, cp, ws["dh"].at(), st.gy, ws["dc"].at(), st.gx,
                  layer.span(p).at(d * 3 * h, 3 * h) if p else None, *st.args,
                  i32(sp.input_forget), *_act_args(sp.acts[d], 3)])
    if gp is not None:
        layer.launch("tr_lstm_peephole_grad", 3 * h,
                     [st.gx, st.mid, cp, layer.span(gp, True).at(d * 3 * h, 3 * h), i64(n),
                      i64(h)])
    return st.gx, None


def _gru_back_step(layer: _Layer, saved: _Span, d: int, s: int, has_gy: bool, gp):
    st, sp, n, h, ws = _BackStep(layer, saved, d, s, has_gy), layer.sp, layer.n, layer.h, layer.ws
    lbr = sp.linear_before_reset
    grh = ws["grh"].at(s * n * h, n * h)
    layer.launch("tr_gru_bwd_gates", n * h,
                 [st.gates, st.mid, st.hp, ws["dh"].at(), st.gy, st.gx, grh,
                  ws["q"].at(s * n * h, n * h), ws["gr3"].at(), ws["t1"].at(), *st.args,
                  i32(lbr), *_act_args(sp.acts[d], 2)])
    if not lbr:  # d(r * H) = grh Rh, then the reset gate's gradient
        rh = layer.span(layer.ins[2]).at(d * layer.gh * h + 2 * h * h, h * h)
        layer.gemm(grh, rh, ws["t0"].at(), n, h, h, (h, 1), (h, 1))
        layer.launch("tr_gru_bwd_reset", n * h,
                     [st.gates, st.hp, ws["t0"].at(), st.gx, ws["gr3"].at(), ws["t1"].at(),
                      i64(n), i64(h), layer.clip, *_act_args(sp.acts[d], 1)])
    return ws["gr3"].at(), ws["t1"].at()


def _rnn_back_step(layer: _Layer, saved: _Span, d: int, s: int, has_gy: bool, gp):
    st = _BackStep(layer, saved, d, s, has_gy)
    layer.launch("tr_rnn_bwd", layer.n * layer.h,
                 [st.gates, layer.ws["dh"].at(), st.gy, st.gx, *st.args,
                  *_act_args(layer.sp.acts[d], 1)])
    return st.gx, None


_BACKWARD_STEPS = {"LSTM": _lstm_back_step, "GRU": _gru_back_step, "RNN": _rnn_back_step}
"""cell -> one backward step: launches the cell's kernels, returns (the left operand of
dH_{t-1}'s product with R, what the carry adds to it or None)."""


def _weight_grads(layer: _Layer, d: int, reverse: bool, outs: list) -> None:
    """gX (scattered back to time order, the second direction added), gW, gR and gB of
    direction ``d``, each one product or column sum over every step's gate gradients."""
    ws, t, n, h, gh, x_size = layer.ws, layer.t, layer.n, layer.h, layer.gh, layer.x_size
    rows, gx = t * n, ws["gx"].at()
    gru = layer.sp.cell == "GRU"
    if outs[0] is not None:
        w = layer.span(layer.ins[1]).at(d * gh * x_size, gh * x_size)
        layer.gemm(gx, w, ws["gxs"].at(), rows, gh, x_size, (gh, 1), (x_size, 1))
        layer.scatter(ws["gxs"].at(), layer.b.buf(outs[0], True), t, x_size, n * x_size, 1, 0,
                      reverse, False, layer.lens, accumulate=d > 0)
    if outs[1] is not None:
        layer.gather(layer.span(layer.ins[0]).at(), ws["xs"].at(), t, x_size, n * x_size, 1, 0,
                     reverse, False, layer.lens)
        gw = layer.span(outs[1], True).at(d * gh * x_size, gh * x_size)
        layer.gemm(gx, ws["xs"].at(), gw, gh, rows, x_size, (1, gh), (x_size, 1))
    if outs[2] is not None:
        gr = layer.span(outs[2], True)
        hprev = ws["hprev"].at()
        if gru:  # the candidate's recurrent product has its own operands (grh, q)
            layer.gemm(gx, hprev, gr.at(d * gh * h, 2 * h * h), 2 * h, rows, h, (1, gh),
                       (h, 1))
            layer.gemm(ws["grh"].at(), ws["q"].at(), gr.at(d * gh * h + 2 * h * h, h * h), h,
                       rows, h, (1, h), (h, 1))
        else:
            layer.gemm(gx, hprev, gr.at(d * gh * h, gh * h), gh, rows, h, (1, gh), (h, 1))
    if outs[3] is not None:
        gb = layer.span(outs[3], True)
        base = d * 2 * gh
        sums = [(gx, base, gh, gh), (gx, base + gh, 2 * h if gru else gh, gh)]
        if gru:
            sums.append((ws["grh"].at(), base + gh + 2 * h, h, h))
        for a, at, cols, lda in sums:
            layer.launch("tr_recurrent_col_sum", cols,
                         [a, gb.at(at, cols), i64(rows), i64(cols), i64(lda)])


# ---- registration -------------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    defs = []
    for cell in ("LSTM", "GRU", "RNN"):
        defs += [KernelDef(cell, "cuda", recurrent_factory),
                 KernelDef(f"{cell}Training", "cuda", recurrent_factory, domain=INTERNAL_DOMAIN),
                 KernelDef(f"{cell}Grad", "cuda", recurrent_grad_factory, domain=INTERNAL_DOMAIN)]
    return defs
