"""Shared oracle helpers: onnxruntime and onnx.reference runs, and the comparison we use."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort


def ort_run(model: onnx.ModelProto | str, feed: dict, optimize: bool = True) -> list[np.ndarray]:
    """onnxruntime's outputs on CPU. ``optimize=False`` turns its graph optimizations off: they
    fuse QuantizeLinear/DequantizeLinear around Conv/MatMul into integer kernels (QLinearConv
    with a bias quantized to int32), which is not the graph's ONNX semantics."""
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def assert_close_relative(actual: np.ndarray, expected: np.ndarray, rel: float = 1e-5) -> None:
    """|actual - expected| <= rel * max|expected| elementwise: relative to the output's scale.

    A purely elementwise relative test would demand bit-exactness on logits that happen to be
    near zero, which float32 arithmetic in a different order (NHWC, im2col) cannot give.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * max(scale, 1e-30))


def mse_loss_model(classes: int = 10) -> onnx.ModelProto:
    """A user's ONNX loss model spelling out mean squared error (Sub, Mul, ReduceMean): what the
    builtin ``mse`` must equal."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Sub", ["out", "target"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "mse", [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", classes]),
        helper.make_tensor_value_info("target", TensorProto.FLOAT, ["n", classes])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
