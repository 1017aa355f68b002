"""Import: file errors, unsupported-op report, old IR, external data, opset conversion, symbolic
batch with a plan per concrete shape, schema defaults."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.importer import import_model

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(tr_onnx.ModelLoadError, match="nope.onnx: no such model file"):
        tr_onnx.InferenceSession(tmp_path / "nope.onnx")


def test_truncated_file_is_named(tmp_path):
    data = (ZOO / "lenet.onnx").read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(tr_onnx.ModelLoadError, match=r"truncated\.onnx: not a valid ONNX model"):
        tr_onnx.InferenceSession(bad)


@pytest.mark.parametrize("content", [b"hello, I am not a model\n", b"\x00" * 64, b""],
                         ids=["text", "zeros", "empty"])
def test_non_onnx_file_is_named(tmp_path, content):
    bad = tmp_path / "junk.onnx"
    bad.write_bytes(content)
    with pytest.raises(tr_onnx.ModelLoadError, match=r"junk\.onnx"):
        tr_onnx.InferenceSession(bad)


def test_checker_failure_is_named():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    node = helper.make_node("Relu", ["x"], ["y"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph([node, node], "g", [x], [y]))  # y defined twice
    with pytest.raises(tr_onnx.ModelLoadError, match="fails onnx.checker"):
        tr_onnx.InferenceSession(model)


def _unsupported_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("FancyOp", ["a"], ["b"], name="fancy1", domain="com.example"),
        helper.make_node("FancyOp", ["b"], ["c"], name="fancy2", domain="com.example"),
        helper.make_node("StringNormalizer", ["c"], ["d"], name="normalize"),
        helper.make_node("Other", ["d"], ["e"], name="other", domain="com.acme"),
    ]
    y = helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 20), helper.make_opsetid("com.example", 1),
        helper.make_opsetid("com.acme", 3)])


def test_unsupported_ops_are_all_listed_in_one_error():
    with pytest.raises(tr_onnx.UnsupportedModelError) as err:
        tr_onnx.InferenceSession(_unsupported_model())
    message = str(err.value)
    assert {(d, o) for d, o, _, _ in err.value.missing} == {
        ("com.example", "FancyOp"), ("", "StringNormalizer"), ("com.acme", "Other")}
    for fragment in ["'fancy1'", "'fancy2'", "'normalize'", "'other'", "com.example", "com.acme",
                     "StringNormalizer (domain 'ai.onnx', since_version 10)", "docs/plugins.md"]:
        assert fragment in message
    assert "'ok'" not in message


def test_old_ir_with_initializers_as_inputs_imports():
    path = ZOO / "resnet_opset9_ir3.onnx"
    proto = onnx.load(path)
    assert proto.ir_version == 3 and len(proto.graph.input) > 1
    sess = tr_onnx.InferenceSession(path)
    assert [i.name for i in sess.get_inputs()] == ["input"]
    feed = {"input": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    assert_close_relative(sess.run(None, feed)[0], ort_run(str(path), feed)[0])


def test_external_data_is_loaded(tmp_path):
    proto = onnx.load(ZOO / "mlp.onnx")
    path = tmp_path / "mlp_ext.onnx"
    onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").stat().st_size > 60_000
    feed = {"input": np.ones((2, 64), np.float32)}
    got = tr_onnx.InferenceSession(path).run(None, feed)[0]
    assert_close_relative(got, ort_run(str(ZOO / "mlp.onnx"), feed)[0])


def test_missing_external_data_is_named(tmp_path):
    proto = onnx.load(ZOO / "mlp.onnx")
    path = tmp_path / "mlp_ext.onnx"
    onnx.save_model(proto, path, save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(tr_onnx.ModelLoadError, match="mlp_ext.onnx: external data"):
        tr_onnx.InferenceSession(path)


def test_opset_below_range_is_converted():
    # opset 6 Add with the legacy broadcast attribute; imported by converting to opset 7
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    b = numpy_helper.from_array(np.arange(3, dtype=np.float32), "b")
    node = helper.make_node("Add", ["x", "b"], ["y"], broadcast=1)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    b_input = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])  # IR 3: listed too
    model = helper.make_model(helper.make_graph([node], "g", [x, b_input], [y], [b]),
                              opset_imports=[helper.make_opsetid("", 6)])
    model.ir_version = 3
    imported = import_model(model)
    assert imported.original_opset == 6
    assert imported.proto.opset_import[0].version == 7
    feed = {"x": np.ones((2, 3), np.float32)}
    np.testing.assert_array_equal(tr_onnx.InferenceSession(model).run(None, feed)[0],
                                  np.ones((2, 3), np.float32) + np.arange(3))


def test_symbolic_batch_gets_one_cached_plan_per_shape():
    sess = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    assert sess.get_inputs()[0].shape == ["batch", 1, 8, 8]
    feeds = {b: {"input": np.full((b, 1, 8, 8), 0.5, np.float32)} for b in (2, 5)}
    plans = {b: sess.plan_for(f) for b, f in feeds.items()}
    assert plans[2] is not plans[5]
    assert plans[2].graph.inputs[0].shape == (2, 1, 8, 8)
    sess.run(None, feeds[2])
    assert sess.plan_for(feeds[2]) is plans[2]
    assert len(sess._plans) == 2


def test_schema_defaults_are_filled_once_in_the_framework():
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx")
    plan = sess.plan_for({"input": np.zeros((1, 64), np.float32)})
    gemm = next(n for n in plan.graph.nodes if n.op_type == "Gemm")
    assert gemm.attrs["alpha"] == 1.0 and gemm.attrs["transA"] == 0


def test_const_feed_input_specialises_the_plan():
    # Reshape's shape arriving as a graph input: the plan specialises on its value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])
    model = helper.make_model(helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])],
                                                "g", [x, s], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    sess = tr_onnx.InferenceSession(model)
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    for shape in ([3, 4], [4, 3], [12, 1]):
        (out,) = sess.run(None, {"x": data, "s": np.array(shape, np.int64)})
        np.testing.assert_array_equal(out, data.reshape(shape))
    assert len(sess._plans) == 3


def test_a_node_the_folder_cannot_evaluate_is_left_to_run(monkeypatch):
    """Issue 11, item 2: onnx.reference raised a bare ValueError while folding one BERT export's
    GatherElements, and the import crashed. A node whose folding fails stays in the graph and
    runs with its kernel (here: the evaluator made to fail for GatherElements)."""
    from tr_onnx import constant_folding

    real = constant_folding._evaluate_node

    def failing(node, *args):
        if node.op_type == "GatherElements":
            raise ValueError("the reference evaluator's own error")
        return real(node, *args)

    monkeypatch.setattr(constant_folding, "_evaluate_node", failing)
    # integer initializers are constants (float ones are parameters, never folded)
    data = numpy_helper.from_array(np.arange(12, dtype=np.int64).reshape(3, 4), "data")
    index = numpy_helper.from_array(np.array([[2, 0, 1, 2]], np.int64), "index")
    nodes = [helper.make_node("GatherElements", ["data", "index"], ["picked"], axis=0),
             helper.make_node("Cast", ["picked"], ["as_float"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "as_float"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 4])], [data, index])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = tr_onnx.InferenceSession(model)
    assert [n.op_type for n in sess.imported.proto.graph.node] == ["GatherElements", "Cast",
                                                                    "Add"]
    x = np.ones((1, 4), np.float32)
    want = ort_run(model, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=0, atol=0)


def test_shape_chains_fold_once_input_shapes_are_concrete():
    """Issue 11, item 1: Hugging Face exports compute Expand's shape as
    ``Shape(x) -> Gather -> Range -> Unsqueeze -> Max(initializer) -> Shape``; every value
    depends only on input shapes. The Shape of a value folded earlier in the same fixpoint
    (no value_info left: its dims are its shape) must fold too, or Expand's shape stays
    "computed at run time"."""
    ints = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
            (("zero", 0), ("one", 1), ("axis0", [0]), ("floor", [[0]]))]
    w = numpy_helper.from_array(np.array([[1.5]], np.float32), "w")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["t"], axis=0),
             helper.make_node("Range", ["zero", "t", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "axis0"], ["u"]),
             helper.make_node("Max", ["u", "floor"], ["m"]),
             helper.make_node("Shape", ["m"], ["ms"]),
             helper.make_node("Expand", ["w", "ms"], ["we"]),
             helper.make_node("Mul", ["x", "we"], ["y"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", "t"])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", "t"])], [*ints, w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = tr_onnx.InferenceSession(model)
    for shape in ((2, 5), (3, 7)):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                                   rtol=0, atol=0)
        ops = [n.op_type for n in sess.plan_for({"x": x}).graph.nodes]
        assert ops == ["Expand", "Mul"], ops  # the whole chain folded
