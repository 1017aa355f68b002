"""Data-dependent shapes and branches inside static plans (tr_onnx.subplan,
tr_onnx.ops.dynamic): forward against onnxruntime, gradients against float64 finite
differences of onnx.reference, PyTorch exports that pool over a boolean mask (NonZero) and take
a data-dependent branch (If) trained against PyTorch, the sub-plan cache, and the named errors.
"""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.errors import ShapeError
from tr_onnx.training.gradients import vjp

F32, F64, BOOL, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "dynamic", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def masked_mean(t=F32, shape=(2, 5, 3)):
    """x[mask].mean(0) as the classic exporter writes it, with a Relu before (outside)."""
    return _model([helper.make_node("Relu", ["x"], ["h"]),
                   helper.make_node("NonZero", ["mask"], ["nz"]),
                   helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
                   helper.make_node("GatherND", ["h", "idx"], ["sel"]),
                   helper.make_node("ReduceMean", ["sel"], ["y"], axes=[0], keepdims=0)],
                  [("x", t, list(shape)), ("mask", BOOL, list(shape[:-1]))],
                  [("y", t, [shape[-1]])])


def compress_sum(t=F32):
    """Rows kept by a run-time condition, summed, times x's first row (a static consumer)."""
    return _model([helper.make_node("Compress", ["x", "c"], ["kept"], axis=0),
                   helper.make_node("ReduceSum", ["kept", "ax0"], ["s"], keepdims=0),
                   helper.make_node("Mul", ["s", "s"], ["y"])],
                  [("x", t, [4, 3]), ("c", BOOL, [4])], [("y", t, [3])],
                  [_ints("ax0", [0])])


def nested_compress(t=F32):
    """A data-dependent condition computed from a data-dependent value: a region inside the
    region's sub-plan."""
    zero = numpy_helper.from_array(np.array(0, np.float32 if t == F32 else np.float64), "zero")
    return _model([helper.make_node("Compress", ["x", "c"], ["a"]),
                   helper.make_node("Greater", ["a", "zero"], ["pos"]),
                   helper.make_node("Compress", ["a", "pos"], ["b"]),
                   helper.make_node("Mul", ["b", "b"], ["b2"]),
                   helper.make_node("ReduceSum", ["b2"], ["y"], keepdims=1)],
                  [("x", t, [2, 4]), ("c", BOOL, [8])], [("y", t, [1])], [zero])


def reshape_by_count(t=F32):
    """A shape computed outside the region (from the condition's count) reshapes inside it:
    the sub-plan is made for that shape's value too."""
    return _model([helper.make_node("Compress", ["x", "c"], ["kept"], axis=0),
                   helper.make_node("Cast", ["c"], ["ci"], to=I64),
                   helper.make_node("ReduceSum", ["ci"], ["n"], keepdims=1),
                   helper.make_node("Concat", ["three", "n"], ["shape"], axis=0),
                   helper.make_node("Transpose", ["kept"], ["kt"], perm=[1, 0]),
                   helper.make_node("Reshape", ["kt", "shape"], ["r"]),
                   helper.make_node("ReduceSum", ["r", "ax1"], ["y"], keepdims=0)],
                  [("x", t, [4, 3]), ("c", BOOL, [4])], [("y", t, [3])],
                  [_ints("ax1", [1]), _ints("three", [3])])


def tile_by_count(t=F32):
    """Tile by a count computed from data (no NonZero): the sub-plan binds the repeats by
    value, and x's gradient flows through the Tile."""
    return _model([helper.make_node("Cast", ["c"], ["ci"], to=I64),
                   helper.make_node("ReduceSum", ["ci"], ["k"], keepdims=1),
                   helper.make_node("Tile", ["x", "k"], ["tiled"]),
                   helper.make_node("Mul", ["tiled", "tiled"], ["sq"]),
                   helper.make_node("ReduceSum", ["sq"], ["y"], keepdims=1)],
                  [("x", t, [3]), ("c", BOOL, [4])], [("y", t, [1])])


def unique_stats():
    """Unique's values and counts reduced to static scalars."""
    return _model([helper.make_node("Unique", ["x"], ["u", "first", "inv", "counts"]),
                   helper.make_node("ReduceMax", ["counts"], ["most"], keepdims=1),
                   helper.make_node("ReduceSum", ["u"], ["total"], keepdims=1),
                   helper.make_node("Concat", ["most", "total"], ["y"], axis=0)],
                  [("x", I64, [9])], [("y", I64, [2])], opset=17)


def nms_count():
    """How many boxes NonMaxSuppression keeps from run-time boxes and scores, and the sum of
    their [batch, class, box] rows: static outputs of a data-dependent selection."""
    limits = [_ints("max_out", [3]),
              numpy_helper.from_array(np.array([0.5], np.float32), "iou"),
              numpy_helper.from_array(np.array([0.1], np.float32), "score_min")]
    return _model([helper.make_node("Relu", ["scores"], ["s"]),
                   helper.make_node("NonMaxSuppression",
                                    ["boxes", "s", "max_out", "iou", "score_min"], ["sel"]),
                   helper.make_node("ReduceSum", ["sel", "ax0"], ["y"], keepdims=0)],
                  [("boxes", F32, [2, 6, 4]), ("scores", F32, [2, 2, 6])], [("y", I64, [3])],
                  [_ints("ax0", [0]), *limits])


def runtime_if(t=F32):
    """If(sum(x) > 0): then x * w, else -x (w a weight read from the outer scope)."""
    zero = numpy_helper.from_array(np.array(0, np.float32 if t == F32 else np.float64), "zero")
    w = numpy_helper.from_array(np.linspace(0.5, 1.5, 6).reshape(2, 3).astype(
        np.float32 if t == F32 else np.float64), "w")
    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", t, [2, 3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", t, [2, 3])])
    return _model([helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                   helper.make_node("Greater", ["s", "zero"], ["cond"]),
                   helper.make_node("If", ["cond"], ["b"], then_branch=then, else_branch=other),
                   helper.make_node("Tanh", ["b"], ["y"])],
                  [("x", t, [2, 3])], [("y", t, [2, 3])], [zero, w])


RNG = np.random.default_rng(5)


def _feeds(case: str, dtype=np.float32) -> list[dict]:
    """Three feeds per model, with different data-dependent sizes (and both If branches)."""
    rng = np.random.default_rng(len(case))
    if case == "masked_mean":
        masks = [rng.random((2, 5)) > 0.5 for _ in range(3)]
        for m in masks:
            m[0, 0] = True  # never empty: the mean of nothing is NaN
        return [{"x": rng.standard_normal((2, 5, 3)).astype(dtype), "mask": m} for m in masks]
    if case in ("compress_sum", "reshape_by_count"):
        return [{"x": rng.standard_normal((4, 3)).astype(dtype),
                 "c": np.array(c, bool)} for c in ([1, 0, 1, 1], [0, 1, 0, 0], [1, 0, 1, 0])]
    if case == "tile_by_count":
        return [{"x": rng.standard_normal(3).astype(dtype), "c": np.array(c, bool)}
                for c in ([1, 0, 1, 1], [0, 1, 0, 0], [1, 0, 1, 0])]
    if case == "nested_compress":
        return [{"x": rng.standard_normal((2, 4)).astype(dtype),
                 "c": rng.random(8) > p} for p in (0.2, 0.5, 0.7)]
    if case == "unique_stats":
        return [{"x": rng.integers(0, k, 9).astype(np.int64)} for k in (3, 5, 9)]
    if case == "nms_count":  # clusters of overlapping boxes: the kept count varies
        return [{"boxes": np.concatenate([c, c + 0.3], axis=-1).astype(np.float32),
                 "scores": rng.random((2, 2, 6)).astype(dtype) - 0.2}
                for c in (rng.random((2, 6, 2)) * k for k in (0.5, 2.0, 8.0))]
    if case == "runtime_if":
        x = rng.standard_normal((2, 3)).astype(dtype)
        return [{"x": np.abs(x)}, {"x": -np.abs(x)}, {"x": np.abs(x) + 0.5}]
    raise KeyError(case)


MODELS = {"masked_mean": masked_mean, "compress_sum": compress_sum,
          "nested_compress": nested_compress, "unique_stats": unique_stats,
          "reshape_by_count": reshape_by_count, "tile_by_count": tile_by_count,
          "runtime_if": runtime_if, "nms_count": nms_count}


@pytest.mark.parametrize("case", list(MODELS))
def test_a_data_dependent_model_runs_like_onnxruntime_for_every_size(case):
    model = MODELS[case]()
    session = tr_onnx.InferenceSession(model)
    for feed in _feeds(case):
        (ours,) = session.run(None, feed)
        (theirs,) = ort_run(model, feed)
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def _finite_differences(model, feed, cot, h=1e-6) -> np.ndarray:
    """d sum(y * cot) / dx by central differences of onnx.reference, one element at a time."""
    ref = ReferenceEvaluator(model)
    x = feed["x"]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        shifted = []
        for sign in (1, -1):
            xs = x.copy()
            xs[i] += sign * h
            shifted.append(float(np.sum(ref.run(None, {**feed, "x": xs})[0] * cot)))
        grad[i] = (shifted[0] - shifted[1]) / (2 * h)
    return grad


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("case", ["masked_mean", "compress_sum", "nested_compress",
                                  "runtime_if", "reshape_by_count", "tile_by_count",
                                  "masked_mean_4d"])
def test_gradients_through_a_data_dependent_part_match_finite_differences(case, align):
    if case == "masked_mean_4d":  # NCHW data: the layout pass pads its channels at align 8
        model, feeds = masked_mean(F64, (1, 3, 2, 2)), []
        rng = np.random.default_rng(1)
        for _ in range(2):
            mask = rng.random((1, 3, 2)) > 0.4
            mask[0, 0, 0] = True
            feeds.append({"x": rng.standard_normal((1, 3, 2, 2)), "mask": mask})
    else:
        model, feeds = MODELS[case](F64), _feeds(case, np.float64)[:2]
    for feed in feeds:
        y = ReferenceEvaluator(model).run(None, feed)[0]
        cot = np.random.default_rng(3).standard_normal(y.shape)
        _, grads = vjp(model, feed, ["x"], cot, channel_align=align)
        expected = _finite_differences(model, feed, cot)
        np.testing.assert_allclose(grads["x"], expected, rtol=1e-6, atol=1e-7)


def _region(session, feed):
    plan = session.plan_for(feed)
    return next(n for n in plan.graph.nodes if n.op_type == "DynamicRegion").attrs["region"]


def test_a_sub_plan_is_compiled_once_per_size_and_reused():
    session = tr_onnx.InferenceSession(masked_mean())
    x = np.ones((2, 5, 3), np.float32)
    three = np.zeros((2, 5), bool)
    three[0, :3] = True
    five = np.zeros((2, 5), bool)
    five[1, :] = True
    other_three = np.zeros((2, 5), bool)
    other_three[1, 2:] = True
    region = _region(session, {"x": x, "mask": three})
    session.run(None, {"x": x, "mask": three})
    first = region.last
    session.run(None, {"x": x, "mask": five})
    session.run(None, {"x": x, "mask": other_three})
    assert len(region.sub.plans) == 2  # counts 3 and 5
    assert region.last is first  # the same plan (and arena) for a size met before


def test_a_data_dependent_value_reaching_an_output_undecidable_at_plan_time_is_named():
    """NonZero of a trained weight: no model input decides it, so no plan can be made."""
    w = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w")
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    model = _model([helper.make_node("Mul", ["x", "w"], ["xw"]),
                    helper.make_node("Greater", ["w", "zero"], ["pos"]),
                    helper.make_node("NonZero", ["pos"], ["nz"]),
                    helper.make_node("Cast", ["nz"], ["y"], to=F32)],
                   [("x", F32, [3])], [("y", F32, [1, None]), ("xw", F32, [3])], [w, zero])
    with pytest.raises(ShapeError, match=r"NonZero.*'nz'.*depends on data"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.ones(3, np.float32)})


def test_a_runtime_if_whose_branches_differ_in_shape_is_named():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", F32, [2])])
    other = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["e"], axis=0)], "else",
                              [], [helper.make_tensor_value_info("e", F32, [4])])
    # the condition is computed from data: a bool model input would be a plan-time value,
    # whose branch the static control-flow pass inlines (passes.control_flow)
    decide = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
              helper.make_node("Greater", ["total", "zero"], ["cond"])]
    model = _model(decide + [helper.make_node("If", ["cond"], ["y"], then_branch=then,
                                              else_branch=other)],
                   [("x", F32, [2])], [("y", F32, [None])],
                   inits=[numpy_helper.from_array(np.array(0, np.float32), "zero")])
    with pytest.raises(ShapeError, match=r"If.*different or data-dependent shapes"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.ones(2, np.float32)})


# ---- PyTorch exports: trained alike ---------------------------------------------------------


class MaskedPool(torch.nn.Module):
    """Pooling over a boolean mask: h = Linear(x); logits = classifier(h[mask].mean(0))."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.cls = torch.nn.Linear(4, 2)

    def forward(self, x, mask):
        h = torch.tanh(self.lin(x))
        return self.cls(h[mask].mean(0)).unsqueeze(0)


class Branchy(torch.nn.Module):
    """A data-dependent branch: torch.cond(x.sum() > 0, ...) with a weight in each branch."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(3, 4)
        self.cls = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.cond(x.sum() > 0, lambda x: torch.tanh(self.a(x)),
                       lambda x: torch.relu(self.b(x)) * 2.0, (x,))
        return self.cls(h)


def _seeded(cls):
    def build():
        torch.manual_seed(0)
        return cls()
    return build


def _mask_batch(k):
    """A mask with a different count each batch."""
    rng = np.random.default_rng(k)
    mask = rng.random((2, 5)) > 0.5
    mask[0, 0] = True
    return ({"x": rng.standard_normal((2, 5, 3)).astype(np.float32), "mask": mask},
            np.array([k % 2], np.int64))


def _branch_batch(k):
    """Even batches take the then-branch, odd ones the else-branch."""
    rng = np.random.default_rng(k)
    x = np.abs(rng.standard_normal((4, 3)).astype(np.float32))
    return {"x": x if k % 2 == 0 else -x}, rng.integers(0, 2, 4).astype(np.int64)


@pytest.mark.parametrize("case", [
    ParityCase("masked-pool-classic", _seeded(MaskedPool), _mask_batch, lr=0.5),
    ParityCase("masked-pool-dynamo", _seeded(MaskedPool), _mask_batch, exporter="dynamo",
               opset=18, lr=0.5),
    ParityCase("data-branch-dynamo", _seeded(Branchy), _branch_batch, exporter="dynamo",
               opset=18, lr=0.5),
], ids=lambda c: c.id)
def test_a_pytorch_export_with_data_dependent_shapes_trains_like_pytorch(case, tmp_path):
    result = run_case(case, tmp_path)
    assert_parity(result)
