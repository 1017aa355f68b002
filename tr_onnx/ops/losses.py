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

from .. import host_blas
from ..domains import INTERNAL_DOMAIN
from ..errors import InputError
from ..hookspecs import hookimpl
from ..host_math import negate
from ..opdef import OpDef


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    return np.promote_types(dtype, np.float32)


class _Labels:
    """Plan-time setup shared by the forward and backward kernels: the label workspaces and a
    ``prepare(labels, weights, ws)`` filling safe class indices, their flat positions in the
    contiguous class-last buffer ``[..., C]`` and the per-element weights (None when every
    weight is 1: no weight input and no ``ignore_index``)."""

    def __init__(self, ctx, x_index: int, label_index: int, acc: np.dtype):
        x_info = ctx.inputs[x_index]
        if len(x_info.shape) < 2:
            raise ctx.error(f"scores must have rank >= 2 (N, C, ...), got {x_info.shape}")
        self.c = x_info.shape[1]
        lshape = ctx.inputs[label_index].shape
        self.ignore = ctx.attrs.get("ignore_index")  # no schema default: absent means none
        self.reduction = ctx.attrs["reduction"]
        self.idx_ws = ctx.workspace(lshape + (1,), np.int64)
        self.flat_ws = ctx.workspace(lshape, np.int64)
        self.w_ws = ctx.workspace(lshape, acc)
        self.count = int(np.prod(lshape, dtype=np.int64))
        # each label's row start in the class-last buffer: flat = row * C + class
        self.row_starts = np.arange(0, self.count * self.c, self.c, dtype=np.int64).reshape(
            lshape)
        self.has_weights = ctx.has_input(label_index + 1)
        self.weighted = self.has_weights or self.ignore is not None

    def prepare(self, labels, weights, ws):
        """(indices [..., 1] with ignored labels at class 0, flat positions, weights or
        None)."""
        idx, flat = ws[self.idx_ws], ws[self.flat_ws]
        np.copyto(idx[..., 0], labels, casting="unsafe")
        if self.ignore is not None:
            keep = idx != self.ignore  # label-sized bool temporary
            idx *= keep
        if self.count and not 0 <= idx.min() <= idx.max() < self.c:
            # a flat position outside its row would read another sample's scores
            bad = idx[(idx < 0) | (idx >= self.c)][0]
            raise InputError(f"a label is {int(bad)}: class labels must lie in [0, {self.c})"
                             + ("" if self.ignore is None else
                                f" or equal ignore_index {self.ignore}"))
        np.add(idx[..., 0], self.row_starts, out=flat)
        if not self.weighted:
            return idx, flat, None
        w = ws[self.w_ws]
        if weights is not None:
            np.copyto(w, np.take(weights, idx[..., 0]))  # label-sized temporary
        else:
            w[...] = 1
        if self.ignore is not None:
            w *= keep[..., 0]
        return idx, flat, w

    def denominator(self, w) -> float:
        """What ``mean`` divides the weighted sum by (0/0 = nan when every label is ignored)."""
        return float(np.sum(w)) if w is not None else float(self.count)


def _class_last_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0],) + tuple(shape[2:]) + (shape[1],)


def _log_softmax_class_last(x_cl, lp, m, s) -> None:
    """lp = x - max - log(sum(exp(x - max))) over the last axis (m, s: [..., 1] scratch)."""
    np.maximum.reduce(x_cl, axis=-1, keepdims=True, out=m)
    np.subtract(x_cl, m, out=lp)
    np.exp(lp, out=lp)
    np.add.reduce(lp, axis=-1, keepdims=True, out=s)
    np.log(s, out=s)
    np.subtract(x_cl, m, out=lp)
    np.subtract(lp, s, out=lp)


def _picker(src, out):
    """A call ``(indices [..., 1], flat positions) -> None`` writing out[...] = src[..., label]:
    a flat take where src is contiguous (take_along_axis costs ~12 us of Python per call),
    else take_along_axis (a label-sized temporary)."""
    if src.flags.c_contiguous:
        flat_src = src.reshape(-1)
        return lambda idx, flat: np.take(flat_src, flat, out=out)
    return lambda idx, flat: np.copyto(out, np.take_along_axis(src, idx, axis=-1)[..., 0])


def _nll_forward(ctx, log_softmax: bool):
    """loss[n, d] = -w[label] * logp[n, label, d]; ``log_softmax``: logp = LogSoftmax(x, axis 1)
    (the optional output 1), else logp = x. The views are made on the first call
    (``host_blas.prepared_step``): a [32, 10] loss is a few microseconds of arithmetic."""
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    acc = _acc_dtype(dtype)
    labels = _Labels(ctx, 0, 1, acc)
    cl_shape = _class_last_shape(x_info.shape)
    kept = cl_shape[:-1] + (1,)
    lp_ws = ctx.workspace(cl_shape, acc) if log_softmax else None
    m_ws, s_ws, loss_ws = (ctx.workspace(kept, acc) for _ in range(3))
    has_weights, has_log_prob = labels.has_weights, log_softmax and ctx.has_output(1)
    reduction = labels.reduction

    def make(ins, outs, ws):
        x_cl = np.moveaxis(ins[0], 1, -1)
        src = ws[lp_ws] if log_softmax else x_cl
        m, s, loss = ws[m_ws], ws[s_ws], ws[loss_ws][..., 0]
        log_prob = np.moveaxis(outs[1], 1, -1) if has_log_prob else None
        label_in, weight_in, out = ins[1], ins[2] if has_weights else None, outs[0]
        pick = _picker(src, loss)

        def run():
            if log_softmax:
                _log_softmax_class_last(x_cl, src, m, s)
                if log_prob is not None:
                    np.copyto(log_prob, src, casting="same_kind")
            idx, flat, w = labels.prepare(label_in, weight_in, ws)
            pick(idx, flat)
            if w is not None:
                np.multiply(loss, w, out=loss)
            negate(loss, loss)
            if reduction == "none":
                np.copyto(out, loss, casting="same_kind")
                return
            total = np.add.reduce(loss, axis=None)
            if reduction == "mean":
                with np.errstate(invalid="ignore", divide="ignore"):
                    total = total / labels.denominator(w)
            out[...] = total

        return [run]

    return host_blas.prepared_step(make)


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
    picked_ws = ctx.workspace(kept[:-1], acc)
    lp_ws = ctx.workspace(cl_shape, acc) if log_softmax else None
    m_ws, s_ws = ctx.workspace(kept, acc), ctx.workspace(kept, acc)
    has_weights = labels.has_weights
    has_glp = log_softmax and ctx.has_input(4)
    reduction = labels.reduction

    def make(ins, outs, ws):
        g, coef, picked = ws[g_ws], ws[coef_ws][..., 0], ws[picked_ws]
        g_flat = g.reshape(-1)
        gx_cl = np.moveaxis(outs[0], 1, -1)
        x_cl = np.moveaxis(ins[1], 1, -1)
        glp = np.moveaxis(ins[4], 1, -1) if has_glp else None
        p, m, s = ws[lp_ws] if log_softmax else None, ws[m_ws], ws[s_ws]
        gloss, label_in, weight_in = ins[0], ins[2], ins[3] if has_weights else None

        def run():
            idx, flat, w = labels.prepare(label_in, weight_in, ws)
            if reduction == "none":
                scale = gloss
            else:
                scale = np.float64(gloss)
                if reduction == "mean":  # no label counted (all ignored): nan, as the loss
                    with np.errstate(invalid="ignore", divide="ignore"):
                        scale = scale / labels.denominator(w)
            if w is None:
                np.copyto(coef, scale)
            else:
                np.multiply(w, scale, out=coef)
            if glp is not None:
                np.copyto(g, glp)
            else:
                g.fill(0)
            # G[..., label] -= coef; ignored elements have coef 0 at their safe index 0
            np.take(g_flat, flat, out=picked)
            np.subtract(picked, coef, out=picked)
            np.put(g_flat, flat, picked)
            if not log_softmax:
                np.copyto(gx_cl, g, casting="same_kind")
                return
            _log_softmax_class_last(x_cl, p, m, s)
            np.exp(p, out=p)
            np.add.reduce(g, axis=-1, keepdims=True, out=s)
            np.multiply(p, s, out=p)
            np.subtract(g, p, out=g)
            np.copyto(gx_cl, g, casting="same_kind")

        return [run]

    return host_blas.prepared_step(make)


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
