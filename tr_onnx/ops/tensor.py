"""Tensor manipulation: reshaping, transposing, joining, splitting, slicing, gathering, padding
and the small generators (Constant, Shape, Range, EyeLike...).

Output shapes come from ONNX shape inference (``ctx.outputs[i].shape``); factories read the
shape-determining inputs (``const_inputs``) only where the kernel needs more than the output
shape (Slice's steps, Pad's offsets). Kernels read and write logical views; where an output
is the input regrouped (Tile, DepthToSpace) they write through a strided view of the output
that splits its axes, so nothing is copied twice. Ops whose output is a pure function of
plan-time facts (Shape, Size, Constant, Range, EyeLike...) compute it in the factory and
``run`` copies it into the arena: the arena slot may be reused by other values between steps.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, STRIDED_TO_PLAIN, OpDef

# ---- helpers -------------------------------------------------------------------------------


def _axis(axis: int, rank: int) -> int:
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


def transpose_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    perm = tuple(ctx.attrs["perm"]) if "perm" in ctx.attrs else tuple(reversed(range(rank)))

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0].transpose(perm))

    return run


# ---- joining and splitting ------------------------------------------------------------------


def concat_numpy(ctx):
    rank = len(ctx.outputs[0].shape)
    axis = _axis(ctx.attrs["axis"], rank)
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
    axis = _axis(ctx.attrs["axis"], rank)
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


# ---- slicing and gathering ------------------------------------------------------------------


def slice_index(shape, starts, ends, axes, steps) -> tuple:
    """Python slices implementing ONNX Slice (negative indices, clamping, negative steps)."""
    index = [slice(None)] * len(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, len(shape))
        dim = shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, end if end >= 0 else None, step)
    return tuple(index)


def slice_numpy(ctx):
    shape = ctx.inputs[0].shape
    if ctx.since_version < 10:
        starts, ends = ctx.attrs["starts"], ctx.attrs["ends"]
        axes = ctx.attrs.get("axes", range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(ctx.const(1)), _ints(ctx.const(2))
        axes = _ints(ctx.const(3)) if ctx.has_input(3) else range(len(starts))
        steps = _ints(ctx.const(4)) if ctx.has_input(4) else [1] * len(starts)
    if 0 in steps:
        raise ctx.error("Slice steps must not be 0")
    index = slice_index(shape, [int(s) for s in starts], [int(e) for e in ends], list(axes),
                        steps)

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0][index])

    return run


def gather_numpy(ctx):
    axis = _axis(ctx.attrs["axis"], len(ctx.inputs[0].shape))

    def run(ins, outs, ws):
        np.take(ins[0], ins[1], axis=axis, out=outs[0])

    return run


def gather_elements_numpy(ctx):
    axis = _axis(ctx.attrs["axis"], len(ctx.inputs[0].shape))

    def run(ins, outs, ws):
        # take_along_axis has no out=: one temporary the size of the output.
        np.copyto(outs[0], np.take_along_axis(ins[0], ins[1].astype(np.intp, copy=False), axis))

    return run


def gather_nd_numpy(ctx):
    b = int(ctx.attrs.get("batch_dims", 0))
    idx_rank = len(ctx.inputs[1].shape)
    k = ctx.inputs[1].shape[-1]
    # Broadcastable aranges over the batch axes, against indices[..., j] (rank idx_rank - 1).
    grids = tuple(np.arange(n).reshape((1,) * i + (n,) + (1,) * (idx_rank - 2 - i))
                  for i, n in enumerate(ctx.inputs[1].shape[:b]))

    def run(ins, outs, ws):
        idx = ins[1]
        # Advanced indexing has no out=: one temporary the size of the output.
        np.copyto(outs[0], ins[0][grids + tuple(idx[..., j] for j in range(k))])

    return run


_SCATTER_REDUCE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def scatter_elements_numpy(ctx):
    shape = ctx.inputs[2].shape
    axis = _axis(ctx.attrs["axis"], len(shape))
    reduce = _SCATTER_REDUCE.get(ctx.attrs.get("reduction", "none"))
    grids = np.indices(shape, sparse=True)  # broadcastable aranges over the updates' axes

    def run(ins, outs, ws):
        y = outs[0]
        np.copyto(y, ins[0])
        index = tuple(ins[1] if a == axis else g for a, g in enumerate(grids))
        if reduce is None:
            y[index] = ins[2]  # repeated indices: the last update wins, as in the reference
        else:
            reduce.at(y, index, ins[2])

    return run


# ---- generators -----------------------------------------------------------------------------


def _sparse_to_dense(sparse) -> np.ndarray:
    from onnx import numpy_helper

    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def constant_numpy(ctx):
    info, attrs = ctx.outputs[0], ctx.attrs
    if "value" in attrs:
        value = attrs["value"]
    elif "sparse_value" in attrs:
        value = _sparse_to_dense(attrs["sparse_value"])
    else:
        key = next(k for k in ("value_float", "value_floats", "value_int", "value_ints")
                   if k in attrs)
        value = attrs[key]
    return _constant_output(np.asarray(value, info.dtype).reshape(info.shape))


def constant_of_shape_numpy(ctx):
    value = ctx.attrs.get("value")
    fill = np.asarray(value).reshape(-1)[0] if value is not None else 0
    fill = np.asarray(fill, ctx.outputs[0].dtype)

    def run(ins, outs, ws):
        outs[0].fill(fill)

    return run


def shape_numpy(ctx):
    shape = ctx.inputs[0].logical_shape
    rank = len(shape)
    start = _axis(ctx.attrs.get("start", 0), rank)
    end = _axis(ctx.attrs.get("end", rank), rank)
    start, end = min(max(start, 0), rank), min(max(end, 0), rank)
    return _constant_output(np.array(shape[start:end], np.int64))


def size_numpy(ctx):
    return _constant_output(np.array(math.prod(ctx.inputs[0].logical_shape), np.int64))


def range_numpy(ctx):
    start, delta = (np.asarray(ctx.const(i)).reshape(()) for i in (0, 2))
    info = ctx.outputs[0]
    work = np.float64 if info.dtype.kind == "f" else np.int64
    value = (start.astype(work) + np.arange(info.shape[0], dtype=work) * delta.astype(work))
    return _constant_output(value.astype(info.dtype))


def eye_like_numpy(ctx):
    info = ctx.outputs[0]
    return _constant_output(np.eye(info.shape[0], info.shape[1], int(ctx.attrs.get("k", 0)),
                                   dtype=info.dtype))


def one_hot_numpy(ctx):
    axis = _axis(ctx.attrs["axis"], len(ctx.outputs[0].shape))
    depth = int(np.asarray(ctx.const(1)).reshape(-1)[0])
    rank = len(ctx.outputs[0].shape)
    positions = np.arange(depth).reshape((1,) * axis + (depth,) + (1,) * (rank - axis - 1))
    wrapped = positions - depth  # negative indices in [-depth, -1] count from the end
    hit, hit_wrapped = (ctx.workspace(ctx.outputs[0].shape, np.bool_) for _ in range(2))
    expand = (slice(None),) * axis + (None,)

    def run(ins, outs, ws):
        idx, values, y = ins[0][expand], ins[2], outs[0]
        np.equal(idx, positions, out=ws[hit])
        np.equal(idx, wrapped, out=ws[hit_wrapped])
        np.logical_or(ws[hit], ws[hit_wrapped], out=ws[hit])
        y.fill(values[0])
        np.copyto(y, values[1], where=ws[hit])

    return run


# ---- padding, tiling, broadcasting ----------------------------------------------------------


def _pad_source(t: int, n: int, mode: str) -> int:
    """Where position ``t`` (relative to the first input element) reads from, in [0, n)."""
    if mode == "edge":
        return min(max(t, 0), n - 1)
    if mode == "wrap":
        return t % n
    if n == 1:  # reflect
        return 0
    period = 2 * (n - 1)
    t %= period
    return period - t if t >= n else t


def _copy_runs(dst: list[int], src: list[int]) -> list[tuple[slice, slice]]:
    """Group ``out[dst[i]] = out[src[i]]`` into slice copies (source step +1, -1 or 0)."""
    runs: list[list[int]] = []  # [dst0, src0, step, length]
    for d, s in zip(dst, src):
        if runs:
            d0, s0, step, length = runs[-1]
            if d == d0 + length and (
                    (length == 1 and s - s0 in (-1, 0, 1)) or s == s0 + step * length):
                runs[-1] = [d0, s0, s - s0 if length == 1 else step, length + 1]
                continue
        runs.append([d, s, 0, 1])
    slices = []
    for d0, s0, step, length in runs:
        if step == 0:
            src_slice = slice(s0, s0 + 1)  # broadcast one element
        else:
            stop = s0 + step * length
            src_slice = slice(s0, stop if stop >= 0 else None, step)
        slices.append((slice(d0, d0 + length), src_slice))
    return slices


def pad_numpy(ctx):
    in_shape = ctx.inputs[0].shape
    rank = len(in_shape)
    mode = ctx.attrs["mode"]
    if ctx.since_version < 11:
        pads = list(ctx.attrs["pads"] if "pads" in ctx.attrs else ctx.attrs["paddings"])
        axes = list(range(rank))
        value = ctx.attrs["value"]
    else:
        pads = _ints(ctx.const(1))
        axes = [_axis(a, rank) for a in _ints(ctx.const(3))] if ctx.has_input(3) else \
            list(range(rank))
        value = None  # input 2, read at run time (or 0 when absent)
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[i + len(axes)]
    # Negative pads crop the input; the rest pads around what remains.
    crop = tuple(slice(max(-b, 0), n - max(-e, 0)) for b, e, n in zip(begin, end, in_shape))
    lo, hi = [max(b, 0) for b in begin], [max(e, 0) for e in end]
    kept = [s.stop - s.start for s in crop]
    interior = tuple(slice(lo[a], lo[a] + kept[a]) for a in range(rank))
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise ctx.error(f"unknown Pad mode {mode!r}")
    if mode != "constant" and any((lo[a] or hi[a]) and kept[a] == 0 for a in range(rank)):
        raise ctx.error(f"Pad mode {mode!r} cannot pad an empty axis")
    # Axes are padded one after another; axis a's border is filled over the full extent of
    # the axes before it (already padded) and the interior of the axes after it.
    steps = []
    for a in range(rank):
        if not lo[a] and not hi[a]:
            continue
        region = tuple(slice(None) if b < a else interior[b] if b > a else slice(None)
                       for b in range(rank))
        border = list(range(lo[a])) + list(range(lo[a] + kept[a], lo[a] + kept[a] + hi[a]))
        head = (slice(None),) * a
        if mode == "constant":
            fills = [head + (slice(0, lo[a]),), head + (slice(lo[a] + kept[a], None),)]
            steps.append((region, fills, None))
        else:
            src = [lo[a] + _pad_source(j - lo[a], kept[a], mode) for j in border]
            copies = [(head + (d,), head + (s,)) for d, s in _copy_runs(border, src)]
            steps.append((region, None, copies))

    def run(ins, outs, ws):
        y = outs[0]
        np.copyto(y[interior], ins[0][crop])
        fill = value if value is not None else ins[2] if len(ins) > 2 and ins[2] is not None \
            else 0
        for region, fills, copies in steps:
            v = y[region]
            if fills is not None:
                for f in fills:
                    np.copyto(v[f], fill)
            else:
                for d, s in copies:
                    np.copyto(v[d], v[s])

    return run


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


# ---- block rearrangements, triangles, scans, selection, einsum ------------------------------


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


def cumsum_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    axis = _axis(int(np.asarray(ctx.const(1)).reshape(-1)[0]), rank)
    head = (slice(None),) * axis
    order = head + (slice(None, None, -1) if ctx.attrs["reverse"] else slice(None),)
    exclusive = bool(ctx.attrs["exclusive"])

    def run(ins, outs, ws):
        x, y = ins[0][order], outs[0][order]
        if exclusive:
            if y.shape[axis]:
                y[head + (0,)] = 0
                np.cumsum(x[head + (slice(None, -1),)], axis=axis,
                          out=y[head + (slice(1, None),)])
        else:
            np.cumsum(x, axis=axis, out=y)

    return run


def top_k_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    axis = _axis(ctx.attrs["axis"], rank)
    n, k = ctx.inputs[0].shape[axis], ctx.outputs[0].shape[axis]
    largest = bool(ctx.attrs.get("largest", 1))
    head = (slice(None),) * axis
    flip = head + (slice(None, None, -1),)
    first_k = head + (slice(0, k),)

    def run(ins, outs, ws):
        x = ins[0]
        # argsort allocates its result; a stable sort keeps equal values in index order. For
        # the largest, sorting the reversed axis ascending and reading it backwards does both.
        if largest:
            order = np.argsort(x[flip], axis=axis, kind="stable")[flip][first_k]
            np.subtract(n - 1, order, out=outs[1])
        else:
            np.copyto(outs[1], np.argsort(x, axis=axis, kind="stable")[first_k])
        np.copyto(outs[0], np.take_along_axis(x, outs[1], axis))  # a temporary of k values

    return run


def einsum_numpy(ctx):
    equation = ctx.attrs["equation"].replace(" ", "")

    def run(ins, outs, ws):
        np.einsum(equation, *ins, out=outs[0])

    return run


# ---- registration ---------------------------------------------------------------------------

_ALIAS = {"layout": PLAIN_ONLY, "alias_output": True, "differentiable": True}


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
              layout=STRIDED_TO_PLAIN, differentiable=True),
        OpDef("Concat", (1, 4, 11, 13), {"numpy": concat_numpy}, differentiable=True),
        OpDef("Split", (1, 2, 11, 13, 18), {"numpy": split_numpy}, const_inputs=(1,),
              differentiable=True),
        OpDef("Slice", (1, 10, 11, 13), {"numpy": slice_numpy}, const_inputs=(1, 2, 3, 4),
              differentiable=True),
        OpDef("Gather", (1, 11, 13), {"numpy": gather_numpy}, differentiable=True),
        OpDef("GatherElements", (11, 13), {"numpy": gather_elements_numpy}, differentiable=True),
        OpDef("GatherND", (11, 12, 13), {"numpy": gather_nd_numpy}, differentiable=True),
        OpDef("ScatterElements", (11, 13, 16, 18), {"numpy": scatter_elements_numpy},
              differentiable=True),
        OpDef("Constant", (1, 9, 11, 12, 13, 19, 21, 23, 24, 25), {"numpy": constant_numpy}),
        OpDef("ConstantOfShape", (9, 20, 21, 23, 24, 25), {"numpy": constant_of_shape_numpy},
              const_inputs=(0,)),
        OpDef("Shape", (1, 13, 15, 19, 21, 23, 24, 25), {"numpy": shape_numpy}),
        OpDef("Size", (1, 13, 19, 21, 23, 24, 25), {"numpy": size_numpy}),
        OpDef("Expand", (8, 13), {"numpy": expand_numpy}, const_inputs=(1,),
              differentiable=True),
        OpDef("Pad", (1, 2, 11, 13, 18, 19, 21, 23, 24, 25), {"numpy": pad_numpy},
              const_inputs=(1, 3), differentiable=True),
        OpDef("Tile", (1, 6, 13), {"numpy": tile_numpy}, const_inputs=(1, 2),
              differentiable=True),
        OpDef("Range", (11, 27), {"numpy": range_numpy}, const_inputs=(0, 1, 2)),
        OpDef("OneHot", (9, 11, 28), {"numpy": one_hot_numpy}, const_inputs=(1,)),
        OpDef("Trilu", (14,), {"numpy": trilu_numpy}, const_inputs=(1,), differentiable=True),
        OpDef("DepthToSpace", (1, 11, 13, 28), {"numpy": depth_to_space_numpy},
              differentiable=True),
        OpDef("SpaceToDepth", (1, 13, 28), {"numpy": space_to_depth_numpy},
              differentiable=True),
        OpDef("EyeLike", (9, 22), {"numpy": eye_like_numpy}),
        OpDef("CumSum", (11, 14), {"numpy": cumsum_numpy}, const_inputs=(1,),
              differentiable=True),
        OpDef("TopK", (1, 10, 11, 24), {"numpy": top_k_numpy}, const_inputs=(1,),
              differentiable=True),
        OpDef("Einsum", (12, 28), {"numpy": einsum_numpy}, differentiable=True),
    ]
