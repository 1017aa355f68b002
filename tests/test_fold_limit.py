"""Constant folding has a size limit (issue 12, item 9): a 171-byte model whose ConstantOfShape
makes [50000, 50000] floats asked NumPy for 9.3 GiB at import. A value larger than
``fold_limit_bytes`` (default 64 MiB) is not folded: its size is known from shape inference
before anything is evaluated, and the node runs as a node. A plan whose arena is larger than
``max_arena_bytes`` (default: the machine's physical memory) is an ``ArenaSizeError`` naming
the largest values and their nodes, before anything is allocated."""

import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.importer import DEFAULT_FOLD_LIMIT_BYTES

MiB = 1 << 20


def _int64(name, value):
    return numpy_helper.from_array(np.array(value, np.int64), name)


def _constant_of_shape_model(shape, value=1.5):
    """ConstantOfShape(shape) -> ReduceSum -> y: only y is an output, so the constant alone
    would be folded (graph outputs never are)."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill",
                              value=numpy_helper.from_array(np.array([value], np.float32))),
             helper.make_node("ReduceSum", ["big"], ["y"], name="total", keepdims=0)]
    graph = helper.make_graph(nodes, "fill", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                              [_int64("shape", shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _peak_bytes(fn):
    """Peak bytes traced (Python and NumPy allocations) while ``fn`` runs, and what it returned
    or raised."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except tr_onnx.TrOnnxError as exc:
            result = exc
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def _op_types(session):
    return [n.op_type for n in session.imported.proto.graph.node]


def test_the_171_byte_model_imports_in_little_memory_and_its_plan_is_a_named_error():
    model = _constant_of_shape_model([50000, 50000])
    assert len(model.SerializeToString()) < 200
    peak, session = _peak_bytes(lambda: tr_onnx.InferenceSession(model,
                                                                 max_arena_bytes=1 << 30))
    assert peak < 16 * MiB, peak  # the constant alone is 9.3 GiB
    assert _op_types(session) == ["ConstantOfShape", "ReduceSum"]
    peak, error = _peak_bytes(lambda: session.run(None, {}))
    assert isinstance(error, tr_onnx.ArenaSizeError), error
    assert peak < 16 * MiB, peak
    message = str(error)
    assert "9.31 GiB" in message and "max_arena_bytes=1073741824" in message
    assert "'big' [50000, 50000] float32" in message
    assert "node 'fill' (ConstantOfShape" in message


def test_by_default_a_plan_larger_than_physical_memory_is_a_named_error():
    session = tr_onnx.InferenceSession(_constant_of_shape_model([1 << 20, 1 << 20]))
    with pytest.raises(tr_onnx.ArenaSizeError, match=r"physical memory .*max_arena_bytes="):
        session.run(None, {})


def test_a_constant_over_the_default_limit_runs_as_a_node():
    """128 MiB of ConstantOfShape (the limit is 64 MiB): importing it asked for 1 GB before."""
    shape = [4096, 8192]
    model = _constant_of_shape_model(shape)
    peak, session = _peak_bytes(lambda: tr_onnx.InferenceSession(model))
    assert peak < 16 * MiB, peak
    assert _op_types(session) == ["ConstantOfShape", "ReduceSum"]
    want = ReferenceEvaluator(model).run(None, {})[0]
    np.testing.assert_allclose(session.run(None, {})[0], want, rtol=1e-6)


def test_a_constant_under_the_default_limit_is_still_folded():
    session = tr_onnx.InferenceSession(_constant_of_shape_model([1024, 1024]))  # 4 MiB
    assert _op_types(session) == ["ReduceSum"]
    assert DEFAULT_FOLD_LIMIT_BYTES == 64 * MiB


def _expanding(op):
    """(nodes, initializers) making c, a [32, 64] float32 value (8 KiB; int64 before the Cast,
    16 KiB), from a few bytes of integer constants (float initializers are parameters, which
    are never folded)."""
    row = _int64("row", np.arange(64))
    to_float = helper.make_node("Cast", ["ci"], ["c"], to=TensorProto.FLOAT)
    return {
        "ConstantOfShape": ([helper.make_node("ConstantOfShape", ["shape"], ["c"], value=(
            numpy_helper.from_array(np.array([0.25], np.float32))))], [_int64("shape", [32, 64])]),
        "Expand": ([helper.make_node("Expand", ["row", "shape"], ["ci"]), to_float],
                   [row, _int64("shape", [32, 64])]),
        "Tile": ([helper.make_node("Tile", ["row2", "reps"], ["ci"]), to_float],
                 [_int64("row2", np.arange(64)[None]), _int64("reps", [32, 1])]),
        "Range": ([helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
                   helper.make_node("Reshape", ["r", "shape"], ["ci"]), to_float],
                  [_int64("start", 0), _int64("limit", 32 * 64), _int64("delta", 1),
                   _int64("shape", [32, 64])]),
    }[op]


@pytest.mark.parametrize("op", ["ConstantOfShape", "Expand", "Tile", "Range"])
def test_fold_limit_bytes_keeps_larger_values_as_nodes(op):
    nodes, inits = _expanding(op)
    nodes = nodes + [helper.make_node("Add", ["x", "c"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 64])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)}
    want = ReferenceEvaluator(model).run(None, feed)[0]
    limited = tr_onnx.InferenceSession(model, fold_limit_bytes=4096)
    unlimited = tr_onnx.InferenceSession(model, fold_limit_bytes=None)
    assert op in _op_types(limited)
    assert _op_types(unlimited) == ["Add"]
    plan = limited.plan_for(feed)
    assert op in [n.op_type for n in plan.graph.nodes]  # the plan runs it too
    for session in (limited, unlimited):
        np.testing.assert_array_equal(session.run(None, feed)[0], want)


def test_training_takes_fold_limit_bytes_and_trains_the_same():
    """An offset made by ConstantOfShape, over the limit: the training session keeps it as a
    node and trains exactly as when it is folded."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array((rng.standard_normal((16, 4)) * 0.3).astype(np.float32), "w")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["offset"], value=(
                 numpy_helper.from_array(np.array([0.5], np.float32)))),
             helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Add", ["h", "offset"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
        [w, _int64("shape", [8, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((8, 16)).astype(np.float32)
    labels = rng.standard_normal((8, 4)).astype(np.float32)
    params = []
    for limit in (64, None):  # the offset is 128 bytes
        session = tr_onnx.TrainingSession(model, loss="mse", optimizer="sgd", lr=0.1,
                                          backend="numpy", fold_limit_bytes=limit)
        assert ("ConstantOfShape" in _op_types(session)) == (limit is not None)
        for _ in range(3):
            session.train_step({"x": x}, labels)
        params.append(session.parameters())
    np.testing.assert_array_equal(params[0]["w"], params[1]["w"])
    assert not np.array_equal(params[0]["w"], numpy_helper.to_array(w))


@pytest.mark.parametrize("limit", [-1, 1.5, "64MB"], ids=["negative", "float", "string"])
def test_a_bad_fold_limit_is_an_error_naming_it(limit):
    with pytest.raises(tr_onnx.InputError, match=f"fold_limit_bytes={limit!r}"):
        tr_onnx.InferenceSession(_constant_of_shape_model([2, 2]), fold_limit_bytes=limit)
