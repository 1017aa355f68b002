"""Quantization: QuantizeLinear and DequantizeLinear (per tensor, per axis, blocked), with the
straight-through gradient of a Q -> DQ pair; DynamicQuantizeLinear, and the integer ops
ConvInteger, MatMulInteger, QLinearConv and QLinearMatMul (forward only).

Quantized values are whatever the numpy backend can hold: int8/uint8/int16/uint16 today, and
the ml_dtypes types (int4/uint4, float8) through the same code once ``dtypes`` maps them --
a quantized type is an integer type when ``ml_dtypes.iinfo`` knows it (rounding half to even,
then saturation to its range) and a float type otherwise (a cast, clipped to the type's
largest finite value when ``saturate``).

Gradient (PyTorch's fake-quantize gradient). QuantizeLinear's rule is the straight-through
estimator: rounding counts as the identity, so ``q = x / scale + zero_point`` where it is not
clipped (``dq/dx = 1/scale``, ``dq/dscale = -x/scale**2``) and constant where it is.
DequantizeLinear's rule is its exact derivative, ``y = (q - zero_point) * scale``. Autodiff
stops at integer values, so QuantizeLinear declares ``straight_through``: its integer output
carries a float gradient, which DequantizeLinear's rule computes. Composed over a pair the two
give PyTorch's ``fake_quantize_per_{tensor,channel}_affine`` gradient, ``gx = gy`` inside the
range and 0 outside, and, for a scale one chooses to train, exactly the learnable fake
quantization's (``_fake_quantize_learnable_per_tensor_affine``): ``round(x/s) - x/s`` inside,
``qmin - zp`` / ``qmax - zp`` outside. Scales and zero points are not parameters by default
(``param_inputs`` none: frozen, like PyTorch's observers'); the float weight before a pair is
(``forwards_params``: its value reaches the consumer up to rounding).

Integer convolutions and matmuls subtract the zero points and contract in float64: products of
8-bit (and 16-bit) values and their sums stay integers far below 2**53, so the result is the
exact integer sum, with BLAS instead of NumPy's integer loops.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..dtypes import np_dtype, onnx_elem_type
from ..hookspecs import hookimpl
from ..host_math import negate
from ..opdef import ELEMENTWISE, PLAIN_ONLY, OpDef
from .conv_window import Window, im2col_nhwc, pad_nhwc, padding_slabs_nhwc
from .tensor import positive_axis

# ---- quantized types and quantization parameters ------------------------------------------


def quant_range(dtype) -> tuple[int, int] | None:
    """(min, max) of an integer quantized type; None for a float one (float8...)."""
    try:
        info = ml_dtypes.iinfo(np.dtype(dtype))
    except (TypeError, ValueError):
        return None
    return int(info.min), int(info.max)


def float_limit(dtype) -> float:
    """The largest finite value of a float quantized type (what ``saturate`` clips to)."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


class QuantParam:
    """How a scale or zero point (input ``index``) lines up with x: per tensor (a scalar or one
    element), per axis (1-D, x's ``axis`` long) or blocked (x's rank, ``ceil(D / block_size)``
    along ``axis``). ``view`` gives it broadcastable to x (blocked: repeated into a workspace),
    ``reduce`` sums an x-shaped gradient back to its shape."""

    def __init__(self, ctx, index: int, x_shape, axis: int, block_size: int, what: str):
        shape, self.x_shape, self.axis = tuple(ctx.inputs[index].shape), tuple(x_shape), axis
        rank, self.blocked, self.ws, self.grad_ws = len(x_shape), False, None, None
        if math.prod(shape) == 1 and len(shape) <= 1:
            self.bshape = ()  # per tensor: the axis plays no part
            return
        if not 0 <= axis < rank:
            raise ctx.error(f"axis {ctx.attrs.get('axis', 1)} is outside x's rank {rank} "
                            f"(the {what} of shape {list(shape)} is per axis)")
        if block_size <= 0:
            if len(shape) != 1 or not rank or shape[0] != x_shape[axis]:
                raise ctx.error(f"{what} of shape {list(shape)} is neither a scalar nor one "
                                f"value per index of axis {axis} of x {list(x_shape)}")
            self.bshape = tuple(shape[0] if i == axis else 1 for i in range(rank))
        else:
            blocks = -(-x_shape[axis] // block_size)
            want = tuple(blocks if i == axis else d for i, d in enumerate(x_shape))
            if shape != want:
                raise ctx.error(f"{what} of shape {list(shape)} does not block x "
                                f"{list(x_shape)} by block_size {block_size} along axis "
                                f"{axis} (expected {list(want)})")
            self.blocked = True
            padded = tuple(blocks * block_size if i == axis else d
                           for i, d in enumerate(x_shape))
            # [.., blocks, block_size, ..]: the parameter repeats along the inner axis
            self.split = x_shape[:axis] + (blocks, block_size) + x_shape[axis + 1:]
            self.expand = shape[:axis + 1] + (1,) + shape[axis + 1:]
            self.ws = ctx.workspace(padded, ctx.inputs[index].dtype)
            self.take = (slice(None),) * axis + (slice(0, x_shape[axis]),)

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The shape of what ``view`` returns."""
        return self.x_shape if self.blocked else self.bshape

    def view(self, p: np.ndarray, ws: list) -> np.ndarray:
        if not self.blocked:
            return p.reshape(self.bshape)
        full = ws[self.ws]
        np.copyto(full.reshape(self.split), p.reshape(self.expand))
        return full[self.take]

    def reserve_grad(self, ctx, dtype) -> None:
        """Ask for the workspace ``reduce`` needs (blocked: x padded to whole blocks)."""
        if self.blocked:
            self.grad_ws = ctx.workspace(ctx.workspace_requests[self.ws][0], dtype)

    def reduce(self, g: np.ndarray, out: np.ndarray, ws: list) -> None:
        """``out`` (the parameter's shape) = the x-shaped ``g`` summed over what it covers."""
        if not self.blocked:
            if not self.bshape:
                np.sum(g, out=out.reshape(()))
            else:
                others = tuple(i for i in range(len(self.bshape)) if i != self.axis)
                np.sum(g, axis=others, out=out)
            return
        full = ws[self.grad_ws]
        full.fill(0)
        np.copyto(full[self.take], g)
        np.sum(full.reshape(self.split), axis=self.axis + 1, out=out)


def _layout(ctx):
    """(x's shape, the positive quantization axis, block_size) of a Q/DQ node or its grads."""
    shape = tuple(ctx.inputs[1].shape) if ctx.node.domain == INTERNAL_DOMAIN else \
        tuple(ctx.inputs[0].shape)
    axis = positive_axis(int(ctx.attrs.get("axis", 1)), len(shape)) if shape else 0
    return shape, axis, int(ctx.attrs.get("block_size", 0) or 0)


def _division_dtype(ctx, scale_index: int) -> np.dtype:
    """The type x / scale is computed in: ``precision`` (v23+) or else the scale's type, as the
    spec says (onnx.reference promotes the two instead; they differ only when they differ)."""
    precision = int(ctx.attrs.get("precision", 0) or 0)
    return np_dtype(precision) if precision else np.dtype(ctx.inputs[scale_index].dtype)


def _wide(dtype: np.dtype) -> np.dtype:
    """Where rounding, adding the zero point and clipping happen: at least float32, so every
    16-bit quantized value is exact."""
    return np.promote_types(dtype, np.float32)


# ---- QuantizeLinear / DequantizeLinear ------------------------------------------------------


def quantize_linear_numpy(ctx):
    """``y = saturate(round_half_even(x / scale) + zero_point)``; the output type is the zero
    point's, else ``output_dtype``, else uint8 (shape inference has typed the output)."""
    shape, axis, block = _layout(ctx)
    qtype = np.dtype(ctx.outputs[0].dtype)
    rng = quant_range(qtype)
    division = _division_dtype(ctx, 1)
    scale = QuantParam(ctx, 1, shape, axis, block, "y_scale")
    zp = QuantParam(ctx, 2, shape, axis, block, "y_zero_point") \
        if ctx.has_input(2) and rng is not None else None
    t = ctx.workspace(shape, _wide(division))
    limit = float_limit(qtype) if rng is None and int(ctx.attrs.get("saturate", 1)) else None

    def run(ins, outs, ws):
        q = ws[t]
        np.divide(ins[0], scale.view(ins[1], ws), out=q, dtype=division, casting="unsafe")
        if rng is not None:
            np.rint(q, out=q)
            if zp is not None:
                np.add(q, zp.view(ins[2], ws), out=q, casting="unsafe")
            np.clip(q, rng[0], rng[1], out=q)
        elif limit is not None:
            np.clip(q, -limit, limit, out=q)  # NaN stays NaN
        np.copyto(outs[0], q, casting="unsafe")

    return run


def dequantize_linear_numpy(ctx):
    """``y = (x - zero_point) * scale``, computed as onnx.reference does: x - zero_point in
    float32, times the scale in at least float32, then the output type (the scale's, or
    ``output_dtype`` from v23). Float quantized types have no zero point to subtract."""
    shape, axis, block = _layout(ctx)
    rng = quant_range(ctx.inputs[0].dtype)
    out_dtype = np.dtype(ctx.outputs[0].dtype)
    compute = _wide(out_dtype)
    scale = QuantParam(ctx, 1, shape, axis, block, "x_scale")
    zp = QuantParam(ctx, 2, shape, axis, block, "x_zero_point") \
        if ctx.has_input(2) and rng is not None else None
    t = None if compute == out_dtype else ctx.workspace(shape, compute)

    def run(ins, outs, ws):
        y = outs[0] if t is None else ws[t]
        if zp is not None:
            np.subtract(ins[0], zp.view(ins[2], ws), out=y, dtype=np.float32, casting="unsafe")
        else:
            np.copyto(y, ins[0], casting="unsafe")
        np.multiply(y, scale.view(ins[1], ws), out=y, casting="unsafe")
        if t is not None:
            np.copyto(outs[0], y, casting="unsafe")

    return run


# ---- their backward ops (domain ai.tr_onnx) ---------------------------------------------------
# Inputs (gy, x, scale, zero_point?), attributes of the forward node (axis made positive,
# block_size, precision) and, for QuantizeLinearGrad, ``to`` (the quantized element type);
# outputs (gx, gscale?) -- gscale only when the rule asked for it.


def quantize_linear_grad_numpy(ctx):
    """Straight-through: ``gx = gq / scale`` where ``round(x * (1 / scale)) + zp`` is inside
    the quantized range (float types: where ``|x / scale|`` does not saturate), 0 elsewhere;
    ``gscale = sum(-gq * x / scale**2)`` over the same positions.

    The range test multiplies by the reciprocal, as PyTorch's fake quantization does, where
    the forward divides (ONNX): the two differ only where x / scale is within an ulp of a
    range edge's half step, and that is where a symmetric per-channel observer puts each
    channel's largest weight (w / s = 127.5 by division, 127.49999 by PyTorch's product, so
    PyTorch lets its gradient through)."""
    shape, axis, block = _layout(ctx)
    qtype = np_dtype(int(ctx.attrs["to"]))
    rng = quant_range(qtype)
    division = _division_dtype(ctx, 2)
    scale = QuantParam(ctx, 2, shape, axis, block, "y_scale")
    zp = QuantParam(ctx, 3, shape, axis, block, "y_zero_point") \
        if ctx.has_input(3) and rng is not None else None
    wide = _wide(division)
    t, inside, above = (ctx.workspace(shape, d) for d in (wide, np.bool_, np.bool_))
    inverse = ctx.workspace(scale.view_shape, division)
    limit = float_limit(qtype) if rng is None else None
    with_scale = ctx.has_output(1)
    gs_ws = ctx.workspace(shape, ctx.outputs[0].dtype) if with_scale else None
    if with_scale:
        scale.reserve_grad(ctx, ctx.outputs[0].dtype)

    def run(ins, outs, ws):
        q, mask = ws[t], ws[inside]
        s = scale.view(ins[2], ws)
        if rng is not None:
            np.multiply(ins[1], np.reciprocal(s, out=ws[inverse], dtype=division), out=q,
                        dtype=division, casting="unsafe")
            np.rint(q, out=q)
            if zp is not None:
                np.add(q, zp.view(ins[3], ws), out=q, casting="unsafe")
            np.greater_equal(q, rng[0], out=mask)
            np.logical_and(mask, np.less_equal(q, rng[1], out=ws[above]), out=mask)
        else:
            np.divide(ins[1], s, out=q, dtype=division, casting="unsafe")  # as the forward
            np.less_equal(np.abs(q, out=q), limit, out=mask)
        gx = outs[0]
        np.divide(ins[0], s, out=gx, casting="unsafe")
        np.multiply(gx, mask, out=gx)
        if with_scale:
            g = ws[gs_ws]
            np.multiply(gx, ins[1], out=g)  # gq/s * x
            np.divide(g, s, out=g)
            negate(g, g)
            scale.reduce(g, outs[1], ws)

    return run


def dequantize_linear_grad_numpy(ctx):
    """``gx = gy * scale`` (the float gradient of the quantized value) and
    ``gscale = sum(gy * (x - zero_point))``."""
    shape, axis, block = _layout(ctx)
    rng = quant_range(ctx.inputs[1].dtype)
    scale = QuantParam(ctx, 2, shape, axis, block, "x_scale")
    zp = QuantParam(ctx, 3, shape, axis, block, "x_zero_point") \
        if ctx.has_input(3) and rng is not None else None
    with_scale = ctx.has_output(1)
    if with_scale:
        dtype = np.dtype(ctx.outputs[1].dtype)
        g_ws = ctx.workspace(shape, dtype)
        scale.reserve_grad(ctx, dtype)

    def run(ins, outs, ws):
        np.multiply(ins[0], scale.view(ins[2], ws), out=outs[0], casting="unsafe")
        if with_scale:
            g = ws[g_ws]
            if zp is not None:
                np.subtract(ins[1], zp.view(ins[3], ws), out=g, dtype=dtype, casting="unsafe")
            else:
                np.copyto(g, ins[1], casting="unsafe")
            np.multiply(g, ins[0], out=g, casting="unsafe")
            scale.reduce(g, outs[1], ws)

    return run


def _grad_attrs(node) -> dict:
    x = node.inputs[0]
    attrs = {"axis": positive_axis(int(node.attrs.get("axis", 1)), x.rank) if x.rank else 0,
             "block_size": int(node.attrs.get("block_size", 0) or 0)}
    if int(node.attrs.get("precision", 0) or 0):
        attrs["precision"] = int(node.attrs["precision"])
    return attrs


def quantize_linear_vjp(b, node, gys, needed):
    """Straight-through gradient of x (and of the scale, when it trains); gq may be integer
    typed only as a check's seed (a float gradient otherwise, from DequantizeLinear's rule)."""
    x, scale = node.inputs[:2]
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    attrs = {**_grad_attrs(node), "to": onnx_elem_type(node.outputs[0].dtype)}
    like = [x] + ([scale] if needed[1] else [])
    outs = b.op("QuantizeLinearGrad", [gys[0], x, scale, zp], attrs, domain=INTERNAL_DOMAIN,
                like=like)
    outs = outs if isinstance(outs, list) else [outs]
    grads = [outs[0] if needed[0] else None, outs[1] if needed[1] else None]
    return grads + [None] * (len(node.inputs) - 2)


def dequantize_linear_vjp(b, node, gys, needed):
    """The quantized value's gradient (float, shaped like it) and the scale's."""
    x, scale = node.inputs[:2]
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    gy = gys[0]
    specs = [(x.shape, gy.dtype)] + ([(scale.shape, scale.dtype)] if needed[1] else [])
    outs = b.op("DequantizeLinearGrad", [gy, x, scale, zp], _grad_attrs(node),
                domain=INTERNAL_DOMAIN, shapes=specs)
    outs = outs if isinstance(outs, list) else [outs]
    grads = [outs[0] if needed[0] else None, outs[1] if needed[1] else None]
    return grads + [None] * (len(node.inputs) - 2)


# ---- DynamicQuantizeLinear ------------------------------------------------------------------


def dynamic_quantize_linear_numpy(ctx):
    """uint8 quantization of x with the scale and zero point its range gives, in float32 as
    onnx.reference (and onnxruntime) compute them: the range always contains 0."""
    t = ctx.workspace(ctx.inputs[0].shape, np.float32)
    f32 = np.float32

    def run(ins, outs, ws):
        x = ins[0]
        hi, lo = f32(max(0.0, np.max(x))), f32(min(0.0, np.min(x)))
        scale = f32(f32(1.0) if hi == lo else f32(hi - lo)) / f32(255)
        zp = np.rint(max(f32(0), min(f32(255), f32(0) - lo / scale)))
        q = ws[t]
        np.divide(x, scale, out=q, casting="unsafe")
        np.rint(q, out=q)
        np.add(q, zp, out=q)
        np.clip(q, 0, 255, out=q)
        np.copyto(outs[0], q, casting="unsafe")
        outs[1][...] = scale
        outs[2][...] = zp

    return run


# ---- integer contractions ---------------------------------------------------------------------


def _centered(src: np.ndarray, zp: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """``out = src - zp`` in float64 (exact for the quantized types)."""
    if zp is None:
        np.copyto(out, src, casting="unsafe")
    else:
        np.subtract(src, zp, out=out, dtype=np.float64, casting="unsafe")
    return out


def _requantize(acc: np.ndarray, multiplier: np.ndarray, zp, y: np.ndarray) -> None:
    """``y = saturate(round_half_even(acc * multiplier) + zp)`` in place over ``acc``."""
    np.multiply(acc, multiplier, out=acc)
    if zp is not None:
        np.add(acc, zp, out=acc, casting="unsafe")
    np.rint(acc, out=acc)
    lo, hi = quant_range(y.dtype)
    np.clip(acc, lo, hi, out=acc)
    np.copyto(y, acc, casting="unsafe")


def _multiplier_workspaces(ctx, shape) -> tuple[int, int]:
    """The requantization multiplier's workspaces: in the scales' type, and in float64."""
    return ctx.workspace(shape, ctx.inputs[1].dtype), ctx.workspace(shape, np.float64)


def _multiplier(sa, sb, sy, ws: list, spaces: tuple[int, int]) -> np.ndarray:
    """``sa * sb / sy`` in the scales' own type, as onnx.reference forms it, then float64."""
    m, out = ws[spaces[0]], ws[spaces[1]]
    np.multiply(sa, sb, out=m, casting="unsafe")
    np.divide(m, sy, out=m, casting="unsafe")
    np.copyto(out, m, casting="unsafe")
    return out


def _matmul_integer(ctx, a: int, b: int):
    """Plan of ``(A - a_zp) @ (B - b_zp)`` for inputs ``a`` and ``b``: workspaces for the
    centred operands and the float64 product. A's zero point is a scalar or one per row
    ([M]), B's a scalar or one per column ([N])."""
    a_shape, b_shape = tuple(ctx.inputs[a].shape), tuple(ctx.inputs[b].shape)
    ws = (ctx.workspace(a_shape, np.float64), ctx.workspace(b_shape, np.float64),
          ctx.workspace(ctx.outputs[0].shape, np.float64))

    def product(w, x_a, x_b, zp_a=None, zp_b=None) -> np.ndarray:
        if zp_a is not None:
            zp_a = zp_a.reshape(()) if zp_a.size == 1 else zp_a.reshape(-1, 1)
        return np.matmul(_centered(x_a, zp_a, w[ws[0]]), _centered(x_b, zp_b, w[ws[1]]),
                         out=w[ws[2]])

    return product


def matmul_integer_numpy(ctx):
    """``y = (a - a_zero_point) @ (b - b_zero_point)`` in int32."""
    product = _matmul_integer(ctx, 0, 1)

    def run(ins, outs, ws):
        np.copyto(outs[0], product(ws, *ins), casting="unsafe")

    return run


def qlinear_matmul_numpy(ctx):
    """Inputs a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp: the integer product of the
    centred operands, requantized by ``a_scale * b_scale / y_scale`` (b's per column allowed)
    to y_zp's type."""
    product = _matmul_integer(ctx, 0, 3)
    m = _multiplier_workspaces(ctx, np.broadcast_shapes(*(ctx.inputs[i].shape
                                                          for i in (1, 4, 6))))

    def run(ins, outs, ws):
        acc = product(ws, ins[0], ins[3], ins[2], ins[5])
        _requantize(acc, _multiplier(ins[1], ins[4], ins[6], ws, m), ins[7], outs[0])

    return run


def _conv_integer(ctx, w_index: int, x_zp: int | None, w_zp: int | None):
    """Plan of the integer convolution of ``x - x_zp`` by ``w - w_zp`` (per output channel
    allowed): padded channels-last float64 input, im2col, one matmul per group; returns
    ``conv(ins, ws) -> [N, *S_out, O]`` float64."""
    x_info, w_info = ctx.inputs[0], ctx.inputs[w_index]
    n, c, *spatial = x_info.shape
    o, cg, *kernel = w_info.shape
    group = int(ctx.attrs.get("group", 1))
    if cg * group != c or o % group or len(kernel) != len(spatial):
        raise ctx.error(f"weight {list(w_info.shape)} does not fit input {list(x_info.shape)} "
                        f"with group={group}")
    kernel = tuple(int(k) for k in (ctx.attrs.get("kernel_shape") or kernel))
    attrs = {"auto_pad": ctx.attrs.get("auto_pad", "NOTSET"), **ctx.attrs}
    try:
        win = Window.resolve(attrs, spatial, kernel)
    except ValueError as e:
        raise ctx.error(str(e)) from None
    interior, slabs = padding_slabs_nhwc(win)
    og, taps = o // group, math.prod(kernel)
    rows = n * math.prod(win.out_shape)
    xp_ws = ctx.workspace((n, *win.padded_shape, c), np.float64)
    xc_ws = ctx.workspace((n, *spatial, c), np.float64)
    col_ws = ctx.workspace((rows, taps * cg), np.float64)
    w_ws = ctx.workspace((o, *kernel, cg), np.float64)
    y_ws = ctx.workspace((rows, o), np.float64)
    rank = len(spatial) + 2
    to_last = (0, *range(2, rank), 1)

    def conv(ins, ws):
        x_zero = None if x_zp is None else ins[x_zp].reshape(())
        xc = _centered(ins[0].transpose(to_last), x_zero, ws[xc_ws])
        xp = pad_nhwc(xc, ws[xp_ws], interior, slabs, 0.0)  # padding is the zero point
        w_zero = None if w_zp is None else ins[w_zp].reshape((-1,) + (1,) * (rank - 1))
        # centred into the [O, *K, C/group] order of im2col's columns
        _centered(ins[w_index], w_zero, ws[w_ws].transpose((0, rank - 1, *range(1, rank - 1))))
        w2 = ws[w_ws].reshape(o, taps * cg)
        y2 = ws[y_ws]
        for g in range(group):
            cs, os_ = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
            col = im2col_nhwc(xp[..., cs], win, ws[col_ws])
            np.matmul(col, w2[os_].T, out=y2[:, os_])
        return y2.reshape(n, *win.out_shape, o)

    return conv, win


def _check_out(ctx, win) -> None:
    if tuple(ctx.outputs[0].shape[2:]) != win.out_shape:
        raise ctx.error(f"window arithmetic gives spatial output {list(win.out_shape)} but "
                        f"shape inference says {list(ctx.outputs[0].shape[2:])}")


def conv_integer_numpy(ctx):
    """``y = conv(x - x_zero_point, w - w_zero_point)`` in int32 (Conv's attributes)."""
    conv, win = _conv_integer(ctx, 1, 2 if ctx.has_input(2) else None,
                              3 if ctx.has_input(3) else None)
    _check_out(ctx, win)
    rank = len(ctx.outputs[0].shape)
    to_first = (0, rank - 1, *range(1, rank - 1))

    def run(ins, outs, ws):
        np.copyto(outs[0], conv(ins, ws).transpose(to_first), casting="unsafe")

    return run


def qlinear_conv_numpy(ctx):
    """Inputs x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B (int32): the integer
    convolution plus B, requantized by ``x_scale * w_scale / y_scale`` (w_scale may be per
    output channel) to y_zp's type."""
    conv, win = _conv_integer(ctx, 3, 2, 5)
    _check_out(ctx, win)
    o = ctx.inputs[3].shape[0]
    m = _multiplier_workspaces(ctx, (o,))
    rank = len(ctx.outputs[0].shape)
    has_bias = ctx.has_input(8)

    def run(ins, outs, ws):
        acc = conv(ins, ws)
        if has_bias:
            np.add(acc, ins[8], out=acc, casting="unsafe")
        multiplier = _multiplier(ins[1], ins[4].reshape(-1), ins[6], ws, m)
        y = outs[0].transpose((0, *range(2, rank), 1))
        _requantize(acc, multiplier, ins[7].reshape(()), y)

    return run


# ---- registration ---------------------------------------------------------------------------

Q_VERSIONS = (10, 13, 19, 21, 23, 24, 25, 28)
_FORWARD_ONLY = {"differentiable": False, "layout": PLAIN_ONLY}


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("QuantizeLinear", Q_VERSIONS, {"numpy": quantize_linear_numpy},
              layout=ELEMENTWISE, differentiable=True, gradient=quantize_linear_vjp,
              grad_inputs=(0, 1), forwards_params=True, straight_through=True,
              doc="y = saturate(round(x / scale) + zero_point): per tensor, per axis, blocked; "
                  "straight-through gradient (rounding as identity, 0 where clipped)"),
        OpDef("DequantizeLinear", Q_VERSIONS, {"numpy": dequantize_linear_numpy},
              layout=ELEMENTWISE, differentiable=True, gradient=dequantize_linear_vjp,
              grad_inputs=(0, 1), forwards_params=True,
              doc="y = (x - zero_point) * scale; the gradient of a quantized x is float"),
        OpDef("DynamicQuantizeLinear", (11,), {"numpy": dynamic_quantize_linear_numpy},
              differentiable=False, layout=PLAIN_ONLY),
        OpDef("MatMulInteger", (10,), {"numpy": matmul_integer_numpy}, **_FORWARD_ONLY),
        OpDef("QLinearMatMul", (10, 21), {"numpy": qlinear_matmul_numpy}, **_FORWARD_ONLY),
        OpDef("ConvInteger", (10,), {"numpy": conv_integer_numpy}, **_FORWARD_ONLY),
        OpDef("QLinearConv", (10,), {"numpy": qlinear_conv_numpy}, **_FORWARD_ONLY),
        # backward ops of the rules above
        OpDef("QuantizeLinearGrad", (1,), {"numpy": quantize_linear_grad_numpy},
              domain=INTERNAL_DOMAIN, layout=ELEMENTWISE,
              doc="straight-through gradient of QuantizeLinear: (gx, gscale?)"),
        OpDef("DequantizeLinearGrad", (1,), {"numpy": dequantize_linear_grad_numpy},
              domain=INTERNAL_DOMAIN, layout=ELEMENTWISE,
              doc="gradient of DequantizeLinear: (g of the quantized value, gscale?)"),
    ]
