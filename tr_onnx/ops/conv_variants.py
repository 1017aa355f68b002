"""Convolutions of the newer opsets that train nothing yet: CausalConvWithState (a depthwise
causal 1-D convolution that carries its last k - 1 inputs) and DeformConv (each kernel tap reads
at its own learned offset). Forward only, NumPy in float64 (the node suite's references); kept
apart from ``conv.py``'s Conv family, whose layouts, oneDNN kernels and gradients they share
nothing of."""

from __future__ import annotations

import itertools

import numpy as np

from ..hookspecs import hookimpl
from ..host_math import negate
from ..opdef import PLAIN_ONLY, OpDef

# --------------------------------------------------------------------------------------------
# CausalConvWithState: a depthwise causal 1-D convolution that carries its last k-1 inputs
# --------------------------------------------------------------------------------------------


def causal_conv_with_state_numpy(ctx):
    """``y[b, c, t] = act(bias[c] + sum_j w[c, 0, j] * p[b, c, t + j])`` over
    ``p = concat(past_state or zeros, x)`` (length + k - 1 samples); ``present_state`` is the
    last k - 1 of ``p``. Accumulated tap by tap in float64 (one multiply-add per tap, as the
    depthwise Conv does); ``activation`` silu/swish is ``y * sigmoid(y)``."""
    batch, channels, length = ctx.inputs[0].shape
    taps = ctx.inputs[1].shape[2]
    activation = ctx.attrs.get("activation", "none")
    if isinstance(activation, bytes):
        activation = activation.decode()
    if activation not in ("none", "silu", "swish"):
        raise ctx.error(f"activation {activation!r} is not none, silu or swish")
    has_bias, has_state = ctx.has_input(2), ctx.has_input(3)
    padded = ctx.workspace((batch, channels, length + taps - 1), np.float64)
    acc = ctx.workspace((batch, channels, length), np.float64)
    tmp = ctx.workspace((batch, channels, length), np.float64)

    def run(ins, outs, ws):
        p, y, t = ws[padded], ws[acc], ws[tmp]
        x, w = ins[0], ins[1]
        if has_state:
            np.copyto(p[:, :, :taps - 1], ins[3])
        else:
            p[:, :, :taps - 1] = 0
        np.copyto(p[:, :, taps - 1:], x)
        np.multiply(p[:, :, 0:length], w[None, :, 0, 0:1], out=y)
        for j in range(1, taps):
            np.multiply(p[:, :, j:j + length], w[None, :, 0, j:j + 1], out=t)
            np.add(y, t, out=y)
        if has_bias:
            np.add(y, ins[2][None, :, None], out=y)
        if activation != "none":
            negate(y, t)
            np.exp(t, out=t)
            np.add(t, 1, out=t)
            np.divide(y, t, out=y)
        np.copyto(outs[0], y)
        if len(outs) > 1 and outs[1] is not None:
            np.copyto(outs[1], p[:, :, length:])

    return run


# --------------------------------------------------------------------------------------------
# DeformConv: each kernel tap reads at its own learned offset (bilinear, zeros outside)
# --------------------------------------------------------------------------------------------


def _bilinear_nchw(x: np.ndarray, y: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """x [C, H, W] sampled at real positions (y, xs) of any one shape: [C, *shape]; corners
    outside the map count as zeros (GridSample's zeros padding with aligned corners)."""
    h, w = x.shape[1:]
    y0, x0 = np.floor(y), np.floor(xs)
    out = np.zeros((x.shape[0], *y.shape))
    for dy, dx in itertools.product((0, 1), (0, 1)):
        yy, xx = y0 + dy, x0 + dx
        weight = (1 - np.abs(y - yy)) * (1 - np.abs(xs - xx))
        inside = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
        taken = x[:, np.clip(yy, 0, h - 1).astype(np.int64), np.clip(xx, 0, w - 1).astype(np.int64)]
        out += taken * np.where(inside, weight, 0.0)
    return out


def deform_conv_numpy(ctx):
    """2-D DeformConv in float64: per offset group the input is sampled at each tap's position
    plus its offset (and scaled by ``mask``), then one matmul per group with the weight, as
    im2col. Columns are per-step temporaries (the samples are data-dependent)."""
    if len(ctx.inputs[0].shape) != 4:
        raise ctx.error("only 2-D DeformConv is implemented")
    n, c, h, w = ctx.inputs[0].shape
    oc, c_per_group, kh, kw = ctx.inputs[1].shape
    oh, ow = ctx.outputs[0].shape[2:]
    group, offset_group = int(ctx.attrs.get("group", 1)), int(ctx.attrs.get("offset_group", 1))
    sh, sw = ctx.attrs.get("strides") or (1, 1)
    dh, dw = ctx.attrs.get("dilations") or (1, 1)
    pads = ctx.attrs.get("pads") or (0, 0, 0, 0)
    base_y = (np.arange(kh) * dh)[:, None, None, None] + (np.arange(oh) * sh - pads[0])[
        None, None, :, None]
    base_x = (np.arange(kw) * dw)[None, :, None, None] + (np.arange(ow) * sw - pads[1])[
        None, None, None, :]
    has_bias, has_mask = ctx.has_input(3), ctx.has_input(4)
    c_per_offset = c // offset_group

    def run(ins, outs, ws):
        x, weight = ins[0].astype(np.float64), ins[1].astype(np.float64)
        offset = ins[2].reshape(n, offset_group, kh, kw, 2, oh, ow)
        mask = ins[4].reshape(n, offset_group, kh, kw, oh, ow) if has_mask else None
        y = np.empty((n, oc, oh, ow))
        for b in range(n):
            cols = np.empty((c, kh, kw, oh, ow))
            for g in range(offset_group):
                part = slice(g * c_per_offset, (g + 1) * c_per_offset)
                cols[part] = _bilinear_nchw(x[b, part], base_y + offset[b, g, :, :, 0],
                                            base_x + offset[b, g, :, :, 1])
                if has_mask:
                    cols[part] *= mask[b, g]
            for g in range(group):
                rows = slice(g * (oc // group), (g + 1) * (oc // group))
                chans = slice(g * c_per_group, (g + 1) * c_per_group)
                y[b, rows] = (weight[rows].reshape(oc // group, -1)
                              @ cols[chans].reshape(-1, oh * ow)).reshape(-1, oh, ow)
        if has_bias:
            y += ins[3].reshape(1, -1, 1, 1)
        np.copyto(outs[0], y)

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("DeformConv", (19, 22), {"numpy": deform_conv_numpy}, layout=PLAIN_ONLY,
              differentiable=False),
        OpDef("CausalConvWithState", (27,), {"numpy": causal_conv_with_state_numpy},
              layout=PLAIN_ONLY, differentiable=False),
    ]
