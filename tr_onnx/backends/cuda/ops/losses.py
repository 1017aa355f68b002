"""cuda bindings of ``ops/losses.py`` (``kernels/losses.cu``): SoftmaxCrossEntropyLoss and
its backward, over [N, C] scores or channels-last [N, C, *S] ones (class rows), and
NegativeLogLikelihoodLoss and its backward over [N, C] or [N, C, *S] log-probabilities, compact
or channels-last; with class weights, ignore_index and every reduction. The other builtin
losses are built from elementwise ops by the train pass.

NegativeLogLikelihoodLoss: float32/16/bf16 storage (the loss, weights and gradients in the
scores' type, as ONNX types them), int64 or int32 labels. Per row one thread, the sum and
mean in one thread in double (``tr_loss_reduce``), so no atomics and a fixed order; NumPy sums
float32 pairwise, so a reduced loss may differ from NumPy's by an ulp or two of float32 (the
per-row losses and every gradient of a sum or none reduction are NumPy's bits; a mean's
gradient too where the weights' sum is exact, e.g. unweighted or integer weights). A label
outside [0, C) that is not ignore_index (NumPy's kernel raises or reads another row) counts as
ignored."""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ..bind import DT, BindContext, Unbound, float_dt, geometry, i32, i64, need_compact
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain
from .indexing import INDEX_TYPES, index_suffix
from .tensor import logical_strides

# ---- kernels/losses.cu: the family's name table -------------------------------------------------

def losses_source() -> KernelSource:
    """kernels/losses.cu: softmax cross-entropy and negative log-likelihood, forward and
    backward."""
    return kernel_source(
        "losses",
        instantiate("TR_LOSS({T}, {dt})", ("tr_sce_fwd_{dt}", "tr_sce_bwd_{dt}"), STORAGE),
        plain("tr_sce_reduce"),
        instantiate("TR_NLL_REDUCE({T}, {dt})", "tr_nll_reduce_{dt}", STORAGE),
        instantiate("TR_NLL({T}, {dt}, {I}, {it})",
                    ("tr_nll_fwd_{dt}_{it}", "tr_nll_bwd_{dt}_{it}"), STORAGE, INDEX_TYPES))


KERNELS = losses_source()


def _sce_rows(b: BindContext, x, labels) -> tuple[int, list]:
    """``_nll_rows`` of the scores, int64 labels."""
    if b.t(labels).dtype != np.int64:
        raise Unbound("labels must be int64")
    if geometry(b.t(x)) is None or b.t(x).dtype.name not in DT:
        raise Unbound(f"scores {x.name!r} in a layout the row kernels cannot read")
    return _nll_rows(b, x, labels)


def _sce_common(node):
    reduction = {"none": 0, "sum": 1, "mean": 2}[node.attrs["reduction"]]
    ignore = node.attrs.get("ignore_index")
    return reduction, [i64(ignore if ignore is not None else -100), i32(ignore is not None)]


def _rows(ctx: KernelContext) -> int:
    """Class rows of the scores: N for [N, C], N * spatial for [N, C, *S]."""
    forward = ctx.node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
    shape = ctx.inputs[0 if forward else 1].shape
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
        _, geo = _sce_rows(b, x, labels)
        rows = int(geo[0])
        dt = b.dt(x)
        reduction, common = _sce_common(node)
        weighted = weights is not None or node.attrs.get("ignore_index") is not None
        row_w = b.ws(row_w_ws)
        row_loss = b.buf(out, True) if reduction == 0 else b.ws(row_loss_ws)
        calls = [b.launch(f"tr_sce_fwd_{dt}", rows,
                          [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w, *geo]
                          + common)]
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
        lanes, geo = _sce_rows(b, x, labels)
        rows = int(geo[0])
        if _sce_rows(b, gx, labels) != (lanes, geo):
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
                                *geo] + common),
                      b.launch("tr_sce_reduce", 1,
                               [row_loss, row_w, i64(rows), i32(reduction), i32(weighted),
                                b.ws(loss_ws), denom], single_block=True)]
        calls.append(b.launch(f"tr_sce_bwd_{dt}", rows,
                              [b.buf(x), b.buf(labels), b.buf(weights), b.buf(gloss), denom,
                               b.buf(gx, True), *geo, i64(lanes)] + common
                              + [i32(reduction)]))
        return calls

    return bind


# ---- NegativeLogLikelihoodLoss -----------------------------------------------------------------

def _nll_rows(b: BindContext, x, labels) -> tuple[int, list]:
    """(lanes per row, [rows, c, s, ns, ss, cs]) of log-probabilities ``x`` [N, C, *S]: row
    (n, sp) at n * ns + sp * ss, its classes cs apart; lanes = Cp for a channels-last x (the
    padded lanes its gradient zeroes), else C."""
    need_compact(b, labels)
    tx = b.t(x)
    strides = logical_strides(b, x)
    c, s = tx.shape[1], math.prod(tx.shape[2:])
    g = geometry(tx)
    lanes = g.cp if g.kind == "channels_last" else c
    rows = tx.shape[0] * s
    return lanes, [i64(rows), i64(c), i64(s), i64(strides[0]),
                   i64(strides[-1] if len(tx.shape) > 2 else 0), i64(strides[1])]


def nll_factory(ctx: KernelContext):
    """NegativeLogLikelihoodLoss: rows' losses and weights in float32 scratch, then (sum,
    mean) their reduction into the loss, the denominator into scratch too."""
    rows = _rows(ctx)
    row_loss_ws, row_w_ws = (ctx.workspace((rows,), np.float32) for _ in range(2))
    denom_ws = ctx.workspace((1,), np.float32)

    def bind(b: BindContext, node) -> list:
        x, labels = node.inputs[0], node.inputs[1]
        weights = node.inputs[2] if len(node.inputs) > 2 else None
        out = node.outputs[0]
        dt = float_dt(b, x, weights, out)
        need_compact(b, out)
        _, geo = _nll_rows(b, x, labels)
        reduction, common = _sce_common(node)
        weighted = weights is not None or node.attrs.get("ignore_index") is not None
        row_loss, row_w = b.ws(row_loss_ws), b.ws(row_w_ws)
        calls = [b.launch(f"tr_nll_fwd_{dt}_{index_suffix(b, labels)}", int(geo[0]),
                          [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w,
                           b.buf(out, True) if reduction == 0 else None] + geo + common)]
        if reduction:
            calls.append(b.launch(f"tr_nll_reduce_{dt}", 1,
                                  [row_loss, row_w, geo[0], i32(reduction), i32(weighted),
                                   b.buf(out, True), b.ws(denom_ws)], single_block=True))
        return calls

    return bind


def nll_grad_factory(ctx: KernelContext):
    """NegativeLogLikelihoodLossGrad: a mean's denominator (the forward's weights, summed) is
    recomputed into scratch from the labels and weights (the rows' losses it also gives are
    not read)."""
    rows = _rows(ctx)
    mean = ctx.attrs["reduction"] == "mean"
    if mean:
        row_loss_ws, row_w_ws = (ctx.workspace((rows,), np.float32) for _ in range(2))
        loss_ws, denom_ws = (ctx.workspace((1,), np.float32) for _ in range(2))

    def bind(b: BindContext, node) -> list:
        gloss, x, labels = node.inputs[:3]
        weights = node.inputs[3] if len(node.inputs) > 3 else None
        gx = node.outputs[0]
        dt = float_dt(b, gloss, x, weights, gx)
        lanes, geo = _nll_rows(b, gx, labels)
        it = index_suffix(b, labels)
        reduction, common = _sce_common(node)
        weighted = weights is not None or node.attrs.get("ignore_index") is not None
        calls, denom = [], None
        if mean:
            denom = b.ws(denom_ws)
            _, xgeo = _nll_rows(b, x, labels)
            row_loss, row_w = b.ws(row_loss_ws), b.ws(row_w_ws)
            calls += [b.launch(f"tr_nll_fwd_{dt}_{it}", int(geo[0]),
                               [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w, None]
                               + xgeo + common),
                      b.launch("tr_sce_reduce", 1,
                               [row_loss, row_w, geo[0], i32(reduction), i32(weighted),
                                b.ws(loss_ws), denom], single_block=True)]
        calls.append(b.launch(f"tr_nll_bwd_{dt}_{it}", int(geo[0]),
                              [b.buf(labels), b.buf(weights), b.buf(gloss), denom,
                               b.buf(gx, True)] + geo + [i64(lanes)] + common
                              + [i32(reduction)]))
        return calls

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("SoftmaxCrossEntropyLoss", "cuda", sce_factory),
            KernelDef("SoftmaxCrossEntropyLossGrad", "cuda", sce_grad_factory,
                      domain=INTERNAL_DOMAIN),
            KernelDef("NegativeLogLikelihoodLoss", "cuda", nll_factory),
            KernelDef("NegativeLogLikelihoodLossGrad", "cuda", nll_grad_factory,
                      domain=INTERNAL_DOMAIN)]
