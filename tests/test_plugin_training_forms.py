"""A plugin op declares its training form, export rule, value bound and float32 ports in its
OpDef alone (plugins/tr_onnx_example_ops, com.example BatchCenter): training takes the batch's
mean and commits the running mean, as PyTorch computes it; the export is standard ONNX that
onnxruntime runs; the value bound holds."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import tr_onnx_example_ops
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.optim import SGD
from tr_onnx.passes import control_flow, value_bounds

RNG = np.random.default_rng(20261206)
N, D, H = 8, 5, 3
LR, MOMENTUM = 0.1, 0.8


def _model() -> onnx.ModelProto:
    """x [N, D] -> Gemm (W, b) -> com.example BatchCenter (running mean rm) -> y [N, H]."""
    inits = {"W": RNG.standard_normal((H, D)).astype(np.float32),
             "b": RNG.standard_normal(H).astype(np.float32),
             "rm": RNG.standard_normal(H).astype(np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1),
             helper.make_node("BatchCenter", ["h", "rm"], ["y"], name="center",
                              domain=tr_onnx_example_ops.DOMAIN, momentum=MOMENTUM)]
    graph = helper.make_graph(
        nodes, "centered", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, H])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(tr_onnx_example_ops.DOMAIN, 1)])
    model.ir_version = 8
    return model


def _initial(model) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _torch_step(p: dict[str, np.ndarray], x, labels) -> tuple[float, dict[str, np.ndarray]]:
    """The oracle: one SGD step on mean((h - mean_batch(h) - labels)^2), and the running mean
    moved towards the batch's mean."""
    w, b = (torch.tensor(p[k], dtype=torch.float64, requires_grad=True) for k in ("W", "b"))
    h = torch.tensor(x, dtype=torch.float64) @ w.T + b
    y = h - h.mean(0)
    loss = ((y - torch.tensor(labels, dtype=torch.float64)) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        rm = MOMENTUM * torch.tensor(p["rm"], dtype=torch.float64) + (1 - MOMENTUM) * h.mean(0)
        return float(loss), {"W": (w - LR * w.grad).numpy(), "b": (b - LR * b.grad).numpy(),
                             "rm": rm.numpy()}


@pytest.fixture(scope="module")
def trained():
    model = _model()
    session = tr_onnx.TrainingSession(model, loss="mse", optimizer=SGD(lr=LR),
                                      plugins=[tr_onnx_example_ops])
    x = RNG.standard_normal((N, D)).astype(np.float32)
    labels = RNG.standard_normal((N, H)).astype(np.float32)
    loss = float(session.train_step({"x": x}, labels))
    return model, session, x, labels, loss


def test_training_form_is_the_batch_mean_and_commits_the_running_mean(trained):
    model, session, x, labels, loss = trained
    want_loss, want = _torch_step(_initial(model), x, labels)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    params = session.parameters()
    for name in ("W", "b", "rm"):
        np.testing.assert_allclose(params[name], want[name], rtol=1e-5, atol=1e-6)
    assert session._state.active.info.converted["BatchCenter"] == 1
    assert session._state.active.info.running_stats == ["rm"]
    assert "rm" not in session._state.active.info.trainable


def test_export_writes_standard_ops_that_onnxruntime_runs(trained, tmp_path):
    model, session, x, labels, loss = trained
    exported = onnx.load(session.export(tmp_path / "centered.onnx"))
    assert [n.op_type for n in exported.graph.node] == ["Gemm", "Sub"]
    assert all(n.domain == "" for n in exported.graph.node)
    p = session.parameters()
    want = x @ p["W"].T + p["b"] - p["rm"]  # inference: the running mean
    (ours,) = ort.InferenceSession(exported.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)
    (eval_mode,) = session.run(None, {"x": x})
    np.testing.assert_allclose(eval_mode, want, rtol=1e-5, atol=1e-5)


def test_value_bound_is_the_input_bound_plus_the_running_mean():
    from tr_onnx.compiler import dispatch

    model = _model()
    imported = tr_onnx.InferenceSession(model, plugins=[tr_onnx_example_ops]).imported
    graph = imported.specialize({"x": (N, D)}, {}, control_flow.resolve)
    dispatch(graph, imported.registry, "numpy")
    bounds = value_bounds.magnitude_bounds(graph, 2.0)
    p = _initial(model)
    assert bounds["y"] == pytest.approx(bounds["h"] + np.abs(p["rm"]).max())
    x = np.full((N, D), 2.0, np.float32) * np.sign(p["W"][0])  # the first row's worst case
    assert np.abs(x @ p["W"].T + p["b"] - p["rm"]).max() <= bounds["y"]


def test_float32_ports_are_declared_in_the_opdef():
    training = next(d for d in tr_onnx_example_ops.batch_center.OPDEFS
                    if d.op_type == "BatchCenterTraining")
    assert (training.fp32_inputs, training.fp32_outputs) == ((1,), (1,))
