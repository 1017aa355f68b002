"""ConvTranspose on the cuda backend, without a GPU: one cuDNN ``conv_dgrad`` graph of its
adjoint Conv and a broadcasting add of the bias, its gradient a Conv and a ConvGradFilter.
(A dgrad with the bias in its epilogue takes runtime-fusion engines only: deviceless cuDNN
lists them, but building one loads a module through the driver, so it cannot be checked here.)

Checked: the graph each form declares (the adjoint's pads, the roles of x, w and y, the bias)
passes validate, lowering and the heuristics of the real cuDNN deviceless (an H200) in fp32,
fp16 and bf16; three SGD steps of a small decoder (Conv -> ConvTranspose -> Conv) on the host
emulator equal the numpy backend's (the emulator runs a cuDNN node as its numpy kernel: this
checks the plan, the layouts, the pointers and the gradient wiring, while the graph's numbers
are cuDNN's own on a GPU, the bias add's the host build's); a ConvTranspose whose output
extends past its full result is named as unbound, not run. Tolerances: the losses and
parameters within 1e-5 relative (the same numpy kernels on both sides, other summation orders
only in the tr_onnx kernels between).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import CudaUnsupported, CudnnCall, Launch
from tr_onnx.backends.cuda.deviceless import check_plan
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, emulated_cuda
from tr_onnx.testing.recorder import FakeRecorder

N, C, H = 2, 3, 6

FORMS = {  # id: ConvTranspose attributes, weight [C_in, C_out / group, *k], output spatial
    "stride2-k2": ({"strides": [2, 2]}, (8, 6, 2, 2), 2 * H),
    "stride2-k3-pads-output_padding": ({"strides": [2, 2], "pads": [1, 1, 1, 1],
                                        "output_padding": [1, 1]}, (8, 6, 3, 3), 2 * H),
    "stride1-k3-dilation2-group2": ({"dilations": [2, 2], "group": 2, "pads": [2, 2, 2, 2]},
                                    (8, 3, 3, 3), H),
    "same_upper-stride2": ({"strides": [2, 2], "auto_pad": "SAME_UPPER"}, (8, 4, 3, 3), 2 * H),
}


def decoder(form: str, bias: bool = True) -> onnx.ModelProto:
    """x -> Conv(3->8, 3x3) -> Relu -> ConvTranspose(form) -> Conv(1x1 -> 2) -> Relu -> Flatten ->
    Gemm: scores [N, 5]."""
    attrs, wshape, out = FORMS[form]
    rng = np.random.default_rng(0)
    c_out = wshape[1] * attrs.get("group", 1)

    def init(name, shape, scale=0.3):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    inits = [init("w1", (8, C, 3, 3)), init("b1", (8,), 0.1), init("wt", wshape),
             init("w2", (2, c_out, 1, 1)), init("b2", (2,), 0.1),
             init("w3", (2 * out * out, 5), 0.1), init("b3", (5,), 0.1)]
    t_inputs = ["h", "wt"]
    if bias:
        inits.append(init("bt", (c_out,), 0.2))
        t_inputs.append("bt")
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["h"]),
             helper.make_node("ConvTranspose", t_inputs, ["u"], **attrs),
             helper.make_node("Conv", ["u", "w2", "b2"], ["v"]),
             helper.make_node("Relu", ["v"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["scores"])]
    graph = helper.make_graph(nodes, f"decoder-{form}", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [N, C, H, H])], [helper.make_tensor_value_info(
            "scores", TensorProto.FLOAT, [N, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = onnx.shape_inference.infer_shapes(model)
    u = [v for v in model.graph.value_info if v.name == "u"][0]
    assert [d.dim_value for d in u.type.tensor_type.shape.dim][2:] == [out, out]
    return model


def batch(k: int):
    rng = np.random.default_rng(10 + k)
    return {"x": rng.standard_normal((N, C, H, H)).astype(np.float32)}, rng.integers(0, 5, N)


def recorder(plan) -> FakeRecorder:
    return FakeRecorder(plan.memory, policy=EXECUTOR_POLICY)


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("host_kernels"))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_conv_transpose_graph_plans_on_an_h200(form, precision):
    session = tr_onnx.TrainingSession(decoder(form), backend=CudaBackend(device=recorder),
                                      precision=precision, channel_align=8)
    plan = session._train_plan(batch(0)[0])
    (call, bias, *zero) = [c for bn in plan.executor.bound if bn.node.op_type == "ConvTranspose"
                    for c in bn.calls]
    assert isinstance(call, CudnnCall) and call.desc.kind == "conv_dgrad"
    assert set(call.desc.inputs) == {"loss", "filter"} and set(call.desc.outputs) == {"DX"}
    assert call.desc.epilogue == () and call.desc.node_inputs == (0, 1)
    assert isinstance(bias, Launch) and bias.kernel.name.startswith("tr_bcast_binary_")
    rows = check_plan(plan)
    failing = [(r.node, r.kind, r.error) for r in rows if not r.ok]
    assert not failing
    assert any("ConvTranspose" in r.node for r in rows)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("form", list(FORMS))
def test_three_sgd_steps_on_the_emulator_equal_numpy(form, bias, host_lib):
    def train(**kw):
        s = tr_onnx.TrainingSession(decoder(form, bias), optimizer=SGD(lr=0.1, momentum=0.9),
                                    channel_align=8, **kw)
        return s, [float(s.train_step(*batch(k))) for k in range(3)]

    ref, want = train(backend="numpy")
    sess, got = train(backend=emulated_cuda(host_lib))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() and ("bt" in a) == bias
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    kinds = {c.desc.kind for bn in sess._state.active.executor.bound for c in bn.calls
             if isinstance(c, CudnnCall) and bn.node.op_type == "ConvTranspose"}
    assert kinds == {"conv_dgrad"}


def test_a_conv_transpose_past_its_full_result_is_named_unbound():
    """An ``output_shape`` beyond the full result (14 > 2 * (6 - 1) + 2) means negative pads:
    no adjoint Conv reads it (numpy computes it; its gradient is refused there too), so the
    cuda plan names the node."""
    model = decoder("stride2-k2")
    (node,) = [n for n in model.graph.node if n.op_type == "ConvTranspose"]
    node.attribute.append(helper.make_attribute("output_shape", [14, 14]))
    (w3,) = [t for t in model.graph.initializer if t.name == "w3"]
    w3.CopyFrom(numpy_helper.from_array(np.zeros((2 * 14 * 14, 5), np.float32), "w3"))
    del model.graph.value_info[:]
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=recorder))
    with pytest.raises(CudaUnsupported, match="ConvTranspose(.|\n)*extends past its full"):
        sess.run(None, batch(0)[0])
