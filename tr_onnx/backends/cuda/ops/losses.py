"""cuda bindings of ``ops/losses.py``: SoftmaxCrossEntropyLoss and its backward
(``kernels/losses.cu``), over [N, C] scores or channels-last [N, C, *S] ones (class rows), with
class weights, ignore_index and every reduction. The other builtin losses are built from
elementwise ops by the train pass."""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ..bind import DT, INTERNAL, BindContext, Unbound, geometry, i32, i64
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain

# ---- kernels/losses.cu: the family's name table -------------------------------------------------

def losses_source() -> KernelSource:
    """kernels/losses.cu: softmax cross-entropy, forward and backward."""
    return kernel_source(
        "losses",
        instantiate("TR_LOSS({T}, {dt})", ("tr_sce_fwd_{dt}", "tr_sce_bwd_{dt}"), STORAGE),
        plain("tr_sce_reduce"))


KERNELS = losses_source()


def _sce_geometry(b: BindContext, x, labels):
    tx = b.t(x)
    g = geometry(tx)
    if b.t(labels).dtype != np.int64:
        raise Unbound("labels must be int64")
    if g is None or tx.dtype.name not in DT:
        raise Unbound(f"scores {x.name!r} in a layout the row kernels cannot read")
    if g.kind == "flat" and len(tx.shape) == 2:
        return tx.shape[0], tx.shape[1], tx.shape[1]
    if g.kind == "channels_last" and tx.layout.kind == "channels_last":
        return g.n // g.cp, g.c, g.cp
    raise Unbound("scores of rank > 2 must be channels-last (class-last rows)")


def _sce_common(node):
    reduction = {"none": 0, "sum": 1, "mean": 2}[node.attrs["reduction"]]
    ignore = node.attrs.get("ignore_index")
    return reduction, [i64(ignore if ignore is not None else -100), i32(ignore is not None)]


def _rows(ctx: KernelContext) -> int:
    """Class rows of the scores: N for [N, C], N * spatial for [N, C, *S]."""
    shape = ctx.inputs[0].shape if ctx.node.op_type == "SoftmaxCrossEntropyLoss" else \
        ctx.inputs[1].shape
    return shape[0] * math.prod(shape[2:])


def sce_factory(ctx: KernelContext):
    """SoftmaxCrossEntropyLoss: per-row losses and weights in scratch, then the reduction.
    Scratch: the rows' weights; with a reduction also the rows' losses and the denominator."""
    rows = _rows(ctx)
    reduction = ctx.attrs["reduction"] != "none"
    row_w_ws = ctx.workspace((rows,), np.float32)
    row_loss_ws = ctx.workspace((rows,), np.float32) if reduction else None
    denom_ws = ctx.workspace((1,), np.float32) if reduction else None

    def bind(b: BindContext, node) -> list:
        x, labels = node.inputs[0], node.inputs[1]
        weights = node.inputs[2] if len(node.inputs) > 2 else None
        out = node.outputs[0]
        if len(node.outputs) > 1 and node.outputs[1] is not None:
            raise Unbound("the log_prob output has no kernel")
        if b.t(out).dtype != np.float32:
            raise Unbound("the loss kernels write a float32 loss")
        rows, c, ld = _sce_geometry(b, x, labels)
        dt = b.dt(x)
        reduction, common = _sce_common(node)
        weighted = weights is not None or node.attrs.get("ignore_index") is not None
        row_w = b.ws(row_w_ws)
        row_loss = b.buf(out, True) if reduction == 0 else b.ws(row_loss_ws)
        calls = [b.launch(f"tr_sce_fwd_{dt}", rows,
                          [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w, i64(rows),
                           i64(c), i64(ld)] + common)]
        if reduction:
            calls.append(b.launch("tr_sce_reduce", 1,
                                  [row_loss, row_w, i64(rows), i32(reduction), i32(weighted),
                                   b.buf(out, True), b.ws(denom_ws)], single_block=True))
        return calls

    return bind


def sce_grad_factory(ctx: KernelContext):
    """SoftmaxCrossEntropyLossGrad: the mean's denominator (the forward's row weights, summed)
    is recomputed into scratch, with the rows' weights and losses and the loss it needs."""
    rows = _rows(ctx)
    denom_ws = ctx.workspace((1,), np.float32)
    mean = ctx.attrs["reduction"] == "mean"
    if mean:
        row_w_ws, row_loss_ws = (ctx.workspace((rows,), np.float32) for _ in range(2))
        loss_ws = ctx.workspace((1,), np.float32)

    def bind(b: BindContext, node) -> list:
        gloss, x, labels = node.inputs[:3]
        weights = node.inputs[3] if len(node.inputs) > 3 else None
        if len(node.inputs) > 4 and node.inputs[4] is not None:
            raise Unbound("a log_prob gradient input has no kernel")
        gx = node.outputs[0]
        rows, c, ld = _sce_geometry(b, x, labels)
        if _sce_geometry(b, gx, labels)[2] != ld:
            raise Unbound("scores and their gradient in different layouts")
        dt = b.dt(x)
        if b.dt(gx) != dt or b.t(gloss).dtype != np.float32:
            raise Unbound("gradient dtype differs from the scores', or a non-float32 loss "
                          "gradient")
        reduction, common = _sce_common(node)
        weighted = weights is not None or node.attrs.get("ignore_index") is not None
        denom = b.ws(denom_ws)
        calls = []
        if mean:
            row_w, row_loss = b.ws(row_w_ws), b.ws(row_loss_ws)
            calls += [b.launch(f"tr_sce_fwd_{dt}", rows,
                               [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w,
                                i64(rows), i64(c), i64(ld)] + common),
                      b.launch("tr_sce_reduce", 1,
                               [row_loss, row_w, i64(rows), i32(reduction), i32(weighted),
                                b.ws(loss_ws), denom], single_block=True)]
        calls.append(b.launch(f"tr_sce_bwd_{dt}", rows,
                              [b.buf(x), b.buf(labels), b.buf(weights), b.buf(gloss), denom,
                               b.buf(gx, True), i64(rows), i64(c), i64(ld)] + common
                              + [i32(reduction)]))
        return calls

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("SoftmaxCrossEntropyLoss", "cuda", sce_factory),
            KernelDef("SoftmaxCrossEntropyLossGrad", "cuda", sce_grad_factory, domain=INTERNAL)]
