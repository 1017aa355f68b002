"""cuda bindings of ``ops/attention.py``: RMSNormalization / RMSNormalizationGrad, Swish,
RotaryEmbedding / RotaryEmbeddingGrad, Attention / AttentionGrad (``kernels/attention.cu``).

Attention runs a kernel of our own, one thread per query row: it covers every form the NumPy
kernel does (causal and window frontiers, boolean and float masks, nonpad_kv_seqlen, softcap,
grouped key/value heads, past/present key and value, qk_matmul_output modes 0-3). The
gradient recomputes the probabilities, as the NumPy kernel does: a row kernel writes P and
the scores' gradient gS into fp32 scratch [batch, q_heads, q, total] (and gQ), a second
kernel sums them into gK and gV per key/value head, a third reduces the float mask's
gradient. Swish's gradient rule is standard ops (Sigmoid, Mul, Add, Sub), bound elsewhere.

cuDNN's SDPA graph (``describe_sdpa``) takes the forms it can compute -- fp16/bf16, head sizes
multiples of 8, no softcap, no boolean or short mask, no past key/value, nonpad_kv_seqlen or
window, Y alone (``sdpa_refusal``) -- but only where ``TR_ONNX_CUDNN_SDPA=1`` asks for it
(``SDPA_ENV``): no SDPA plan has been checked without a GPU, since deviceless cuDNN (9.19,
9.28) validates and lowers the graph, then its heuristics ask for the device. The node's
bound calls say which ran: a ``CudnnCall`` of kind ``sdpa``, or the ``tr_attention_fwd_<dt>``
launch.
"""

from __future__ import annotations

import math
import os
from functools import partial

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ....ops.attention import attention_form, attention_spec
from ..bind import (
    BindContext,
    Unbound,
    binding,
    contiguous_strides,
    cudnn_workspace,
    f32,
    float_dt,
    i32,
    i64,
    need_compact,
    same_layout,
)
from ..cudnn_graphs import CudnnGraphError, GraphDesc, PlanIndex, ScalarDesc
from ..sources import STORAGE, KernelSource, instantiate, kernel_source

# ---- kernels/attention.cu: the family's name table ------------------------------------------


def attention_source() -> KernelSource:
    """kernels/attention.cu: RMSNormalization (forward, backward), Swish, RotaryEmbedding
    (and its inverse), Attention (forward, present key/value, backward)."""
    return kernel_source(
        "attention",
        instantiate("TR_RMS_NORM({T}, {dt})", (
            "tr_rms_norm_fwd_{dt}", "tr_rms_norm_bwd_dx_{dt}", "tr_rms_norm_bwd_scale_{dt}",
            "tr_swish_{dt}"), STORAGE),
        instantiate("TR_ROTARY({T}, {dt})", "tr_rotary_{dt}", STORAGE),
        instantiate("TR_ATTENTION({T}, {dt})", (
            "tr_attention_fwd_{dt}", "tr_attention_present_{dt}", "tr_attention_bwd_rows_{dt}",
            "tr_attention_bwd_kv_{dt}", "tr_attention_bwd_mask_{dt}"), STORAGE))


KERNELS = attention_source()

MAX_HEAD = 256
"""Head sizes a query row's accumulators hold (``TR_ATTENTION_MAX_HEAD``)."""


def _at(seq, i: int):
    return seq[i] if i < len(seq) else None


# ---- RMSNormalization -----------------------------------------------------------------------


def _rms_rows(b: BindContext, node, x, scale) -> tuple[int, int, int]:
    """(rows, row length m, the scale's period sp inside a row): the scale's shape, less its
    leading ones, must be a suffix of the normalised axes."""
    shape = b.t(x).shape
    axis = int(node.attrs["axis"]) % len(shape)
    s_shape = list(b.t(scale).shape)
    while s_shape and s_shape[0] == 1:
        s_shape.pop(0)
    normalised = list(shape[axis:])
    if len(s_shape) > len(normalised) or normalised[len(normalised) - len(s_shape):] != s_shape:
        raise Unbound(f"a scale of shape {list(b.t(scale).shape)} that varies outside the "
                      f"normalised axes {normalised}")
    return math.prod(shape[:axis]), math.prod(normalised), math.prod(s_shape)


def _stash_float32(node) -> None:
    if int(node.attrs.get("stash_type", 1)) != 1:
        raise Unbound("stash_type other than float32")


def bind_rms_norm(b: BindContext, node) -> list:
    """y = round(x / rms(x)) * scale per row, one thread per row."""
    x, scale, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, x, scale, y)
    _stash_float32(node)
    rows, m, sp = _rms_rows(b, node, x, scale)
    dt = float_dt(b, x, scale, y)
    return [b.launch(f"tr_rms_norm_fwd_{dt}", rows,
                     [b.buf(x), b.buf(scale), b.buf(y, True), i64(rows), i64(m), i64(sp),
                      f32(float(node.attrs["epsilon"]))])]


def rms_norm_grad_factory(ctx: KernelContext):
    """RMSNormalizationGrad: the dx kernel writes each row's 1 / rms into float32 scratch,
    which the scale's gradient kernel reads."""
    shape = ctx.inputs[1].shape
    axis = int(ctx.attrs["axis"]) % len(shape)
    inv_ws = ctx.workspace((max(1, math.prod(shape[:axis])),), np.float32)

    def bind(b: BindContext, node) -> list:
        gy, x, scale = node.inputs[:3]
        gx, gscale = (list(node.outputs) + [None, None])[:2]
        need_compact(b, gy, x, scale, gx, gscale)
        rows, m, sp = _rms_rows(b, node, x, scale)
        dt = float_dt(b, gy, x, scale, gx, gscale)
        calls = [b.launch(f"tr_rms_norm_bwd_dx_{dt}", rows,
                          [b.buf(gy), b.buf(x), b.buf(scale), b.buf(gx, True), b.ws(inv_ws),
                           i64(rows), i64(m), i64(sp), f32(float(node.attrs["epsilon"]))])]
        if gscale is not None:
            calls.append(b.launch(f"tr_rms_norm_bwd_scale_{dt}", sp,
                                  [b.buf(gy), b.buf(x), b.ws(inv_ws, writes=False),
                                   b.buf(gscale, True), i64(rows), i64(m), i64(sp)]))
        return calls

    return bind


# ---- Swish ----------------------------------------------------------------------------------


def bind_swish(b: BindContext, node) -> list:
    """x * sigmoid(alpha x) over any one layout: swish(0) = 0 keeps padded lanes zero. alpha
    is rounded to the storage type, as the NumPy kernel's ``dtype.type(alpha)``."""
    x, y = node.inputs[0], node.outputs[0]
    g = same_layout(b, x, y)
    dt = float_dt(b, x, y)
    alpha = float(b.t(y).dtype.type(float(node.attrs["alpha"])))
    return [b.launch(f"tr_swish_{dt}", g.n, [b.buf(x), b.buf(y, True), i64(g.n), f32(alpha)])]


# ---- RotaryEmbedding ------------------------------------------------------------------------


def _rotary(b: BindContext, node, inverse: bool) -> list:
    """RotaryEmbedding (``inverse``: its gradient) on a 3-D [b, s, heads * d] or 4-D
    [b, heads, s, d] input: one thread per element."""
    x, cos, sin = node.inputs[:3]
    pos = _at(node.inputs, 3)
    y = node.outputs[0]
    need_compact(b, x, cos, sin, pos, y)
    shape = b.t(x).shape
    if len(shape) == 3:
        heads = int(node.attrs.get("num_heads", 0) or 0)
        if not heads or shape[2] % heads:
            raise Unbound(f"a 3-D input of hidden size {shape[2]} needs num_heads dividing it")
        n, s, d = shape[0], shape[1], shape[2] // heads
        strides = (s * heads * d, heads * d, d)
    else:
        n, heads, s, d = shape
        strides = (heads * s * d, d, s * d)
    rot = int(node.attrs.get("rotary_embedding_dim", 0) or 0) or d
    if rot % 2 or rot > d:
        raise Unbound(f"rotary_embedding_dim {rot} must be even and at most the head size {d}")
    if pos is not None and b.t(pos).dtype != np.int64:
        raise Unbound("position_ids must be int64")
    # the [batch, seq] index of a cache row (position_ids, or the caches' own leading axes):
    # an axis of length 1 broadcasts (exporters give [1, seq, rot / 2] caches)
    index = tuple(b.t(pos).shape) if pos is not None else tuple(b.t(cos).shape[:-1])
    if len(index) != 2 or index[0] not in (1, n) or index[1] not in (1, s):
        raise Unbound(f"a cache row index of shape {list(index)} does not broadcast to "
                      f"[{n}, {s}]")
    rows = (0 if index[0] == 1 else index[1], 0 if index[1] == 1 else 1)
    dt = float_dt(b, x, cos, sin, y)
    return [b.launch(f"tr_rotary_{dt}", n * s * heads * d, [
        b.buf(x), b.buf(cos), b.buf(sin), b.buf(pos), b.buf(y, True), i64(n), i64(s),
        i64(heads), i64(d), i64(rot), *(i64(v) for v in strides), *(i64(v) for v in rows),
        i32(int(node.attrs.get("interleaved", 0) or 0)), i32(int(inverse))])]


def bind_rotary(b: BindContext, node) -> list:
    return _rotary(b, node, False)


def bind_rotary_grad(b: BindContext, node) -> list:
    return _rotary(b, node, True)


# ---- Attention ------------------------------------------------------------------------------


def _heads_strides(shape, rank3: bool, heads: int) -> tuple[int, int, int]:
    """(batch, head, seq) element strides of a [b, heads, seq, size] tensor or of the
    [b, seq, heads * size] one viewed so."""
    if rank3:
        _, s, hd = shape
        return s * hd, hd // heads, hd
    _, h, s, size = shape
    return h * s * size, s * size, size


class _Form:
    """An Attention (``first`` = 0) or AttentionGrad (``first`` = 1: gY first) node's geometry,
    and the kernels' shared argument tail."""

    def __init__(self, b: BindContext, node, first: int):
        ins = list(node.inputs) + [None] * (7 + first - len(node.inputs))
        self.q, self.k, self.v, self.mask, self.past_k, self.past_v, self.nonpad = \
            ins[first:first + 7]
        shapes = [None if v is None else tuple(b.t(v).shape)
                  for v in (self.q, self.k, self.v, self.mask, self.past_k)]
        self.sp = sp = attention_form(node.attrs, shapes, b.t(self.q).dtype, Unbound)
        if sp.soft != sp.acc:
            raise Unbound("a softmax_precision wider than float32")
        if max(sp.d, sp.dv) > MAX_HEAD:
            raise Unbound(f"head sizes {sp.d}, {sp.dv}: the row kernel holds {MAX_HEAD}")
        if self.nonpad is not None and (self.past_k is not None or
                                        b.t(self.nonpad).dtype != np.int64):
            raise Unbound("nonpad_kv_seqlen must be int64 and without past key/value")
        need_compact(b, *ins)
        self.mask_args = self._mask(b)

    def _mask(self, b: BindContext) -> list:
        sp, mask = self.sp, self.mask
        if mask is None:
            return [i64(sp.t), i64(0), i64(0), i64(0)]
        shape = tuple(b.t(mask).shape)
        full = (1,) * (4 - len(shape)) + shape
        if len(shape) > 4 or full[3] > sp.t or any(
                m not in (1, s) for m, s in zip(full[:3], (sp.b, sp.hq, sp.sq))):
            raise Unbound(f"attn_mask of shape {list(shape)} does not broadcast to "
                          f"{[sp.b, sp.hq, sp.sq, sp.t]}")
        strides = [full[1] * full[2] * full[3], full[2] * full[3], full[3]]
        return [i64(full[3])] + [i64(0 if full[a] == 1 else strides[a]) for a in range(3)]

    def masks(self, b: BindContext) -> list:
        """The float and boolean mask pointers (one of them null) and nonpad_kv_seqlen."""
        mask = self.mask
        boolean = mask is not None and b.t(mask).dtype == np.bool_
        if mask is not None and not boolean:
            float_dt(b, mask, self.q)  # a float mask is Q's dtype
        return [None if boolean else b.buf(mask), b.buf(mask) if boolean else None,
                b.buf(self.nonpad)]

    def shape_args(self, b: BindContext, y) -> list:
        sp = self.sp
        return [i64(v) for v in (
            sp.b, sp.hq, sp.hkv, sp.sq, sp.past, sp.t, sp.d, sp.dv,
            *_heads_strides(b.t(self.q).shape, sp.rank3, sp.hq),
            *_heads_strides(b.t(self.k).shape, sp.rank3, sp.hkv),
            *_heads_strides(b.t(self.v).shape, sp.rank3, sp.hkv),
            *_heads_strides(b.t(y).shape, sp.rank3, sp.hq))]

    def tail(self) -> list:
        sp = self.sp
        return [*self.mask_args, f32(sp.scale), f32(sp.softcap), i32(int(sp.causal)),
                i64(sp.left), i64(sp.right), i32(sp.mode)]


SDPA_ENV = "TR_ONNX_CUDNN_SDPA"
"""Set to 1 (when a plan is made): an Attention / AttentionGrad node of a form cuDNN's SDPA
computes runs its graphs (``describe_sdpa``; ``describe_sdpa_backward`` after a forward graph
that writes O and the softmax statistics into the node's scratch), the row kernels where
cuDNN builds none. Off by default: on a CPU, cuDNN 9.19 and 9.28 in deviceless mode validate
and lower these graphs, then decline at ``create_execution_plans`` ("cuda_get_device(&device)
failed with CUDA driver version is insufficient for CUDA runtime version"), so no SDPA plan
is checked without a GPU."""


PATH_NOTES = {op: f"cuDNN's SDPA instead where {SDPA_ENV}=1 and the form fits: fp16/bf16, head "
                  "sizes multiples of 8, no softcap, boolean or short mask, past or window"
              for op in ("Attention", "AttentionGrad")}
"""Why a node of these ops ran the row kernels (``tr-onnx inspect --backend cuda``)."""


def _sdpa_asked() -> bool:
    return os.environ.get(SDPA_ENV, "") not in ("", "0")


def sdpa_refusal(b: BindContext, node, f: _Form) -> str | None:
    """Why cuDNN's SDPA graphs do not compute this Attention (AttentionGrad) node (None: they
    do)."""
    sp = f.sp
    if b.t(f.q).dtype.name not in ("float16", "bfloat16"):
        return "SDPA takes fp16 / bf16"
    if sp.softcap > 0:
        return "softcap"
    if sp.d % 8 or sp.dv % 8:
        return f"head sizes {sp.d}, {sp.dv}: cuDNN's validate wants multiples of 8"
    if f.past_k is not None or f.nonpad is not None or sp.left >= 0 or sp.right >= 0:
        return "past key / value, nonpad_kv_seqlen or a window"
    if f.mask is not None and (b.t(f.mask).dtype == np.bool_ or b.t(f.mask).shape[-1] != sp.t):
        return "a boolean mask, or one shorter than the keys"
    extra = node.outputs[1:] if node.domain != INTERNAL_DOMAIN else node.inputs[8:]
    if any(v is not None for v in extra) or int(node.attrs.get("mask_grad", 0)):
        return ("present key / value, qk_matmul_output (or their gradients) or the mask's "
                "gradient")
    return None


def _bhsd(t, rank3: bool, heads: int) -> tuple[tuple, tuple]:
    """cuDNN's [b, heads, seq, size] dims and element strides of a compact 4-D tensor, or of a
    3-D [b, seq, heads * size] one (BSHD)."""
    if rank3:
        n, s, hd = t.shape
        return (n, heads, s, hd // heads), (s * hd, hd // heads, hd, 1)
    return tuple(t.shape), tuple(contiguous_strides(t.shape))


def _sdpa_ops(g, desc: GraphDesc, ins: dict, scalars: dict, causal: bool) -> dict:
    bias = {"bias": ins["bias"]} if "bias" in ins else {}
    o, stats = g.sdpa(ins["q"], ins["k"], ins["v"], generate_stats="Stats" in desc.outputs,
                      attn_scale=scalars["attn_scale"], use_causal_mask=causal, name="sdpa",
                      **bias)
    return {"O": o, "Stats": stats}


def _sdpa_backward_ops(g, desc: GraphDesc, ins: dict, scalars: dict, causal: bool) -> dict:
    bias = {"bias": ins["bias"]} if "bias" in ins else {}
    dq, dk, dv = g.sdpa_backward(ins["q"], ins["k"], ins["v"], ins["o"], ins["dO"],
                                 ins["stats"], attn_scale=scalars["attn_scale"],
                                 use_causal_mask=causal, name="sdpa_backward", **bias)
    return {"dQ": dq, "dK": dk, "dV": dv}


def _sdpa_inputs(node, plan, first: int):
    """(spec, plan index, the q / k / v [/ bias] tensors) of an Attention (``first`` 0) or
    AttentionGrad (1) node: the float mask is the graph's additive bias (dims 1 on its
    broadcast axes)."""
    t = plan.tensors
    q, k, v = (t[x.name] for x in node.inputs[first:first + 3])
    m = node.inputs[first + 3] if len(node.inputs) > first + 3 else None
    mask = t[m.name] if m is not None else None
    shapes = [q.shape, k.shape, v.shape, None if mask is None else mask.shape, None]
    sp = attention_form(node.attrs, shapes, q.dtype, CudnnGraphError)
    index = PlanIndex(plan)
    ins = {port: index.tensor(x, port, *_bhsd(x, sp.rank3, heads), node.label)
           for port, x, heads in (("q", q, sp.hq), ("k", k, sp.hkv), ("v", v, sp.hkv))}
    if mask is not None:
        full = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        ins["bias"] = index.tensor(mask, "bias", full, contiguous_strides(full), node.label)
    return sp, index, ins


def _sdpa_desc(kind: str, node, sp, ins: dict, outs: dict, workspace, build) -> GraphDesc:
    """The scale is the NumPy kernel's (the square of the attribute's float32 root); causal is
    the top-left diagonal (no past: key j is hidden from query i past i)."""
    return GraphDesc(kind, node.label, ins["q"].data_type, ins, outs,
                     scalars={"attn_scale": ScalarDesc("attn_scale", sp.scale)},
                     workspace=workspace, build=partial(build, causal=sp.causal))


def describe_sdpa(node, plan, workspace: tuple[int, int], o=None, stats=None) -> GraphDesc:
    """Attention(Q, K, V[, float mask]) -> Y as cuDNN's SDPA (grouped key/value heads as K / V
    head counts dividing Q's); for AttentionGrad, ``o`` and ``stats``: its scratch DTensors
    that take O [b, q_heads, q, dv] and the softmax statistics [b, q_heads, q, 1] (float32)."""
    grad = o is not None
    sp, index, ins = _sdpa_inputs(node, plan, int(grad))
    if grad:
        outs = {"O": index.tensor(o, "O", *_bhsd(o, False, sp.hq), node.label),
                "Stats": index.tensor(stats, "Stats", stats.shape,
                                      contiguous_strides(stats.shape), node.label)}
    else:
        y = plan.tensors[node.outputs[0].name]
        outs = {"O": index.tensor(y, "O", *_bhsd(y, sp.rank3, sp.hq), node.label)}
    return _sdpa_desc("sdpa", node, sp, ins, outs, workspace, _sdpa_ops)


def describe_sdpa_backward(node, plan, workspace: tuple[int, int], o, stats) -> GraphDesc:
    """AttentionGrad's gQ, gK, gV as cuDNN's SDPA backward, from the forward graph's O and
    statistics in the node's scratch (``o``, ``stats``) and gY."""
    sp, index, ins = _sdpa_inputs(node, plan, 1)
    t = plan.tensors
    gy = t[node.inputs[0].name]
    ins.update(o=index.tensor(o, "o", *_bhsd(o, False, sp.hq), node.label),
               dO=index.tensor(gy, "dO", *_bhsd(gy, sp.rank3, sp.hq), node.label),
               stats=index.tensor(stats, "stats", stats.shape, contiguous_strides(stats.shape),
                                  node.label))
    outs = {port: index.tensor(t[v.name], port, *_bhsd(t[v.name], sp.rank3, heads), node.label)
            for port, v, heads in (("dQ", node.outputs[0], sp.hq), ("dK", node.outputs[1], sp.hkv),
                                   ("dV", node.outputs[2], sp.hkv))}
    return _sdpa_desc("sdpa_backward", node, sp, ins, outs, workspace, _sdpa_backward_ops)


def attention_factory(ctx: KernelContext):
    """Attention: cuDNN's SDPA where ``SDPA_ENV`` asks for it and the form fits (its workspace
    reserved then), else the row kernel."""
    k = cudnn_workspace(ctx) if _sdpa_asked() else None

    def bind(b: BindContext, node) -> list:
        f = _Form(b, node, 0)
        if k is not None and sdpa_refusal(b, node, f) is None:
            try:
                return b.cudnn(node, k, describe=describe_sdpa)
            except Unbound:
                pass  # cuDNN builds no SDPA plan for it here: the row kernel
        return bind_attention(b, node, f)

    return bind


def bind_attention(b: BindContext, node, f: _Form) -> list:
    """Y (and qk_matmul_output) by the row kernel; present key / value by the copy kernel."""
    y, present_k, present_v, qk = (list(node.outputs) + [None] * 4)[:4]
    need_compact(b, y, present_k, present_v, qk)
    dt = float_dt(b, y, f.q, present_k, present_v, qk)
    sp = f.sp
    calls = [b.launch(f"tr_attention_fwd_{dt}", sp.b * sp.hq * sp.sq, [
        b.buf(f.q), b.buf(f.k), b.buf(f.v), b.buf(f.past_k), b.buf(f.past_v), *f.masks(b),
        b.buf(y, True), b.buf(qk, True), *f.shape_args(b, y), *f.tail()])]
    for out, past, new, size in ((present_k, f.past_k, f.k, sp.d), (present_v, f.past_v, f.v,
                                                                     sp.dv)):
        if out is not None:
            calls.append(b.launch(f"tr_attention_present_{dt}", sp.b * sp.hkv * sp.t * size, [
                b.buf(past), b.buf(new), b.buf(out, True), i64(sp.b), i64(sp.hkv),
                i64(sp.past), i64(sp.t), i64(size),
                *(i64(v) for v in _heads_strides(b.t(new).shape, sp.rank3, sp.hkv))]))
    return calls


def attention_grad_factory(ctx: KernelContext):
    """AttentionGrad: fp32 scratch of P and gS (and gZ for a float mask's gradient), each
    [batch, q_heads, q, total], for the row kernels; where ``SDPA_ENV`` asks for cuDNN's
    graphs, their workspace and scratch for the forward's O (Q's dtype) and statistics too."""
    sp = attention_spec(ctx, 1)
    rows = (sp.b * sp.hq * sp.sq * sp.t,)
    p_ws, gs_ws = ctx.workspace(rows, np.float32), ctx.workspace(rows, np.float32)
    gz_ws = ctx.workspace(rows, np.float32) if int(ctx.attrs.get("mask_grad", 0)) else None
    sdpa = None
    if _sdpa_asked():
        sdpa = (cudnn_workspace(ctx),
                ctx.workspace((sp.b, sp.hq, sp.sq, sp.dv), ctx.inputs[1].dtype),
                ctx.workspace((sp.b, sp.hq, sp.sq, 1), np.float32))

    def bind(b: BindContext, node) -> list:
        f = _Form(b, node, 1)
        if sdpa is not None and sdpa_refusal(b, node, f) is None:
            k, o, stats = sdpa[0], b.workspaces[sdpa[1]], b.workspaces[sdpa[2]]
            try:
                return (b.cudnn(node, k, describe=partial(describe_sdpa, o=o, stats=stats))
                        + b.cudnn(node, k, describe=partial(describe_sdpa_backward, o=o,
                                                            stats=stats)))
            except Unbound:
                pass  # cuDNN builds no SDPA plans for it here: the row kernels
        return bind_attention_grad(b, node, f, p_ws, gs_ws, gz_ws)

    return bind


def bind_attention_grad(b: BindContext, node, f: _Form, p_ws: int, gs_ws: int,
                        gz_ws: int | None) -> list:
    """gQ (and P, gS) per query row; gK, gV (past and new keys) per key element; the float
    mask's gradient per mask element."""
    sp = f.sp
    gy = node.inputs[0]
    g_present_k, g_present_v, g_qk = (list(node.inputs[8:]) + [None] * 3)[:3]
    past = int(node.attrs.get("past", 0))
    outs = list(node.outputs) + [None] * 6
    gq, gk, gv = outs[:3]
    g_past_k, g_past_v = outs[3:5] if past else (None, None)
    g_mask = outs[5 if past else 3] if gz_ws is not None else None
    need_compact(b, gy, g_present_k, g_present_v, g_qk, *outs)
    dt = float_dt(b, gy, f.q, gq, gk, gv, g_past_k, g_past_v, g_present_k, g_present_v, g_qk)
    shape = f.shape_args(b, gy)
    p, gs = b.ws(p_ws), b.ws(gs_ws)
    gz = b.ws(gz_ws) if gz_ws is not None else None
    calls = [b.launch(f"tr_attention_bwd_rows_{dt}", sp.b * sp.hq * sp.sq, [
        b.buf(gy), b.buf(f.q), b.buf(f.k), b.buf(f.v), b.buf(f.past_k), b.buf(f.past_v),
        *f.masks(b), b.buf(g_qk), b.buf(gq, True), p, gs, gz, *shape, *f.tail()]),
        b.launch(f"tr_attention_bwd_kv_{dt}", sp.b * sp.hkv * sp.t * (sp.d + sp.dv), [
            b.buf(f.q), b.buf(gy), b.ws(p_ws, writes=False), b.ws(gs_ws, writes=False),
            b.buf(g_present_k), b.buf(g_present_v), b.buf(gk, True), b.buf(gv, True),
            b.buf(g_past_k, True), b.buf(g_past_v, True), *shape])]
    if g_mask is not None:
        full = (1,) * (4 - len(b.t(f.mask).shape)) + tuple(b.t(f.mask).shape)
        calls.append(b.launch(f"tr_attention_bwd_mask_{float_dt(b, g_mask)}", math.prod(full), [
            b.ws(gz_ws, writes=False), b.buf(g_mask, True), *(i64(m) for m in full),
            i64(sp.b), i64(sp.hq), i64(sp.sq), i64(full[3]), i64(sp.t)]))
    return calls


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("RMSNormalization", "cuda", binding(bind_rms_norm)),
            KernelDef("RMSNormalizationGrad", "cuda", rms_norm_grad_factory,
                      domain=INTERNAL_DOMAIN),
            KernelDef("Swish", "cuda", binding(bind_swish)),
            KernelDef("RotaryEmbedding", "cuda", binding(bind_rotary)),
            KernelDef("RotaryEmbeddingGrad", "cuda", binding(bind_rotary_grad),
                      domain=INTERNAL_DOMAIN),
            KernelDef("Attention", "cuda", attention_factory),
            KernelDef("AttentionGrad", "cuda", attention_grad_factory, domain=INTERNAL_DOMAIN)]
