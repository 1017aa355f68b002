"""cuda bindings of ``ops/reduce.py``: ReduceSum / ReduceMean (column sums, or one run of
consecutive axes) and Softmax / LogSoftmax over the last axis (``kernels/reduce.cu``)."""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import (
    BindContext,
    Unbound,
    binding,
    copy_of,
    float_dt,
    geometry,
    i32,
    i64,
    need_compact,
    row_split,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source

# ---- kernels/reduce.cu: the family's name table -------------------------------------------------

def reduce_source() -> KernelSource:
    """kernels/reduce.cu: Softmax / LogSoftmax rows, ReduceSum / ReduceMean over one run of
    axes, and column sums (ReduceSum over leading rows)."""
    return kernel_source(
        "reduce",
        instantiate("TR_REDUCE({T}, {dt})", ("tr_softmax_{dt}", "tr_reduce_mid_{dt}",
                                             "tr_sum_rows_{dt}"), STORAGE))


KERNELS = reduce_source()


def reduce_axes(node, rank: int) -> list[int] | None:
    v = node.inputs[1] if len(node.inputs) > 1 else None
    if v is not None:
        if v.data is None:
            return None
        axes = [int(a) for a in np.asarray(v.data).reshape(-1)]
    else:
        axes = list(node.attrs.get("axes") or [])
    if not axes:
        return [] if int(node.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted(a % rank for a in axes)


def bind_column_sums(b: BindContext, node) -> list:
    """Sums over leading axes of a compact tensor, or over every axis but the channels of a
    channels-last one (the bias gradients of Gemm and Conv): column sums."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    rank = len(tx.shape)
    axes = reduce_axes(node, rank)
    gx, gy = geometry(tx), geometry(ty)
    dt = b.dt(x)
    if axes is None or gx is None or gy is None:
        raise Unbound("axes computed at run time, or a layout the column sum cannot read")
    if gx.kind == "flat" and axes == list(range(len(axes))):
        rows = math.prod(tx.shape[:len(axes)])
        cols = ld = math.prod(tx.shape[len(axes):])
    elif gx.kind == "channels_last" and tx.layout.kind == "channels_last" and \
            axes == [0, *range(2, rank)]:
        rows, ld = gx.n // gx.cp, gx.cp
        cols = gy.cp if gy.kind == "channels_last" else tx.shape[1]
    else:
        raise Unbound(f"ReduceSum over axes {axes} of a {tx.layout.describe()} tensor: only "
                       "leading axes (compact) or all but the channels (channels-last) are "
                       "bound")
    return [b.launch(f"tr_sum_rows_{dt}", cols,
                     [b.buf(x), b.buf(y, True), i64(rows), i64(cols), i64(ld)])]


def bind_reduce(b: BindContext, node) -> list:
    """ReduceSum as column sums where it is one (``bind_column_sums``); else ReduceSum /
    ReduceMean over one run of consecutive axes of a compact tensor: ``[outer, r, inner]`` ->
    ``[outer, inner]``."""
    x, y = node.inputs[0], node.outputs[0]
    if node.op_type == "ReduceSum":
        try:
            return bind_column_sums(b, node)
        except Unbound:
            pass
    need_compact(b, x, y)
    shape = b.t(x).shape
    axes = reduce_axes(node, len(shape))
    if axes is None:
        raise Unbound("axes computed at run time")
    dt = float_dt(b, x, y)
    if not axes:
        return [copy_of(b, x, y)]
    if axes != list(range(axes[0], axes[-1] + 1)):
        raise Unbound(f"axes {axes} are not one run of consecutive axes")
    outer = math.prod(shape[:axes[0]])
    r = math.prod(shape[axes[0]:axes[-1] + 1])
    inner = math.prod(shape[axes[-1] + 1:])
    return [b.launch(f"tr_reduce_mid_{dt}", outer * inner,
                     [b.buf(x), b.buf(y, True), i64(outer), i64(r), i64(inner),
                      i32(node.op_type == "ReduceMean")])]


def bind_softmax(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    need_compact(b, x, y)
    rows, c = row_split(node, b.t(x).shape, True)
    dt = float_dt(b, x, y)
    return [b.launch(f"tr_softmax_{dt}", rows,
                     [b.buf(x), b.buf(y, True), i64(rows), i64(c), i64(c),
                      i32(node.op_type == "LogSoftmax")])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("ReduceSum", "cuda", binding(bind_reduce)),
            KernelDef("ReduceMean", "cuda", binding(bind_reduce)),
            KernelDef("Softmax", "cuda", binding(bind_softmax)),
            KernelDef("LogSoftmax", "cuda", binding(bind_softmax))]
