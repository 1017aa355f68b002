"""cuda bindings of ``ops/optimizers.py``: gradient accumulation, the running-statistics commit
(Assign), ZeroFill, ScaleClipGrad (loss-scale unscaling, global norm, clipping), the fused
optimizer updates over the flat PARAM span and its GRAD / OPT_STATE mirrors
(``kernels/optimizers.cu``), the training step's loss scaling and guard: LossScaleUpdate,
StepCheck, StepAdvance, StepReport (``kernels/amp.cu``), and the ONNX training ops
(``ai.onnx.preview.training`` Adam, Momentum, Adagrad) as nodes of a user's model.

Every flag these ops skip or set on is a declared input of the node (``ops/optimizers.py``):
the bindings read the node, never a name. A guarded step (``train_pass.add_step_guard``) runs
as one graph: the commits and the update skip themselves on the device when the batch was bad.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....ir import Node, Value
from ....opdef import KernelContext, KernelDef
from ....ops.optimizers import PREVIEW, UPDATE_STATES
from ..bind import (
    DT,
    BindContext,
    Copy,
    Unbound,
    binding,
    f64,
    geometry,
    i32,
    i64,
    need_compact,
    operand_spec,
    operand_specs,
    out_geometry,
)
from ..capture import DeviceBuffer
from ..device import BLOCK
from ..nccl import NCCL_MAX, nccl_dtype, node_all_reduce
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain

# ---- kernels/optimizers.cu and kernels/amp.cu: the families' name tables ------------------------

def optimizers_source() -> KernelSource:
    """kernels/optimizers.cu: the fused SGD / Adam(W) / Adagrad updates and ScaleClipGrad."""
    return kernel_source(
        "optimizers",
        instantiate("TR_OPTIM({T}, {dt})", ("tr_sgd_{dt}", "tr_adam_{dt}", "tr_adagrad_{dt}"),
                    STORAGE),
        instantiate("TR_SCALE_CLIP_NORM({T}, {dt})",
                    ("tr_scale_clip_norm_{dt}", "tr_scale_clip_norm_apply_{dt}"), STORAGE),
        plain("tr_scale_clip_norm_total", "tr_preview_adam_f32", "tr_preview_momentum_f32",
              "tr_preview_adagrad_f32"))


def amp_source() -> KernelSource:
    """kernels/amp.cu: dynamic loss scaling and the one-graph step's guard."""
    return kernel_source(
        "amp",
        instantiate("TR_UNSCALE_CHECK({T}, {dt})", "tr_unscale_check_{dt}", STORAGE),
        instantiate("TR_POISON_NONFINITE({T}, {dt})", "tr_poison_nonfinite_{dt}", STORAGE),
        plain("tr_step_advance", "tr_loss_scale_update", "tr_flag_or", "tr_copy_unless_b4",
              "tr_zero_if_b4", "tr_step_check", "tr_step_report"))



KERNELS = (optimizers_source(), amp_source())


def _input(node: Node, k: int) -> Value | None:
    return node.inputs[k] if k < len(node.inputs) else None


def _flag(b: BindContext, v: Value | None, writes: bool = False) -> DeviceBuffer | None:
    """A float32 flag input's pointer (None when absent)."""
    if v is None:
        return None
    if b.t(v).dtype != np.float32 or math.prod(b.t(v).shape) != 1:
        raise Unbound(f"{v.name!r} must be a float32 scalar flag")
    return b.buf(v, writes)


def _words(b: BindContext, v: Value) -> int:
    nbytes = b.t(v).nbytes
    if nbytes % 4:
        raise Unbound(f"{v.name!r} is {nbytes} bytes, not whole 4-byte words")
    return nbytes // 4


def bind_accumulate(b: BindContext, node) -> list:
    """acc += g, in place (ins[0] is both read and written)."""
    acc, g = node.inputs[0], node.inputs[1]
    dt = b.dt(acc)
    if b.dt(g) != dt:
        raise Unbound(f"accumulator {b.t(acc).dtype}, gradient {b.t(g).dtype}")
    out = out_geometry(b, acc)
    specs, (m, c, s, cp) = operand_specs(b, [acc, g], out)
    if specs[1] == 1 and out.n != 1:
        raise Unbound("a scalar gradient broadcast into an accumulator")
    return [b.launch(f"tr_add_mixed_{dt}", out.n,
                     [b.buf(acc, True), b.buf(g), b.buf(acc, True), i64(out.n),
                      i64(specs[0]), i64(specs[1]), i64(m), i64(c), i64(s), i64(cp)])]


def bind_assign(b: BindContext, node) -> list:
    """target = value; with a ``skip`` flag (input 2), a copy the device skips when set."""
    target, value = node.inputs[0], node.inputs[1]
    tt, tv = b.t(target), b.t(value)
    gt, gv = geometry(tt), geometry(tv)
    if gt is None or gv is None or tt.dtype != tv.dtype or operand_spec(tv, gv, gt) != gt.n:
        raise Unbound(f"assigning {tv.layout.describe()} {tv.dtype} to "
                      f"{tt.layout.describe()} {tt.dtype}")
    nbytes = gt.n * tt.dtype.itemsize
    dst, src = b.tensor_buf(tt, True, nbytes), b.tensor_buf(tv, False, nbytes)
    skip = _flag(b, _input(node, 2))
    if skip is None:
        return [Copy(dst, src)]
    if nbytes % 4:
        raise Unbound(f"a guarded assignment copies 4-byte words, not {nbytes} bytes")
    return [b.launch("tr_copy_unless_b4", nbytes // 4, [dst, src, i64(nbytes // 4), skip])]


def bind_zero_fill(b: BindContext, node) -> list:
    """x = 0; with a flag (input 1), only when it is set (a bad batch's gradients)."""
    v = node.inputs[0]
    t = b.t(v)
    flag = _flag(b, _input(node, 1))
    if flag is not None:
        words = _words(b, v)
        return [b.launch("tr_zero_if_b4", words, [b.buf(v, True), i64(words), flag])]
    width = 4 if t.nbytes % 4 == 0 else 1
    words = t.nbytes // width
    return [b.launch(f"tr_zero_lanes_b{width}", words,
                     [b.buf(v, True), i64(1), i64(0), i64(words)])]


CLIP_PARTS = 1024
"""At most this many chunks (blocks) in ScaleClipGrad's sum of squares: the one-block total
then adds four partials per lane."""
CLIP_MIN_CHUNK = 8 * BLOCK
"""The least chunk: each lane adds at least 8 values."""


def clip_chunks(n: int) -> tuple[int, int]:
    """(parts, chunk) of ScaleClipGrad's sum of squares over ``n`` values: chunks of a whole
    number of ``BLOCK`` lanes, at least ``CLIP_MIN_CHUNK``, at most ``CLIP_PARTS`` of them.
    Fixed by ``n`` alone, so the summation order is the same at every step."""
    chunk = max(CLIP_MIN_CHUNK, -(-n // CLIP_PARTS))
    chunk = -(-chunk // BLOCK) * BLOCK
    return max(1, -(-n // chunk)), chunk


def scale_clip_grad_factory(ctx: KernelContext):
    """ScaleClipGrad: unscale and check GRAD first when loss scaling declares ``inv_scale``
    and ``found_inf`` (inputs 2, 3); then scale by 1/k with each chunk's sum of squares into
    float64 scratch (one block per chunk), the norm and the clip coefficient from those in a
    fixed order (one block; the coefficient into float32 scratch), and the clipping pass."""
    parts, chunk = clip_chunks(math.prod(ctx.inputs[0].shape))
    partial_ws = ctx.workspace((parts,), np.float64)
    coef_ws = ctx.workspace((1,), np.float32)

    def bind(b: BindContext, node) -> list:
        g, scale = node.inputs[0], node.inputs[1]
        norm = node.outputs[0] if node.outputs else None
        if norm is None or b.t(norm).dtype != np.float32 or b.t(scale).dtype != np.float32:
            raise Unbound("needs a float32 scale input and a float32 norm output")
        dt = b.dt(g)
        n = math.prod(b.t(g).shape)
        calls = []
        inv, found = _flag(b, _input(node, 2)), _flag(b, _input(node, 3), writes=True)
        if (inv is None) != (found is None):
            raise Unbound("unscaling needs both inv_scale and found_inf")
        if inv is not None:
            calls.append(b.launch(f"tr_unscale_check_{dt}", n,
                                  [b.buf(g, True), i64(n), inv, found]))
        return calls + [
            b.launch(f"tr_scale_clip_norm_{dt}", parts * BLOCK,
                     [b.buf(g, True), i64(n), b.buf(scale), b.ws(partial_ws), i64(parts),
                      i64(chunk)]),
            b.launch("tr_scale_clip_norm_total", 1,
                     [b.ws(partial_ws, writes=False), i64(parts), b.buf(norm, True),
                      b.ws(coef_ws), f64(float(node.attrs.get("max_norm", 0.0)))],
                     single_block=True),
            b.launch(f"tr_scale_clip_norm_apply_{dt}", n,
                     [b.buf(g, True), i64(n), b.ws(coef_ws, writes=False)])]

    return bind


def bind_update(b: BindContext, node) -> list:
    """The fused update over the whole PARAM span and its GRAD / OPT_STATE mirrors; the
    optional ``skip`` flag and ``weight_copy`` span follow (params, grads, moments, lr,
    step)."""
    a = node.attrs
    states = UPDATE_STATES[node.op_type]
    p, g = node.inputs[0], node.inputs[1]
    moments = node.inputs[2:2 + states]
    lr, step = node.inputs[2 + states], node.inputs[3 + states]
    skip, copy = _input(node, 4 + states), _input(node, 5 + states)
    tp = b.t(p)
    if tp.dtype != np.float32:
        raise Unbound(f"parameters must be float32 master weights, got {tp.dtype}")
    gdt = b.dt(g)
    n = math.prod(tp.shape)
    for v in [g, *moments, copy]:
        if v is not None and math.prod(b.t(v).shape) != n:
            raise Unbound(f"{v.name!r} does not mirror the parameter span")
    if copy is not None and DT.get(b.t(copy).dtype.name) != gdt:
        raise Unbound(f"weight copy {copy.name!r} must be a {gdt} span like the gradients")
    if b.t(lr).dtype != np.float32 or b.t(step).dtype != np.int64:
        raise Unbound("lr must be float32 and step int64 in the arena")
    if node.op_type == "SGDUpdate":
        stem = "sgd"
        scalars = [f64(a["momentum"]), f64(a["dampening"]), i32(int(a["nesterov"])),
                   f64(a["weight_decay"])]
    elif node.op_type == "AdamUpdate":
        stem = "adam"
        scalars = [f64(a["beta1"]), f64(a["beta2"]), f64(a["epsilon"]), f64(a["weight_decay"]),
                   i32(int(a["decoupled"]))]
    else:
        stem = "adagrad"
        scalars = [f64(a["lr_decay"]), f64(a["weight_decay"]), f64(a["epsilon"])]
    args = [b.buf(p, True), b.buf(g)] + [b.buf(m, True) for m in moments] + [
        b.buf(copy, True), i64(n), b.buf(lr), b.buf(step), _flag(b, skip)] + scalars
    return [b.launch(f"tr_{stem}_{gdt}", n, args)]


def bind_loss_scale_update(b: BindContext, node) -> list:
    """LossScaleUpdate(scale, inv_scale, growth_tracker, found_inf[, reject])."""
    scale, inv, tracker, found = node.inputs[:4]
    if b.t(tracker).dtype != np.int32:
        raise Unbound("the growth tracker must be int32")
    a = node.attrs
    return [b.launch("tr_loss_scale_update", 1, [
        _flag(b, scale, True), _flag(b, inv, True), b.buf(tracker, True), _flag(b, found),
        f64(a["growth_factor"]), f64(a["backoff_factor"]), i32(a["growth_interval"]),
        _flag(b, _input(node, 4))], single_block=True)]


def bind_step_check(b: BindContext, node) -> list:
    """StepCheck(bad, reject, loss, step, applied[, grads][, found_inf]): bad = non-finite
    loss (or gradient); reject = step != applied + 1 (then bad too); with attribute ``world``,
    bad = the maximum over the ranks (one NCCL all-reduce of the flag on the step's stream,
    captured with the step); found_inf = bad."""
    bad, reject, loss, step, applied = node.inputs[:5]
    grads, found = _input(node, 5), _input(node, 6)
    bad_buf = _flag(b, bad, True)
    calls = [b.launch("tr_zero_lanes_b4", 1, [bad_buf, i64(1), i64(0), i64(1)]),
             b.launch("tr_unscale_check_f32", 1, [_flag(b, loss), i64(1), None, bad_buf])]
    if grads is not None:
        n = math.prod(b.t(grads).shape)
        calls.append(b.launch(f"tr_unscale_check_{b.dt(grads)}", n,
                              [b.buf(grads), i64(n), None, bad_buf]))
    for v in (step, applied):
        if b.t(v).dtype != np.int64:
            raise Unbound(f"{v.name!r} must be an int64 scalar")
    calls.append(b.launch("tr_step_check", 1, [b.buf(step), b.buf(applied),
                                                _flag(b, reject, True), bad_buf],
                          single_block=True))
    if "world" in node.attrs:
        calls.append(node_all_reduce(b, node, bad_buf, 1, nccl_dtype(np.float32), NCCL_MAX))
    if found is not None:
        found_buf = _flag(b, found, True)
        calls += [b.launch("tr_zero_lanes_b4", 1, [found_buf, i64(1), i64(0), i64(1)]),
                  b.launch("tr_flag_or", 1, [found_buf, bad_buf], single_block=True)]
    return calls


def bind_step_advance(b: BindContext, node) -> list:
    applied, skip = node.inputs[:2]
    if b.t(applied).dtype != np.int64:
        raise Unbound(f"{applied.name!r} must be an int64 scalar")
    return [b.launch("tr_step_advance", 1, [b.buf(applied, True), _flag(b, skip)],
                     single_block=True)]


def bind_step_report(b: BindContext, node) -> list:
    """StepReport(report, loss, bad, found_inf, grad_norm, reject): ``REPORT_FIELDS``."""
    report, *fields = node.inputs[:6]
    fields += [None] * (5 - len(fields))
    if b.t(report).dtype != np.float32 or math.prod(b.t(report).shape) < 5:
        raise Unbound("the report must be float32 with room for 5 fields")
    return [b.launch("tr_step_report", 1, [_flag(b, v) for v in fields] + [b.buf(report, True)],
                     single_block=True)]


PREVIEW_TENSORS = {"Adam": 4, "Momentum": 3, "Adagrad": 3}
"""The tensors of one tuple of an ``ai.onnx.preview.training`` op: (X, G, V[, H]) in, the
updated (X, V[, H]) out."""


def bind_preview(b: BindContext, node) -> list:
    """ONNX Adam / Momentum / Adagrad (R, T, X..., G..., V..., [H...]): one launch per tuple
    over compact float32 tensors, R (float32) and T (int64) read on the device."""
    per = PREVIEW_TENSORS[node.op_type]
    r, t = node.inputs[:2]
    count = (len(node.inputs) - 2) // per
    if b.t(r).dtype != np.float32 or b.t(t).dtype != np.int64:
        raise Unbound("R must be float32 and T int64")
    a = node.attrs
    if node.op_type == "Adam":
        scalars = [f64(a["alpha"]), f64(a["beta"]), f64(a["epsilon"]),
                   f64(a["norm_coefficient"]), f64(a["norm_coefficient_post"])]
    elif node.op_type == "Momentum":
        if a["mode"] not in ("standard", "nesterov"):
            raise Unbound(f"Momentum mode {a['mode']!r}")
        scalars = [f64(a["alpha"]), f64(a["beta"]), f64(a["norm_coefficient"]),
                   i32(a["mode"] == "nesterov")]
    else:
        scalars = [f64(a["decay_factor"]), f64(a["epsilon"]), f64(a["norm_coefficient"])]
    calls = []
    for i in range(count):
        ins = [node.inputs[2 + k * count + i] for k in range(per)]
        outs = [node.outputs[k * count + i] for k in range(per - 1)]
        need_compact(b, *ins, *outs)
        n = math.prod(b.t(ins[0]).shape)
        for v in ins + outs:
            if b.t(v).dtype != np.float32 or math.prod(b.t(v).shape) != n:
                raise Unbound(f"{v.name!r} is not a float32 tensor of {n} elements like "
                              f"{ins[0].name!r} (NumPy rounds each step in half precision)")
        calls.append(b.launch(f"tr_preview_{node.op_type.lower()}_f32", n,
                              [b.buf(v) for v in ins] + [b.buf(v, True) for v in outs]
                              + [i64(n), b.buf(r), b.buf(t)] + scalars))
    return calls


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("ScaleClipGrad", "cuda", scale_clip_grad_factory, domain=INTERNAL_DOMAIN)] + [
        KernelDef(op, "cuda", binding(fn), domain=INTERNAL_DOMAIN) for op, fn in (
            ("Accumulate", bind_accumulate), ("Assign", bind_assign),
            ("ZeroFill", bind_zero_fill), ("SGDUpdate", bind_update),
            ("AdamUpdate", bind_update), ("AdagradUpdate", bind_update),
            ("LossScaleUpdate", bind_loss_scale_update), ("StepCheck", bind_step_check),
            ("StepAdvance", bind_step_advance), ("StepReport", bind_step_report))] + [
        KernelDef(op, "cuda", binding(bind_preview), domain=PREVIEW) for op in PREVIEW_TENSORS]
