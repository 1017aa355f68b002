"""float32 LayerNormalization and LayerNormGrad through oneDNN (ops.layer_norm_onednn) against
PyTorch autograd in float64 and against our own NumPy kernels: last axis and inner axes, with
and without bias, the Mean and InvStdDev outputs; and that a broadcast scale, a padded layout
or float64 runs NumPy.

oneDNN is part of the test extra on Linux x86-64 (``onednn-cpu-gomp``): there these tests
require it rather than skip.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from gradcheck import GradCase, build_model
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper

from tr_onnx import InferenceSession
from tr_onnx.ops import normalization
from tr_onnx.training.gradients import vjp

# float32 against float64: the NumPy kernels' own errors on these cases are up to 1.2e-6 (y),
# 5.8e-7 (gx) and 6.6e-5 (gscale, a sum over 512 rows); oneDNN's are below them
RTOL, ATOL = 1e-5, 1e-4
CASES = {  # id: (x shape, axis, bias)
    "bert_rows": ((8, 64, 256), -1, True),
    "inner_axes": ((4, 6, 10), 1, True),
    "no_bias": ((5, 33), -1, False),
}


@pytest.fixture
def used(monkeypatch):
    """Names of the oneDNN layer-norm kernels that built a step."""
    require_onednn()
    return spy_kernels(monkeypatch, normalization, ("layer_norm_onednn", "layer_norm_grad_onednn"))


def _numpy_only(monkeypatch):
    monkeypatch.setattr(normalization, "layer_norm_onednn", lambda *args: None)
    monkeypatch.setattr(normalization, "layer_norm_grad_onednn", lambda *args: None)


def _case(spec, seed=0):
    shape, axis, bias = spec
    rng = np.random.default_rng(seed)
    normalized = shape[axis % len(shape):]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    s = rng.standard_normal(normalized).astype(np.float32)
    b = rng.standard_normal(normalized).astype(np.float32) if bias else None
    cot = rng.standard_normal(shape).astype(np.float32)
    return x, s, b, cot


def _ours(spec, x, s, b, cot):
    inputs = [x, s] + ([b] if b is not None else [])
    model = build_model(GradCase("ln", "LayerNormalization", inputs,
                                 {"axis": spec[1], "epsilon": 1e-5}))
    feed = {f"x{i}": v for i, v in enumerate(inputs)}
    y, grads = vjp(model, feed, list(feed), cot)
    return [y] + [grads[f"x{i}"] for i in range(len(inputs))]


def _torch(spec, x, s, b, cot):
    ts = [torch.tensor(v.astype(np.float64), requires_grad=True)
          for v in (x, s, b) if v is not None]
    normalized = x.shape[spec[1] % x.ndim:]
    y = torch.nn.functional.layer_norm(ts[0], normalized, ts[1],
                                       ts[2] if len(ts) > 2 else None, 1e-5)
    y.backward(torch.tensor(cot.astype(np.float64)))
    return [y.detach().numpy()] + [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("case", list(CASES))
def test_layer_norm_and_its_gradient_match_torch_and_numpy(case, used, monkeypatch):
    spec = CASES[case]
    inputs = _case(spec)
    got = _ours(spec, *inputs)
    assert sorted(used) == ["layer_norm_grad_onednn", "layer_norm_onednn"]
    want = _torch(spec, *inputs)
    for name, g, w in zip(("y", "gx", "gscale", "gbias"), got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)
    _numpy_only(monkeypatch)
    reference = _ours(spec, *inputs)
    for name, g, r in zip(("y", "gx", "gscale", "gbias"), got, reference):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL, err_msg=name)


def _three_output_model(shape, axis):
    normalized = list(shape[axis % len(shape):])
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"],
                            axis=axis, epsilon=1e-3)
    rng = np.random.default_rng(3)
    graph = helper.make_graph(
        [node], "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * len(shape))
         for n in ("y", "mean", "inv")],
        [numpy_helper.from_array(rng.standard_normal(normalized).astype(np.float32), n)
         for n in ("s", "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_mean_and_inv_std_dev_outputs(used):
    shape, axis = (6, 4, 12), 1
    model = _three_output_model(shape, axis)
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 3
    got = InferenceSession(model.SerializeToString()).run(None, {"x": x})
    assert used == ["layer_norm_onednn"]
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for name, g, w in zip(("y", "mean", "inv_std_dev"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_what_onednn_cannot_take_runs_numpy(used):
    """A scale broadcast from [1, 5] over [3, 5] rows: NumPy's kernels run it."""
    x = np.random.default_rng(5).standard_normal((4, 3, 5)).astype(np.float32)
    s = np.random.default_rng(6).standard_normal((1, 5)).astype(np.float32)
    model = build_model(GradCase("ln", "LayerNormalization", [x, s], {"axis": 1}))
    cot = np.ones_like(x)
    vjp(model, {"x0": x, "x1": s}, ["x0", "x1"], cot)
    assert used == []
