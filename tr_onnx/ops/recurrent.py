"""Recurrent layers: LSTM, GRU and RNN (every direction, ``sequence_lens``, initial states,
peepholes, ``layout`` 0 and 1, the ONNX activation list with alpha/beta, ``clip``, GRU's
``linear_before_reset``, LSTM's ``input_forget``), and their backward through time.

One family because the three share everything but the cell: the time loop, the per-batch
reversal that ``sequence_lens`` implies, the layouts, the activations and the weight-gradient
matmuls. Each cell is a pair of step functions (``_CELLS``, ops/recurrent_cells.py) over one
direction.

Training. The backward pass needs every step's gate pre-activations and states. The gradient
rule therefore swaps the forward node for its training variant (``ai.tr_onnx`` ``LSTMTraining``,
``GRUTraining``, ``RNNTraining``: the same kernel, one more output ``saved`` of shape
``[directions, T, N, S]``) and emits one named backward op (``LSTMGrad``, ``GRUGrad``,
``RNNGrad``) whose kernel runs the whole layer, both directions, backwards through time: the
training graph of a layer is two nodes, never an unrolled loop.

Saved per step and direction (``N * S`` values, three contiguous blocks, see ``_rows``): LSTM
``[pre-activations i,o,f,c | C_t | H_t]``, GRU ``[pre-activations z,r,h | H_{t-1} Rh^T + Rbh |
H_t]``, RNN ``[pre-activation | H_t]``. Pre-activations are stored after ``clip`` (so the
clip's derivative is ``|a| < clip``).

``sequence_lens``. Steps run in *processing order* ``s``: batch row ``n`` reads time
``tidx[s, n]`` (``s`` forwards; ``len_n - 1 - s`` backwards while ``s < len_n``). Past a row's
length its state is carried unchanged (so ``Y_h``/``Y_c`` hold the last valid step) and its
``Y`` is zero. ``tidx[:, n]`` is a permutation of the time axis, so one gather brings ``X`` into
processing order and one scatter takes ``Y`` and ``gX`` back.

Kernels compute in the input's dtype and write outputs in place; gathers and scatters use
index workspaces (``np.take(out=)``, assignment into views). What still allocates per run is
small, one step's size at most: ``clip``'s mask and the rarely used activations' temporaries
(LeakyRelu, ThresholdedRelu's product, Elu, HardSigmoid's derivative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..host_math import negate
from ..ir import Node, Value, attribute_value
from ..opdef import PLAIN_ONLY, OpDef
from .recurrent_cells import _CELLS, _Buffers, _rows

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_N_ACTS = {"LSTM": 3, "GRU": 2, "RNN": 1}
_DEFAULT_ACTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"),
                 "RNN": ("Tanh",)}
N_IN = {"LSTM": 8, "GRU": 6, "RNN": 6}  # X, W, R, B, sequence_lens, initial_h[, initial_c, P]
N_OUT = {"LSTM": 3, "GRU": 2, "RNN": 2}  # Y, Y_h[, Y_c]
_GRAD_INPUTS = {"LSTM": (0, 1, 2, 3, 5, 6, 7), "GRU": (0, 1, 2, 3, 5), "RNN": (0, 1, 2, 3, 5)}
SEQ_LENS = 4


# ---- activations ----------------------------------------------------------------------------
# name -> (uses alpha, uses beta, default alpha, default beta, forward, derivative).
# forward(x, out, a, b) writes f(x); derivative(x, y, out, a, b) writes f'(x) given y = f(x).


def _sigmoid(x, out, a, b):
    negate(x, out)  # a hidden_size=1 gate block is a strided column of [N, G*1] rows
    np.exp(out, out=out)
    np.add(out, 1, out=out)
    np.reciprocal(out, out=out)


def _sigmoid_d(x, y, out, a, b):
    np.subtract(1, y, out=out)
    np.multiply(out, y, out=out)


def _tanh_d(x, y, out, a, b):
    np.multiply(y, y, out=out)
    np.subtract(1, out, out=out)


def _affine(x, out, a, b):
    np.multiply(x, a, out=out)
    np.add(out, b, out=out)


def _leaky_relu(x, out, a, b):
    np.multiply(x, a, out=out)
    np.copyto(out, x, where=x >= 0)


def _leaky_relu_d(x, y, out, a, b):
    np.greater_equal(x, 0, out=out)
    np.multiply(out, 1 - a, out=out)
    np.add(out, a, out=out)


def _thresholded_relu(x, out, a, b):
    np.greater(x, a, out=out)
    np.multiply(out, x, out=out)


def _scaled_tanh(x, out, a, b):
    np.multiply(x, b, out=out)
    np.tanh(out, out=out)
    np.multiply(out, a, out=out)


def _scaled_tanh_d(x, y, out, a, b):
    np.multiply(x, b, out=out)
    np.tanh(out, out=out)
    np.multiply(out, out, out=out)
    np.subtract(1, out, out=out)
    np.multiply(out, a * b, out=out)


def _hard_sigmoid(x, out, a, b):
    _affine(x, out, a, b)
    np.clip(out, 0, 1, out=out)


def _hard_sigmoid_d(x, y, out, a, b):
    np.greater(y, 0, out=out)
    np.multiply(out, y < 1, out=out)
    np.multiply(out, a, out=out)


def _elu(x, out, a, b):
    np.minimum(x, 0, out=out)
    np.expm1(out, out=out)
    np.multiply(out, a, out=out)
    np.copyto(out, x, where=x >= 0)


def _elu_d(x, y, out, a, b):
    np.add(y, a, out=out)
    np.copyto(out, 1, where=x >= 0)


def _softsign(x, out, a, b):
    np.abs(x, out=out)
    np.add(out, 1, out=out)
    np.divide(x, out, out=out)


def _softsign_d(x, y, out, a, b):
    np.abs(x, out=out)
    np.add(out, 1, out=out)
    np.multiply(out, out, out=out)
    np.reciprocal(out, out=out)


_ACTIVATIONS = {
    "sigmoid": (False, False, 0.0, 0.0, _sigmoid, _sigmoid_d),
    "tanh": (False, False, 0.0, 0.0, lambda x, out, a, b: np.tanh(x, out=out), _tanh_d),
    "relu": (False, False, 0.0, 0.0, lambda x, out, a, b: np.maximum(x, 0, out=out),
             lambda x, y, out, a, b: np.greater(x, 0, out=out)),
    "affine": (True, True, 1.0, 0.0, _affine, lambda x, y, out, a, b: out.fill(a)),
    "leakyrelu": (True, False, 0.01, 0.0, _leaky_relu, _leaky_relu_d),
    "thresholdedrelu": (True, False, 1.0, 0.0, _thresholded_relu,
                        lambda x, y, out, a, b: np.greater(x, a, out=out)),
    "scaledtanh": (True, True, 1.0, 1.0, _scaled_tanh, _scaled_tanh_d),
    "hardsigmoid": (True, True, 0.2, 0.5, _hard_sigmoid, _hard_sigmoid_d),
    "elu": (True, False, 1.0, 0.0, _elu, _elu_d),
    "softsign": (False, False, 0.0, 0.0, _softsign, _softsign_d),
    "softplus": (False, False, 0.0, 0.0, lambda x, out, a, b: np.logaddexp(0, x, out=out),
                 lambda x, y, out, a, b: _sigmoid(x, out, a, b)),
}


@dataclass(frozen=True)
class _Act:
    """One resolved activation: ``act(x, out)`` and ``act.derivative(x, y, out)``."""

    name: str
    alpha: float
    beta: float

    def __call__(self, x, out):
        _ACTIVATIONS[self.name][4](x, out, self.alpha, self.beta)

    def derivative(self, x, y, out):
        _ACTIVATIONS[self.name][5](x, y, out, self.alpha, self.beta)


# ---- the layer's description ------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A recurrent node's attributes, resolved once: the ONNX attributes with their defaults
    (standard ops) or the normalised ones the internal ops carry (``attrs()``)."""

    cell: str
    hidden: int
    reverse: tuple[bool, ...]  # per direction
    layout: int
    acts: tuple[tuple[_Act, ...], ...]  # per direction, the cell's activations (f, g, h)
    clip: float  # 0: no clip
    linear_before_reset: bool
    input_forget: bool

    @property
    def gates(self) -> int:
        return _GATES[self.cell]

    @property
    def width(self) -> int:
        """Width S of one saved row (see the module docstring)."""
        return {"LSTM": 6, "GRU": 5, "RNN": 2}[self.cell] * self.hidden

    def attrs(self) -> dict:
        """The normalised attributes of the internal ops (training forward and backward)."""
        acts = [a for d in self.acts for a in d]
        return {"hidden_size": self.hidden, "layout": self.layout, "clip": self.clip,
                "direction": ("bidirectional" if len(self.reverse) == 2
                              else "reverse" if self.reverse[0] else "forward"),
                "activations": [a.name for a in acts], "alphas": [a.alpha for a in acts],
                "betas": [a.beta for a in acts], "input_forget": int(self.input_forget),
                "linear_before_reset": int(self.linear_before_reset)}


def _resolve_acts(cell: str, attrs: dict, directions: int, label: str):
    k = _N_ACTS[cell]
    names = list(attrs.get("activations") or _DEFAULT_ACTS[cell] * directions)
    if len(names) == k and directions == 2:
        names = names * 2
    if len(names) > k * directions:  # RNN's schema default lists Tanh for two directions
        names = names[:k * directions]
    if len(names) != k * directions:
        raise UnsupportedModelError(f"{label}: {len(names)} activations given, {cell} with "
                                    f"{directions} direction(s) takes {k * directions}", [])
    if "alphas" in attrs:  # normalised already (internal ops)
        alphas, betas = list(attrs["alphas"]), list(attrs["betas"])
        return [_Act(n, a, b) for n, a, b in zip(names, alphas, betas)]
    # ONNX: the alpha/beta lists are consumed in order by the activations that take them
    # (as onnxruntime reads them); missing ones take the activation op's default
    alphas = list(attrs.get("activation_alpha") or [])
    betas = list(attrs.get("activation_beta") or [])
    acts = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{label}: unknown activation {name!r}; supported: "
                                        f"{sorted(_ACTIVATIONS)}", [])
        uses_a, uses_b, da, db = _ACTIVATIONS[key][:4]
        a = float(alphas.pop(0)) if uses_a and alphas else da
        b = float(betas.pop(0)) if uses_b and betas else db
        acts.append(_Act(key, a, b))
    return acts


def _spec(cell: str, attrs: dict, r_shape, label: str) -> Spec:
    """The spec of a node with these attributes and recurrence weight shape ``[D, G*H, H]``."""
    direction = attrs.get("direction", "forward")
    reverse = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(
        direction)
    if reverse is None:
        raise UnsupportedModelError(f"{label}: unknown direction {direction!r}", [])
    hidden = int(r_shape[-1])
    acts = _resolve_acts(cell, attrs, len(reverse), label)
    k = _N_ACTS[cell]
    clip = attrs.get("clip")
    return Spec(cell, hidden, reverse, int(attrs.get("layout", 0)),
                 tuple(tuple(acts[d * k:(d + 1) * k]) for d in range(len(reverse))),
                 float(clip) if clip is not None else 0.0,
                 bool(attrs.get("linear_before_reset", 0)), bool(attrs.get("input_forget", 0)))


def _cell_of(op_type: str) -> str:
    return op_type.removesuffix("Training").removesuffix("Grad")


def ctx_spec(ctx) -> Spec:
    return _spec(_cell_of(ctx.node.op_type), ctx.attrs, ctx.inputs[2].shape, ctx.node.label)


def _state_view(h, layout: int):
    """``[D, N, H]`` view of initial_h/Y_h/initial_c/Y_c (layout 1: ``[N, D, H]``)."""
    return h if h is None or layout == 0 else h.swapaxes(0, 1)


class _Order:
    """Processing order of one direction. ``make`` returns ``inv`` (rows past their sequence's
    end, [T, N, 1]; None without sequence_lens) and, flattened in step-major order, the row
    each (step, batch) reads or writes in X/gX and in Y/gY seen as 2-D ``[rows, last axis]``
    arrays (``_as_rows``), for ``np.take(..., out=)`` gathers and in-place scatters. The rows
    are in range by construction: gathers take ``mode="clip"``, as ``"raise"`` buffers the
    whole output (a copy of X per run)."""

    def __init__(self, ctx, sp: Spec, t: int, n: int):
        self.t, self.n, self.layout, self.dirs = t, n, sp.layout, len(sp.reverse)
        self.steps = np.arange(t).reshape(t, 1)
        self.ends = self.steps + 1
        self.rows = np.arange(n).reshape(1, n)
        self.tidx_ws, self.ix_ws, self.iy_ws = (ctx.workspace((t, n), np.int64)
                                                for _ in range(3))
        self.inv_ws = ctx.workspace((t, n, 1), np.bool_)
        self.masked = ctx.has_input(SEQ_LENS)

    def make(self, lens, reverse: bool, d: int, ws):
        """(inv, X rows, Y rows of direction ``d``) for this run's sequence lengths."""
        tidx, inv = ws[self.tidx_ws], ws[self.inv_ws]
        if not self.masked:
            np.copyto(tidx, self.steps[::-1] if reverse else self.steps)
            inv = None
        else:
            if lens.min() < 0 or lens.max() > self.t:  # the executor's error names the node
                raise ValueError(f"sequence_lens {lens.tolist()} outside [0, {self.t}] (the "
                                 f"sequence length of X)")
            np.greater_equal(self.steps, lens.reshape(1, -1), out=inv[..., 0])
            np.copyto(tidx, self.steps)
            if reverse:  # len - 1 - s inside the sequence, s past it (a permutation per row)
                np.subtract(lens.reshape(1, -1), self.ends, out=tidx, casting="unsafe")
                np.copyto(tidx, self.steps, where=inv[..., 0])
        return (inv, self._flat(tidx, 1, 0, ws[self.ix_ws]),
                self._flat(tidx, self.dirs, d, ws[self.iy_ws]))

    def _flat(self, tidx, dirs: int, d: int, out):
        """Row of (time tidx, batch n, direction d) in [T, D, N, ...] (layout 0) or
        [N, T, D, ...] (layout 1); X is the case D = 1."""
        if self.layout == 0:  # (t * D + d) * N + n
            np.multiply(tidx, dirs, out=out)
            np.add(out, d, out=out)
            np.multiply(out, self.n, out=out)
            np.add(out, self.rows, out=out)
        else:  # (n * T + t) * D + d
            np.multiply(self.rows, self.t, out=out)
            np.add(out, tidx, out=out)
            np.multiply(out, dirs, out=out)
            np.add(out, d, out=out)
        return out.reshape(-1)


def _as_rows(a):
    """``a`` as a 2-D ``[rows, last axis]`` view (a reshape that copied would lose writes)."""
    if not a.flags.c_contiguous:
        raise ValueError("recurrent kernels need compact inputs and outputs")
    return a.reshape(-1, a.shape[-1])


# ---- kernels ------------------------------------------------------------------------------------


def layer_dims(ctx, sp: Spec) -> tuple[int, int, int]:
    """(T, N, input size) of X."""
    shape = ctx.inputs[0].shape
    t, n = (shape[0], shape[1]) if sp.layout == 0 else (shape[1], shape[0])
    return t, n, shape[2]


def _workspaces(ctx, shapes: dict) -> dict:
    dtype = ctx.inputs[0].dtype
    return {k: ctx.workspace(s, dtype) for k, s in shapes.items()}


def _fold_biases(sp: Spec, bias, xp, b: _Buffers) -> None:
    """Add W's and R's biases to ``xp`` = X W^T, except GRU's Rbh under linear_before_reset,
    which stays inside the reset gate's product (``b.rbh``)."""
    h, gh = sp.hidden, sp.gates * sp.hidden
    b.rbh = b.zero[0]
    if bias is None:
        return
    np.add(xp, bias[:gh], out=xp)
    if sp.cell == "GRU" and sp.linear_before_reset:
        np.add(xp[..., :2 * h], bias[gh:gh + 2 * h], out=xp[..., :2 * h])
        b.rbh = bias[gh + 2 * h:]
    else:
        np.add(xp, bias[gh:], out=xp)


def recurrent_numpy(ctx):
    """LSTM / GRU / RNN forward (and their ai.tr_onnx training variants, which also write the
    saved rows as their last output). Outputs past a sequence's length are zero; Y_h/Y_c hold
    the state of its last valid step."""
    sp = ctx_spec(ctx)
    t, n, _ = layer_dims(ctx, sp)
    h, gh, dirs = sp.hidden, sp.gates * sp.hidden, len(sp.reverse)
    n_out, lstm = N_OUT[sp.cell], sp.cell == "LSTM"
    training = ctx.node.domain == INTERNAL_DOMAIN
    saved_ws = None if training else ctx.workspace((dirs, t, n, sp.width), ctx.inputs[0].dtype)
    order = _Order(ctx, sp, t, n)
    x_size = ctx.inputs[0].shape[2]
    ids = _workspaces(ctx, {"xp": (t, n, gh), "act": (n, gh), "t0": (n, h), "t1": (n, h),
                            "zero": (n, h), "y": (t, n, h), "xs": (t * n, x_size)})
    step = _CELLS[sp.cell][0]
    has = [ctx.has_input(i) for i in range(N_IN[sp.cell])]
    out = [ctx.has_output(i) for i in range(n_out)]

    def run(ins, outs, ws):
        b = _Buffers(ids, ws)
        b.zero.fill(0)
        x = _as_rows(ins[0])
        saved = outs[n_out] if training else ws[saved_ws]
        h0 = _state_view(ins[5], sp.layout) if has[5] else None
        c0 = _state_view(ins[6], sp.layout) if lstm and has[6] else None
        lens = ins[SEQ_LENS] if has[SEQ_LENS] else None
        with np.errstate(over="ignore"):  # exp overflow in a sigmoid is its limit, 0 or 1
            for d, reverse in enumerate(sp.reverse):
                inv, ix, iy = order.make(lens, reverse, d, ws)
                np.take(x, ix, axis=0, out=b.xs, mode="clip")  # X in processing order
                np.matmul(b.xs, ins[1][d].T, out=b.xp.reshape(t * n, gh))
                _fold_biases(sp, ins[3][d] if has[3] else None, b.xp, b)
                r, p = ins[2][d], ins[7][d] if lstm and has[7] else None
                hp = h0[d] if h0 is not None else b.zero
                cp = (c0[d] if c0 is not None else b.zero) if lstm else None
                gates, mid, hall = _rows(sp, saved[d], n)
                for s in range(t):
                    hs, cs = hall[s], mid[s] if lstm else None
                    step(sp, sp.acts[d], gates[s], mid[s] if mid is not None else None, hs,
                         b.xp[s], hp, cp, r, p, b)
                    if inv is not None:  # past the sequence's end: the state carries over
                        np.copyto(hs, hp, where=inv[s])
                        if lstm:
                            np.copyto(cs, cp, where=inv[s])
                    hp, cp = hs, cs
                if out[0]:
                    np.copyto(b.y, hall)
                    if inv is not None:
                        np.copyto(b.y, 0, where=inv)
                    _as_rows(outs[0])[iy] = b.y.reshape(t * n, h)
                if n_out > 1 and out[1]:
                    np.copyto(_state_view(outs[1], sp.layout)[d], hp)
                if lstm and out[2]:
                    np.copyto(_state_view(outs[2], sp.layout)[d], cp)

    return run


def recurrent_grad_numpy(ctx):
    """ai.tr_onnx LSTMGrad / GRUGrad / RNNGrad: backward through time over the whole layer.

    Inputs: the forward node's inputs (padded to all of them), its saved rows, then the
    gradients of its outputs (Y, Y_h[, Y_c]; absent where none flows). Outputs: gX, gW, gR,
    gB, g_initial_h[, g_initial_c, gP]. Per direction, the loop from the last step to the first
    turns dh/dc into the gate gradients (``gx`` [T, N, G*H]); gW, gR, gB and gX then come out of
    one matmul each over all steps."""
    sp = ctx_spec(ctx)
    t, n, _ = layer_dims(ctx, sp)
    h, gh, cell = sp.hidden, sp.gates * sp.hidden, sp.cell
    n_in, lstm, gru = N_IN[cell], cell == "LSTM", cell == "GRU"
    x_size = ctx.inputs[0].shape[2]
    shapes = {"gx": (t, n, gh), "hprev": (t, n, h), "act": (n, gh), "der": (n, gh),
              "t0": (n, h), "t1": (n, h), "dh": (n, h), "dc": (n, h), "keep_h": (n, h),
              "keep_c": (n, h), "gy": (t, n, h), "gxs": (t * n, x_size), "zero": (n, h),
              "xs": (t * n, x_size), "gxt": (t * n, x_size),
              "dp": (3 * h,), "hsum": (h,)}
    if lstm:
        shapes["cprev"] = (t, n, h)
    if gru:
        shapes.update(grh=(t, n, h), q=(t, n, h), gr3=(n, gh))
    ids = _workspaces(ctx, shapes)
    order = _Order(ctx, sp, t, n)
    step = _CELLS[cell][1]
    has = [ctx.has_input(i) for i in range(n_in + 1 + N_OUT[cell])]
    out = [ctx.has_output(i) for i in range(len(ctx.outputs))]
    g_y, g_yh, g_yc = n_in + 1, n_in + 2, n_in + 3

    def run(ins, outs, ws):
        b = _Buffers(ids, ws)
        b.zero.fill(0)
        x, saved = _as_rows(ins[0]), ins[n_in]
        lens = ins[SEQ_LENS] if has[SEQ_LENS] else None
        states = [_state_view(ins[i], sp.layout) if has[i] else None for i in (5, 6)[:1 + lstm]]
        gx_out = _as_rows(outs[0]) if out[0] else None
        for d, reverse in enumerate(sp.reverse):
            inv, ix, iy = order.make(lens, reverse, d, ws)
            gates, mid, hall = _rows(sp, saved[d], n)
            # the state before each step: the initial one, then each step's output
            for buf, state, steps in ((b.hprev, states[0], hall),
                                      *(((b.cprev, states[1], mid),) if lstm else ())):
                np.copyto(buf[0], state[d] if state is not None else b.zero)
                np.copyto(buf[1:], steps[:-1])
            gy = None
            if has[g_y]:
                gy = b.gy
                np.take(_as_rows(ins[g_y]), iy, axis=0, out=gy.reshape(t * n, h),
                        mode="clip")
                if inv is not None:  # Y is zero there: no gradient flows back
                    np.copyto(gy, 0, where=inv)
            for buf, i in ((b.dh, g_yh), (b.dc, g_yc)):
                src = _state_view(ins[i], sp.layout) if i < len(ins) and has[i] else None
                np.copyto(buf, src[d] if src is not None else b.zero)
            b.dp.fill(0)
            r, p = ins[2][d], ins[7][d] if lstm and has[7] else None
            with np.errstate(over="ignore"):
                for s in range(t - 1, -1, -1):
                    if gy is not None:
                        np.add(b.dh, gy[s], out=b.dh)
                    if inv is not None:  # rows past their end: dh/dc pass to the step before
                        for g_, keep in ((b.dh, b.keep_h), (b.dc, b.keep_c)):
                            np.multiply(g_, inv[s], out=keep)
                            np.copyto(g_, 0, where=inv[s])
                    step(sp, sp.acts[d], gates[s], mid[s] if mid is not None else None,
                         b.hprev[s], b.cprev[s] if lstm else None, b.dh, b.dc, b.gx[s], r, p,
                         b.dp, b, s)
                    if inv is not None:
                        np.add(b.dh, b.keep_h, out=b.dh)
                        np.add(b.dc, b.keep_c, out=b.dc)
            np.take(x, ix, axis=0, out=b.xs, mode="clip")
            _weight_grads(sp, ins, outs, out, d, ix, gx_out, b)
            if out[4]:
                np.copyto(_state_view(outs[4], sp.layout)[d], b.dh)
            if lstm and out[5]:
                np.copyto(_state_view(outs[5], sp.layout)[d], b.dc)
            if lstm and out[6]:
                np.copyto(outs[6][d], b.dp)

    return run


def _weight_grads(sp: Spec, ins, outs, out, d: int, ix, gx_out, b) -> None:
    """gX (scattered back to time order), gW, gR and gB of direction ``d`` from the gate
    gradients of every step (``b.gx``), each one matmul or sum over all steps."""
    t, n, gh = b.gx.shape
    h = sp.hidden
    gx2, hprev2 = b.gx.reshape(t * n, gh), b.hprev.reshape(t * n, h)
    if gx_out is not None:  # each direction's rows cover gX once: set, or add the second
        np.matmul(gx2, ins[1][d], out=b.gxs)
        if d == 0:
            gx_out[ix] = b.gxs
        else:
            b.gxt[ix] = b.gxs
            np.add(gx_out, b.gxt, out=gx_out)
    if out[1]:
        np.matmul(gx2.T, b.xs, out=outs[1][d])
    gru = sp.cell == "GRU"
    if out[2]:
        if gru:  # the candidate's recurrent product has its own operands (grh, q)
            np.matmul(gx2[:, :2 * h].T, hprev2, out=outs[2][d][:2 * h])
            np.matmul(b.grh.reshape(t * n, h).T, b.q.reshape(t * n, h),
                      out=outs[2][d][2 * h:])
        else:
            np.matmul(gx2.T, hprev2, out=outs[2][d])
    if out[3]:
        gb = outs[3][d]
        np.sum(gx2, axis=0, out=gb[:gh])
        if gru:
            np.sum(gx2[:, :2 * h], axis=0, out=gb[gh:gh + 2 * h])
            np.sum(b.grh.reshape(t * n, h), axis=0, out=gb[gh + 2 * h:])
        else:
            np.copyto(gb[gh:], gb[:gh])


# ---- gradient rule ------------------------------------------------------------------------------


def _node_spec(node) -> Spec:
    return _spec(_cell_of(node.op_type), node.attrs, node.inputs[2].shape, node.label)


def _save_for_backward(b, node, sp: Spec) -> Value:
    """Swap a standard LSTM/GRU/RNN node for its training variant (same inputs and outputs,
    plus the saved rows) and return the saved rows; a training node already has them."""
    n_out = N_OUT[sp.cell]
    if node.domain == INTERNAL_DOMAIN:
        return node.outputs[n_out]
    x = node.inputs[0]
    t, n = (x.shape[0], x.shape[1]) if sp.layout == 0 else (x.shape[1], x.shape[0])
    graph = b.graph
    saved = Value(graph.unique_name(f"{node.name}/saved_steps"),
                  (len(sp.reverse), t, n, sp.width), x.dtype)
    graph.values[saved.name] = saved
    op_type = f"{sp.cell}Training"
    opdef = b.registry.lookup(INTERNAL_DOMAIN, op_type, 1, b.backend)
    if opdef is None:
        raise UnsupportedModelError(f"{node.label}: training needs {INTERNAL_DOMAIN}.{op_type} for "
                                    f"backend {b.backend!r}, which is not registered", [])
    outputs = list(node.outputs) + [None] * (n_out - len(node.outputs)) + [saved]
    inputs = list(node.inputs) + [None] * (N_IN[sp.cell] - len(node.inputs))
    graph.replace_node(node, Node(node.name, op_type, INTERNAL_DOMAIN, 1, inputs, outputs,
                                  sp.attrs(), opdef, node.phase))
    return saved


def _grad_shapes(sp: Spec, inputs) -> list[tuple[tuple[int, ...], np.dtype]]:
    x, w, r = inputs[:3]
    t, n = (x.shape[0], x.shape[1]) if sp.layout == 0 else (x.shape[1], x.shape[0])
    dirs, h = len(sp.reverse), sp.hidden
    state = (dirs, n, h) if sp.layout == 0 else (n, dirs, h)
    shapes = [x.shape, w.shape, r.shape, (dirs, 2 * sp.gates * h), state]
    if sp.cell == "LSTM":
        shapes += [state, (dirs, 3 * h)]
    return [(tuple(s), x.dtype) for s in shapes]


def recurrent_vjp(b, node, gys, needed):
    """One named backward op for the layer (LSTMGrad/GRUGrad/RNNGrad), reading the rows the
    training variant of the forward node saved. sequence_lens gets no gradient."""
    sp = _node_spec(node)
    saved = _save_for_backward(b, node, sp)
    cell = sp.cell
    inputs = list(node.inputs) + [None] * (N_IN[cell] - len(node.inputs))
    gys = list(gys)[:N_OUT[cell]] + [None] * (N_OUT[cell] - len(gys))
    grads = b.op(f"{cell}Grad", inputs + [saved] + gys, sp.attrs(), domain=INTERNAL_DOMAIN,
                 shapes=_grad_shapes(sp, inputs))
    result = [None] * len(node.inputs)
    for position, g in zip(_GRAD_INPUTS[cell], grads):
        if position < len(node.inputs) and needed[position]:
            result[position] = g
    return result


def _training_shape(node, shapes, dtypes):
    """Shape rule of the training variants (a NodeProto of a model holding one): the standard
    outputs and the saved rows [D, T, N, S]."""
    attrs = {a.name: attribute_value(a) for a in node.attribute}
    sp = _spec(_cell_of(node.op_type), attrs, shapes[2], node.name)
    x = shapes[0]
    t, n = (x[0], x[1]) if sp.layout == 0 else (x[1], x[0])
    dirs, h = len(sp.reverse), sp.hidden
    state = (dirs, n, h) if sp.layout == 0 else (n, dirs, h)
    y = (t, dirs, n, h) if sp.layout == 0 else (n, t, dirs, h)
    outs = [y, state] + ([state] if sp.cell == "LSTM" else [])
    return [(s, dtypes[0]) for s in outs] + [((dirs, t, n, sp.width), dtypes[0])]


# ---- registration -------------------------------------------------------------------------------

_DOCS = {
    "LSTM": "one LSTM layer (gates i,o,f,c; peepholes; input_forget); backward through time "
            "as ai.tr_onnx LSTMGrad",
    "GRU": "one GRU layer (gates z,r,h; linear_before_reset); backward through time as "
           "ai.tr_onnx GRUGrad",
    "RNN": "one simple RNN layer; backward through time as ai.tr_onnx RNNGrad",
}
_VERSIONS = {"LSTM": (1, 7, 14, 22), "GRU": (1, 3, 7, 14, 22), "RNN": (1, 7, 14, 22)}
_PARAMS = {"LSTM": (1, 2, 3, 7), "GRU": (1, 2, 3), "RNN": (1, 2, 3)}


@hookimpl
def tr_onnx_op_definitions():
    defs = []
    for cell in ("LSTM", "GRU", "RNN"):
        defs += [
            OpDef(cell, _VERSIONS[cell], {"numpy": recurrent_numpy}, layout=PLAIN_ONLY,
                  differentiable=True, gradient=recurrent_vjp, grad_inputs=_GRAD_INPUTS[cell],
                  param_inputs=_PARAMS[cell], doc=_DOCS[cell]),
            OpDef(f"{cell}Training", (1,), {"numpy": recurrent_numpy}, domain=INTERNAL_DOMAIN,
                  layout=PLAIN_ONLY, shape=_training_shape, differentiable=True,
                  gradient=recurrent_vjp, grad_inputs=_GRAD_INPUTS[cell],
                  doc=f"{cell} that also outputs each step's gates and states for {cell}Grad"),
            OpDef(f"{cell}Grad", (1,), {"numpy": recurrent_grad_numpy}, domain=INTERNAL_DOMAIN,
                  layout=PLAIN_ONLY, doc=f"backward through time of one {cell} layer"),
        ]
    return defs
