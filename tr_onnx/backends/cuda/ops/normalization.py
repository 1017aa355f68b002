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
    f32,
    float_dt,
    geometry,
    i64,
    need_compact,
    operand_spec,
    out_geometry,
    row_split,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source

# ---- kernels/normalization.cu: the family's name table ------------------------------------------

def normalization_source() -> KernelSource:
    """kernels/normalization.cu: LayerNormalization and LayerNormGrad; BatchNormalization's
    inference and running statistics."""
    return kernel_source(
        "normalization",
        instantiate("TR_LAYERNORM({T}, {dt})", ("tr_layernorm_fwd_{dt}", "tr_layernorm_bwd_dx_{dt}",
                                                "tr_layernorm_bwd_params_{dt}"), STORAGE),
        instantiate("TR_BATCHNORM({T}, {dt})", ("tr_bn_running_{dt}", "tr_bn_infer_{dt}"),
                    STORAGE))


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


def bn_running(b: BindContext, node, desc) -> list:
    """ONNX's running statistics (biased variance): rewritten after cuDNN's batchnorm, whose
    own update uses the unbiased variance, from x, the batch mean cuDNN saved and the old
    values (inputs of the graph, unchanged by it) -- unless the node asks for PyTorch's
    unbiased convention, which is cuDNN's."""
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
    momentum = float(node.attrs.get("momentum", 0.9))
    return [b.launch(f"tr_bn_running_{b.dt(x)}", gx.c,
                     [b.buf(x), b.buf(outs[1]), b.buf(node.inputs[3]), b.buf(node.inputs[4]),
                      b.buf(outs[3], True), b.buf(outs[4], True), i64(gx.n // gx.cp),
                      i64(gx.c), i64(gx.cp), f32(momentum), f32(1.0 - momentum),
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
            KernelDef("BatchNormTraining", "cuda", cudnn_binding(then=bn_running),
                      domain=INTERNAL),
            KernelDef("BatchNormGrad", "cuda", cudnn_binding(), domain=INTERNAL),
            KernelDef("LayerNormalization", "cuda", binding(bind_layer_norm)),
            KernelDef("LayerNormGrad", "cuda", layer_norm_grad_factory, domain=INTERNAL)]
