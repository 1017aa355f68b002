"""cuda bindings of ``ops/resize.py``: Resize (10-19), Upsample (7, 9, 10) and ResizeGrad
(``kernels/resize.cu``), on compact tensors and on channels-last feature maps (channel lanes
padded, the CNN layout: the resized axes are spatial, so each axis's gather moves whole
contiguous channel rows).

The numpy kernel's plan is the oracle and the plan: ``resize_plan`` (its own code, at plan
time) says which axes change, in which order, and how many taps each table row holds; the
device rebuilds the same (index, weight) tables every step (``tr_resize_table``: coordinates
in float64 with the reference's expressions, so nearest picks and weights are its bits) into
the node's scratch, and applies them one axis at a time with fp32 sums in the numpy kernel's
order, fp32 intermediates in scratch. With ``--fmad=false`` every mode (nearest, linear, cubic,
antialias, exclude_outside, every coordinate mode) then matches numpy bit for bit in f32, and
f16/bf16 storage rounds once at the end as numpy's cast does.

ResizeGrad is deterministic, in gather form (no atomics): each forward table is rebuilt, then
transposed on the device (``tr_resize_transpose``: one thread per input position lists the
outputs that read it, in increasing order, as ``transpose_table`` does), and the transposed
tables are applied to gy in reverse order, like the forward.

Refused (``Unbound``): integer tensors (the kernels store f32/f16/bf16), a resized channel
axis of a padded channels-last tensor, layouts other than compact / channels-last, input and
output in different layouts, antialias windows wider than ``WINDOW`` taps (downscaling by
more than about 30x)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....ir import Node
from ....opdef import KernelContext, KernelDef
from ....ops.resize import geometry as axis_geometry
from ....ops.resize import node_spec, resize_inputs, resize_plan, transpose_table
from ..bind import DT, BindContext, Unbound, copy_of, f32, f64, i64, same_layout
from ..capture import DeviceBuffer
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain, storage_pairs

# ---- kernels/resize.cu: the family's name table -----------------------------------------------

APPLY_PAIRS = tuple((s, d) for s in DT.values() for d in DT.values()
                    if "f32" in (s, d) or s == d)
"""(source, destination) storage of the apply kernel: a node's storage to fp32 scratch and
back, or straight through (one resized axis)."""


def resize_source() -> KernelSource:
    """kernels/resize.cu: the table builders and the per-axis gather-and-sum."""
    return kernel_source(
        "resize",
        plain("tr_resize_table", "tr_resize_transpose"),
        instantiate("TR_RESIZE_APPLY({S}, {sdt}, {D}, {ddt})", "tr_resize_apply_{sdt}_{ddt}",
                    storage_pairs(APPLY_PAIRS)),
        instantiate("TR_RESIZE_FILL({T}, {dt})", "tr_resize_fill_{dt}", STORAGE))


KERNELS = resize_source()

WINDOW = 64  # kernels/resize.cu TR_RESIZE_WINDOW: the widest window a table row computes
MODES = {"nearest": 0, "linear": 1, "cubic": 2}
COORDS = {"half_pixel": 0, "half_pixel_symmetric": 1, "pytorch_half_pixel": 2,
          "align_corners": 3, "asymmetric": 4, "tf_half_pixel_for_nn": 5,
          "tf_crop_and_resize": 6}
RULES = {"round_prefer_floor": 0, "round_prefer_ceil": 1, "floor": 2, "ceil": 3}


# ---- plan time ---------------------------------------------------------------------------------


def physical(info) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(physical shape, perm: physical axis -> logical axis, channels, padded channels) of a
    compact or channels-last tensor (``c = cp = 1`` for compact: no lane is a pad)."""
    layout, shape = info.layout, tuple(int(d) for d in info.shape)
    if layout.is_plain or len(shape) <= 1:
        return shape, tuple(range(len(shape))), 1, 1
    if layout.kind == "channels_last" and layout.perm == (0, *range(2, len(shape)), 1) \
            and layout.phys_shape[0] == shape[0]:
        phys = tuple(int(d) for d in layout.phys_shape)
        return phys, tuple(layout.perm), shape[1], phys[-1]
    raise Unbound(f"{info.name!r} is {layout.describe()}; the resize kernels read compact or "
                  "channels-last tensors")


@dataclass(frozen=True)
class AxisTable:
    """One resized axis: the ``tr_resize_table`` arguments of its forward table (``n_out``
    rows of ``taps`` over ``n_in`` positions) and, for ResizeGrad, its transpose's ``ttaps``."""

    axis: int
    n_in: int
    n_out: int
    taps: int
    ttaps: int
    args: tuple  # mode, coord, rule, exclude, antialias, scale, a, r0, r1 (kernel types)
    outside: bool  # tf_crop_and_resize: the table marks extrapolated rows


def axis_tables(ctx: KernelContext, op: str, version: int, in_shape) -> tuple[list, float]:
    """The node's resized axes in the order the numpy kernel runs them, and the fill value of
    extrapolated positions."""
    roi, scales, sizes = resize_inputs(ctx, op, version)
    try:
        plan = resize_plan(op, version, ctx.attrs, in_shape, roi, scales, sizes)
        geo = axis_geometry(op, version, ctx.attrs, in_shape, roi, scales, sizes)
    except ValueError as e:
        raise Unbound(str(e)) from None
    spec = node_spec(op, version, ctx.attrs)
    tables = []
    for t in plan.tables:
        g = geo[t.axis]
        rule = spec.nearest_mode
        if rule == "legacy":  # as _coefficients: onnxruntime's opset < 11 rounding
            rule = "floor" if g.scale >= 1 else "ceil"
        s = min(g.scale, 1.0)
        window = 2 - 2 * (math.floor((-1 if spec.mode == "linear" else -2) / s) + 1)
        if spec.antialias and window > WINDOW:
            raise Unbound(f"an antialias window of {window} taps; the kernel takes {WINDOW}")
        r0, r1 = g.roi
        args = (i64(MODES[spec.mode]), i64(COORDS[spec.coordinate_mode]), i64(RULES[rule]),
                i64(spec.exclude_outside), i64(spec.antialias), f64(g.scale),
                f64(spec.cubic_coeff_a), f64(r0), f64(r1))
        tables.append(AxisTable(t.axis, t.n_src, t.idx.shape[0], t.idx.shape[1],
                                transpose_table(t).idx.shape[1], args,
                                spec.coordinate_mode == "tf_crop_and_resize"))
    return tables, float(spec.extrapolation_value)


@dataclass(frozen=True)
class Step:
    """One gather-and-sum along physical axis ``pa``: ``src`` positions to ``dst``, with the
    table in scratch ``idx``/``w`` (the transposed one for ResizeGrad: ``tidx``/``tw``)."""

    table: AxisTable
    pa: int
    src: int
    dst: int
    taps: int
    ws: tuple[int, ...]  # idx, w[, outside] | idx, w, tidx, tw
    out_ws: int | None  # fp32 scratch the step writes; None: the node's output


def _plan(ctx: KernelContext, grad: bool):
    """(steps, fill value, physical shape of the source, perm, c, cp) of a Resize/ResizeGrad
    node, its scratch reserved: per step the table buffers, then an fp32 buffer for every
    result but the last (which goes to the output)."""
    x, y = ctx.inputs[0], ctx.outputs[0]
    if grad:
        op, version = ctx.attrs["forward_op"], int(ctx.attrs["forward_version"])
        tables, fill = axis_tables(ctx, op, version, y.shape)
        tables = tables[::-1]
    else:
        tables, fill = axis_tables(ctx, ctx.node.op_type, ctx.since_version, x.shape)
    phys, perm, c, cp = physical(x)
    shape, steps = list(phys), []
    for k, t in enumerate(tables):
        pa = perm.index(t.axis)
        if pa == len(phys) - 1 and cp != c:
            raise Unbound("resizing the padded channel axis of a channels-last tensor")
        src, dst = (t.n_out, t.n_in) if grad else (t.n_in, t.n_out)
        ws = [ctx.workspace((t.n_out * t.taps,), np.int64),
              ctx.workspace((t.n_out * t.taps,), np.float32)]
        if grad:
            ws += [ctx.workspace((t.n_in * t.ttaps,), np.int64),
                   ctx.workspace((t.n_in * t.ttaps,), np.float32)]
        elif t.outside:
            ws.append(ctx.workspace((t.n_out,), np.int64))
        shape[pa] = dst
        out_ws = ctx.workspace((math.prod(shape),), np.float32) if k < len(tables) - 1 \
            else None
        steps.append(Step(t, pa, src, dst, t.ttaps if grad else t.taps, tuple(ws), out_ws))
    return steps, fill, phys, perm, c, cp


def _refusal(reason: str):
    def bind(b: BindContext, node: Node) -> list:
        raise Unbound(reason)

    return bind


def _factory(grad: bool):
    def factory(ctx: KernelContext):
        try:
            steps, fill, phys, perm, c, cp = _plan(ctx, grad)
        except Unbound as e:
            return _refusal(str(e))

        def bind(b: BindContext, node: Node) -> list:
            x, y = node.inputs[0], node.outputs[0]
            if not steps:  # the identity (numpy: a copy)
                same_layout(b, x, y)
                if b.t(x).dtype != b.t(y).dtype:
                    raise Unbound("an identity resize that changes dtype")
                return [copy_of(b, x, y)]
            sdt, ddt = b.dt(x), b.dt(y)
            _, _, yc, ycp = physical(b.t(y))
            if (yc, ycp) != (c, cp) or b.t(y).layout.perm != b.t(x).layout.perm:
                raise Unbound("input and output in different layouts")
            return _calls(b, x, y, sdt, ddt, steps, fill, phys, c, cp, grad)

        return bind

    return factory


def _calls(b: BindContext, x, y, sdt: str, ddt: str, steps: list, fill: float, phys,
           c: int, cp: int, grad: bool) -> list:
    calls, shape, src, src_dt = [], list(phys), b.buf(x), sdt
    for s in steps:
        t = s.table
        idx, w = b.ws(s.ws[0]), b.ws(s.ws[1])
        outside = b.ws(s.ws[2]) if len(s.ws) == 3 else None
        calls.append(b.launch("tr_resize_table", t.n_out,
                              [idx, w, outside, i64(t.n_out), i64(t.n_in), i64(t.taps),
                               *t.args]))
        if grad:
            tidx, tw = b.ws(s.ws[2]), b.ws(s.ws[3])
            calls.append(b.launch("tr_resize_transpose", t.n_in,
                                  [b.ws(s.ws[0], False), b.ws(s.ws[1], False), tidx, tw,
                                   i64(t.n_out), i64(t.taps), i64(t.n_in), i64(t.ttaps)]))
            idx, w = tidx, tw
        inner = math.prod(shape[s.pa + 1:])
        shape[s.pa] = s.dst
        total = math.prod(shape)
        dst, dst_dt = (b.buf(y, True), ddt) if s.out_ws is None else (b.ws(s.out_ws), "f32")
        calls.append(b.launch(f"tr_resize_apply_{src_dt}_{dst_dt}", total,
                              [src, dst, _read(idx), _read(w), i64(total), i64(s.src),
                               i64(s.dst), i64(inner), i64(s.taps), i64(c), i64(cp)]))
        src, src_dt = _read(dst), dst_dt
    final = list(shape)
    for s in steps:  # tf_crop_and_resize: the fill after every axis, as numpy's mask
        if len(s.ws) == 3:
            inner = math.prod(final[s.pa + 1:])
            total = math.prod(final)
            calls.append(b.launch(f"tr_resize_fill_{ddt}", total,
                                  [b.buf(y, True), b.ws(s.ws[2], False), i64(total),
                                   i64(s.dst), i64(inner), i64(c), i64(cp), f32(fill)]))
    return calls


def _read(buf: DeviceBuffer) -> DeviceBuffer:
    """The same buffer, read (the next launch's input)."""
    return DeviceBuffer(buf.ptr, buf.nbytes, False, buf.name)


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Resize", "cuda", _factory(False)),
            KernelDef("Upsample", "cuda", _factory(False)),
            KernelDef("ResizeGrad", "cuda", _factory(True), domain=INTERNAL_DOMAIN)]
