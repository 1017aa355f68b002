"""cuda bindings of ``ops/optimizers.py``: gradient accumulation, the running-statistics
commit (Assign), ZeroFill, ScaleClipGrad (global norm, clipping, loss-scale unscaling) and the
fused optimizer updates over the flat PARAM span and its GRAD / OPT_STATE mirrors
(``kernels/optimizers.cu``; loss scaling and the step guard's kernels are in ``amp.cu``).

In a plan with the step guard (``__bad_batch``), the commit and the update skip themselves on
the device when the batch was bad, so a step runs as one graph without a host decision.
"""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ... import APPLIED, BAD_BATCH, REJECT
from ..bind import (
    DT,
    INTERNAL,
    BindContext,
    Copy,
    Unbound,
    binding,
    f64,
    geometry,
    i32,
    i64,
    operand_spec,
    operand_specs,
    out_geometry,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source

# ---- kernels/optimizers.cu: the family's name table ---------------------------------------------

def optimizers_source() -> KernelSource:
    """kernels/optimizers.cu: the fused SGD / Adam(W) / Adagrad updates and ScaleClipGrad."""
    return kernel_source(
        "optimizers",
        instantiate("TR_OPTIM({T}, {dt})", ("tr_sgd_{dt}", "tr_adam_{dt}", "tr_adagrad_{dt}"),
                    STORAGE),
        instantiate("TR_SCALE_CLIP_NORM({T}, {dt})", "tr_scale_clip_norm_{dt}", STORAGE))


KERNELS = optimizers_source()


OPTIMIZERS = ("SGDUpdate", "AdamUpdate", "AdagradUpdate")


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
    target, value = node.inputs[0], node.inputs[1]
    tt, tv = b.t(target), b.t(value)
    gt, gv = geometry(tt), geometry(tv)
    if gt is None or gv is None or tt.dtype != tv.dtype or operand_spec(tv, gv, gt) != gt.n:
        raise Unbound(f"assigning {tv.layout.describe()} {tv.dtype} to "
                       f"{tt.layout.describe()} {tt.dtype}")
    nbytes = gt.n * tt.dtype.itemsize
    dst, src = b.tensor_buf(tt, True, nbytes), b.tensor_buf(tv, False, nbytes)
    if b.guard_flag is None:
        return [Copy(dst, src)]
    if nbytes % 4:
        raise Unbound(f"a guarded assignment copies 4-byte words, not {nbytes} bytes")
    # a step run as one graph: the copy is skipped on the device when the batch is bad
    flag = b.named_scalar(BAD_BATCH, np.float32, writes=False)
    return [b.launch("tr_copy_unless_b4", nbytes // 4,
                     [dst, src, i64(nbytes // 4), flag])]


def bind_zero_fill(b: BindContext, node) -> list:
    v = node.inputs[0]
    t = b.t(v)
    width = 4 if t.nbytes % 4 == 0 else 1
    words = t.nbytes // width
    return [b.launch(f"tr_zero_lanes_b{width}", words,
                     [b.tensor_buf(t, True), i64(1), i64(0), i64(words)])]


def bind_scale_clip_grad(b: BindContext, node) -> list:
    g, scale = node.inputs[0], node.inputs[1]
    norm = node.outputs[0] if node.outputs else None
    if norm is None or b.t(norm).dtype != np.float32 or b.t(scale).dtype != np.float32:
        raise Unbound("needs a float32 scale input and a float32 norm output")
    dt = b.dt(g)
    n = math.prod(b.t(g).shape)
    calls = []
    unscale = node.attrs.get("unscale")
    if unscale:  # dynamic loss scaling: clear the flag, unscale and check GRAD (amp.cu)
        inv = b.named_scalar(unscale["inv_scale"], np.float32, writes=False)
        found = b.named_scalar(unscale["found_inf"], np.float32)
        if b.guard_flag is None:  # else the step guard cleared it (and set it for a bad batch)
            calls.append(b.launch("tr_zero_lanes_b4", 1,
                                  [found, i64(1), i64(0), i64(1)]))
        calls.append(b.launch(f"tr_unscale_check_{dt}", n,
                              [b.buf(g, True), i64(n), inv, found]))
    return calls + [b.launch(f"tr_scale_clip_norm_{dt}", n,
                             [b.buf(g, True), i64(n), b.buf(scale), b.buf(norm, True),
                              f64(float(node.attrs.get("max_norm", 0.0)))], single_block=True)]


def bind_optimizer(b: BindContext, node) -> list:
    """The fused update over the whole PARAM span and its GRAD / OPT_STATE mirrors."""
    a = node.attrs
    ins = list(node.inputs)
    p, g = ins[0], ins[1]
    tp = b.t(p)
    if tp.dtype != np.float32:
        raise Unbound(f"parameters must be float32 master weights, got {tp.dtype}")
    gdt = b.dt(g)
    n = math.prod(tp.shape)
    for v in ins[:-2]:
        if v is not None and math.prod(b.t(v).shape) != n:
            raise Unbound(f"{v.name!r} does not mirror the parameter span")
    if node.op_type == "SGDUpdate":
        stem, states, lr, step = "sgd", [ins[2]], ins[3], ins[4]
        scalars = [f64(a["momentum"]), f64(a["dampening"]), i32(int(a["nesterov"])),
                   f64(a["weight_decay"])]
    elif node.op_type == "AdamUpdate":
        stem, states, lr, step = "adam", ins[2:4], ins[4], ins[5]
        scalars = [f64(a["beta1"]), f64(a["beta2"]), f64(a["epsilon"]),
                   f64(a["weight_decay"]), i32(int(a["decoupled"]))]
    else:
        stem, states, lr, step = "adagrad", [ins[2]], ins[3], ins[4]
        scalars = [f64(a["lr_decay"]), f64(a["weight_decay"]), f64(a["epsilon"])]
    if b.t(lr).dtype != np.float32 or b.t(step).dtype != np.int64:
        raise Unbound("lr must be float32 and step int64 in the arena")
    copy = None
    if a.get("weight_copy"):  # mixed precision: the half weights the compute phase reads
        t = b.tensors.get(a["weight_copy"])
        if t is None or t.shape != tp.shape or DT.get(t.dtype.name) != gdt:
            raise Unbound(f"weight copy {a['weight_copy']!r} must be a {gdt} span mirroring "
                           "the parameters")
        copy = b.tensor_buf(t, True)
    ls = a.get("loss_scale")
    # the update skips itself on this flag: loss scaling's overflow flag (which the step
    # guard also sets for a bad batch), else the guard's own
    found = b.named_scalar(ls["found_inf"], np.float32, writes=False) if ls else \
        None if b.guard_flag is None else b.named_scalar(BAD_BATCH, np.float32, writes=False)
    args = [b.buf(p, True), b.buf(g)] + [b.buf(s, True) for s in states] + [
        copy, i64(n), b.buf(lr), b.buf(step), found] + scalars
    calls = [b.launch(f"tr_{stem}_{gdt}", n, args)]
    reject = None
    if b.guard_flag is not None:  # the step guard's applied-steps counter follows the update
        reject = b.named_scalar(REJECT, np.float32, writes=False)
        calls.append(b.launch("tr_step_advance", 1, [b.named_scalar(APPLIED, np.int64),
                                                            found], single_block=True))
    if ls:  # dynamic loss scaling: backoff or growth after the (maybe skipped) update
        calls.append(b.launch("tr_loss_scale_update", 1, [
            b.named_scalar(ls["scale"], np.float32), b.named_scalar(ls["inv_scale"], np.float32),
            b.named_scalar(ls["growth_tracker"], np.int32),
            found, f64(ls["growth_factor"]),
            f64(ls["backoff_factor"]), i32(ls["growth_interval"]), reject],
            single_block=True))
    return calls


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(fn), domain=INTERNAL) for op, fn in (
        ("Accumulate", bind_accumulate), ("Assign", bind_assign), ("ZeroFill", bind_zero_fill),
        ("ScaleClipGrad", bind_scale_clip_grad))]
        + [KernelDef(op, "cuda", binding(bind_optimizer), domain=INTERNAL) for op in OPTIMIZERS])
