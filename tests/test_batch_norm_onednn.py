"""float32 BatchNormalization in training mode and its gradient through oneDNN
(ops.batch_norm_onednn) against PyTorch autograd in float64, onnx.reference (running
statistics) and our own NumPy kernels: image maps (channels-last in the arena, at channel
alignment 1 and 8), BatchNorm1d's [N, C] and [N, C, L]; a NaN in the batch; frozen statistics
(training=0) and float64 run NumPy.

oneDNN is part of the test extra on Linux x86-64 (``onednn-cpu-gomp``): there these tests
require it rather than skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradcheck import Const, GradCase, build_model
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tr_onnx import InferenceSession
from tr_onnx.ops import batch_norm_onednn
from tr_onnx.training.gradients import vjp

EPS, MOMENTUM = 1e-5, 0.9
# float32 against float64. The NumPy kernels' own errors on these cases: y 2.4e-6, gx 1.5e-6,
# gscale / gbias 3.1e-5 (sums over 288 pixels); oneDNN's are of the same size
RTOL, ATOL = 1e-5, 1e-4
CASES = {  # id: (x shape, channel alignment)
    "image": ((8, 16, 6, 6), 1),
    "image_align8": ((8, 16, 6, 6), 8),
    "padded_channels": ((4, 5, 3, 3), 8),  # 5 channels in 8 lanes
    "bn1d": ((16, 10), 1),
    "bn1d_sequence": ((4, 6, 10), 1),
}
KERNELS = ("training", "grad")


@pytest.fixture
def used(monkeypatch):
    """Names of the oneDNN batch-norm kernels that built a step."""
    require_onednn()
    return spy_kernels(monkeypatch, batch_norm_onednn, KERNELS)


def _numpy_only(monkeypatch):
    for name in KERNELS:
        monkeypatch.setattr(batch_norm_onednn, name, lambda *args: None)


def _case(shape, seed=0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    scale = rng.standard_normal(c).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    mean = rng.standard_normal(c).astype(np.float32)
    var = rng.uniform(0.5, 2, c).astype(np.float32)
    cot = rng.standard_normal(shape).astype(np.float32)
    return x, scale, bias, mean, var, cot


def _training_case(x, scale, bias, mean, var) -> GradCase:
    return GradCase("bn", "BatchNormalization", [x, scale, bias, Const(mean), Const(var)],
                    {"epsilon": EPS, "momentum": MOMENTUM, "training_mode": 1}, opset=15,
                    n_outputs=3, output_shapes=[x.shape, mean.shape, mean.shape])


def _ours(x, scale, bias, mean, var, cot, align):
    model = build_model(_training_case(x, scale, bias, mean, var))
    feed = {"x0": x, "x1": scale, "x2": bias}
    y, grads = vjp(model, feed, list(feed), cot, channel_align=align)
    return [y] + [grads[n] for n in feed]


def _torch(x, scale, bias, mean, var, cot):
    ts = [torch.tensor(v.astype(np.float64), requires_grad=True) for v in (x, scale, bias)]
    y = torch.nn.functional.batch_norm(ts[0], torch.tensor(mean, dtype=torch.float64),
                                       torch.tensor(var, dtype=torch.float64), ts[1], ts[2],
                                       training=True, momentum=1 - MOMENTUM, eps=EPS)
    y.backward(torch.tensor(cot.astype(np.float64)))
    return [y.detach().numpy()] + [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("case", list(CASES))
def test_batch_norm_and_its_gradient_match_torch_and_numpy(case, used, monkeypatch):
    shape, align = CASES[case]
    inputs = _case(shape)
    got = _ours(*inputs, align)
    if case != "padded_channels":  # oneDNN offers only its reference loop for padded lanes
        assert set(used) == set(KERNELS)
    want = _torch(*inputs)
    for name, g, w in zip(("y", "gx", "gscale", "gbias"), got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)
    _numpy_only(monkeypatch)
    reference = _ours(*inputs, align)
    for name, g, r in zip(("y", "gx", "gscale", "gbias"), got, reference):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL, err_msg=name)


def _statistics_model(x, scale, bias, mean, var):
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"],
                            ["y", "running_mean", "running_var"], epsilon=EPS,
                            momentum=MOMENTUM, training_mode=1)
    graph = helper.make_graph(
        [node], "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
         for n, shape in (("y", list(x.shape)), ("running_mean", [x.shape[1]]),
                          ("running_var", [x.shape[1]]))],
        [numpy_helper.from_array(a, n) for a, n in ((scale, "s"), (bias, "b"), (mean, "m"),
                                                     (var, "v"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


@pytest.mark.parametrize("align", [1, 8])
def test_running_statistics_match_onnx_reference(used, align):
    x, scale, bias, mean, var, _ = _case((6, 8, 5, 5), seed=1)
    model = _statistics_model(x, scale, bias, mean, var)
    got = InferenceSession(model, channel_align=align).run(None, {"x": x})
    assert used == ["training"]
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for name, g, w in zip(("y", "running_mean", "running_var"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_nan_in_the_batch_spreads_as_in_numpy(used, monkeypatch):
    """A NaN makes its channel's statistics NaN, so the whole channel's y and its gradients,
    as the NumPy kernels and PyTorch compute them; the other channels stay finite."""
    x, scale, bias, mean, var, cot = _case((4, 6, 3, 3), seed=2)
    x[1, 2, 0, 1] = np.nan
    got = _ours(x, scale, bias, mean, var, cot, 1)
    assert set(used) == set(KERNELS)
    _numpy_only(monkeypatch)
    reference = _ours(x, scale, bias, mean, var, cot, 1)
    for name, g, r in zip(("y", "gx", "gscale", "gbias"), got, reference):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=name)
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL, err_msg=name)
    assert np.isnan(got[0][:, 2]).all() and np.isfinite(np.delete(got[0], 2, axis=1)).all()


def test_frozen_statistics_and_float64_run_numpy(used):
    """training=0 (BatchNormalization in inference mode, differentiated: gx = a * gy) and
    float64 batches take the NumPy kernels."""
    x, scale, bias, mean, var, cot = _case((4, 6, 3, 3), seed=3)
    frozen = build_model(GradCase("bn", "BatchNormalization",
                                  [x, scale, bias, Const(mean), Const(var)], {"epsilon": EPS},
                                  output_shapes=[x.shape]))
    vjp(frozen, {"x0": x}, ["x0"], cot)
    assert used == []
    wide = [a.astype(np.float64) for a in (x, scale, bias, mean, var, cot)]
    got = _ours(*wide, 1)
    assert used == []
    for name, g, w in zip(("y", "gx", "gscale", "gbias"), got, _torch(*wide)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=name)
