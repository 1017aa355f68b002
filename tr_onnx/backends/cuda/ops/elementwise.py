"""cuda bindings of ``ops/elementwise.py``: broadcasting Add/Sub/Mul/Div/Sum, comparisons,
Where, Cast, Identity and Dropout, inference and training (``kernels/elementwise.cu``).

Operands are indexed by the output's elements through specs (``bind.operand_spec``): the same
layout, a scalar, a trailing broadcast, or a change between compact and padded channels-last.
What specs cannot express (a broadcast inside compact tensors) takes the strided kernel.
Padded output lanes must stay zero: where an op could write non-zero there (a scalar operand,
a division), a ``tr_zero_lanes`` launch follows.
"""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.elementwise import check_inference_dropout, dropout_scale
from ..bind import (
    TO_PADDED,
    BindContext,
    Unbound,
    binding,
    collapse,
    contiguous_strides,
    copy_of,
    f32,
    f64,
    float_dt,
    geometry,
    i32,
    i64,
    keeps_pads_zero,
    need_compact,
    operand_spec,
    operand_specs,
    out_geometry,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, storage_pairs, values

# ---- kernels/elementwise.cu: the family's name table --------------------------------------------

BINARY_OPS = ("add", "sub", "mul", "div")
"""Kernel stems of ``tr_<op>_<dt>`` and ``tr_<op>_mixed_<dt>``."""

COMPARE_OPS = {"greater": ">", "less": "<", "equal": "=="}
"""Kernel stem of ``tr_<op>_<dt>`` -> the C comparison it makes."""

CONVERT_PAIRS = (("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the Cast kernels ``tr_convert_<src>_<dst>``."""


def elementwise_source() -> KernelSource:
    """kernels/elementwise.cu: binary ops by period, by operand spec (mixed layouts) and by
    strides (general broadcasting), Greater/Less/Equal, Where and Cast."""
    ops = values("op", BINARY_OPS)
    compares = tuple({"op": op, "cmp": cmp} for op, cmp in COMPARE_OPS.items())
    return kernel_source(
        "elementwise",
        instantiate("TR_BINARY({op}, {T}, {dt})", "tr_{op}_{dt}", ops, STORAGE),
        instantiate("TR_MIXED_BINARY({op}, {T}, {dt})", "tr_{op}_mixed_{dt}", ops, STORAGE),
        instantiate("TR_COMPARE({op}, {cmp}, {T}, {dt})", "tr_{op}_{dt}", compares, STORAGE),
        instantiate("TR_WHERE({T}, {dt})", "tr_where_{dt}", STORAGE),
        instantiate("TR_BCAST_BINARY({T}, {dt})", "tr_bcast_binary_{dt}", STORAGE),
        instantiate("TR_CONVERT({S}, {sdt}, {D}, {ddt})", "tr_convert_{sdt}_{ddt}",
                    storage_pairs(CONVERT_PAIRS)),
        instantiate("TR_DROPOUT({T}, {dt})", "tr_dropout_{dt}", STORAGE))


KERNELS = elementwise_source()


BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Sum": "add"}
BCAST_OPS = {"Add": 0, "Sum": 0, "Sub": 1, "Mul": 2, "Div": 3}  # tr_bcast_binary's op codes
COMPARE = {"Greater": "greater", "Less": "less", "Equal": "equal"}


def bind_binary_specs(b: BindContext, node) -> list:
    """Add/Sub/Mul/Div/Sum through operand specs (a Sum of more inputs: y = y + next)."""
    op = BINARY[node.op_type]
    ins = [v for v in node.inputs if v is not None]
    if len(ins) < 2:
        raise Unbound("a one-input Sum is a copy; the fan-in sums have a binding")
    y = node.outputs[0]
    dt = b.dt(y)
    for v in ins:
        if b.dt(v) != dt:
            raise Unbound(f"mixed dtypes ({b.t(v).dtype} and {b.t(y).dtype})")
    out = out_geometry(b, y)
    calls = []
    acc = ins[0]
    for other in ins[1:]:
        specs, (m, c, s, cp) = operand_specs(b, [acc, other], out)
        a_buf, b_buf, y_buf = b.buf(acc), b.buf(other), b.buf(y, True)
        if all(isinstance(p, int) and p > 0 for p in specs):
            calls.append(b.launch(f"tr_{op}_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, i64(out.n), i64(specs[0]),
                                   i64(specs[1])]))
        else:
            calls.append(b.launch(f"tr_{op}_mixed_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, i64(out.n), i64(specs[0]),
                                   i64(specs[1]), i64(m), i64(c), i64(s), i64(cp)]))
        acc = y
        if out.padded and not (op != "div" and keeps_pads_zero(specs, out)):
            calls.append(b.zero_lanes(y, out))
    return calls


def bind_binary(b: BindContext, node) -> list:
    """``bind_binary_specs``; where operand specs cannot express the broadcast (compact
    tensors), the general strided kernel."""
    try:
        return bind_binary_specs(b, node)
    except Unbound as e:
        why = str(e)
    ins = [v for v in node.inputs if v is not None]
    y = node.outputs[0]
    if len(ins) < 2:
        raise Unbound(why)
    try:
        need_compact(b, *ins, y)
    except Unbound as e:
        raise Unbound(f"{why}; {e}") from None
    dt = float_dt(b, *ins, y)
    shape = tuple(b.t(y).shape)
    rank = len(shape)
    calls, acc = [], ins[0]
    for other in ins[1:]:
        sets = []
        for v in (acc, other):
            s = tuple(b.t(v).shape)
            s = (1,) * (rank - len(s)) + s
            st = contiguous_strides(s)
            sets.append([0 if s[k] == 1 and shape[k] != 1 else st[k] for k in range(rank)])
        d, (sa, sb, _) = collapse(shape, sets + [contiguous_strides(shape)])
        n = math.prod(shape)
        calls.append(b.launch(f"tr_bcast_binary_{dt}", n,
                              [b.buf(acc), b.buf(other), b.buf(y, True), i64(n),
                               i32(BCAST_OPS[node.op_type])] + [i64(v) for v in d + sa + sb]))
        acc = y
    return calls


def bind_compare(b: BindContext, node) -> list:
    """Greater / Less / Equal of float operands into a bool (one byte) output."""
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    dt = b.dt(a)
    if b.dt(c) != dt or b.t(y).dtype != np.bool_:
        raise Unbound("operands of different dtypes")
    out = out_geometry(b, y)
    specs, (m, ch, s, cp) = operand_specs(b, [a, c], out)
    calls = [b.launch(f"tr_{COMPARE[node.op_type]}_{dt}", out.n,
                      [b.buf(a), b.buf(c), b.buf(y, True), i64(out.n), i64(specs[0]),
                       i64(specs[1]), i64(m), i64(ch), i64(s), i64(cp)])]
    if out.padded and not keeps_pads_zero(specs, out):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_where(b: BindContext, node) -> list:
    cond, a, c = node.inputs[:3]
    y = node.outputs[0]
    dt = b.dt(y)
    if b.t(cond).dtype != np.bool_ or b.dt(a) != dt or b.dt(c) != dt:
        raise Unbound("Where needs a bool condition and two operands of the output's dtype")
    out = out_geometry(b, y)
    specs, (m, ch, s, cp) = operand_specs(b, [cond, a, c], out)
    calls = [b.launch(f"tr_where_{dt}", out.n,
                      [b.buf(cond), b.buf(a), b.buf(c), b.buf(y, True), i64(out.n)]
                      + [i64(p) for p in specs] + [i64(m), i64(ch), i64(s), i64(cp)])]
    # a padded lane reads cond = false (pads of a same-layout cond are zero), so it takes c
    zero_c = specs[2] == 1 and c.data is not None and not np.asarray(c.data).reshape(
        -1).view(np.uint8).any()
    if out.padded and not (specs[0] != 1 and (zero_c or specs[2] in (out.n, TO_PADDED))):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_cast(b: BindContext, node) -> list:
    """Cast between float storage types in one layout: the float16 copy of a float32
    BatchNorm parameter gradient in a half-precision plan, the loss region's casts."""
    x, y = node.inputs[0], node.outputs[0]
    pair = (b.dt(x), b.dt(y))
    if pair not in CONVERT_PAIRS:
        raise Unbound(f"Cast {pair[0]} -> {pair[1]}: the conversion kernels are "
                      f"{', '.join(f'{s}->{d}' for s, d in CONVERT_PAIRS)}")
    gy = out_geometry(b, y)
    if operand_spec(b.t(x), geometry(b.t(x)), gy) != gy.n:
        raise Unbound("input and output in different layouts")
    return [b.launch(f"tr_convert_{pair[0]}_{pair[1]}", gy.n,
                     [b.buf(x), b.buf(y, True), i64(gy.n)])]


def bind_copy(b: BindContext, node) -> list:
    """Identity (and the reshaping ops of ``ops/tensor.py``) where the output could not alias
    its input: a device copy when the bytes are the same."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    if not (tx.layout.is_plain and ty.layout.is_plain) or tx.dtype != ty.dtype:
        raise Unbound(f"a copy from {tx.layout.describe()} to {ty.layout.describe()}")
    return [copy_of(b, x, y)]


def _dropout(b: BindContext, x, y, mask, step, rows_before, seed: int, ratio: float,
             scale: float) -> list:
    """``tr_dropout_<dt>`` over compact x, y and mask (one launch per Philox block of 4)."""
    need_compact(b, x, y, mask)
    if b.t(mask).dtype != np.bool_:
        raise Unbound(f"the mask {mask.name!r} must be bool")
    for v in (step, rows_before):
        if v is not None and (b.t(v).dtype != np.int64 or math.prod(b.t(v).shape) != 1):
            raise Unbound(f"{v.name!r} must be an int64 scalar")
    n = math.prod(b.t(x).shape)
    per_row = n // b.t(x).shape[0] if rows_before is not None else 0
    seed = seed % 2**64
    return [b.launch(f"tr_dropout_{float_dt(b, x, y)}", -(-n // 4) + 1, [
        b.buf(x), b.buf(y, True), b.buf(mask, True), i64(n), b.buf(step), b.buf(rows_before),
        i64(per_row), i64(seed - 2**64 if seed >= 2**63 else seed), f64(ratio), f32(scale)])]


def dropout_training_factory(ctx):
    """DropoutTraining(x, step[, rows_before]): the numpy kernel's masks bit for bit (NumPy's
    Philox, drawn on the device), y = (x * mask) * scale in x's storage."""
    ratio = float(ctx.attrs.get("ratio", 0.5))
    scale = float(dropout_scale(ratio))

    def bind(b: BindContext, node) -> list:
        x, step = node.inputs[:2]
        rows_before = node.inputs[2] if len(node.inputs) > 2 else None
        return _dropout(b, x, node.outputs[0], node.outputs[1], step, rows_before,
                        int(node.attrs["seed"]), ratio, scale)

    return bind


def dropout_inference_factory(ctx):
    """Inference Dropout (``ops.elementwise.check_inference_dropout`` refuses a training-mode
    one): y = x, the optional mask all ones."""
    check_inference_dropout(ctx)

    def bind(b: BindContext, node) -> list:
        x, y = node.inputs[0], node.outputs[0]
        mask = node.outputs[1] if len(node.outputs) > 1 else None
        if mask is None:
            return bind_copy(b, node)
        return _dropout(b, x, y, mask, None, None, 0, 0.0, 1.0)

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(bind_binary)) for op in BINARY]
            + [KernelDef(op, "cuda", binding(bind_compare)) for op in COMPARE]
            + [KernelDef("Where", "cuda", binding(bind_where)),
               KernelDef("Cast", "cuda", binding(bind_cast)),
               KernelDef("Identity", "cuda", binding(bind_copy)),
               KernelDef("Dropout", "cuda", dropout_inference_factory),
               KernelDef("DropoutTraining", "cuda", dropout_training_factory,
                         domain="ai.tr_onnx")])
