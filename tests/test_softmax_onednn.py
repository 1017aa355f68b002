"""Softmax through oneDNN's softmax (``tr_onnx.ops.softmax_onednn``) against onnxruntime and a
float64 reference: finite inputs take oneDNN; an input holding NaN, an infinity or a value
whose square overflows takes the NumPy kernel on that run, which gives ONNX's NaN rows (oneDNN
alone gives [NaN, 0, 0, 0] for [NaN, 1, 2, 3], measured)."""

from __future__ import annotations

import numpy as np
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper
from oracles import ort_run

import tr_onnx
from tr_onnx.ops import softmax_onednn

RNG = np.random.default_rng(11)


def softmax_model(shape, axis: int, opset: int = 13):
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=axis)], "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def float64_softmax(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


@pytest.fixture
def built(monkeypatch):
    require_onednn()
    return spy_kernels(monkeypatch, softmax_onednn, ["softmax_step"])


# attention scores, a row longer than oneDNN's vector, v11's coercion of the trailing axes to
# one row
CASES = [((2, 4, 16, 16), -1, 13, (3,)), ((5, 67), 1, 13, (1,)), ((3, 5, 7), 1, 11, (1, 2))]


@pytest.mark.parametrize("shape, axis, opset, axes", CASES)
def test_finite_inputs_run_in_onednn_and_match(built, shape, axis, opset, axes):
    x = (RNG.standard_normal(shape) * 4).astype(np.float32)
    x.reshape(-1)[::7] *= 20  # rows with a wide range: exp underflows to 0 for some
    model = softmax_model(shape, axis, opset)
    (y,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    assert built == ["softmax_step"]
    (want,) = ort_run(model, {"x": x})
    # oneDNN's exp rounds differently: ~1e-6 relative (the op tests' float32 tolerance)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, float64_softmax(x, axes), rtol=1e-5, atol=1e-6)


SPECIAL = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e19, "-huge": -3e19}


@pytest.mark.parametrize("value", list(SPECIAL))
def test_a_run_with_a_non_finite_or_huge_value_takes_numpy(built, value):
    """The same plan, run on a finite input and then with one special value in two rows:
    NaN rows where ONNX has them, and exact values elsewhere."""
    shape = (6, 19)
    model = softmax_model(shape, -1)
    sess = tr_onnx.InferenceSession(model)
    x = RNG.standard_normal(shape).astype(np.float32)
    sess.run(None, {"x": x})
    assert built == ["softmax_step"]
    x[1, 3] = x[4, 0] = SPECIAL[value]
    x[5] = -np.inf  # a row of -inf alone: 0/0 in ONNX
    x[2, :4] = [np.inf, -np.inf, 1.0, 2.0]
    (y,) = sess.run(None, {"x": x})
    (want,) = ort_run(model, {"x": x})
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    (again,) = sess.run(None, {"x": np.nan_to_num(x, nan=0.0, posinf=5.0, neginf=-5.0)
                              .clip(-50, 50)})
    assert np.isfinite(again).all()  # a finite run after it: oneDNN again, rows sum to 1
    np.testing.assert_allclose(again.sum(axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("shape, axis", [((2, 5, 3, 3), 1), ((2, 3, 5, 7), 2)])
def test_strided_rows_and_float64_keep_numpy(built, shape, axis):
    """A Softmax over a channels-last feature map's channels (strided rows), over a middle
    axis (oneDNN has only its reference loop for it) and a float64 one are not oneDNN's: the
    NumPy kernel runs them, to onnxruntime."""
    x = RNG.standard_normal(shape).astype(np.float32)
    model = softmax_model(x.shape, axis)
    for align in (1, 8):
        (y,) = tr_onnx.InferenceSession(model, channel_align=align).run(None, {"x": x})
        (want,) = ort_run(model, {"x": x})
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    x64 = RNG.standard_normal((4, 8))
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax64",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 8])])
    model64 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    (y64,) = tr_onnx.InferenceSession(model64).run(None, {"x": x64})
    np.testing.assert_allclose(y64, float64_softmax(x64, (1,)), rtol=1e-12)
    assert built == []
