"""Normalisations: InstanceNormalization and GroupNormalization (spatial: they compute on the
channels-last view of their input; BatchNormalization is ops/batch_norm.py and LRN
ops/lrn.py, both spatial too, sharing this module's view helpers), LayerNormalization,
MeanVarianceNormalization and LpNormalization (elementwise-layout reductions), with their
gradient rules and the internal ops (domain ai.tr_onnx) they use: GroupNormGrad
(Instance/Group) and LayerNormGrad. MVN and LpNormalization differentiate through standard ops.

Spatial kernels take ``x_nhwc = np.moveaxis(x, c, -1)`` with ``c`` the rule's channel axis: a
near-contiguous view over the physical channels-last buffer, in which a per-channel vector
broadcasts along the last axis. Rank-2 inputs ``(N, C)`` are stored plain; the same view code
serves them. Statistics over float16 data accumulate in float32 (as the ONNX spec of
BatchNormalization asks); float32/float64 compute in their own type.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from onnx import TensorProto

from ..domains import INTERNAL_DOMAIN
from ..dtypes import elem_type_name, np_dtype, onnx_elem_type
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..layouts import StridedLayout, channels_last_view
from ..opdef import (
    CHANNEL_NORMALIZATION,
    CHANNEL_VECTOR,
    ELEMENTWISE,
    NORMALIZATION,
    SPATIAL,
    OpDef,
)
from .layer_norm_onednn import layer_norm_grad_onednn, layer_norm_onednn
from .reduce import reduce_kept

# SPATIAL, with the per-channel scale and bias stored as (padded) channel vectors
SCALE_BIAS_NORM = replace(SPATIAL, weights={1: CHANNEL_VECTOR, 2: CHANNEL_VECTOR})
# GroupNormGrad reads (gy, x, scale): gy is the channels-last map of input 0
SCALE_NORM_GRAD = replace(SPATIAL, weights={2: CHANNEL_VECTOR})


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """The type statistics are computed in: float32 at least (float16 sums overflow/round)."""
    return np.promote_types(dtype, np.float32)


def _channels_last(a: np.ndarray, axis: int) -> np.ndarray:
    """The view with the channel axis last (over a channels-last buffer: near-contiguous)."""
    return channels_last_view(a, axis)


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


def group_norm_grad_numpy(ctx):
    """ai.tr_onnx GroupNormGrad(gy, x, scale) -> (gx, gscale, gbias) for Instance/Group
    normalisation (``num_groups``, ``epsilon``, ``per_group_params`` as the forward's).

    Per (n, group) with M elements: xhat = (x - mean) * inv, g = gy * scale;
    gx = inv * (g - mean(g) - xhat * mean(g * xhat)); gscale/gbias sum gy * xhat / gy over
    the batch and the spatial axes (and the group's channels for per-group parameters).
    """
    c_axis = SCALE_BIAS_NORM.channel_axis
    x_info, dtype = ctx.inputs[1], ctx.outputs[0].dtype
    shape = x_info.shape
    groups, eps = int(ctx.attrs["num_groups"]), float(ctx.attrs["epsilon"])
    per_group = bool(ctx.attrs["per_group_params"])
    acc = _acc_dtype(dtype)
    n, c = shape[0], shape[c_axis]
    cg = c // groups
    spatial = int(np.prod([d for i, d in enumerate(shape) if i not in (0, c_axis)],
                          dtype=np.int64))
    full = (n, spatial, groups, cg)
    xhat_ws, g_ws, t_ws = (ctx.workspace(full, acc) for _ in range(3))
    mean_ws, inv_ws = ctx.workspace((n, 1, groups, 1), acc), ctx.workspace((n, 1, groups, 1), acc)
    m1_ws, m2_ws = ctx.workspace((n, 1, groups, 1), acc), ctx.workspace((n, 1, groups, 1), acc)
    gs_ws, gb_ws = ctx.workspace((groups, cg), acc), ctx.workspace((groups, cg), acc)
    sb_shape = (groups, 1) if per_group else (groups, cg)
    nhwc = _channels_last_shape(shape, c_axis)[:-1] + (groups, cg)
    has_gscale, has_gbias = ctx.has_output(1), ctx.has_output(2)

    def run(ins, outs, ws):
        xhat, g, t = ws[xhat_ws], ws[g_ws], ws[t_ws]
        mean, inv, m1, m2, gs, gb = (ws[k] for k in (mean_ws, inv_ws, m1_ws, m2_ws, gs_ws,
                                                     gb_ws))
        np.copyto(xhat.reshape(nhwc), _split_last_axis(_channels_last(ins[1], c_axis), groups))
        np.copyto(g.reshape(nhwc), _split_last_axis(_channels_last(ins[0], c_axis), groups))
        np.mean(xhat, axis=(1, 3), keepdims=True, out=mean)
        np.subtract(xhat, mean, out=xhat)
        np.square(xhat, out=t)
        np.mean(t, axis=(1, 3), keepdims=True, out=inv)
        np.add(inv, eps, out=inv)
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        np.multiply(xhat, inv, out=xhat)
        np.sum(g, axis=(0, 1), out=gb)
        np.multiply(g, xhat, out=t)
        np.sum(t, axis=(0, 1), out=gs)
        for k, src, wanted in ((1, gs, has_gscale), (2, gb, has_gbias)):
            if wanted:
                dst = outs[k].reshape(sb_shape)  # (C,) or (G,) unit-stride vectors: views
                if per_group:
                    np.sum(src, axis=1, keepdims=True, out=dst)
                else:
                    np.copyto(dst, src, casting="same_kind")
        if outs[0] is None:
            return
        np.multiply(g, ins[2].reshape(sb_shape), out=g)
        np.mean(g, axis=(1, 3), keepdims=True, out=m1)
        np.multiply(g, xhat, out=t)
        np.mean(t, axis=(1, 3), keepdims=True, out=m2)
        np.multiply(xhat, m2, out=t)
        np.subtract(g, t, out=g)
        np.subtract(g, m1, out=g)
        np.multiply(g, inv, out=g)
        np.copyto(_split_last_axis(_channels_last(outs[0], c_axis), groups), g.reshape(nhwc),
                  casting="same_kind")

    return run


def _group_norm_grad(b, node, gys, needed, groups: int, per_group: bool):
    x, scale, bias = node.inputs[:3]
    if gys[0] is None:
        return [None] * len(node.inputs)
    gx, gscale, gbias = b.op("GroupNormGrad", [gys[0], x, scale],
                             {"num_groups": groups, "epsilon": float(node.attrs["epsilon"]),
                              "per_group_params": int(per_group)},
                             domain=INTERNAL_DOMAIN, like=[x, scale, bias])
    return [gx if needed[0] else None, gscale if needed[1] else None,
            gbias if needed[2] else None]


def instance_norm_vjp(b, node, gys, needed):
    return _group_norm_grad(b, node, gys, needed,
                            node.inputs[0].shape[SCALE_BIAS_NORM.channel_axis], False)


def group_norm_vjp(b, node, gys, needed):
    return _group_norm_grad(b, node, gys, needed, int(node.attrs["num_groups"]),
                            node.since_version < 21)


# ------------------------------------------------------------ Layer / MVN / Lp normalization


def _stash_dtype(ctx, dtype: np.dtype) -> np.dtype:
    """Stage-one precision: ``stash_type`` (float32 by the schema default), or x's if wider."""
    stash = int(ctx.attrs["stash_type"])
    if stash not in _STASH_TYPES:
        raise UnsupportedModelError(
            f"{ctx.node.label}: stash_type={stash} ({elem_type_name(stash)}); the schema's "
            f"stash types are {', '.join(elem_type_name(t) for t in _STASH_TYPES)}", [])
    return np.promote_types(dtype, np_dtype(stash))


# the float types a normalization may compute its statistics in
_STASH_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _plain_rows(info, dtype: np.dtype) -> bool:
    """Whether a tensor's kernel view reshapes to ``[outer, inner]`` rows of ``dtype`` without
    a copy (a plain, unpadded layout of that type)."""
    return isinstance(info.layout, StridedLayout) and info.layout.is_plain \
        and np.dtype(info.dtype) == dtype


def _all_plain_float32(ctx) -> bool:
    """Every operand a plain float32 tensor: oneDNN's layer normalization (the caller has
    checked the stash type) runs on the arena's rows as they lie (``layer_norm_onednn``)."""
    f32 = np.dtype(np.float32)
    return all(i is None or _plain_rows(i, f32) for i in (*ctx.inputs, *ctx.outputs))


def _rows_of(a: np.ndarray, plain: bool, scratch: np.ndarray) -> np.ndarray:
    """``a`` as ``scratch``-shaped ``[outer, inner]`` rows: a view when ``plain``, else a copy."""
    if plain:
        return a.reshape(scratch.shape)
    np.copyto(scratch.reshape(a.shape), a, casting="same_kind")
    return scratch


def _row_stats(x2, d, mean, inv, eps: float) -> None:
    """d = x2 - mean and inv = 1 / sqrt(var + eps) per row of ``[outer, inner]`` x2: the mean,
    then the centred sum of squares (``mean``/``inv`` are ``[outer, 1]``; d may be x2)."""
    inner = x2.shape[1]
    np.einsum("ij->i", x2, out=mean[:, 0])
    np.divide(mean, inner, out=mean)
    np.subtract(x2, mean, out=d)
    np.einsum("ij,ij->i", d, d, out=inv[:, 0])
    np.divide(inv, inner, out=inv)
    np.add(inv, eps, out=inv)
    np.sqrt(inv, out=inv)
    np.reciprocal(inv, out=inv)


def layer_norm_numpy(ctx):
    """Normalise over axes [axis, rank); Mean and InvStdDev outputs keep the reduced axes as 1.

    The statistics are two passes over rows (the mean, then the centred sum of squares). The
    centred rows live in y when y is plain rows of the stash type, and are scaled there in
    place; otherwise in a workspace copied out at the end."""
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
    kept = shape[:axis] + (1,) * (rank - axis)
    if acc == np.float32 and _all_plain_float32(ctx):
        fast = layer_norm_onednn(ctx, outer, inner, eps)
        if fast is not None:
            return fast
    x_rows, in_y = _plain_rows(x_info, acc), _plain_rows(ctx.outputs[0], acc)
    d_ws = None if in_y else ctx.workspace((outer, inner), acc)
    mean_ws, inv_ws = ctx.workspace((outer, 1), acc), ctx.workspace((outer, 1), acc)
    has_bias, has_mean, has_inv = ctx.has_input(2), ctx.has_output(1), ctx.has_output(2)

    def run(ins, outs, ws):
        mean, inv = ws[mean_ws], ws[inv_ws]
        d = outs[0].reshape(outer, inner) if in_y else ws[d_ws]
        d_full, mean_full = d.reshape(shape), mean.reshape(kept)  # views (plain rows)
        _row_stats(_rows_of(ins[0], x_rows, d), d, mean, inv, eps)
        if has_mean:
            np.copyto(outs[1], mean_full, casting="same_kind")
        if has_inv:
            np.copyto(outs[2], inv.reshape(kept), casting="same_kind")
        np.multiply(d, inv, out=d)
        np.multiply(d_full, ins[1], out=d_full)
        if has_bias:
            np.add(d_full, ins[2], out=d_full)
        if not in_y:
            np.copyto(outs[0], d_full, casting="same_kind")

    return run


def layer_norm_grad_numpy(ctx):
    """ai.tr_onnx LayerNormGrad(gy, x, scale) -> (gx, gscale, gbias) over axes [axis, rank);
    gscale/gbias have the normalised shape x.shape[axis:] (the rule sums them down to a
    broadcast scale/bias). Per row of M elements: xhat = (x - mean) * inv, g = gy * scale,
    gx = inv * (g - mean(g) - xhat * mean(g * xhat)).

    Row and column sums are einsum passes over ``[outer, inner]`` rows, read in place (and g
    built in gx) when gy, x, gx are plain rows of the compute type, else in workspace copies."""
    x_info, dtype = ctx.inputs[1], ctx.outputs[0].dtype
    shape = x_info.shape
    rank = len(shape)
    axis = int(ctx.attrs["axis"]) % rank
    eps = float(ctx.attrs["epsilon"])
    acc = _acc_dtype(dtype)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis:], dtype=np.int64))
    rows = (outer, inner)
    if acc == np.float32 and _all_plain_float32(ctx):
        fast = layer_norm_grad_onednn(ctx, outer, inner, eps)
        if fast is not None:
            return fast
    gy_rows, x_rows = _plain_rows(ctx.inputs[0], acc), _plain_rows(x_info, acc)
    in_gx = ctx.has_output(0) and _plain_rows(ctx.outputs[0], acc)
    xh_ws = ctx.workspace(rows, acc)
    gy_ws = None if gy_rows else ctx.workspace(rows, acc)
    g_ws = None if in_gx else ctx.workspace(rows, acc)
    mean_ws, inv_ws, m1_ws, m2_ws = (ctx.workspace((outer, 1), acc) for _ in range(4))
    gs_ws, gb_ws = ctx.workspace((inner,), acc), ctx.workspace((inner,), acc)
    has = [ctx.has_output(i) for i in range(3)]

    def run(ins, outs, ws):
        xh, mean, inv, m1, m2 = (ws[k] for k in (xh_ws, mean_ws, inv_ws, m1_ws, m2_ws))
        gy2 = _rows_of(ins[0], gy_rows, xh if gy_rows else ws[gy_ws])  # plain: xh's shape
        _row_stats(_rows_of(ins[1], x_rows, xh), xh, mean, inv, eps)  # a copy centred in place
        np.multiply(xh, inv, out=xh)
        if has[1]:
            np.einsum("ij,ij->j", gy2, xh, out=ws[gs_ws])
            np.copyto(outs[1], ws[gs_ws].reshape(outs[1].shape), casting="same_kind")
        if has[2]:
            np.einsum("ij->j", gy2, out=ws[gb_ws])
            np.copyto(outs[2], ws[gb_ws].reshape(outs[2].shape), casting="same_kind")
        if not has[0]:
            return
        g = outs[0].reshape(rows) if in_gx else ws[g_ws]
        np.multiply(gy2.reshape(shape), ins[2], out=g.reshape(shape))
        np.einsum("ij->i", g, out=m1[:, 0])
        np.divide(m1, inner, out=m1)
        np.einsum("ij,ij->i", g, xh, out=m2[:, 0])
        np.divide(m2, inner, out=m2)
        np.multiply(xh, m2, out=xh)
        np.subtract(g, xh, out=g)
        np.subtract(g, m1, out=g)
        np.multiply(g, inv, out=g)
        if not in_gx:
            np.copyto(outs[0], g.reshape(shape), casting="same_kind")

    return run


def layer_norm_vjp(b, node, gys, needed):
    """LayerNormGrad for y; the Mean/InvStdDev outputs' gradients (rarely used) by primitives:
    d mean/dx = 1/M, d inv/dx = -inv^3 (x - mean) / M."""
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    rank = x.rank
    axis = int(node.attrs["axis"]) % rank
    norm_shape = tuple(x.shape[axis:])
    gx = gscale = gbias = None
    if gys[0] is not None:
        gx, gscale, gbias = b.op(
            "LayerNormGrad", [gys[0], x, scale],
            {"axis": axis, "epsilon": float(node.attrs["epsilon"])}, domain=INTERNAL_DOMAIN,
            shapes=[(x.shape, x.dtype), (norm_shape, scale.dtype),
                    (norm_shape, (bias if bias is not None else scale).dtype)])
        gscale = b.unbroadcast(gscale, scale.shape) if needed[1] else None
        gbias = b.unbroadcast(gbias, bias.shape) if bias is not None and needed[2] else None
    if needed[0] and (len(gys) > 1 and gys[1] is not None or len(gys) > 2 and gys[2] is not None):
        m = float(np.prod(norm_shape))

        def as_x(v):
            return v if v.dtype == x.dtype else b.op("Cast", [v], {"to": onnx_elem_type(x.dtype)})

        extra = []
        if gys[1] is not None:
            extra.append(b.mul(as_x(gys[1]), b.scalar_like(1.0 / m, x)))
        if len(gys) > 2 and gys[2] is not None:
            mean, inv = as_x(node.outputs[1]), as_x(node.outputs[2])
            coef = b.mul(b.mul(b.mul(inv, inv), inv), as_x(gys[2]))
            coef = b.mul(coef, b.scalar_like(-1.0 / m, x))
            extra.append(b.mul(b.sub(x, mean), coef))
        for e in extra:
            e = b.op("Expand", [e, b.ints(x.shape)]) if tuple(e.shape) != tuple(x.shape) else e
            gx = e if gx is None else b.add(gx, e)
    out = [gx if needed[0] else None, gscale]
    return out + ([gbias] if len(node.inputs) > 2 else [])


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


def mvn_vjp(b, node, gys, needed):
    """y = d / (std + 1e-9), d = x - mean(x), std = sqrt(mean(d^2)) over ``axes``:
    gd = (gy - mean(gy * y) * d / std) / (std + 1e-9); gx = gd - mean(gd)."""
    x, y, gy = node.inputs[0], node.outputs[0], gys[0]
    axes = sorted({int(a) % x.rank for a in node.attrs["axes"]})

    def mean(v):
        return reduce_kept(b, "ReduceMean", v, axes)

    d = b.sub(x, mean(x))
    std = b.op("Sqrt", [mean(b.mul(d, d))])
    den = b.add(std, b.scalar_like(1e-9, x))
    gd = b.div(b.sub(gy, b.mul(mean(b.mul(gy, y)), b.div(d, std))), den)
    return [b.sub(gd, mean(gd))]


def lp_norm_vjp(b, node, gys, needed):
    """y = x / n, n = ||x||_p along ``axis``: gx = (gy - t * sum(gy * y)) / n with t = y
    (p = 2) or sign(x) (p = 1). Undefined (division by 0) where n = 0."""
    x, y, gy = node.inputs[0], node.outputs[0], gys[0]
    axes = [int(node.attrs["axis"]) % x.rank]
    p = int(node.attrs["p"])
    n = reduce_kept(b, "ReduceL2" if p == 2 else "ReduceL1", x, axes)
    t = y if p == 2 else b.op("Sign", [x])
    return [b.div(b.sub(gy, b.mul(t, reduce_kept(b, "ReduceSum", b.mul(gy, y), axes))), n)]


@hookimpl
def tr_onnx_op_definitions():
    def internal(op_type, factory, layout, **kw):
        return OpDef(op_type, (1,), {"numpy": factory}, domain=INTERNAL_DOMAIN, layout=layout,
                     **kw)

    return [
        OpDef("InstanceNormalization", (1, 6, 22), {"numpy": instance_norm_numpy},
              layout=SCALE_BIAS_NORM, differentiable=True, gradient=instance_norm_vjp,
              param_inputs=(1, 2), traits=frozenset({NORMALIZATION, CHANNEL_NORMALIZATION})),
        OpDef("GroupNormalization", (18, 21), {"numpy": group_norm_numpy},
              layout=SCALE_BIAS_NORM, differentiable=True, gradient=group_norm_vjp,
              param_inputs=(1, 2), traits=frozenset({NORMALIZATION, CHANNEL_NORMALIZATION})),
        OpDef("LayerNormalization", (17,), {"numpy": layer_norm_numpy}, differentiable=True,
              gradient=layer_norm_vjp, param_inputs=(1, 2), traits=frozenset({NORMALIZATION})),
        OpDef("MeanVarianceNormalization", (9, 13), {"numpy": mvn_numpy}, differentiable=True,
              gradient=mvn_vjp, traits=frozenset({NORMALIZATION})),
        OpDef("LpNormalization", (1, 22), {"numpy": lp_norm_numpy}, differentiable=True,
              gradient=lp_norm_vjp, traits=frozenset({NORMALIZATION})),
        internal("GroupNormGrad", group_norm_grad_numpy, SCALE_NORM_GRAD,
                 doc="(gy, x, scale) -> (gx, gscale, gbias) of Instance/GroupNormalization"),
        internal("LayerNormGrad", layer_norm_grad_numpy, ELEMENTWISE,
                 doc="(gy, x, scale) -> (gx, gscale, gbias) over the normalised shape"),
    ]
