"""Gemm and MatMul through oneDNN's matmul (``tr_onnx.ops.matmul._onednn_product``): every
transpose, every shape of Gemm's C, a stack times one matrix (one GEMM over its rows), operands
whose rows are not evenly apart, and the gradients' Gemms, against onnxruntime,
onnx.reference and PyTorch autograd.

A single product takes oneDNN only where oneDNN has its own kernels for it (AVX-512 machines;
``matmul.own_kernel``). The tests that check oneDNN's arithmetic accept its generic GEMM too,
so that they run it on any machine; one test checks the choice itself on this machine."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
from tr_onnx import onednn
from tr_onnx.ops import matmul

RNG = np.random.default_rng(7)
M, K, N = 40, 48, 36  # 69120 products: above the 32x32x32 below which NumPy runs them


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture
def built(monkeypatch):
    """The names of the oneDNN factories that built a kernel, with oneDNN's generic GEMM
    accepted as well as its own kernels."""
    require_onednn()
    monkeypatch.setattr(matmul, "own_kernel", lambda implementation: True)
    return spy_kernels(monkeypatch, matmul, ["_onednn_product"])


def model_of(op, feeds: dict, consts: dict, attrs: dict, pre=None):
    """One ``op`` node; ``pre``: (op, attrs) of a node run on the first feed before it."""
    names = [*feeds, *consts]
    nodes = [helper.make_node(op, names, ["y"], **attrs)]
    if pre is not None:
        nodes[0].input[0] = "pre"
        nodes.insert(0, helper.make_node(pre[0], [names[0]], ["pre"], **pre[1]))
    graph = helper.make_graph(
        nodes, op.lower(),
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
         for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", 0, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return onnx.shape_inference.infer_shapes(model)


def check(model, feed, align: int = 1):
    (y,) = tr_onnx.InferenceSession(model, channel_align=align).run(None, feed)
    (e_ort,) = ort_run(model, feed)
    (e_ref,) = ReferenceEvaluator(model).run(None, feed)
    assert y.shape == e_ort.shape
    # float32 sums of 48 products in another order: a few ulp of the largest terms
    np.testing.assert_allclose(y, e_ort, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, e_ref, rtol=1e-5, atol=1e-5)


C_SHAPES = {"none": None, "vector": (N,), "row": (1, N), "column": (M, 1), "matrix": (M, N),
            "scalar": ()}
# oneDNN's own kernels add a bias of one value per column only (others: its reference loop)
ONEDNN_C = ("none", "vector", "row")


@pytest.mark.parametrize("c", list(C_SHAPES))
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_with_every_transpose_and_bias_shape(built, trans_a, trans_b, c):
    a = rand(K, M) if trans_a else rand(M, K)
    consts = {"b": rand(N, K) if trans_b else rand(K, N)}
    if C_SHAPES[c] is not None:
        consts["c"] = rand(*C_SHAPES[c])
    check(model_of("Gemm", {"a": a}, consts, {"transA": trans_a, "transB": trans_b}),
          {"a": a})
    assert built == (["_onednn_product"] if c in ONEDNN_C else [])


@pytest.mark.parametrize("attrs", [{"alpha": 0.5}, {"beta": 2.0}])
def test_gemm_scaled_takes_numpy(built, attrs):
    a = rand(M, K)
    check(model_of("Gemm", {"a": a}, {"b": rand(K, N), "c": rand(N)}, attrs), {"a": a})
    assert built == []


def test_gemm_with_zero_beta_ignores_c(built):
    a = rand(M, K)
    c = np.full(N, np.nan, np.float32)  # read with beta 0 it would poison every output
    check(model_of("Gemm", {"a": a}, {"b": rand(K, N), "c": c}, {"beta": 0.0}), {"a": a})
    assert built == ["_onednn_product"]


@pytest.mark.parametrize("shape_a, shape_b", [
    ((M, K), (K, N)),          # one matrix
    ((4, 10, K), (K, N)),      # a stack times one matrix: one GEMM over the 40 rows
    ((2, 3, 10, K), (K, N)),   # two stacked axes, folded alike
])
def test_matmul_of_matrices_and_of_a_stack_times_a_matrix(built, shape_a, shape_b):
    a = rand(*shape_a)
    check(model_of("MatMul", {"a": a}, {"b": rand(*shape_b)}, {}), {"a": a})
    assert built == ["_onednn_product"]


@pytest.mark.parametrize("align", [1, 8])
def test_matmul_on_a_channels_last_feature_map(built, align):
    """MatMul over the last axis of a Conv's output: the feature map is stored channels-last
    (and with align 8, padded), so its rows are not evenly apart and the stack is not one
    matrix; oneDNN reads it through its strides, or declines and NumPy runs it."""
    x = rand(2, 5, 12, 40)
    w = rand(6, 5, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["h"]),
         helper.make_node("MatMul", ["h", "b"], ["y"])], "conv_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", 0, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(rand(40, N), "b")])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    plan = sess.plan_for({"x": x})
    assert plan.layout.channels_last > 0  # the case this test is for
    check(model, {"x": x}, align)


def test_single_products_need_onednn_s_own_kernels(monkeypatch):
    """On this machine: a 2-D Gemm takes oneDNN exactly when oneDNN's choice for it is one of
    its own kernels; stacks of matrices with the same leading axes take it either way."""
    require_onednn()
    dims = [(M, K), (K, N), (M, N)]
    mds = [onednn.MemoryDesc.strided(d, (d[1] * 4, 4)) for d in dims]
    expected = matmul.own_kernel(onednn.matmul(*mds).implementation)
    built = spy_kernels(monkeypatch, matmul, ["_onednn_product"])
    a = rand(M, K)
    check(model_of("Gemm", {"a": a}, {"b": rand(K, N)}, {}), {"a": a})
    assert built == (["_onednn_product"] if expected else [])
    monkeypatch.setattr(matmul, "own_kernel", lambda implementation: False)
    stacked = {"a": rand(3, M, K), "b": rand(3, K, N)}
    check(model_of("MatMul", stacked, {}, {}), stacked)
    check(model_of("Gemm", {"a": a}, {"b": rand(K, N)}, {}), {"a": a})
    assert built == (["_onednn_product"] if expected else []) + ["_onednn_product"]


def test_gemm_gradients_run_in_onednn_and_match_torch(built):
    """y = x @ W^T + b (a Linear layer): the forward and the gradients' Gemms (gy @ W, gy^T @
    x: transposed operands) all run in oneDNN and match PyTorch autograd."""
    import torch
    from gradcheck import GradCase, build_model

    from tr_onnx.training.gradients import vjp

    x, w, b = rand(M, K), rand(N, K), rand(N)
    model = build_model(GradCase("Gemm", "Gemm", [x, w, b], {"transB": 1}))
    cot = rand(M, N)
    y, grads = vjp(model, {"x0": x, "x1": w, "x2": b}, ["x0", "x1", "x2"], cot)
    assert built.count("_onednn_product") == 3
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    ty = torch.nn.functional.linear(tx, tw, tb)
    ty.backward(torch.tensor(cot))
    for got, want in ((y, ty.detach()), (grads["x0"], tx.grad), (grads["x1"], tw.grad),
                      (grads["x2"], tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=2e-5, atol=2e-5)


def test_a_prepared_step_raises_a_failed_onednn_status_and_ignores_other_results():
    """A prepared step runs a bound primitive through its ``execute`` (its status returned,
    no Python frame of its own): a nonzero status raises OneDnnError naming the
    implementation; a NumPy call's returned array is not a status."""
    from tr_onnx import host_blas

    require_onednn()
    dims = [(M, K), (K, N), (M, N)]
    mds = [onednn.MemoryDesc.strided(d, (d[1] * 4, 4)) for d in dims]
    primitive = onednn.matmul(*mds)
    a, b, y = rand(M, K), rand(K, N), np.empty((M, N), np.float32)
    md = primitive.md("scratchpad")
    scratch = (md, 0) if md.nbytes else None
    ws = [np.empty(md.nbytes // 4 + 1, np.float32)]
    failing = []

    def make(ins, outs, ws):
        bound = onednn.bind(primitive, list(zip(("src", "weights", "dst"), mds,
                                                (*ins, outs[0]))), scratch, ws)
        if failing:
            bound.execute = lambda: 5  # as dnnl_primitive_execute reports a failure
        return [bound, lambda: np.add(outs[0], 1, out=outs[0])]  # returns an array

    step = host_blas.prepared_step(make)
    step([a, b], [y], ws)
    np.testing.assert_allclose(y, a @ b + 1, rtol=1e-5, atol=1e-5)
    failing.append(True)
    with pytest.raises(onednn.OneDnnError, match=r"oneDNN execute \(.+\) failed with status 5"):
        step([a, b], [y.copy()], ws)  # other views: the calls are made again
