"""cuda bindings of ``ops/quantize.py``: QuantizeLinear and DequantizeLinear (per tensor, per
axis, blocked; 8- and 16-bit integer types, DequantizeLinear also int32), their gradients
QuantizeLinearGrad / DequantizeLinearGrad (the scale's gradient too), and
DynamicQuantizeLinear (``kernels/quantize.cu``), in the numpy kernels' float32 arithmetic.

x may be compact or channels-last padded (a QAT model's activations after a Conv, a weight in
``[O, *K, Cp]``): the kernels index the parameters through the quantization axis's physical
place and write the pad lanes 0. Not bound: float8 and 4-bit types (ml_dtypes, no device
type here), x / scale in a type other than x's (opset 23's ``precision`` or a scale of another
type), blocked parameters over a channels-last x, the scale's gradient from half-precision
gradients.

The integer contractions (MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv; 8-bit
operands, float32 scales) are direct kernels, one thread per output element summing in 64-bit
integers: exact, as NumPy's float64 contraction is, and slow next to a tensor-core GEMM -- they
make quantized inference models run, not fast.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....dtypes import np_dtype
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.conv_window import Window
from ....ops.quantize import quant_range
from ....ops.tensor import positive_axis
from ..bind import (
    TO_COMPACT,
    TO_PADDED,
    BindContext,
    Unbound,
    binding,
    f32,
    geometry,
    i32,
    i64,
    need_compact,
    operand_specs,
    out_geometry,
    same_layout,
)
from ..device import BLOCK
from ..sources import STORAGE, instantiate, kernel_source, plain

QUANT = {"int8": ("tr_i8", "i8"), "uint8": ("tr_u8", "u8"), "int16": ("tr_i16", "i16"),
         "uint16": ("tr_u16", "u16")}
"""Quantized types the kernels store: dtype name -> (C type, kernel suffix)."""
DEQUANT = {**QUANT, "int32": ("int", "i32")}
"""What DequantizeLinear (and its gradient's scale term) reads: QUANT and int32."""
EIGHT_BIT = {k: QUANT[k] for k in ("int8", "uint8")}
"""The integer contractions' operand and output types."""


def _operand(types: dict, c_field: str, suffix_field: str) -> tuple[dict[str, str], ...]:
    """An instantiation axis over ``types``: ``{c_field}`` the C type, ``{suffix_field}`` the
    kernel-name suffix."""
    return tuple({c_field: c, suffix_field: q} for c, q in types.values())


def _axis(types: dict) -> tuple[dict[str, str], ...]:
    return _operand(types, "Q", "q")


KERNELS = kernel_source(
    "quantize",
    instantiate("TR_QUANTIZE({T}, {dt}, {Q}, {q})",
                ("tr_quantize_{dt}_{q}", "tr_quantize_grad_{dt}_{q}"), STORAGE, _axis(QUANT)),
    instantiate("TR_DEQUANTIZE({Q}, {q}, {T}, {dt})", "tr_dequantize_{q}_{dt}", _axis(DEQUANT),
                STORAGE),
    instantiate("TR_DEQUANTIZE_GRAD({T}, {dt})", "tr_dequantize_grad_{dt}", STORAGE),
    instantiate("TR_QUANT_SCALE_GRAD({Q}, {q})", "tr_dequantize_grad_scale_{q}",
                _axis(DEQUANT)),
    plain("tr_quantize_grad_scale", "tr_dynamic_quantize_range", "tr_dynamic_quantize"),
    instantiate("TR_INT_MATMUL({Q}, {q}, {B}, {b})", "tr_matmul_integer_{q}_{b}",
                _axis(EIGHT_BIT), _operand(EIGHT_BIT, "B", "b")),
    instantiate("TR_QLINEAR_MATMUL({Q}, {q}, {B}, {b}, {Y}, {y})",
                "tr_qlinear_matmul_{q}_{b}_{y}", _axis(EIGHT_BIT), _operand(EIGHT_BIT, "B", "b"),
                _operand(EIGHT_BIT, "Y", "y")),
    instantiate("TR_INT_CONV_KERNELS({Q}, {q}, {B}, {b})", "tr_conv_integer_{q}_{b}",
                _axis(EIGHT_BIT), _operand(EIGHT_BIT, "B", "b")),
    instantiate("TR_QLINEAR_CONV({Q}, {q}, {B}, {b}, {Y}, {y})",
                "tr_qlinear_conv_{q}_{b}_{y}", _axis(EIGHT_BIT), _operand(EIGHT_BIT, "B", "b"),
                _operand(EIGHT_BIT, "Y", "y")))


def _suffix(b: BindContext, v, types: dict) -> str:
    name = np.dtype(b.t(v).dtype).name
    if name not in types:
        raise Unbound(f"{v.name!r} is {name}; the kernels quantize to {', '.join(types)}")
    return types[name][1]


def quant_axis(b: BindContext, node, x, param) -> list:
    """The kernels' (mode, inner, len, bs, blocks, cp, c) for ``param`` (a scale or zero point)
    over the physical elements of ``x`` (or of a tensor shaped like it): per tensor, per axis
    (the axis's physical place: the last one for the channels of a channels-last x) or
    blocked (compact x only)."""
    t = b.t(x)
    g = geometry(t)
    if g is None:
        raise Unbound(f"{x.name!r} is {t.layout.describe()}")
    need_compact(b, param)
    shape = tuple(t.shape)
    cp, c = (g.cp, g.c) if g.kind == "channels_last" else (1, 1)
    pshape = tuple(b.t(param).shape)
    if math.prod(pshape) == 1 and len(pshape) <= 1:
        return [i32(0), i64(1), i64(1), i64(1), i64(1), i64(cp), i64(c)]
    axis = positive_axis(int(node.attrs.get("axis", 1)), len(shape))
    perm, phys = ((t.layout.perm, t.layout.phys_shape) if g.kind == "channels_last"
                  else (tuple(range(len(shape))), shape))
    place = perm.index(axis)
    inner, length = math.prod(phys[place + 1:]), phys[place]
    block = int(node.attrs.get("block_size", 0) or 0)
    if block <= 0:
        return [i32(1), i64(inner), i64(length), i64(1), i64(1), i64(cp), i64(c)]
    if g.kind != "flat":
        raise Unbound(f"blocked parameters over {t.layout.describe()} {x.name!r}")
    return [i32(2), i64(inner), i64(length), i64(block), i64(-(-shape[axis] // block)),
            i64(cp), i64(c)]


def operand_maps(b: BindContext, operands: list, out) -> tuple[list, list]:
    """Each operand's map onto the output's elements (``kernels/quantize.cu``: 0 same layout,
    1 compact into channels-last, 2 channels-last into compact) and the (mc, ms, mcp) the
    layout changes share."""
    g = out_geometry(b, out)
    specs, (_, c, s, cp) = operand_specs(b, operands, g)
    maps = {g.n: 0, TO_PADDED: 1, TO_COMPACT: 2}
    for v, spec in zip(operands, specs):
        if spec not in maps:
            raise Unbound(f"{v.name!r} broadcasts onto {out.name!r}")
    return [i32(maps[spec]) for spec in specs], [i64(c), i64(s), i64(cp)]


def _division(b: BindContext, node, x, scale) -> str:
    """The storage suffix of x, which x / scale is computed in: the scale's type (or
    ``precision``) must be x's."""
    precision = int(node.attrs.get("precision", 0) or 0)
    dt = b.dt(x)
    if b.dt(scale) != dt or precision and np_dtype(precision) != b.t(x).dtype:
        raise Unbound(f"x {b.t(x).dtype} divided by a {b.t(scale).dtype} scale in "
                      f"{np_dtype(precision) if precision else b.t(scale).dtype}: the kernels "
                      "divide in x's type")
    return dt


def _zero_point(b: BindContext, node, k: int, qtype: np.dtype):
    zp = node.inputs[k] if len(node.inputs) > k else None
    if zp is not None and b.t(zp).dtype != qtype:
        raise Unbound(f"zero point {zp.name!r} is {b.t(zp).dtype}, the values {qtype}")
    return zp


def bind_quantize_linear(b: BindContext, node) -> list:
    """y = clip(rint(x / scale) + zero_point) into an 8- or 16-bit integer y, x's layout."""
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    qtype = np.dtype(b.t(y).dtype)
    q = _suffix(b, y, QUANT)
    dt = _division(b, node, x, scale)
    zp = _zero_point(b, node, 2, qtype)
    g = same_layout(b, x, y)
    lo, hi = quant_range(qtype)
    return [b.launch(f"tr_quantize_{dt}_{q}", g.n,
                     [b.buf(x), b.buf(scale), b.buf(zp), b.buf(y, True), i64(g.n),
                      *quant_axis(b, node, x, scale), f32(lo), f32(hi)])]


def bind_dequantize_linear(b: BindContext, node) -> list:
    """y = (x - zero_point) * scale, y (the scale's type) in x's layout."""
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    q = _suffix(b, x, DEQUANT)
    zp = _zero_point(b, node, 2, np.dtype(b.t(x).dtype))
    dt = b.dt(y)
    if b.dt(scale) != dt:
        raise Unbound(f"scale {b.t(scale).dtype}, output {b.t(y).dtype}")
    g = same_layout(b, x, y)
    return [b.launch(f"tr_dequantize_{q}_{dt}", g.n,
                     [b.buf(x), b.buf(scale), b.buf(zp), b.buf(y, True), i64(g.n),
                      *quant_axis(b, node, x, scale)])]


def _scale_grad(b: BindContext, gscale, scale, what: str) -> int:
    """The number of scales (one block each) of a float32 scale gradient."""
    for v in (gscale, scale):
        if b.t(v).dtype != np.float32:
            raise Unbound(f"{what}'s scale gradient in {b.t(v).dtype} (float32 only)")
    need_compact(b, gscale)
    return math.prod(b.t(gscale).shape)


def bind_quantize_linear_grad(b: BindContext, node) -> list:
    """(gy, x, scale, zero_point?) -> (gx, gscale?): the straight-through gradient, over gx's
    elements (gy and x in its layout or the other one)."""
    gy, x, scale = node.inputs[:3]
    gx = node.outputs[0]
    gscale = node.outputs[1] if len(node.outputs) > 1 else None
    try:
        qtype = np_dtype(int(node.attrs["to"]))
    except TypeError as e:
        raise Unbound(str(e)) from None
    if qtype.name not in QUANT:
        raise Unbound(f"the straight-through gradient of a {qtype} quantization")
    dt = _division(b, node, x, scale)
    zp = _zero_point(b, node, 3, qtype)
    if b.dt(gy) != dt or b.dt(gx) != dt:
        raise Unbound("gy, x and gx of different types")
    (gy_map, x_map), shape = operand_maps(b, [gy, x], gx)
    n = out_geometry(b, gx).n
    axis = quant_axis(b, node, gx, scale)
    lo, hi = quant_range(qtype)
    calls = [b.launch(f"tr_quantize_grad_{dt}_{QUANT[qtype.name][1]}", n,
                      [b.buf(gy), b.buf(x), b.buf(scale), b.buf(zp), b.buf(gx, True), i64(n),
                       *axis, f32(lo), f32(hi), gy_map, x_map, *shape])]
    if gscale is not None:
        if dt != "f32":
            raise Unbound("a scale gradient from half-precision gradients")
        params = _scale_grad(b, gscale, scale, "QuantizeLinear")
        calls.append(b.launch("tr_quantize_grad_scale", params * BLOCK,
                              [b.buf(gx), b.buf(x), b.buf(scale), b.buf(gscale, True),
                               i64(params), i64(n), *axis, x_map, *shape]))
    return calls


def bind_dequantize_linear_grad(b: BindContext, node) -> list:
    """(gy, x, scale, zero_point?) -> (gx = gy * scale, gscale = sum(gy * (x - zp))?), over
    gx's elements (gy and x in its layout or the other one)."""
    gy, x, scale = node.inputs[:3]
    gx = node.outputs[0]
    gscale = node.outputs[1] if len(node.outputs) > 1 else None
    q = _suffix(b, x, DEQUANT)
    zp = _zero_point(b, node, 3, np.dtype(b.t(x).dtype))
    dt = b.dt(gy)
    if b.dt(gx) != dt or b.dt(scale) != dt:
        raise Unbound("gy, scale and gx of different types")
    (gy_map, x_map), shape = operand_maps(b, [gy, x], gx)
    n = out_geometry(b, gx).n
    axis = quant_axis(b, node, gx, scale)
    calls = [b.launch(f"tr_dequantize_grad_{dt}", n,
                      [b.buf(gy), b.buf(scale), b.buf(gx, True), i64(n), *axis, gy_map,
                       *shape])]
    if gscale is not None:
        if dt != "f32":
            raise Unbound("a scale gradient from half-precision gradients")
        params = _scale_grad(b, gscale, scale, "DequantizeLinear")
        calls.append(b.launch(f"tr_dequantize_grad_scale_{q}", params * BLOCK,
                              [b.buf(gy), b.buf(x), b.buf(zp), b.buf(gscale, True),
                               i64(params), i64(n), *axis, gy_map, x_map, *shape]))
    return calls


def bind_dynamic_quantize_linear(b: BindContext, node) -> list:
    """uint8 y, scale and zero point of a compact float32 x: the range in one block, then the
    quantization reading the scale and zero point it wrote."""
    x = node.inputs[0]
    y, scale, zp = node.outputs[:3]
    need_compact(b, x, y)
    if b.t(x).dtype != np.float32 or b.t(scale).dtype != np.float32 or \
            b.t(zp).dtype != np.uint8:
        raise Unbound("DynamicQuantizeLinear from float32 to uint8 only (as ONNX)")
    n = math.prod(b.t(x).shape)
    return [b.launch("tr_dynamic_quantize_range", 1,
                     [b.buf(x), i64(n), b.buf(scale, True), b.buf(zp, True)],
                     single_block=True),
            b.launch("tr_dynamic_quantize", n, [b.buf(x), b.buf(y, True), i64(n), b.buf(scale),
                                                b.buf(zp)])]


# ---- integer contractions ------------------------------------------------------------------

def _eight_bit(b: BindContext, *vs) -> list[str]:
    need_compact(b, *(v for v in vs if v is not None))
    return [_suffix(b, v, EIGHT_BIT) for v in vs]


def _per(b: BindContext, v, count: int, what: str) -> int:
    """1 when ``v`` holds one value per index (``count`` of them), 0 for a single value."""
    if v is None:
        return 0
    numel = math.prod(b.t(v).shape)
    if numel == 1:
        return 0
    if numel != count or len(b.t(v).shape) != 1:
        raise Unbound(f"{what} {v.name!r} of shape {list(b.t(v).shape)}")
    return 1


def _optional(node, k: int):
    return node.inputs[k] if len(node.inputs) > k else None


def _matmul_dims(b: BindContext, a, bb, y) -> list:
    """(m, k, n, a_batch, b_batch) of a batched product of compact a and b (a batch of one
    broadcasts)."""
    sa, sb, sy = (tuple(b.t(v).shape) for v in (a, bb, y))
    if len(sa) < 2 or len(sb) < 2:
        raise Unbound("a 1-D operand (matmul's vector forms)")
    (m, k), n = sa[-2:], sb[-1]
    batch = math.prod(sy[:-2])
    strides = []
    for shape in (sa, sb):
        own = math.prod(shape[:-2])
        if own not in (1, batch):
            raise Unbound(f"batch {list(shape[:-2])} broadcast partly to {list(sy[:-2])}")
        strides.append(0 if own == 1 else math.prod(shape[-2:]))
    return [i64(m), i64(k), i64(n), i64(strides[0]), i64(strides[1])]


def _float_scales(b: BindContext, *vs) -> None:
    need_compact(b, *vs)
    for v in vs:
        if b.t(v).dtype != np.float32:
            raise Unbound(f"scale {v.name!r} is {b.t(v).dtype} (float32 only)")


def _y_range(b: BindContext, y) -> list:
    lo, hi = quant_range(b.t(y).dtype)
    return [np.float64(lo), np.float64(hi)]


def bind_matmul_integer(b: BindContext, node) -> list:
    """(A, B, a_zero_point?, b_zero_point?) -> int32 (A - a_zp) @ (B - b_zp)."""
    a, bb = node.inputs[:2]
    a_zp, b_zp = _optional(node, 2), _optional(node, 3)
    y = node.outputs[0]
    qa, qb = _eight_bit(b, a, bb)
    need_compact(b, y, a_zp, b_zp)
    dims = _matmul_dims(b, a, bb, y)
    total = math.prod(b.t(y).shape)
    return [b.launch(f"tr_matmul_integer_{qa}_{qb}", total,
                     [b.buf(a), b.buf(a_zp), b.buf(bb), b.buf(b_zp), b.buf(y, True),
                      i64(total), *dims, i32(_per(b, a_zp, int(dims[0]), "a_zero_point")),
                      i32(_per(b, b_zp, int(dims[2]), "b_zero_point"))])]


def bind_qlinear_matmul(b: BindContext, node) -> list:
    """(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> y requantized."""
    a, a_scale, a_zp, bb, b_scale, b_zp, y_scale, y_zp = node.inputs[:8]
    y = node.outputs[0]
    qa, qb, qy = _eight_bit(b, a, bb, y)
    need_compact(b, a_zp, b_zp, y_zp)
    _float_scales(b, a_scale, b_scale, y_scale)
    dims = _matmul_dims(b, a, bb, y)
    for v in (a_scale, y_scale, y_zp):
        _per(b, v, 1, "a per-tensor parameter")
    total = math.prod(b.t(y).shape)
    n = int(dims[2])
    return [b.launch(f"tr_qlinear_matmul_{qa}_{qb}_{qy}", total,
                     [b.buf(a), b.buf(a_scale), b.buf(a_zp), b.buf(bb), b.buf(b_scale),
                      b.buf(b_zp), b.buf(y_scale), b.buf(y_zp), b.buf(y, True), i64(total),
                      *dims, i32(_per(b, a_zp, int(dims[0]), "a_zero_point")),
                      i32(_per(b, b_zp, n, "b_zero_point")),
                      i32(_per(b, b_scale, n, "b_scale")), *_y_range(b, y)])]


def _conv_window(b: BindContext, node, x, w, y) -> list:
    """The kernels' window (n, c, d, h, w, o, od, oh, ow, kernel, strides, pads, dilations,
    group) of an NCHW integer convolution with 1 to 3 spatial axes."""
    (n, c, *spatial), (o, _, *kernel) = b.t(x).shape, b.t(w).shape
    if not 1 <= len(spatial) <= 3:
        raise Unbound(f"{len(spatial)} spatial axes")
    a = node.attrs
    kernel = [int(k) for k in (a.get("kernel_shape") or kernel)]
    win = Window.resolve({"auto_pad": a.get("auto_pad", "NOTSET"), **a}, spatial, kernel)
    if tuple(b.t(y).shape[2:]) != win.out_shape:
        raise Unbound(f"output {list(b.t(y).shape)} for window output {list(win.out_shape)}")
    lead = 3 - len(spatial)

    def three(v, fill):
        return [fill] * lead + [int(d) for d in v]

    return [i64(v) for v in (n, c, *three(spatial, 1), o, *three(win.out_shape, 1),
                             *three(kernel, 1), *three(win.strides, 1),
                             *three(win.pads_begin, 0), *three(win.dilations, 1),
                             int(a.get("group", 1)))]


def bind_conv_integer(b: BindContext, node) -> list:
    """(x, w, x_zero_point?, w_zero_point?) -> int32 conv(x - x_zp, w - w_zp)."""
    x, w = node.inputs[:2]
    x_zp, w_zp = _optional(node, 2), _optional(node, 3)
    y = node.outputs[0]
    qx, qw = _eight_bit(b, x, w)
    need_compact(b, y, x_zp, w_zp)
    _per(b, x_zp, 1, "x_zero_point")
    window = _conv_window(b, node, x, w, y)
    total = math.prod(b.t(y).shape)
    return [b.launch(f"tr_conv_integer_{qx}_{qw}", total,
                     [b.buf(x), b.buf(x_zp), b.buf(w), b.buf(w_zp), b.buf(y, True), i64(total),
                      *window, i32(_per(b, w_zp, int(window[5]), "w_zero_point"))])]


def bind_qlinear_conv(b: BindContext, node) -> list:
    """(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B?) -> y requantized."""
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = node.inputs[:8]
    bias = _optional(node, 8)
    y = node.outputs[0]
    qx, qw, qy = _eight_bit(b, x, w, y)
    need_compact(b, x_zp, w_zp, y_zp, bias)
    _float_scales(b, x_scale, w_scale, y_scale)
    if bias is not None and b.t(bias).dtype != np.int32:
        raise Unbound(f"bias {b.t(bias).dtype} (int32 as ONNX)")
    for v in (x_scale, x_zp, y_scale, y_zp):
        _per(b, v, 1, "a per-tensor parameter")
    window = _conv_window(b, node, x, w, y)
    o = int(window[5])
    total = math.prod(b.t(y).shape)
    return [b.launch(f"tr_qlinear_conv_{qx}_{qw}_{qy}", total,
                     [b.buf(x), b.buf(x_scale), b.buf(x_zp), b.buf(w), b.buf(w_scale),
                      b.buf(w_zp), b.buf(y_scale), b.buf(y_zp), b.buf(bias), b.buf(y, True),
                      i64(total), *window, i32(_per(b, w_zp, o, "w_zero_point")),
                      i32(_per(b, w_scale, o, "w_scale")), *_y_range(b, y)])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef(op, "cuda", binding(fn), domain=domain) for op, fn, domain in (
        ("QuantizeLinear", bind_quantize_linear, ""),
        ("DequantizeLinear", bind_dequantize_linear, ""),
        ("DynamicQuantizeLinear", bind_dynamic_quantize_linear, ""),
        ("MatMulInteger", bind_matmul_integer, ""),
        ("QLinearMatMul", bind_qlinear_matmul, ""),
        ("ConvInteger", bind_conv_integer, ""),
        ("QLinearConv", bind_qlinear_conv, ""),
        ("QuantizeLinearGrad", bind_quantize_linear_grad, INTERNAL_DOMAIN),
        ("DequantizeLinearGrad", bind_dequantize_linear_grad, INTERNAL_DOMAIN))]
