"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (tr_onnx/ops/losses.py): forward against
PyTorch (cross_entropy / nll_loss), onnxruntime and onnx.reference; gradients w.r.t. the scores
against PyTorch autograd in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.training.gradients import vjp

_IDENTITY_LRN = {"size": 1, "alpha": 1e-30, "beta": 0.75, "bias": 1.0}
OPS = {"sce": "SoftmaxCrossEntropyLoss", "nll": "NegativeLogLikelihoodLoss"}

# id: (scores shape, reduction, ignore_index or None, weights?, label dtype)
CASES = {
    "NC_mean": ((6, 5), "mean", None, False, np.int64),
    "NC_sum_weights": ((6, 5), "sum", None, True, np.int64),
    "NC_none_ii": ((7, 3), "none", 1, False, np.int32),
    "NCd1_mean_weights_ii": ((3, 4, 5), "mean", 2, True, np.int64),
    "NCd1_mean_negative_ii": ((3, 4, 5), "mean", -1, False, np.int64),
    "NCd1d2_none_weights": ((2, 5, 3, 4), "none", None, True, np.int32),
    "NCd1d2_mean_ii_weights": ((2, 5, 3, 4), "mean", 4, True, np.int64),
    "NCd1d2d3_sum_high_ii": ((2, 3, 2, 2, 3), "sum", 10, False, np.int64),
}


def _data(shape, ignore, weights, label_dtype, dtype, seed=0):
    rng = np.random.default_rng(seed)
    n, c, *rest = shape
    x = rng.standard_normal(shape).astype(dtype)
    t = rng.integers(0, c, (n, *rest))
    if ignore is not None:
        t.flat[::4] = ignore  # (an ignore_index that is a class is also drawn at random)
    w = rng.uniform(0.5, 2.0, c).astype(dtype) if weights else None
    return x, t.astype(label_dtype), w


def _model(op, x, t, w, reduction, ignore, log_prob=False, channels_last=False):
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    inputs = ["x_cl" if channels_last else "x", "t"] + (["w"] if w is not None else [])
    outs = ["loss"] + (["log_prob"] if log_prob else [])
    nodes = [helper.make_node("LRN", ["x"], ["x_cl"], **_IDENTITY_LRN)] if channels_last else []
    nodes.append(helper.make_node(op, inputs, outs, **attrs))
    elem = onnx_elem_type(x.dtype)
    loss_shape = list(t.shape) if reduction == "none" else []
    g_outs = [helper.make_tensor_value_info("loss", elem, loss_shape)]
    if log_prob:
        g_outs.append(helper.make_tensor_value_info("log_prob", elem, list(x.shape)))
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", elem, x.shape),
                    helper.make_tensor_value_info("t", onnx_elem_type(t.dtype), t.shape)],
        g_outs, [numpy_helper.from_array(w, "w")] if w is not None else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _torch_loss(short, tx, t, w, reduction, ignore):
    kw = {"reduction": reduction, "weight": None if w is None else torch.tensor(w)}
    kw["ignore_index"] = ignore if ignore is not None else -100
    target = torch.tensor(t.astype(np.int64))
    if short == "sce":
        return F.cross_entropy(tx, target, **kw)
    return F.nll_loss(tx, target, **kw)


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("short", list(OPS), ids=list(OPS))
def test_forward_matches_torch_ort_reference(short, case, align):
    shape, reduction, ignore, weights, label_dtype = CASES[case]
    x, t, w = _data(shape, ignore, weights, label_dtype, np.float32)
    log_prob = short == "sce"
    model = _model(OPS[short], x, t, w, reduction, ignore, log_prob=log_prob,
                   channels_last=len(shape) == 4)
    feed = {"x": x, "t": t}
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    ours = sess.run(None, feed)
    expected_torch = _torch_loss(short, torch.tensor(x), t, w, reduction, ignore).numpy()
    np.testing.assert_allclose(ours[0], expected_torch, rtol=1e-5, atol=1e-6)
    oracles = [ort_run(model, feed)]
    # onnx.reference's NegativeLogLikelihoodLoss drops ignore_index == -1 when there are no
    # weights (``elif ignore_index != -1``): its mean then counts the ignored elements
    if not (short == "nll" and ignore == -1 and w is None):
        oracles.append(ReferenceEvaluator(model).run(None, feed))
    for oracle in oracles:
        for a, b in zip(ours, oracle):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if log_prob:
        np.testing.assert_allclose(ours[1], torch.log_softmax(torch.tensor(x), 1).numpy(),
                                   rtol=1e-5, atol=1e-6)
    plan = sess.plan_for(feed)
    for tensor in plan.memory.tensors.values():
        assert pad_lanes_are_zero(plan.executor.arena, tensor)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("short", list(OPS), ids=list(OPS))
def test_gradient_matches_torch_autograd(short, case):
    shape, reduction, ignore, weights, label_dtype = CASES[case]
    x, t, w = _data(shape, ignore, weights, label_dtype, np.float64, seed=1)
    model = _model(OPS[short], x, t, w, reduction, ignore)
    cot = np.random.default_rng(2).standard_normal(t.shape if reduction == "none" else ())
    loss, grads = vjp(model, {"x": x, "t": t}, ["x"], cot, output="loss", channel_align=8)
    tx = torch.tensor(x, requires_grad=True)
    tloss = _torch_loss(short, tx, t, w, reduction, ignore)
    tloss.backward(torch.tensor(cot))
    np.testing.assert_allclose(loss, tloss.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["f16", "f64"])
@pytest.mark.parametrize("short", list(OPS), ids=list(OPS))
def test_dtypes(short, dtype):
    x, t, w = _data((4, 5, 3), 2, True, np.int64, dtype)
    model = _model(OPS[short], x, t, w, "mean", 2, log_prob=short == "sce")
    ours = tr_onnx.InferenceSession(model).run(None, {"x": x, "t": t})
    # float16: ours accumulates in float32, onnxruntime in float16 steps (a few ulps)
    tol = (2e-3, 2e-3) if dtype == np.float16 else (1e-12, 1e-12)
    for a, b in zip(ours, ort_run(model, {"x": x, "t": t})):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, *tol)


def test_sce_log_prob_gradient_matches_torch():
    """Gradient through both outputs: loss and log_prob both feed the objective."""
    x, t, w = _data((4, 5, 3), 1, True, np.int64, np.float64, seed=3)
    model = _model(OPS["sce"], x, t, w, "mean", 1, log_prob=True)
    rng = np.random.default_rng(4)
    cot_lp = rng.standard_normal(x.shape)
    _, grads = vjp(model, {"x": x, "t": t}, ["x"], cot_lp, output="log_prob")
    tx = torch.tensor(x, requires_grad=True)
    torch.log_softmax(tx, 1).backward(torch.tensor(cot_lp))
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_mean_with_every_label_ignored_is_nan():
    x, t, _ = _data((3, 4), None, False, np.int64, np.float32)
    t[:] = 2
    model = _model(OPS["nll"], x, t, None, "mean", 2)
    out = tr_onnx.InferenceSession(model).run(None, {"x": x, "t": t})[0]
    assert np.isnan(out)  # 0 / 0, as PyTorch and onnx.reference
