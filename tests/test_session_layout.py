"""InferenceSession's onnxruntime-like surface, bad feeds, and the layout pass on small graphs."""

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.cli import main as cli_main

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def test_get_inputs_outputs_like_onnxruntime():
    sess = tr_onnx.InferenceSession(ZOO / "resnet.onnx")
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert (inp.name, inp.shape, inp.type) == ("input", ["batch", 3, 16, 16], "tensor(float)")
    assert (out.name, out.shape) == ("logits", ["batch", 10])


@pytest.mark.parametrize("feed, message", [
    ({"image": np.zeros((1, 64), np.float32)}, r"unknown input\(s\) \['image'\].*\['input'\]"),
    ({}, r"missing input\(s\) \['input'\]"),
    ({"input": np.zeros((1, 64), np.float64)},
     "input 'input': expected dtype float32, got float64"),
    ({"input": np.zeros((1, 63), np.float32)}, r"input 'input': expected shape \['batch', 64\]"),
    ({"input": np.zeros((64,), np.float32)}, r"input 'input': expected shape \['batch', 64\]"),
], ids=["unknown", "missing", "dtype", "shape", "rank"])
def test_bad_feed_names_the_input(feed, message):
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx")
    with pytest.raises(tr_onnx.InputError, match=message):
        sess.run(None, feed)


def test_unknown_output_name():
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx")
    with pytest.raises(tr_onnx.InputError, match="unknown output"):
        sess.run(["probs"], {"input": np.zeros((1, 64), np.float32)})


def _conv_then(consumer_nodes, out_shape, extra_inits=()):
    """x[2,5,6,6] -> Conv(5->13, 3x3, pad 1) -> consumer_nodes -> y."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((13, 5, 3, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv")
    graph = helper.make_graph([conv, *consumer_nodes], "g", [x], [y], [w, *extra_inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_non_absorbable_reshape_inserts_one_counted_transpose():
    shape = numpy_helper.from_array(np.array([2, 13, 36], np.int64), "shape")
    model = _conv_then([helper.make_node("Reshape", ["c", "shape"], ["r"]),
                        helper.make_node("Softmax", ["r"], ["y"], axis=-1)], [2, 13, 36], [shape])
    feed = {"x": np.random.default_rng(1).standard_normal((2, 5, 6, 6)).astype(np.float32)}
    for align in (1, 8):
        sess = tr_onnx.InferenceSession(model, channel_align=align)
        assert_close_relative(sess.run(None, feed)[0], ort_run(model, feed)[0])
        plan = sess.plan_for(feed)
        assert len(plan.layout.transposes) == 1
        assert plan.layout.absorbed_flattens == []


def test_flatten_into_gemm_is_absorbed_with_padding():
    rng = np.random.default_rng(2)
    wg = numpy_helper.from_array(rng.standard_normal((7, 13 * 36)).astype(np.float32), "wg")
    model = _conv_then([helper.make_node("Relu", ["c"], ["r"]),
                        helper.make_node("Flatten", ["r"], ["f"]),
                        helper.make_node("Gemm", ["f", "wg"], ["y"], transB=1)], [2, 7], [wg])
    feed = {"x": rng.standard_normal((2, 5, 6, 6)).astype(np.float32)}
    sess = tr_onnx.InferenceSession(model, channel_align=8)
    assert_close_relative(sess.run(None, feed)[0], ort_run(model, feed)[0])
    plan = sess.plan_for(feed)
    assert plan.layout.transposes == [] and len(plan.layout.absorbed_flattens) == 1
    w_layout = plan.graph.values["wg"].get_layout()
    assert w_layout.phys_shape == (7, 16 * 36)  # rows in (h, w, c) order, 13 -> 16 lanes
    plan.executor.run(check_pads=True)


def test_inspect_cli_reports_layout_and_arena(capsys):
    assert cli_main(["inspect", str(ZOO / "resnet.onnx"), "--batch", "4",
                     "--channel-align", "8"]) == 0
    out = capsys.readouterr().out
    assert "transposes inserted   0" in out and "flattens absorbed     1" in out
    assert "Conv" in out and "tr_onnx.ops.conv (numpy)" in out
    arena = int(out.split("arena ")[1].split(" B")[0].replace(",", ""))
    naive = int(out.split("naive sum ")[1].split(" B")[0].replace(",", ""))
    assert arena < naive


def test_inspect_cli_error_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"nope")
    assert cli_main(["inspect", str(bad)]) == 2
    assert "bad.onnx" in capsys.readouterr().err
