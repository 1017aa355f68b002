"""Conv, ConvTranspose, DeformConv and CausalConvWithState (their window arithmetic:
``ops/conv_window.py``).

All kernels but DeformConv's and CausalConvWithState's (plain NCHW / ``[N, C, L]``) compute
channels-last: a feature map ``[N, C, *S]`` is read as its ``[N, *S, C]``
view (near-contiguous over the physical NHWC buffer) and the output is written through the
same kind of view. Conv is im2col + one matmul per group (``im2col_nhwc``); depthwise Conv
accumulates kernel taps instead; ConvTranspose is one matmul per group + col2im
(``col2im_nhwc``). Every buffer the step needs is a plan-time workspace.

Gradients: Conv's rule emits the backward ops ConvGradData (the transposed convolution: for
stride 1 a Conv of the padded gy with the flipped weight, else gy @ w then col2im) and
ConvGradFilter (im2col(x)^T @ gy), both domain ai.tr_onnx (their kernels: ``ops/conv_grad.py``),
and a ReduceSum for the bias; ConvTranspose's rule is a Conv of gy and a ConvGradFilter with the
roles of x and gy swapped.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..domains import INTERNAL_DOMAIN
from ..dtypes import accumulator_dtype
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..layouts import channels_last_view
from ..opdef import (
    BATCHNORM_FOLDS_INTO,
    CHANNEL_VECTOR,
    CHANNELS_LAST,
    CONV_WEIGHT,
    CONVOLUTION,
    PLAIN,
    SPATIAL,
    LayoutRule,
    OpDef,
)
from . import conv_grid, conv_onednn
from .conv_window import (
    Window,
    as_2d,
    channel_groups,
    col2im_nhwc,
    col2im_slices_nhwc,
    im2col_nhwc,
    matrix_view_or_copy,
    mergeable_2d,
    pad_nhwc,
    padding_slabs_nhwc,
)

CONV_LAYOUT = LayoutRule(inputs=SPATIAL.inputs, outputs=SPATIAL.outputs,
                         weights={1: CONV_WEIGHT, 2: CHANNEL_VECTOR})
# ConvGradFilter slides over a feature map (input 0) and writes a weight-shaped gradient
GRAD_FILTER_LAYOUT = LayoutRule(inputs=CHANNELS_LAST, outputs=PLAIN)


def _kernel_shape(attrs, w_shape) -> tuple[int, ...]:
    return tuple(int(k) for k in (attrs.get("kernel_shape") or w_shape[2:]))


def grid_useful(win: Window, dtype: np.dtype) -> bool:
    return conv_grid.Grid.useful(win, dtype)


def onednn_kernel(name: str, ctx, win: Window, group: int, dtype: np.dtype, **post_ops):
    """The oneDNN kernel ``name`` of ops.conv_onednn for this node, or None (not installed,
    not float32, a window or primitive oneDNN refuses, a shape NumPy runs faster:
    ``conv_onednn.preferred``): then NumPy runs it."""
    if not conv_onednn.usable(win, dtype) or not conv_onednn.preferred(name, ctx, win, group):
        return None
    return getattr(conv_onednn, name)(ctx, win, group, **post_ops)


# --------------------------------------------------------------------------------------------
# Conv
# --------------------------------------------------------------------------------------------

def conv_numpy(ctx):
    return conv_kernel(ctx)[0]


def conv_kernel(ctx, add: bool = False, clip: tuple[float, float] | None = None):
    """(run, fused): the kernel of a Conv node (or of ops/fused_conv.py's FusedConv, which
    asks oneDNN to ``add`` its input 3 and ``clip`` to (lo, hi) too); ``fused`` says whether
    the kernel did that, else the caller does."""
    x_info, w_info, y_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    if len(x_info.shape) < 3 or len(w_info.shape) != len(x_info.shape):
        raise ctx.error(f"weight {list(w_info.shape)} does not fit input {list(x_info.shape)}: "
                        "both are [N or M, C, spatial...] of one rank, at least 3")
    n, c, *spatial = x_info.shape
    o, cg, *_ = w_info.shape
    group = int(ctx.attrs["group"])
    kernel = _kernel_shape(ctx.attrs, w_info.shape)
    if tuple(w_info.shape[2:]) != kernel or cg * group != c or o % group:
        raise ctx.error(f"weight {list(w_info.shape)} does not fit input {list(x_info.shape)} "
                        f"with group={group}, kernel_shape={list(kernel)}")
    win = Window.for_node(ctx, spatial, kernel)
    dtype = np.dtype(y_info.dtype)
    post_ops = {"add": add, "clip": clip} if add or clip else {}
    fast = onednn_kernel("conv_onednn", ctx, win, group, dtype, **post_ops)
    if fast is not None:
        return fast, True
    if post_ops:
        return conv_kernel(ctx)[0], False
    compute = accumulator_dtype(dtype)
    cast = compute != dtype
    xp_k = (ctx.workspace((n, *win.padded_shape, c), compute) if win.needs_padding or cast
            else None)
    interior, slabs = padding_slabs_nhwc(win)
    if group == c and group > 1:
        return _depthwise_conv_numpy(ctx, win, o // c, xp_k, interior, slabs, compute), False

    og, taps = o // group, math.prod(kernel)
    rows = n * math.prod(win.out_shape)
    pointwise = taps == 1 and not win.needs_padding and all(s == 1 for s in win.strides)
    if not pointwise and not cast and grid_useful(win, dtype):
        return conv_grid.conv_grid_numpy(ctx, win, group), False
    x_rows_ok = pointwise and (xp_k is not None or mergeable_2d(x_info, True, 1 + win.ndim))
    col_k = None if x_rows_ok else ctx.workspace((rows, taps * cg), compute)
    w_k = (None if not cast and mergeable_2d(w_info, True, 1)
           else ctx.workspace((o, taps * cg), compute))
    y_k = (None if not cast and mergeable_2d(y_info, True, 1 + win.ndim)
           else ctx.workspace((rows, o), compute))
    groups = channel_groups(group, cg, og)
    has_bias = ctx.has_input(2)
    zero = compute.type(0)

    def run(ins, outs, ws):
        x = channels_last_view(ins[0])
        xp = pad_nhwc(x, ws[xp_k], interior, slabs, zero) if xp_k is not None else x
        w2 = matrix_view_or_copy(channels_last_view(ins[1]), 1,
                                 ws[w_k] if w_k is not None else None)
        y = channels_last_view(outs[0])
        y2 = as_2d(y, 1 + win.ndim) if y_k is None else ws[y_k]
        for cs, os_ in groups:
            if col_k is None:
                col = as_2d(xp, 1 + win.ndim)[:, cs]
            else:
                col = im2col_nhwc(xp[..., cs], win, ws[col_k])
            np.matmul(col, w2[os_].T, out=y2[:, os_])
        if has_bias:
            np.add(y2, ins[2], out=y2)
        if y_k is not None:
            np.copyto(y, y2.reshape(y.shape), casting="same_kind")

    return run, False


def _depthwise_conv_numpy(ctx, win, mult, xp_k, interior, slabs, compute):
    """group == C: each output channel ``c*mult + m`` sees only input channel ``c``, so sum the
    kernel taps elementwise (no im2col, no matmul)."""
    n, c = ctx.inputs[0].shape[:2]
    cast = compute != np.dtype(ctx.outputs[0].dtype)
    x_taps = win.tap_slices_nhwc()
    w_taps = [(slice(None), 0, *tap) for tap in win.taps]
    split = (n, *win.out_shape, c, mult)
    prod_k = ctx.workspace(split, compute) if len(x_taps) > 1 else None
    acc_k = ctx.workspace(split, compute) if cast else None
    wc_k = ctx.workspace(ctx.inputs[1].shape, compute) if cast else None
    has_bias = ctx.has_input(2)
    zero = compute.type(0)

    def run(ins, outs, ws):
        x = channels_last_view(ins[0])
        xp = pad_nhwc(x, ws[xp_k], interior, slabs, zero) if xp_k is not None else x
        w = ins[1]
        if wc_k is not None:
            np.copyto(ws[wc_k], w)
            w = ws[wc_k]
        y = channels_last_view(outs[0])
        # [N, *S, C*mult] -> [N, *S, C, mult]: splitting the unit-stride channel axis is a view
        y4 = as_strided(y, split, (*y.strides[:-1], y.strides[-1] * mult, y.strides[-1]))
        acc = ws[acc_k] if acc_k is not None else y4
        tmp = ws[prod_k] if prod_k is not None else None
        for t, (xs, wsl) in enumerate(zip(x_taps, w_taps)):
            xt = xp[xs][..., None]
            wt = w[wsl].reshape(c, mult)  # a 1-D strided vector: reshaping it is a view
            if t == 0:
                np.multiply(xt, wt, out=acc)
            else:
                np.multiply(xt, wt, out=tmp)
                np.add(acc, tmp, out=acc)
        if has_bias:
            np.add(acc, ins[2].reshape(c, mult), out=acc)
        if acc_k is not None:
            np.copyto(y4, acc, casting="same_kind")

    return run


# --------------------------------------------------------------------------------------------
# ConvTranspose
# --------------------------------------------------------------------------------------------

def conv_transpose_pads(attrs, in_shape, kernel, strides, dilations):
    """(pads_begin, pads_end) of a ConvTranspose: from ``output_shape`` or ``auto_pad`` SAME_*
    (the total split as ONNX and onnxruntime do), else the explicit ``pads``."""
    nd = len(in_shape)
    out_pad = [int(p) for p in attrs.get("output_padding") or (0,) * nd]
    auto_pad = attrs["auto_pad"]
    target = attrs.get("output_shape")
    if target is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = [s * st for s, st in zip(in_shape, strides)]
    if target is not None:
        target = [int(t) for t in target][-nd:]
        total = [st * (s - 1) + op + (k - 1) * d + 1 - t for st, s, op, k, d, t in
                 zip(strides, in_shape, out_pad, kernel, dilations, target)]
        if auto_pad == "SAME_UPPER":
            return [t // 2 for t in total], [t - t // 2 for t in total], out_pad
        return [t - t // 2 for t in total], [t // 2 for t in total], out_pad
    pads = [int(p) for p in attrs.get("pads") or (0,) * (2 * nd)]
    return pads[:nd], pads[nd:], out_pad


def conv_transpose_numpy(ctx):
    x_info, w_info, y_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n, c, *spatial = x_info.shape
    _, og, *_ = w_info.shape
    group = int(ctx.attrs["group"])
    kernel = _kernel_shape(ctx.attrs, w_info.shape)
    nd = len(spatial)
    strides = tuple(int(s) for s in ctx.attrs.get("strides") or (1,) * nd)
    dilations = tuple(int(d) for d in ctx.attrs.get("dilations") or (1,) * nd)
    out_shape = tuple(y_info.shape[2:])
    begin, end, out_pad = conv_transpose_pads(ctx.attrs, spatial, kernel, strides, dilations)
    want = tuple(st * (s - 1) + op + (k - 1) * d + 1 - b - e for st, s, op, k, d, b, e in
                 zip(strides, spatial, out_pad, kernel, dilations, begin, end))
    if want != out_shape or w_info.shape[0] != c or c % group:
        raise ctx.error(f"ConvTranspose arithmetic gives spatial output {list(want)} but shape "
                        f"inference says {list(out_shape)}")
    compute = accumulator_dtype(y_info.dtype)
    cast = compute != np.dtype(y_info.dtype)
    cg, o = c // group, og * group
    taps = math.prod(kernel)
    # The full (uncropped) result lives in a workspace whose origin is shifted so that
    # negative pads (an output larger than the full result) still index from 0.
    shift = [max(0, -b) for b in begin]
    full_len = [st * (s - 1) + (k - 1) * d + 1 for st, s, k, d in
                zip(strides, spatial, kernel, dilations)]
    extent = [max(sh + fl, sh + b + os_) for sh, fl, b, os_ in
              zip(shift, full_len, begin, out_shape)]
    full_k = ctx.workspace((n, *extent, o), compute)
    rows = n * math.prod(spatial)
    col_k = ctx.workspace((rows, taps * og), compute)
    x_k = (None if not cast and mergeable_2d(x_info, True, 1 + nd)
           else ctx.workspace((rows, c), compute))
    w_k = (None if not cast and mergeable_2d(w_info, True, 1)
           else ctx.workspace((c, taps * og), compute))
    # x's positions are the windows of a convolution over the full result: col2im_nhwc into it
    frame_win = Window(tuple(full_len), kernel, strides, dilations, (0,) * nd, (0,) * nd,
                       tuple(spatial))
    frame = (slice(None),) + tuple(slice(sh, sh + fl) for sh, fl in zip(shift, full_len))
    crop = (slice(None),) + tuple(slice(sh + b, sh + b + os_) for sh, b, os_ in
                                  zip(shift, begin, out_shape)) + (slice(None),)
    col_shape = (n, *spatial, *kernel, og)
    groups = [(cs, col2im_slices_nhwc(frame_win, os_)) for cs, os_ in channel_groups(group, cg, og)]
    has_bias = ctx.has_input(2)

    def run(ins, outs, ws):
        x2 = matrix_view_or_copy(channels_last_view(ins[0]), 1 + nd,
                                 ws[x_k] if x_k is not None else None)
        w2 = matrix_view_or_copy(channels_last_view(ins[1]), 1,
                                 ws[w_k] if w_k is not None else None)
        full, col = ws[full_k], ws[col_k]
        full.fill(0)
        cols = col.reshape(col_shape)
        for cs, scatter in groups:
            np.matmul(x2[:, cs], w2[cs], out=col)
            col2im_nhwc(cols, full[frame], scatter)
        cropped = full[crop]
        if has_bias:
            np.add(cropped, ins[2], out=cropped)
        np.copyto(channels_last_view(outs[0]), cropped, casting="same_kind")

    return run


# --------------------------------------------------------------------------------------------
# Gradient rules
# --------------------------------------------------------------------------------------------



def _bias_grad(b, gy):
    """d/db of a bias added per output channel: gy summed over N and the spatial axes."""
    return b.op("ReduceSum", [gy, b.ints([0, *range(2, len(gy.shape))])], {"keepdims": 0})


def conv_vjp(b, node, gys, needed):
    """Conv: gx = ConvGradData(gy, w), gw = ConvGradFilter(x, gy), gb = ReduceSum(gy)."""
    gy = gys[0]
    grads = [None] * len(node.inputs)
    if gy is None:
        return grads
    x, w = node.inputs[:2]
    win = Window.resolve(node.attrs, x.shape[2:], _kernel_shape(node.attrs, w.shape))
    attrs = {**win.attrs(), "group": int(node.attrs["group"])}
    if needed[0]:
        grads[0] = b.op("ConvGradData", [gy, w], attrs, domain=INTERNAL_DOMAIN, like=x)
    if needed[1]:
        grads[1] = b.op("ConvGradFilter", [x, gy], attrs, domain=INTERNAL_DOMAIN, like=w)
    if len(needed) > 2 and needed[2]:
        grads[2] = _bias_grad(b, gy)
    return grads


def conv_transpose_adjoint_attrs(node) -> dict:
    """The attributes of the Conv whose adjoint ``node`` (a ConvTranspose) is: the Conv over
    ConvTranspose's output that gives its input's spatial shape with the same weight, strides,
    dilations and group, its pads those of the uncropped frame. Its gradient is that Conv (gx)
    and a ConvGradFilter; the cuda backend runs the ConvTranspose itself as that Conv's cuDNN
    data gradient. Raises UnsupportedModelError where the output extends past the full
    result (negative pads, an output_padding beyond the end pad by a stride)."""
    x, w = node.inputs[:2]
    spatial = x.shape[2:]
    nd = len(spatial)
    kernel = _kernel_shape(node.attrs, w.shape)
    strides = [int(s) for s in node.attrs.get("strides") or (1,) * nd]
    dilations = [int(d) for d in node.attrs.get("dilations") or (1,) * nd]
    begin, end, out_pad = conv_transpose_pads(node.attrs, spatial, kernel, strides, dilations)
    # the output_padding tail never received x's contributions: drop it from the end pad
    # (a conv pad below one stride is absorbed by the floor of the window count)
    conv_end = [max(0, e - op) for e, op in zip(end, out_pad)]
    if min(begin) < 0 or any(e - op <= -st for e, op, st in zip(end, out_pad, strides)):
        raise UnsupportedModelError(
            f"{node.label}: no adjoint Conv for a ConvTranspose whose output extends past its "
            f"full result (pads {list(begin) + list(end)}, output_padding {out_pad})", [])
    return {"kernel_shape": list(kernel), "strides": strides, "dilations": dilations,
            "pads": list(begin) + conv_end, "auto_pad": "NOTSET",
            "group": int(node.attrs["group"])}


def conv_transpose_vjp(b, node, gys, needed):
    """ConvTranspose is the adjoint of a Conv with the same weight: gx = Conv(gy, w) over gy
    padded back to the uncropped frame, gw = ConvGradFilter(gy, x) (roles swapped)."""
    gy = gys[0]
    grads = [None] * len(node.inputs)
    if gy is None:
        return grads
    x, w = node.inputs[:2]
    attrs = conv_transpose_adjoint_attrs(node)
    if needed[0]:
        grads[0] = b.op("Conv", [gy, w], attrs, like=x)
    if needed[1]:
        grads[1] = b.op("ConvGradFilter", [gy, x], attrs, domain=INTERNAL_DOMAIN, like=w)
    if len(needed) > 2 and needed[2]:
        grads[2] = _bias_grad(b, gy)
    return grads


def conv_value_bound(node, bound, stats) -> float | None:
    """A constant weight and bias: |y| <= |x| * max_o sum |w_o| + max |b| (per output
    channel o)."""
    w, x = node.inputs[1], bound(node.inputs[0])
    has_b = len(node.inputs) > 2 and node.inputs[2] is not None
    b = stats.max_abs(node.inputs[2]) if has_b else 0.0
    data = stats.data(w)
    if data is None or b is None or x is None or data.ndim < 2:
        return None
    return x * stats.largest_sum(w, 1) + b


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Conv", (1, 11, 22), {"numpy": conv_numpy}, layout=CONV_LAYOUT,
              differentiable=True, gradient=conv_vjp, param_inputs=(1, 2),
              value_bounds=conv_value_bound,
              traits=frozenset({CONVOLUTION, BATCHNORM_FOLDS_INTO})),
        OpDef("ConvTranspose", (1, 11, 22), {"numpy": conv_transpose_numpy}, layout=CONV_LAYOUT,
              differentiable=True, gradient=conv_transpose_vjp, param_inputs=(1, 2),
              traits=frozenset({CONVOLUTION, BATCHNORM_FOLDS_INTO})),
    ]
