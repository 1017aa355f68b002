"""cuda bindings of ``ops/normalization.py``: BatchNormalization with fixed statistics (a
kernel), the training pass's BatchNormTraining / BatchNormGrad (cuDNN graphs, described here:
``describe_batchnorm``, ``describe_batchnorm_backward``; ONNX's running statistics with the
biased variance are a kernel after the graph), LayerNormalization and its backward
LayerNormGrad, Instance/GroupNormalization and their backward GroupNormGrad,
MeanVarianceNormalization and LpNormalization (``kernels/normalization.cu``; MVN and
LpNormalization differentiate through standard ops, the reduce and elementwise families').

Instance/Group normalization reads [N, S, C] maps (``map_strides``: channels-last or compact,
each operand by its own strides) with one block per (sample, group): fp64 lane sums folded in a
fixed order (deterministic), the mean and then the centred sum of squares, as the NumPy
kernels' two passes. MVN and LpNormalization reduce any axes the same way, one block per index
of the kept axes.

A synchronised BatchNorm (``sync_batchnorm``: the node carries a ``world`` attribute) is no
cuDNN graph: its per-channel sums are kernels, and NCCL all-reduces them between the kernels
(``nccl.NcclAllReduce`` on the step's stream, captured with the step like the gradient
all-reduce), as the NumPy kernels' MPI all-reduces: forward [sum x | rows], then the sums of
(x - mean)^2; backward [sum gy (x - mean) | sum gy | rows]. The sums are fp64 per-chunk
partials added in an order fixed by the shape (``bn_chunks``), so a step is deterministic.
The saved statistics are cuDNN's (mean and 1 / sqrt(var + eps), float32), so either
BatchNormGrad reads either forward's."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....memory import ALIGN, MemoryPlan
from ....opdef import KernelContext, KernelDef
from ..bind import (
    BindContext,
    Unbound,
    binding,
    collapse,
    cudnn_binding,
    cudnn_workspace,
    f32,
    f64,
    float_dt,
    geometry,
    i32,
    i64,
    logical_strides,
    need_compact,
    operand_spec,
    out_geometry,
    row_split,
    same_layout,
)
from ..cudnn_graphs import (
    CudnnGraph,
    CudnnGraphError,
    GraphDesc,
    PlanIndex,
    ScalarDesc,
    channel_vector,
    describe_node,
    feature_map,
)
from ..device import BLOCK
from ..nccl import NCCL_SUM, nccl_dtype, node_all_reduce
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain

# ---- kernels/normalization.cu: the family's name table ------------------------------------------

def normalization_source() -> KernelSource:
    """kernels/normalization.cu: LayerNormalization and LayerNormGrad; BatchNormalization's
    inference and running statistics, and synchronised BatchNorm's training kernels;
    Instance/GroupNormalization and GroupNormGrad; MeanVarianceNormalization and
    LpNormalization."""
    return kernel_source(
        "normalization",
        instantiate("TR_LAYERNORM({T}, {dt})", ("tr_layernorm_fwd_{dt}", "tr_layernorm_bwd_dx_{dt}",
                                                "tr_layernorm_bwd_params_{dt}"), STORAGE),
        instantiate("TR_BATCHNORM({T}, {dt})", (
            "tr_bn_running_{dt}", "tr_bn_infer_{dt}", "tr_bn_sums_{dt}", "tr_bn_normalize_{dt}",
            "tr_bn_grad_sums_{dt}", "tr_bn_grad_dx_{dt}"), STORAGE),
        plain("tr_bn_running_finish", "tr_bn_sum_chunks", "tr_bn_sync_mean",
              "tr_bn_sync_finish", "tr_bn_grad_params"),
        instantiate("TR_GROUPNORM({T}, {dt})", (
            "tr_groupnorm_fwd_{dt}", "tr_groupnorm_bwd_dx_{dt}", "tr_groupnorm_bwd_params_{dt}"),
            STORAGE),
        instantiate("TR_AXES_NORM({T}, {dt})", ("tr_mvn_{dt}", "tr_lp_norm_{dt}"), STORAGE))


KERNELS = normalization_source()


# ---- cuDNN graphs: batchnorm, batchnorm_backward ----------------------------------------------

def describe_batchnorm(node, plan: MemoryPlan, workspace: tuple[int, int]) -> GraphDesc:
    """BatchNormTraining(x, scale, bias, running_mean, running_var) -> (y, saved_mean,
    saved_inv_std, new_running_mean, new_running_var).

    cuDNN's running update is ``next = (1 - m) * prev + m * batch`` with the unbiased batch
    variance; ONNX's momentum is the weight of the old value (so m = 1 - momentum) and its
    variance is the biased one. The graph always declares the running statistics (the
    frontend requires them); where the node asks for ONNX's biased variance the backend then
    rewrites the next running statistics from x, saved_mean and the old values with its own
    kernel (``notes`` says so); PyTorch's unbiased convention is cuDNN's own.
    """
    index = PlanIndex(plan)
    t = plan.tensors
    x, scale, bias = (t[v.name] for v in node.inputs[:3])
    y = t[node.outputs[0].name]
    rank = len(x.shape)
    xd = feature_map(index, x, "input", True, node.label)
    c = xd.dims[1]
    ins = {"input": xd,
           "scale": channel_vector(index, scale, "scale", rank, c, node.label),
           "bias": channel_vector(index, bias, "bias", rank, c, node.label)}
    outs = {"Y": feature_map(index, y, "Y", True, node.label)}
    for port, i in (("mean", 1), ("inv_var", 2)):
        if node.outputs[i] is not None:
            outs[port] = channel_vector(index, t[node.outputs[i].name], port, rank, c, node.label)
    momentum = float(node.attrs.get("momentum", 0.9))
    unbiased = bool(node.attrs.get("unbiased_running_var", 0))
    scalars = {"epsilon": ScalarDesc("epsilon", float(node.attrs.get("epsilon", 1e-5))),
               "momentum": ScalarDesc("momentum", 1.0 - momentum)}
    # frontend 1.32's batchnorm() requires the running statistics (omitting them is a
    # TypeError at validate()); its update uses the unbiased batch variance
    for port, i in (("in_running_mean", 3), ("in_running_var", 4)):
        ins[port] = channel_vector(index, t[node.inputs[i].name], port, rank, c, node.label)
    for port, i in (("next_running_mean", 3), ("next_running_var", 4)):
        if node.outputs[i] is not None:
            outs[port] = channel_vector(index, t[node.outputs[i].name], port, rank, c, node.label)
    notes = []
    if not unbiased:
        notes.append("running statistics use the biased batch variance (ONNX): the backend "
                     "rewrites cuDNN's (unbiased) update from saved_mean and the old values")
    if xd.dims != outs["Y"].dims:
        raise CudnnGraphError(f"{node.label}: x dims {list(xd.dims)} and y dims "
                              f"{list(outs['Y'].dims)} differ")
    return GraphDesc("batchnorm", node.label, xd.data_type, ins, outs, scalars=scalars,
                     notes=tuple(notes), build=build_batchnorm)


def describe_batchnorm_backward(node, plan: MemoryPlan,
                                workspace: tuple[int, int]) -> GraphDesc:
    """BatchNormGrad(gy, x, scale, mean, inv_std) -> (gx, gscale, gbias), training=1 only:
    with fixed running statistics (training=0) gx is a per-channel scale, an elementwise kernel."""
    if not int(node.attrs.get("training", 1)):
        raise CudnnGraphError(f"{node.label}: training=0 (fixed statistics) is a per-channel "
                              "scale of gy; it has no cuDNN batchnorm_backward graph")
    index = PlanIndex(plan)
    t = plan.tensors
    gy, x, scale, mean, inv_std = (t[v.name] for v in node.inputs[:5])
    rank = len(x.shape)
    xd = feature_map(index, x, "input", True, node.label)
    c = xd.dims[1]
    ins = {"grad": feature_map(index, gy, "grad", True, node.label), "input": xd,
           "scale": channel_vector(index, scale, "scale", rank, c, node.label),
           "mean": channel_vector(index, mean, "mean", rank, c, node.label),
           "inv_variance": channel_vector(index, inv_std, "inv_variance", rank, c, node.label)}
    outs = {}
    for port, i in (("DX", 0), ("DScale", 1), ("DBias", 2)):
        v = node.outputs[i] if i < len(node.outputs) else None
        if v is None:
            continue
        outs[port] = (feature_map(index, t[v.name], port, True, node.label) if i == 0
                      else channel_vector(index, t[v.name], port, rank, c, node.label))
    if ins["grad"].dims != xd.dims or ("DX" in outs and outs["DX"].dims != xd.dims):
        raise CudnnGraphError(f"{node.label}: gy, x and gx dims differ")
    return GraphDesc("batchnorm_backward", node.label, xd.data_type, ins, outs,
                     build=build_batchnorm_backward)


def build_batchnorm(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    """The frontend calls of the ``batchnorm`` graph."""
    running = {k: ins[k] for k in ("in_running_mean", "in_running_var") if k in ins}
    y, mean, inv_var, next_mean, next_var = g.batchnorm(
        input=ins["input"], scale=ins["scale"], bias=ins["bias"], epsilon=scalars["epsilon"],
        momentum=scalars["momentum"], peer_stats=[], name="bn", **running)
    return {"Y": y, "mean": mean, "inv_var": inv_var, "next_running_mean": next_mean,
            "next_running_var": next_var}


def build_batchnorm_backward(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    """The frontend calls of the ``batchnorm_backward`` graph."""
    dx, dscale, dbias = g.batchnorm_backward(
        grad=ins["grad"], input=ins["input"], scale=ins["scale"], mean=ins["mean"],
        inv_variance=ins["inv_variance"], peer_stats=[], name="dbn")
    return {"DX": dx, "DScale": dscale, "DBias": dbias}


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
    of per-chunk sums of squares (``bn_chunks``). Synchronised (a ``world`` attribute):
    ``bind_sync_bn_training``, no cuDNN."""
    if "world" in ctx.attrs:
        rows, c = _rows_channels(ctx.inputs[0].shape)
        sync_ws = (ctx.workspace((bn_chunks(rows, c)[0], c), np.float64),
                   ctx.workspace((c + 1,), np.float64), ctx.workspace((c,), np.float64))
        return lambda b, node: bind_sync_bn_training(b, node, *sync_ws)
    k = cudnn_workspace(ctx)
    partial_ws = None
    if not ctx.attrs.get("unbiased_running_var", 0) and (ctx.has_output(3)
                                                          or ctx.has_output(4)):
        rows, c = _rows_channels(ctx.inputs[0].shape)
        partial_ws = ctx.workspace((bn_chunks(rows, c)[0], c), np.float64)

    def bind(b: BindContext, node) -> list:
        calls = b.cudnn(node, k)
        return calls + bn_running(b, node, calls[0].desc, partial_ws)

    return bind


def bn_grad_factory(ctx: KernelContext):
    """BatchNormGrad: cuDNN's backward graph; synchronised (a ``world`` attribute, training
    statistics): ``bind_sync_bn_grad``, over float64 scratch of per-chunk sums of gy (x - mean)
    and gy, and their totals with the row count."""
    if "world" in ctx.attrs and int(ctx.attrs.get("training", 1)):
        rows, c = _rows_channels(ctx.inputs[1].shape)
        sync_ws = (ctx.workspace((bn_chunks(rows, c)[0], 2 * c), np.float64),
                   ctx.workspace((2 * c + 1,), np.float64))
        return lambda b, node: bind_sync_bn_grad(b, node, *sync_ws)
    x_info, gx_info = ctx.inputs[1], ctx.outputs[0]
    if gx_info is None or x_info.layout.kind == gx_info.layout.kind:
        return cudnn_binding()(ctx)
    # cuDNN's backward graph takes x, dy and dx in one layout; a compact x beside a
    # channels-last dx (tf2onnx's NCHW BatchNorm between Transposes, its gradient from a
    # channels-last Conv) is padded into a copy laid out as dx first
    if gx_info.layout.kind != "channels_last":
        raise ctx.error("BatchNormGrad of a channels-last x into a compact dx: cuDNN's graph "
                        "takes them in one layout")
    k = cudnn_workspace(ctx)
    copy_ws = ctx.workspace(tuple(gx_info.layout.phys_shape), x_info.dtype)

    def bind(b: BindContext, node) -> list:
        x, gx = node.inputs[1], node.outputs[0]
        g = geometry(b.t(gx))
        dt = float_dt(b, x, gx)
        copy = b.workspaces[copy_ws]

        def describe(node, plan, workspace):
            desc = describe_node(node, plan, workspace=workspace)
            dx = desc.outputs["DX"]
            desc.inputs["input"] = dataclasses.replace(
                dx, name=copy.name, byte_offset=copy.offset,
                alignment=ALIGN, slot_bytes=copy.nbytes,  # arena offsets: multiples of 256
                region="WORKSPACE")
            return desc

        return [b.launch(f"tr_pad_nhwc_{dt}_{dt}", g.n,
                         [b.buf(x), b.ws(copy_ws), i64(g.n), i64(g.c), i64(g.s), i64(g.cp)]),
                *b.cudnn(node, k, describe=describe)]

    return bind


def _sync_geometry(b: BindContext, x, *maps) -> tuple[int, int, int]:
    """(rows, c, ld) of a synchronised BatchNorm's channels-last feature map ``x`` (rows of
    ld = Cp lanes), which ``maps`` (y, gy, gx) share."""
    g = geometry(b.t(x))
    if g is None or g.kind != "channels_last" or b.t(x).layout.kind != "channels_last":
        raise Unbound(f"a {b.t(x).layout.describe()} input; the per-channel kernels read a "
                      "channels-last feature map")
    for v in maps:
        if v is not None:
            same_layout(b, x, v)
    return g.n // g.cp, g.c, g.cp


def _need_float32(b: BindContext, *vs) -> None:
    for v in vs:
        if v is not None and b.t(v).dtype != np.float32:
            raise Unbound(f"{v.name!r} must be float32 (the per-channel vectors are)")


def _sync_sums(b: BindContext, node, sums: int, count: int):
    """The in-place NCCL sum over the node's world of the first ``count`` float64 values of
    scratch buffer ``sums``."""
    return node_all_reduce(b, node, b.ws(sums), count, nccl_dtype(np.float64), NCCL_SUM)


def _chunk_sums(b: BindContext, name: str, inputs: list, rows_c_ld: tuple[int, int, int],
                partial: int, out: int, width: int, n: int) -> list:
    """Per-chunk sums kernel ``name`` over ``inputs`` into scratch ``partial`` [chunks, width]
    (one block per chunk and 32 channels), then ``tr_bn_sum_chunks``: their totals into the
    first ``n`` values of scratch ``out`` (the row count last when ``n > width``)."""
    rows, c, ld = rows_c_ld
    chunks, chunk_rows = bn_chunks(rows, c)
    if b.workspaces[partial].shape != (chunks, width):
        raise Unbound(f"no scratch of {chunks} x {width} partial sums was reserved")
    return [b.launch(name, chunks * -(-c // BN_TILE) * BLOCK,
                     [*inputs, b.ws(partial), i64(rows), i64(c), i64(ld), i64(chunks),
                      i64(chunk_rows)]),
            b.launch("tr_bn_sum_chunks", n, [b.ws(partial, writes=False), b.ws(out), i64(width),
                                             i64(chunks), i64(n), i64(rows)])]


def bind_sync_bn_training(b: BindContext, node, partial: int, sums: int, sq: int) -> list:
    """BatchNormTraining over the world's batch, as the NumPy kernel's two passes: [sum x |
    rows] all-reduced into the mean (the saved mean), then the sums of (x - mean)^2
    all-reduced into the biased variance: the saved 1 / sqrt(var + eps), the running
    statistics (momentum; PyTorch's count / (count - 1) with ``unbiased_running_var``, the
    world's count), and y. Scratch: ``partial`` [chunks, c], ``sums`` [c + 1], ``sq`` [c]
    (float64)."""
    x, scale, bias, rm, rv = node.inputs[:5]
    y, mean, inv, new_rm, new_rv = (list(node.outputs) + [None] * 5)[:5]
    if mean is None or inv is None:
        raise Unbound("a synchronised BatchNorm writes the saved mean and inv_std")
    _need_float32(b, scale, bias, rm, rv, mean, inv, new_rm, new_rv)
    rows, c, ld = shape = _sync_geometry(b, x, y)
    dt = float_dt(b, x, y)
    momentum = float(node.attrs.get("momentum", 0.9))
    n = rows * ld
    return [*_chunk_sums(b, f"tr_bn_sums_{dt}", [b.buf(x)], shape, partial, sums, c, c + 1),
            _sync_sums(b, node, sums, c + 1),
            b.launch("tr_bn_sync_mean", c, [b.ws(sums, writes=False), b.buf(mean, True), i64(c)]),
            *_chunk_sums(b, f"tr_bn_running_{dt}", [b.buf(x), b.buf(mean)], shape, partial, sq,
                         c, c),
            _sync_sums(b, node, sq, c),
            b.launch("tr_bn_sync_finish", c, [
                b.ws(sums, writes=False), b.ws(sq, writes=False), b.buf(mean), b.buf(rm),
                b.buf(rv), b.buf(inv, True), b.buf(new_rm, True), b.buf(new_rv, True), i64(c),
                f32(momentum), f32(1.0 - momentum), f64(1.0 - momentum),
                i32(int(node.attrs.get("unbiased_running_var", 0))),
                f32(float(node.attrs.get("epsilon", 1e-5)))]),
            b.launch(f"tr_bn_normalize_{dt}", n, [
                b.buf(x), b.buf(scale), b.buf(bias), b.buf(mean), b.buf(inv), b.buf(y, True),
                i64(n), i64(c), i64(ld)])]


def bind_sync_bn_grad(b: BindContext, node, partial: int, sums: int) -> list:
    """BatchNormGrad (training statistics) over the world's batch, as the NumPy kernel and
    ``torch.nn.SyncBatchNorm``: gscale and gbias are this rank's sums (the gradient
    all-reduce averages them), gx reads [sum gy (x - mean) | sum gy | rows] all-reduced.
    Scratch: ``partial`` [chunks, 2c], ``sums`` [2c + 1] (float64)."""
    gy, x, scale, mean, inv = node.inputs[:5]
    gx, gscale, gbias = (list(node.outputs) + [None] * 3)[:3]
    _need_float32(b, scale, mean, inv, gscale, gbias)
    rows, c, ld = shape = _sync_geometry(b, x, gy, gx)
    dt = float_dt(b, gy, x, gx)
    calls = _chunk_sums(b, f"tr_bn_grad_sums_{dt}", [b.buf(gy), b.buf(x), b.buf(mean)], shape,
                        partial, sums, 2 * c, 2 * c + 1)
    if gscale is not None or gbias is not None:
        calls.append(b.launch("tr_bn_grad_params", c, [
            b.ws(sums, writes=False), b.buf(inv), b.buf(gscale, True), b.buf(gbias, True),
            i64(c)]))
    if gx is None:  # the NumPy kernel's sums stay local then too
        return calls
    n = rows * ld
    return calls + [_sync_sums(b, node, sums, 2 * c + 1),
                    b.launch(f"tr_bn_grad_dx_{dt}", n, [
                        b.buf(gy), b.buf(x), b.buf(scale), b.buf(mean), b.buf(inv),
                        b.ws(sums, writes=False), b.buf(gx, True), i64(n), i64(c), i64(ld)])]


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
    _need_float32(b, node.inputs[3], node.inputs[4], outs[1], outs[3], outs[4])
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


# ---- Instance / Group normalization ----------------------------------------------------------

def map_strides(b: BindContext, v) -> tuple[int, int, int, int, int, int, int]:
    """(n, s, c, cp, sn, ss, sc) of a [N, C, *S] tensor as the [N, S, C] map the Instance /
    Group / LRN kernels index: S the spatial axes flattened, element strides of a sample, a
    position and a channel (channels-last [N, *S, Cp]: (S * Cp, Cp, 1); compact NCHW:
    (C * S, 1, S)), cp the channel lanes a position holds (the padded count, or c)."""
    shape = b.t(v).shape
    if len(shape) < 2:
        raise Unbound(f"a rank-{len(shape)} input; [N, C, *S] is normalised")
    st = logical_strides(b, v)
    n, c, spatial = int(shape[0]), int(shape[1]), [int(d) for d in shape[2:]]
    ss = st[-1] if spatial else 1
    if any(st[2 + k] != ss * math.prod(spatial[k + 1:]) for k in range(len(spatial))):
        raise Unbound(f"{v.name!r}: spatial axes that do not flatten to one stride")
    g = geometry(b.t(v))
    cp = g.cp if g.kind == "channels_last" else c
    return n, math.prod(spatial), c, cp, st[0], ss, st[1]


def map_args(b: BindContext, v) -> list:
    """``TR_MAP_ARGS``: the element strides (sn, ss, sc) of ``v``'s [N, S, C] map."""
    return [i64(k) for k in map_strides(b, v)[4:]]


def map_lanes(b: BindContext, v) -> int:
    """The channel lanes of a position of ``v``'s [N, S, C] map (padded, or C)."""
    return map_strides(b, v)[3]


def _group_norm_form(b: BindContext, node) -> tuple[int, int, float]:
    """(groups, channels per scale/bias entry, epsilon) of an Instance/GroupNormalization or
    GroupNormGrad node whose kernels take it."""
    x = node.inputs[1] if node.op_type == "GroupNormGrad" else node.inputs[0]
    c = int(b.t(x).shape[1])
    eps = float(node.attrs["epsilon"])
    if node.op_type == "InstanceNormalization":
        return c, 1, eps
    groups = int(node.attrs["num_groups"])
    if groups <= 0 or c % groups:
        raise Unbound(f"{c} channels cannot be split into {groups} groups")
    per_group = bool(node.attrs["per_group_params"]) if node.op_type == "GroupNormGrad" \
        else node.since_version < 21
    if node.op_type == "GroupNormalization" and node.since_version >= 21 and \
            int(node.attrs["stash_type"]) != 1:
        raise Unbound("a stash_type other than float32 (the kernels compute in float32)")
    n, c_s = int(b.t(x).shape[0]), math.prod(b.t(x).shape[1:])
    if n * c_s >= 1 << 32:
        raise Unbound("2^32 elements or more (the kernels index a batch with 32-bit division)")
    return groups, c // groups if per_group else 1, eps


def bind_group_norm(b: BindContext, node) -> list:
    """InstanceNormalization and GroupNormalization (18: one scale/bias per group, 21: per
    channel): ``tr_groupnorm_fwd``, one block per (sample, group), over channels-last or
    compact maps (y's padded lanes written 0)."""
    x, scale, bias = node.inputs[:3]
    y = node.outputs[0]
    need_compact(b, scale, bias)
    groups, per_param, eps = _group_norm_form(b, node)
    n, s, c, *_ = map_strides(b, x)
    dt = float_dt(b, x, scale, bias, y)
    return [b.launch(f"tr_groupnorm_fwd_{dt}", n * groups * BLOCK, [
        b.buf(x), b.buf(scale), b.buf(bias), b.buf(y, True), i64(n), i64(s), i64(c),
        i64(c // groups), i64(per_param), f32(eps), *map_args(b, x), *map_args(b, y),
        i64(map_lanes(b, y))])]


def group_norm_grad_factory(ctx: KernelContext):
    """GroupNormGrad: ``tr_groupnorm_bwd_dx`` (one block per (sample, group)) recomputes each
    unit's mean and inverse deviation into two float32 scratch vectors, which
    ``tr_groupnorm_bwd_params`` (one block per scale entry) then reads. gy, x and gx may be
    laid out differently (each kernel reads each by its own strides)."""
    units = int(ctx.inputs[1].shape[0]) * int(ctx.attrs["num_groups"])
    mean_ws = ctx.workspace((units,), np.float32)
    inv_ws = ctx.workspace((units,), np.float32)

    def bind(b: BindContext, node) -> list:
        gy, x, scale = node.inputs[:3]
        gx, gscale, gbias = (list(node.outputs) + [None] * 3)[:3]
        need_compact(b, scale, gscale, gbias)
        groups, per_param, eps = _group_norm_form(b, node)
        n, s, c, *_ = map_strides(b, x)
        dt = float_dt(b, gy, x, scale, gx, gscale, gbias)
        shape = (n, s, c, c // groups, per_param)
        gx_map = [*map_args(b, gx), i64(map_lanes(b, gx))] if gx is not None \
            else [i64(0)] * 4
        calls = [b.launch(f"tr_groupnorm_bwd_dx_{dt}", n * groups * BLOCK, [
            b.buf(gy), b.buf(x), b.buf(scale), b.buf(gx, True), b.ws(mean_ws), b.ws(inv_ws),
            *map(i64, shape), f32(eps), *map_args(b, x), *map_args(b, gy), *gx_map])]
        lanes = {b.t(v).layout.phys_shape[0] for v in (gscale, gbias) if v is not None}
        if len(lanes) > 1:
            raise Unbound("gscale and gbias padded differently")
        for count in lanes:  # their padded lanes are written 0 too
            calls.append(b.launch(f"tr_groupnorm_bwd_params_{dt}", count * BLOCK, [
                b.buf(gy), b.buf(x), b.ws(mean_ws, writes=False), b.ws(inv_ws, writes=False),
                b.buf(gscale, True), b.buf(gbias, True), *map(i64, shape), i64(count),
                *map_args(b, x), *map_args(b, gy)]))
        return calls

    return bind


# ---- MeanVarianceNormalization, LpNormalization ---------------------------------------------

def _axes_split(b: BindContext, x, y, axes: list[int]) -> tuple[list, list]:
    """[units, m] and the (dims, strides) of the kept then the reduced axes of ``x`` (laid
    out as ``y``), collapsed for ``TR_AXES_SPLIT``; y's padded lanes need zeroing after."""
    same_layout(b, x, y)
    shape, st = b.t(x).shape, logical_strides(b, x)
    kept = [a for a in range(len(shape)) if a not in axes]
    args, counts = [], []
    for group in (kept, axes):
        dims, (strides,) = collapse([shape[a] for a in group], [[st[a] for a in group]])
        counts.append(math.prod(shape[a] for a in group))
        args += [*map(i64, dims), *map(i64, strides)]
    return [i64(k) for k in counts], args


def _zero_pads(b: BindContext, y) -> list:
    g = out_geometry(b, y)
    return [b.zero_lanes(y, g)] if g.padded else []


def bind_mvn(b: BindContext, node) -> list:
    """MeanVarianceNormalization over ``axes`` (any set, any layout ``logical_strides``
    reads): ``tr_mvn``, one block per kept index."""
    x, y = node.inputs[0], node.outputs[0]
    rank = len(b.t(x).shape)
    axes = sorted({int(a) % rank for a in node.attrs["axes"]})
    counts, split = _axes_split(b, x, y, axes)
    return [b.launch(f"tr_mvn_{float_dt(b, x, y)}", int(counts[0]) * BLOCK,
                     [b.buf(x), b.buf(y, True), *counts, *split]), *_zero_pads(b, y)]


def bind_lp_norm(b: BindContext, node) -> list:
    """LpNormalization (p = 1 or 2) along ``axis``: ``tr_lp_norm``, one block per row."""
    x, y = node.inputs[0], node.outputs[0]
    rank = len(b.t(x).shape)
    axis, p = int(node.attrs["axis"]), int(node.attrs["p"])
    if not -rank <= axis < rank or p not in (1, 2):
        raise Unbound(f"axis {axis} of a rank-{rank} input with p = {p}")
    counts, split = _axes_split(b, x, y, [axis % rank])
    return [b.launch(f"tr_lp_norm_{float_dt(b, x, y)}", int(counts[0]) * BLOCK,
                     [b.buf(x), b.buf(y, True), *counts, i32(p), *split]), *_zero_pads(b, y)]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("BatchNormalization", "cuda", binding(bind_batch_norm_inference)),
            KernelDef("BatchNormTraining", "cuda", CudnnGraph(
                describe_batchnorm, binding=bn_training_factory), domain=INTERNAL_DOMAIN),
            KernelDef("BatchNormGrad", "cuda", CudnnGraph(
                describe_batchnorm_backward, binding=bn_grad_factory), domain=INTERNAL_DOMAIN),
            KernelDef("LayerNormalization", "cuda", binding(bind_layer_norm)),
            KernelDef("LayerNormGrad", "cuda", layer_norm_grad_factory, domain=INTERNAL_DOMAIN),
            KernelDef("InstanceNormalization", "cuda", binding(bind_group_norm)),
            KernelDef("GroupNormalization", "cuda", binding(bind_group_norm)),
            KernelDef("GroupNormGrad", "cuda", group_norm_grad_factory, domain=INTERNAL_DOMAIN),
            KernelDef("MeanVarianceNormalization", "cuda", binding(bind_mvn)),
            KernelDef("LpNormalization", "cuda", binding(bind_lp_norm))]
