"""Quantization ops (tr_onnx/ops/quantize.py): the straight-through gradient of Q -> DQ pairs
against PyTorch's fake quantization, QAT CNNs exported by PyTorch's classic exporter (opset 17)
trained alike (issue 13's must-show: one with torch.fake_quantize_* in its forward, one from
torch.ao.quantization's eager prepare_qat), and the forward of every op against onnxruntime
beyond the node suite's few cases (per-channel weights, groups, strides, padding, batches).

Finite differences of each rule alone are in grad_cases_quantize.py; the node suite runs the
official cases."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from allocation import LEFT_BOUND, PEAK_BOUND, step_allocation
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx import ir
from tr_onnx.layouts import StridedLayout
from tr_onnx.opdef import KernelContext, TensorInfo
from tr_onnx.registry import default_registry
from tr_onnx.training.gradients import vjp

RNG = np.random.default_rng(20261201)


# ---- the pair's gradient against PyTorch's fake quantization --------------------------------


def _qdq_model(x_shape, scale, zp, axis=1, opset=17, learn_scale=False) -> onnx.ModelProto:
    """x -> QuantizeLinear -> DequantizeLinear -> y, scale and zero point as initializers (or
    the scale as a graph input, to differentiate it)."""
    scale, zp = np.asarray(scale, np.float32), np.asarray(zp)
    inits = [numpy_helper.from_array(zp, "zp")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    if learn_scale:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT,
                                                    list(scale.shape)))
    else:
        inits.append(numpy_helper.from_array(scale, "scale"))
    attrs = {"axis": axis} if scale.ndim else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "qdq", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             list(x_shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _torch_fake_quant(x, scale, zp, qmin, qmax, axis=None):
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, float(scale), int(zp), qmin, qmax)
    return torch.fake_quantize_per_channel_affine(
        x, torch.from_numpy(np.asarray(scale, np.float32)),
        torch.from_numpy(np.asarray(zp, np.int32)), axis, qmin, qmax)


PAIRS = [  # id, x shape, scale, zero point (its dtype is the quantized type), axis
    ("per_tensor_uint8", (4, 3, 5, 5), 0.05, np.uint8(128), None),
    ("per_tensor_int8", (6, 10), 0.02, np.int8(-3), None),
    ("per_channel_int8", (4, 3, 3, 3), [0.01, 0.03, 0.02, 0.05], np.int8([0, 2, -1, 0]), 0),
    ("per_channel_uint8_axis1", (2, 3, 4, 4), [0.04, 0.02, 0.08], np.uint8([128, 100, 0]), 1),
]


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] for p in PAIRS])
def test_a_qdq_pair_has_pytorchs_fake_quantize_forward_and_gradient(pair, align):
    """dx = gy where round(x/s) + zp is inside the range, 0 outside: PyTorch's STE, to float32
    rounding (the pair computes gy * s / s)."""
    _, shape, scale, zp, axis = pair
    info = np.iinfo(zp.dtype)
    rng = np.random.default_rng(len(shape) + align)
    steps = np.reshape(scale, [-1 if i == axis else 1 for i in range(len(shape))])
    x = (rng.standard_normal(shape) * 120 * steps).astype(np.float32)  # ~1/3 clipped
    cot = rng.standard_normal(shape).astype(np.float32)
    model = _qdq_model(shape, scale, zp, axis=0 if axis is None else axis)
    y, grads = vjp(model, {"x": x}, ["x"], cot, channel_align=align)
    xt = torch.from_numpy(x).requires_grad_()
    yt = _torch_fake_quant(xt, scale, zp, int(info.min), int(info.max), axis)
    (yt * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-6, atol=0)
    inside = (xt.grad.numpy() != 0)
    assert 0.2 < inside.mean() < 0.95  # both the pass-through and the clipped region are seen


def test_a_weight_on_the_range_edge_tie_gets_its_gradient_as_in_pytorch():
    """w / s is 127.5 by division (ONNX's forward: rounds to 128, clipped) and 127.49999 by
    PyTorch's x * (1/s) (inside): a symmetric per-channel observer makes exactly such a pair
    (s = max|w| / 127.5; these two are from the eager QAT case). The gradient follows PyTorch;
    the forward value is 127 * s either way."""
    w, scale = np.float32(0.06247977), np.float32(0.00049003743)
    assert w / scale == np.float32(127.5)
    x = np.array([[w, -w, w / 2]], np.float32)
    model = _qdq_model(x.shape, scale, np.int8(0))
    y, grads = vjp(model, {"x": x}, ["x"], np.ones_like(x))
    xt = torch.from_numpy(x).requires_grad_()
    _torch_fake_quant(xt, scale, 0, -128, 127).sum().backward()
    np.testing.assert_array_equal(grads["x"], xt.grad.numpy())
    assert grads["x"][0, 0] == 1.0
    np.testing.assert_array_equal(y[0, :2], [127 * scale, -128 * scale])


def test_a_trained_scale_gets_pytorchs_learnable_fake_quantize_gradient():
    """The two rules composed give _fake_quantize_learnable_per_tensor_affine's scale gradient
    (round(x/s) - x/s inside the range, qmin - zp / qmax - zp outside): measured 1.0e-6
    relative (9.2e-5 on 91.6; the pair adds (q - zp) and -x/s in float32 where PyTorch
    forms round(x/s) - x/s)."""
    shape, scale, zp = (8, 16), np.float32(0.05), np.uint8(100)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    cot = rng.standard_normal(shape).astype(np.float32)
    model = _qdq_model(shape, scale, zp, learn_scale=True)
    _, grads = vjp(model, {"x": x, "scale": np.array(scale)}, ["x", "scale"], cot)
    xt = torch.from_numpy(x).requires_grad_()
    st = torch.tensor([float(scale)], requires_grad=True)
    yt = torch._fake_quantize_learnable_per_tensor_affine(
        xt, st, torch.tensor([float(zp)]), 0, 255, 1.0)
    (yt * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-6, atol=0)
    assert abs(float(grads["scale"]) - float(st.grad)) <= 1e-5 * abs(float(st.grad))


# ---- the must-show: a QAT CNN from PyTorch ------------------------------------------------------


class QatNet(torch.nn.Module):
    """A conv net with fake quantization as PyTorch QAT applies it: activations per tensor
    (uint8), weights per output channel (int8, symmetric); scales and zero points are buffers
    (observers' results, frozen)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)
        self.register_buffer("conv_scale", torch.tensor([0.02, 0.03, 0.025, 0.04]))
        # small enough that some fc weights (|w| <= 1/8) clip: the STE's zero region trains too
        self.register_buffer("fc_scale", torch.tensor([0.0008, 0.001, 0.0009, 0.0012, 0.0011]))
        self.register_buffer("zp4", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("zp5", torch.zeros(5, dtype=torch.int32))

    def forward(self, x):
        x = torch.fake_quantize_per_tensor_affine(x, 0.05, 128, 0, 255)
        w = torch.fake_quantize_per_channel_affine(self.conv.weight, self.conv_scale, self.zp4,
                                                   0, -128, 127)
        y = torch.nn.functional.conv2d(x, w, self.conv.bias, padding=1).relu()
        y = torch.nn.functional.max_pool2d(y, 2)
        y = torch.fake_quantize_per_tensor_affine(y, 0.02, 0, 0, 255)
        w = torch.fake_quantize_per_channel_affine(self.fc.weight, self.fc_scale, self.zp5,
                                                   0, -128, 127)
        return torch.nn.functional.linear(y.flatten(1), w, self.fc.bias)


def _eager_qat_net() -> torch.nn.Module:
    """The same idea through torch.ao.quantization's eager QAT: QuantStub/DeQuantStub and
    prepare_qat with plain (exportable) FakeQuantize modules, observers calibrated on a few
    batches and then disabled, as QAT fine-tuning does once ranges settle."""
    tq = torch.ao.quantization

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.fc = torch.nn.Linear(4 * 8 * 8, 5)

        def forward(self, x):
            y = torch.relu(self.conv(self.quant(x)))
            return self.dequant(self.fc(y.flatten(1)))

    torch.manual_seed(0)
    net = Net().train()
    with warnings.catch_warnings():  # "torch.ao.quantization is deprecated" (it still works)
        warnings.simplefilter("ignore", DeprecationWarning)
        _prepare_qat(net, tq)
    with torch.no_grad():
        for k in range(3):
            net(torch.from_numpy(_qat_batch(10 + k)[0]["x"]))
    net.apply(tq.disable_observer)
    return net.eval()


def _prepare_qat(net, tq) -> None:
    """Per-tensor uint8 activations, per-channel symmetric int8 weights."""
    net.qconfig = tq.QConfig(
        activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver,
                                             quant_min=0, quant_max=255, dtype=torch.quint8),
        weight=tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver,
                                         quant_min=-128, quant_max=127, dtype=torch.qint8,
                                         qscheme=torch.per_channel_symmetric, ch_axis=0))
    tq.prepare_qat(net, inplace=True)


def _qat_batch(k):
    rng = np.random.default_rng(100 + k)
    return ({"x": (rng.standard_normal((6, 3, 8, 8)) * 2.5).astype(np.float32)},
            rng.integers(0, 5, 6).astype(np.int64))


# onnxruntime's graph optimizations would run the Q/DQ-wrapped Conv as QLinearConv with its
# bias quantized: 2.5e-3 from the graph's own semantics, which tr_onnx and PyTorch compute
QAT_CASES = [ParityCase(name, build, _qat_batch, dynamic_axes={"x": {0: "batch"}}, lr=0.05,
                        ort_optimize=False)
             for name, build in (("qat_cnn", QatNet), ("qat_eager", _eager_qat_net))]
QDQ_PAIRS = {"qat_cnn": 4, "qat_eager": 5}  # functional: input, 2 weights, pooled activation;
# eager: input, 2 weights, conv and fc outputs


@pytest.fixture(scope="module", params=QAT_CASES, ids=[c.id for c in QAT_CASES])
def qat(request, tmp_path_factory):
    return request.param, run_case(request.param, tmp_path_factory.mktemp(request.param.id))


def _qdq_count(path) -> tuple[int, int]:
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


def test_a_qat_cnn_from_pytorch_trains_like_pytorch(qat):
    assert_parity(qat[1])


def test_the_trained_qat_export_keeps_its_quantize_dequantize_pairs(qat):
    case, result = qat
    pairs = (QDQ_PAIRS[case.id],) * 2
    assert _qdq_count(result.path) == pairs
    assert _qdq_count(result.path.with_name(f"{case.id}_trained.onnx")) == pairs


def test_the_float_weights_before_their_pairs_train_and_the_scales_do_not(qat):
    """PyTorch's parameters() (the float weights before their Q/DQ pairs, reached through
    them); the scales, buffers there, are frozen."""
    case, result = qat
    torch_params = {n for n, _ in case.build().named_parameters()}
    assert torch_params == {"conv.weight", "conv.bias", "fc.weight", "fc.bias"}
    assert set(result.session._state.active.info.trainable) == torch_params
    roles = result.session.parameter_roles
    assert {n for n, r in roles.items() if r.trainable} == torch_params


def test_qat_training_with_padded_channels_equals_compact(qat):
    """Channel padding 8 (the cuda layout, on the numpy backend): the pairs read logical views
    of NHWC activations and leave padded lanes zero; the losses equal the compact run's
    (measured: bit for bit)."""
    case, result = qat
    session = tr_onnx.TrainingSession(result.path, loss=tr_onnx.LossSpec("cross_entropy"),
                                      optimizer=tr_onnx.optim.SGD(lr=case.lr),
                                      backend="numpy", channel_align=8)
    losses = [float(session.train_step(*case.batches(k))) for k in range(case.steps)]
    np.testing.assert_allclose(losses, result.losses, rtol=1e-6)


def test_a_qat_training_step_allocates_only_numpy_buffers(qat):
    """As tests/test_step_allocation.py holds the zoo's inference: the pairs' forward and
    backward ops take their scratch from the plan (measured peaks ~27 KB per step)."""
    peak, left = step_allocation(qat[1].session._state.active.executor.run)
    assert peak < PEAK_BOUND
    assert left < LEFT_BOUND


# ---- forward against onnxruntime -----------------------------------------------------------------


def _single(op, inputs, attrs=None, opset=21, out_type=None):
    """A one-node model over ``inputs`` (name -> array; names starting with "c_" become
    initializers) and the feed of the others."""
    names = list(inputs)
    inits = [numpy_helper.from_array(v, n) for n, v in inputs.items() if n.startswith("c_")]
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items() if not n.startswith("c_")]
    node = helper.make_node(op, [n if inputs[n] is not None else "" for n in names], ["y"],
                            **(attrs or {}))
    graph = helper.make_graph([node], op, ins, [helper.make_value_info("y", onnx.TypeProto())],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model = onnx.shape_inference.infer_shapes(model)
    feed = {n: v for n, v in inputs.items() if not n.startswith("c_")}
    return model, feed


def _ours(model, feed):
    return tr_onnx.InferenceSession(model, backend="numpy").run(None, feed)[0]


def _u8(shape, lo=0, hi=256):
    return RNG.integers(lo, hi, shape).astype(np.uint8)


def _i8(shape):
    return RNG.integers(-128, 128, shape).astype(np.int8)


# uint8 activations with int8 weights: onnxruntime's x86 kernels (without VNNI) add pairs of
# u8*s8 products in int16 and saturate (its documented reason for reduce_range); weights within
# 7 bits keep it exact, full-range ones put it 59 steps off onnx.reference and tr_onnx (U8S8)
FORWARD = [
    ("QuantizeLinear_per_axis_int8", "QuantizeLinear",
     {"x": RNG.standard_normal((2, 4, 3, 3)).astype(np.float32) * 3,
      "c_s": np.array([0.02, 0.05, 0.01, 0.1], np.float32), "c_z": np.int8([0, 3, -7, 1])},
     {"axis": 1}),
    ("QuantizeLinear_blocked_int16", "QuantizeLinear",
     {"x": RNG.standard_normal((3, 10)).astype(np.float32) * 100,
      "c_s": RNG.uniform(0.001, 0.01, (3, 4)).astype(np.float32),
      "c_z": RNG.integers(-50, 50, (3, 4)).astype(np.int16)}, {"axis": 1, "block_size": 3}),
    ("DequantizeLinear_per_axis_uint16", "DequantizeLinear",
     {"x": RNG.integers(0, 65536, (2, 3, 4)).astype(np.uint16),
      "c_s": np.array([0.001, 0.002, 0.0005], np.float32),
      "c_z": np.array([30000, 0, 65535], np.uint16)}, {"axis": -2}),
    ("MatMulInteger_batched_int8", "MatMulInteger",
     {"a": _i8((2, 5, 7)), "b": _i8((7, 4)), "c_az": np.int8(3),
      "c_bz": np.int8([1, -2, 0, 5])}, {}),
    ("QLinearMatMul_int8_per_column", "QLinearMatMul",
     {"a": _i8((2, 3, 6)), "c_as": np.float32(0.02), "c_az": np.int8(-1), "b": _i8((6, 4)),
      "c_bs": np.float32(0.03), "c_bz": np.int8(2),
      "c_ys": np.float32(0.05), "c_yz": np.int8(4)}, {}),
    ("ConvInteger_pads_strides_group", "ConvInteger",
     {"x": _u8((2, 4, 7, 6)), "w": _u8((6, 2, 3, 2)), "c_xz": np.uint8(120),
      "c_wz": np.uint8(7)}, {"pads": [1, 0, 2, 1], "strides": [2, 1], "group": 2}),
    ("ConvInteger_1d_strided", "ConvInteger",
     {"x": _u8((2, 3, 9)), "w": _u8((4, 3, 3)), "c_xz": np.uint8(100)},
     {"strides": [2], "pads": [1, 1]}),
    ("ConvInteger_3d_dilated", "ConvInteger",
     {"x": _u8((1, 2, 4, 5, 4)), "w": _u8((2, 2, 2, 3, 2)), "c_xz": np.uint8(3),
      "c_wz": np.uint8(9)}, {"dilations": [1, 1, 2]}),
    ("QLinearConv_1d_same_lower", "QLinearConv",
     {"x": _u8((2, 3, 9)), "c_xs": np.float32(0.1), "c_xz": np.uint8(90), "w": _u8((4, 3, 3)),
      "c_ws": np.float32(0.05), "c_wz": np.uint8(120), "c_ys": np.float32(0.7),
      "c_yz": np.uint8(128)}, {"auto_pad": "SAME_LOWER"}),
    ("QLinearConv_per_channel_bias", "QLinearConv",
     {"x": _u8((2, 3, 6, 6)), "c_xs": np.float32(0.02), "c_xz": np.uint8(128),
      "w": RNG.integers(-64, 64, (4, 3, 3, 3)).astype(np.int8),  # 7 bits: U8S8 above
      "c_ws": np.array([0.01, 0.02, 0.015, 0.005], np.float32),
      "c_wz": np.int8([0, 0, 0, 0]), "c_ys": np.float32(0.1), "c_yz": np.uint8(100),
      "c_b": RNG.integers(-500, 500, 4).astype(np.int32)},
     {"pads": [1, 1, 1, 1], "dilations": [1, 2], "kernel_shape": [3, 3]}),
    ("QLinearConv_int8_stride_auto_pad", "QLinearConv",
     {"x": _i8((1, 4, 7, 7)), "c_xs": np.float32(0.05), "c_xz": np.int8(-5),
      "w": _i8((4, 1, 3, 3)), "c_ws": np.float32(0.01), "c_wz": np.int8(0),
      "c_ys": np.float32(0.2), "c_yz": np.int8(0)},
     {"auto_pad": "SAME_UPPER", "strides": [2, 2], "group": 4}),
]


@pytest.mark.parametrize("case", FORWARD, ids=[c[0] for c in FORWARD])
def test_forward_equals_onnxruntime(case):
    _, op, inputs, attrs = case
    opset = 21 if op in ("QuantizeLinear", "DequantizeLinear") else 10
    model, feed = _single(op, inputs, attrs, opset=opset)
    (expected,) = ort_run(model, feed)
    np.testing.assert_array_equal(_ours(model, feed), expected)


def test_dynamic_quantize_linear_equals_onnxruntime():
    x = (RNG.standard_normal((3, 17)) * 5 + 2).astype(np.float32)
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    graph = helper.make_graph([node], "dql", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [3, 17])], [helper.make_value_info(n, onnx.TypeProto())
                                             for n in "ysz"])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]))
    ours = tr_onnx.InferenceSession(model, backend="numpy").run(None, {"x": x})
    for a, b in zip(ours, ort_run(model, {"x": x})):
        np.testing.assert_array_equal(a, b)


# ---- kernels over the ml_dtypes quantized types, before dtypes.py maps them --------------------
# The importer cannot hold int4/uint4/float8 values yet (tr_onnx.dtypes), so these run the
# numpy kernels directly on hand-made plan contexts, against onnx.reference.


def _kernel_outputs(op, version, attrs, arrays, out_dtype):
    """Run ``op``'s numpy kernel on ``arrays`` (one output shaped like input 0)."""
    registry = default_registry()
    opdef = registry.lookup("", op, version, "numpy")
    node = ir.Node("n", op, "", version, [], [], dict(attrs))

    def info(i, a):
        return TensorInfo(f"in{i}", a.shape, a.dtype, StridedLayout.plain(a.shape), a.shape)

    y = np.zeros(arrays[0].shape, out_dtype)
    ctx = KernelContext(node, [info(i, a) for i, a in enumerate(arrays)], [info(0, y)],
                        [None] * len(arrays), "numpy")
    run = opdef.kernels["numpy"](ctx)
    run(arrays, [y], [np.zeros(s, d) for s, d in ctx.workspace_requests])
    return y


def _reference(op, version, attrs, arrays, out_dtype):
    names = [f"in{i}" for i in range(len(arrays))]
    inits = [numpy_helper.from_array(a, n) for n, a in zip(names[1:], arrays[1:])]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], **attrs)], op,
        [helper.make_tensor_value_info("in0", helper.np_dtype_to_tensor_dtype(arrays[0].dtype),
                                       arrays[0].shape)],
        [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(
            np.dtype(out_dtype)), arrays[0].shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", version)])
    return ReferenceEvaluator(model).run(None, {"in0": arrays[0]})[0]


X_WIDE = np.random.default_rng(3).standard_normal((2, 4, 6)).astype(np.float32) * 40
ML_DTYPES = [  # id, op, attrs, inputs after x, output dtype
    ("Q_int4_per_axis", "QuantizeLinear", {"axis": 1},
     [np.float32([0.5, 2, 4, 8]), np.array([1, -2, 0, 7], ml_dtypes.int4)], ml_dtypes.int4),
    ("Q_uint4_blocked", "QuantizeLinear", {"axis": 2, "block_size": 4},
     [np.full((2, 4, 2), 3.0, np.float32), np.full((2, 4, 2), 8, ml_dtypes.uint4)],
     ml_dtypes.uint4),
    ("Q_float8e4m3fn_saturate", "QuantizeLinear", {},
     [np.float32(0.05), np.zeros((), ml_dtypes.float8_e4m3fn)], ml_dtypes.float8_e4m3fn),
    ("Q_float8e5m2_no_saturate", "QuantizeLinear", {"saturate": 0},
     [np.float32(1e-3), np.zeros((), ml_dtypes.float8_e5m2)], ml_dtypes.float8_e5m2),
]


@pytest.mark.parametrize("case", ML_DTYPES, ids=[c[0] for c in ML_DTYPES])
def test_quantize_kernels_are_generic_over_the_ml_dtypes_types(case):
    """QuantizeLinear to int4/uint4 (saturated, half to even) and float8 (clipped to its
    largest finite value unless saturate=0), then DequantizeLinear back, equal
    onnx.reference bit for bit."""
    _, op, attrs, params, qtype = case
    arrays = [X_WIDE, *params]
    q = _kernel_outputs(op, 25, attrs, arrays, qtype)
    expected = _reference(op, 25, attrs, arrays, qtype)
    np.testing.assert_array_equal(q.astype(np.float32), expected.astype(np.float32))
    back, dq_attrs = [q, *params], {k: v for k, v in attrs.items() if k != "saturate"}
    y = _kernel_outputs("DequantizeLinear", 25, dq_attrs, back, np.float32)
    np.testing.assert_array_equal(y, _reference("DequantizeLinear", 25, dq_attrs, back,
                                                np.float32))


REFERENCE_ONLY = [  # attributes onnxruntime's opsets here do not reach: against onnx.reference
    ("QuantizeLinear_precision_float16", "QuantizeLinear",
     {"x": RNG.standard_normal((6, 40)).astype(np.float32) * 7,  # float32 division: 14 differ
      "c_s": np.float32(0.037), "c_z": np.uint8(17)}, {"precision": TensorProto.FLOAT16}, 25),
    ("QuantizeLinear_output_dtype_int16", "QuantizeLinear",
     {"x": RNG.standard_normal((3, 8)).astype(np.float32) * 700,
      "c_s": np.float32(0.01)}, {"output_dtype": TensorProto.INT16}, 24),
    ("DequantizeLinear_output_dtype_float16", "DequantizeLinear",
     {"x": _i8((2, 6)), "c_s": np.array([0.5, 0.25], np.float32),
      "c_z": np.int8([3, -3])}, {"axis": 0, "output_dtype": TensorProto.FLOAT16}, 25),
]


@pytest.mark.parametrize("case", REFERENCE_ONLY, ids=[c[0] for c in REFERENCE_ONLY])
def test_precision_and_output_dtype_equal_onnx_reference(case):
    """``precision`` (v25: the division's type) and ``output_dtype`` (v21 Q, v23 DQ)."""
    _, op, inputs, attrs, opset = case
    model, feed = _single(op, inputs, attrs, opset=opset)
    expected = ReferenceEvaluator(model).run(None, feed)[0]
    ours = _ours(model, feed)
    assert ours.dtype == expected.dtype
    np.testing.assert_array_equal(ours, expected)
