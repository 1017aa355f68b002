"""Elementwise gradient rules against PyTorch autograd (float64), Max/Min's tie rule, and the
training-mode ``ai.tr_onnx.DropoutTraining`` (counter-based mask, its gradient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gradcheck import GradCase, build_model, wrt_names
from onnx import TensorProto, helper

import tr_onnx
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.training.gradients import vjp

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

RNG = np.random.default_rng(7)


def _ours(case: GradCase, cot_seed: int = 0):
    model = build_model(case)
    feed = {f"x{i}": x for i, x in enumerate(case.inputs)}
    y0 = tr_onnx.InferenceSession(model).run(["y0"], feed)[0]
    cot = np.random.default_rng(cot_seed).standard_normal(y0.shape)
    y, grads = vjp(model, feed, wrt_names(case), cot, output="y0")
    return y, grads, cot


def _torch(fn, inputs, cot):
    ts = [torch.tensor(x, requires_grad=x.dtype.kind == "f") for x in inputs]
    y = fn(*ts)
    gs = iter(torch.autograd.grad(y, [t for t in ts if t.requires_grad], torch.tensor(cot)))
    return y.detach().numpy(), [next(gs).numpy() if t.requires_grad else None for t in ts]


def f32(value: float) -> float:
    """An attribute's value as the model holds it (ONNX float attributes are float32)."""
    return float(np.float32(value))


# Selu's defaults as ONNX stores them (float32), not PyTorch's float64 constants
SELU_ALPHA, SELU_GAMMA = f32(1.67326319217681884765625), f32(1.05070102214813232421875)


def _pos(*shape):
    return RNG.uniform(0.5, 2.0, shape)


def _away(*shape):  # no value near 0 (the kink of the piecewise activations)
    x = RNG.standard_normal(shape) * 2
    return np.where(np.abs(x) < 0.1, 0.3, x)


# (id, op, attrs, opset, inputs, torch function of the inputs)
TORCH_CASES = [
    ("gelu", "Gelu", {}, 20, [RNG.standard_normal((3, 5)) * 2], F.gelu),
    ("gelu_tanh", "Gelu", {"approximate": "tanh"}, 20, [RNG.standard_normal((3, 5)) * 2],
     lambda x: F.gelu(x, approximate="tanh")),
    ("mish", "Mish", {}, 18, [RNG.standard_normal((3, 5)) * 3], F.mish),
    ("softplus", "Softplus", {}, 17, [RNG.standard_normal((3, 5)) * 3], F.softplus),
    ("softsign", "Softsign", {}, 17, [RNG.standard_normal((3, 5))], F.softsign),
    ("elu", "Elu", {"alpha": 0.7}, 17, [_away(3, 5)], lambda x: F.elu(x, f32(0.7))),
    ("selu", "Selu", {}, 17, [_away(3, 5)], lambda x: SELU_GAMMA * F.elu(x, SELU_ALPHA)),
    ("celu", "Celu", {"alpha": 1.5}, 17, [_away(3, 5)], lambda x: F.celu(x, 1.5)),
    ("hardswish", "HardSwish", {}, 17, [RNG.uniform(-5, 5, (4, 6))], F.hardswish),
    ("hardsigmoid", "HardSigmoid", {"alpha": 0.25, "beta": 0.5}, 17,
     [RNG.uniform(-5, 5, (4, 6))], lambda x: torch.clamp(x * 0.25 + 0.5, 0, 1)),
    ("erf", "Erf", {}, 13, [RNG.standard_normal((3, 5))], torch.erf),
    ("atanh", "Atanh", {}, 17, [RNG.uniform(-0.9, 0.9, (3, 5))], torch.atanh),
    ("acosh", "Acosh", {}, 17, [RNG.uniform(1.1, 3, (3, 5))], torch.acosh),
    ("pow", "Pow", {}, 17, [_pos(2, 3, 4), RNG.standard_normal((3, 1))], torch.pow),
    ("div_bcast", "Div", {}, 17, [RNG.standard_normal((2, 3, 4)), _pos(4)], torch.div),
    ("fmod", "Mod", {"fmod": 1}, 17, [RNG.uniform(-6, 6, (3, 4)), np.array([1.3, -0.7, 2.1, 0.9])],
     torch.fmod),
    ("prelu_channel", "PRelu", {}, 16, [_away(2, 3, 4, 5), RNG.uniform(0.1, 0.4, (3, 1, 1))],
     lambda x, s: F.prelu(x, s.reshape(-1))),
    ("max_bcast", "Max", {}, 17, [RNG.standard_normal((2, 3, 4)), RNG.standard_normal((3, 1))],
     torch.maximum),
    ("where", "Where", {}, 17, [RNG.random((3, 4)) < 0.5, RNG.standard_normal((3, 1)),
                                RNG.standard_normal(4)], torch.where),
]


@pytest.mark.parametrize("op, attrs, opset, inputs, fn", [c[1:] for c in TORCH_CASES],
                         ids=[c[0] for c in TORCH_CASES])
def test_matches_torch_autograd(op, attrs, opset, inputs, fn):
    case = GradCase(op, op, inputs, attrs, opset=opset)
    y, grads, cot = _ours(case)
    y_t, grads_t = _torch(fn, inputs, cot)
    np.testing.assert_allclose(y, y_t, rtol=1e-10, atol=1e-12)
    for i in range(len(inputs)):
        name = f"x{i}"
        if name in grads:
            np.testing.assert_allclose(grads[name], grads_t[i], rtol=1e-9, atol=1e-12,
                                       err_msg=f"{op}: d/d{name}")


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_extremum_ties_go_to_the_first_input(op):
    a = RNG.standard_normal((3, 4))
    b = np.where(RNG.random((3, 4)) < 0.5, a, -a)  # ties at about half the positions
    c = a.copy()  # ties everywhere with a
    _, grads, cot = _ours(GradCase(op, op, [a, b, c]))
    y = (np.maximum if op == "Max" else np.minimum)(a, b)
    first_a = a == y
    np.testing.assert_array_equal(grads["x0"], np.where(first_a, cot, 0))
    np.testing.assert_array_equal(grads["x1"], np.where(first_a, 0, cot))
    np.testing.assert_array_equal(grads["x2"], np.zeros_like(c))


# ---- ai.tr_onnx.DropoutTraining ---------------------------------------------------------------

def dropout_model(shape, ratio, seed, dtype=TensorProto.DOUBLE, pre_pool=False,
                  rows_before=False):
    """x -> [1x1 MaxPool ->] DropoutTraining(x, step[, rows_before]) -> (y, mask); step (and
    rows_before) graph inputs."""
    nodes = []
    x = "x"
    if pre_pool:  # makes x a channels-last (padded) feature map
        nodes.append(helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[1, 1]))
        x = "p"
    extra = ["rows_before"] if rows_before else []
    nodes.append(helper.make_node("DropoutTraining", [x, "step", *extra], ["y", "mask"],
                                  domain="ai.tr_onnx", ratio=ratio, seed=seed))
    graph = helper.make_graph(
        nodes, "dropout_training",
        [helper.make_tensor_value_info("x", dtype, shape),
         helper.make_tensor_value_info("step", TensorProto.INT64, [])] + [
            helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in extra],
        [helper.make_tensor_value_info("y", dtype, shape),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.tr_onnx", 1)])


def _scale(ratio: float) -> float:
    return 1 / (1 - f32(ratio))  # the kernel sees the float32 attribute


def _run_dropout(x, step, ratio=0.3, seed=11):
    dtype = {np.float64: TensorProto.DOUBLE, np.float32: TensorProto.FLOAT}[x.dtype.type]
    sess = tr_onnx.InferenceSession(dropout_model(list(x.shape), ratio, seed, dtype))
    return sess.run(None, {"x": x, "step": np.array(step, np.int64)})


def test_dropout_training_mask_fraction_and_scale():
    x = RNG.standard_normal((64, 1000))
    y, mask = _run_dropout(x, step=5, ratio=0.3)
    assert mask.dtype == np.bool_ and mask.shape == x.shape
    assert abs(mask.mean() - 0.7) < 0.01  # 64000 Bernoulli(0.7) draws: std 0.0018
    np.testing.assert_array_equal(y, np.where(mask, x * _scale(0.3), 0))


def test_dropout_training_mask_is_a_function_of_seed_and_step():
    x = RNG.standard_normal((8, 50))
    _, m5 = _run_dropout(x, step=5)
    _, m5_again = _run_dropout(x, step=5)  # a fresh session: resuming at step 5
    _, m6 = _run_dropout(x, step=6)
    _, m5_seed = _run_dropout(x, step=5, seed=12)
    _, m5_f32 = _run_dropout(x.astype(np.float32), step=5)
    np.testing.assert_array_equal(m5, m5_again)
    np.testing.assert_array_equal(m5, m5_f32)  # the uniforms are float64 whatever x's dtype
    assert (m5 != m6).mean() > 0.2 and (m5 != m5_seed).mean() > 0.2


@pytest.mark.parametrize(("shape", "split", "pre_pool"), [
    ((10, 7), (3, 3, 4), False), ((9, 3, 5), (4, 5), False), ((6, 2, 3, 3), (1, 2, 3), False),
    ((6, 2, 3, 3), (1, 2, 3), True), ((5, 3, 2, 2), (2, 3), True)])
def test_dropout_training_draws_a_ranks_rows_of_the_global_batchs_mask(shape, split, pre_pool):
    """Data parallelism: with ``rows_before`` (the global batch's rows before this shard),
    each shard's mask is its rows of the mask one process draws for the whole batch -- shards
    whose uniforms start amid a Philox counter's four (7, 15 or 18 values per row) and a
    channels-last x included -- so the ranks' masks are disjoint draws, not one repeated."""
    x = RNG.standard_normal(shape)
    whole = tr_onnx.InferenceSession(dropout_model(list(shape), 0.4, 7, pre_pool=pre_pool))
    _, want = whole.run(None, {"x": x, "step": np.array(3, np.int64)})
    start = 0
    for rows in split:
        part = (rows, *shape[1:])
        sess = tr_onnx.InferenceSession(dropout_model(list(part), 0.4, 7, pre_pool=pre_pool,
                                                      rows_before=True))
        y, mask = sess.run(None, {"x": x[start:start + rows], "step": np.array(3, np.int64),
                                  "rows_before": np.array(start, np.int64)})
        np.testing.assert_array_equal(mask, want[start:start + rows], err_msg=f"rows {start}+")
        np.testing.assert_array_equal(y, np.where(mask, x[start:start + rows] * _scale(0.4), 0))
        start += rows
    assert 0.3 < (~want).mean() < 0.5  # a mask that drops, so equal masks are no accident


def test_dropout_training_same_step_same_session():
    x = RNG.standard_normal((4, 30))
    sess = tr_onnx.InferenceSession(dropout_model([4, 30], 0.5, 3))
    runs = [sess.run(["mask"], {"x": x, "step": np.array(s, np.int64)})[0].copy()
            for s in (2, 3, 2)]
    np.testing.assert_array_equal(runs[0], runs[2])
    assert not np.array_equal(runs[0], runs[1])


def test_dropout_training_mask_does_not_depend_on_layout():
    x = RNG.standard_normal((2, 3, 4, 5))
    feed = {"x": x, "step": np.array(9, np.int64)}
    plain = tr_onnx.InferenceSession(dropout_model([2, 3, 4, 5], 0.4, 5), channel_align=1)
    nhwc = tr_onnx.InferenceSession(dropout_model([2, 3, 4, 5], 0.4, 5, pre_pool=True),
                                    channel_align=8)
    y1, m1 = plain.run(None, feed)
    y8, m8 = nhwc.run(None, feed)
    np.testing.assert_array_equal(m1, m8)
    np.testing.assert_array_equal(y1, y8)
    plan = nhwc.plan_for(feed)
    assert all(pad_lanes_are_zero(plan.executor.arena, t) for t in plan.memory.tensors.values())


@pytest.mark.parametrize("ratio", [0.0, 1.0], ids=["ratio0", "ratio1"])
def test_dropout_training_extreme_ratios(ratio):
    x = RNG.standard_normal((3, 7))
    y, mask = _run_dropout(x, step=1, ratio=ratio)
    np.testing.assert_array_equal(mask, np.full(x.shape, ratio == 0.0))
    np.testing.assert_array_equal(y, x if ratio == 0.0 else np.zeros_like(x))


@pytest.mark.parametrize("ratio", [0.0, 0.3], ids=["ratio0", "ratio0.3"])
def test_dropout_training_gradient(ratio):
    """With the step fixed the mask is fixed and y is linear in x: finite differences through
    our own forward (onnx.reference does not know the internal op) and the closed form."""
    shape = [2, 3, 4, 5]
    model = dropout_model(shape, ratio, 21)
    x = RNG.standard_normal(shape)
    step = np.array(4, np.int64)
    sess = tr_onnx.InferenceSession(model)
    y, mask = sess.run(None, {"x": x, "step": step})
    cot = RNG.standard_normal(shape)
    y_v, grads = vjp(model, {"x": x, "step": step}, ["x"], cot, output="y")
    np.testing.assert_array_equal(y_v, y)
    np.testing.assert_allclose(grads["x"], cot * mask * _scale(ratio), rtol=1e-15)
    h = 1e-6
    for _ in range(3):
        d = RNG.standard_normal(shape)
        hi = sess.run(["y"], {"x": x + h * d, "step": step})[0]
        lo = sess.run(["y"], {"x": x - h * d, "step": step})[0]
        fd = float(np.sum((hi - lo) * cot)) / (2 * h)
        assert abs(fd - float(np.sum(grads["x"] * d))) <= 1e-6 * (abs(fd) + 1e-8)
