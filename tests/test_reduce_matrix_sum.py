"""ReduceSum / ReduceMean over leading or trailing axes, and Softmax's row sums, as one einsum
over a matrix (ops.reduce ``matrix_sum``), against onnx.reference and onnxruntime: both ends,
keepdims 0 and 1, float32 and float64, NaN and inf kept, a channels-last feature map (not
contiguous: the NumPy reduction runs), and Softmax's short-row max on rows with NaN, -inf and
values whose exp overflows unless the max is exact. A spy checks the matrix sum ran where it
should."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.ops import reduce as reduce_ops


def _model(op, shape, attrs, axes=None, opset=18):
    elem = TensorProto.FLOAT
    out_shape = list(shape)
    if axes is not None:
        keep = attrs.get("keepdims", 1)
        out_shape = [1 if a in [x % len(shape) for x in axes] else d
                     for a, d in enumerate(shape)
                     if keep or a not in [x % len(shape) for x in axes]]
    inputs = ["x"]
    inits = []
    if axes is not None:
        inputs.append("axes")
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes))
    node = helper.make_node(op, inputs, ["y"], **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info("y", elem, out_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _typed(model, dtype):
    elem = onnx_elem_type(dtype)
    model.graph.input[0].type.tensor_type.elem_type = elem
    model.graph.output[0].type.tensor_type.elem_type = elem
    return model


@pytest.fixture
def summed(monkeypatch):
    """How many matrix sums ran."""
    calls = []
    real = reduce_ops.matrix_sum

    def spy(*args):
        call = real(*args)
        if call is None:
            return None
        return lambda: calls.append(1) or call()

    monkeypatch.setattr(reduce_ops, "matrix_sum", spy)
    return calls


@pytest.mark.parametrize("shape,axes", [
    ((8, 64, 32), [0, 1]),  # a bias gradient
    ((8, 64, 32), [2]),  # rows
    ((4, 3, 5, 7), [2, 3]),
    ((300, 9), [0]),
], ids=["leading2", "trailing", "trailing2", "leading_long"])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_over_leading_or_trailing_axes_match_the_references(summed, shape, axes, op,
                                                                 keepdims, dtype):
    model = _typed(_model(op, list(shape), {"keepdims": keepdims}, axes), dtype)
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype) * 10
    x.flat[5] = np.nan
    x.flat[-3] = np.inf
    (got,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    assert summed, "the matrix sum did not run"
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_middle_axes_and_non_contiguous_maps_reduce_in_numpy(summed):
    """A middle axis is not a matrix sum; a channels-last map's logical view is not
    contiguous, so the NumPy reduction runs on it."""
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    middle = _model("ReduceSum", [2, 3, 4, 5], {"keepdims": 1}, [1])
    (got,) = tr_onnx.InferenceSession(middle).run(None, {"x": x})
    np.testing.assert_allclose(got, x.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
    assert not summed
    conv_then_sum = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
         helper.make_node("ReduceSum", ["c", "axes"], ["y"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor("w", TensorProto.FLOAT, [6, 3, 1, 1],
                            np.arange(18, dtype=np.float32) / 10),
         helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])]),
        opset_imports=[helper.make_opsetid("", 18)])
    (got,) = tr_onnx.InferenceSession(conv_then_sum).run(None, {"x": x})
    want = ort.InferenceSession(conv_then_sum.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not summed


@pytest.mark.parametrize("shape,axis", [((32, 4, 8, 8), -1), ((8, 4, 16, 64), -1), ((6, 10), -1),
                                        ((10, 6), 0)],
                         ids=["short_rows", "long_rows", "loss_rows", "axis0_columns"])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_rows_match_the_references_with_nan_and_inf(summed, shape, axis, op):
    """Each softmax "row" (along ``axis``) with NaN, all -inf, +inf and some -inf."""
    model = _model(op, list(shape), {"axis": axis}, opset=13)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32) * 5
    rows = x.reshape(-1, shape[-1]) if axis == -1 else x.T
    rows[0, 1] = np.nan  # the whole row NaN
    rows[1, :] = -np.inf  # 0/0: NaN
    rows[2, 3] = np.inf  # inf - inf: NaN
    rows[3, :2] = -np.inf  # exp(-inf) = 0: the rest of the row as usual
    rows[4, 1] = 200  # exp(200) overflows float32: only the exact row max keeps it finite
    rows[5, -1] = 300
    (got,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    assert summed
    # onnx.reference's LogSoftmax is log(Softmax): -inf where exp underflows (rows 4, 5)
    (want,) = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x}) \
        if op == "LogSoftmax" else ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
