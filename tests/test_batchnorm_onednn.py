"""float32 batch normalization in training mode and its gradient through oneDNN
(ops/batchnorm_onednn.py) against PyTorch autograd in float32 and against our NumPy kernels:
y, the running statistics, gx, gscale and gbias; ranks 2 to 5, compact (align 1) and padded
(align 8) channels. Where oneDNN offers only its reference loop (channels padded past their
count) NumPy runs, compared all the same.

oneDNN is part of the test extra on Linux x86-64: there these tests require it.
"""

from __future__ import annotations

import platform

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from tr_onnx import onednn
from tr_onnx.ops import batchnorm_onednn
from tr_onnx.training.gradients import vjp

# float32: oneDNN sums in its own order, NumPy per sample then over the batch, torch in another
RTOL, ATOL = 2e-5, 2e-5
MOMENTUM = 0.9
SHAPES = {"nchw": (8, 32, 6, 5), "nchw_c5": (2, 5, 4, 3), "nc": (16, 12), "ncw": (4, 6, 10),
          "ncdhw": (2, 8, 3, 4, 2)}
# padded lanes (C not a multiple of 8 at align 8; a rank-2 input is stored plain) leave oneDNN
# only its reference loop
ONEDNN_RUNS = {(s, a) for s in SHAPES for a in (1, 8)} - {
    ("nchw_c5", 8), ("ncw", 8)}
KERNELS = ("batch_norm_training_onednn", "batch_norm_grad_onednn")


@pytest.fixture(autouse=True)
def needs_onednn():
    if not onednn.available():
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            pytest.fail("oneDNN is not installed (pip install onednn-cpu-gomp, in tr_onnx[test])")
        pytest.skip("oneDNN has no wheel for this platform")


@pytest.fixture
def used(monkeypatch):
    """Names of the oneDNN kernels that built a step (None returned: NumPy ran)."""
    names = []
    for name in KERNELS:
        real = getattr(batchnorm_onednn, name)

        def spy(*args, real=real, name=name):
            run = real(*args)
            if run is not None:
                names.append(name)
            return run

        monkeypatch.setattr(batchnorm_onednn, name, spy)
    return names


def _inputs(shape):
    rng = np.random.default_rng(3)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    scale, bias = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    mean = rng.standard_normal(c).astype(np.float32)
    var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    cot = rng.standard_normal(shape).astype(np.float32)
    return x, scale, bias, mean, var, cot


def _model(shape) -> onnx.ModelProto:
    c = shape[1]
    _, scale, bias, mean, var, _ = _inputs(shape)
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((scale, "scale"), (bias, "bias"), (mean, "mean"), (var, "var"))]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                            ["y", "running_mean", "running_var"], training_mode=1,
                            momentum=MOMENTUM, epsilon=1e-5)
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [c])
        for n in ("running_mean", "running_var")]
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(shape))], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def _ours(shape, align):
    x, *_, cot = _inputs(shape)
    model = _model(shape)
    results = {}
    for out in ("running_mean", "running_var"):
        value, _ = vjp(model, {"x": x}, [], np.zeros(shape[1], np.float32), output=out,
                       channel_align=align)
        results[out] = value
    y, grads = vjp(model, {"x": x}, ["x", "scale", "bias"], cot, channel_align=align)
    return {"y": y, "gx": grads["x"], "gscale": grads["scale"], "gbias": grads["bias"],
            **results}


def _torch(shape):
    x, scale, bias, mean, var, cot = (torch.tensor(a) for a in _inputs(shape))
    x.requires_grad_(True)
    scale.requires_grad_(True)
    bias.requires_grad_(True)
    # ONNX's running = momentum * running + (1 - momentum) * batch, with the biased batch var
    running_mean, running_var = mean.clone(), var.clone()
    y = F.batch_norm(x, running_mean, running_var, scale, bias, training=True,
                     momentum=1 - MOMENTUM, eps=1e-5)
    y.backward(cot)
    n = x.numel() // x.shape[1]
    biased = (running_var - MOMENTUM * var) * (n - 1) / n + MOMENTUM * var  # undo Bessel
    return {"y": y.detach().numpy(), "gx": x.grad.numpy(), "gscale": scale.grad.numpy(),
            "gbias": bias.grad.numpy(), "running_mean": running_mean.numpy(),
            "running_var": biased.numpy()}


def _close(got, want):
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL * scale,
                                   err_msg=name)


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("shape_id", list(SHAPES))
def test_batch_norm_matches_torch_and_numpy(shape_id, align, used, monkeypatch):
    shape = SHAPES[shape_id]
    got = _ours(shape, align)
    if (shape_id, align) in ONEDNN_RUNS:
        assert sorted(set(used)) == sorted(KERNELS)
    else:
        assert not used
    _close(got, _torch(shape))
    for name in KERNELS:
        monkeypatch.setattr(batchnorm_onednn, name, lambda *args: None)
    _close(got, _ours(shape, align))
