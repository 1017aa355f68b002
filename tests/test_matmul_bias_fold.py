"""MatMul by a constant then Add of a per-column constant bias, in inference plans, as one
MatMulBias (``passes.inference_folds.fuse_matmul_bias``, ``ops.matmul.matmul_bias_numpy``):
which pairs fold, and the folded plans against onnxruntime and onnx.reference, for 2-D
products, stacks (one GEMM over the rows), strided stacks (np.matmul then the add), a bias on
either side of the Add and a flattened channels-last feature map (the weight's rows permuted)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
from tr_onnx.ops import matmul

RNG = np.random.default_rng(5)
K, N = 48, 40


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def model_of(nodes, inputs: dict, consts: dict, outputs=("y",)):
    graph = helper.make_graph(
        nodes, "matmul_bias",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
         for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return onnx.shape_inference.infer_shapes(model)


def run_and_check(model, feed, align: int = 1) -> list[str]:
    """The op types of the plan's steps, after checking every output against onnxruntime and
    onnx.reference."""
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    got = sess.run(None, feed)
    for want in (ort_run(model, feed), ReferenceEvaluator(model).run(None, feed)):
        for g, w in zip(got, want):
            assert g.shape == w.shape
            # float32 sums of 48 products, the bias added inside the GEMM: another order
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    return [s.label.split("(")[-1].split(",")[0] for s in sess.plan_for(feed).executor.steps]


@pytest.mark.parametrize("x_shape", [(6, K), (3, 5, K), (2, 3, 4, K)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("bias_shape", [(N,), (1, N)], ids=["n", "1n"])
@pytest.mark.parametrize("bias_first", [False, True], ids=["y+b", "b+y"])
def test_matmul_then_column_bias_folds(x_shape, bias_shape, bias_first):
    x = rand(*x_shape)
    add = ["b", "p"] if bias_first else ["p", "b"]
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["p"]),
                      helper.make_node("Add", add, ["y"])],
                     {"x": x}, {"w": rand(K, N), "b": rand(*bias_shape)})
    ops = run_and_check(model, {"x": x})
    assert ops == ["MatMulBias"]


def test_a_strided_stack_folds_and_takes_numpy_s_product():
    """A transposed stack's rows are not one matrix: the product is np.matmul, then the add."""
    x = rand(5, 3, K)
    model = model_of([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
                      helper.make_node("MatMul", ["t", "w"], ["p"]),
                      helper.make_node("Add", ["p", "b"], ["y"])],
                     {"x": x}, {"w": rand(K, N), "b": rand(N)})
    assert "MatMulBias" in run_and_check(model, {"x": x})


@pytest.mark.parametrize("align", [1, 8])
def test_a_flattened_feature_map_folds_with_its_weight_rows_permuted(align):
    """Conv -> Flatten -> MatMul -> Add: the MatMulBias reads the map flattened in its
    channels-last order, the weight's rows stored to match."""
    x = rand(2, 3, 4, 4)
    model = model_of([helper.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
                      helper.make_node("Flatten", ["c"], ["f"]),
                      helper.make_node("MatMul", ["f", "w"], ["p"]),
                      helper.make_node("Add", ["p", "b"], ["y"])],
                     {"x": x}, {"k": rand(5, 3, 3, 3), "w": rand(5 * 16, N), "b": rand(N)})
    assert "MatMulBias" in run_and_check(model, {"x": x}, align)


def _unfolded(nodes, inputs, consts, outputs=("y",)):
    return run_and_check(model_of(nodes, inputs, consts, outputs), inputs)


def test_pairs_that_do_not_fold():
    x = rand(6, K)
    matmul = helper.make_node("MatMul", ["x", "w"], ["p"])
    # a bias of one value per element, not per column
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"])], {"x": x},
        {"w": rand(K, N), "b": rand(6, N)})
    # a bias that broadcasts the product to a larger shape
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"])], {"x": x},
        {"w": rand(K, N), "b": rand(2, 1, N)})
    # weights that are a model input, not a constant
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"])], {"x": x, "w": rand(K, N)},
        {"b": rand(N)})
    # a bias that is a model input
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"])], {"x": x, "b": rand(N)},
        {"w": rand(K, N)})
    # the product read by another node too, and the product a model output
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"]),
         helper.make_node("Relu", ["p"], ["r"])], {"x": x}, {"w": rand(K, N), "b": rand(N)},
        outputs=("y", "r"))
    assert "MatMulBias" not in _unfolded(
        [matmul, helper.make_node("Add", ["p", "b"], ["y"])], {"x": x},
        {"w": rand(K, N), "b": rand(N)}, outputs=("y", "p"))


def test_training_plans_keep_matmul_and_add():
    """The fold is an inference rewrite: a TrainingSession's graph keeps both nodes (the
    bias and the weight train)."""
    x = rand(6, K)
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["p"]),
                      helper.make_node("Add", ["p", "b"], ["y"])],
                     {"x": x}, {"w": rand(K, N), "b": rand(N)})
    sess = tr_onnx.TrainingSession(model, loss="mse")
    sess.train_step({"x": x}, rand(6, N))
    labels = [s.label for s in sess._train_plan({"x": x}).executor.steps]
    assert any("(MatMul," in label for label in labels)
    assert not any("MatMulBias" in label for label in labels)


# at least 32x32x32 products, below which NumPy runs them anyway
@pytest.mark.parametrize("x_shape, bias_shape", [((40, K), (N,)), ((4, 10, K), (1, N)),
                                                 ((2, 3, 8, K), (1, 1, N))],
                         ids=["2d", "3d", "4d"])
def test_the_bias_inside_onednn_s_matmul(monkeypatch, x_shape, bias_shape):
    """Where oneDNN has its own matmul kernels (AVX-512) it adds the bias; its generic GEMM is
    accepted here too, so that every machine runs that path."""
    require_onednn()
    monkeypatch.setattr(matmul, "own_kernel", lambda implementation: True)
    built = spy_kernels(monkeypatch, matmul, ["_onednn_product"])
    x = rand(*x_shape)
    model = model_of([helper.make_node("MatMul", ["x", "w"], ["p"]),
                      helper.make_node("Add", ["p", "b"], ["y"])],
                     {"x": x}, {"w": rand(K, N), "b": rand(*bias_shape)})
    assert run_and_check(model, {"x": x}) == ["MatMulBias"]
    assert "_onednn_product" in built
