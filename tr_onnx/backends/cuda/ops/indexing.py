"""cuda bindings of ``ops/indexing.py``: Gather and its backward GatherGrad
(``kernels/indexing.cu``), over compact tensors with int64 indices."""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import (
    INTERNAL,
    BindContext,
    Unbound,
    binding,
    float_dt,
    i64,
    move_kernel,
    need_compact,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, widths

# ---- kernels/indexing.cu: the family's name table -----------------------------------------------

def indexing_source() -> KernelSource:
    """kernels/indexing.cu: Gather along one axis (bit patterns) and GatherGrad."""
    return kernel_source(
        "indexing",
        instantiate("TR_GATHER({U}, {bytes})", "tr_gather_b{bytes}", widths(1, 2, 4, 8)),
        instantiate("TR_GATHER_GRAD({T}, {dt})", "tr_gather_grad_{dt}", STORAGE))


KERNELS = indexing_source()


def _axis_args(b: BindContext, node, data, idx) -> list:
    """(nidx, axis length, inner size) of a Gather over ``data``'s ``axis``."""
    if b.t(idx).dtype != np.int64:
        raise Unbound("indices must be int64")
    shape = b.t(data).shape
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    return [i64(math.prod(b.t(idx).shape)), i64(shape[axis]),
            i64(math.prod(shape[axis + 1:]))]


def bind_gather(b: BindContext, node) -> list:
    x, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, x, idx, y)
    n = math.prod(b.t(y).shape)
    return [b.launch(f"tr_gather_{move_kernel(b, y)}", n,
                     [b.buf(x), b.buf(idx), b.buf(y, True), i64(n)]
                     + _axis_args(b, node, x, idx))]


def bind_gather_grad(b: BindContext, node) -> list:
    gy, idx, gx = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, gy, idx, gx)
    n = math.prod(b.t(gx).shape)
    dt = float_dt(b, gy, gx)
    return [b.launch(f"tr_gather_grad_{dt}", n,
                     [b.buf(gy), b.buf(idx), b.buf(gx, True), i64(n)]
                     + _axis_args(b, node, gx, idx))]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Gather", "cuda", binding(bind_gather)),
            KernelDef("GatherGrad", "cuda", binding(bind_gather_grad), domain=INTERNAL)]
