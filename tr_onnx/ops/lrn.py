"""LRN (local response normalization across channels, AlexNet's): y = x / (bias + alpha /
size * sum of x^2 over a window of channels) ** beta, on the channels-last view of its input
(a spatial op), with its gradient as one internal op, ``ai.tr_onnx.LRNGrad``."""

from __future__ import annotations

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import NORMALIZATION, SPATIAL, OpDef
from .normalization import _acc_dtype, _channels_last, _channels_last_shape, _check_rank


def _window_shifts(size: int, c: int, transpose: bool = False) -> list[int]:
    """Offsets k with s[..., j] += sq[..., j + k]: channel j's window is
    [j - floor((size-1)/2), j + ceil((size-1)/2)]; ``transpose`` gives the windows holding j."""
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    if transpose:
        lo, hi = hi, lo
    return [k for k in range(-lo, hi + 1) if abs(k) < c]


def _window_sum(src: np.ndarray, dst: np.ndarray, shifts: list[int]) -> None:
    """dst[..., j] = sum over k of src[..., j + k] where j + k is a channel (last axis)."""
    c = src.shape[-1]
    dst[...] = 0
    for k in shifts:
        if k >= 0:
            dst[..., :c - k] += src[..., k:]
        else:
            dst[..., -k:] += src[..., :c + k]


class _Window:
    """What both kernels read from the node: the window's attributes, the statistics' dtype,
    the channels-last shape and the window's channel shifts."""

    def __init__(self, ctx, x_info):
        self.size = int(ctx.attrs["size"])
        self.alpha, self.beta = float(ctx.attrs["alpha"]), float(ctx.attrs["beta"])
        self.bias = float(ctx.attrs["bias"])
        self.acc = _acc_dtype(ctx.outputs[0].dtype)
        self.nhwc = _channels_last_shape(x_info.shape, SPATIAL.channel_axis)
        self.shifts = _window_shifts(self.size, self.nhwc[-1])

    def denominator(self, x_nhwc, sq, s) -> None:
        """s = bias + alpha / size * (window sum of x^2), using ``sq`` as scratch."""
        np.square(x_nhwc, out=sq)
        _window_sum(sq, s, self.shifts)
        np.multiply(s, self.alpha / self.size, out=s)
        np.add(s, self.bias, out=s)


def lrn_numpy(ctx):
    """y = x / (bias + alpha / size * sum of x^2 over a channel window) ** beta.

    The window's square sum is built as ``size`` shifted adds along the last axis of the
    channels-last view (exact, unlike differences of a cumulative sum).
    """
    c_axis = SPATIAL.channel_axis
    _check_rank(ctx, 2)
    win = _Window(ctx, ctx.inputs[0])
    sq_ws, sum_ws = ctx.workspace(win.nhwc, win.acc), ctx.workspace(win.nhwc, win.acc)

    def run(ins, outs, ws):
        x_nhwc, y_nhwc = _channels_last(ins[0], c_axis), _channels_last(outs[0], c_axis)
        s = ws[sum_ws]
        win.denominator(x_nhwc, ws[sq_ws], s)
        np.power(s, -win.beta, out=s)
        np.multiply(x_nhwc, s, out=y_nhwc, casting="same_kind")

    return run


def lrn_grad_numpy(ctx):
    """ai.tr_onnx LRNGrad(gy, x) -> gx, with s = bias + alpha/size * window_sum(x^2):
    gx = gy * s^-beta - 2 beta alpha/size * x * window_sum^T(gy * x * s^(-beta-1))."""
    c_axis = SPATIAL.channel_axis
    win = _Window(ctx, ctx.inputs[1])
    s_ws, t_ws, u_ws = (ctx.workspace(win.nhwc, win.acc) for _ in range(3))
    shifts_t = _window_shifts(win.size, win.nhwc[-1], transpose=True)
    beta, coef = win.beta, -2.0 * win.beta * win.alpha / win.size

    def run(ins, outs, ws):
        gy_nhwc, x_nhwc = _channels_last(ins[0], c_axis), _channels_last(ins[1], c_axis)
        s, t, u = ws[s_ws], ws[t_ws], ws[u_ws]
        win.denominator(x_nhwc, t, s)
        np.power(s, -beta - 1.0, out=t)  # s^(-beta-1)
        np.multiply(t, gy_nhwc, out=t)
        np.multiply(t, x_nhwc, out=t)
        _window_sum(t, u, shifts_t)
        np.multiply(u, x_nhwc, out=u)
        np.multiply(u, coef, out=u)
        np.power(s, -beta, out=s)
        np.multiply(s, gy_nhwc, out=s)
        np.add(s, u, out=s)
        np.copyto(_channels_last(outs[0], c_axis), s, casting="same_kind")

    return run


def lrn_vjp(b, node, gys, needed):
    attrs = {k: node.attrs[k] for k in ("size", "alpha", "beta", "bias")}
    return [b.op("LRNGrad", [gys[0], node.inputs[0]], attrs, domain=INTERNAL_DOMAIN,
                 like=node.inputs[0])]


@hookimpl
def tr_onnx_op_definitions():
    # a net with LRN (AlexNet's era) was designed without BatchNorm
    return [OpDef("LRN", (1, 13), {"numpy": lrn_numpy}, layout=SPATIAL, differentiable=True,
                  gradient=lrn_vjp, traits=frozenset({NORMALIZATION})),
            OpDef("LRNGrad", (1,), {"numpy": lrn_grad_numpy}, domain=INTERNAL_DOMAIN,
                  layout=SPATIAL, doc="(gy, x) -> gx")]
