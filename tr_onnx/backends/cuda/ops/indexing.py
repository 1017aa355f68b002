"""cuda bindings of ``ops/indexing.py`` (``kernels/indexing.cu``): Gather and GatherGrad,
GatherElements, ScatterElements and its opset 9-10 name Scatter, GatherND and GatherNDGrad,
ScatterND, TopK, OneHot and ReverseSequence.

Index tensors are int64 or int32 (Gather, GatherGrad: int64); negative indices count from the
end. An index out of range even so is an error of the NumPy kernels at run time; on the device
nothing can raise, so a gather writes 0 for it and a scatter skips it -- never a write outside
the output. The kernel comments in ``kernels/indexing.cu`` say the same per kernel.

Scatters are deterministic and equal NumPy's bit for bit, duplicates included: no atomics.
ScatterElements runs one thread per output element, which walks the updates along the axis
(the only ones that can reach it) in order; ScatterND and GatherNDGrad (the scatter-add of
GatherND's gradient) run one thread per (batch, slice lane), which walks that batch's index
tuples in order. The reductions (add, mul, max, min) compute in fp32 and round to the storage
type after every step, as ``np.add.at`` and its kin do on float16 / bfloat16 arrays, so even
repeated indices give NumPy's bits. GatherElements' gradient (ScatterElements with reduction
add into zeros) and TopK's (ScatterElements of the values' gradient into zeros) run on the
same kernels.

Layouts: GatherElements and ScatterElements index every operand through the element strides
of its logical axes (``tensor.logical_strides``), so a channels-last padded feature map (after
a Conv) is read and written in place, its padded lanes zeroed after the node. The other ops
take compact tensors and raise ``Unbound`` for any other layout (the layout pass gives them
compact ones: they are not channel ops). TopK and the reductions take float32/16/bf16 data;
the moves (gathers, scatters without reduction, OneHot, ReverseSequence) any element of 1, 2,
4 or 8 bytes.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import (
    MAX_DIMS,
    BindContext,
    Unbound,
    binding,
    collapse,
    const_ints,
    copy_of,
    float_dt,
    i32,
    i64,
    move_kernel,
    need_compact,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, widths
from .tensor import logical_strides, pad_dims6, pads_after

# ---- kernels/indexing.cu: the family's name table -----------------------------------------------

INDEX_TYPES = ({"I": "long long", "it": "i64"}, {"I": "int", "it": "i32"})
"""The index tensors' C types and kernel-name suffixes."""

MOVES = widths(1, 2, 4, 8)


def indexing_source() -> KernelSource:
    """kernels/indexing.cu: the gathers and scatters (bit patterns, and the scatter reductions
    per storage type), TopK, OneHot and ReverseSequence."""
    moved = ("tr_gather_elements_b{bytes}_{it}", "tr_scatter_elements_b{bytes}_{it}",
             "tr_gather_nd_b{bytes}_{it}", "tr_scatter_nd_b{bytes}_{it}",
             "tr_one_hot_b{bytes}_{it}", "tr_reverse_sequence_b{bytes}_{it}")
    macros = ("TR_GATHER_ELEMENTS", "TR_SCATTER_ELEMENTS_MOVE", "TR_GATHER_ND",
              "TR_SCATTER_ND_MOVE", "TR_ONE_HOT", "TR_REVERSE_SEQUENCE")
    moves = [instantiate(f"{macro}({{U}}, {{bytes}}, {{I}}, {{it}})", name, MOVES, INDEX_TYPES)
             for macro, name in zip(macros, moved)]
    return kernel_source(
        "indexing",
        instantiate("TR_GATHER({U}, {bytes})", "tr_gather_b{bytes}", MOVES),
        instantiate("TR_GATHER_GRAD({T}, {dt})", "tr_gather_grad_{dt}", STORAGE),
        *moves,
        instantiate("TR_SCATTER_ELEMENTS_REDUCE({T}, {dt}, {I}, {it})",
                    "tr_scatter_elements_{dt}_{it}", STORAGE, INDEX_TYPES),
        instantiate("TR_SCATTER_ND_REDUCE({T}, {dt}, {I}, {it})", "tr_scatter_nd_{dt}_{it}",
                    STORAGE, INDEX_TYPES),
        instantiate("TR_TOP_K({T}, {dt})", "tr_top_k_{dt}", STORAGE))


KERNELS = indexing_source()

REDUCTIONS = {"none": 0, "add": 1, "mul": 2, "max": 3, "min": 4}
"""ScatterElements / ScatterND reductions -> the kernels' ``reduction`` argument."""

def index_suffix(b: BindContext, v) -> str:
    """The kernel suffix of index tensor ``v``: ``i64`` or ``i32``."""
    name = np.dtype(b.t(v).dtype).name
    if name not in ("int64", "int32"):
        raise Unbound(f"indices {v.name!r} are {name}; the kernels read int64 or int32")
    return "i64" if name == "int64" else "i32"


# ---- Gather ---------------------------------------------------------------------------------

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


# ---- GatherElements, ScatterElements (strided: compact or channels-last) --------------------

def bind_gather_elements(b: BindContext, node) -> list:
    x, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
    shape = b.t(idx).shape
    axis = int(node.attrs["axis"]) % len(shape)
    xs = logical_strides(b, x)
    x_axis, xs[axis] = xs[axis], 0  # the gathered axis' offset comes from the index value
    d, (sx, si, sy) = collapse(shape, [xs, logical_strides(b, idx), logical_strides(b, y)])
    n = math.prod(shape)
    kernel = f"tr_gather_elements_{move_kernel(b, y)}_{index_suffix(b, idx)}"
    return [b.launch(kernel, n, [b.buf(x), b.buf(idx), b.buf(y, True), i64(n),
                                 i64(b.t(x).shape[axis]), i64(x_axis)]
                     + [i64(v) for v in d + sx + si + sy])] + pads_after(b, y)


def bind_scatter_elements(b: BindContext, node) -> list:
    x, idx, upd = node.inputs[:3]
    y = node.outputs[0]
    shape, ushape = b.t(x).shape, b.t(idx).shape
    rank = len(shape)
    axis = int(node.attrs.get("axis", 0)) % rank
    reduction = REDUCTIONS[node.attrs.get("reduction", "none")]
    d, strides = pad_dims6(shape, logical_strides(b, x), logical_strides(b, y),
                       logical_strides(b, idx), logical_strides(b, upd))
    u, _ = pad_dims6(ushape)
    n = math.prod(shape)
    it = index_suffix(b, idx)
    args = [b.buf(x), b.buf(idx), b.buf(upd), b.buf(y, True), i64(n),
            i32(axis + MAX_DIMS - rank)] + [i64(v) for v in d + u + sum(strides, [])]
    if reduction:
        kernel = f"tr_scatter_elements_{float_dt(b, x, upd, y)}_{it}"
        args.append(i32(reduction))
    else:
        kernel = f"tr_scatter_elements_{move_kernel(b, y)}_{it}"
    return [b.launch(kernel, n, args)] + pads_after(b, y)


# ---- GatherND, GatherNDGrad, ScatterND (compact) ---------------------------------------------

def _nd_args(b: BindContext, data, idx, batch_dims: int) -> tuple[int, int, int, list]:
    """(batch, index tuples per batch entry, slice size, [k, slice, rows, k0..k5]) of a
    GatherND / ScatterND over ``data`` ([batch, *k dims, *slice]) with index tuples ``idx``."""
    dshape, ishape = b.t(data).shape, b.t(idx).shape
    k = ishape[-1]
    dims = list(dshape[batch_dims:batch_dims + k])
    if len(dims) != k or k > MAX_DIMS:
        raise Unbound(f"index tuples of {k} entries into a rank-{len(dshape)} tensor")
    batch, nuple = math.prod(ishape[:batch_dims]), math.prod(ishape[batch_dims:-1])
    slice_ = math.prod(dshape[batch_dims + k:])
    return batch, nuple, slice_, [i64(k), i64(slice_), i64(math.prod(dims))] + [
        i64(v) for v in dims + [1] * (MAX_DIMS - k)]


def bind_gather_nd(b: BindContext, node) -> list:
    x, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, x, idx, y)
    batch, nuple, slice_, args = _nd_args(b, x, idx, int(node.attrs.get("batch_dims", 0)))
    n = batch * nuple * slice_
    kernel = f"tr_gather_nd_{move_kernel(b, y)}_{index_suffix(b, idx)}"
    return [b.launch(kernel, n, [b.buf(x), b.buf(idx), b.buf(y, True), i64(n), i64(nuple)]
                     + args)]


def _scatter_nd(b: BindContext, idx, upd, y, batch_dims: int, reduction: int):
    batch, nuple, slice_, args = _nd_args(b, y, idx, batch_dims)
    lanes = batch * slice_
    it = index_suffix(b, idx)
    head = [b.buf(idx), b.buf(upd), b.buf(y, True), i64(lanes), i64(nuple)]
    if reduction:
        return b.launch(f"tr_scatter_nd_{float_dt(b, upd, y)}_{it}", lanes,
                        head + args + [i32(reduction)])
    return b.launch(f"tr_scatter_nd_{move_kernel(b, y)}_{it}", lanes, head + args)


def bind_scatter_nd(b: BindContext, node) -> list:
    x, idx, upd = node.inputs[:3]
    y = node.outputs[0]
    need_compact(b, x, idx, upd, y)
    reduction = REDUCTIONS[node.attrs.get("reduction", "none")]
    return [copy_of(b, x, y), _scatter_nd(b, idx, upd, y, 0, reduction)]


def bind_gather_nd_grad(b: BindContext, node) -> list:
    gy, idx, gx = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, gy, idx, gx)
    float_dt(b, gy, gx)
    n = math.prod(b.t(gx).shape)
    zero = b.launch(f"tr_zero_lanes_{move_kernel(b, gx)}", n,
                    [b.buf(gx, True), i64(1), i64(0), i64(n)])
    return [zero, _scatter_nd(b, idx, gy, gx, int(node.attrs["batch_dims"]), REDUCTIONS["add"])]


# ---- TopK, OneHot, ReverseSequence (compact) -------------------------------------------------

def bind_top_k(b: BindContext, node) -> list:
    x, vals, idx = node.inputs[0], node.outputs[0], node.outputs[1]
    need_compact(b, x, vals, idx)
    shape = b.t(x).shape
    axis = int(node.attrs.get("axis", -1)) % len(shape)
    k = b.t(vals).shape[axis]
    if b.t(idx).dtype != np.int64:
        raise Unbound("TopK's indices output must be int64")
    n = math.prod(shape)
    largest = int(node.attrs.get("largest", 1))
    return [b.launch(f"tr_top_k_{float_dt(b, x, vals)}", n,
                     [b.buf(x), b.buf(vals, True), b.buf(idx, True), i64(n), i64(shape[axis]),
                      i64(k), i64(math.prod(shape[axis + 1:])), i32(largest)])]


def bind_one_hot(b: BindContext, node) -> list:
    idx, depth_v, vals = node.inputs[:3]
    y = node.outputs[0]
    need_compact(b, idx, vals, y)
    shape = b.t(y).shape
    axis = int(node.attrs.get("axis", -1)) % len(shape)
    (depth,) = const_ints(depth_v, "depth")[:1]
    n = math.prod(shape)
    kernel = f"tr_one_hot_{move_kernel(b, y)}_{index_suffix(b, idx)}"
    return [b.launch(kernel, n, [b.buf(idx), b.buf(vals), b.buf(y, True), i64(n), i64(depth),
                                 i64(math.prod(shape[axis + 1:]))])]


def bind_reverse_sequence(b: BindContext, node) -> list:
    x, lens, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, x, lens, y)
    shape = b.t(x).shape
    t_axis, b_axis = int(node.attrs["time_axis"]), int(node.attrs["batch_axis"])
    n = math.prod(shape)
    kernel = f"tr_reverse_sequence_{move_kernel(b, y)}_{index_suffix(b, lens)}"
    return [b.launch(kernel, n, [b.buf(x), b.buf(lens), b.buf(y, True), i64(n),
                                 i64(shape[t_axis]), i64(math.prod(shape[t_axis + 1:])),
                                 i64(shape[b_axis]), i64(math.prod(shape[b_axis + 1:]))])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Gather", "cuda", binding(bind_gather)),
            KernelDef("GatherGrad", "cuda", binding(bind_gather_grad), domain=INTERNAL_DOMAIN),
            KernelDef("GatherElements", "cuda", binding(bind_gather_elements)),
            KernelDef("ScatterElements", "cuda", binding(bind_scatter_elements)),
            KernelDef("Scatter", "cuda", binding(bind_scatter_elements)),
            KernelDef("GatherND", "cuda", binding(bind_gather_nd)),
            KernelDef("GatherNDGrad", "cuda", binding(bind_gather_nd_grad), domain=INTERNAL_DOMAIN),
            KernelDef("ScatterND", "cuda", binding(bind_scatter_nd)),
            KernelDef("TopK", "cuda", binding(bind_top_k)),
            KernelDef("OneHot", "cuda", binding(bind_one_hot)),
            KernelDef("ReverseSequence", "cuda", binding(bind_reverse_sequence))]
