"""Normalisations: BatchNormalization, InstanceNormalization, GroupNormalization and LRN (spatial:
they compute on the channels-last view of their input), LayerNormalization,
MeanVarianceNormalization and LpNormalization (elementwise-layout reductions).

Spatial kernels take ``x_nhwc = np.moveaxis(x, c, -1)`` with ``c`` the rule's channel axis: a
near-contiguous view over the physical channels-last buffer, in which a per-channel vector
broadcasts along the last axis. Rank-2 inputs ``(N, C)`` are stored plain; the same view code
serves them. Statistics over float16 data accumulate in float32 (as the ONNX spec of
BatchNormalization asks); float32/float64 compute in their own type.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..dtypes import np_dtype
from ..hookspecs import hookimpl
from ..opdef import CHANNEL_VECTOR, SPATIAL, OpDef

# SPATIAL, with the per-channel parameters stored as (padded) channel vectors
BATCH_NORM = replace(SPATIAL, weights={i: CHANNEL_VECTOR for i in (1, 2, 3, 4)})
SCALE_BIAS_NORM = replace(SPATIAL, weights={1: CHANNEL_VECTOR, 2: CHANNEL_VECTOR})


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """The type statistics are computed in: float32 at least (float16 sums overflow/round)."""
    return np.promote_types(dtype, np.float32)


def _channels_last(a: np.ndarray, axis: int) -> np.ndarray:
    """The view with the channel axis last (over a channels-last buffer: near-contiguous)."""
    return np.moveaxis(a, axis, -1)


def _split_last_axis(a: np.ndarray, parts: int) -> np.ndarray:
    """``[..., C]`` -> ``[..., parts, C // parts]`` as a view (never a copy: ``reshape`` of a
    strided view may silently copy, and outputs must be written in place)."""
    *lead, c = a.shape
    step = a.strides[-1]
    return np.lib.stride_tricks.as_strided(
        a, (*lead, parts, c // parts), (*a.strides[:-1], step * (c // parts), step))


def _channels_last_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if i != axis) + (shape[axis],)


def _check_rank(ctx, minimum: int) -> int:
    rank = len(ctx.inputs[0].shape)
    if rank < minimum:
        raise ctx.error(f"{ctx.node.op_type} needs an input of rank >= {minimum}, got {rank}")
    return rank


# --------------------------------------------------------------------------- BatchNormalization


def _batch_norm_training(ctx) -> bool:
    """Whether the node normalises with batch statistics (by the rules of its version)."""
    if ctx.since_version >= 14:
        return bool(ctx.attrs["training_mode"])
    if ctx.since_version < 7:
        return not ctx.attrs["is_test"]
    # v7/v9: the training outputs' presence selects the mode ("Output case #1").
    return any(ctx.has_output(i) for i in range(1, 5))


def batch_norm_numpy(ctx):
    """y = x * a + b per channel, a = scale / sqrt(var + eps), b = bias - mean * a.

    In training mode mean/var are the batch's (biased variance over N and the spatial axes),
    and the running statistics are updated: running = momentum * running + (1 - momentum) *
    batch. Before v14 the outputs are (Y, running_mean, running_var, saved_mean, saved_var)
    with the saved ones the batch statistics; from v14 (Y, running_mean, running_var).
    """
    c_axis = BATCH_NORM.channel_axis
    rank = _check_rank(ctx, c_axis + 1)
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    if ctx.attrs.get("spatial", 1) == 0 and rank > 2:  # attribute only before v9
        raise ctx.error("BatchNormalization with spatial=0 (per-element statistics, "
                        "deprecated since opset 9) is not supported; flatten the input to "
                        "(N, C*D1*...) instead, as the ONNX spec suggests")
    eps = float(ctx.attrs["epsilon"])
    momentum = float(ctx.attrs["momentum"])
    training = _batch_norm_training(ctx)
    acc = _acc_dtype(dtype)
    c = x_info.shape[c_axis]
    a_ws, b_ws = ctx.workspace((c,), acc), ctx.workspace((c,), acc)
    stat_axes = tuple(range(rank - 1))  # every axis but the channels of the channels-last view
    if training:
        mean_ws, var_ws = ctx.workspace((c,), acc), ctx.workspace((c,), acc)
        d_ws = ctx.workspace(_channels_last_shape(x_info.shape, c_axis), acc)
        count = max(int(np.prod(x_info.shape, dtype=np.int64)) // max(c, 1), 1)
        running = [i for i in (1, 2) if ctx.has_output(i)]
        saved = [i for i in (3, 4) if ctx.has_output(i)] if ctx.since_version < 14 else []

    def run_inference(ins, outs, ws):
        scale, bias, mean, var = ins[1], ins[2], ins[3], ins[4]
        a, b = ws[a_ws], ws[b_ws]
        np.add(var, eps, out=a)
        np.sqrt(a, out=a)
        np.divide(scale, a, out=a)
        np.multiply(mean, a, out=b)
        np.subtract(bias, b, out=b)
        x_nhwc, y_nhwc = _channels_last(ins[0], c_axis), _channels_last(outs[0], c_axis)
        np.multiply(x_nhwc, a, out=y_nhwc, casting="same_kind")
        np.add(y_nhwc, b, out=y_nhwc, casting="same_kind")

    def run_training(ins, outs, ws):
        scale, bias = ins[1], ins[2]
        a, b, mean, var, d = ws[a_ws], ws[b_ws], ws[mean_ws], ws[var_ws], ws[d_ws]
        x_nhwc, y_nhwc = _channels_last(ins[0], c_axis), _channels_last(outs[0], c_axis)
        np.mean(x_nhwc, axis=stat_axes, dtype=acc, out=mean)
        np.subtract(x_nhwc, mean, out=d)
        flat = d.reshape(-1, c)  # contiguous workspace: a view
        np.einsum("kc,kc->c", flat, flat, out=var)
        np.divide(var, count, out=var)
        # the running/saved outputs, from the batch statistics (a and b are scratch here)
        for i, stat, given in ((1, mean, ins[3]), (2, var, ins[4])):
            if i in running:
                np.multiply(given, momentum, out=b)
                np.multiply(stat, 1.0 - momentum, out=a)
                np.add(b, a, out=b)
                np.copyto(outs[i], b, casting="same_kind")
        for i, stat in ((3, mean), (4, var)):
            if i in saved:
                np.copyto(outs[i], stat, casting="same_kind")
        np.add(var, eps, out=a)
        np.sqrt(a, out=a)
        np.divide(scale, a, out=a)
        np.multiply(d, a, out=d)
        np.add(d, bias, out=d)
        np.copyto(y_nhwc, d, casting="same_kind")

    return run_training if training else run_inference


# ------------------------------------------------------------- Instance / Group normalization


def _group_norm_run(ctx, groups: int, per_group_params: bool, eps: float, acc: np.dtype):
    """Normalise x over (spatial, channels of one group) per (n, group); y = xhat * s + b.

    Works on the channels-last view split into ``[N, *S, G, C/G]``; ``per_group_params``: scale
    and bias have one value per group (GroupNormalization v18) instead of one per channel.
    """
    c_axis = SCALE_BIAS_NORM.channel_axis
    x_info = ctx.inputs[0]
    shape = x_info.shape
    n, c = shape[0], shape[c_axis]
    if groups <= 0 or c % groups:
        raise ctx.error(f"{c} channels cannot be split into {groups} groups")
    cg = c // groups
    spatial = int(np.prod([d for i, d in enumerate(shape) if i not in (0, c_axis)],
                          dtype=np.int64))
    d_ws = ctx.workspace((n, spatial, groups, cg), acc)
    mean_ws = ctx.workspace((n, 1, groups, 1), acc)
    var_ws = ctx.workspace((n, groups), acc)
    sb_shape = (groups, 1) if per_group_params else (groups, cg)
    count = max(spatial * cg, 1)

    def run(ins, outs, ws):
        d, mean, var = ws[d_ws], ws[mean_ws], ws[var_ws]
        d_full = d.reshape(_channels_last_shape(shape, c_axis)[:-1] + (groups, cg))  # view
        x_g = _split_last_axis(_channels_last(ins[0], c_axis), groups)
        y_g = _split_last_axis(_channels_last(outs[0], c_axis), groups)
        np.copyto(d_full, x_g)
        np.mean(d, axis=(1, 3), keepdims=True, out=mean)
        np.subtract(d, mean, out=d)
        np.einsum("nsgk,nsgk->ng", d, d, out=var)
        np.divide(var, count, out=var)
        np.add(var, eps, out=var)
        np.sqrt(var, out=var)
        np.divide(d, var[:, None, :, None], out=d)
        np.multiply(d, ins[1].reshape(sb_shape), out=d)  # (C,) views have unit stride: a view
        np.add(d, ins[2].reshape(sb_shape), out=d)
        np.copyto(y_g, d_full, casting="same_kind")

    return run


def instance_norm_numpy(ctx):
    """InstanceNormalization: statistics per (n, c) over the spatial axes."""
    _check_rank(ctx, 2)
    c = ctx.inputs[0].shape[SCALE_BIAS_NORM.channel_axis]
    return _group_norm_run(ctx, c, False, float(ctx.attrs["epsilon"]),
                           _acc_dtype(ctx.outputs[0].dtype))


def group_norm_numpy(ctx):
    """GroupNormalization: v18 has per-group scale/bias, v21 per-channel and ``stash_type``."""
    _check_rank(ctx, 2)
    dtype = ctx.outputs[0].dtype
    acc = _stash_dtype(ctx, dtype) if ctx.since_version >= 21 else _acc_dtype(dtype)
    return _group_norm_run(ctx, int(ctx.attrs["num_groups"]), ctx.since_version < 21,
                           float(ctx.attrs["epsilon"]), acc)


# ----------------------------------------------------------------------------------- LRN


def lrn_numpy(ctx):
    """y = x / (bias + alpha / size * sum of x^2 over a channel window) ** beta.

    The window of channel c is [c - floor((size-1)/2), c + ceil((size-1)/2)]; its square sum is
    built as ``size`` shifted adds along the last axis of the channels-last view (exact, unlike
    differences of a cumulative sum).
    """
    c_axis = SPATIAL.channel_axis
    _check_rank(ctx, 2)
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    size = int(ctx.attrs["size"])
    alpha, beta = float(ctx.attrs["alpha"]), float(ctx.attrs["beta"])
    bias = float(ctx.attrs["bias"])
    acc = _acc_dtype(dtype)
    nhwc = _channels_last_shape(x_info.shape, c_axis)
    c = nhwc[-1]
    sq_ws, sum_ws = ctx.workspace(nhwc, acc), ctx.workspace(nhwc, acc)
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    shifts = [k for k in range(-lo, hi + 1) if abs(k) < c]

    def run(ins, outs, ws):
        x_nhwc, y_nhwc = _channels_last(ins[0], c_axis), _channels_last(outs[0], c_axis)
        sq, s = ws[sq_ws], ws[sum_ws]
        np.square(x_nhwc, out=sq)
        s[...] = 0
        for k in shifts:  # s[..., j] += sq[..., j + k] where j + k is a channel
            if k >= 0:
                s[..., :c - k] += sq[..., k:]
            else:
                s[..., -k:] += sq[..., :c + k]
        np.multiply(s, alpha / size, out=s)
        np.add(s, bias, out=s)
        np.power(s, -beta, out=s)
        np.multiply(x_nhwc, s, out=y_nhwc, casting="same_kind")

    return run


# ------------------------------------------------------------ Layer / MVN / Lp normalization


def _stash_dtype(ctx, dtype: np.dtype) -> np.dtype:
    """Stage-one precision: ``stash_type`` (float32 by the schema default), or x's if wider."""
    return np.promote_types(dtype, np_dtype(int(ctx.attrs["stash_type"])))


def layer_norm_numpy(ctx):
    """Normalise over axes [axis, rank); Mean and InvStdDev outputs keep the reduced axes as 1."""
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    shape = x_info.shape
    rank = len(shape)
    axis = int(ctx.attrs["axis"])
    if not -rank <= axis < rank:
        raise ctx.error(f"axis {axis} is out of range for a rank-{rank} input")
    axis %= rank
    eps = float(ctx.attrs["epsilon"])
    acc = _stash_dtype(ctx, dtype)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis:], dtype=np.int64))
    norm_axes = tuple(range(axis, rank))
    kept = shape[:axis] + (1,) * (rank - axis)
    d_ws = ctx.workspace((outer, inner), acc)
    mean_ws, inv_ws = ctx.workspace((outer, 1), acc), ctx.workspace((outer, 1), acc)
    has_bias, has_mean, has_inv = ctx.has_input(2), ctx.has_output(1), ctx.has_output(2)

    def run(ins, outs, ws):
        d, mean, inv = ws[d_ws], ws[mean_ws], ws[inv_ws]
        d_full, mean_full = d.reshape(shape), mean.reshape(kept)  # contiguous: views
        np.mean(ins[0], axis=norm_axes, keepdims=True, dtype=acc, out=mean_full)
        np.subtract(ins[0], mean_full, out=d_full)
        np.einsum("ij,ij->i", d, d, out=inv[:, 0])
        np.divide(inv, inner, out=inv)
        np.add(inv, eps, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        if has_mean:
            np.copyto(outs[1], mean_full, casting="same_kind")
        if has_inv:
            np.copyto(outs[2], inv.reshape(kept), casting="same_kind")
        np.multiply(d, inv, out=d)
        np.multiply(d_full, ins[1], out=d_full)
        if has_bias:
            np.add(d_full, ins[2], out=d_full)
        np.copyto(outs[0], d_full, casting="same_kind")

    return run


def mvn_numpy(ctx):
    """(x - mean) / (sqrt(var) + 1e-9) over ``axes`` (the ONNX function body's epsilon)."""
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    rank = len(x_info.shape)
    axes = tuple(sorted({int(a) % rank for a in ctx.attrs["axes"]}))
    kept = tuple(1 if a in axes else d for a, d in enumerate(x_info.shape))
    acc = _acc_dtype(dtype)
    d_ws, sq_ws = ctx.workspace(x_info.shape, acc), ctx.workspace(x_info.shape, acc)
    mean_ws, std_ws = ctx.workspace(kept, acc), ctx.workspace(kept, acc)

    def run(ins, outs, ws):
        d, sq, mean, std = ws[d_ws], ws[sq_ws], ws[mean_ws], ws[std_ws]
        np.mean(ins[0], axis=axes, keepdims=True, dtype=acc, out=mean)
        np.subtract(ins[0], mean, out=d)
        np.square(d, out=sq)
        np.mean(sq, axis=axes, keepdims=True, out=std)
        np.sqrt(std, out=std)
        np.add(std, 1e-9, out=std)
        np.divide(d, std, out=outs[0], casting="same_kind")

    return run


def lp_norm_numpy(ctx):
    """x / ||x||_p along ``axis`` (p = 1 or 2); 0 where the norm is 0."""
    x_info = ctx.inputs[0]
    rank = len(x_info.shape)
    axis = int(ctx.attrs["axis"])
    if not -rank <= axis < rank:
        raise ctx.error(f"axis {axis} is out of range for a rank-{rank} input")
    axis %= rank
    p = int(ctx.attrs["p"])
    if p not in (1, 2):
        raise ctx.error(f"p must be 1 or 2, got {p}")
    dtype = ctx.outputs[0].dtype
    kept = tuple(1 if a == axis else d for a, d in enumerate(x_info.shape))
    norm_ws = ctx.workspace(kept, dtype)
    magnitude = np.abs if p == 1 else np.square

    def run(ins, outs, ws):
        x, y, norm = ins[0], outs[0], ws[norm_ws]
        magnitude(x, out=y)  # y as scratch before the final divide
        np.sum(y, axis=axis, keepdims=True, out=norm)
        if p == 2:
            np.sqrt(norm, out=norm)
        y[...] = 0
        np.divide(x, norm, out=y, where=norm != 0)  # (kept-shape) bool temporary

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("BatchNormalization", (1, 6, 7, 9, 14, 15), {"numpy": batch_norm_numpy},
              layout=BATCH_NORM, differentiable=True),
        OpDef("InstanceNormalization", (1, 6, 22), {"numpy": instance_norm_numpy},
              layout=SCALE_BIAS_NORM, differentiable=True),
        OpDef("GroupNormalization", (18, 21), {"numpy": group_norm_numpy},
              layout=SCALE_BIAS_NORM, differentiable=True),
        OpDef("LRN", (1, 13), {"numpy": lrn_numpy}, layout=SPATIAL, differentiable=True),
        OpDef("LayerNormalization", (17,), {"numpy": layer_norm_numpy}, differentiable=True),
        OpDef("MeanVarianceNormalization", (9, 13), {"numpy": mvn_numpy}, differentiable=True),
        OpDef("LpNormalization", (1, 22), {"numpy": lp_norm_numpy}, differentiable=True),
    ]
