"""Tensor manipulation: data movement by shape, not by index values. Reshaping (Reshape, Flatten,
Squeeze, Unsqueeze), Transpose, joining and splitting, Slice, tiling and broadcasting (Tile,
Expand), block rearrangements, Trilu and the small generators (Constant, Shape, Range,
EyeLike...), with the backward op SliceGrad. Pad is ops/pad.py, CumSum and CumProd
ops/cumulative.py, and what moves data by index values (Gather*, ScatterElements, OneHot,
TopK) ops/indexing.py: they use the axis and gradient helpers defined here.

Output shapes come from ONNX shape inference (``ctx.outputs[i].shape``); factories read the
shape-determining inputs (``const_inputs``) only where the kernel needs more than the output
shape (Slice's steps). Kernels read and write logical views; where an output
is the input regrouped (Tile, DepthToSpace) they write through a strided view of the output
that splits its axes, so nothing is copied twice. Ops whose output is a pure function of
plan-time facts (Shape, Size, Constant, Range, EyeLike...) compute it in the factory and
``run`` copies it into the arena: the arena slot may be reused by other values between steps.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided
from onnx import numpy_helper

from .. import onednn
from ..domains import INTERNAL_DOMAIN
from ..dtypes import is_float
from ..hookspecs import hookimpl
from ..opdef import BROADCASTS, LAYOUT_ONLY, PLAIN_ONLY, STRIDED_TO_PLAIN, OpDef, bounded_like_input
from .elementwise import largest_input_bound

DATA_INPUT = (0,)  # the data input: shapes, indices, axes and pads never receive a gradient

# ---- helpers -------------------------------------------------------------------------------


def positive_axis(axis: int, rank: int) -> int:
    """``axis`` counted from the front (ONNX's negative axes count from the back)."""
    return int(axis) + rank if int(axis) < 0 else int(axis)


def _ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _split_axes(a: np.ndarray, splits: dict[int, tuple[int, ...]]) -> np.ndarray:
    """A view of ``a`` with axis ``i`` split row-major into ``splits[i]`` (any strides).

    One logical axis has one stride, so splitting it is always a view, unlike ``reshape`` of a
    non-contiguous array."""
    shape, strides = [], []
    for i, (n, st) in enumerate(zip(a.shape, a.strides)):
        if i not in splits:
            shape.append(n)
            strides.append(st)
            continue
        sizes = splits[i]
        sub, acc = [], st
        for s in reversed(sizes):
            sub.append(acc)
            acc *= s
        shape.extend(sizes)
        strides.extend(reversed(sub))
    return as_strided(a, tuple(shape), tuple(strides), writeable=True)


def _copy_regrouped(ctx):
    """Reshape/Flatten/Squeeze/Unsqueeze when the output cannot alias the input: a copy.

    Both are plain (PLAIN_ONLY), i.e. C-contiguous, so the reshape below is a view."""
    shape = ctx.outputs[0].shape

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0].reshape(shape))

    return run


def _constant_output(value: np.ndarray):
    """A kernel writing a plan-time value into its output slot each step."""

    def run(ins, outs, ws):
        np.copyto(outs[0], value)

    return run


# ---- reshaping (views when the layouts allow) ------------------------------------------------


def reshape_target(in_shape, shape, allowzero: bool) -> tuple[int, ...]:
    """Reshape's output shape: ``0`` copies the input dimension unless ``allowzero``; one ``-1``
    is inferred."""
    out = [in_shape[i] if d == 0 and not allowzero else d for i, d in enumerate(shape)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = math.prod(in_shape) // known if known else 0
    return tuple(out)


def reshape_numpy(ctx):
    shape = _ints(ctx.const(1)) if ctx.since_version >= 5 else list(ctx.attrs["shape"])
    target = reshape_target(ctx.inputs[0].shape, shape, bool(ctx.attrs.get("allowzero", 0)))
    if target != tuple(ctx.outputs[0].shape):
        raise ctx.error(f"shape {shape} gives {list(target)}, but inference says "
                        f"{list(ctx.outputs[0].shape)}")
    return _copy_regrouped(ctx)


# below this many elements NumPy's strided copy costs about what oneDNN's call does
_ONEDNN_TRANSPOSE_MIN = 4096


def onednn_transpose(ctx, perm: tuple[int, ...]):
    """A float32 Transpose as one oneDNN reorder (x's strides permuted into y's layout):
    vectorised and on its threads, where ``np.copyto`` of a transposed view is one strided
    element loop (BERT's [8, 64, 4, 64] -> [8, 4, 64, 64]: 29 vs 18 us alone; a [512, 1024]
    matrix: 2.1 vs 0.36 ms; 2 threads, 2026-12-02). The copy moves bits: NaN payloads, -0 and
    infinities come through unchanged. None for other dtypes, small tensors, or where oneDNN
    is not there or offers only its reference loop."""
    x, y = ctx.inputs[0], ctx.outputs[0]
    if x.dtype != np.float32 or y.dtype != np.float32 or not 1 <= len(perm) <= onednn.MAX_DIMS \
            or math.prod(y.shape) < _ONEDNN_TRANSPOSE_MIN or not onednn.available():
        return None
    x_strides = x.layout.view_strides(4)
    src = onednn.MemoryDesc.strided(y.shape, [x_strides[p] for p in perm])
    dst = onednn.MemoryDesc.strided(y.shape, y.layout.view_strides(4))
    return onednn.source_to_destination_step(ctx, lambda: onednn.reorder(src, dst), src, dst)


def transpose_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    perm = tuple(ctx.attrs["perm"]) if "perm" in ctx.attrs else tuple(reversed(range(rank)))
    fast = onednn_transpose(ctx, perm)
    if fast is not None:
        return fast

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0].transpose(perm))

    return run


# ---- joining and splitting ------------------------------------------------------------------


# Concat-1 and Split-1 give ``axis`` no schema default; their docs say 1 and (as Split-2) 0.
CONCAT1_AXIS, SPLIT1_AXIS = 1, 0


def concat_numpy(ctx):
    rank = len(ctx.outputs[0].shape)
    axis = positive_axis(ctx.attrs.get("axis", CONCAT1_AXIS), rank)
    regions, start = [], 0
    for info in ctx.inputs:
        n = info.shape[axis]
        regions.append((slice(None),) * axis + (slice(start, start + n),))
        start += n

    def run(ins, outs, ws):
        y = outs[0]
        for x, region in zip(ins, regions):
            np.copyto(y[region], x)

    return run


def split_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    axis = positive_axis(ctx.attrs.get("axis", SPLIT1_AXIS), rank)
    # The sizes (from the attribute, input 1, num_outputs or an even split) are already in
    # the inferred output shapes.
    regions, start = [], 0
    for info in ctx.outputs:
        n = info.shape[axis] if info is not None else 0
        regions.append((slice(None),) * axis + (slice(start, start + n),))
        start += n

    def run(ins, outs, ws):
        x = ins[0]
        for y, region in zip(outs, regions):
            if y is not None:
                np.copyto(y, x[region])

    return run


# ---- slicing ---------------------------------------------------------------------------------


def slice_index(shape, starts, ends, axes, steps) -> tuple:
    """Python slices implementing ONNX Slice (negative indices, clamping, negative steps)."""
    index = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = positive_axis(axis, len(shape))
        dim = shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, end if end >= 0 else None, step)
    return tuple(index)


def slice_args(since_version: int, attrs, const) -> tuple[list, list, list, list]:
    """Slice's (starts, ends, axes, steps) from the attributes (<10) or the inputs;
    ``const(i)`` is input i's plan-time value."""
    if since_version < 10:
        starts, ends = attrs["starts"], attrs["ends"]
        axes = attrs.get("axes", range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(const(1)), _ints(const(2))
        axes = _ints(const(3)) if const(3) is not None else range(len(starts))
        steps = _ints(const(4)) if const(4) is not None else [1] * len(starts)
    return [int(v) for v in starts], [int(v) for v in ends], [int(v) for v in axes], \
        [int(v) for v in steps]


def slice_numpy(ctx):
    starts, ends, axes, steps = slice_args(ctx.since_version, ctx.attrs, ctx.const)
    if 0 in steps:
        raise ctx.error("Slice steps must not be 0")
    index = slice_index(ctx.inputs[0].shape, starts, ends, axes, steps)

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0][index])

    return run


# ---- generators -----------------------------------------------------------------------------


def _sparse_to_dense(sparse) -> np.ndarray:
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def constant_value(ctx) -> np.ndarray:
    """Constant's output: its attribute as an array of the output's dtype and shape."""
    info, attrs = ctx.outputs[0], ctx.attrs
    if "value" in attrs:
        value = attrs["value"]
    elif "sparse_value" in attrs:
        value = _sparse_to_dense(attrs["sparse_value"])
    else:
        key = next(k for k in ("value_float", "value_floats", "value_int", "value_ints")
                   if k in attrs)
        value = attrs[key]
    return np.asarray(value, info.dtype).reshape(info.shape)


def constant_numpy(ctx):
    return _constant_output(constant_value(ctx))


def constant_of_shape_fill(ctx) -> np.ndarray:
    """ConstantOfShape's fill: its ``value`` attribute (0 without one) in the output dtype."""
    value = ctx.attrs.get("value")
    fill = np.asarray(value).reshape(-1)[0] if value is not None else 0
    return np.asarray(fill, ctx.outputs[0].dtype)


def constant_of_shape_numpy(ctx):
    fill = constant_of_shape_fill(ctx)

    def run(ins, outs, ws):
        outs[0].fill(fill)

    return run


def shape_value(ctx) -> np.ndarray:
    """Shape's output (attributes start / end, clamped), an int64 vector."""
    shape = ctx.inputs[0].logical_shape
    rank = len(shape)
    start = positive_axis(ctx.attrs.get("start", 0), rank)
    end = positive_axis(ctx.attrs.get("end", rank), rank)
    start, end = min(max(start, 0), rank), min(max(end, 0), rank)
    return np.array(shape[start:end], np.int64)


def shape_numpy(ctx):
    return _constant_output(shape_value(ctx))


def size_value(ctx) -> np.ndarray:
    return np.array(math.prod(ctx.inputs[0].logical_shape), np.int64)


def size_numpy(ctx):
    return _constant_output(size_value(ctx))


def range_value(ctx) -> np.ndarray:
    """Range's output: computed in float64 (int64 for integers), then cast."""
    start, delta = (np.asarray(ctx.const(i)).reshape(()) for i in (0, 2))
    info = ctx.outputs[0]
    work = np.float64 if is_float(info.dtype) else np.int64
    value = (start.astype(work) + np.arange(info.shape[0], dtype=work) * delta.astype(work))
    return value.astype(info.dtype)


def range_numpy(ctx):
    return _constant_output(range_value(ctx))


def eye_like_value(ctx) -> np.ndarray:
    info = ctx.outputs[0]
    return np.eye(info.shape[0], info.shape[1], int(ctx.attrs.get("k", 0)), dtype=info.dtype)


def eye_like_numpy(ctx):
    return _constant_output(eye_like_value(ctx))


# ---- tiling, broadcasting -------------------------------------------------------------------


def tile_numpy(ctx):
    in_shape, out_shape = ctx.inputs[0].shape, ctx.outputs[0].shape
    # The repeats are in the inferred output shape (Tile-1's tiles/axis inputs too).
    splits = {a: (o // n if n else 0, n) for a, (n, o) in enumerate(zip(in_shape, out_shape))}
    spread = (None, slice(None)) * len(in_shape)

    def run(ins, outs, ws):
        if outs[0].size:
            np.copyto(_split_axes(outs[0], splits), ins[0][spread])

    return run


def expand_numpy(ctx):
    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])  # broadcasts to the output shape

    return run


# ---- block rearrangements, triangles --------------------------------------------------------


def depth_to_space_numpy(ctx):
    bs = int(ctx.attrs["blocksize"])
    n, c, h, w = ctx.inputs[0].shape
    cb = c // (bs * bs)
    # Before v28 of SpaceToDepth / v11 of DepthToSpace there is no mode: the order is DCR.
    crd = ctx.attrs.get("mode", "DCR") == "CRD"
    x_split = {1: (cb, bs, bs)} if crd else {1: (bs, bs, cb)}
    perm = (0, 1, 4, 2, 5, 3) if crd else (0, 3, 4, 1, 5, 2)
    y_split = {2: (h, bs), 3: (w, bs)}

    def run(ins, outs, ws):
        np.copyto(_split_axes(outs[0], y_split), _split_axes(ins[0], x_split).transpose(perm))

    return run


def space_to_depth_numpy(ctx):
    bs = int(ctx.attrs["blocksize"])
    n, c, h, w = ctx.inputs[0].shape
    crd = ctx.attrs.get("mode", "DCR") == "CRD"
    x_split = {2: (h // bs, bs), 3: (w // bs, bs)}  # [n, c, h', bh, w', bw]
    perm = (0, 1, 3, 5, 2, 4) if crd else (0, 3, 5, 1, 2, 4)
    y_split = {1: (c, bs, bs)} if crd else {1: (bs, bs, c)}

    def run(ins, outs, ws):
        np.copyto(_split_axes(outs[0], y_split), _split_axes(ins[0], x_split).transpose(perm))

    return run


def trilu_numpy(ctx):
    rows, cols = ctx.inputs[0].shape[-2:]
    k = int(np.asarray(ctx.const(1)).reshape(-1)[0]) if ctx.has_input(1) else 0
    keep = np.triu(np.ones((rows, cols), bool), k) if ctx.attrs["upper"] else \
        np.tril(np.ones((rows, cols), bool), k)
    drop = ~keep

    def run(ins, outs, ws):
        # Two masked copies, not a multiply: inf * 0 would give nan.
        np.copyto(outs[0], ins[0], where=keep)
        np.copyto(outs[0], 0, where=drop)

    return run


# ---- backward ops (domain ai.tr_onnx) -------------------------------------------------------
# Named backward steps that no short chain of standard ops does well. Each writes a gradient
# shaped like the forward input (``ctx.outputs[0]``) from ``gy`` (input 0).


def slice_grad_numpy(ctx):
    """``gx = 0; gx[slice] = gy`` for any steps (negative, non-unit) and clamped bounds; attrs
    ``starts``, ``ends``, ``axes`` (non-negative), ``steps`` as the forward Slice resolved them."""
    a = ctx.attrs
    index = slice_index(ctx.outputs[0].shape, a["starts"], a["ends"], a["axes"], a["steps"])

    def run(ins, outs, ws):
        outs[0].fill(0)
        outs[0][index] = ins[0]

    return run


# ---- gradient rules -------------------------------------------------------------------------
# Each returns one entry per forward input; index/shape inputs never get one (``grad_inputs``).


def reshape_to(b, v, shape):
    """``v`` reshaped to ``shape`` (no node when it already has it)."""
    shape = tuple(shape)
    if tuple(v.shape) == shape:
        return v
    return b.op("Reshape", [v, b.ints(shape)], {"allowzero": 1}, shapes=[(shape, v.dtype)])


def zeros_like(b, v):
    """Zeros shaped like ``v``, made each step (ConstantOfShape) rather than stored."""
    return b.op("ConstantOfShape", [b.ints(v.shape)],
                {"value": numpy_helper.from_array(np.zeros(1, v.dtype))}, like=v)


def first_only(node, gx) -> list:
    """``[gx, None, ...]``: a rule's answer when only the data input gets a gradient."""
    return [gx] + [None] * (len(node.inputs) - 1)


def _const_of(node):
    """``const(i)``: the plan-time value of input i of a forward node (None if absent)."""
    def const(i):
        v = node.inputs[i] if i < len(node.inputs) else None
        return v.data if v is not None else None
    return const


def regroup_vjp(b, node, gys, needed):
    """Reshape/Flatten/Squeeze/Unsqueeze: gy reshaped back."""
    return first_only(node, reshape_to(b, gys[0], node.inputs[0].shape))


def transpose_vjp(b, node, gys, needed):
    x = node.inputs[0]
    perm = node.attrs.get("perm", list(reversed(range(x.rank))))
    inverse = [int(p) for p in np.argsort(perm)]
    return [b.op("Transpose", [gys[0]], {"perm": inverse}, like=x)]


def concat_vjp(b, node, gys, needed):
    """One Split of gy (a Slice when only one input needs its part)."""
    gy, xs = gys[0], node.inputs
    if len(xs) == 1:
        return [gy]
    axis = positive_axis(node.attrs.get("axis", CONCAT1_AXIS), gy.rank)
    sizes = [x.shape[axis] for x in xs]
    if sum(needed) == 1:
        i = needed.index(True)
        start = sum(sizes[:i])
        part = b.op("Slice", [gy, b.ints([start]), b.ints([start + sizes[i]]), b.ints([axis])],
                    like=xs[i])
        return [part if j == i else None for j in range(len(xs))]
    parts = b.op("Split", [gy, b.ints(sizes)], {"axis": axis}, like=list(xs))
    return [p if need else None for p, need in zip(parts, needed)]


def split_vjp(b, node, gys, needed):
    """Concat of the output gradients; zeros for outputs nothing differentiates."""
    x = node.inputs[0]
    parts = [g if g is not None else zeros_like(b, y) for g, y in zip(gys, node.outputs)]
    if len(parts) == 1:
        return first_only(node, parts[0])
    axis = positive_axis(node.attrs.get("axis", SPLIT1_AXIS), x.rank)
    return first_only(node, b.op("Concat", parts, {"axis": axis}, like=x))


def slice_vjp(b, node, gys, needed):
    """Unit steps: gy zero-padded back to x's shape (Pad). Other steps: SliceGrad."""
    x, gy = node.inputs[0], gys[0]
    starts, ends, axes, steps = slice_args(node.since_version, node.attrs, _const_of(node))
    axes = [positive_axis(a, x.rank) for a in axes]
    index = slice_index(x.shape, starts, ends, axes, steps)
    if gy.shape and 0 in gy.shape:
        return first_only(node, zeros_like(b, x))
    if all(s.step in (None, 1) for s in index):
        begin = [s.start or 0 for s in index]
        end = [n - (s.stop if s.stop is not None else n) for s, n in zip(index, x.shape)]
        if not any(begin) and not any(end):
            return first_only(node, gy)
        return first_only(node, b.op("Pad", [gy, b.ints(begin + end)], {"mode": "constant"},
                                 like=x))
    attrs = {"starts": starts, "ends": ends, "axes": axes, "steps": steps}
    return first_only(node, b.op("SliceGrad", [gy], attrs, domain=INTERNAL_DOMAIN, like=x))


def expand_vjp(b, node, gys, needed):
    return first_only(node, b.unbroadcast(gys[0], node.inputs[0].shape))


def tile_vjp(b, node, gys, needed):
    """gy split into (repeats, n) per tiled axis and summed over the repeats."""
    x, gy = node.inputs[0], gys[0]
    if x.shape and 0 in x.shape:
        return first_only(node, zeros_like(b, x))
    split, axes = [], []
    for n, o in zip(x.shape, gy.shape):
        if o != n:
            axes.append(len(split))
            split.append(o // n)
        split.append(n)
    if not axes:
        return first_only(node, gy)
    g = reshape_to(b, gy, split)
    return first_only(node, b.op("ReduceSum", [g, b.ints(axes)], {"keepdims": 0}, like=x))


def depth_to_space_vjp(b, node, gys, needed):
    """The inverse rearrangement. SpaceToDepth of opset 17 knows only the DCR order, so
    CRD's inverse is spelled as Reshape -> Transpose -> Reshape."""
    x, gy = node.inputs[0], gys[0]
    bs = int(node.attrs["blocksize"])
    if node.attrs.get("mode", "DCR") == "DCR":
        return [b.op("SpaceToDepth", [gy], {"blocksize": bs}, like=x)]
    n, c, h, w = x.shape
    g = reshape_to(b, gy, (n, c // (bs * bs), h, bs, w, bs))
    g = b.op("Transpose", [g], {"perm": [0, 1, 3, 5, 2, 4]},
             shapes=[((n, c // (bs * bs), bs, bs, h, w), gy.dtype)])
    return [reshape_to(b, g, x.shape)]


def space_to_depth_vjp(b, node, gys, needed):
    mode = node.attrs.get("mode", "DCR")
    return [b.op("DepthToSpace", [gys[0]], {"blocksize": int(node.attrs["blocksize"]),
                                            "mode": mode}, like=node.inputs[0])]


def trilu_vjp(b, node, gys, needed):
    """The same triangle of gy."""
    return first_only(node, b.op("Trilu", [gys[0]] + node.inputs[1:],
                             {"upper": int(node.attrs["upper"])}, like=node.inputs[0]))


# ---- registration ---------------------------------------------------------------------------

_ALIAS = {"layout": PLAIN_ONLY, "alias_output": True, "differentiable": True,
          "gradient": regroup_vjp, "grad_inputs": (0,), "forwards_params": True,
          "value_bounds": bounded_like_input, "traits": frozenset({LAYOUT_ONLY})}
_NONE = {"differentiable": False}


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Reshape", (1, 5, 13, 14, 19, 21, 23, 24, 25), {"numpy": reshape_numpy},
              const_inputs=(1,), **_ALIAS),
        OpDef("Flatten", (1, 9, 11, 13, 21, 23, 24, 25), {"numpy": _copy_regrouped}, **_ALIAS),
        OpDef("Squeeze", (1, 11, 13, 21, 23, 24, 25), {"numpy": _copy_regrouped},
              const_inputs=(1,), **_ALIAS),
        OpDef("Unsqueeze", (1, 11, 13, 21, 23, 24, 25), {"numpy": _copy_regrouped},
              const_inputs=(1,), **_ALIAS),
        OpDef("Transpose", (1, 13, 21, 23, 24, 25), {"numpy": transpose_numpy},
              layout=STRIDED_TO_PLAIN, differentiable=True, gradient=transpose_vjp,
              forwards_params=True, value_bounds=bounded_like_input,
              traits=frozenset({LAYOUT_ONLY})),
        OpDef("Concat", (1, 4, 11, 13), {"numpy": concat_numpy}, differentiable=True,
              gradient=concat_vjp, param_inputs="all", param_min_size=2,
              value_bounds=largest_input_bound),
        OpDef("Split", (1, 2, 11, 13, 18), {"numpy": split_numpy}, const_inputs=(1,),
              differentiable=True, gradient=split_vjp, grad_inputs=DATA_INPUT,
              forwards_params=True),
        OpDef("Slice", (1, 10, 11, 13), {"numpy": slice_numpy}, const_inputs=(1, 2, 3, 4),
              differentiable=True, gradient=slice_vjp, grad_inputs=DATA_INPUT,
              forwards_params=True, value_bounds=bounded_like_input),
        OpDef("Constant", (1, 9, 11, 12, 13, 19, 21, 23, 24, 25), {"numpy": constant_numpy},
              **_NONE),
        OpDef("ConstantOfShape", (9, 20, 21, 23, 24, 25), {"numpy": constant_of_shape_numpy},
              const_inputs=(0,), **_NONE),
        OpDef("Shape", (1, 13, 15, 19, 21, 23, 24, 25), {"numpy": shape_numpy}, **_NONE),
        OpDef("Size", (1, 13, 19, 21, 23, 24, 25), {"numpy": size_numpy}, **_NONE),
        OpDef("Expand", (8, 13), {"numpy": expand_numpy}, const_inputs=(1,),
              differentiable=True, gradient=expand_vjp, grad_inputs=DATA_INPUT,
              forwards_params=True, value_bounds=bounded_like_input,
              traits=frozenset({BROADCASTS})),
        OpDef("Tile", (1, 6, 13), {"numpy": tile_numpy}, const_inputs=(1, 2),
              differentiable=True, gradient=tile_vjp, grad_inputs=DATA_INPUT,
              forwards_params=True, value_bounds=bounded_like_input,
              traits=frozenset({BROADCASTS})),
        OpDef("Range", (11, 27), {"numpy": range_numpy}, const_inputs=(0, 1, 2), **_NONE),
        OpDef("Trilu", (14,), {"numpy": trilu_numpy}, const_inputs=(1,), differentiable=True,
              gradient=trilu_vjp, grad_inputs=DATA_INPUT),
        OpDef("DepthToSpace", (1, 11, 13, 28), {"numpy": depth_to_space_numpy},
              differentiable=True, gradient=depth_to_space_vjp, value_bounds=bounded_like_input),
        OpDef("SpaceToDepth", (1, 13, 28), {"numpy": space_to_depth_numpy},
              differentiable=True, gradient=space_to_depth_vjp, value_bounds=bounded_like_input),
        OpDef("EyeLike", (9, 22), {"numpy": eye_like_numpy}, **_NONE),
        # backward-only ops of the rules above
        OpDef("SliceGrad", (1,), {"numpy": slice_grad_numpy}, domain=INTERNAL_DOMAIN,
              doc="gradient of Slice: gy written into zeros at the slice"),
    ]
