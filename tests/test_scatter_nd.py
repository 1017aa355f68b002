"""ScatterND beyond the op tables (forward cases: test_ops_tensor.py; gradients:
grad_cases_tensor.py, test_grad_torch_tensor.py): an index out of range is an error naming the
node, whether the indices are fed or known at plan time; the reductions without a gradient
rule say so; and a PyTorch model whose ``slice_scatter`` the dynamo exporter turns into
ScatterND imports, runs like onnxruntime and trains like PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from gradcheck import Const, GradCase, build_model
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.backends.numpy_backend import KernelError
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.training.gradients import vjp

RNG = np.random.default_rng(5)


def scatter_nd_model(indices: np.ndarray, fed: bool) -> onnx.ModelProto:
    """data [5, 6] and updates [m] fed; the indices [m, 2] fed or an initializer."""
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f32, [5, 6]),
              helper.make_tensor_value_info("u", f32, [len(indices)])]
    inits = []
    if fed:
        inputs.append(helper.make_tensor_value_info("i", TensorProto.INT64, list(indices.shape)))
    else:
        inits.append(numpy_helper.from_array(indices, "i"))
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], name="put_rows")
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", f32,
                                                                                   [5, 6])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


OUT_OF_RANGE = np.array([[0, 1], [5, 0], [2, -7]], np.int64)  # 5 >= 5 and -7 < -6


def test_out_of_range_fed_index_names_the_node_and_the_tuple():
    sess = tr_onnx.InferenceSession(scatter_nd_model(OUT_OF_RANGE, fed=True))
    feed = {"x": np.zeros((5, 6), np.float32), "u": np.ones(3, np.float32)}
    with pytest.raises(KernelError, match=r"node 'put_rows' \(ScatterND, ai.onnx v18\).*"
                                          r"index tuple \[5, 0\] at indices\[1\] is out of "
                                          r"range for the data's leading dims \[5, 6\]"):
        sess.run(None, {**feed, "i": OUT_OF_RANGE})
    ok = np.array([[0, 1], [4, 0], [2, -6]], np.int64)  # the same plan, in-range indices
    (y,) = sess.run(None, {**feed, "i": ok})
    assert y.sum() == 3 and y[0, 1] == y[4, 0] == y[2, 0] == 1


def test_out_of_range_constant_index_is_refused_when_the_plan_is_made():
    sess = tr_onnx.InferenceSession(scatter_nd_model(OUT_OF_RANGE[[0, 2]], fed=False))
    feed = {"x": np.zeros((5, 6), np.float32), "u": np.ones(2, np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"node 'put_rows' \(ScatterND, ai.onnx "
                                                    r"v18\): index tuple \[2, -7\] at "
                                                    r"indices\[1\] is out of range"):
        sess.run(None, feed)


@pytest.mark.parametrize("reduction, opset", [("mul", 16), ("max", 18), ("min", 18)])
def test_reductions_without_a_rule_refuse_the_gradient_by_name(reduction, opset):
    case = GradCase("scatter_nd_" + reduction, "ScatterND",
                    [RNG.standard_normal((4, 3)), Const(np.array([[1], [-1]], np.int64)),
                     RNG.standard_normal((2, 3))], {"reduction": reduction}, opset=opset)
    model = build_model(case)
    model.graph.node[0].name = "reduce_rows"
    feed = {"x0": np.asarray(case.inputs[0]), "x2": np.asarray(case.inputs[2])}
    with pytest.raises(UnsupportedModelError, match=rf"node 'reduce_rows' \(ScatterND, ai.onnx "
                                                    rf"v{opset}\): no gradient for ScatterND "
                                                    rf"with reduction '{reduction}'"):
        vjp(model, feed, ["x0", "x2"], np.ones((4, 3)))


# ---- a dynamo-exported slice_scatter, end to end ---------------------------------------------

class SliceScatter(torch.nn.Module):
    """Columns 2:5 of one Linear's output replaced by another's, as ``x[:, 2:5] = y`` (or
    Swin's shifted-window bookkeeping) is written functionally; both branches train."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.patch = torch.nn.Linear(6, 3)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.slice_scatter(self.body(x), self.patch(x), dim=1, start=2, end=5)
        return self.head(torch.tanh(h))


def test_dynamo_slice_scatter_runs_like_onnxruntime_and_trains_like_pytorch(tmp_path):
    torch.manual_seed(0)
    model = SliceScatter()
    path = tmp_path / "slice_scatter.onnx"
    torch.onnx.export(model.eval(), (torch.zeros(5, 6),), str(path), dynamo=True,
                      external_data=False, input_names=["input"], verbose=False)
    proto = onnx.load(path)
    assert "ScatterND" in [n.op_type for n in proto.graph.node]  # what this test is about
    x = RNG.standard_normal((5, 6)).astype(np.float32)
    session = tr_onnx.TrainingSession(path, loss="mse", optimizer=tr_onnx.optim.SGD(lr=0.1),
                                      backend="numpy")
    np.testing.assert_allclose(session.run(None, {"input": x})[0], ort_run(proto, {"input": x})[0],
                               rtol=0, atol=1e-5)

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = RNG.standard_normal((5, 6)).astype(np.float32)
        target = RNG.standard_normal((5, 4)).astype(np.float32)
        want = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(target))
        optim.zero_grad()
        want.backward()
        optim.step()
        got = session.train_step({"input": x}, target)
        assert abs(got - want.item()) <= 1e-5, (step, got, want.item())
    params = session.parameters()
    for name, p in model.state_dict().items():
        np.testing.assert_allclose(params[name], p.numpy(), rtol=0, atol=1e-5, err_msg=name)
    with torch.no_grad():
        np.testing.assert_allclose(session.run(None, {"input": x})[0],
                                   model(torch.from_numpy(x)).numpy(), rtol=0, atol=1e-5)


class SliceAssign(torch.nn.Module):
    """Features written into a slice of a buffer and a column gated in place: what users write
    as ``h[:, 2:5] = ...`` (exporters emit ScatterND / index_put)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.inp = torch.nn.Linear(6, 8)
        self.gate = torch.nn.Linear(6, 3)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        h[:, 2:5] = torch.tanh(h[:, 2:5]) * torch.sigmoid(self.gate(x))
        h[:, 0] = h[:, 7] * 0.5
        return self.out(torch.relu(h))


def _slice_batch(k):
    rng = np.random.default_rng(40 + k)
    return ({"x": rng.standard_normal((5, 6)).astype(np.float32)},
            rng.integers(0, 4, 5).astype(np.int64))


@pytest.mark.parametrize("exporter", ["classic", "dynamo"])
def test_a_slice_assigning_model_trains_like_pytorch(exporter, tmp_path):
    case = ParityCase(f"slice_assign-{exporter}", SliceAssign, _slice_batch, exporter=exporter,
                      lr=0.2, dynamic_axes={"x": {0: "batch"}})
    result = run_case(case, tmp_path)
    ops = {n.op_type for n in onnx.load(str(result.path)).graph.node}
    assert ops & {"ScatterND", "ScatterElements"}, ops  # the assignment stays a scatter
    assert_parity(result)
