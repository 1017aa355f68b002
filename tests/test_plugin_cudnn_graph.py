"""A plugin op whose cuda kernel is a cuDNN graph it declares itself: ``com.example``
MatMulBiasRelu (plugins/tr_onnx_example_ops/.../matmul_bias_relu.py), ``relu(a @ w + bias)`` as
one frontend graph (matmul, bias, relu), with no line of tr_onnx knowing the op.

Checked without a GPU: the NumPy kernel against onnxruntime running the same computation as
standard ops (MatMul, Add, Relu) and against the plugin's ``onnx.reference`` implementation;
the gradient rule by float64 finite differences; a cuda plan (inference, and training in fp32,
fp16, bf16) binds the node to the plugin's graph, one ``CudnnCall``, and the real cuDNN
(deviceless, an H200) validates, lowers and finds engines for it within the node's workspace;
three SGD steps on the host emulator (which runs a cuDNN node as its numpy kernel: the plan,
its pointers and the gradient wiring) equal the numpy backend's. The graph's numbers are
cuDNN's own, on a GPU.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tr_onnx_example_ops
from gradcheck import GradCase, check_case
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tr_onnx_example_ops import matmul_bias_relu

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import CudnnCall
from tr_onnx.backends.cuda.cudnn_graphs import CudnnGraphError, describe_node, graph_ops
from tr_onnx.backends.cuda.deviceless import check_plan
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, emulated_cuda
from tr_onnx.testing.recorder import FakeRecorder

N, K, M, CLASSES = 4, 6, 8, 5
DOMAIN = tr_onnx_example_ops.DOMAIN


def model(standard_ops: bool = False) -> onnx.ModelProto:
    """x [N, K] -> MatMulBiasRelu(w [K, M], b [M]) -> Gemm -> scores [N, 5]; with
    ``standard_ops`` the first node is MatMul -> Add -> Relu instead (what onnxruntime runs)."""
    rng = np.random.default_rng(0)

    def init(name, shape, scale=0.4):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    inits = [init("w", (K, M)), init("b", (M,), 0.2), init("w2", (M, CLASSES)),
             init("b2", (CLASSES,), 0.1)]
    if standard_ops:
        first = [helper.make_node("MatMul", ["x", "w"], ["t"]),
                 helper.make_node("Add", ["t", "b"], ["u"]),
                 helper.make_node("Relu", ["u"], ["h"])]
    else:
        first = [helper.make_node("MatMulBiasRelu", ["x", "w", "b"], ["h"], domain=DOMAIN)]
    graph = helper.make_graph(
        first + [helper.make_node("Gemm", ["h", "w2", "b2"], ["scores"])], "mbr",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, K])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [N, CLASSES])], inits)
    opsets = [helper.make_opsetid("", 17)] + ([] if standard_ops else
                                              [helper.make_opsetid(DOMAIN, 1)])
    return helper.make_model(graph, opset_imports=opsets)


def batch(k: int):
    rng = np.random.default_rng(10 + k)
    return {"x": rng.standard_normal((N, K)).astype(np.float32)}, rng.integers(0, CLASSES, N)


def recorder(plan) -> FakeRecorder:
    return FakeRecorder(plan.memory, policy=EXECUTOR_POLICY)


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("host_kernels"))


def test_the_numpy_kernel_equals_onnxruntime_and_the_reference():
    feed = batch(0)[0]
    got = tr_onnx.InferenceSession(model(), backend="numpy").run(None, feed)[0]
    want = ort.InferenceSession(model(standard_ops=True).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feed)[0]
    ref = ReferenceEvaluator(model(), new_ops=tr_onnx_example_ops.REFERENCE_OPS).run(None, feed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, ref[0], rtol=1e-5, atol=1e-6)


def test_the_gradient_equals_finite_differences():
    rng = np.random.default_rng(3)
    a, w, bias = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    # relu's kink: finite differences of step 1e-6 never straddle it here
    assert np.abs(a @ w + bias).min() > 1e-3
    check_case(GradCase("MatMulBiasRelu", "MatMulBiasRelu", [a, w, bias], domain=DOMAIN,
                        reference_ops=tuple(tr_onnx_example_ops.REFERENCE_OPS)))


def _graph_calls(plan) -> list:
    return [c for bn in plan.executor.bound if bn.node.op_type == "MatMulBiasRelu"
            for c in bn.calls]


@pytest.mark.parametrize("precision", ["inference", "fp32", "fp16", "bf16"])
def test_the_cuda_plan_binds_the_op_to_its_own_graph_which_cudnn_validates(precision):
    if precision == "inference":
        plan = tr_onnx.InferenceSession(model(), backend=CudaBackend(device=recorder)).plan_for(
            batch(0)[0])
    else:
        session = tr_onnx.TrainingSession(model(), backend=CudaBackend(device=recorder),
                                          precision=precision)
        plan = session._train_plan(batch(0)[0])
    (call,) = _graph_calls(plan)
    assert isinstance(call, CudnnCall) and call.desc.kind == "matmul_bias_relu"
    assert call.desc.build is matmul_bias_relu.build_matmul_bias_relu
    assert set(call.desc.inputs) == {"A", "B", "bias"} and set(call.desc.outputs) == {"Y"}
    assert call.desc.inputs["A"].dims == (1, N, K) and call.desc.outputs["Y"].dims == (1, N, M)
    assert call.desc.io_data_type == {"fp16": "HALF", "bf16": "BFLOAT16"}.get(precision, "FLOAT")
    rows = [r for r in check_plan(plan) if r.kind == "matmul_bias_relu"]
    assert len(rows) == 1 and rows[0].ok, rows
    assert 0 < rows[0].within <= rows[0].engines


def test_an_op_without_a_graph_is_named_with_the_list_that_has_the_plugin_op():
    session = tr_onnx.TrainingSession(model(), backend=CudaBackend(device=recorder))
    plan = session._train_plan(batch(0)[0])
    sign = next(n for n in plan.graph.nodes if n.op_type == "Sign")  # from the gradient rule
    with pytest.raises(CudnnGraphError, match=r"Sign.*no cuDNN graph.*MatMulBiasRelu"):
        describe_node(sign, plan.memory)
    assert "MatMulBiasRelu" in graph_ops()


def test_three_sgd_steps_on_the_emulator_equal_numpy(host_lib):
    def train(**kw):
        s = tr_onnx.TrainingSession(model(), optimizer=SGD(lr=0.1, momentum=0.9), **kw)
        return s, [float(s.train_step(*batch(k))) for k in range(3)]

    ref, want = train(backend="numpy")
    sess, got = train(backend=emulated_cuda(host_lib))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() >= {"w", "b"}
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    (call,) = _graph_calls(sess._state.active)
    assert isinstance(call, CudnnCall) and call.desc.kind == "matmul_bias_relu"
