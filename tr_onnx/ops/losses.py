"""Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss, with their named backward ops
(ai.tr_onnx SoftmaxCrossEntropyLossGrad, NegativeLogLikelihoodLossGrad).

Scores are ``[N, C]`` or ``[N, C, d1, ...]`` with labels ``[N]`` / ``[N, d1, ...]``. Kernels work
on the class-last view ``np.moveaxis(x, 1, -1)`` (any strided layout), picking each label's
class with ``take_along_axis``. A label equal to ``ignore_index`` gets weight 0 (and class 0 as
a safe index); ``mean`` divides the weighted sum by the sum of the weights that were used.
float16 computes in float32.
"""

from __future__ import annotations

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import OpDef

INTERNAL_DOMAIN = "ai.tr_onnx"


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    return np.promote_types(dtype, np.float32)


class _Labels:
    """Plan-time setup shared by the forward and backward kernels: the label workspaces and a
    ``prepare(labels, weights, ws)`` filling safe indices and per-element weights."""

    def __init__(self, ctx, x_index: int, label_index: int, acc: np.dtype):
        x_info = ctx.inputs[x_index]
        if len(x_info.shape) < 2:
            raise ctx.error(f"scores must have rank >= 2 (N, C, ...), got {x_info.shape}")
        self.c = x_info.shape[1]
        lshape = ctx.inputs[label_index].shape
        self.ignore = ctx.attrs.get("ignore_index")  # no schema default: absent means none
        self.reduction = ctx.attrs["reduction"]
        self.idx_ws = ctx.workspace(lshape + (1,), np.int64)
        self.w_ws = ctx.workspace(lshape, acc)
        self.count = int(np.prod(lshape, dtype=np.int64))
        self.has_weights = ctx.has_input(label_index + 1)
        self.weighted = self.has_weights or self.ignore is not None

    def prepare(self, labels, weights, ws):
        """(indices [..., 1] with ignored labels at class 0, weights per element)."""
        idx, w = ws[self.idx_ws], ws[self.w_ws]
        np.copyto(idx[..., 0], labels, casting="unsafe")
        if self.ignore is not None:
            keep = idx != self.ignore  # label-sized bool temporary
            idx *= keep
        if weights is not None:
            np.copyto(w, np.take(weights, idx[..., 0]))  # label-sized temporary
        else:
            w[...] = 1
        if self.ignore is not None:
            w *= keep[..., 0]
        return idx, w

    def denominator(self, w) -> float:
        """What ``mean`` divides the weighted sum by (0/0 = nan when every label is ignored)."""
        return float(np.sum(w)) if self.weighted else float(self.count)


def _class_last_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0],) + tuple(shape[2:]) + (shape[1],)


def _log_softmax_class_last(x_cl, lp, m, s) -> None:
    """lp = x - max - log(sum(exp(x - max))) over the last axis (m, s: [..., 1] scratch)."""
    np.max(x_cl, axis=-1, keepdims=True, out=m)
    np.subtract(x_cl, m, out=lp)
    np.exp(lp, out=lp)
    np.sum(lp, axis=-1, keepdims=True, out=s)
    np.log(s, out=s)
    np.subtract(x_cl, m, out=lp)
    np.subtract(lp, s, out=lp)


def _nll_forward(ctx, log_softmax: bool):
    """loss[n, d] = -w[label] * logp[n, label, d]; ``log_softmax``: logp = LogSoftmax(x, axis 1)
    (the optional output 1), else logp = x."""
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    acc = _acc_dtype(dtype)
    labels = _Labels(ctx, 0, 1, acc)
    cl_shape = _class_last_shape(x_info.shape)
    kept = cl_shape[:-1] + (1,)
    lp_ws = ctx.workspace(cl_shape, acc) if log_softmax else None
    m_ws, s_ws, loss_ws = (ctx.workspace(kept, acc) for _ in range(3))
    has_weights, has_log_prob = labels.has_weights, log_softmax and ctx.has_output(1)

    def run(ins, outs, ws):
        x_cl = np.moveaxis(ins[0], 1, -1)
        src = x_cl
        if log_softmax:
            src = ws[lp_ws]
            _log_softmax_class_last(x_cl, src, ws[m_ws], ws[s_ws])
            if has_log_prob:
                np.copyto(np.moveaxis(outs[1], 1, -1), src, casting="same_kind")
        idx, w = labels.prepare(ins[1], ins[2] if has_weights else None, ws)
        loss = ws[loss_ws]
        np.copyto(loss, np.take_along_axis(src, idx, axis=-1))  # label-sized temporary
        np.multiply(loss[..., 0], w, out=loss[..., 0])
        np.negative(loss, out=loss)
        if labels.reduction == "none":
            np.copyto(outs[0], loss[..., 0], casting="same_kind")
            return
        total = np.sum(loss)
        if labels.reduction == "mean":
            with np.errstate(invalid="ignore", divide="ignore"):
                total = total / labels.denominator(w)
        outs[0][...] = total

    return run


def sce_numpy(ctx):
    return _nll_forward(ctx, log_softmax=True)


def nll_numpy(ctx):
    return _nll_forward(ctx, log_softmax=False)


def _loss_grad(ctx, log_softmax: bool):
    """d loss / d logp[n, c, d] = -gloss_scale[n, d] * w[n, d] * (c == label), with gloss_scale
    gloss (none), gloss (sum) or gloss / sum(w) (mean). For SoftmaxCrossEntropyLossGrad
    (inputs gloss, scores, labels, weights, glog_prob) the log_prob gradient is added and the
    LogSoftmax backward applied: gx = G - softmax(x) * sum_c(G)."""
    x_info, dtype = ctx.inputs[1], ctx.outputs[0].dtype
    acc = _acc_dtype(dtype)
    labels = _Labels(ctx, 1, 2, acc)
    cl_shape = _class_last_shape(x_info.shape)
    kept = cl_shape[:-1] + (1,)
    g_ws = ctx.workspace(cl_shape, acc)
    coef_ws = ctx.workspace(kept, acc)
    lp_ws = ctx.workspace(cl_shape, acc) if log_softmax else None
    m_ws, s_ws = ctx.workspace(kept, acc), ctx.workspace(kept, acc)
    has_weights = labels.has_weights
    has_glp = log_softmax and ctx.has_input(4)
    reduction = labels.reduction

    def run(ins, outs, ws):
        g, coef = ws[g_ws], ws[coef_ws]
        idx, w = labels.prepare(ins[2], ins[3] if has_weights else None, ws)
        if reduction == "none":
            np.multiply(ins[0], w, out=coef[..., 0])
        else:
            scale = np.float64(ins[0])
            if reduction == "mean":  # no label counted (all ignored): nan, as the loss
                with np.errstate(invalid="ignore", divide="ignore"):
                    scale = scale / labels.denominator(w)
            np.multiply(w, scale, out=coef[..., 0])
        if has_glp:
            np.copyto(g, np.moveaxis(ins[4], 1, -1))
        else:
            g[...] = 0
        # G[..., label] -= coef; ignored elements have coef 0 at their safe index 0
        picked = np.take_along_axis(g, idx, axis=-1)  # label-sized temporary
        np.subtract(picked, coef, out=picked)
        np.put_along_axis(g, idx, picked, axis=-1)
        gx_cl = np.moveaxis(outs[0], 1, -1)
        if not log_softmax:
            np.copyto(gx_cl, g, casting="same_kind")
            return
        p, s = ws[lp_ws], ws[s_ws]
        _log_softmax_class_last(np.moveaxis(ins[1], 1, -1), p, ws[m_ws], s)
        np.exp(p, out=p)
        np.sum(g, axis=-1, keepdims=True, out=s)
        np.multiply(p, s, out=p)
        np.subtract(g, p, out=g)
        np.copyto(gx_cl, g, casting="same_kind")

    return run


def sce_grad_numpy(ctx):
    return _loss_grad(ctx, log_softmax=True)


def nll_grad_numpy(ctx):
    return _loss_grad(ctx, log_softmax=False)


def _loss_attrs(node) -> dict:
    attrs = {"reduction": node.attrs["reduction"]}
    if node.attrs.get("ignore_index") is not None:
        attrs["ignore_index"] = int(node.attrs["ignore_index"])
    return attrs


def sce_vjp(b, node, gys, needed):
    """Through the loss and the optional log_prob output, w.r.t. the scores only."""
    x, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    glp = gys[1] if len(gys) > 1 else None
    gloss = gys[0] if gys[0] is not None else b.const(np.zeros(node.outputs[0].shape,
                                                               node.outputs[0].dtype))
    gx = b.op("SoftmaxCrossEntropyLossGrad", [gloss, x, labels, weights, glp],
              _loss_attrs(node), domain=INTERNAL_DOMAIN, like=x)
    return [gx] + [None] * (len(node.inputs) - 1)


def nll_vjp(b, node, gys, needed):
    x, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    gx = b.op("NegativeLogLikelihoodLossGrad", [gys[0], x, labels, weights],
              _loss_attrs(node), domain=INTERNAL_DOMAIN, like=x)
    return [gx] + [None] * (len(node.inputs) - 1)


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("SoftmaxCrossEntropyLoss", (12, 13), {"numpy": sce_numpy}, differentiable=True,
              gradient=sce_vjp, grad_inputs=(0,)),
        OpDef("NegativeLogLikelihoodLoss", (12, 13, 22), {"numpy": nll_numpy},
              differentiable=True, gradient=nll_vjp, grad_inputs=(0,)),
        OpDef("SoftmaxCrossEntropyLossGrad", (1,), {"numpy": sce_grad_numpy},
              domain=INTERNAL_DOMAIN,
              doc="(gloss, scores, labels, [weights], [glog_prob]) -> gscores"),
        OpDef("NegativeLogLikelihoodLossGrad", (1,), {"numpy": nll_grad_numpy},
              domain=INTERNAL_DOMAIN, doc="(gloss, input, target, [weights]) -> ginput"),
    ]
