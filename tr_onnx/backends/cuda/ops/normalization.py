"""cuda bindings of ``ops/normalization.py``: BatchNormalization with fixed statistics (a
kernel), the training pass's BatchNormTraining / BatchNormGrad (cuDNN graphs; ONNX's running
statistics with the biased variance are a kernel after the graph), LayerNormalization and its
backward LayerNormGrad (``kernels/normalization.cu``)."""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ..bind import (
    INTERNAL,
    BindContext,
    Unbound,
    binding,
    cudnn_binding,
    cudnn_workspace,
    f32,
    float_dt,
    geometry,
    i64,
    need_compact,
    operand_spec,
    out_geometry,
    row_split,
)
from ..device import BLOCK
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain

# ---- kernels/normalization.cu: the family's name table ------------------------------------------

def normalization_source() -> KernelSource:
    """kernels/normalization.cu: LayerNormalization and LayerNormGrad; BatchNormalization's
    inference and running statistics, and synchronised BatchNorm's training kernels."""
    return kernel_source(
        "normalization",
        instantiate("TR_LAYERNORM({T}, {dt})", ("tr_layernorm_fwd_{dt}", "tr_layernorm_bwd_dx_{dt}",
                                                "tr_layernorm_bwd_params_{dt}"), STORAGE),
        instantiate("TR_BATCHNORM({T}, {dt})", (
            "tr_bn_running_{dt}", "tr_bn_infer_{dt}", "tr_bn_sums_{dt}", "tr_bn_normalize_{dt}",
            "tr_bn_grad_sums_{dt}", "tr_bn_grad_dx_{dt}"), STORAGE),
        plain("tr_bn_running_finish", "tr_bn_sum_chunks", "tr_bn_sync_mean",
              "tr_bn_sync_finish", "tr_bn_grad_params"))


KERNELS = normalization_source()


def bind_batch_norm_inference(b: BindContext, node) -> list:
    """BatchNormalization with fixed statistics (inference; training mode is the training
    pass's BatchNormTraining, a cuDNN graph)."""
    outs = [v for v in node.outputs[1:] if v is not None]
    if outs or int(node.attrs.get("training_mode", 0)):
        raise Unbound("training-mode BatchNormalization outside a training plan")
    x, y = node.inputs[0], node.outputs[0]
    gx, gy = geometry(b.t(x)), out_geometry(b, y)
    if gx is None or operand_spec(b.t(x), gx, gy) != gy.n:
        raise Unbound("input and output in different layouts")
    if gy.kind == "channels_last" and b.t(y).layout.kind == "channels_last":
        c, ld = gy.c, gy.cp
    elif gy.kind == "flat" and len(gy.shape) == 2:
        c = ld = gy.shape[1]
    else:
        raise Unbound(f"a {b.t(x).layout.describe()} rank-{len(gy.shape)} input; channels-last "
                       "feature maps and [N, C] are bound")
    params = node.inputs[1:5]
    if any(b.t(v).dtype != np.float32 for v in params):
        raise Unbound("scale, bias, mean and var must be float32")
    return [b.launch(f"tr_bn_infer_{b.dt(x)}", gy.n,
                     [b.buf(x)] + [b.buf(v) for v in params] + [
                         b.buf(y, True), i64(gy.n), i64(c), i64(ld),
                         f32(float(node.attrs.get("epsilon", 1e-5)))])]


BN_TILE = 32
"""Channels per block of the per-chunk sums (``TR_BN_TILE`` in kernels/normalization.cu)."""
BN_BLOCKS = 1024
"""About this many blocks (chunks x channel tiles) in the per-channel sums (the running
statistics', a synchronised BatchNorm's)..."""
BN_MAX_CHUNKS = 256
"""...in at most this many chunks of rows (the finishing kernel's loop per channel)..."""
BN_MIN_ROWS = 64
"""...of at least this many rows (8 per lane)."""


def bn_chunks(rows: int, c: int) -> tuple[int, int]:
    """(chunks, chunk_rows) of the per-channel sums over ``rows`` rows of ``c`` channels:
    fixed by the shape alone, so the summation order is the same every step."""
    tiles = -(-c // BN_TILE)
    target = max(1, min(BN_MAX_CHUNKS, BN_BLOCKS // tiles))
    chunk_rows = max(BN_MIN_ROWS, -(-rows // target))
    return max(1, -(-rows // chunk_rows)), chunk_rows


def _rows_channels(shape) -> tuple[int, int]:
    c = int(shape[1])
    return math.prod(shape) // max(c, 1), c


def bn_training_factory(ctx: KernelContext):
    """BatchNormTraining: cuDNN's training graph; where the node asks for ONNX's running
    statistics (the biased variance), two kernels after it rewrite them, over float64 scratch
    of per-chunk sums of squares (``bn_chunks``)."""
    k = cudnn_workspace(ctx)
    partial_ws = None
    if not ctx.attrs.get("unbiased_running_var", 0) and (ctx.has_output(3)
                                                          or ctx.has_output(4)):
        rows, c = _rows_channels(ctx.inputs[0].shape)
        partial_ws = ctx.workspace((bn_chunks(rows, c)[0], c), np.float64)

    def bind(b: BindContext, node) -> list:
        if "world" in node.attrs:  # never the rank's own statistics in place of the world's
            raise Unbound("sync_batchnorm (batch statistics over every rank) has no cuda "
                          "binding yet; train without sync_batchnorm, or on numpy")
        calls = b.cudnn(node, k)
        return calls + bn_running(b, node, calls[0].desc, partial_ws)

    return bind


def bn_running(b: BindContext, node, desc, partial_ws: int | None) -> list:
    """ONNX's running statistics (biased variance): rewritten after cuDNN's batchnorm, whose
    own update uses the unbiased variance, from x, the batch mean cuDNN saved and the old
    values (inputs of the graph, unchanged by it) -- unless the node asks for PyTorch's
    unbiased convention, which is cuDNN's. Per-chunk sums of (x - mean)^2 (one block per chunk
    of rows and 32 channels) into ``partial_ws``, then one thread per channel adds them in
    order."""
    if not desc.notes:
        return []
    outs = node.outputs
    if not any(i < len(outs) and outs[i] is not None for i in (3, 4)):
        return []
    if any(i >= len(outs) or outs[i] is None for i in (1, 3, 4)):
        raise Unbound("running statistics need the saved mean and both running outputs")
    x = node.inputs[0]
    gx = geometry(b.t(x))
    if gx is None or gx.kind != "channels_last":
        raise Unbound("the running-statistics kernel reads a channels-last x")
    for v in (node.inputs[3], node.inputs[4], outs[1], outs[3], outs[4]):
        if b.t(v).dtype != np.float32:
            raise Unbound(f"{v.name!r} must be float32")
    rows, c = gx.n // gx.cp, gx.c
    chunks, chunk_rows = bn_chunks(rows, c)
    if partial_ws is None or b.workspaces[partial_ws].shape != (chunks, c):
        raise Unbound(f"no scratch of {chunks} x {c} partial sums was reserved")
    momentum = float(node.attrs.get("momentum", 0.9))
    return [b.launch(f"tr_bn_running_{b.dt(x)}", chunks * -(-c // BN_TILE) * BLOCK,
                     [b.buf(x), b.buf(outs[1]), b.ws(partial_ws), i64(rows), i64(c),
                      i64(gx.cp), i64(chunks), i64(chunk_rows)]),
            b.launch("tr_bn_running_finish", c,
                     [b.ws(partial_ws, writes=False), b.buf(outs[1]), b.buf(node.inputs[3]),
                      b.buf(node.inputs[4]), b.buf(outs[3], True), b.buf(outs[4], True),
                      i64(rows), i64(c), i64(chunks), f32(momentum), f32(1.0 - momentum),
                      f32(1.0 - momentum)])]


def bind_layer_norm(b: BindContext, node) -> list:
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    outs = list(node.outputs) + [None, None]
    y, mean, inv = outs[0], outs[1], outs[2]
    need_compact(b, x, scale, bias, y, mean, inv)
    rows, m = row_split(node, b.t(x).shape, False)
    for v in (scale, bias):
        if v is not None and math.prod(b.t(v).shape) != m:
            raise Unbound("a scale or bias that broadcasts over the normalised axes")
    for v in (mean, inv):
        if v is not None and b.t(v).dtype != np.float32:
            raise Unbound("Mean / InvStdDev outputs must be float32")
    dt = float_dt(b, x, scale, bias, y)
    return [b.launch(f"tr_layernorm_fwd_{dt}", rows,
                     [b.buf(x), b.buf(scale), b.buf(bias), b.buf(y, True), b.buf(mean, True),
                      b.buf(inv, True), i64(rows), i64(m),
                      f32(float(node.attrs.get("epsilon", 1e-5)))])]


def _layer_norm_rows(shape, axis: int) -> tuple[int, int]:
    axis %= len(shape)
    return math.prod(shape[:axis]), math.prod(shape[axis:])


def layer_norm_grad_factory(ctx: KernelContext):
    """LayerNormGrad: the dx kernel recomputes each row's mean and inverse deviation into
    two float32 scratch vectors, which the parameter-gradient kernel then reads."""
    rows, _ = _layer_norm_rows(ctx.inputs[1].shape, int(ctx.attrs["axis"]))
    mean_ws = ctx.workspace((rows,), np.float32)
    inv_ws = ctx.workspace((rows,), np.float32)

    def bind(b: BindContext, node) -> list:
        gy, x, scale = node.inputs[:3]
        outs = list(node.outputs) + [None, None]
        gx, gscale, gbias = outs[0], outs[1], outs[2]
        need_compact(b, gy, x, scale, gx, gscale, gbias)
        rows, m = _layer_norm_rows(b.t(x).shape, int(node.attrs["axis"]))
        dt = float_dt(b, gy, x, scale, gx, gscale, gbias)
        mean, inv = b.ws(mean_ws), b.ws(inv_ws)
        calls = [b.launch(f"tr_layernorm_bwd_dx_{dt}", rows,
                          [b.buf(gy), b.buf(x), b.buf(scale), b.buf(gx, True), mean, inv,
                           i64(rows), i64(m), f32(float(node.attrs["epsilon"]))])]
        if gscale is not None or gbias is not None:
            calls.append(b.launch(f"tr_layernorm_bwd_params_{dt}", m,
                                  [b.buf(gy), b.buf(x), b.ws(mean_ws, writes=False),
                                   b.ws(inv_ws, writes=False), b.buf(gscale, True),
                                   b.buf(gbias, True), i64(rows), i64(m)]))
        return calls

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("BatchNormalization", "cuda", binding(bind_batch_norm_inference)),
            KernelDef("BatchNormTraining", "cuda", bn_training_factory, domain=INTERNAL),
            KernelDef("BatchNormGrad", "cuda", cudnn_binding(), domain=INTERNAL),
            KernelDef("LayerNormalization", "cuda", binding(bind_layer_norm)),
            KernelDef("LayerNormGrad", "cuda", layer_norm_grad_factory, domain=INTERNAL)]
