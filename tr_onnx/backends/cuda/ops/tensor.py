"""cuda bindings of ``ops/tensor.py`` (``kernels/tensor.cu``): the data movement (Reshape,
Flatten, Squeeze, Unsqueeze copies, Transpose, Concat, Split, Slice and SliceGrad, Expand,
Tile, DepthToSpace, SpaceToDepth, Pad and PadGrad, Trilu), the scans (CumSum, CumProd,
CumProdGrad) and the plan-time values (Constant, ConstantOfShape, Shape, Size, Range,
EyeLike).

Most of it is one strided copy: each logical axis of source and destination has an element
stride in its physical layout (compact row-major, or ``[N, *S, Cp]`` for a channels-last
tensor, ``bind.logical_strides``); an op is a choice of dims and strides -- an offset and
steps for Slice, stride 0 on Expand's broadcast axes and Tile's repeats, axes split row-major
for Tile and the block rearrangements -- then axes are collapsed where every operand walks
contiguously, and one kernel over at most ``bind.MAX_DIMS`` axes moves the bit patterns.
Pad, Trilu and the scans need each element's coordinates and take the rank left-padded to
six. The movers and scans read and write compact and channels-last tensors (their layout
rule lets a 4-D output follow a channels-last input); the padded lanes of a channels-last
output are zeroed after the node (``pads_after``).

Data movement is exact (bit patterns). PadGrad adds its terms in fp32 (the NumPy kernel adds
them axis by axis in the storage type); CumSum / CumProd run each line in fp32 (long long for
integers), rounded at each store, as NumPy's sequential ``cumsum`` does in float32; CumProdGrad
is NumPy's formula in fp32, its sums sequential.

The plan-time values are the NumPy kernels' (``ops/tensor.py``: ``constant_value``,
``shape_value``...), written into the output by a kernel each step (its slot may hold other
values between steps): a fill where the value is uniform, else up to ``PUT_LIMIT`` elements
passed as kernel arguments; Range and EyeLike have generators of their own.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops import tensor as ops
from ....ops.pad import pad_amounts
from ..bind import (
    MAX_DIMS,
    BindContext,
    Launch,
    Unbound,
    binding,
    collapse,
    const_ints,
    float_dt,
    geometry,
    i32,
    i64,
    logical_strides,
    move_kernel,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, widths
from .elementwise import bind_copy

# ---- kernels/tensor.cu: the family's name table -------------------------------------------------

SCANNED = STORAGE + ({"dt": "i64", "T": "long long"}, {"dt": "i32", "T": "int"})
"""The scans' element types: the storage types (fp32 accumulation) and the integers."""

RANGES = ({"rt": "f32", "T": "float", "W": "double"}, {"rt": "i64", "T": "long long",
                                                        "W": "long long"},
          {"rt": "i32", "T": "int", "W": "long long"})
"""Range's output types and the type it computes in (NumPy's float64 / int64)."""


def tensor_source() -> KernelSource:
    """kernels/tensor.cu: strided copies, Pad and PadGrad, Trilu, the scans, the fills of
    plan-time values and the zeroing of padded lanes (ZeroFill, flags)."""
    moves = widths(1, 2, 4, 8)
    return kernel_source(
        "tensor",
        instantiate("TR_STRIDED_COPY({U}, {bytes})", "tr_strided_copy_b{bytes}", moves),
        instantiate("TR_PAD_MOVE({U}, {bytes})", "tr_pad_b{bytes}", moves),
        instantiate("TR_PAD_GRAD({T}, {dt})", "tr_pad_grad_{dt}", STORAGE),
        instantiate("TR_TRILU({U}, {bytes})", "tr_trilu_b{bytes}", moves),
        instantiate("TR_{SCAN}({T}, {dt})", "tr_{scan}_{dt}",
                    ({"SCAN": "CUMSUM", "scan": "cumsum"}, {"SCAN": "CUMPROD", "scan": "cumprod"}),
                    SCANNED),
        instantiate("TR_CUMPROD_GRAD({T}, {dt})", "tr_cumprod_grad_{dt}", STORAGE),
        instantiate("TR_FILL({U}, {bytes})", "tr_fill_b{bytes}", moves),
        instantiate("TR_PUT({U}, {bytes})", "tr_put_b{bytes}", moves),
        instantiate("TR_EYE({U}, {bytes})", "tr_eye_b{bytes}", moves),
        instantiate("TR_RANGE({T}, {rt}, {W})", "tr_range_{rt}", RANGES),
        instantiate("TR_ZERO_LANES({U}, {bytes})", "tr_zero_lanes_b{bytes}", widths(1, 2, 4)))


KERNELS = tensor_source()

COPY_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
PAD_MODES = {"constant": 0, "reflect": 1, "edge": 2, "wrap": 3}
COPY_LAUNCH_LIMIT = 64
"""The most launches one strided copy is split into when its axes do not collapse to
``MAX_DIMS`` (beyond, the node is refused)."""
PUT_LIMIT = 512
"""The most elements of a non-uniform plan-time value (Constant, Shape, Size) written by
``tr_put`` launches of 8 each: such nodes survive import only as graph outputs (or past
``fold_limit_bytes``); a larger one is refused, never written by thousands of launches."""

# ---- shared helpers (indexing.py and losses.py use them too) --------------------------------

def pads_after(b: BindContext, y) -> list:
    """The zeroing of ``y``'s padded lanes, when it has any (after a strided write)."""
    g = geometry(b.t(y))
    return [b.zero_lanes(y, g)] if g is not None and g.padded else []


def pad_dims6(dims, *stride_sets) -> tuple[list[int], list[list[int]]]:
    """``dims`` and each stride set left-padded to six axes (dims 1, strides 0), for the
    kernels that need each element's coordinates (no collapsing)."""
    if len(dims) > MAX_DIMS:
        raise Unbound(f"rank {len(dims)}; the element-indexed kernels take {MAX_DIMS} axes")
    pad = MAX_DIMS - len(dims)
    return [1] * pad + [int(d) for d in dims], [[0] * pad + [int(s) for s in st]
                                                 for st in stride_sets]


def strided_copy(b: BindContext, x, y, dims, xs, ys, xo: int = 0, yo: int = 0) -> Launch:
    """``y[yo + ys . c] = x[xo + xs . c]`` for every coordinate ``c`` of ``dims``, one launch
    over the collapsed axes (``Unbound`` when more than ``MAX_DIMS`` remain)."""
    d, (sx, sy) = collapse(dims, [xs, ys])
    n = math.prod(d)
    return b.launch(f"tr_strided_copy_{move_kernel(b, y)}", n,
                    [b.buf(x), b.buf(y, True), i64(n), i64(xo), i64(yo)]
                    + [i64(v) for v in d + sx + sy])


def strided_copies(b: BindContext, x, y, dims, xs, ys, xo: int = 0, yo: int = 0,
                   launches: int = COPY_LAUNCH_LIMIT) -> list[Launch]:
    """``strided_copy``, or, when the axes do not collapse to ``MAX_DIMS`` (a Tile of every
    axis of a channels-last map, a rank-7 Transpose), one per index of the leading axes, at
    most ``launches`` of them."""
    try:
        collapse(dims, [xs, ys])
    except Unbound:
        k = next(i for i, n in enumerate(dims) if n != 1)
        if dims[k] > launches:
            raise
        return [c for i in range(dims[k])
                for c in strided_copies(b, x, y, dims[k + 1:], xs[k + 1:], ys[k + 1:],
                                        xo + i * xs[k], yo + i * ys[k], launches // dims[k])]
    return [strided_copy(b, x, y, dims, xs, ys, xo, yo)]


def split_axes(shape, strides, splits: dict[int, tuple[int, ...]]) -> tuple[list, list]:
    """(dims, strides) of a view with axis ``i`` split row-major into ``splits[i]``: the
    strided form of ``ops.tensor._split_axes``."""
    dims, out = [], []
    for i, (n, st) in enumerate(zip(shape, strides)):
        sizes = splits.get(i, (n,))
        sub = [st * math.prod(sizes[k + 1:]) for k in range(len(sizes))]
        dims += list(sizes)
        out += sub
    return dims, out


def zero_all(b: BindContext, v) -> Launch:
    """Every byte of ``v``'s buffer (pads included) zeroed, in the widest word that fits."""
    nbytes = b.t(v).nbytes
    size = next(s for s in (4, 2, 1) if nbytes % s == 0)
    n = nbytes // size
    return b.launch(f"tr_zero_lanes_b{size}", n, [b.buf(v, True), i64(1), i64(0), i64(n)])


def slice_ranges(shape, index) -> tuple[list[int], list[int], list[int]]:
    """(begin, step, count) per axis of the Python slices ``index`` over ``shape``."""
    begin, step, count = [], [], []
    for s, n in zip(index, shape):
        r = range(*s.indices(n))
        begin.append(r.start)
        step.append(r.step)
        count.append(len(r))
    return begin, step, count


def sliced_copy(b: BindContext, src, dst, begin, step, count, into: bool) -> list[Launch]:
    """``dst = src[slice]`` (``into`` False: Slice) or ``dst[slice] = src`` (SliceGrad)."""
    big, small = (dst, src) if into else (src, dst)
    bs = logical_strides(b, big)
    offset = sum(g * s for g, s in zip(begin, bs))
    walked = [st * s for st, s in zip(step, bs)]
    if into:
        return strided_copies(b, src, dst, count, logical_strides(b, small), walked, yo=offset)
    return strided_copies(b, src, dst, count, walked, logical_strides(b, small), xo=offset)


# ---- Transpose, Concat, Split, Slice, SliceGrad ---------------------------------------------

def bind_transpose(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    perm = [int(p) for p in node.attrs.get("perm") or reversed(range(len(shape)))]
    xs = logical_strides(b, x)
    out = tuple(b.t(y).shape)
    return strided_copies(b, x, y, out, [xs[p] for p in perm], logical_strides(b, y)) + \
        pads_after(b, y)


def bind_concat(b: BindContext, node) -> list:
    y = node.outputs[0]
    ins = [v for v in node.inputs if v is not None]
    out = tuple(b.t(y).shape)
    axis = ops.positive_axis(node.attrs.get("axis", ops.CONCAT1_AXIS), len(out))
    ys = logical_strides(b, y)
    calls, at = [], 0
    for v in ins:
        shape = tuple(b.t(v).shape)
        if math.prod(shape):
            calls += strided_copies(b, v, y, shape, logical_strides(b, v), ys,
                                    yo=at * ys[axis])
        at += shape[axis]
    return calls + pads_after(b, y)


def bind_split(b: BindContext, node) -> list:
    """Each output a strided copy out of x (the sizes are in the outputs' inferred shapes)."""
    x = node.inputs[0]
    rank = len(b.t(x).shape)
    axis = ops.positive_axis(node.attrs.get("axis", ops.SPLIT1_AXIS), rank)
    xs = logical_strides(b, x)
    calls, at = [], 0
    for y in node.outputs:
        if y is None:
            continue  # numpy's split_numpy counts an absent output as 0 wide, so does this
        shape = tuple(b.t(y).shape)
        if math.prod(shape):
            calls += strided_copies(b, x, y, shape, xs, logical_strides(b, y),
                                    xo=at * xs[axis]) + pads_after(b, y)
        at += shape[axis]
    return calls


def bind_slice(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    ins = list(node.inputs) + [None] * 5
    starts, ends, axes, steps = ops.slice_args(
        node.since_version, node.attrs,
        lambda i: None if ins[i] is None else const_ints(ins[i], "Slice's bounds"))
    if 0 in steps:
        raise Unbound("Slice steps must not be 0")
    begin, step, count = slice_ranges(shape, ops.slice_index(shape, starts, ends, axes, steps))
    if tuple(count) != tuple(b.t(y).shape):
        raise Unbound(f"slice gives {count}, the output is {list(b.t(y).shape)}")
    if not math.prod(count):
        return []
    return sliced_copy(b, x, y, begin, step, count, into=False) + pads_after(b, y)


def bind_slice_grad(b: BindContext, node) -> list:
    """gx zeroed, then gy copied into its slice."""
    gy, gx = node.inputs[0], node.outputs[0]
    a = node.attrs
    shape = tuple(b.t(gx).shape)
    index = ops.slice_index(shape, a["starts"], a["ends"], a["axes"], a["steps"])
    begin, step, count = slice_ranges(shape, index)
    calls = [zero_all(b, gx)]
    if math.prod(count):
        calls += sliced_copy(b, gy, gx, begin, step, count, into=True)
    return calls


# ---- Expand, Tile, DepthToSpace, SpaceToDepth -----------------------------------------------

def bind_expand(b: BindContext, node) -> list:
    """A strided copy with stride 0 on every broadcast axis (any number of runs)."""
    x, y = node.inputs[0], node.outputs[0]
    out = tuple(b.t(y).shape)
    shape_in = (1,) * (len(out) - len(b.t(x).shape)) + tuple(b.t(x).shape)
    if any(a not in (1, o) for a, o in zip(shape_in, out)):
        raise Unbound(f"cannot expand {list(b.t(x).shape)} to {list(out)}")
    xs = [0] * (len(out) - len(b.t(x).shape)) + logical_strides(b, x)
    xs = [0 if a != o else s for a, o, s in zip(shape_in, out, xs)]
    if not math.prod(out):
        return []
    return strided_copies(b, x, y, out, xs, logical_strides(b, y)) + pads_after(b, y)


def bind_tile(b: BindContext, node) -> list:
    """y's axes split into (repeats, n), read from x with stride 0 on the repeats."""
    x, y = node.inputs[0], node.outputs[0]
    shape, out = tuple(b.t(x).shape), tuple(b.t(y).shape)
    if not math.prod(out):
        return []
    splits = {a: (o // n, n) for a, (n, o) in enumerate(zip(shape, out)) if o != n}
    dims, ys = split_axes(out, logical_strides(b, y), splits)
    xs = []
    for a, st in enumerate(logical_strides(b, x)):
        xs += [0, st] if a in splits else [st]
    return strided_copies(b, x, y, dims, xs, ys) + pads_after(b, y)


def _block_copy(b: BindContext, node, x_split, perm, y_split) -> list:
    """``y`` (axes split by ``y_split``) = ``x`` (split by ``x_split``) transposed by ``perm``:
    DepthToSpace and SpaceToDepth, as ``ops.tensor``'s NumPy kernels write them."""
    x, y = node.inputs[0], node.outputs[0]
    _, xs = split_axes(b.t(x).shape, logical_strides(b, x), x_split)
    dims, ys = split_axes(b.t(y).shape, logical_strides(b, y), y_split)
    return strided_copies(b, x, y, dims, [xs[p] for p in perm], ys) + pads_after(b, y)


def bind_depth_to_space(b: BindContext, node) -> list:
    bs = int(node.attrs["blocksize"])
    n, c, h, w = b.t(node.inputs[0]).shape
    cb = c // (bs * bs)
    if node.attrs.get("mode", "DCR") == "CRD":
        return _block_copy(b, node, {1: (cb, bs, bs)}, (0, 1, 4, 2, 5, 3),
                           {2: (h, bs), 3: (w, bs)})
    return _block_copy(b, node, {1: (bs, bs, cb)}, (0, 3, 4, 1, 5, 2), {2: (h, bs), 3: (w, bs)})


def bind_space_to_depth(b: BindContext, node) -> list:
    bs = int(node.attrs["blocksize"])
    n, c, h, w = b.t(node.inputs[0]).shape
    x_split = {2: (h // bs, bs), 3: (w // bs, bs)}
    if node.attrs.get("mode", "DCR") == "CRD":
        return _block_copy(b, node, x_split, (0, 1, 3, 5, 2, 4), {1: (c, bs, bs)})
    return _block_copy(b, node, x_split, (0, 3, 5, 1, 2, 4), {1: (bs, bs, c)})


# ---- Pad, PadGrad ---------------------------------------------------------------------------

def _pad_axes(in_shape, begin, end) -> list[int]:
    """The kernels' per-axis (lo, crop, kept), each left-padded to six axes: output positions
    before the kept input, input elements cropped at the front, input elements kept."""
    rank = len(in_shape)
    lo = [max(p, 0) for p in begin]
    crop = [max(-p, 0) for p in begin]
    kept = [n - max(-p, 0) - max(-q, 0) for n, p, q in zip(in_shape, begin, end)]
    pad = [0] * (MAX_DIMS - rank)
    return [i64(v) for v in pad + lo + pad + crop + [1] * (MAX_DIMS - rank) + kept]


def _pad_mode(node, in_shape, begin, end) -> int:
    mode = node.attrs.get("mode", "constant")
    if mode not in PAD_MODES:
        raise Unbound(f"unknown Pad mode {mode!r}")
    if mode != "constant" and any((p > 0 or q > 0) and n - max(-p, 0) - max(-q, 0) <= 0
                                  for n, p, q in zip(in_shape, begin, end)):
        raise Unbound(f"Pad mode {mode!r} cannot pad an empty axis")
    return PAD_MODES[mode]


def bind_pad(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape, out = tuple(b.t(x).shape), tuple(b.t(y).shape)
    ins = list(node.inputs) + [None] * 4
    begin, end = pad_amounts(node.since_version, node.attrs, const_ints(ins[1], "pads"),
                                 const_ints(ins[3], "axes"), len(shape))
    mode = _pad_mode(node, shape, begin, end)
    value = ins[2] if node.since_version >= 11 and mode == 0 else None
    if value is not None and math.prod(b.t(value).shape) != 1:
        raise Unbound("Pad's constant_value must be one element")
    fill = np.asarray(node.attrs.get("value", 0.0) if node.since_version < 11 else 0,
                      b.t(y).dtype)
    d, (xs, ys) = pad_dims6(out, logical_strides(b, x), logical_strides(b, y))
    n = math.prod(out)
    if not n:
        return []
    bits = int(fill.reshape(1).view(f"u{fill.itemsize}")[0])
    return [b.launch(f"tr_pad_{move_kernel(b, y)}", n,
                     [b.buf(x), b.buf(value), b.buf(y, True), i64(n), i64(bits), i32(mode)]
                     + [i64(v) for v in d + xs + ys] + _pad_axes(shape, begin, end))] + \
        pads_after(b, y)


def bind_pad_grad(b: BindContext, node) -> list:
    gy, gx = node.inputs[0], node.outputs[0]
    shape, out = tuple(b.t(gx).shape), tuple(b.t(gy).shape)
    rank = len(shape)
    pads = [int(p) for p in node.attrs["pads"]]
    begin, end = pads[:rank], pads[rank:]
    mode = _pad_mode(node, shape, begin, end)
    d, (gys, gxs) = pad_dims6(shape, logical_strides(b, gy), logical_strides(b, gx))
    o, _ = pad_dims6(out)
    n = math.prod(shape)
    return [b.launch(f"tr_pad_grad_{float_dt(b, gy, gx)}", n,
                     [b.buf(gy), b.buf(gx, True), i64(n), i32(mode)]
                     + [i64(v) for v in d + gys + gxs] + _pad_axes(shape, begin, end)
                     + [i64(v) for v in o])] + pads_after(b, gx)


# ---- Trilu, CumSum, CumProd, CumProdGrad ----------------------------------------------------

def bind_trilu(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    rows, cols = shape[-2:]
    k = const_ints(node.inputs[1], "Trilu's k")[0] if len(node.inputs) > 1 and \
        node.inputs[1] is not None else 0
    n = math.prod(shape)
    if not n:
        return []
    ms = [0] * (len(shape) - 2) + [cols, 1]  # the element's place in its [rows, cols] matrix
    d, (xs, ys, ms) = collapse(shape, [logical_strides(b, x), logical_strides(b, y), ms])
    return [b.launch(f"tr_trilu_{move_kernel(b, y)}", n,
                     [b.buf(x), b.buf(y, True), i64(n), i64(cols), i64(k),
                      i32(int(node.attrs.get("upper", 1)))]
                     + [i64(v) for v in d + xs + ys + ms])] + pads_after(b, y)


def scan_dt(b: BindContext, *vs) -> str:
    """The scans' kernel suffix: a storage type, or i64 / i32."""
    names = {np.dtype(b.t(v).dtype).name for v in vs}
    if names <= {"int64"}:
        return "i64"
    if names <= {"int32"}:
        return "i32"
    return float_dt(b, *vs)


def _lines(b: BindContext, axis: int, *vs) -> tuple[int, list, list[list[int]]]:
    """(line length, each operand's stride along ``axis``, the collapsed dims and strides of
    the line starts) of a scan along ``axis``."""
    shape = list(b.t(vs[0]).shape)
    strides = [logical_strides(b, v) for v in vs]
    along = [s[axis] for s in strides]
    d, sets = collapse(shape[:axis] + [1] + shape[axis + 1:],
                       [s[:axis] + [0] + s[axis + 1:] for s in strides])
    return shape[axis], along, d + sum(sets, [])


def _scan_axis(b: BindContext, node, i: int) -> int:
    rank = len(b.t(node.inputs[0]).shape)
    return ops.positive_axis(const_ints(node.inputs[i], "the scan's axis")[0], rank)


def bind_scan(b: BindContext, node) -> list:
    """CumSum / CumProd: one thread per line along the axis."""
    x, y = node.inputs[0], node.outputs[0]
    length, (ax, ay), dims = _lines(b, _scan_axis(b, node, 1), x, y)
    lines = math.prod(b.t(x).shape) // length if length else 0
    if not lines:
        return []
    name = "cumsum" if node.op_type == "CumSum" else "cumprod"
    return [b.launch(f"tr_{name}_{scan_dt(b, x, y)}", lines,
                     [b.buf(x), b.buf(y, True), i64(lines), i64(length), i64(ax), i64(ay),
                      i32(int(node.attrs.get("exclusive", 0))),
                      i32(int(node.attrs.get("reverse", 0)))] + [i64(v) for v in dims])] + \
        pads_after(b, y)


def bind_cumprod_grad(b: BindContext, node) -> list:
    gy, x, gx = node.inputs[0], node.inputs[1], node.outputs[0]
    length, along, dims = _lines(b, _scan_axis(b, node, 2), gy, x, gx)
    n = math.prod(b.t(gx).shape)
    if not n:
        return []
    return [b.launch(f"tr_cumprod_grad_{float_dt(b, gy, x, gx)}", n,
                     [b.buf(gy), b.buf(x), b.buf(gx, True), i64(n), i64(length)]
                     + [i64(v) for v in along]
                     + [i32(int(node.attrs["exclusive"])), i32(int(node.attrs["reverse"]))]
                     + [i64(v) for v in dims])] + pads_after(b, gx)


# ---- plan-time values -----------------------------------------------------------------------

def _bits(value: np.ndarray) -> np.ndarray:
    """The elements of ``value`` as unsigned integers of their size (their bit patterns)."""
    value = np.ascontiguousarray(value).reshape(-1)
    return value.view(f"u{value.dtype.itemsize}").astype(np.uint64)


def write_value(b: BindContext, y, value: np.ndarray) -> list:
    """Launches writing the plan-time ``value`` into ``y``: one fill of every element when the
    value is uniform (ConstantOfShape's one-element fill too), else ``tr_put`` 8 at a time
    into a compact ``y``."""
    kind = move_kernel(b, y)
    words = [i64(int(w) - (1 << 64) if w >> 63 else int(w)) for w in _bits(value)]
    g = geometry(b.t(y))
    if not words or not math.prod(b.t(y).shape):
        return []
    if len(set(words)) == 1 and g is not None:
        return [b.launch(f"tr_fill_{kind}", g.n, [b.buf(y, True), i64(g.n), words[0]])] + \
            pads_after(b, y)
    need_flat(b, y)
    if len(words) > PUT_LIMIT:
        raise Unbound(f"a plan-time value of {len(words)} different elements (more than "
                      f"{PUT_LIMIT}); fold it at import (it is a graph output, or larger than "
                      "fold_limit_bytes)")
    calls = []
    for first in range(0, len(words), 8):
        chunk = words[first:first + 8]
        calls.append(b.launch(f"tr_put_{kind}", len(chunk),
                              [b.buf(y, True), i64(first), i64(len(chunk))]
                              + chunk + [i64(0)] * (8 - len(chunk))))
    return calls


def need_flat(b: BindContext, y) -> None:
    g = geometry(b.t(y))
    if g is None or g.kind != "flat":
        raise Unbound(f"{y.name!r} is {b.t(y).layout.describe()}; plan-time values are "
                      "written into compact tensors")


def value_binding(value_of):
    """The factory of a node whose output is the plan-time ``value_of(ctx)``."""

    def factory(ctx):
        value = value_of(ctx)

        def bind(b: BindContext, node) -> list:
            return write_value(b, node.outputs[0], value)

        return bind

    factory.__name__ = factory.__qualname__ = f"bind_{value_of.__name__}"
    return factory


def bind_eye_like(b: BindContext, node) -> list:
    y = node.outputs[0]
    need_flat(b, y)
    rows, cols = b.t(y).shape
    n = rows * cols
    if not n:
        return []
    (one,) = [i64(int(w)) for w in _bits(np.ones(1, b.t(y).dtype))]
    return [b.launch(f"tr_eye_{move_kernel(b, y)}", n,
                     [b.buf(y, True), i64(n), i64(cols), i64(int(node.attrs.get("k", 0))),
                      one])]


def bind_range(b: BindContext, node) -> list:
    y = node.outputs[0]
    kind = {"float32": "f32", "int64": "i64", "int32": "i32"}.get(np.dtype(b.t(y).dtype).name)
    if kind is None:
        raise Unbound(f"Range of {b.t(y).dtype}; the kernels write float32, int64, int32")
    start, delta = (np.asarray(node.inputs[i].data).reshape(()) if node.inputs[i].data is not None
                    else None for i in (0, 2))
    if start is None or delta is None:
        raise Unbound("Range's start or delta computed at run time")
    n = math.prod(b.t(y).shape)
    if not n:
        return []
    scalar = np.float64 if kind == "f32" else np.int64
    return [b.launch(f"tr_range_{kind}", n, [b.buf(y, True), i64(n), scalar(start),
                                             scalar(delta)])]


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(bind_copy)) for op in COPY_OPS]
            + [KernelDef("Expand", "cuda", binding(bind_expand)),
               KernelDef("Transpose", "cuda", binding(bind_transpose)),
               KernelDef("Slice", "cuda", binding(bind_slice)),
               KernelDef("SliceGrad", "cuda", binding(bind_slice_grad), domain=INTERNAL_DOMAIN),
               KernelDef("Concat", "cuda", binding(bind_concat)),
               KernelDef("Split", "cuda", binding(bind_split)),
               KernelDef("Pad", "cuda", binding(bind_pad)),
               KernelDef("PadGrad", "cuda", binding(bind_pad_grad), domain=INTERNAL_DOMAIN),
               KernelDef("Tile", "cuda", binding(bind_tile)),
               KernelDef("DepthToSpace", "cuda", binding(bind_depth_to_space)),
               KernelDef("SpaceToDepth", "cuda", binding(bind_space_to_depth)),
               KernelDef("Trilu", "cuda", binding(bind_trilu)),
               KernelDef("CumSum", "cuda", binding(bind_scan)),
               KernelDef("CumProd", "cuda", binding(bind_scan)),
               KernelDef("CumProdGrad", "cuda", binding(bind_cumprod_grad), domain=INTERNAL_DOMAIN),
               KernelDef("Constant", "cuda", value_binding(ops.constant_value)),
               KernelDef("ConstantOfShape", "cuda", value_binding(ops.constant_of_shape_fill)),
               KernelDef("Shape", "cuda", value_binding(ops.shape_value)),
               KernelDef("Size", "cuda", value_binding(ops.size_value)),
               KernelDef("Range", "cuda", binding(bind_range)),
               KernelDef("EyeLike", "cuda", binding(bind_eye_like))])
