"""Stride-1 convolutions without im2col: on the padded channels-last input seen as one
``[N * prod(S_padded), C]`` matrix, each kernel tap is a row offset, so the convolution is one
accumulated GEMM per tap over contiguous rows (``host_blas``), and so are its two gradients.

The GEMMs compute every position of the padded grid; a position whose window runs past the
grid's end (the last rows of each image) is computed and never read. An output position ``o``
is grid row ``n*P + sum_i o_i * pitch_i``; tap ``t`` reads input row ``that + offset(t)``.

- forward: ``y_grid[r] = sum_t xp[r + off_t] @ w_t^T``, then the valid rows (+ bias) to y;
- ConvGradData: ``gx_grid[r + off_t] += gy_grid[r] @ w_t`` (gy_grid: gy at its grid rows,
  zero elsewhere), then the interior to gx;
- ConvGradFilter: ``gw_t = gy_grid^T @ xp[off_t:]``, written straight into gw's OHWI view.

Worth it when the grid is not much larger than the output (``useful``): for a 2x2 map padded
to 4x4 most rows would be waste, and conv.py's im2col path runs instead.
"""

from __future__ import annotations

import math

import numpy as np

from .. import host_blas
from ..layouts import channels_last_view
from .conv_window import (
    Window,
    as_2d,
    channel_groups,
    mergeable_2d,
    pad_nhwc,
    padding_slabs_nhwc,
)

MAX_WASTE = 1.6  # grid rows per output row above which im2col's copy is the cheaper one


class Grid:
    """The padded grid of a stride-1 window over ``n`` images."""

    def __init__(self, win: Window, n: int):
        self.win, self.n = win, n
        self.shape = win.padded_shape
        self.per_image = math.prod(self.shape)
        pitch = [math.prod(self.shape[i + 1:]) for i in range(win.ndim)]
        self.offsets = [sum(t * d * p for t, d, p in zip(tap, win.dilations, pitch))
                        for tap in win.taps]
        self.rows = n * self.per_image - max(self.offsets)  # rows every tap can read
        # output positions inside the grid, and the rest of the grid (zeroed in gy_grid)
        self.valid = (slice(None),) + tuple(slice(0, o) for o in win.out_shape) + (slice(None),)
        self.invalid = [(slice(None),) * (1 + axis) + (slice(o, s),)
                        for axis, (o, s) in enumerate(zip(win.out_shape, self.shape)) if o < s]

    @staticmethod
    def useful(win: Window, dtype: np.dtype) -> bool:
        """Stride 1, a dtype BLAS takes, and a grid at most ``MAX_WASTE`` times the output."""
        return (all(s == 1 for s in win.strides) and host_blas.available(dtype)
                and math.prod(win.padded_shape) <= MAX_WASTE * math.prod(win.out_shape))

    def image(self, flat: np.ndarray) -> np.ndarray:
        """A ``[n * P, C]`` grid buffer as ``[n, *S_padded, C]``."""
        return flat.reshape(self.n, *self.shape, flat.shape[-1])

    def scatter_gy(self, gy: np.ndarray, grid: np.ndarray) -> None:
        """gy ``[N, *S_out, O]`` to its grid rows, zeros on every other row."""
        image = self.image(grid)
        for slab in self.invalid:
            image[slab] = 0
        np.copyto(image[self.valid], gy)


def _padded_input(ctx, win: Window, grid: Grid, dtype):
    """(workspace key or None, fill): the input on the padded grid, copied into a workspace
    unless it needs no padding and already is the grid matrix."""
    n, c = ctx.inputs[0].shape[:2]
    if not win.needs_padding and mergeable_2d(ctx.inputs[0], True, 1 + win.ndim):
        return None, None
    interior, slabs = padding_slabs_nhwc(win)
    zero = dtype.type(0)
    return ctx.workspace((n * grid.per_image, c), dtype), (interior, slabs, zero)


def conv_grid_numpy(ctx, win: Window, group: int):
    """Conv (not depthwise) as one accumulated GEMM per tap over the padded grid."""
    x_info, w_info, y_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n, c = x_info.shape[:2]
    o, cg = w_info.shape[:2]
    dtype = np.dtype(y_info.dtype)
    grid = Grid(win, n)
    xp_k, fill = _padded_input(ctx, win, grid, dtype)
    y_k = ctx.workspace((n * grid.per_image, o), dtype)
    groups = channel_groups(group, cg, o // group)
    has_bias = ctx.has_input(2)
    rows = grid.rows

    def make(ins, outs, ws):
        x = channels_last_view(ins[0])
        xp = as_2d(x, 1 + win.ndim) if xp_k is None else ws[xp_k]
        w = channels_last_view(ins[1])
        calls = []
        for t, (tap, off) in enumerate(zip(win.taps, grid.offsets)):
            w_t = w[(slice(None), *tap, slice(None))]
            calls += [host_blas.prepared_gemm(xp[off:off + rows, cs], w_t[os_].T,
                                              ws[y_k][:rows, os_], accumulate=t > 0)
                      for cs, os_ in groups]
        return calls

    prepared = host_blas.PreparedCalls(make)

    def run(ins, outs, ws):
        calls = prepared.get(ins, outs, ws)
        if xp_k is not None:
            pad_nhwc(channels_last_view(ins[0]), grid.image(ws[xp_k]), *fill)
        for call in calls:
            call()
        y = channels_last_view(outs[0])
        valid = grid.image(ws[y_k])[grid.valid]
        if has_bias:
            np.add(valid, ins[2], out=y)
        else:
            np.copyto(y, valid)

    return run


def conv_grad_data_grid_numpy(ctx, win: Window, group: int):
    """gx of a stride-1 Conv: every tap scatters ``gy @ w_t`` into gx's padded grid."""
    w_info, gx_info = ctx.inputs[1], ctx.outputs[0]
    n, c = gx_info.shape[:2]
    o, cg = w_info.shape[:2]
    dtype = np.dtype(gx_info.dtype)
    grid = Grid(win, n)
    gy_k = ctx.workspace((n * grid.per_image, o), dtype)
    gx_k = ctx.workspace((n * grid.per_image, c), dtype)
    interior, _ = padding_slabs_nhwc(win)
    groups = channel_groups(group, cg, o // group)
    rows = grid.rows

    def make(ins, outs, ws):
        w = channels_last_view(ins[1])
        gy, gx = ws[gy_k], ws[gx_k]
        return [host_blas.prepared_gemm(gy[:rows, os_], w[(os_, *tap, slice(None))],
                                        gx[off:off + rows, cs], accumulate=True)
                for tap, off in zip(win.taps, grid.offsets) for cs, os_ in groups]

    prepared = host_blas.PreparedCalls(make)

    def run(ins, outs, ws):
        calls = prepared.get(ins, outs, ws)
        grid.scatter_gy(channels_last_view(ins[0]), ws[gy_k])
        ws[gx_k].fill(0)
        for call in calls:
            call()
        np.copyto(channels_last_view(outs[0]), grid.image(ws[gx_k])[interior])

    return run


def conv_grad_filter_grid_numpy(ctx, win: Window, group: int):
    """gw of a stride-1 Conv: per tap ``gy_grid^T @ xp[off_t:]``, into gw's OHWI view."""
    x_info, gy_info, gw_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    n = x_info.shape[0]
    o, cg = gw_info.shape[:2]
    dtype = np.dtype(gw_info.dtype)
    grid = Grid(win, n)
    xp_k, fill = _padded_input(ctx, win, grid, dtype)
    # no scatter when the grid is the output itself (a 1x1 kernel without padding)
    direct_gy = not grid.invalid and mergeable_2d(gy_info, True, 1 + win.ndim)
    gy_k = None if direct_gy else ctx.workspace((n * grid.per_image, o), dtype)
    groups = channel_groups(group, cg, o // group)
    rows = grid.rows

    def make(ins, outs, ws):
        xp = as_2d(channels_last_view(ins[0]), 1 + win.ndim) if xp_k is None else ws[xp_k]
        gy = as_2d(channels_last_view(ins[1]), 1 + win.ndim) if gy_k is None else ws[gy_k]
        gw = channels_last_view(outs[0])
        return [host_blas.prepared_gemm(gy[:rows, os_].T, xp[off:off + rows, cs],
                                        gw[(os_, *tap, slice(None))])
                for tap, off in zip(win.taps, grid.offsets) for cs, os_ in groups]

    prepared = host_blas.PreparedCalls(make)

    def run(ins, outs, ws):
        calls = prepared.get(ins, outs, ws)
        if xp_k is not None:
            pad_nhwc(channels_last_view(ins[0]), grid.image(ws[xp_k]), *fill)
        if gy_k is not None:
            grid.scatter_gy(channels_last_view(ins[1]), ws[gy_k])
        for call in calls:
            call()

    return run
