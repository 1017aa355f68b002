"""The erf GELU chain ``x * 0.5 * (1 + erf(x / sqrt(2)))`` fused into one Gelu node
(tr_onnx/passes/fusions.py) and float32 Gelu / GeluGrad through oneDNN (ops/unary.py):

1. ``nn.GELU`` as torch.onnx exports it (classic exporter, opset 17: Div, Erf, Add, Mul, Mul):
   the plan runs one Gelu and no Erf; forward vs onnxruntime, losses and the trained export vs
   PyTorch (the parity harness), and one step's weights vs PyTorch's to float32 rounding.
2. Every operand order of the chain, and its Mul-by-1/sqrt(2) form, is fused and equals
   onnxruntime; a chain with an intermediate read elsewhere or that is a model output, a
   constant that is not the GELU's, or a scalar initializer (a parameter: it may train) is left
   as it is.
3. oneDNN's Gelu and GeluGrad (erf and tanh forms) against float64 x Phi(x) and torch's float64
   autograd: within 4 ulp of max(|x|, 1) (the chain's own float32 error is of that size: 1 +
   erf cancels in the tail), NaN where the chain gives NaN; padded channels-last equals plain.

oneDNN is part of the test extra on Linux x86-64: there the fused path must be the one tested.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, export, run_case

import tr_onnx
from tr_onnx.ops import unary, unary_onednn
from tr_onnx.passes import fusions
from tr_onnx.training.gradients import vjp

F32_EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True)
def needs_onednn():
    require_onednn()  # without it the chain runs unfused


def _ops(session, feed) -> list[str]:
    plan = session.plan_for(feed)
    return [n.op_type for n in plan.graph.nodes]


# ---- 1. torch's export ----------------------------------------------------------------------

def _gelu_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))


def _batch(k):
    rng = np.random.default_rng(k)
    return ({"x": (rng.standard_normal((6, 16)) * 2).astype(np.float32)},
            rng.integers(0, 5, 6).astype(np.int64))


@pytest.mark.parametrize("exporter", ["classic", "dynamo"])
def test_torch_gelu_export_trains_as_pytorch(exporter, tmp_path):
    result = run_case(ParityCase(f"gelu-{exporter}", _gelu_mlp, _batch, exporter=exporter,
                                 dynamic_axes={"x": {0: "batch"}}), tmp_path)
    assert_parity(result)
    if exporter == "classic":
        assert {"Erf", "Div"} <= {n.op_type for n in onnx.load(result.path).graph.node}
        ops = [n.op_type for plan in result.session._plans.values() for n in plan.graph.nodes]
        assert "Gelu" in ops and "GeluGrad" in ops and "Erf" not in ops, ops
        trained = onnx.load(tmp_path / "gelu-classic_trained.onnx")  # the model's own nodes
        assert [n.op_type for n in trained.graph.node] == \
            [n.op_type for n in onnx.load(result.path).graph.node]


def test_one_step_equals_pytorch_to_float32_rounding(tmp_path):
    """One SGD step's weights: the fused Gelu's gradient is PyTorch's up to float32 rounding."""
    module = _gelu_mlp()
    path = export(ParityCase("gelu", _gelu_mlp, _batch), module, tmp_path / "gelu.onnx")
    feed, labels = _batch(0)
    session = tr_onnx.TrainingSession(path, loss="cross_entropy",
                                      optimizer=tr_onnx.optim.SGD(lr=1.0))
    session.train_step(feed, labels)
    loss = F.cross_entropy(module(torch.from_numpy(feed["x"])), torch.from_numpy(labels))
    loss.backward()
    ours = session.parameters()
    for name, p in module.named_parameters():
        want = (p - p.grad).detach().numpy()
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=2e-6, err_msg=name)


# ---- 2. the chain's forms --------------------------------------------------------------------

SQRT2 = math.sqrt(2.0)


def _chain_model(form: str, *, scale=SQRT2, half=0.5, extra_output: str | None = None,
                 initializer_scalars: bool = False, reuse_erf: bool = False) -> onnx.ModelProto:
    """x [3, 7] -> MatMul w -> h -> GELU chain ``form`` -> g -> MatMul v -> out."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((7, 9)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((9, 4)).astype(np.float32), "v")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"])]
    scalars = {"k": scale if form != "mul_inv" else 1.0 / scale, "one": 1.0, "half": half}
    for name, value in scalars.items():
        if initializer_scalars:
            inits.append(numpy_helper.from_array(np.array(value, np.float32), name))
        else:
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
                np.array(value, np.float32))))
    scale_op = "Mul" if form == "mul_inv" else "Div"
    nodes += [helper.make_node(scale_op, ["h", "k"], ["s"]),
              helper.make_node("Erf", ["s"], ["e"]),
              helper.make_node("Add", ["one", "e"], ["a"])]
    if form in ("torch", "mul_inv"):  # (h * a) * 0.5
        nodes += [helper.make_node("Mul", ["h", "a"], ["m"]),
                  helper.make_node("Mul", ["m", "half"], ["g"])]
    elif form == "half_first":  # (0.5 * h) * a
        nodes += [helper.make_node("Mul", ["half", "h"], ["m"]),
                  helper.make_node("Mul", ["a", "m"], ["g"])]
    elif form == "half_of_sum":  # h * (a * 0.5)
        nodes += [helper.make_node("Mul", ["a", "half"], ["m"]),
                  helper.make_node("Mul", ["m", "h"], ["g"])]
    nodes.append(helper.make_node("MatMul", ["g", "v"], ["out"]))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 4])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, [3, 9]))
    if reuse_erf:  # the Erf's output read by a node outside the chain
        nodes.append(helper.make_node("Neg", ["e"], ["ne"]))
        outputs.append(helper.make_tensor_value_info("ne", TensorProto.FLOAT, [3, 9]))
    graph = helper.make_graph(nodes, "gelu_chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 7])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run_both(model):
    x = (np.random.default_rng(2).standard_normal((3, 7)) * 2).astype(np.float32)
    session = tr_onnx.InferenceSession(model.SerializeToString())
    ours = session.run(None, {"x": x})
    theirs = ort_run(model.SerializeToString(), {"x": x})
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return _ops(session, {"x": x})


@pytest.mark.parametrize("form", ["torch", "mul_inv", "half_first", "half_of_sum"])
def test_each_form_of_the_chain_is_fused(form):
    ops = _run_both(_chain_model(form))
    assert ops.count("Gelu") == 1 and not {"Erf", "Div", "Add"} & set(ops), ops
    assert ops.count("Mul") == 0 and ops.count("MatMul") == 2, ops


@pytest.mark.parametrize("variant", [
    {"extra_output": "m"}, {"extra_output": "h", "form": "torch"}, {"reuse_erf": True},
    {"scale": 1.5}, {"half": 0.25}, {"initializer_scalars": True}])
def test_what_is_not_the_gelu_chain_is_left_alone(variant):
    variant = dict(variant)
    form = variant.pop("form", "torch")
    ops = _run_both(_chain_model(form, **variant))
    if variant == {"extra_output": "h"}:  # h is read again, but the chain is whole: fused
        assert "Gelu" in ops, ops
    else:
        assert "Erf" in ops and "Gelu" not in ops, (variant, ops)


def test_the_fusion_is_for_float32_with_onednn(monkeypatch):
    monkeypatch.setattr(fusions, "_fast_gelu", lambda dtype, backend: False)
    ops = _run_both(_chain_model("torch"))
    assert "Erf" in ops and "Gelu" not in ops


# ---- 3. oneDNN's kernels ---------------------------------------------------------------------

def _exact_gelu(x: np.ndarray, approximate: str) -> torch.Tensor:
    return F.gelu(torch.tensor(x.astype(np.float64)), approximate=approximate)


def _gelu_model(shape, approximate: str) -> onnx.ModelProto:
    node = helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)
    graph = helper.make_graph(
        [node], "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _grid() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([np.linspace(-12, 12, 4803), rng.standard_normal(3000) * 3,
                           [0.0, -0.0, 1e-30, -1e-30, 1e-40, 40.0, -40.0, 1e3, -1e3]]
                          ).astype(np.float32).reshape(-1, 7)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_onednn_gelu_and_its_gradient_match_float64(approximate, monkeypatch):
    x = _grid()
    gy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    model = _gelu_model(x.shape, approximate)
    built = spy_kernels(monkeypatch, unary, ["onednn_gelu"])
    y, grads = vjp(model, {"x": x}, ["x"], gy)
    assert built == ["onednn_gelu"] * 2  # oneDNN ran Gelu and GeluGrad, not NumPy
    exact = _exact_gelu(x, approximate)
    bound = 4 * F32_EPS * np.maximum(np.abs(x.astype(np.float64)), 1.0)
    assert np.all(np.abs(y - exact.numpy()) <= bound)
    x64 = torch.tensor(x.astype(np.float64), requires_grad=True)
    F.gelu(x64, approximate=approximate).backward(torch.tensor(gy.astype(np.float64)))
    grad_bound = 8 * F32_EPS * np.maximum(np.abs(gy.astype(np.float64)) *
                                          np.maximum(np.abs(x.astype(np.float64)), 1.0), 1e-30)
    assert np.all(np.abs(grads["x"] - x64.grad.numpy()) <= grad_bound)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_onednn_gelu_special_values_are_numpys(approximate, monkeypatch):
    """NaN, infinities and overflow (the tanh form cubes x) give what the NumPy kernels give,
    which equal the chains of standard ops bit for bit (tests/test_grad_named_unary.py)."""
    x = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, 3.0], np.float32)
    gy = np.ones_like(x)
    model = _gelu_model(x.shape, approximate)
    with np.errstate(all="ignore"):
        fast = vjp(model, {"x": x}, ["x"], gy)
        monkeypatch.setattr(unary, "onednn_gelu", lambda ctx, infos: None)
        numpy_kernels = vjp(model, {"x": x}, ["x"], gy)
    for got, want in ((fast[0], numpy_kernels[0]), (fast[1]["x"], numpy_kernels[1]["x"])):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_restoring_inf_after_onednn_gelu(approximate, monkeypatch):
    """Where oneDNN's gelu loses +inf (its AVX-512 gelu_erf: ``unary_onednn._gelu_loses_inf``), the
    kernel puts +inf back where x is +inf and changes nothing else; forced here, so that the
    path runs on any machine. A run without +inf (or NaN) in x skips the mask."""
    require_onednn()
    monkeypatch.setattr(unary_onednn, "_gelu_loses_inf", lambda alg: True)
    x = _grid()
    x[0, :4] = [np.inf, np.nan, -np.inf, np.inf]
    session = tr_onnx.InferenceSession(_gelu_model(x.shape, approximate))
    with np.errstate(all="ignore"):
        (y,) = session.run(None, {"x": x})
        monkeypatch.setattr(unary, "onednn_gelu", lambda ctx, infos: None)
        (want,) = tr_onnx.InferenceSession(_gelu_model(x.shape, approximate)).run(
            None, {"x": x})
    assert y[0, 0] == np.inf and y[0, 3] == np.inf and np.isnan(y[0, 1])
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_allclose(y[~np.isnan(y)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)
    finite = _grid()
    (y_finite,) = session.run(None, {"x": finite})
    assert np.all(np.isfinite(y_finite))
