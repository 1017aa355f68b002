"""MaxPool, AveragePool, LpPool and their Global forms, channels-last.

A pool is a loop over the kernel taps: each tap is one strided slice of the (padded)
``[N, *S, C]`` input covering every output position at once, folded into the output with one
ufunc. The window arithmetic (pads, ``auto_pad``, ``ceil_mode``, dilations) is
``conv_window.Window``.

Gradients: the windowed pools' rules emit MaxPoolGrad, AveragePoolGrad and LpPoolGrad (domain
ai.tr_onnx), which add each tap's share of gy back through the same per-tap slices into a
padded gx; GlobalMaxPool has GlobalMaxPoolGrad, GlobalAveragePool and GlobalLpPool are a few
standard ops.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from .. import host_blas, onednn
from ..domains import INTERNAL_DOMAIN
from ..dtypes import accumulator_dtype, is_float
from ..hookspecs import hookimpl
from ..layouts import channels_last_view
from ..opdef import SPATIAL, OpDef, bounded_like_input
from .conv_window import Window, merged_view, pad_nhwc, padding_slabs_nhwc


def _lowest(dtype: np.dtype):
    """The padding value of a max pool: no input value can lose to it."""
    if is_float(dtype):
        return dtype.type(-np.inf)
    return np.iinfo(dtype).min


class _Tapped:
    """What every windowed pool prepares: the window, the padded-input workspace and the
    per-tap slices."""

    def __init__(self, ctx, fill, ceil_mode: bool, x_info=None, out_shape=None,
                 pad_input: bool = True):
        """``x_info``: the tensor the windows slide over (default input 0); a backward op
        passes its input x or its output gx, and the forward's spatial output ``out_shape``
        (gy's). ``pad_input``: reserve the padded-input workspace."""
        x_info = x_info or ctx.inputs[0]
        self.n, self.c, *spatial = x_info.shape
        kernel = [int(k) for k in ctx.attrs["kernel_shape"]]
        self.win = Window.for_node(ctx, spatial, kernel, ceil_mode=ceil_mode, out_shape=out_shape)
        self.dtype = np.dtype(ctx.outputs[0].dtype)
        self.fill = fill(self.dtype) if callable(fill) else self.dtype.type(fill)
        self.interior, self.slabs = padding_slabs_nhwc(self.win)
        self.xp_k = (ctx.workspace((self.n, *self.win.padded_shape, self.c), self.dtype)
                     if self.win.needs_padding and pad_input else None)
        self.taps = self.win.tap_slices_nhwc()
        self.out_nhwc = (self.n, *self.win.out_shape, self.c)

    def grad_buffer(self, ctx):
        """(workspace index or None, dtype) of the padded gx the backward ops scatter into:
        None when gx's own view serves (no padding, no float16 accumulation)."""
        compute = accumulator_dtype(self.dtype)
        if self.win.needs_padding or compute != self.dtype:
            return ctx.workspace((self.n, *self.win.padded_shape, self.c), compute), compute
        return None, compute

    def scatter_begin(self, outs, ws, gxp_k):
        """The zeroed buffer gx is accumulated in (padded workspace or gx's channels-last view)."""
        gxp = channels_last_view(outs[0]) if gxp_k is None else ws[gxp_k]
        gxp.fill(0)
        return gxp

    def scatter_end(self, outs, gxp, gxp_k) -> None:
        """Crop the padded buffer into gx."""
        if gxp_k is not None:
            np.copyto(channels_last_view(outs[0]), gxp[self.interior], casting="same_kind")

    def padded(self, x, ws):
        x = channels_last_view(x)
        if self.xp_k is None:
            return x
        return pad_nhwc(x, ws[self.xp_k], self.interior, self.slabs, self.fill)


def _ceil_mode(ctx) -> bool:
    return bool(ctx.attrs.get("ceil_mode"))  # absent before MaxPool-10 / AveragePool-10


def _clipped_taps_nhwc(win: Window) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """Per tap with any position inside the input, in scan order: (slice of the ``[N, *S_out,
    C]`` output, slice of the unpadded ``[N, *S, C]`` input) it pairs. A max pool's padding
    never wins (it is the lowest value), so the clipped taps need neither a padded copy of x
    nor a padded gx to crop."""
    pairs = []
    for tap in win.taps:
        outs, ins = [], []
        for a, t in enumerate(tap):
            st, off = win.strides[a], t * win.dilations[a] - win.pads_begin[a]
            lo = max(0, -(off // st))  # the first o with o * st + off >= 0
            hi = min(win.out_shape[a], (win.in_shape[a] - 1 - off) // st + 1)
            if lo >= hi:
                break
            outs.append(slice(lo, hi))
            ins.append(slice(lo * st + off, (hi - 1) * st + off + 1, st))
        else:
            whole = (slice(None),)
            pairs.append((whole + tuple(outs) + whole, whole + tuple(ins) + whole))
    return pairs


def _max_over_taps(x, y, pairs, fill, full: int | None, maximum=np.maximum) -> None:
    """y = the maximum of each window of the channels-last x over its clipped taps (``fill``
    where a window has none); ``full``: the index of a tap covering every output position, or
    None."""
    if full is None:
        y.fill(fill)
    else:
        np.copyto(y, x[pairs[full][1]])
    for k, (o, i) in enumerate(pairs):
        if k != full:
            maximum(y[o], x[i], out=y[o])


def _full_tap(pairs, out_shape) -> int | None:
    """The first tap whose output slice covers every position, or None."""
    for k, (o, _) in enumerate(pairs):
        if all(sl.stop - sl.start == n for sl, n in zip(o[1:-1], out_shape)):
            return k
    return None


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


def _onednn_max_pool(ctx, win: Window):
    """oneDNN's max pooling (one call, ~3x NumPy's taps on LeNet's 2x2 pools: 10 vs 28 us,
    2026-12-02) where the plan proved the input finite (``ir.Node.proven_finite``): its max
    drops NaN, ONNX's keeps it. None elsewhere, or where oneDNN declines."""
    from . import conv_onednn

    if not ctx.node.proven_finite or not conv_onednn.usable(win, ctx.inputs[0].dtype):
        return None
    strides, dilations, pad_l, pad_r = conv_onednn.geometry(win)
    src, dst = conv_onednn.strided(ctx.inputs[0]), conv_onednn.strided(ctx.outputs[0])
    return onednn.source_to_destination_step(ctx, lambda: onednn.max_pooling(
        src, dst, strides, win.kernel, dilations, pad_l, pad_r), src, dst)


def max_pool_numpy(ctx):
    with_indices = ctx.has_output(1)
    t = _Tapped(ctx, _lowest, _ceil_mode(ctx), pad_input=with_indices)
    fast = None if with_indices else _onednn_max_pool(ctx, t.win)
    if fast is not None:
        return fast
    if not with_indices:
        pairs = _clipped_taps_nhwc(t.win)
        full = _full_tap(pairs, t.win.out_shape)

        def run(ins, outs, ws):
            _max_over_taps(channels_last_view(ins[0]), channels_last_view(outs[0]), pairs,
                           t.fill, full)

        return run

    maps = _tap_index_maps(t.win, column_major=bool(ctx.attrs.get("storage_order")))
    plane = math.prod(t.win.in_shape)
    # flat offset of each (n, c) plane in the logical [N, C, *S] input
    base = (np.arange(t.n, dtype=np.int64)[:, None] * t.c + np.arange(t.c)) * plane
    base = base.reshape((t.n,) + (1,) * t.win.ndim + (t.c,))
    mask_k = ctx.workspace(t.out_nhwc, np.bool_)

    def run_indices(ins, outs, ws):
        xp = t.padded(ins[0], ws)
        y, idx, mask = channels_last_view(outs[0]), channels_last_view(outs[1]), ws[mask_k]
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
    if counts.size == 0:  # an empty output (a zero-width window count): nothing to divide
        counts = np.ones(1, np.int64)
    uniform = bool(np.all(counts == counts.flat[0]))
    divisor = acc_dtype.type(counts.flat[0]) if uniform else \
        counts.reshape((1, *t.win.out_shape, 1)).astype(acc_dtype)
    acc_k = ctx.workspace(t.out_nhwc, acc_dtype) if acc_dtype != t.dtype else None

    def run(ins, outs, ws):
        xp = t.padded(ins[0], ws)
        y = channels_last_view(outs[0])
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
        _root(acc, p, channels_last_view(outs[0]))

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

    def reduce(ins, outs, ws):
        y = channels_last_view(outs[0])
        acc = ws[acc_k] if acc_k is not None else y
        np.add.reduce(channels_last_view(ins[0]), axis=axes, keepdims=True, out=acc)
        np.divide(acc, count, out=y)

    if dtype not in (np.float32, np.float64):  # np.matmul's BLAS types
        return reduce
    ones = np.ones((1, math.prod(spatial)), dtype)

    def make(ins, outs, ws):
        """Each sample's sums as ``ones @ x[n]`` ([1, H*W] @ [H*W, C]): BLAS, where NumPy's
        reduction over the middle axis of [N, H*W, C] runs a short loop per row (zoo resnet's
        [32, 8, 8, 32]: 72 vs 14 us, 2 threads, 2026-12-02)."""
        rank = ins[0].ndim  # [N, *S, C] seen as [N, prod(S), C]
        x, y = (merged_view(channels_last_view(a), (1, rank - 1)) for a in (ins[0], outs[0]))
        if x is None or y is None:
            return [partial(reduce, ins, outs, ws)]
        return [partial(np.matmul, ones, x, out=y), partial(np.divide, y, count, out=y)]

    return host_blas.prepared_step(make)


def global_max_pool_numpy(ctx):
    *_, axes = _global(ctx)

    def run(ins, outs, ws):
        np.maximum.reduce(channels_last_view(ins[0]), axis=axes, keepdims=True,
                          out=channels_last_view(outs[0]))

    return run


def global_lp_pool_numpy(ctx):
    n, c, spatial, dtype, axes = _global(ctx)
    p = _lp_power(ctx)
    acc_dtype = accumulator_dtype(dtype)
    tmp_k = ctx.workspace((n, *spatial, c), acc_dtype)
    acc_k = ctx.workspace((n, *(1,) * len(spatial), c), acc_dtype)

    def run(ins, outs, ws):
        tmp, acc = ws[tmp_k], ws[acc_k]
        _abs_pow(channels_last_view(ins[0]), p, tmp)
        np.add.reduce(tmp, axis=axes, keepdims=True, out=acc)
        _root(acc, p, channels_last_view(outs[0]))

    return run


# --------------------------------------------------------------------------------------------
# Backward ops (domain ai.tr_onnx) and gradient rules
# --------------------------------------------------------------------------------------------
# A windowed pool's backward op gets the forward window with explicit pads (``Window.attrs``)
# plus ``ceil_mode``; it accumulates each tap's share of gy into a padded gx (the adjoint of
# the forward's per-tap slices) and crops it.



def max_pool_grad_numpy(ctx):
    """MaxPoolGrad(gy, x) -> gx: recompute each window's maximum and route gy to the first tap
    (in scan order) holding it, as the forward's Indices do.

    Branch-free per tap: share = rest * (x_tap == max), rest -= share, gx_tap += share, with
    rest starting as gy: the first tap to match takes all of gy, later ties add zero. (Masked
    copies of an argmax cost ~10 ns an element on random masks: 20 ms on ResNet's stem pool.)
    NaN never takes the gradient (the maximum ignores it)."""
    gy_info, x_info = ctx.inputs[0], ctx.inputs[1]
    t = _Tapped(ctx, _lowest, bool(ctx.attrs["ceil_mode"]), x_info=x_info,
                out_shape=gy_info.shape[2:], pad_input=False)
    pairs = _clipped_taps_nhwc(t.win)
    full = _full_tap(pairs, t.win.out_shape)
    compute = accumulator_dtype(t.dtype)
    acc_k = ctx.workspace((t.n, *t.win.in_shape, t.c), compute) if compute != t.dtype else None
    best_k = ctx.workspace(t.out_nhwc, t.dtype)
    mask_k = ctx.workspace(t.out_nhwc, np.bool_)
    rest_k, share_k = ctx.workspace(t.out_nhwc, compute), ctx.workspace(t.out_nhwc, compute)

    def run(ins, outs, ws):
        x = channels_last_view(ins[1])
        best, mask, rest, share = ws[best_k], ws[mask_k], ws[rest_k], ws[share_k]
        _max_over_taps(x, best, pairs, t.fill, full, np.fmax)
        gx = channels_last_view(outs[0]) if acc_k is None else ws[acc_k]
        gx.fill(0)
        np.copyto(rest, channels_last_view(ins[0]))
        last = len(pairs) - 1
        for k, (o, i) in enumerate(pairs):
            np.equal(x[i], best[o], out=mask[o])
            np.multiply(rest[o], mask[o], out=share[o])
            if k != last:
                np.subtract(rest[o], share[o], out=rest[o])
            np.add(gx[i], share[o], out=gx[i])
        if acc_k is not None:
            np.copyto(channels_last_view(outs[0]), gx, casting="same_kind")

    return run


def average_pool_grad_numpy(ctx):
    """AveragePoolGrad(gy) -> gx: every tap of a window gets gy / the window's divisor."""
    t = _Tapped(ctx, 0, bool(ctx.attrs["ceil_mode"]), x_info=ctx.outputs[0],
                out_shape=ctx.inputs[0].shape[2:], pad_input=False)
    gxp_k, compute = t.grad_buffer(ctx)
    counts = _window_counts(t.win, bool(ctx.attrs["count_include_pad"]))
    divisor = counts.reshape((1, *t.win.out_shape, 1)).astype(compute)
    share_k = ctx.workspace(t.out_nhwc, compute)

    def run(ins, outs, ws):
        share = ws[share_k]
        np.divide(channels_last_view(ins[0]), divisor, out=share)
        gxp = t.scatter_begin(outs, ws, gxp_k)
        for tap in t.taps:
            dst = gxp[tap]
            np.add(dst, share, out=dst)
        t.scatter_end(outs, gxp, gxp_k)

    return run


def _signed_pow(x, q: float, out) -> None:
    """``out = sign(x) * |x| ** q`` (d|x|^p/dx / p with q = p - 1); ``out`` is a workspace."""
    if q == 1.0:
        np.copyto(out, x)
        return
    if q == 0.0:
        np.sign(x, out=out)
        return
    np.abs(x, out=out)
    np.power(out, q, out=out)
    np.copysign(out, x, out=out)


def lp_pool_grad_numpy(ctx):
    """LpPoolGrad(gy, x, y) -> gx = sum over windows of gy * y^(1-p), times sign(x)|x|^(p-1)."""
    gy_info, x_info = ctx.inputs[0], ctx.inputs[1]
    p = float(ctx.attrs["p"])
    t = _Tapped(ctx, 0, bool(ctx.attrs["ceil_mode"]), x_info=x_info,
                out_shape=gy_info.shape[2:], pad_input=False)
    gxp_k, compute = t.grad_buffer(ctx)
    share_k = ctx.workspace(t.out_nhwc, compute)
    dx_k = ctx.workspace((t.n, *t.win.in_shape, t.c), compute)

    def run(ins, outs, ws):
        share, dx = ws[share_k], ws[dx_k]
        gy, x, y = (channels_last_view(a) for a in ins[:3])
        if p == 1.0:
            np.copyto(share, gy)
        else:
            np.power(y, 1.0 - p, out=share)
            np.multiply(share, gy, out=share)
        gxp = t.scatter_begin(outs, ws, gxp_k)
        for tap in t.taps:
            dst = gxp[tap]
            np.add(dst, share, out=dst)
        _signed_pow(x, p - 1.0, dx)
        inner = gxp[t.interior] if gxp_k is not None else gxp
        np.multiply(inner, dx, out=inner)
        t.scatter_end(outs, gxp, gxp_k)

    return run


def global_max_pool_grad_numpy(ctx):
    """GlobalMaxPoolGrad(gy, x) -> gx: gy goes to each (n, c) plane's first maximum."""
    x_info = ctx.inputs[1]
    n, c, *spatial = x_info.shape
    size = math.prod(spatial)
    dtype = np.dtype(ctx.outputs[0].dtype)
    flat_k = ctx.workspace((n, size, c), dtype)
    arg_k = ctx.workspace((n, 1, c), np.intp)

    def run(ins, outs, ws):
        flat, arg = ws[flat_k], ws[arg_k]
        np.copyto(flat.reshape((n, *spatial, c)), channels_last_view(ins[1]))
        np.argmax(flat, axis=1, keepdims=True, out=arg)
        flat.fill(0)
        # gy [N, C, 1...] seen as [N, 1, C]: a view (its spatial axes have size 1)
        gy = channels_last_view(ins[0]).reshape(n, 1, c)
        np.put_along_axis(flat, arg, gy, axis=1)
        np.copyto(channels_last_view(outs[0]), flat.reshape((n, *spatial, c)))

    return run


def _pool_attrs(node, x) -> dict:
    """The forward's window with explicit pads, for a pool's backward op."""
    ceil_mode = int(node.attrs.get("ceil_mode", 0))  # absent before MaxPool-10/AveragePool-10
    win = Window.resolve(node.attrs, x.shape[2:], node.attrs["kernel_shape"], bool(ceil_mode))
    return {**win.attrs(), "ceil_mode": ceil_mode}


def max_pool_vjp(b, node, gys, needed):
    """MaxPool: MaxPoolGrad(gy, x); the Indices output carries no gradient."""
    x = node.inputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    return [b.op("MaxPoolGrad", [gys[0], x], _pool_attrs(node, x), domain=INTERNAL_DOMAIN,
                 like=x)]


def average_pool_vjp(b, node, gys, needed):
    x = node.inputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    attrs = {**_pool_attrs(node, x),
             "count_include_pad": int(node.attrs.get("count_include_pad", 0))}
    return [b.op("AveragePoolGrad", [gys[0]], attrs, domain=INTERNAL_DOMAIN, like=x)]


def lp_pool_vjp(b, node, gys, needed):
    x = node.inputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    attrs = {**_pool_attrs(node, x), "p": float(node.attrs["p"])}
    return [b.op("LpPoolGrad", [gys[0], x, node.outputs[0]], attrs, domain=INTERNAL_DOMAIN,
                 like=x)]


def global_average_pool_vjp(b, node, gys, needed):
    """gx = gy broadcast over the spatial axes, / their size."""
    x = node.inputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    spread = b.op("Expand", [gys[0], b.ints(x.shape)])
    # no spatial element: gx is empty, and any factor scales nothing
    return [b.mul(spread, b.scalar_like(1.0 / max(math.prod(x.shape[2:]), 1), x))]


def global_max_pool_vjp(b, node, gys, needed):
    x = node.inputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    return [b.op("GlobalMaxPoolGrad", [gys[0], x], {}, domain=INTERNAL_DOMAIN, like=x)]


def global_lp_pool_vjp(b, node, gys, needed):
    """gx = gy * y^(1-p) * sign(x)|x|^(p-1), broadcast over the spatial axes."""
    x, y = node.inputs[0], node.outputs[0]
    if gys[0] is None or not needed[0]:
        return [None]
    p = float(node.attrs["p"])
    if p == 1.0:
        return [b.mul(b.op("Sign", [x]), gys[0])]
    if p == 2.0:
        return [b.mul(x, b.div(gys[0], y))]
    q = b.scalar_like(p - 1.0, x)
    dx = b.mul(b.op("Sign", [x]), b.op("Pow", [b.op("Abs", [x]), q]))
    return [b.mul(dx, b.div(gys[0], b.op("Pow", [y, q])))]


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("MaxPool", (1, 8, 10, 11, 12, 22), {"numpy": max_pool_numpy}, layout=SPATIAL,
              differentiable=True, gradient=max_pool_vjp, value_bounds=bounded_like_input),
        OpDef("AveragePool", (1, 7, 10, 11, 19, 22), {"numpy": average_pool_numpy},
              layout=SPATIAL, differentiable=True, gradient=average_pool_vjp,
              value_bounds=bounded_like_input),
        OpDef("LpPool", (1, 2, 11, 18, 22), {"numpy": lp_pool_numpy}, layout=SPATIAL,
              differentiable=True, gradient=lp_pool_vjp),
        OpDef("GlobalAveragePool", (1, 22), {"numpy": global_average_pool_numpy},
              layout=SPATIAL, differentiable=True, gradient=global_average_pool_vjp,
              value_bounds=bounded_like_input),
        OpDef("GlobalMaxPool", (1, 22), {"numpy": global_max_pool_numpy}, layout=SPATIAL,
              differentiable=True, gradient=global_max_pool_vjp, value_bounds=bounded_like_input),
        OpDef("GlobalLpPool", (1, 2, 22), {"numpy": global_lp_pool_numpy}, layout=SPATIAL,
              differentiable=True, gradient=global_lp_pool_vjp),
        OpDef("MaxPoolGrad", (1,), {"numpy": max_pool_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=SPATIAL, doc="gx of MaxPool: gy routed to each window's first maximum"),
        OpDef("AveragePoolGrad", (1,), {"numpy": average_pool_grad_numpy},
              domain=INTERNAL_DOMAIN, layout=SPATIAL,
              doc="gx of AveragePool: gy / divisor spread over each window"),
        OpDef("LpPoolGrad", (1,), {"numpy": lp_pool_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=SPATIAL, doc="gx of LpPool from (gy, x, y)"),
        OpDef("GlobalMaxPoolGrad", (1,), {"numpy": global_max_pool_grad_numpy},
              domain=INTERNAL_DOMAIN, layout=SPATIAL,
              doc="gx of GlobalMaxPool: gy routed to each plane's first maximum"),
    ]
