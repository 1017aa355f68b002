"""MaxPool, AveragePool, LpPool and their Global forms, channels-last.

A pool is a loop over the kernel taps: each tap is one strided slice of the (padded)
``[N, *S, C]`` input covering every output position at once, folded into the output with one
ufunc. The window arithmetic (pads, ``auto_pad``, ``ceil_mode``, dilations) is ``conv.Window``.
"""

from __future__ import annotations

import math

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import SPATIAL, OpDef
from .conv import Window, accumulator_dtype, pad_nhwc, padding_slabs_nhwc


def _lowest(dtype: np.dtype):
    """The padding value of a max pool: no input value can lose to it."""
    if dtype.kind == "f":
        return dtype.type(-np.inf)
    return np.iinfo(dtype).min


class _Tapped:
    """What every windowed pool prepares: the window, the padded-input workspace and the
    per-tap slices."""

    def __init__(self, ctx, fill, ceil_mode: bool):
        x_info = ctx.inputs[0]
        self.n, self.c, *spatial = x_info.shape
        kernel = [int(k) for k in ctx.attrs["kernel_shape"]]
        self.win = Window.for_node(ctx, spatial, kernel, ceil_mode=ceil_mode)
        self.dtype = np.dtype(ctx.outputs[0].dtype)
        self.fill = fill(self.dtype) if callable(fill) else self.dtype.type(fill)
        self.interior, self.slabs = padding_slabs_nhwc(self.win)
        self.xp_k = (ctx.workspace((self.n, *self.win.padded_shape, self.c), self.dtype)
                     if self.win.needs_padding else None)
        self.taps = self.win.tap_slices_nhwc()
        self.out_nhwc = (self.n, *self.win.out_shape, self.c)

    def padded(self, x, ws):
        x = np.moveaxis(x, 1, -1)
        if self.xp_k is None:
            return x
        return pad_nhwc(x, ws[self.xp_k], self.interior, self.slabs, self.fill)


def _ceil_mode(ctx) -> bool:
    return bool(ctx.attrs.get("ceil_mode"))  # absent before MaxPool-10 / AveragePool-10


# --------------------------------------------------------------------------------------------
# MaxPool
# --------------------------------------------------------------------------------------------

def _tap_index_maps(win: Window, column_major: bool) -> list[np.ndarray]:
    """Per tap, ``[1, *S_out, 1]`` int64: the flat spatial index (in the logical NCHW tensor's
    plane, row- or column-major) of the input element that tap reads at each output position."""
    maps = []
    order = "F" if column_major else "C"
    for tap in win.taps:
        coords = [np.clip(win.tap_positions(a)[:, t], 0, win.in_shape[a] - 1)
                  for a, t in enumerate(tap)]
        grid = np.meshgrid(*coords, indexing="ij")
        flat = np.ravel_multi_index(grid, win.in_shape, order=order).astype(np.int64)
        maps.append(flat.reshape((1, *win.out_shape, 1)))
    return maps


def max_pool_numpy(ctx):
    t = _Tapped(ctx, _lowest, _ceil_mode(ctx))
    with_indices = ctx.has_output(1)
    if not with_indices:
        def run(ins, outs, ws):
            xp = t.padded(ins[0], ws)
            y = np.moveaxis(outs[0], 1, -1)
            np.copyto(y, xp[t.taps[0]])
            for tap in t.taps[1:]:
                np.maximum(y, xp[tap], out=y)

        return run

    maps = _tap_index_maps(t.win, column_major=bool(ctx.attrs.get("storage_order")))
    plane = math.prod(t.win.in_shape)
    # flat offset of each (n, c) plane in the logical [N, C, *S] input
    base = (np.arange(t.n, dtype=np.int64)[:, None] * t.c + np.arange(t.c)) * plane
    base = base.reshape((t.n,) + (1,) * t.win.ndim + (t.c,))
    mask_k = ctx.workspace(t.out_nhwc, np.bool_)

    def run_indices(ins, outs, ws):
        xp = t.padded(ins[0], ws)
        y, idx, mask = np.moveaxis(outs[0], 1, -1), np.moveaxis(outs[1], 1, -1), ws[mask_k]
        np.copyto(y, xp[t.taps[0]])
        np.copyto(idx, maps[0])
        for tap, imap in zip(t.taps[1:], maps[1:]):
            xt = xp[tap]
            np.greater(xt, y, out=mask)  # strictly greater: the first maximum in scan order wins
            np.copyto(y, xt, where=mask)
            np.copyto(idx, imap, where=mask)
        np.add(idx, base, out=idx)

    return run_indices


# --------------------------------------------------------------------------------------------
# AveragePool, LpPool
# --------------------------------------------------------------------------------------------

def _window_counts(win: Window, include_pad: bool) -> np.ndarray:
    """``[*S_out]``: how many taps of each window the average divides by -- inside the input,
    or (``include_pad``) inside the input plus its explicit padding, never the ceil_mode
    overhang."""
    counts = None
    for a in range(win.ndim):
        pos = win.tap_positions(a)
        lo, hi = (-win.pads_begin[a], win.in_shape[a] + win.pads_end[a]) if include_pad \
            else (0, win.in_shape[a])
        per_axis = ((pos >= lo) & (pos < hi)).sum(axis=1)
        counts = per_axis if counts is None else np.multiply.outer(counts, per_axis)
    return counts


def average_pool_numpy(ctx):
    t = _Tapped(ctx, 0, _ceil_mode(ctx))
    counts = _window_counts(t.win, bool(ctx.attrs.get("count_include_pad")))
    acc_dtype = accumulator_dtype(t.dtype)
    uniform = bool(np.all(counts == counts.flat[0]))
    divisor = acc_dtype.type(counts.flat[0]) if uniform else \
        counts.reshape((1, *t.win.out_shape, 1)).astype(acc_dtype)
    acc_k = ctx.workspace(t.out_nhwc, acc_dtype) if acc_dtype != t.dtype else None

    def run(ins, outs, ws):
        xp = t.padded(ins[0], ws)
        y = np.moveaxis(outs[0], 1, -1)
        acc = ws[acc_k] if acc_k is not None else y
        np.copyto(acc, xp[t.taps[0]])
        for tap in t.taps[1:]:
            np.add(acc, xp[tap], out=acc)
        np.divide(acc, divisor, out=y)

    return run


def _lp_power(ctx) -> float:
    return float(ctx.attrs["p"])  # a float in LpPool-1/GlobalLpPool-1, an int since version 2


def _abs_pow(x, p: float, out) -> None:
    """``out = |x| ** p`` without temporaries (``out`` may be a workspace of another dtype)."""
    if p == 2.0:
        np.square(x, out=out)
    else:
        np.abs(x, out=out)
        if p != 1.0:
            np.power(out, p, out=out)


def _root(acc, p: float, out) -> None:
    if p == 2.0:
        np.sqrt(acc, out=out)
    elif p == 1.0:
        np.copyto(out, acc)
    else:
        np.power(acc, 1.0 / p, out=out)


def lp_pool_numpy(ctx):
    p = _lp_power(ctx)
    t = _Tapped(ctx, 0, _ceil_mode(ctx))
    acc_dtype = accumulator_dtype(t.dtype)
    acc_k = ctx.workspace(t.out_nhwc, acc_dtype)
    tmp_k = ctx.workspace(t.out_nhwc, acc_dtype)

    def run(ins, outs, ws):
        xp = t.padded(ins[0], ws)
        acc, tmp = ws[acc_k], ws[tmp_k]
        _abs_pow(xp[t.taps[0]], p, acc)
        for tap in t.taps[1:]:
            _abs_pow(xp[tap], p, tmp)
            np.add(acc, tmp, out=acc)
        _root(acc, p, np.moveaxis(outs[0], 1, -1))

    return run


# --------------------------------------------------------------------------------------------
# Global pools: one reduction over the spatial axes of the channels-last view
# --------------------------------------------------------------------------------------------

def _global(ctx):
    n, c, *spatial = ctx.inputs[0].shape
    dtype = np.dtype(ctx.outputs[0].dtype)
    axes = tuple(range(1, 1 + len(spatial)))
    return n, c, spatial, dtype, axes


def global_average_pool_numpy(ctx):
    n, c, spatial, dtype, axes = _global(ctx)
    acc_dtype = accumulator_dtype(dtype)
    acc_k = ctx.workspace((n, *(1,) * len(spatial), c), acc_dtype) if acc_dtype != dtype else None
    count = acc_dtype.type(math.prod(spatial))

    def run(ins, outs, ws):
        y = np.moveaxis(outs[0], 1, -1)
        acc = ws[acc_k] if acc_k is not None else y
        np.add.reduce(np.moveaxis(ins[0], 1, -1), axis=axes, keepdims=True, out=acc)
        np.divide(acc, count, out=y)

    return run


def global_max_pool_numpy(ctx):
    *_, axes = _global(ctx)

    def run(ins, outs, ws):
        np.maximum.reduce(np.moveaxis(ins[0], 1, -1), axis=axes, keepdims=True,
                          out=np.moveaxis(outs[0], 1, -1))

    return run


def global_lp_pool_numpy(ctx):
    n, c, spatial, dtype, axes = _global(ctx)
    p = _lp_power(ctx)
    acc_dtype = accumulator_dtype(dtype)
    tmp_k = ctx.workspace((n, *spatial, c), acc_dtype)
    acc_k = ctx.workspace((n, *(1,) * len(spatial), c), acc_dtype)

    def run(ins, outs, ws):
        tmp, acc = ws[tmp_k], ws[acc_k]
        _abs_pow(np.moveaxis(ins[0], 1, -1), p, tmp)
        np.add.reduce(tmp, axis=axes, keepdims=True, out=acc)
        _root(acc, p, np.moveaxis(outs[0], 1, -1))

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("MaxPool", (1, 8, 10, 11, 12, 22), {"numpy": max_pool_numpy}, layout=SPATIAL,
              differentiable=True),
        OpDef("AveragePool", (1, 7, 10, 11, 19, 22), {"numpy": average_pool_numpy},
              layout=SPATIAL, differentiable=True),
        OpDef("LpPool", (1, 2, 11, 18, 22), {"numpy": lp_pool_numpy}, layout=SPATIAL,
              differentiable=True),
        OpDef("GlobalAveragePool", (1, 22), {"numpy": global_average_pool_numpy},
              layout=SPATIAL, differentiable=True),
        OpDef("GlobalMaxPool", (1, 22), {"numpy": global_max_pool_numpy}, layout=SPATIAL,
              differentiable=True),
        OpDef("GlobalLpPool", (1, 2, 22), {"numpy": global_lp_pool_numpy}, layout=SPATIAL,
              differentiable=True),
    ]
