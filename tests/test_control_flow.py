"""Static control flow resolved at specialisation (tr_onnx.passes.control_flow): If with a
plan-time condition inlined, Scan and Loop unrolled, sequences as lists of tensors. Forward
against onnxruntime, gradients through an inlined If against float64 finite differences, the
named errors, and a scripted PyTorch model (the classic exporter emits Loop and If for Python
control flow) trained alike in tr_onnx and PyTorch."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.passes import control_flow
from tr_onnx.testing.recorder import FakeRecorder
from tr_onnx.training.gradients import vjp

F, D, I64, B = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL
RNG = np.random.default_rng(5)


def recorder(plan) -> FakeRecorder:
    return FakeRecorder(plan.memory, policy=EXECUTOR_POLICY)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, opset=17, inits=()):
    graph = helper.make_graph(nodes, "cf", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _same_as_ort(model, feed, atol=1e-6):
    ours = tr_onnx.InferenceSession(model).run(None, feed)
    theirs = ort_run(model.SerializeToString(), feed)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    return ours


def _branches(elem=F):
    """then: x * w (w from the outer scope), with a nested If on the second condition;
    else: x + x."""
    inner = helper.make_node("If", ["c2"], ["t"], then_branch=helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["a"])], "inner_then", [], [_vi("a", elem, [3, 4])]),
        else_branch=helper.make_graph([helper.make_node("Sub", ["x", "w"], ["b"])],
                                      "inner_else", [], [_vi("b", elem, [3, 4])]))
    then = helper.make_graph([inner], "then", [], [_vi("t", elem, [3, 4])])
    other = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"])], "else", [],
                              [_vi("e", elem, [3, 4])])
    return helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)


def test_if_on_bool_inputs_plans_one_branch_per_value_and_matches_onnxruntime():
    model = _model([_branches()], [_vi("c", B, []), _vi("c2", B, []), _vi("x", F, [3, 4]),
                                   _vi("w", F, [3, 4])], [_vi("y", F, [3, 4])])
    sess = tr_onnx.InferenceSession(model)
    assert sess.imported.const_feeds == {"c", "c2"}
    x, w = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    for c, c2 in [(True, True), (True, False), (False, True)]:
        feed = {"c": np.array(c), "c2": np.array(c2), "x": x, "w": w}
        _same_as_ort(model, feed)
        plan = sess.plan_for(feed)
        assert not {n.op_type for n in plan.graph.nodes} & {"If"}
    assert len(sess._plans) == 3  # one plan per condition value


def test_gradient_through_an_inlined_if_matches_finite_differences():
    model = _model([_branches(D)], [_vi("x", D, [3, 4]), _vi("w", D, [3, 4])],
                   [_vi("y", D, [3, 4])], inits=[helper.make_tensor("c", B, [], [True]),
                                                 helper.make_tensor("c2", B, [], [True])])
    x, w = RNG.standard_normal((2, 3, 4))
    cot = RNG.standard_normal((3, 4))
    y, grads = vjp(model, {"x": x, "w": w}, ["x", "w"], cot)
    np.testing.assert_allclose(y, x * w, rtol=1e-12)
    h = 1e-6
    for name, value in (("x", x), ("w", w)):
        d = RNG.standard_normal(value.shape)
        feed = {"x": x, "w": w}
        hi = ort_run(model.SerializeToString(), {**feed, name: value + h * d})[0]
        lo = ort_run(model.SerializeToString(), {**feed, name: value - h * d})[0]
        fd = float(np.sum((hi - lo) * cot)) / (2 * h)
        assert abs(fd - float(np.sum(grads[name] * d))) <= 1e-6 * abs(fd) + 1e-9


def _cumsum_body(elem=F):
    return helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "x_t"], ["scan"])], "body",
        [_vi("s_in", elem, [3]), _vi("x_t", elem, [3])],
        [_vi("s_out", elem, [3]), _vi("scan", elem, [3])])


@pytest.mark.parametrize("attrs,shape", [
    ({}, (4, 3)),
    ({"scan_input_axes": [1], "scan_output_axes": [1]}, (3, 4)),
    ({"scan_input_directions": [1], "scan_output_directions": [1]}, (4, 3)),
    ({"scan_input_axes": [-1], "scan_input_directions": [1], "scan_output_axes": [-1]}, (3, 4)),
], ids=["forward", "axis1", "reverse_both", "negative_axis_reverse_in"])
def test_scan_unrolled_matches_onnxruntime(attrs, shape):
    out_shape = (4, 3) if attrs.get("scan_output_axes", [0])[0] == 0 else (3, 4)
    node = helper.make_node("Scan", ["s", "xs"], ["s_final", "ys"], body=_cumsum_body(),
                            num_scan_inputs=1, **attrs)
    model = _model([node], [_vi("s", F, [3]), _vi("xs", F, list(shape))],
                   [_vi("s_final", F, [3]), _vi("ys", F, list(out_shape))])
    _same_as_ort(model, {"s": RNG.standard_normal(3).astype(np.float32),
                         "xs": RNG.standard_normal(shape).astype(np.float32)})


@pytest.mark.parametrize("directions", [[0], [1]], ids=["forward", "reverse"])
def test_opset8_scan_unrolls_each_batch_entry_and_matches_onnxruntime(directions):
    node = helper.make_node("Scan", ["", "s", "xs"], ["s_final", "ys"], body=_cumsum_body(),
                            num_scan_inputs=1, directions=directions)
    model = _model([node], [_vi("s", F, [2, 3]), _vi("xs", F, [2, 4, 3])],
                   [_vi("s_final", F, [2, 3]), _vi("ys", F, [2, 4, 3])], opset=8)
    _same_as_ort(model, {"s": RNG.standard_normal((2, 3)).astype(np.float32),
                         "xs": RNG.standard_normal((2, 4, 3)).astype(np.float32)})


def _loop(*cond_nodes, inits=()):
    body = helper.make_graph(
        [*cond_nodes, helper.make_node("Add", ["y_in", "x"], ["y_out"]),
         helper.make_node("Cast", ["i"], ["i_f"], to=F),
         helper.make_node("Mul", ["y_out", "i_f"], ["scan"])], "body",
        [_vi("i", I64, []), _vi("cond_in", B, []), _vi("y_in", F, [2])],
        [_vi("cond_out", B, []), _vi("y_out", F, [2]), _vi("scan", F, [2])])
    node = helper.make_node("Loop", ["m", "c", "y0"], ["y", "ys"], body=body)
    return _model([node], [_vi("m", I64, []), _vi("c", B, []), _vi("y0", F, [2]),
                           _vi("x", F, [2])], [_vi("y", F, [2]), _vi("ys", F, ["m", 2])],
                  inits=inits)


def test_loop_with_a_trip_count_input_is_unrolled_and_matches_onnxruntime():
    model = _loop(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    y0, x = RNG.standard_normal((2, 2)).astype(np.float32)
    for m in (1, 4):
        feed = {"m": np.array(m, np.int64), "c": np.array(True), "y0": y0, "x": x}
        y, ys = _same_as_ort(model, feed)
        assert ys.shape == (m, 2)


def test_loop_whose_body_computes_its_condition_from_the_iteration_unrolls_step_by_step():
    """cond_out = i < 2 with M = 5: three iterations, then the condition stops it."""
    model = _loop(helper.make_node("Less", ["i", "two"], ["cond_out"]),
                  inits=[helper.make_tensor("two", I64, [], [2])])
    y0, x = RNG.standard_normal((2, 2)).astype(np.float32)
    feed = {"m": np.array(5, np.int64), "c": np.array(True), "y0": y0, "x": x}
    y, ys = _same_as_ort(model, feed)
    assert ys.shape == (3, 2)


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_loop_whose_condition_depends_on_data_is_a_named_error(backend):
    """cond_out = max(y) > 0: decided by the values the loop computes. The same error on
    both backends (resolution comes before a backend: not "no cuda binding")."""
    model = _loop(helper.make_node("ReduceMax", ["y_in"], ["top"], keepdims=0),
                  helper.make_node("Greater", ["top", "zero"], ["cond_out"]),
                  inits=[helper.make_tensor("zero", F, [], [0.0])])
    feed = {"m": np.array(3, np.int64), "c": np.array(True),
            "y0": np.zeros(2, np.float32), "x": np.ones(2, np.float32)}
    target = CudaBackend(device=recorder) if backend == "cuda" else backend
    with pytest.raises(UnsupportedModelError, match="condition .* depends on data"):
        tr_onnx.InferenceSession(model, backend=target).run(None, feed)


def test_unrolling_past_the_node_limit_is_a_named_error(monkeypatch):
    monkeypatch.setattr(control_flow, "MAX_UNROLLED_NODES", 20)
    model = _loop(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    feed = {"m": np.array(50, np.int64), "c": np.array(True),
            "y0": np.zeros(2, np.float32), "x": np.ones(2, np.float32)}
    with pytest.raises(UnsupportedModelError, match="more than 20 nodes"):
        tr_onnx.InferenceSession(model).run(None, feed)


def test_sequence_ops_inside_a_graph_become_split_and_concat_and_match_onnxruntime():
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=1, keepdims=0),
        helper.make_node("SequenceErase", ["s", "one"], ["s2"]),
        helper.make_node("SequenceInsert", ["s2", "v", "zero"], ["s3"]),
        helper.make_node("SequenceAt", ["s3", "minus_one"], ["last"]),
        helper.make_node("SequenceLength", ["s3"], ["n"]),
        helper.make_node("ConcatFromSequence", ["s3"], ["stacked"], axis=0, new_axis=1),
        helper.make_node("ConcatFromSequence", ["s3"], ["joined"], axis=0),
    ]
    inits = [helper.make_tensor("one", I64, [], [1]), helper.make_tensor("zero", I64, [], [0]),
             helper.make_tensor("minus_one", I64, [], [-1])]
    model = _model(nodes, [_vi("x", F, [2, 3]), _vi("v", F, [2])],
                   [_vi("last", F, [2]), _vi("n", I64, []), _vi("stacked", F, [3, 2]),
                    _vi("joined", F, [6])], inits=inits)
    _same_as_ort(model, {"x": RNG.standard_normal((2, 3)).astype(np.float32),
                         "v": RNG.standard_normal(2).astype(np.float32)})


@torch.jit.script
def _recurrence(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A Python loop over time and a branch on the batch size, scripted: traced around, the
    classic exporter keeps them as a Loop (trip count from Shape) and an If (condition from
    Shape) whose bodies read the weights from the outer scope."""
    h = torch.zeros(x.shape[0], w.shape[0])
    for t in range(x.shape[1]):
        h = torch.tanh(torch.nn.functional.linear(x[:, t], w, b) + h)
    if x.shape[0] > 1:
        h = h * 2.0
    return h


class _ScriptedRecurrence(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.out = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.out(_recurrence(x, self.lin.weight, self.lin.bias))


def _build_scripted():
    torch.manual_seed(0)
    return _ScriptedRecurrence()


def _batch(k):
    rng = np.random.default_rng(k)
    return ({"x": rng.standard_normal((4, 3, 3)).astype(np.float32)},
            rng.integers(0, 5, 4).astype(np.int64))


def test_a_scripted_loop_and_branch_export_trains_like_pytorch(tmp_path):
    case = ParityCase("scripted-loop-if", _build_scripted, _batch, lr=0.5,
                      dynamic_axes={"x": {0: "batch"}})
    result = run_case(case, tmp_path)
    ops = {n.op_type for n in onnx.load(str(result.path)).graph.node}
    assert {"Loop", "If"} <= ops  # what the classic exporter emits for scripted control flow
    assert_parity(result)


def test_an_if_on_a_condition_computed_from_data_is_left_to_the_run_time_if():
    """Not inlined (x stays data, no const feed): ops/dynamic.py plans both branches and runs
    the one the data selects; the two passes agree on who takes which If."""
    cond = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
            helper.make_node("Greater", ["total", "zero"], ["c"])]
    model = _model(cond + [_branches()], [_vi("c2", B, []), _vi("x", F, [3, 4]),
                                          _vi("w", F, [3, 4])], [_vi("y", F, [3, 4])],
                   inits=[helper.make_tensor("zero", F, [], [0.0])])
    assert tr_onnx.InferenceSession(model).imported.const_feeds == {"c2"}
    w = RNG.standard_normal((3, 4)).astype(np.float32)
    for sign in (1, -1):
        _same_as_ort(model, {"c2": np.array(True), "x": sign * np.ones((3, 4), np.float32),
                             "w": w})


def test_an_if_inside_a_scan_body_on_an_outer_bool_input_is_inlined_every_step():
    branch = helper.make_node("If", ["flip"], ["scan"], then_branch=helper.make_graph(
        [helper.make_node("Neg", ["s_out"], ["n"])], "t", [], [_vi("n", F, [3])]),
        else_branch=helper.make_graph([helper.make_node("Identity", ["s_out"], ["i"])], "e", [],
                                      [_vi("i", F, [3])]))
    body = helper.make_graph([helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), branch],
                             "body", [_vi("s_in", F, [3]), _vi("x_t", F, [3])],
                             [_vi("s_out", F, [3]), _vi("scan", F, [3])])
    node = helper.make_node("Scan", ["s", "xs"], ["s_final", "ys"], body=body, num_scan_inputs=1)
    model = _model([node], [_vi("flip", B, []), _vi("s", F, [3]), _vi("xs", F, [5, 3])],
                   [_vi("s_final", F, [3]), _vi("ys", F, [5, 3])])
    assert tr_onnx.InferenceSession(model).imported.const_feeds == {"flip"}
    for flip in (True, False):
        _same_as_ort(model, {"flip": np.array(flip), "s": np.zeros(3, np.float32),
                             "xs": RNG.standard_normal((5, 3)).astype(np.float32)})


@pytest.mark.parametrize("make", [lambda m: tr_onnx.InferenceSession(m, backend="numpy"),
                                  lambda m: tr_onnx.TrainingSession(m, loss="mse",
                                                                    backend="numpy")],
                         ids=["inference", "training"])
def test_a_sequence_output_comes_back_from_run_as_a_list(make):
    node = helper.make_node("SplitToSequence", ["x"], ["parts"], axis=1, keepdims=0)
    graph = helper.make_graph(
        [node], "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (parts,) = make(model).run(["parts"], {"x": x})
    (expected,) = ort_run(model, {"x": x})
    assert len(parts) == len(expected) == 3
    for got, want in zip(parts, expected):
        np.testing.assert_array_equal(got, want)
