"""Conv, ConvTranspose, DeformConv and CausalConvWithState, and the sliding-window arithmetic
the pools share (``Window``).

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

import itertools
import math
from dataclasses import dataclass

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

CONV_LAYOUT = LayoutRule(inputs=SPATIAL.inputs, outputs=SPATIAL.outputs,
                         weights={1: CONV_WEIGHT, 2: CHANNEL_VECTOR})
# ConvGradFilter slides over a feature map (input 0) and writes a weight-shaped gradient
GRAD_FILTER_LAYOUT = LayoutRule(inputs=CHANNELS_LAST, outputs=PLAIN)


# --------------------------------------------------------------------------------------------
# Window arithmetic (Conv, ConvTranspose's input side, every pool)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """A sliding window over the spatial axes ``in_shape`` of a channels-last feature map.

    ``pads_begin``/``pads_end`` are the padding the op defines (explicit or from ``auto_pad``);
    ``padded_shape`` is the extent the windows actually read, which may reach past
    ``pads_end`` when ``ceil_mode`` adds a last, partial window.
    """

    in_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_shape: tuple[int, ...]

    @staticmethod
    def resolve(attrs, in_shape, kernel, ceil_mode: bool = False) -> Window:
        """The window from Conv/pool attributes (``auto_pad``, ``pads``, ``strides``,
        ``dilations``; absent ones mean none). Gradient rules call it on the forward node's
        attributes and hand the resolved pads to their backward ops. Raises ValueError for
        what it cannot do (negative pads)."""
        in_shape, kernel = tuple(int(d) for d in in_shape), tuple(int(k) for k in kernel)
        nd = len(in_shape)
        strides = tuple(int(s) for s in attrs.get("strides") or (1,) * nd)
        dilations = tuple(int(d) for d in attrs.get("dilations") or (1,) * nd)
        auto_pad = attrs["auto_pad"]
        spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = [-(-s // st) for s, st in zip(in_shape, strides)]
            total = [max(0, (o - 1) * st + sp - s)
                     for o, st, sp, s in zip(out, strides, spans, in_shape)]
            small = [t // 2 for t in total]
            big = [t - t // 2 for t in total]
            begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            begin = end = [0] * nd
            out = [(s - sp) // st + 1 for s, sp, st in zip(in_shape, spans, strides)]
        else:
            pads = [int(p) for p in attrs.get("pads") or (0,) * (2 * nd)]
            begin, end = pads[:nd], pads[nd:]
            if min(pads, default=0) < 0:
                raise ValueError(f"negative pads {pads} are not supported")
            out = []
            for s, b, e, sp, st in zip(in_shape, begin, end, spans, strides):
                room = s + b + e - sp
                o = (-(-room // st) if ceil_mode else room // st) + 1
                if ceil_mode and (o - 1) * st >= s + b:
                    o -= 1  # the last window must start inside the input or its left padding
                out.append(o)
        return Window(in_shape, kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))

    @staticmethod
    def for_node(ctx, in_shape, kernel, ceil_mode: bool = False, out_shape=None) -> Window:
        """The window of a Conv/pool node (or of a backward op, whose attributes carry the
        forward's resolved window). Checks the window's output shape against ``out_shape``
        (default: the one shape inference gave the node's output 0)."""
        try:
            win = Window.resolve(ctx.attrs, in_shape, kernel, ceil_mode)
        except ValueError as e:
            raise ctx.error(str(e)) from None
        want = tuple(ctx.outputs[0].shape[2:] if out_shape is None else out_shape)
        if win.out_shape != want:
            raise ctx.error(f"window arithmetic gives spatial output {list(win.out_shape)} but "
                            f"shape inference says {list(want)}")
        return win

    def attrs(self) -> dict:
        """The attributes a backward op needs to rebuild this window (explicit pads)."""
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides),
                "dilations": list(self.dilations),
                "pads": list(self.pads_begin) + list(self.pads_end), "auto_pad": "NOTSET"}

    @property
    def ndim(self) -> int:
        return len(self.in_shape)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return tuple(max(b + s, (o - 1) * st + (k - 1) * d + 1)
                     for b, s, o, st, k, d in zip(self.pads_begin, self.in_shape, self.out_shape,
                                                  self.strides, self.kernel, self.dilations))

    @property
    def needs_padding(self) -> bool:
        return any(self.pads_begin) or self.padded_shape != self.in_shape

    @property
    def taps(self) -> list[tuple[int, ...]]:
        """Kernel positions in row-major order (the order ONNX's pools scan a window)."""
        return list(itertools.product(*(range(k) for k in self.kernel)))

    def tap_slices_nhwc(self) -> list[tuple[slice, ...]]:
        """Per tap, the slice of the padded ``[N, *S_padded, C]`` input it reads for every
        output position at once."""
        return [(slice(None),) + tuple(
            slice(t * d, t * d + (o - 1) * st + 1, st)
            for t, d, o, st in zip(tap, self.dilations, self.out_shape, self.strides))
            + (slice(None),) for tap in self.taps]

    def tap_positions(self, axis: int) -> np.ndarray:
        """``[out, kernel]`` input coordinates (unpadded, may be outside) along ``axis``."""
        o = np.arange(self.out_shape[axis])[:, None] * self.strides[axis]
        k = np.arange(self.kernel[axis])[None, :] * self.dilations[axis]
        return o + k - self.pads_begin[axis]


def padding_slabs_nhwc(win: Window) -> tuple[tuple[slice, ...], list[tuple[slice, ...]]]:
    """(interior, border slabs) of the padded ``[N, *padded, C]`` workspace: the input goes to
    the interior, the fill value to the slabs (they cover everything else, corners twice)."""
    interior = (slice(None),) + tuple(slice(b, b + s) for b, s in zip(win.pads_begin,
                                                                      win.in_shape)) \
        + (slice(None),)
    slabs = []
    for axis, (b, s, p) in enumerate(zip(win.pads_begin, win.in_shape, win.padded_shape)):
        lead = (slice(None),) * (axis + 1)
        if b:
            slabs.append(lead + (slice(0, b),))
        if p > b + s:
            slabs.append(lead + (slice(b + s, p),))
    return interior, slabs


def pad_nhwc(x_nhwc: np.ndarray, xp: np.ndarray, interior, slabs, fill) -> np.ndarray:
    """Copy ``x_nhwc`` into the workspace ``xp`` and fill its borders; returns ``xp``."""
    for slab in slabs:
        xp[slab] = fill
    np.copyto(xp[interior], x_nhwc)
    return xp


def windows_nhwc(xp: np.ndarray, win: Window) -> np.ndarray:
    """Read-only ``[N, *S_out, *K, C]`` view of every window of the padded ``[N, *Sp, C]``."""
    sn, *ss, sc = xp.strides
    shape = (xp.shape[0], *win.out_shape, *win.kernel, xp.shape[-1])
    strides = (sn, *(a * st for a, st in zip(ss, win.strides)),
               *(a * d for a, d in zip(ss, win.dilations)), sc)
    return as_strided(xp, shape, strides, writeable=False)


def im2col_nhwc(xp: np.ndarray, win: Window, col: np.ndarray) -> np.ndarray:
    """Gather the windows of ``xp`` ``[N, *Sp, C]`` into the contiguous workspace ``col``
    ``[N*prod(S_out), prod(K)*C]`` (rows: output positions, columns: (tap, channel))."""
    np.copyto(col.reshape((xp.shape[0], *win.out_shape, *win.kernel, xp.shape[-1])),
              windows_nhwc(xp, win))
    return col


def col2im_slices_nhwc(win: Window, channels: slice = slice(None)) -> list[tuple]:
    """Per tap, (slice of the padded ``[N, *Sp, C]`` buffer, slice of the ``[N, *S_out, *K, C']``
    columns) for ``col2im_nhwc``; ``channels`` selects the buffer's channels (one group)."""
    lead = (slice(None),) * (1 + win.ndim)
    return [(dst[:-1] + (channels,), lead + tap)
            for dst, tap in zip(win.tap_slices_nhwc(), win.taps)]


def col2im_nhwc(cols: np.ndarray, xp: np.ndarray, scatter: list[tuple]) -> np.ndarray:
    """The adjoint of ``im2col_nhwc``: add every window of ``cols`` ``[N, *S_out, *K, C]`` back
    into the padded ``xp`` (not cleared here). One tap never hits a position twice, so each
    tap is one in-place add; ``scatter`` comes from ``col2im_slices_nhwc``."""
    for dst, src in scatter:
        d = xp[dst]
        np.add(d, cols[src], out=d)
    return xp


def merged_stride(shape, strides) -> int | None:
    """The common stride when the axes can be merged into one (size-1 axes ignored)."""
    inner = None
    for d, st in zip(reversed(shape), reversed(strides)):
        if d == 1:
            continue
        if inner is not None and st != inner[0] * inner[1]:
            return None
        if inner is None:
            inner = (st, d)
        else:
            inner = (inner[0], inner[1] * d)
    return inner[0] if inner is not None else 0


def merged_view(a: np.ndarray, splits: tuple[int, ...]) -> np.ndarray | None:
    """``a`` without a copy as one axis per group of consecutive axes, the groups split at
    ``splits`` (an empty group is an axis of 1), or None where a group's strides do not merge."""
    bounds = (0, *splits, a.ndim)
    groups = [(a.shape[lo:hi], a.strides[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    strides = [merged_stride(shape, st) for shape, st in groups]
    if any(st is None for st in strides):
        return None
    return as_strided(a, tuple(math.prod(shape) for shape, _ in groups), tuple(strides))


def as_2d(a: np.ndarray, split: int) -> np.ndarray | None:
    """``a`` seen as ``[prod(shape[:split]), prod(shape[split:])]`` without a copy, or None."""
    return merged_view(a, (split,))


def mergeable_2d(info, moved: bool, split: int) -> bool:
    """Whether a tensor's kernel view (``moved``: after ``channels_last_view(v)``) can be seen
    as a matrix split at ``split`` without a copy; decided at plan time from its layout."""
    strides = info.layout.view_strides(np.dtype(info.dtype).itemsize)
    shape = tuple(info.shape)
    if moved:
        shape = (shape[0], *shape[2:], shape[1])
        strides = (strides[0], *strides[2:], strides[1])
    return merged_stride(shape[:split], strides[:split]) is not None and \
        merged_stride(shape[split:], strides[split:]) is not None


def matrix_view_or_copy(a: np.ndarray, split: int, ws: np.ndarray | None) -> np.ndarray:
    """``a`` as a matrix: a view when its strides allow (``ws`` None), else copied into ``ws``."""
    if ws is None:
        return as_2d(a, split)
    np.copyto(ws.reshape(a.shape), a)
    return ws


def _groups(group: int, cg: int, og: int) -> list[tuple[slice, slice]]:
    """(input channels, output channels) of each group."""
    return [(slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)) for g in range(group)]


def _kernel_shape(attrs, w_shape) -> tuple[int, ...]:
    return tuple(int(k) for k in (attrs.get("kernel_shape") or w_shape[2:]))


def _conv_grid():
    """ops.conv_grid, which builds on this module's window helpers (imported when used)."""
    from . import conv_grid

    return conv_grid


def _grid_useful(win: Window, dtype: np.dtype) -> bool:
    return _conv_grid().Grid.useful(win, dtype)


def _onednn_kernel(name: str, ctx, win: Window, group: int, dtype: np.dtype, **post_ops):
    """The oneDNN kernel ``name`` of ops.conv_onednn for this node, or None (not installed,
    not float32, a window or primitive oneDNN refuses, a shape NumPy runs faster:
    ``conv_onednn.preferred``): then NumPy runs it."""
    from . import conv_onednn

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
    fast = _onednn_kernel("conv_onednn", ctx, win, group, dtype, **post_ops)
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
    if not pointwise and not cast and _grid_useful(win, dtype):
        return _conv_grid().conv_grid_numpy(ctx, win, group), False
    x_rows_ok = pointwise and (xp_k is not None or mergeable_2d(x_info, True, 1 + win.ndim))
    col_k = None if x_rows_ok else ctx.workspace((rows, taps * cg), compute)
    w_k = (None if not cast and mergeable_2d(w_info, True, 1)
           else ctx.workspace((o, taps * cg), compute))
    y_k = (None if not cast and mergeable_2d(y_info, True, 1 + win.ndim)
           else ctx.workspace((rows, o), compute))
    groups = _groups(group, cg, og)
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
    groups = [(cs, col2im_slices_nhwc(frame_win, os_)) for cs, os_ in _groups(group, cg, og)]
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
