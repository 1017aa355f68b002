"""Loops run as loops (``subplan.Iterations``, the RunLoop kernel): those whose trip count or
condition is known only at run time, and those too long to unroll (issue 35 item 5). Checked
against onnxruntime and onnx.reference (forward), finite differences in float64 (gradients
through the iterations) and PyTorch (a scripted while loop exported by torch.onnx, trained)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.passes.control_flow_rules import MAX_PEELED_ITERATIONS
from tr_onnx.testing.recorder import FakeRecorder
from tr_onnx.training.gradients import vjp

F, D, I64, B = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL
RNG = np.random.default_rng(35)
W = np.array([[0.5, -1.2, 0.9], [1.1, 0.3, -0.7]])


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _while_model(elem=F, trip=2 ** 31 - 1):
    """tf.while_loop as tf2onnx exports it: a trip count of INT_MAX and a condition the body
    computes (i + 1 < n, with n from the data), carrying h = tanh(h * w + x)."""
    body = helper.make_graph([
        helper.make_node("Mul", ["h_in", "w"], ["h1"]),
        helper.make_node("Add", ["h1", "x"], ["h2"]),
        helper.make_node("Tanh", ["h2"], ["h_out"]),
        helper.make_node("Add", ["i", "one"], ["i1"]),
        helper.make_node("Less", ["i1", "n"], ["c_out"]),
    ], "body", [_vi("i", I64, []), _vi("c", B, []), _vi("h_in", elem, [2, 3])],
        [_vi("c_out", B, []), _vi("h_out", elem, [2, 3])],
        [numpy_helper.from_array(np.array(1, np.int64), "one")])
    nodes = [helper.make_node("ReduceMax", ["steps"], ["n"], keepdims=0),
             helper.make_node("Mul", ["x", "x"], ["h0"]),
             helper.make_node("Loop", ["M", "go", "h0"], ["h"], body=body),
             helper.make_node("Mul", ["h", "w"], ["y"])]
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    graph = helper.make_graph(nodes, "while", [_vi("x", elem, [2, 3]), _vi("steps", I64, [1])],
                              [_vi("y", elem, [2, 3])],
                              [numpy_helper.from_array(np.array(trip, np.int64), "M"),
                               numpy_helper.from_array(np.array(True), "go"),
                               numpy_helper.from_array(W.astype(dtype), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_while_loop_whose_length_the_data_decides_equals_both_references():
    model = _while_model()
    session = tr_onnx.InferenceSession(model)
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    for steps in (1, 3, 7, 40):  # one plan: the loop's length is a run-time value
        feed = {"x": x, "steps": np.array([steps], np.int64)}
        (ours,) = session.run(None, feed)
        np.testing.assert_allclose(ours, ort_run(model, feed)[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(ours, ReferenceEvaluator(model).run(None, feed)[0], rtol=0,
                                   atol=1e-6)
    assert "RunLoop" in {n.op_type for n in session.plan_for(feed).graph.nodes}


def test_gradients_through_the_iterations_equal_finite_differences():
    model = _while_model(D)
    x, cot = RNG.standard_normal((2, 3)), RNG.standard_normal((2, 3))
    steps = np.array([5], np.int64)
    _, grads = vjp(model, {"x": x, "steps": steps}, ["x", "w"], cot)

    def objective(xv, wv):
        m = _while_model(D)
        m.graph.initializer[2].CopyFrom(numpy_helper.from_array(wv, "w"))
        return float((ReferenceEvaluator(m).run(None, {"x": xv, "steps": steps})[0] * cot).sum())

    eps = 1e-6
    for name, base in (("x", x), ("w", W)):
        fd = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            up, down = base.copy(), base.copy()
            up[idx] += eps
            down[idx] -= eps
            args_up, args_down = ((up, W), (down, W)) if name == "x" else ((x, up), (x, down))
            fd[idx] = (objective(*args_up) - objective(*args_down)) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, rtol=1e-7, atol=1e-8)


@torch.jit.script
def _settle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A while loop on a condition of the data (scripted, the classic exporter keeps it as a
    Loop with an INT64_MAX trip count whose body computes the condition)."""
    h = x
    i = 0
    while i < 6 and bool((h * h).mean() > 0.02):
        h = 0.5 * torch.tanh(torch.nn.functional.linear(h, w, b))
        i += 1
    return h


class _Settle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.out(_settle(x, self.lin.weight, self.lin.bias))


def _build_settle():
    torch.manual_seed(0)
    return _Settle()


def _settle_batch(k):
    rng = np.random.default_rng(k)
    scale = (0.1, 1.0, 3.0, 0.5, 2.0)[k % 5]  # batches that stop after different iterations
    return ({"x": (scale * rng.standard_normal((4, 4))).astype(np.float32)},
            rng.integers(0, 5, 4).astype(np.int64))


def test_a_scripted_while_loop_export_trains_like_pytorch(tmp_path):
    case = ParityCase("while-loop", _build_settle, _settle_batch, lr=0.5,
                      dynamic_axes={"x": {0: "batch"}})
    result = run_case(case, tmp_path)
    assert_parity(result)
    plan = result.session._train_plan(_settle_batch(0)[0])
    assert "RunLoop" in {n.op_type for n in plan.graph.nodes}
    assert not result.session.imported.const_feeds  # not a plan per batch of x


def _counting_model(trip: int, limit: int | None = None):
    """v += 1 for each iteration: ``trip`` of them, or while i < limit (a condition the body
    computes from the iteration number alone, which folding decides one iteration at a
    time)."""
    nodes = [helper.make_node("Add", ["v", "one"], ["v_next"])]
    cond = ["c"]
    if limit is not None:
        nodes.append(helper.make_node("Less", ["i", "limit"], ["c_next"]))
        cond = ["c_next"]
    body = helper.make_graph(
        nodes, "body", [_vi("i", I64, []), _vi("c", B, []), _vi("v", F, [2])],
        [_vi(cond[0], B, []), _vi("v_next", F, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "one")]
        + ([numpy_helper.from_array(np.array(limit, np.int64), "limit")] if limit else []))
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["y"], body=body)], "count",
        [_vi("x", F, [2])], [_vi("y", F, [2])],
        [numpy_helper.from_array(np.array(trip, np.int64), "M")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("trip,limit", [(60_000, None), (10 ** 6, 199)],
                         ids=["too_long_to_unroll", "condition_open_after_the_peeled"])
def test_a_loop_too_long_to_unroll_runs_as_a_loop(trip, limit):
    """60,000 iterations of two nodes pass MAX_UNROLLED_NODES; a condition folding decides
    one iteration at a time is unrolled for MAX_PEELED_ITERATIONS of them, then runs as a
    loop (it took a round over the model per iteration)."""
    model = _counting_model(trip, limit)
    session = tr_onnx.InferenceSession(model)
    feed = {"x": np.array([0.5, -2.0], np.float32)}
    (ours,) = session.run(None, feed)
    np.testing.assert_array_equal(ours, ort_run(model, feed)[0])
    np.testing.assert_array_equal(ours, feed["x"] + (trip if limit is None else limit + 1))
    ops = [n.op_type for n in session.plan_for(feed).graph.nodes]
    assert ops.count("RunLoop") == 1 and len(ops) <= 2 * MAX_PEELED_ITERATIONS + 1, ops


def test_a_run_time_loop_with_scan_outputs_is_a_named_error():
    body = helper.make_graph(
        [helper.make_node("Tanh", ["h"], ["h_next"]),
         helper.make_node("ReduceMax", ["h_next"], ["top"], keepdims=0),
         helper.make_node("Greater", ["top", "zero"], ["c_next"]),
         helper.make_node("Identity", ["h_next"], ["slice"])],
        "body", [_vi("i", I64, []), _vi("c", B, []), _vi("h", F, [2])],
        [_vi("c_next", B, []), _vi("h_next", F, [2]), _vi("slice", F, [2])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["y", "ys"], body=body, name="loop")], "g",
        [_vi("x", F, [2])], [_vi("y", F, [2]), _vi("ys", F, ["n", 2])],
        [numpy_helper.from_array(np.array(10, np.int64), "M")]),
        opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedModelError, match=r"node 'loop' \(Loop.*condition .* depends "
                       r"on data, so it would run as a loop.*cannot have scan outputs \(\['ys'\]"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.ones(2, np.float32)})


def test_a_run_time_loop_on_the_cuda_backend_is_a_named_error():
    recorder = lambda plan: FakeRecorder(plan.memory)  # noqa: E731 - plans, runs nothing
    session = tr_onnx.InferenceSession(_while_model(), backend=CudaBackend(device=recorder))
    with pytest.raises(tr_onnx.TrOnnxError, match="runs on the numpy backend only"):
        session.plan_for({"x": np.zeros((2, 3), np.float32), "steps": np.array([3], np.int64)})
