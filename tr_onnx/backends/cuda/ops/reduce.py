"""cuda bindings of ``ops/reduce.py`` (``kernels/reduce.cu``): every Reduce* op over any set
of axes, ArgMax / ArgMin, Hardmax, Softmax / LogSoftmax over the last axis, and GlobalMaxPool /
GlobalLpPool / GlobalMaxPoolGrad of ``ops/pool.py``, which are reductions over the spatial axes.

A reduction reads its input through the element strides of its logical axes
(``bind.logical_strides``: compact row-major or channels-last ``[N, *S, Cp]``) and writes its
output the same way, so the dynamo export's global average pool (ReduceMean over axes [2, 3]
of an NHWC map, keepdims 1: a channels-last output; keepdims 0: a compact one) is one launch.
The kept axes and the reduced axes are each collapsed to at most six (``bind.collapse``): one
thread per output element walks its reduced elements in logical order, accumulating in fp64;
from ``BLOCK_REDUCE_MIN`` elements per output a block of lanes shares them and a fixed tree
adds the lanes' partials (deterministic). The older kernels stay where they apply: column
sums (the bias gradients: ReduceSum over the leading axes, or over all but the channels of a
channels-last map, fp32 as NumPy's einsum) and one short run of consecutive axes of a compact
tensor (ReduceSum / ReduceMean).
"""

from __future__ import annotations

import math

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.reduce import node_reduce_axes
from ..bind import (
    BindContext,
    Unbound,
    binding,
    collapse,
    copy_of,
    f64,
    float_dt,
    geometry,
    i32,
    i64,
    is_compact,
    logical_strides,
    need_compact,
    row_split,
)
from ..device import BLOCK
from ..sources import STORAGE, KernelSource, instantiate, kernel_source
from .tensor import pads_after

# ---- kernels/reduce.cu: the family's name table -------------------------------------------------

def reduce_source() -> KernelSource:
    """kernels/reduce.cu: Softmax / LogSoftmax rows, ReduceSum / ReduceMean over one run of
    axes, column sums (ReduceSum over leading rows), the strided reductions of every Reduce*
    op, ArgMax / ArgMin, Hardmax and GlobalMaxPoolGrad."""
    return kernel_source(
        "reduce",
        instantiate("TR_REDUCE({T}, {dt})",
                    ("tr_softmax_{dt}", "tr_reduce_mid_{dt}", "tr_sum_rows_{dt}",
                     "tr_reduce_{dt}", "tr_reduce_blocks_{dt}", "tr_arg_extreme_{dt}",
                     "tr_hardmax_{dt}",
                     "tr_global_max_pool_grad_{dt}"), STORAGE))


KERNELS = reduce_source()

# the TR_RED_* op codes of kernels/reduce.cu's tr_reduce
REDUCE_OPS = {"ReduceSum": 0, "ReduceMean": 1, "ReduceMax": 2, "ReduceMin": 3, "ReduceProd": 4,
              "ReduceL1": 5, "ReduceL2": 6, "ReduceSumSquare": 7, "ReduceLogSum": 8,
              "ReduceLogSumExp": 9}
RED_LP = 10

# Reductions of at least this many elements per output take a block of BLOCK lanes each
# (tr_reduce_blocks): one thread walking them all serialises the loads (a full-tensor mean
# of a [32, 1000] logit map: 32000 dependent adds on one thread), and threads walking rows
# side by side read them a row length apart (uncoalesced), where a block's lanes read one
# row's neighbouring elements. Not measured on a GPU yet (no device in this task).
BLOCK_REDUCE_MIN = 256


def reduce_axes(node) -> list[int] | None:
    """The node's reduced axes (``ops.reduce``'s rule; [] for a no-op with empty axes), or
    None where the axes input is computed at run time."""
    if len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].data is None:
        return None
    return list(node_reduce_axes(node))


def reduction_geometry(b: BindContext, x, axes, reduced=(), full=()):
    """(kept dims, reduced dims, kept stride sets, reduced stride sets): ``x``'s logical axes
    split into the kept ones and ``axes``, each group collapsed. The kept stride sets are
    ``x``'s, then each of the ``reduced`` outputs' (keepdims form: size 1 on ``axes``, or
    without those axes), then each of the ``full`` ones' (``x``'s shape); the reduced stride
    sets are ``x``'s and the ``full`` outputs'."""
    shape = list(b.t(x).shape)
    rank = len(shape)
    xs = logical_strides(b, x)
    kept_sets = [xs]
    for v in reduced:
        vs = logical_strides(b, v)
        if len(vs) != rank:  # keepdims=0: the output has the kept axes only
            it = iter(vs)
            vs = [0 if a in axes else next(it) for a in range(rank)]
        kept_sets.append(vs)
    full_sets = [logical_strides(b, v) for v in full]
    kept = [1 if a in axes else d for a, d in enumerate(shape)]
    red = [d if a in axes else 1 for a, d in enumerate(shape)]
    kd, ks = collapse(kept, kept_sets + full_sets)
    rd, rs = collapse(red, [xs] + full_sets)
    return kd, rd, ks, rs


def strided_reduce(b: BindContext, x, y, axes, op: int, p: float = 0.0) -> list:
    """``y`` = the reduction ``op`` (a TR_RED_* code) of ``x`` over ``axes``, both compact or
    channels-last, ``y`` in keepdims form or not: a thread per output, or a block per output
    for long reductions (``BLOCK_REDUCE_MIN``); the padded lanes of ``y`` zeroed."""
    dt = float_dt(b, x, y)
    kd, rd, (sx, sy), (rx,) = reduction_geometry(b, x, axes, reduced=[y])
    total, count = math.prod(kd), math.prod(rd)
    blocks = count >= BLOCK_REDUCE_MIN
    return [b.launch(f"tr_reduce_blocks_{dt}" if blocks else f"tr_reduce_{dt}",
                     total * BLOCK if blocks else total,
                     [b.buf(x), b.buf(y, True), i64(total), i32(op), f64(p), i64(count)]
                     + [i64(v) for v in kd + sx + sy + rd + rx])] + pads_after(b, y)


def bind_column_sums(b: BindContext, node) -> list:
    """Sums over leading axes (not all) of a compact tensor, or over every axis but the
    channels of a channels-last one (the bias gradients of Gemm and Conv): column sums."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    rank = len(tx.shape)
    axes = reduce_axes(node)
    gx, gy = geometry(tx), geometry(ty)
    dt = b.dt(x)
    if axes is None or gx is None or gy is None:
        raise Unbound("axes computed at run time, or a layout the column sum cannot read")
    if gx.kind == gy.kind == "flat" and axes == list(range(len(axes))) and len(axes) < rank:
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
    """Every Reduce* op: ReduceSum as column sums where it is one (``bind_column_sums``);
    ReduceSum / ReduceMean over one short run of consecutive axes of a compact tensor as
    ``[outer, r, inner]`` -> ``[outer, inner]``, or over no axis as a copy; anything else as
    the strided reduction (``strided_reduce``)."""
    x, y = node.inputs[0], node.outputs[0]
    axes = reduce_axes(node)
    if axes is None:
        raise Unbound("axes computed at run time")
    op = node.op_type
    if op == "ReduceSum":
        try:
            return bind_column_sums(b, node)
        except Unbound:
            pass
    if op in ("ReduceSum", "ReduceMean") and is_compact(b, x) and is_compact(b, y):
        shape = b.t(x).shape
        dt = float_dt(b, x, y)
        if not axes:
            return [copy_of(b, x, y)]
        outer = math.prod(shape[:axes[0]])
        r = math.prod(shape[axes[0]:axes[-1] + 1])
        inner = math.prod(shape[axes[-1] + 1:])
        if axes == list(range(axes[0], axes[-1] + 1)) and r < BLOCK_REDUCE_MIN:
            return [b.launch(f"tr_reduce_mid_{dt}", outer * inner,
                             [b.buf(x), b.buf(y, True), i64(outer), i64(r), i64(inner),
                              i32(op == "ReduceMean")])]
    return strided_reduce(b, x, y, axes, REDUCE_OPS[op])


def bind_softmax(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    need_compact(b, x, y)
    rows, c = row_split(node, b.t(x).shape, True)
    dt = float_dt(b, x, y)
    return [b.launch(f"tr_softmax_{dt}", rows,
                     [b.buf(x), b.buf(y, True), i64(rows), i64(c), i64(c),
                      i32(node.op_type == "LogSoftmax")])]


def bind_arg_extreme(b: BindContext, node) -> list:
    """ArgMax / ArgMin along one axis (keepdims, select_last_index), int64 indices into a
    compact or channels-last (padded) output."""
    x, y = node.inputs[0], node.outputs[0]
    shape = b.t(x).shape
    rank = len(shape)
    axis = int(node.attrs["axis"]) % max(rank, 1)
    if 0 in shape:
        raise Unbound("an arg-extremum over an empty tensor (NumPy raises)")
    dt = b.dt(x)
    kd, _, (sx, sy), _ = reduction_geometry(b, x, [axis], reduced=[y])
    total = math.prod(kd)
    calls = [b.launch(f"tr_arg_extreme_{dt}", total,
                      [b.buf(x), b.buf(y, True), i64(total), i32(node.op_type == "ArgMin"),
                       i32(node.attrs.get("select_last_index", 0)), i64(shape[axis]),
                       i64(logical_strides(b, x)[axis] if rank else 1)]
                      + [i64(v) for v in kd + sx + sy])]
    gy = geometry(b.t(y))
    if gy is not None and gy.padded:
        # keepdims of a channels-last map: the int64 lanes [c, cp) are the 4-byte lanes
        # [2c, 2cp) of each row
        calls.append(b.launch("tr_zero_lanes_b4", 2 * gy.n,
                              [b.buf(y, True), i64(gy.n // gy.cp), i64(2 * gy.c),
                               i64(2 * gy.cp)]))
    return calls


def bind_hardmax(b: BindContext, node) -> list:
    """Hardmax: one-hot of the first maximum along ``axis`` (v13), or over the flattened axes
    from ``axis`` on (v1 / v11)."""
    x, y = node.inputs[0], node.outputs[0]
    shape = b.t(x).shape
    rank = len(shape)
    axis = int(node.attrs["axis"]) % max(rank, 1)
    axes = [axis] if node.since_version >= 13 else list(range(axis, rank))
    if 0 in shape:
        return []
    dt = float_dt(b, x, y)
    kd, rd, (sx, sy), (rx, ry) = reduction_geometry(b, x, axes, full=[y])
    total = math.prod(kd)
    return [b.launch(f"tr_hardmax_{dt}", total, [b.buf(x), b.buf(y, True), i64(total)]
                     + [i64(v) for v in kd + sx + sy + rd + rx + ry])] + pads_after(b, y)


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef(op, "cuda", binding(bind_reduce)) for op in REDUCE_OPS] + [
        KernelDef("Softmax", "cuda", binding(bind_softmax)),
        KernelDef("LogSoftmax", "cuda", binding(bind_softmax)),
        KernelDef("ArgMax", "cuda", binding(bind_arg_extreme)),
        KernelDef("ArgMin", "cuda", binding(bind_arg_extreme)),
        KernelDef("Hardmax", "cuda", binding(bind_hardmax))]
