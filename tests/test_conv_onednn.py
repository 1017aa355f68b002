"""float32 Conv, ConvGradData and ConvGradFilter through oneDNN (ops.conv_onednn) against
PyTorch autograd in float32 and against our own NumPy kernels, compact (align 1) and padded
(align 8) channels, 1-D to 3-D windows, groups, depthwise, strides, dilations, padding; and
that a shape oneDNN only has its reference loop for runs NumPy instead; an inference session's
constant weights are packed once and every run matches PyTorch and onnxruntime.

oneDNN is part of the test extra on Linux x86-64 (``onednn-cpu-gomp``): there these tests
require it, so a CI machine without it fails instead of silently testing NumPy twice.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from gradcheck import GradCase, build_model
from onednn_kernels import EXPECTED, spy_kernels
from onnx import TensorProto, helper, numpy_helper

from tr_onnx import InferenceSession, onednn
from tr_onnx.ops import conv_onednn
from tr_onnx.training.gradients import vjp

ALIGNS = [1, 8]
# float32: oneDNN and PyTorch (itself oneDNN) sum in their own orders, NumPy in another
RTOL, ATOL = 2e-5, 2e-5
KERNELS = ("conv_onednn", "conv_grad_data_onednn", "conv_grad_filter_onednn")

# id: (x shape, w shape, stride, padding, dilation, groups); torch takes symmetric padding
CASES = {
    "3x3_pad": ((2, 6, 12, 11), (5, 6, 3, 3), 1, 1, 1, 1),
    "stride2": ((2, 8, 9, 10), (16, 8, 3, 3), 2, 1, 1, 1),
    "pointwise_stride2": ((2, 16, 8, 8), (32, 16, 1, 1), 2, 0, 1, 1),
    "dilation": ((1, 4, 16, 15), (6, 4, 3, 2), 1, (2, 1), (2, 3), 1),
    "groups": ((2, 6, 14, 12), (8, 3, 3, 3), 1, 1, 1, 2),
    "depthwise": ((2, 24, 9, 9), (24, 1, 3, 3), 1, 1, 1, 24),
    "depthwise_stride2_mult": ((1, 8, 10, 10), (16, 1, 3, 3), 2, 1, 1, 8),
    "stem_7x7": ((2, 3, 20, 20), (8, 3, 7, 7), 2, 3, 1, 1),
    "conv1d": ((2, 5, 17), (7, 5, 3), 1, 1, 1, 1),
    "conv3d": ((1, 3, 6, 7, 5), (4, 3, 3, 3, 3), 1, 1, 1, 1),
}
TORCH_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
# where oneDNN 3.2 has a fast (jit/brgconv) kernel for all three with dense channels (its 1x1
# weight gradient is declined: conv_onednn.conv_grad_filter_onednn); the others (channels padded
# past their count, odd group widths, dilations, 1-D, 3-D) may get only its reference loop,
# which conv_onednn declines: NumPy runs them, compared all the same
FAST = {"3x3_pad": KERNELS, "stride2": KERNELS, "depthwise": KERNELS,
        "depthwise_stride2_mult": KERNELS, "stem_7x7": KERNELS,
        "pointwise_stride2": ("conv_onednn", "conv_grad_data_onednn")}
# conv_onednn.preferred: which kernels oneDNN runs by shape (the rest NumPy runs faster), where
# oneDNN runs AVX2 and where it runs AVX-512 (windows wider than 1x1 up to weights 32x the map)
ALL = KERNELS
RULE = {
    "resnet18_layer4": (((8, 512, 2, 2), (512, 512, 3, 3), 1, 1, 1, 1),
                        ("conv_grad_data_onednn",), ("conv_grad_data_onednn",)),
    "resnet18_layer2": (((2, 128, 8, 8), (128, 128, 3, 3), 1, 1, 1, 1),
                        ("conv_grad_data_onednn",), ALL),
    "layer4_stride2": (((2, 64, 4, 4), (128, 64, 3, 3), 2, 1, 1, 1), (), ()),
    "layer3_stride2": (((2, 32, 8, 8), (64, 32, 3, 3), 2, 1, 1, 1), (), ALL),
    "stem": (((2, 3, 32, 32), (16, 3, 7, 7), 2, 3, 1, 1),
             ("conv_onednn", "conv_grad_filter_onednn"), ALL),
    "pointwise": (((2, 16, 8, 8), (32, 16, 1, 1), 1, 0, 1, 1), ("conv_onednn",),
                  ("conv_onednn",)),
    "depthwise": (CASES["depthwise"], KERNELS, KERNELS),
}


def _ours(spec, align, he_init=False):
    """``he_init``: weights scaled by sqrt(2 / fan_in) as a trained layer's, so that a wide
    layer's outputs stay ~1 (with unit weights, 4608 products per output sum to ~70, whose
    float32 summation-order differences exceed the absolute tolerance)."""
    xs, wsh, stride, padding, dilation, groups = spec
    nd = len(xs) - 2
    rng = np.random.default_rng(11)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in (xs, wsh, (wsh[0],)))
    if he_init:
        w *= np.float32(np.sqrt(2.0 / np.prod(wsh[1:])))

    def each(v):
        return list(v) if isinstance(v, tuple) else [v] * nd

    attrs = {"strides": each(stride), "pads": each(padding) * 2, "dilations": each(dilation),
             "group": groups}
    model = build_model(GradCase("Conv", "Conv", [x, w, b], attrs))
    feed = {"x0": x, "x1": w, "x2": b}
    out_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    cot = rng.standard_normal(out_shape).astype(np.float32)
    y, grads = vjp(model, feed, list(feed), cot, channel_align=align)
    return (x, w, b, cot), (y, grads["x0"], grads["x1"], grads["x2"])


def _torch(spec, x, w, b, cot):
    _, _, stride, padding, dilation, groups = spec
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    y = TORCH_CONV[x.ndim](*ts, stride, padding, dilation, groups)
    y.backward(torch.tensor(cot))
    return (y.detach().numpy(), *(t.grad.numpy() for t in ts))


def _close(got, want):
    for name, g, t in zip(("y", "gx", "gw", "gb"), got, want):
        np.testing.assert_allclose(g, t, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.fixture
def used(monkeypatch):
    """Names of the oneDNN kernels that built a step (a factory returning None is not use)."""
    return spy_kernels(monkeypatch, conv_onednn, KERNELS)


def test_onednn_is_installed_where_the_test_extra_installs_it():
    if EXPECTED:
        assert onednn.available(), "pip install onednn-cpu-gomp (part of tr_onnx[test])"


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec_id", list(CASES))
def test_conv_matches_torch_and_numpy(spec_id, align, used, monkeypatch):
    if not onednn.available():
        pytest.fail("oneDNN is not installed")
    # the kernels themselves, on every shape: the shape rule is tested below
    monkeypatch.setattr(conv_onednn, "preferred", lambda *args: True)
    spec = CASES[spec_id]
    inputs, got = _ours(spec, align)
    if align == 1 and spec_id in FAST:  # dense channels, 2-D: oneDNN's own kernels run
        assert sorted(set(used)) == sorted(FAST[spec_id]), spec_id
    _close(got, _torch(spec, *inputs))
    monkeypatch.setattr(conv_onednn, "usable", lambda win, dtype: False)
    _, reference = _ours(spec, align)
    _close(got, reference)


@pytest.mark.parametrize("case_id", list(RULE))
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_shape_rule_picks_the_faster_library(case_id, isa, used, monkeypatch):
    """Each ISA's rule, whichever this machine has (oneDNN's AVX2 kernels run the AVX-512
    rule's choices as well; the numbers are checked either way)."""
    spec, avx2_kernels, avx512_kernels = RULE[case_id]
    monkeypatch.setattr(onednn, "avx512", lambda: isa == "avx512")
    inputs, got = _ours(spec, 1, he_init=True)
    assert sorted(set(used)) == sorted(avx512_kernels if isa == "avx512" else avx2_kernels)
    _close(got, _torch(spec, *inputs))


def test_reference_loop_is_declined(used):
    """A 3-channel image padded to 8 lanes: oneDNN offers only ``ref:any`` for the forward
    convolution (600 ms for ResNet-18's stem where NumPy takes 3 ms), so NumPy runs it."""
    _ours(CASES["stem_7x7"], 8)
    assert "conv_onednn" not in used


def _initializer_model(spec, w, b):
    """A Conv whose weights and bias are initializers (an exported model's parameters)."""
    xs, _, stride, padding, dilation, groups = spec
    nd = len(xs) - 2

    def each(v):
        return list(v) if isinstance(v, tuple) else [v] * nd

    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=each(stride),
                            pads=each(padding) * 2, dilations=each(dilation), group=groups)
    graph = helper.make_graph(
        [node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(xs))],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec_id", list(CASES))
def test_inference_packs_constant_weights_once(spec_id, align, used, monkeypatch):
    """An InferenceSession's weights never change (passes.inference_folds.freeze_parameters):
    the forward kernel reorders them into oneDNN's layout once, when it is made, and every run
    matches PyTorch and onnxruntime."""
    packed = []
    real = conv_onednn._packed
    monkeypatch.setattr(conv_onednn, "_packed",
                        lambda *args: packed.append(args) or real(*args))
    spec = CASES[spec_id]
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in (spec[0], spec[1],
                                                                     (spec[1][0],)))
    model = _initializer_model(spec, w, b)
    session = InferenceSession(model.SerializeToString(), channel_align=align)
    want = TORCH_CONV[x.ndim](*(torch.tensor(a) for a in (x, w, b)), *spec[2:]).numpy()
    for _ in range(2):  # the packed weights serve every run
        got = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    runtime = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, runtime.run(None, {"x": x})[0], rtol=RTOL, atol=ATOL)
    if align == 1 and spec_id in FAST:
        assert used == ["conv_onednn"] and len(packed) == 1, spec_id
    assert len(packed) == used.count("conv_onednn")
