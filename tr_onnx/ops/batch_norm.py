"""BatchNormalization, with its gradient rule and the internal ops (domain ai.tr_onnx) it uses:
BatchNormTraining (what the training pass turns a trained model's BatchNormalization into) and
BatchNormGrad. A spatial op: kernels compute on the channels-last view of x (see
``ops/normalization.py``, whose view helpers they share); float16 statistics accumulate in
float32, as the ONNX spec asks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import ir
from ..distributed import lookup
from ..domains import INTERNAL_DOMAIN, ONNX_DOMAINS
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..ir import Value
from ..opdef import (
    CHANNEL_NORMALIZATION,
    CHANNEL_VECTOR,
    NORMALIZATION,
    SPATIAL,
    OpDef,
    TrainingContext,
)
from . import batch_norm_onednn
from .normalization import _acc_dtype, _channels_last, _channels_last_shape, _check_rank

# SPATIAL, with the per-channel parameters stored as (padded) channel vectors
BATCH_NORM = replace(SPATIAL, weights={i: CHANNEL_VECTOR for i in (1, 2, 3, 4)})
# BatchNormGrad reads (gy, x, per-channel vectors...): gy is the channels-last map of input 0
BATCH_NORM_GRAD = replace(SPATIAL, weights={i: CHANNEL_VECTOR for i in (2, 3, 4)})


def _batch_norm_training(ctx) -> bool:
    """Whether the node normalises with batch statistics (by the rules of its version)."""
    if ctx.since_version >= 14:
        return bool(ctx.attrs["training_mode"])
    if ctx.since_version < 7:
        return not ctx.attrs["is_test"]
    # v7/v9: the training outputs' presence selects the mode ("Output case #1").
    return any(ctx.has_output(i) for i in range(1, 5))


def _sync_world(ctx):
    """The world a synchronised BatchNorm (``sync_batchnorm``) reduces its per-channel sums
    over (its ``world`` attribute), or None: this rank's batch alone."""
    key = ctx.attrs.get("world")
    if key is None:
        return None
    world = lookup(int(key))
    return world if world.size > 1 else None


def _write_batch_statistics(ins, outs, slots, mean, var, scratch, momentum: float,
                           correction: float, eps: float) -> None:
    """The running/saved outputs ``slots`` names, from the batch's mean and biased var (the
    unbiased one is ``var * correction``); leaves 1 / sqrt(var + eps) in ``scratch[0]``."""
    a, b = scratch
    for kind, stat, given, factor in (("running_mean", mean, ins[3], 1.0),
                                      ("running_var", var, ins[4], correction)):
        if kind in slots:
            np.multiply(given, momentum, out=b)
            np.multiply(stat, (1.0 - momentum) * factor, out=a)
            np.add(b, a, out=b)
            np.copyto(outs[slots[kind]], b, casting="same_kind")
    for kind, stat in (("saved_mean", mean), ("saved_var", var)):
        if kind in slots:
            np.copyto(outs[slots[kind]], stat, casting="same_kind")
    np.add(var, eps, out=a)
    np.sqrt(a, out=a)
    np.reciprocal(a, out=a)
    if "saved_inv_std" in slots:
        np.copyto(outs[slots["saved_inv_std"]], a, casting="same_kind")


def _batch_norm_training_run(ctx, eps: float, momentum: float, unbiased: bool, slots: dict):
    """The training-mode kernel: normalise with the batch's statistics and write the outputs
    ``slots`` names (kind -> output index): ``running_mean``/``running_var`` (momentum update
    from inputs 3/4, with the unbiased batch variance when ``unbiased``), ``saved_mean``,
    ``saved_var`` (biased) and ``saved_inv_std`` (1 / sqrt(var + eps)). y always uses the
    biased batch variance.

    Two passes for the statistics (the mean, then the centred sum of squares: no cancellation);
    the centred map lives in y itself, which is then scaled in place, so no map-sized scratch
    exists unless y's type is narrower than the statistics' (float16).

    Synchronised (a ``world`` attribute, ``sync_batchnorm``): the batch is every rank's; the
    per-channel sums (with the row count) and then the sums of squared deviations from that
    mean are all-reduced, the same two passes one process makes over the whole batch."""
    c_axis = BATCH_NORM.channel_axis
    _check_rank(ctx, c_axis + 1)
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    acc = _acc_dtype(dtype)
    c = x_info.shape[c_axis]
    world = _sync_world(ctx)
    slots = {k: i for k, i in slots.items() if ctx.has_output(i)}
    a_ws, b_ws = ctx.workspace((c,), acc), ctx.workspace((c,), acc)
    # the positions per channel: this rank's part of a synchronised count (0 on a rank with
    # no rows), at least 1 as a count of its own
    positions = int(np.prod(x_info.shape, dtype=np.int64)) // max(c, 1)
    local = max(positions, 1)
    fast = batch_norm_onednn.training(ctx, eps) if world is None else None
    if fast is not None:
        normalise, fast_mean, fast_var = fast
        correction = local / max(local - 1, 1) if unbiased else 1.0

        def run_onednn(ins, outs, ws):
            normalise(ins, outs, ws)
            _write_batch_statistics(ins, outs, slots, ws[fast_mean], ws[fast_var],
                                    (ws[a_ws], ws[b_ws]), momentum, correction, eps)

        return run_onednn
    # the sums and, last, the row count travel in one message when synchronised
    mean_ws, var_ws = ctx.workspace((c + 1,), acc), ctx.workspace((c,), acc)
    direct = acc == np.dtype(dtype)  # the centred map can live in y
    d_ws = None if direct else ctx.workspace(_channels_last_shape(x_info.shape, c_axis), acc)
    channel = _ChannelSums(ctx, _channels_last_shape(x_info.shape, c_axis), acc, vectors=2)

    def run(ins, outs, ws):
        scale, bias = ins[1], ins[2]
        a, b, sums, var = ws[a_ws], ws[b_ws], ws[mean_ws], ws[var_ws]
        mean = sums[:c]
        x_nhwc, y_nhwc = _channels_last(ins[0], c_axis), _channels_last(outs[0], c_axis)
        d = y_nhwc if direct else ws[d_ws]
        if not direct:
            np.copyto(d, x_nhwc)
        src = x_nhwc if direct else d
        rows = channel.rows(src, d)
        if rows:
            src, d = rows
        channel.sum(ws, mean, src, rows=bool(rows))
        count = local
        if world is not None:
            sums[c] = positions
            world.allreduce_sum_(sums)
            count = int(sums[c])
        np.divide(mean, count, out=mean)
        np.subtract(src, channel.tiled(ws, 0, mean) if rows else mean, out=d)
        channel.sum(ws, var, d, d, rows=bool(rows))
        if world is not None:
            world.allreduce_sum_(var)
        np.divide(var, count, out=var)
        correction = count / max(count - 1, 1) if unbiased else 1.0
        _write_batch_statistics(ins, outs, slots, mean, var, (a, b), momentum, correction, eps)
        np.multiply(scale, a, out=a)
        np.multiply(d, channel.tiled(ws, 0, a) if rows else a, out=d)
        np.add(d, channel.tiled(ws, 1, bias) if rows else bias, out=d)
        if not direct:
            d = ws[d_ws]
            np.copyto(y_nhwc, d, casting="same_kind")

    return run


class _ChannelSums:
    """Per-channel sums of a channels-last map [..., C], or of the product of two, and the
    map seen so that per-channel vectors broadcast along long rows.

    A dense map is also [M/k, k*C]: rows of k whole pixels (k the largest divisor of the M
    pixels with k*C <= ``ROW``), against which a per-channel vector tiled k times broadcasts
    with NumPy's inner loop k*C long instead of C (x - mean on [32,16,16,16]: 86 -> 33 µs;
    its sum 76 -> 20 µs, with float32 error ~(M/k + k) ulps). Other maps (padded channel
    lanes) take single-threaded einsum passes with per-sample partial sums (error ~(H*W + N)
    ulps): a ones-vector BLAS product is as fast alone, but OpenBLAS threads it from ~0.5M
    elements, and a thread waiting for a busy core stalls it for milliseconds."""

    ROW = 2048

    def __init__(self, ctx, shape: tuple[int, ...], dtype: np.dtype, vectors: int = 0):
        lead = "abcdefghijklmnopqrstuvwxy"[:len(shape) - 1]
        kept = "a" if len(shape) > 2 else ""
        self.sum_spec, self.dot_spec = f"{lead}z->{kept}z", f"{lead}z,{lead}z->{kept}z"
        self.partial = ctx.workspace((shape[0], shape[-1]), dtype) if kept else None
        c = shape[-1]
        pixels = int(np.prod(shape[:-1], dtype=np.int64))
        self.k = max((k for k in range(1, max(self.ROW // max(c, 1), 1) + 1)
                      if pixels % k == 0), default=1)
        self.c = c
        self.row_sum = ctx.workspace((self.k * c,), dtype) if self.k > 1 else None
        self.tiles = [ctx.workspace((self.k * c,), dtype) for _ in range(vectors)] \
            if self.k > 1 else []

    def rows(self, *maps) -> list | None:
        """The maps as [M/k, k*C] views, or None (not all dense, or k = 1)."""
        if self.row_sum is None or not all(m.flags.c_contiguous for m in maps):
            return None
        return [m.reshape(-1, self.k * self.c) for m in maps]

    def tiled(self, ws, i: int, v: np.ndarray) -> np.ndarray:
        """Per-channel ``v`` repeated k times (in tile workspace ``i``), for ``rows`` views."""
        t = ws[self.tiles[i]]
        np.copyto(t.reshape(self.k, self.c), v)
        return t

    def sum(self, ws, out, *maps, rows=False) -> None:
        """out[c] = sum of maps[0] (one map) or of maps[0] * maps[1] (two) over all but c;
        ``rows``: the maps are ``rows`` views."""
        if rows:
            acc = ws[self.row_sum]
            if len(maps) == 1:
                np.add.reduce(maps[0], axis=0, out=acc)
            else:
                np.einsum("rk,rk->k", *maps, out=acc)
            np.add.reduce(acc.reshape(self.k, self.c), axis=0, out=out)
            return
        spec = self.sum_spec if len(maps) == 1 else self.dot_spec
        if self.partial is None:
            np.einsum(spec, *maps, out=out)
            return
        partial = ws[self.partial]
        np.einsum(spec, *maps, out=partial)
        np.add.reduce(partial, axis=0, out=out)


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
    if _batch_norm_training(ctx):
        slots = {"running_mean": 1, "running_var": 2}
        if ctx.since_version < 14:
            slots.update(saved_mean=3, saved_var=4)
        return _batch_norm_training_run(ctx, eps, momentum, False, slots)
    acc = _acc_dtype(dtype)
    c = x_info.shape[c_axis]
    a_ws, b_ws = ctx.workspace((c,), acc), ctx.workspace((c,), acc)

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

    return run_inference


def batch_norm_training_numpy(ctx):
    """ai.tr_onnx BatchNormTraining: (y, saved_mean, saved_inv_std, new_running_mean,
    new_running_var); ``unbiased_running_var`` follows PyTorch's running-variance update."""
    return _batch_norm_training_run(
        ctx, float(ctx.attrs["epsilon"]), float(ctx.attrs["momentum"]),
        bool(ctx.attrs.get("unbiased_running_var", 0)),
        {"saved_mean": 1, "saved_inv_std": 2, "running_mean": 3, "running_var": 4})


def batch_norm_training_shape(node, shapes, dtypes):
    """y like x; the four statistics like running_mean (one value per channel)."""
    c = (shapes[0][BATCH_NORM.channel_axis],)
    stat = dtypes[3] if dtypes[3] is not None else dtypes[0]
    return [(shapes[0], dtypes[0])] + [(c, stat)] * 4


def batch_norm_grad_numpy(ctx):
    """ai.tr_onnx BatchNormGrad(gy, x, scale, mean, inv_std) -> (gx, gscale, gbias).

    xhat = (x - mean) * inv_std; gbias = sum(gy), gscale = sum(gy * xhat) over every axis but
    the channels. ``training=1`` (mean/inv_std are x's batch statistics):
    gx = scale * inv_std * (gy - (gbias + xhat * gscale) / M); ``training=0`` (fixed running
    statistics): gx = scale * inv_std * gy.

    gscale is inv_std * sum(gy * (x - mean)), so xhat is never formed: the centred map is
    built once, in gx itself (a workspace only when gx is absent or narrower than float32),
    and turned into gx in place.

    Synchronised (a ``world`` attribute): gx's two sums and M span every rank's batch (one
    all-reduce), while gscale and gbias stay this rank's -- the gradient all-reduce averages
    them with the other parameters' (``torch.nn.SyncBatchNorm``'s split).
    """
    c_axis = BATCH_NORM.channel_axis
    _check_rank(ctx, c_axis + 1)
    x_info, dtype = ctx.inputs[1], ctx.outputs[0].dtype
    acc = _acc_dtype(dtype)
    c = x_info.shape[c_axis]
    training = bool(ctx.attrs["training"])
    world = _sync_world(ctx) if training else None
    fast = batch_norm_onednn.grad(ctx) if training and world is None else None
    if fast is not None:
        return fast
    in_gx = ctx.has_output(0) and acc == np.dtype(dtype)  # the centred map can live in gx
    t_ws = None if in_gx else ctx.workspace(_channels_last_shape(x_info.shape, c_axis), acc)
    sums_ws, a_ws = ctx.workspace((2 * c + 1,), acc), ctx.workspace((c,), acc)
    k_ws = ctx.workspace((c,), acc)
    # the positions per channel: this rank's part of a synchronised count (0 on a rank with
    # no rows), at least 1 as a count of its own
    positions = int(np.prod(x_info.shape, dtype=np.int64)) // max(c, 1)
    local = max(positions, 1)
    channel = _ChannelSums(ctx, _channels_last_shape(x_info.shape, c_axis), acc, vectors=2)
    has_gscale, has_gbias = ctx.has_output(1), ctx.has_output(2)
    # float16 gy: a float32 copy to sum and combine
    g_ws = ctx.workspace(_channels_last_shape(x_info.shape, c_axis), acc) \
        if acc != np.dtype(ctx.inputs[0].dtype) else None

    def run(ins, outs, ws):
        gy_nhwc, x_nhwc = _channels_last(ins[0], c_axis), _channels_last(ins[1], c_axis)
        scale, mean, inv = ins[2], ins[3], ins[4]
        sums, a, k = ws[sums_ws], ws[a_ws], ws[k_ws]
        gs, gb = sums[:c], sums[c:2 * c]  # [gscale | gbias | rows]: one message synchronised
        gx_nhwc = _channels_last(outs[0], c_axis) if outs[0] is not None else None
        t = gx_nhwc if in_gx else ws[t_ws]
        if g_ws is not None:
            np.copyto(ws[g_ws], gy_nhwc)
            gy_nhwc = ws[g_ws]
        rows = channel.rows(gy_nhwc, x_nhwc, t)
        gy_m, x_m, t_m = rows if rows else (gy_nhwc, x_nhwc, t)
        channel.sum(ws, gb, gy_m, rows=bool(rows))
        np.subtract(x_m, channel.tiled(ws, 0, mean) if rows else mean, out=t_m)
        channel.sum(ws, gs, gy_m, t_m, rows=bool(rows))
        np.multiply(gs, inv, out=gs)
        if has_gscale:
            np.copyto(outs[1], gs, casting="same_kind")
        if has_gbias:
            np.copyto(outs[2], gb, casting="same_kind")
        if gx_nhwc is None:
            return
        np.multiply(scale, inv, out=a)
        if not training:
            np.multiply(gy_nhwc, a, out=gx_nhwc, casting="same_kind")
            return
        count = local
        if world is not None:
            sums[2 * c] = positions
            world.allreduce_sum_(sums)
            count = int(sums[2 * c])
        # gx = a * (gy - gb / M - (x - mean) * inv * gs / M), the centred map t in place
        np.multiply(gs, inv, out=k)
        np.divide(k, count, out=k)
        np.divide(gb, count, out=gb)
        np.multiply(t_m, channel.tiled(ws, 0, k) if rows else k, out=t_m)
        np.add(t_m, channel.tiled(ws, 1, gb) if rows else gb, out=t_m)
        np.subtract(gy_m, t_m, out=t_m)
        np.multiply(t_m, channel.tiled(ws, 0, a) if rows else a, out=t_m)
        if not in_gx:
            np.copyto(gx_nhwc, t, casting="same_kind")

    return run


def _bn_grad(b, x, gy, scale, bias, mean, inv_std, training: int, needed, world=None):
    attrs = {"training": training} if world is None else {"training": training, "world": world}
    gx, gscale, gbias = b.op("BatchNormGrad", [gy, x, scale, mean, inv_std], attrs,
                             domain=INTERNAL_DOMAIN, like=[x, scale, bias])
    return [gx if needed[0] else None, gscale if needed[1] else None,
            gbias if needed[2] else None]


def batch_norm_training_vjp(b, node, gys, needed):
    """Through y only: the saved and running statistics are not differentiated."""
    x, scale, bias = node.inputs[:3]
    if gys[0] is None:
        return [None] * len(node.inputs)
    return _bn_grad(b, x, gys[0], scale, bias, node.outputs[1], node.outputs[2], 1,
                    needed, node.attrs.get("world")) + [None, None]


def batch_norm_vjp(b, node, gys, needed):
    """Inference mode: y = a * x + b with the running statistics (fixed); training mode: the
    batch statistics, recomputed by a BatchNormTraining node (v14+ does not output them)."""
    x, scale, bias, mean, var = node.inputs[:5]
    if gys[0] is None:
        return [None] * len(node.inputs)
    eps = float(node.attrs["epsilon"])
    if node.since_version >= 14:
        training = bool(node.attrs["training_mode"])
    elif node.since_version < 7:
        training = not node.attrs["is_test"]
    else:
        training = any(o is not None for o in node.outputs[1:5])
    if not training:
        inv_std = b.op("Reciprocal", [b.op("Sqrt", [b.add(var, b.scalar_like(eps, var))])])
    else:
        stats = b.op("BatchNormTraining", [x, scale, bias, mean, var],
                     {"epsilon": eps, "momentum": float(node.attrs["momentum"]),
                      "unbiased_running_var": 0},
                     domain=INTERNAL_DOMAIN, like=[x, mean, mean, mean, mean])
        mean, inv_std = stats[1], stats[2]
    return _bn_grad(b, x, gys[0], scale, bias, mean, inv_std, int(training),
                    needed) + [None, None]


# ----------------------------------------------- training form, eval form, export, value bound


def batch_norm_training_form(node, ctx: TrainingContext) -> bool:
    """Training mode whatever mode the model was exported in: a BatchNormTraining normalises
    with the batch's statistics, saves (mean, inv_std) for the gradient and computes the new
    running statistics, which the commit phase assigns (``ctx.commits``). A layer whose scale
    and bias are both frozen stays in inference mode with ``frozen_batchnorm_eval``."""
    graph = ctx.graph
    if node.attrs.get("spatial", 1) != 1 and node.inputs[0].rank > 2:
        raise UnsupportedModelError(f"{node.label}: spatial=0 BatchNormalization cannot "
                                    "be trained", [])
    x, scale, bias, mean, var = node.inputs[:5]
    if ctx.frozen_batchnorm_eval and not any(
            v is not None and v.kind == ir.PARAM and ctx.trains(v) for v in (scale, bias)):
        return False  # frozen layer: inference mode
    stats = (scale, bias, mean, var)
    if x.rank < 2 or any(v is None or v.shape != (x.shape[1],) for v in stats):
        raise UnsupportedModelError(
            f"{node.label}: training needs scale, bias, mean and var of one value per "
            f"channel of x {list(x.shape)}; they are "
            f"{[list(v.shape) if v is not None else None for v in stats]}", [])
    c = (scale.shape[0],)
    outs = list(node.outputs) + [None] * (5 - len(node.outputs))
    y = outs[0]
    saved = [Value(graph.unique_name(f"{node.name}/saved_{k}"), c, x.dtype)
             for k in ("mean", "inv_std")]
    for v in saved:
        graph.values[v.name] = v
    new_stats = []
    for k, old in enumerate(outs[1:3]):
        if old is None or old.shape != c:  # opset < 9 had other optional outputs
            old = Value(graph.unique_name(f"{node.name}/new_running_{k}"), c, x.dtype)
            graph.values[old.name] = old
        new_stats.append(old)
    attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5)),
             "momentum": float(node.attrs.get("momentum", 0.9)),
             "unbiased_running_var": int(ctx.unbiased_running_var)}
    if ctx.sync_world is not None:  # statistics over every rank
        attrs["world"] = ctx.sync_world
    new = ctx.make_node("BatchNormTraining", node.name, [x, scale, bias, mean, var],
                        [y, *saved, *new_stats], attrs)
    graph.replace_node(node, new)
    for stat, v in zip((mean, var), new_stats):
        ctx.commit(stat, v)
    return True


def batch_norm_inference_form(node, graph) -> bool:
    """Exported in training mode: training_mode=0 (the running statistics), and the outputs
    only that mode has dropped where nothing reads them."""
    if not node.attrs.get("training_mode", 0):
        return False
    node.attrs["training_mode"] = 0
    for k in range(1, len(node.outputs)):
        out = node.outputs[k]
        if out is not None and not out.consumers and out not in graph.outputs:
            node.outputs[k] = None
    return True


def batch_norm_export(node, graph, used) -> None:
    """The exported node reads the trained running statistics: training_mode=0, one output
    (unless something reads the others)."""
    for attr in node.attribute:
        if attr.name == "training_mode" and attr.i:
            attr.i = 0
            if not any(o in used for o in node.output[1:]):
                del node.output[1:]


def _is_constant(v) -> bool:
    return v is not None and v.is_constant and v.data is not None


def batch_norm_fold_into_conv(bn, graph) -> bool:
    """Inference plans (``OpDef.inference_fold``): a Conv whose only consumer is this
    BatchNormalization, in inference mode with constant statistics, becomes one Conv with
    per-output-channel scaled weights and a bias, as onnxruntime and PyTorch's
    ``fuse_conv_bn_eval`` fold it: ``w' = w * s``, ``b' = (b - mean) * s + beta`` with
    ``s = gamma / sqrt(var + eps)``, computed in float64 and rounded once to the weights'
    dtype. Returns whether it folded."""
    if int(bn.attrs.get("training_mode", 0)) \
            or any(o is not None and o.consumers for o in bn.outputs[1:]) \
            or any(o in graph.outputs for o in bn.outputs[1:]):
        return False
    y = bn.inputs[0]
    conv = y.producer
    if conv is None or conv.op_type != "Conv" or conv.domain not in ONNX_DOMAINS \
            or y.consumers != [bn] or y in graph.outputs:
        return False
    w = conv.inputs[1]
    b = conv.inputs[2] if len(conv.inputs) > 2 else None
    stats = bn.inputs[1:5]
    if not all(_is_constant(v) for v in (w, *stats)) or (b is not None and not _is_constant(b)) \
            or not np.issubdtype(w.dtype, np.floating) or w.rank < 3:
        return False
    per_channel = (w.shape[0],)
    if any(np.shape(v.data) != per_channel for v in stats) \
            or (b is not None and np.shape(b.data) != per_channel) \
            or len(y.shape) < 2 or y.shape[1] != w.shape[0]:
        return False  # a malformed model: the kernels' shape checks name what is wrong
    gamma, beta, mean, var = (np.asarray(v.data, np.float64) for v in stats)
    s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
    w_data = np.asarray(w.data, np.float64) * s.reshape(-1, *([1] * (w.rank - 1)))
    b_data = (0.0 if b is None else np.asarray(b.data, np.float64)) - mean
    new_w = ir.Value(graph.unique_name(f"{w.name}.bn_folded"), w.shape, w.dtype, ir.CONST,
                     data=w_data.astype(w.dtype))
    graph.values[new_w.name] = new_w
    new_b = ir.Value(graph.unique_name(f"{conv.name}.bias.bn_folded"), (w.shape[0],),
                     w.dtype, ir.CONST, data=(b_data * s + beta).astype(w.dtype))
    graph.values[new_b.name] = new_b
    graph.replace_input(conv, 1, new_w)
    if b is None:
        conv.inputs.append(None)
    graph.replace_input(conv, 2, new_b)
    out = bn.outputs[0]
    graph.remove_node(bn)
    conv.outputs[0] = out
    out.producer = conv
    del graph.values[y.name]
    for v in (w, b, *stats):  # parameters nothing reads any more hold no arena memory
        if v is not None and not v.consumers and v not in graph.outputs \
                and v not in graph.inputs and graph.values.get(v.name) is v:
            del graph.values[v.name]
    return True


def batch_norm_value_bound(node, bound, stats) -> float | None:
    """Inference mode with constant statistics: |y| <= max|scale / sqrt(var + eps)| *
    (|x| + max|mean|) + max|bias|."""
    x = bound(node.inputs[0])
    values = [stats.data(v) for v in node.inputs[1:5]]
    if x is None or any(v is None for v in values) or int(node.attrs.get("training_mode", 0)):
        return None
    gamma, beta, mean, var = values
    scale = np.abs(gamma) / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    return float(np.max(scale)) * (x + stats.max_abs(node.inputs[3])) + stats.max_abs(
        node.inputs[2])


@hookimpl
def tr_onnx_op_definitions():
    def internal(op_type, factory, layout, **kw):
        return OpDef(op_type, (1,), {"numpy": factory}, domain=INTERNAL_DOMAIN, layout=layout,
                     **kw)

    return [
        OpDef("BatchNormalization", (1, 6, 7, 9, 14, 15), {"numpy": batch_norm_numpy},
              layout=BATCH_NORM, differentiable=True, gradient=batch_norm_vjp,
              grad_inputs=(0, 1, 2), param_inputs=(1, 2), training=batch_norm_training_form,
              inference=batch_norm_inference_form, export=batch_norm_export,
              inference_fold=batch_norm_fold_into_conv,
              traits=frozenset({NORMALIZATION, CHANNEL_NORMALIZATION}),
              value_bounds=batch_norm_value_bound),
        # half precision: cuDNN's BatchNorm takes half x/y/dy/dx and float32 per-channel
        # scale, bias, statistics and their gradients
        internal("BatchNormTraining", batch_norm_training_numpy, BATCH_NORM,
                 shape=batch_norm_training_shape, differentiable=True,
                 gradient=batch_norm_training_vjp, grad_inputs=(0, 1, 2),
                 fp32_inputs=(1, 2, 3, 4), fp32_outputs=(1, 2, 3, 4),
                 doc="training-mode BatchNormalization: (y, saved_mean, saved_inv_std, "
                     "new_running_mean, new_running_var)"),
        internal("BatchNormGrad", batch_norm_grad_numpy, BATCH_NORM_GRAD,
                 fp32_inputs=(2, 3, 4), fp32_outputs=(1, 2),
                 doc="(gy, x, scale, mean, inv_std) -> (gx, gscale, gbias)"),
    ]
