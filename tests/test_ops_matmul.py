"""Gemm and MatMul (tr_onnx.ops.matmul) against onnxruntime and onnx.reference, and the
flattened feature map they read in its physical (h, w, c) order after a Conv."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.ops import matmul
from tr_onnx.registry import default_registry

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def model_of(op, feeds: dict, consts: dict, attrs: dict, opset: int, inputs=None):
    names = inputs or [*feeds, *consts]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], op.lower(),
        [helper.make_tensor_value_info(k, onnx_elem_type(v.dtype), list(v.shape))
         for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", 0, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def check(model, feed, rtol=1e-5, atol=1e-6, align=1, oracles=("ort", "reference")):
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    (y,) = sess.run(None, feed)
    (e_ref,) = ReferenceEvaluator(model).run(None, feed)
    (e_ort,) = ort_run(model, feed) if "ort" in oracles else (e_ref,)
    assert y.dtype == e_ort.dtype and y.shape == e_ort.shape
    np.testing.assert_allclose(y, e_ort, rtol=rtol, atol=atol)
    np.testing.assert_allclose(y, e_ref, rtol=rtol, atol=atol)
    return sess


A, B = rand(4, 6), rand(6, 5)
GEMM = [
    pytest.param({"a": A}, {"b": B}, {}, 13, id="no-bias"),
    pytest.param({"a": A}, {"b": B, "c": rand(5)}, {}, 13, id="vector-bias"),
    pytest.param({"a": A}, {"b": B, "c": rand(4, 1)}, {"beta": 0.5}, 13, id="column-bias-beta"),
    pytest.param({"a": A, "c": rand(4, 5)}, {"b": B}, {"alpha": 2.0, "beta": -1.5}, 13,
                 id="matrix-bias-fed-alpha-beta"),
    pytest.param({"a": A}, {"b": B, "c": np.array(3.0, np.float32)}, {"beta": 2.0}, 13,
                 id="scalar-bias"),
    pytest.param({"a": A.T.copy()}, {"b": B.T.copy(), "c": rand(1, 5)},
                 {"transA": 1, "transB": 1}, 11, id="trans-both-v11"),
    pytest.param({"a": A}, {"b": B.T.copy(), "c": rand(5)}, {"transB": 1, "beta": 0.0}, 9,
                 id="beta-zero-v9"),
    pytest.param({"a": A}, {"b": B, "c": rand(4, 5)}, {}, 7, id="v7"),
    # onnxruntime has no Gemm-6 kernel and no int32 Gemm: onnx.reference alone there.
    pytest.param({"a": A}, {"b": B, "c": rand(5)}, {"broadcast": 1}, 6, id="broadcast-v6"),
    pytest.param({"a": A.astype(np.float64)}, {"b": B.astype(np.float64), "c": rand(5).astype(
        np.float64)}, {"alpha": 0.25}, 13, id="float64"),
    pytest.param({"a": RNG.integers(-5, 5, (3, 4)).astype(np.int32)},
                 {"b": RNG.integers(-5, 5, (4, 2)).astype(np.int32),
                  "c": RNG.integers(-5, 5, (2,)).astype(np.int32)}, {}, 13, id="int32"),
]


@pytest.mark.parametrize("feeds, consts, attrs, opset", GEMM)
def test_gemm(feeds, consts, attrs, opset):
    model = model_of("Gemm", feeds, consts, attrs, opset,
                     inputs=[n for n in ("a", "b", "c") if n in feeds or n in consts])
    check(model, feeds, oracles=("reference",) if opset == 6 or "int32" in str(
        feeds["a"].dtype) else ("ort", "reference"))


def test_gemm_float16():
    feeds = {"a": rand(3, 8, dtype=np.float16)}
    model = model_of("Gemm", feeds, {"b": rand(8, 4, dtype=np.float16),
                                     "c": rand(4, dtype=np.float16)}, {}, 13)
    check(model, feeds, rtol=2e-3, atol=2e-3)  # float16: 2 ulps (eps 9.8e-4) of one rounding


MATMUL = [
    pytest.param((4, 6), (6, 5), np.float32, 13, id="2d"),
    pytest.param((6,), (6, 5), np.float32, 13, id="1d-2d"),
    pytest.param((4, 6), (6,), np.float32, 13, id="2d-1d"),
    pytest.param((6,), (6,), np.float32, 13, id="1d-1d"),
    pytest.param((6,), (2, 3, 6, 5), np.float32, 13, id="1d-4d"),
    pytest.param((2, 3, 4, 6), (6,), np.float32, 13, id="4d-1d"),
    pytest.param((2, 1, 4, 6), (3, 6, 5), np.float32, 13, id="batch-broadcast"),
    pytest.param((3, 4, 6), (6, 5), np.float64, 9, id="3d-2d-float64-v9"),
    pytest.param((2, 4, 6), (2, 6, 5), np.int32, 13, id="int32"),
    pytest.param((2, 4, 6), (2, 6, 5), np.int64, 13, id="int64"),
    pytest.param((4, 6), (6, 5), np.float32, 1, id="v1"),
    # both operands stacked alike, float32 (small: NumPy; from 32x32x32 per matrix oneDNN,
    # test_stacked_matmul_*)
    pytest.param((2, 3, 5, 7), (2, 3, 7, 4), np.float32, 13, id="stacked-4d"),
    pytest.param((4, 5, 6), (4, 6, 3), np.float32, 13, id="stacked-3d"),
]


@pytest.mark.parametrize("shape_a, shape_b, dtype, opset", MATMUL)
def test_matmul(shape_a, shape_b, dtype, opset):
    feeds = {"a": (RNG.standard_normal(shape_a) * 3).astype(dtype),
             "b": (RNG.standard_normal(shape_b) * 3).astype(dtype)}
    check(model_of("MatMul", feeds, {}, {}, opset), feeds)


def test_matmul_constant_weight_is_not_copied_at_run_time():
    feeds = {"a": rand(3, 6)}
    sess = check(model_of("MatMul", feeds, {"w": rand(6, 2)}, {}, 13), feeds)
    assert [n.op_type for n, _ in sess.plan_for(feeds).kernels] == ["MatMul"]


# ---- a flattened feature map read in its physical order -------------------------------------

HAS_CONV = ("", "Conv") in default_registry().op_types("numpy")


def conv_then_flat(flatten: str, matmul: str, c: int):
    """x[2,5,4,3] -> Conv(5->c, 3x3, pad 1) -> Flatten | Reshape(N,-1) -> Gemm | MatMul."""
    k = c * 4 * 3
    inits = [numpy_helper.from_array(rand(c, 5, 3, 3), "w"),
             numpy_helper.from_array(rand(c), "bias")]
    nodes = [helper.make_node("Conv", ["x", "w", "bias"], ["f"], pads=[1, 1, 1, 1])]
    if flatten == "Flatten":
        nodes.append(helper.make_node("Flatten", ["f"], ["flat"]))
    else:
        inits.append(numpy_helper.from_array(np.array([2, -1], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["f", "shape"], ["flat"]))
    if matmul == "Gemm":
        inits += [numpy_helper.from_array(rand(7, k), "fc"), numpy_helper.from_array(rand(7), "c")]
        nodes.append(helper.make_node("Gemm", ["flat", "fc", "c"], ["y"], transB=1, alpha=0.5))
    else:
        inits.append(numpy_helper.from_array(rand(k, 7), "fc"))
        nodes.append(helper.make_node("MatMul", ["flat", "fc"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 5, 4, 3])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 7])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FLATTENED = [pytest.param(f, m, c, align, id=f"{f}-{m}-c{c}-align{align}")
             for f, m in (("Flatten", "Gemm"), ("Reshape", "MatMul"), ("Flatten", "MatMul"),
                          ("Reshape", "Gemm"))
             for c in (3, 13) for align in (1, 8)] if HAS_CONV else []


@pytest.mark.parametrize("flatten, matmul, c, align", FLATTENED)
def test_flattened_feature_map_is_absorbed(flatten, matmul, c, align):
    model = conv_then_flat(flatten, matmul, c)
    feed = {"x": rand(2, 5, 4, 3)}
    expected = ort_run(model, feed)[0]
    # Without slot reuse every tensor still holds its own value after the step, so the padded
    # lanes of all of them can be checked; with reuse, the result must not change.
    for reuse in (True, False):
        sess = tr_onnx.InferenceSession(model, channel_align=align, reuse_memory=reuse)
        assert_close_relative(sess.run(None, feed)[0], expected)
        plan = sess.plan_for(feed)
        assert plan.layout.absorbed_flattens and not plan.layout.transposes
    assert all(pad_lanes_are_zero(plan.executor.arena, t) for t in plan.memory.tensors.values())


# products of at least 32x32x32 per matrix (below, NumPy's loop runs them: STACKED_SMALL)
STACKED = {"4d": ((2, 3, 32, 40), (2, 3, 40, 36)), "3d": ((4, 48, 33), (4, 33, 40)),
           "attention": ((8, 4, 64, 64), (8, 4, 64, 64))}


@pytest.mark.parametrize("case", list(STACKED))
def test_stacked_matmul_runs_in_onednn_and_its_gradients_match_torch(case, monkeypatch):
    """Both operands stacked alike, float32: oneDNN's matmul runs the forward and the two
    backward MatMuls; y, ga and gb match PyTorch autograd in float32."""
    import torch
    from gradcheck import GradCase, build_model

    from tr_onnx.training.gradients import vjp

    require_onednn()
    built = spy_kernels(monkeypatch, matmul, ["_onednn_matmul"])
    shape_a, shape_b = STACKED[case]
    a, b = rand(*shape_a), rand(*shape_b)
    model = build_model(GradCase("MatMul", "MatMul", [a, b], {}))
    cot = rand(*np.matmul(a, b).shape)
    y, grads = vjp(model, {"x0": a, "x1": b}, ["x0", "x1"], cot)
    assert built == ["_onednn_matmul"] * 3  # the forward and both gradients' MatMuls
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    ty = ta @ tb
    ty.backward(torch.tensor(cot))
    for got, want in ((y, ty.detach()), (grads["x0"], ta.grad), (grads["x1"], tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=2e-5, atol=2e-5)


def test_small_stacked_products_stay_in_numpy(monkeypatch):
    built = spy_kernels(monkeypatch, matmul, ["_onednn_matmul"])
    feeds = {"a": rand(32, 4, 8, 8), "b": rand(32, 4, 8, 8)}
    check(model_of("MatMul", feeds, {}, {}, 13), feeds)
    assert built == []
