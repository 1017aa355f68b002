"""Conv's backward ops (domain ai.tr_onnx): ConvGradData (gx, the transposed convolution of
gy: for stride 1 a Conv of the padded gy with the flipped weight, else gy @ w then col2im) and
ConvGradFilter (gw = im2col(x)^T @ gy per group). Conv's and ConvTranspose's gradient rules
(``ops/conv.py``) emit them.

Both carry the forward window with explicit pads (``Window.attrs``) and ``group``; the
feature-map operand they slide over is input 0 (channels-last, like the forward's x). They
share the window arithmetic (``ops.conv_window``) and the forward's fast paths
(``ops.conv_grid``, ``ops.conv_onednn``).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import host_blas
from ..domains import INTERNAL_DOMAIN
from ..dtypes import accumulator_dtype
from ..hookspecs import hookimpl
from ..layouts import channels_last_view
from ..opdef import OpDef
from . import conv_grid
from .conv import CONV_LAYOUT, GRAD_FILTER_LAYOUT, grid_useful, onednn_kernel
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


def _as_compute(a: np.ndarray, ws_arr: np.ndarray | None) -> np.ndarray:
    """``a`` itself, or its copy in the accumulation dtype (a plan-time workspace)."""
    if ws_arr is None:
        return a
    np.copyto(ws_arr.reshape(a.shape), a)
    return ws_arr.reshape(a.shape)


def conv_grad_data_numpy(ctx):
    """gx = the transposed convolution of gy. Stride 1: a forward convolution of the padded gy
    (``_grad_data_as_conv_numpy``). Otherwise one matmul per group (``gy @ w`` gives every
    window's contribution, ``[rows, taps*cg]``), then col2im into the padded gx and a crop."""
    gy_info, w_info, gx_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n, c, *spatial = gx_info.shape
    o, cg, *_ = w_info.shape
    group = int(ctx.attrs["group"])
    kernel = tuple(int(k) for k in ctx.attrs["kernel_shape"])
    win = Window.for_node(ctx, spatial, kernel, out_shape=gy_info.shape[2:])
    nd, dtype = win.ndim, np.dtype(gx_info.dtype)
    compute = accumulator_dtype(dtype)
    cast = compute != dtype
    fast = onednn_kernel("conv_grad_data_onednn", ctx, win, group, dtype)
    if fast is not None:
        return fast
    depthwise = group == c and group > 1
    if not depthwise and not cast and math.prod(kernel) > 1 and grid_useful(win, dtype):
        return conv_grid.conv_grad_data_grid_numpy(ctx, win, group)
    adjoint = _adjoint_window(win)
    if adjoint is not None and not depthwise:
        return _grad_data_as_conv_numpy(ctx, adjoint, group, compute)
    direct = not win.needs_padding and not cast  # accumulate straight into gx's view
    gxp_k = None if direct else ctx.workspace((n, *win.padded_shape, c), compute)
    interior, _ = padding_slabs_nhwc(win)
    if group == c and group > 1:
        return _depthwise_grad_data_numpy(ctx, win, o // c, gxp_k, interior, compute)
    og, taps = o // group, math.prod(kernel)
    rows = n * math.prod(win.out_shape)
    gy_k = (None if not cast and mergeable_2d(gy_info, True, 1 + nd)
            else ctx.workspace((rows, o), compute))
    w_k = (None if not cast and mergeable_2d(w_info, True, 1)
           else ctx.workspace((o, taps * cg), compute))
    col_k = ctx.workspace((rows, taps * cg), compute)
    col_shape = (n, *win.out_shape, *kernel, cg)
    groups = [(cs, os_, col2im_slices_nhwc(win, cs)) for cs, os_ in channel_groups(group, cg, og)]

    def run(ins, outs, ws):
        gy2 = matrix_view_or_copy(channels_last_view(ins[0]), 1 + nd,
                                  ws[gy_k] if gy_k is not None else None)
        w2 = matrix_view_or_copy(channels_last_view(ins[1]), 1,
                                 ws[w_k] if w_k is not None else None)
        gx = channels_last_view(outs[0])
        gxp = gx if direct else ws[gxp_k]
        gxp.fill(0)
        col = ws[col_k]
        for _, os_, scatter in groups:
            np.matmul(gy2[:, os_], w2[os_], out=col)
            col2im_nhwc(col.reshape(col_shape), gxp, scatter)
        if not direct:
            np.copyto(gx, gxp[interior], casting="same_kind")

    return run


def _adjoint_window(win: Window) -> Window | None:
    """For a stride-1 window, the window of the convolution that computes gx from gy: over
    gy padded by ``dilation*(k-1) - pad`` on each side, the same kernel and dilations. None
    when the window is strided or a pad exceeds the kernel's span (gy would be cropped)."""
    if any(st != 1 for st in win.strides):
        return None
    spans = [(k - 1) * d for k, d in zip(win.kernel, win.dilations)]
    begin = tuple(sp - b for sp, b in zip(spans, win.pads_begin))
    end = tuple(sp - e for sp, e in zip(spans, win.pads_end))
    if min(begin + end) < 0:
        return None
    return Window(win.out_shape, win.kernel, win.strides, win.dilations, begin, end,
                  win.in_shape)


def _grad_data_as_conv_numpy(ctx, adjoint: Window, group: int, compute: np.dtype):
    """Stride 1: gx = Conv(pad(gy), w'), where ``w'[g*cg + i, o, tap] = w[g*og + o, i,
    flipped tap]`` (the kernel flipped, in and out channels swapped, per group): im2col + one
    matmul per group into gx, no scatter. ``w'`` is copied every step (weights change)."""
    gy_info, w_info, gx_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n, c = gx_info.shape[:2]
    o, cg, *kernel = w_info.shape
    og, taps, nd = o // group, math.prod(kernel), adjoint.ndim
    cast = compute != np.dtype(gx_info.dtype)
    rows = n * math.prod(adjoint.out_shape)
    direct = not adjoint.needs_padding and not cast  # 1x1 kernel: gy itself is the matrix
    gyp_k = None if direct else ctx.workspace((n, *adjoint.padded_shape, o), compute)
    interior, slabs = padding_slabs_nhwc(adjoint)
    gy_k = None if not direct or mergeable_2d(gy_info, True, 1 + nd) else \
        ctx.workspace((rows, o), compute)
    col_k = None if direct else ctx.workspace((rows, taps * og), compute)
    wt_k = ctx.workspace((c, taps * og), compute)
    gx_k = (None if not cast and mergeable_2d(gx_info, True, 1 + nd)
            else ctx.workspace((rows, c), compute))
    wt_shape = (group, cg, *kernel, og)
    # w [O, Cg, *K] seen as [group, og, cg, *K], kernel flipped, then ordered like wt_shape
    flip = (slice(None),) * 3 + (slice(None, None, -1),) * nd
    order = (0, 2, *range(3, 3 + nd), 1)
    groups = channel_groups(group, cg, og)
    zero = compute.type(0)

    def run(ins, outs, ws):
        w = ins[1]
        np.copyto(ws[wt_k].reshape(wt_shape),
                  w.reshape(group, og, cg, *w.shape[2:])[flip].transpose(order))
        wt = ws[wt_k]
        gy = channels_last_view(ins[0])
        gx = channels_last_view(outs[0])
        gx2 = as_2d(gx, 1 + nd) if gx_k is None else ws[gx_k]
        if direct:
            gy2 = matrix_view_or_copy(gy, 1 + nd, ws[gy_k] if gy_k is not None else None)
            for cs, os_ in groups:
                np.matmul(gy2[:, os_], wt[cs].T, out=gx2[:, cs])
        else:
            gyp = pad_nhwc(gy, ws[gyp_k], interior, slabs, zero)
            for cs, os_ in groups:
                col = im2col_nhwc(gyp[..., os_], adjoint, ws[col_k])
                np.matmul(col, wt[cs].T, out=gx2[:, cs])
        if gx_k is not None:
            np.copyto(gx, gx2.reshape(gx.shape), casting="same_kind")

    return run


def _depthwise_grad_data_numpy(ctx, win, mult, gxp_k, interior, compute):
    """group == C: per tap, gx's channel c gets ``sum_m gy[c*mult+m] * w[c*mult+m, tap]``."""
    n, c = ctx.outputs[0].shape[:2]
    cast = compute != np.dtype(ctx.outputs[0].dtype)
    split = (n, *win.out_shape, c, mult)
    scatter = col2im_slices_nhwc(win)
    w_taps = [(slice(None), 0, *tap) for tap in win.taps]
    gyc_k = ctx.workspace(split, compute) if cast else None
    wc_k = ctx.workspace(ctx.inputs[1].shape, compute) if cast else None
    prod_k = ctx.workspace(split, compute) if mult > 1 else None
    tmp_k = ctx.workspace((n, *win.out_shape, c), compute)

    def run(ins, outs, ws):
        gy = channels_last_view(ins[0])
        gy4 = as_strided(gy, split, (*gy.strides[:-1], gy.strides[-1] * mult, gy.strides[-1]))
        gy4 = _as_compute(gy4, ws[gyc_k] if gyc_k is not None else None)
        w = _as_compute(ins[1], ws[wc_k] if wc_k is not None else None)
        gx = channels_last_view(outs[0])
        gxp = gx if gxp_k is None else ws[gxp_k]
        gxp.fill(0)
        tmp = ws[tmp_k]
        for (dst, _), wsl in zip(scatter, w_taps):
            wt = w[wsl].reshape(c, mult)  # a 1-D strided vector: reshaping it is a view
            if mult == 1:
                np.multiply(gy4[..., 0], wt[:, 0], out=tmp)
            else:
                np.multiply(gy4, wt, out=ws[prod_k])
                np.add.reduce(ws[prod_k], axis=-1, out=tmp)
            d = gxp[dst]
            np.add(d, tmp, out=d)
        if gxp_k is not None:
            np.copyto(gx, gxp[interior], casting="same_kind")

    return run


def conv_grad_filter_numpy(ctx):
    """gw = im2col(x)^T @ gy per group, written through gw's OHWI view."""
    x_info, gy_info, gw_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n, c, *spatial = x_info.shape
    o, cg, *_ = gw_info.shape
    group = int(ctx.attrs["group"])
    kernel = tuple(int(k) for k in ctx.attrs["kernel_shape"])
    win = Window.for_node(ctx, spatial, kernel, out_shape=gy_info.shape[2:])
    nd, dtype = win.ndim, np.dtype(gw_info.dtype)
    compute = accumulator_dtype(dtype)
    cast = compute != dtype
    fast = onednn_kernel("conv_grad_filter_onednn", ctx, win, group, dtype)
    if fast is not None:
        return fast
    # a 1x1 stride-1 window: gw = gy^T @ x, one GEMM per group on the maps as they are
    if not (group == c and group > 1) and not cast and math.prod(kernel) == 1 \
            and grid_useful(win, dtype):
        return conv_grid.conv_grad_filter_grid_numpy(ctx, win, group)
    xp_k = (ctx.workspace((n, *win.padded_shape, c), compute) if win.needs_padding or cast
            else None)
    interior, slabs = padding_slabs_nhwc(win)
    zero = compute.type(0)
    if group == c and group > 1:
        return _depthwise_grad_filter_numpy(ctx, win, o // c, xp_k, interior, slabs, compute)
    og, taps = o // group, math.prod(kernel)
    rows = n * math.prod(win.out_shape)
    gy_k = (None if not cast and mergeable_2d(gy_info, True, 1 + nd)
            else ctx.workspace((rows, o), compute))
    col_k = ctx.workspace((rows, taps * cg), compute)
    groups = channel_groups(group, cg, og)
    if not cast and host_blas.available(dtype):
        matrix_k = None if mergeable_2d(gw_info, True, 1) else \
            ctx.workspace((o, taps * cg), compute)
        return _grad_filter_blas(win, groups, xp_k, gy_k, col_k, (interior, slabs, zero),
                                 matrix_k)
    # gw transposed, [(tap, channel), o]: col^T @ gy (M = taps*cg) runs ~1.6x faster in
    # OpenBLAS than gy^T @ col (M = og, often 16) for the same product
    gwt_k = ctx.workspace((taps * cg, o), compute)
    ohwi = (o, *kernel, cg)

    def run(ins, outs, ws):
        x = channels_last_view(ins[0])
        xp = pad_nhwc(x, ws[xp_k], interior, slabs, zero) if xp_k is not None else x
        gy2 = matrix_view_or_copy(channels_last_view(ins[1]), 1 + nd,
                                  ws[gy_k] if gy_k is not None else None)
        gwt, col = ws[gwt_k], ws[col_k]
        for cs, os_ in groups:
            im2col_nhwc(xp[..., cs], win, col)
            np.matmul(col.T, gy2[:, os_], out=gwt[:, os_])
        np.copyto(channels_last_view(outs[0]), gwt.T.reshape(ohwi), casting="same_kind")

    return run


def _grad_filter_blas(win, groups, xp_k, gy_k, col_k, fill, matrix_k):
    """ConvGradFilter's im2col path with the product written straight into gw's OHWI matrix
    [O, taps*Cg]: BLAS is told gw is gwt stored column-major, so it runs the fast shape
    (M = taps*Cg) and no transposed copy of gw follows. Where gw is not that matrix (padded
    channel lanes, another layout: ``matrix_k`` a workspace shaped like it), the same GEMM
    writes the workspace, copied into gw after: one summation order for every layout of gw,
    so a gradient computed into its GRAD slot equals one computed elsewhere and accumulated,
    bit for bit (``train_pass.fold_accumulators``)."""

    def make(ins, outs, ws):
        gy2 = as_2d(channels_last_view(ins[1]), 1 + win.ndim) if gy_k is None else ws[gy_k]
        matrix = as_2d(channels_last_view(outs[0]), 1) if matrix_k is None else ws[matrix_k]
        return [[host_blas.prepared_gemm(gy2[:, os_].T, ws[col_k], matrix[os_])]
                for _, os_ in groups]

    prepared = host_blas.PreparedCalls(make)

    def run(ins, outs, ws):
        calls = prepared.get(ins, outs, ws)
        x = channels_last_view(ins[0])
        xp = pad_nhwc(x, ws[xp_k], *fill) if xp_k is not None else x
        if gy_k is not None:
            np.copyto(ws[gy_k].reshape(ins[1].shape[0], *win.out_shape, -1),
                      channels_last_view(ins[1]))
        for (cs, _), group_calls in zip(groups, calls):
            im2col_nhwc(xp[..., cs], win, ws[col_k])
            for call in group_calls:
                call()
        if matrix_k is not None:
            gw = channels_last_view(outs[0])
            np.copyto(gw, ws[matrix_k].reshape(gw.shape))

    return run


def _depthwise_grad_filter_numpy(ctx, win, mult, xp_k, interior, slabs, compute):
    """group == C: per tap, ``gw[c*mult+m, 0, tap] = sum_{n,s} x[c] * gy[c*mult+m]``."""
    n, c = ctx.inputs[0].shape[:2]
    cast = compute != np.dtype(ctx.outputs[0].dtype)
    split = (n, *win.out_shape, c, mult)
    x_taps = win.tap_slices_nhwc()
    w_taps = [(slice(None), 0, *tap) for tap in win.taps]
    gyc_k = ctx.workspace(split, compute) if cast else None
    prod_k = ctx.workspace(split, compute)
    acc_k = ctx.workspace((c, mult), compute)
    sum_axes = tuple(range(1 + win.ndim))
    zero = compute.type(0)

    def run(ins, outs, ws):
        x = channels_last_view(ins[0])
        xp = pad_nhwc(x, ws[xp_k], interior, slabs, zero) if xp_k is not None else x
        gy = channels_last_view(ins[1])
        gy4 = as_strided(gy, split, (*gy.strides[:-1], gy.strides[-1] * mult, gy.strides[-1]))
        gy4 = _as_compute(gy4, ws[gyc_k] if gyc_k is not None else None)
        prod, acc, gw = ws[prod_k], ws[acc_k], outs[0]
        for xs, wsl in zip(x_taps, w_taps):
            np.multiply(xp[xs][..., None], gy4, out=prod)
            np.add.reduce(prod, axis=sum_axes, out=acc)
            np.copyto(gw[wsl].reshape(c, mult), acc, casting="same_kind")

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("ConvGradData", (1,), {"numpy": conv_grad_data_numpy}, domain=INTERNAL_DOMAIN,
              layout=CONV_LAYOUT, doc="gx of Conv: the transposed convolution of gy"),
        OpDef("ConvGradFilter", (1,), {"numpy": conv_grad_filter_numpy}, domain=INTERNAL_DOMAIN,
              layout=GRAD_FILTER_LAYOUT, doc="gw of Conv: im2col(x)^T @ gy per group"),
    ]
