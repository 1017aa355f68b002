"""cuda bindings of ``ops/tensor.py``'s data movement: Reshape/Flatten/Squeeze/Unsqueeze copies,
Expand, Transpose, Slice and Concat (``kernels/tensor.cu``).

Transpose, Slice and Concat are strided copies: each logical axis of source and destination
has an element stride in its physical layout (compact row-major, or ``[N, *S, Cp]`` for a
channels-last tensor), axes are collapsed where both walk contiguously, and one kernel over
at most ``bind.MAX_DIMS`` axes moves the bit patterns.
"""

from __future__ import annotations

import math

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import (
    BindContext,
    Launch,
    Unbound,
    binding,
    collapse,
    const_ints,
    contiguous_strides,
    copy_of,
    geometry,
    i64,
    move_kernel,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, widths
from .elementwise import bind_copy

# ---- kernels/tensor.cu: the family's name table -------------------------------------------------

def tensor_source() -> KernelSource:
    """kernels/tensor.cu: strided copies (Transpose, Slice, Concat), Expand and the zeroing of
    padded lanes (ZeroFill, flags)."""
    return kernel_source(
        "tensor",
        instantiate("TR_STRIDED_COPY({U}, {bytes})", "tr_strided_copy_b{bytes}",
                    widths(1, 2, 4, 8)),
        instantiate("TR_EXPAND({T}, {dt})", "tr_expand_{dt}", STORAGE),
        instantiate("TR_ZERO_LANES({U}, {bytes})", "tr_zero_lanes_b{bytes}", widths(1, 2, 4)))


KERNELS = tensor_source()


COPY_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def logical_strides(b: BindContext, v) -> list[int]:
    """Element strides of ``v``'s logical axes in its physical layout: row-major for a compact
    tensor, ``[N, *S, Cp]`` order for a channels-last one."""
    t = b.t(v)
    g = geometry(t)
    if g is not None and g.kind == "flat":
        return contiguous_strides(t.shape)
    if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last":
        phys = contiguous_strides(t.layout.phys_shape)  # [N, *S, Cp]
        return [phys[0], phys[-1], *phys[1:-1]]
    raise Unbound(f"{v.name!r} is {t.layout.describe()}; the strided kernels read compact or "
                  "channels-last tensors")


def pads_after(b: BindContext, y) -> list:
    g = geometry(b.t(y))
    return [b.zero_lanes(y, g)] if g is not None and g.padded else []


def strided_copy(b: BindContext, x, y, dims, xs, ys, xo: int = 0, yo: int = 0) -> Launch:
    d, (sx, sy) = collapse(dims, [xs, ys])
    n = math.prod(d)
    return b.launch(f"tr_strided_copy_{move_kernel(b, y)}", n,
                    [b.buf(x), b.buf(y, True), i64(n), i64(xo), i64(yo)]
                    + [i64(v) for v in d + sx + sy])


def bind_expand(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    if geometry(tx) is None or geometry(ty) is None or \
            (len(tx.shape) > 1 and not tx.layout.is_plain) or not ty.layout.is_plain:
        raise Unbound("Expand is bound for compact (plain) tensors only")
    shape_in = (1,) * (len(ty.shape) - len(tx.shape)) + tuple(tx.shape)
    bcast = [i for i, (a, o) in enumerate(zip(shape_in, ty.shape)) if a != o]
    if any(shape_in[i] != 1 for i in bcast):
        raise Unbound(f"cannot expand {list(tx.shape)} to {list(ty.shape)}")
    if not bcast:
        return [copy_of(b, x, y)]
    lo, hi = bcast[0], bcast[-1] + 1
    if any(shape_in[i] != 1 for i in range(lo, hi)):
        raise Unbound(f"expanding {list(tx.shape)} to {list(ty.shape)} broadcasts two "
                      "separate runs of axes; one run is bound")
    inner, repeat = math.prod(ty.shape[hi:]), math.prod(ty.shape[lo:hi])
    n = math.prod(ty.shape)
    return [b.launch(f"tr_expand_{b.dt(y)}", n,
                     [b.buf(x), b.buf(y, True), i64(n), i64(inner), i64(repeat)])]


def bind_transpose(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    perm = [int(p) for p in node.attrs.get("perm") or reversed(range(len(shape)))]
    xs = logical_strides(b, x)
    out = tuple(b.t(y).shape)
    return [strided_copy(b, x, y, out, [xs[p] for p in perm], logical_strides(b, y))] + \
        pads_after(b, y)


def bind_slice(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    rank = len(shape)
    if node.since_version < 10:
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes"), None
    else:
        ins = list(node.inputs) + [None] * 5
        starts, ends = const_ints(ins[1], "starts"), const_ints(ins[2], "ends")
        axes, steps = const_ints(ins[3], "axes"), const_ints(ins[4], "steps")
    axes = [int(a) % rank for a in (axes if axes is not None else range(len(starts)))]
    steps = steps or [1] * len(axes)
    begin, step, count = [0] * rank, [1] * rank, list(shape)
    for a, s, e, st in zip(axes, starts, ends, steps):
        r = range(*slice(int(s), int(e), int(st)).indices(shape[a]))
        begin[a], step[a], count[a] = r.start, r.step, len(r)
    if tuple(count) != tuple(b.t(y).shape):
        raise Unbound(f"slice gives {count}, the output is {list(b.t(y).shape)}")
    xs = logical_strides(b, x)
    xo = sum(bg * s for bg, s in zip(begin, xs))
    return [strided_copy(b, x, y, count, [st * s for st, s in zip(step, xs)],
                         logical_strides(b, y), xo=xo)] + pads_after(b, y)


def bind_concat(b: BindContext, node) -> list:
    y = node.outputs[0]
    ins = [v for v in node.inputs if v is not None]
    out = tuple(b.t(y).shape)
    axis = int(node.attrs.get("axis", 1)) % len(out)
    ys = logical_strides(b, y)
    calls, at = [], 0
    for v in ins:
        shape = tuple(b.t(v).shape)
        if math.prod(shape):
            calls.append(strided_copy(b, v, y, shape, logical_strides(b, v), ys,
                                      yo=at * ys[axis]))
        at += shape[axis]
    return calls + pads_after(b, y)


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(bind_copy)) for op in COPY_OPS]
            + [KernelDef("Expand", "cuda", binding(bind_expand)),
               KernelDef("Transpose", "cuda", binding(bind_transpose)),
               KernelDef("Slice", "cuda", binding(bind_slice)),
               KernelDef("Concat", "cuda", binding(bind_concat))])
