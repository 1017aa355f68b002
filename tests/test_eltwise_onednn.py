"""Elu, Selu and Mish in float32 through oneDNN's eltwise kernels (``ops.unary_onednn.
onednn_finite_eltwise``) against onnxruntime and float64: finite inputs take oneDNN; a run
whose input holds NaN or an infinity takes the NumPy body (what oneDNN's kernels make of them
differs between its ISAs: its AVX-512 gelu_erf turns +inf into NaN), and the next finite run
takes oneDNN again."""

from __future__ import annotations

import numpy as np
import pytest
from onednn_kernels import require_onednn
from onnx import TensorProto, helper
from oracles import ort_run

import tr_onnx
from tr_onnx.ops import unary, unary_onednn

RNG = np.random.default_rng(29)
F32 = {"rtol": 1e-5, "atol": 1e-6}  # the op tests' float32 tolerance


def _softplus(x):
    return np.where(x > 0, x + np.log1p(np.exp(-np.abs(x))), np.log1p(np.exp(np.minimum(x, 0))))


SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875
FLOAT64 = {  # ONNX's definitions in float64
    "Elu": lambda x, alpha: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))),
    "Selu": lambda x, alpha: SELU_GAMMA * np.where(x > 0, x, SELU_ALPHA * np.expm1(
        np.minimum(x, 0))),
    "Mish": lambda x, alpha: x * np.tanh(_softplus(x)),
}
CASES = [("Elu", {"alpha": 0.7}), ("Elu", {}), ("Selu", {}), ("Mish", {})]


def model(op, attrs, shape, dtype=TensorProto.FLOAT):
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], **attrs)], "eltwise",
        [helper.make_tensor_value_info("x", dtype, list(shape))],
        [helper.make_tensor_value_info("y", dtype, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def wide_values(shape) -> np.ndarray:
    """Normal values, a few up to +-1e18, tiny ones, signed zeros and subnormals."""
    x = (RNG.standard_normal(shape) * 4).astype(np.float32)
    flat = x.reshape(-1)
    flat[::53] = RNG.uniform(-1e18, 1e18, flat[::53].size)
    flat[1::41] *= 1e-6
    flat[2::97] = -0.0
    flat[3::89] = 1e-40
    flat[4::83] = -1e-40
    return x


@pytest.fixture
def steps(monkeypatch):
    """How many oneDNN steps were built, and how each run went (True: oneDNN)."""
    require_onednn()
    seen = {"built": 0, "runs": []}
    real_factory, real_run = unary.onednn_finite_eltwise, unary_onednn._finite_or_exact

    def factory(*args):
        step = real_factory(*args)
        seen["built"] += step is not None
        return step

    def run(flat, fast, gamma, y, exact):
        # which of the two the step called on this run (True: oneDNN)
        def took_fast():
            seen["runs"].append(True)
            return fast()

        def took_exact():
            seen["runs"].append(False)
            return exact()

        return real_run(flat, took_fast, gamma, y, took_exact)

    monkeypatch.setattr(unary, "onednn_finite_eltwise", factory)
    monkeypatch.setattr(unary_onednn, "_finite_or_exact", run)
    return seen


@pytest.mark.parametrize("op, attrs", CASES)
def test_finite_inputs_run_in_onednn_and_match(steps, op, attrs):
    shape = (4, 16, 12, 12)
    x = wide_values(shape)
    m = model(op, attrs, shape)
    (y,) = tr_onnx.InferenceSession(m).run(None, {"x": x})
    assert steps["built"] == 1 and steps["runs"] == [True]
    (want,) = ort_run(m, {"x": x})
    np.testing.assert_allclose(y, want, **F32)
    exact = FLOAT64[op](x.astype(np.float64), attrs.get("alpha", 1.0))
    np.testing.assert_allclose(y, exact, **F32)


@pytest.mark.parametrize("op, attrs", CASES)
def test_a_run_with_nan_or_inf_takes_numpy_then_oneDNN_again(steps, op, attrs):
    shape = (3, 5, 64)
    m = model(op, attrs, shape)
    sess = tr_onnx.InferenceSession(m)
    x = wide_values(shape)
    special = x.copy()
    special[0, 0, :4] = [np.nan, np.inf, -np.inf, np.nan]
    special[2, 4, -3:] = [np.inf, -np.inf, np.nan]
    for feed, fast in ((special, False), (x, True)):
        (y,) = sess.run(None, {"x": feed})
        assert steps["runs"][-1] is fast
        (want,) = ort_run(m, {"x": feed})
        np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
        np.testing.assert_allclose(y, want, **F32)  # infinities equal, NaN positions above


def test_padded_channels_and_float64_keep_numpy(steps):
    """A channels-last map padded to 8 lanes has gaps the finiteness dot cannot read as one
    vector, and float64 is not oneDNN's: both run the NumPy body, correctly."""
    shape = (2, 3, 6, 6)
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 3, 1, 1], RNG.standard_normal(9).tolist())
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Elu", ["c"], ["y"])],
        "conv_elu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], [w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = wide_values(shape)
    (y,) = tr_onnx.InferenceSession(m, channel_align=8).run(None, {"x": x})
    np.testing.assert_allclose(y, ort_run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)
    m64 = model("Elu", {}, (4, 9), TensorProto.DOUBLE)
    x64 = RNG.standard_normal((4, 9))
    (y64,) = tr_onnx.InferenceSession(m64).run(None, {"x": x64})
    np.testing.assert_allclose(y64, FLOAT64["Elu"](x64, 1.0), rtol=1e-12, atol=1e-15)
    assert steps["built"] == 0
