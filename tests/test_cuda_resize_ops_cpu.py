"""Resize, Upsample and ResizeGrad on the cuda backend (``backends/cuda/ops/resize.py``,
``kernels/resize.cu``), checked on the host emulator against the numpy backend.

* Inference: single-node models (and Conv -> Resize with ``channel_align=8``, which gives the
  Resize a channels-last input and output with 5 channels padded to 8) over every mode,
  nearest_mode, coordinate_transformation_mode, antialias / exclude_outside / cubic_coeff_a,
  scales up and down, sizes with axes and keep_aspect_ratio_policy, tf_crop_and_resize's roi
  and extrapolation, 5-D trilinear, the legacy Resize 10 / Upsample 7 and 9; float32, float16
  and bfloat16 storage. The padded output lanes stay zero.
* Training: three SGD steps of a small UNet-like model (Conv -> MaxPool -> Conv -> Resize(2x)
  -> merge with the skip branch -> Conv -> Gemm), losses and parameters against numpy's.
* The plans launched the resize kernels, with arguments of the kernels' C types.

Tolerance, inference: bit for bit, every mode. The device builds the numpy kernel's tables
with its float64 expressions in its order (nearest picks and weights are its bits, the
pairwise sums of antialias / exclude_outside are NumPy's algorithm), then sums the taps in
fp32 left to right as NumPy's take / multiply / add sequence does; the kernels compile with
``--fmad=false`` (host: ``-ffp-contract=off``), and f16/bf16 round once, at the store, as
numpy's final cast does. Training: the resize nodes are exact as well; the convolutions'
backward on the emulator runs the numpy kernels too, but the numpy plan folds its gradient
accumulators (``train_pass.fold_accumulators``) and the cuda plan does not, so sums of
gradient contributions round differently: losses within 1e-5 relative, parameters within
2e-4 relative or 1e-6 absolute (seen: losses 3.3e-7 relative, parameters 6e-8 absolute).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.dtypes import BFLOAT16, onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.ops.resize import geometry
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

SHAPE = (2, 3, 6, 7)
CONV_CHANNELS = 5  # padded to 8 by channel_align=8


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("resize_kernels")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def resize_model(attrs: dict, scales=None, sizes=None, roi=None, conv: bool = False,
                 shape=SHAPE, dtype=np.float32, op: str = "Resize", opset: int = 19):
    """x -> [Conv(3x3, pads 1, CONV_CHANNELS) ->] Resize/Upsample -> y; scales / sizes / roi
    as initializers (Upsample 7: the scales attribute)."""
    elem = onnx_elem_type(dtype)
    rng = np.random.default_rng(0)
    inits, feed_shape = [], list(shape)
    data = "x"
    nodes = []
    if conv:
        w = (0.3 * rng.standard_normal((CONV_CHANNELS, shape[1], 3, 3))).astype(dtype)
        inits.append(numpy_helper.from_array(w, "w"))
        nodes.append(helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]))
        shape = (shape[0], CONV_CHANNELS, *shape[2:])
        data = "h"
    inputs = [data]
    if op == "Upsample" and opset < 9:
        attrs = {**attrs, "scales": [float(s) for s in scales]}
    elif op == "Upsample" or opset < 11:
        inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
        inputs.append("scales")
    else:
        if opset < 13 and roi is None:  # Resize 11's roi is a required input (may be empty)
            roi = np.zeros(0, np.float32)
        for name, value, kind in (("roi", roi, np.float32), ("scales", scales, np.float32),
                                  ("sizes", sizes, np.int64)):
            if value is None:
                inputs.append("")
            else:
                inits.append(numpy_helper.from_array(np.asarray(value, kind), name))
                inputs.append(name)
        while inputs[-1] == "":
            inputs.pop()
    version = opset if op == "Resize" else min(opset, 9)
    full = {"coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor",
            "cubic_coeff_a": -0.75, "exclude_outside": 0, "extrapolation_value": 0.0,
            "keep_aspect_ratio_policy": "stretch", **attrs} if op == "Resize" and opset >= 11 \
        else attrs
    given = None if scales is None else np.asarray(scales, np.float32)  # the stored scales
    out = [g.out_size for g in geometry(op, version, full, shape, roi, given, sizes)]
    nodes.append(helper.make_node(op, inputs, ["y"], **attrs))
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", elem,
                                                                              feed_shape)],
                              [helper.make_tensor_value_info("y", elem, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_both(model, x, device):
    """(numpy's y, the emulated cuda backend's y, the cuda session's plan)."""
    ref = tr_onnx.InferenceSession(model, backend="numpy", channel_align=8).run(None, {"x": x})
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), channel_align=8)
    got = sess.run(None, {"x": x})
    (plan,) = sess._plans.values()
    return ref[0], got[0], plan


def launches(plan) -> list[Launch]:
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


def assert_bits_equal(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    diff = got.view(bits) != ref.view(bits)
    assert not diff.any(), (f"{diff.sum()} of {diff.size} differ; max abs "
                            f"{np.abs(got.astype(np.float64) - ref.astype(np.float64)).max()}")


UP, DOWN, MIXED = [1, 1, 2, 2], [1, 1, 0.5, 0.6], [1, 1, 1.7, 0.4]
COORDS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
          "asymmetric"]
NEAREST = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]

CASES = (
    [pytest.param({"mode": "nearest", "nearest_mode": r, "coordinate_transformation_mode": c},
                  s, None, None, id=f"nearest-{r}-{c}-{n}")
     for r in NEAREST for c in COORDS for n, s in (("up", UP), ("mixed", MIXED))]
    + [pytest.param({"mode": m, "coordinate_transformation_mode": c}, s, None, None,
                    id=f"{m}-{c}-{n}")
       for m in ("linear", "cubic") for c in COORDS
       for n, s in (("up", UP), ("down", DOWN), ("mixed", MIXED))]
    + [pytest.param({"mode": m, "antialias": 1}, s, None, None, id=f"{m}-antialias-{n}")
       for m in ("linear", "cubic") for n, s in (("down", DOWN), ("by5", [1, 1, 0.2, 0.19]),
                                                 ("mixed", MIXED))]
    + [pytest.param({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, s, None,
                    None, id=f"cubic-exclude-outside-a-0.5-{n}")
       for n, s in (("up", UP), ("mixed", MIXED))]
    + [pytest.param({"mode": "linear"}, None, [2, 3, 9, 5], None, id="linear-sizes"),
       pytest.param({"mode": "nearest", "axes": [3, 2]}, None, [11, 4], None,
                    id="nearest-sizes-axes"),
       pytest.param({"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
                    None, [9, 9], None, id="linear-not-larger"),
       pytest.param({"mode": "cubic", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"},
                    None, [9, 9], None, id="cubic-not-smaller"),
       pytest.param({"mode": "linear", "axes": [3]}, [1.5], None, None, id="linear-one-axis"),
       pytest.param({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
                     "extrapolation_value": -2.5}, None, [2, 3, 8, 9],
                    [0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], id="linear-tf-crop-extrapolates"),
       pytest.param({"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"},
                    [1, 1, 1.5, 2], None, [0, 0, 0.1, 0.2, 1, 1, 0.8, 0.7],
                    id="nearest-tf-crop"),
       pytest.param({"mode": "linear"}, [1, 1, 1, 1], None, None, id="identity")])


@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize(("attrs", "scales", "sizes", "roi"), CASES)
def test_resize_on_the_device_equals_the_numpy_kernel_bit_for_bit(attrs, scales, sizes, roi,
                                                                  conv, device, signatures):
    if conv and attrs.get("axes") is None and sizes is not None and sizes[1] != 3:
        pytest.skip("sizes name the input's channel count")
    if conv and sizes is not None and attrs.get("axes") is None:
        sizes = [sizes[0], CONV_CHANNELS, *sizes[2:]]
    model = resize_model(attrs, scales, sizes, roi, conv=conv)
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    ref, got, plan = run_both(model, x, device)
    assert_bits_equal(got, ref)
    ls = launches(plan)
    check_launch_arguments(ls, plan, signatures)
    y = plan.memory.tensors["y"]
    assert y.layout.kind == ("channels_last" if conv else "plain")
    assert pad_lanes_are_zero(plan.executor.device.arena, y)
    if attrs != {"mode": "linear"} or scales != [1, 1, 1, 1]:
        assert any(c.kernel.name.startswith("tr_resize_apply_") for c in ls)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize(("attrs", "scales"), [
    ({"mode": "nearest"}, UP), ({"mode": "linear"}, MIXED),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, DOWN),
    ({"mode": "linear", "antialias": 1}, DOWN)], ids=["nearest", "linear", "cubic", "aa"])
def test_half_storage_resizes_in_fp32_and_rounds_once_as_numpy(attrs, scales, conv, dtype,
                                                               device):
    model = resize_model(attrs, scales, conv=conv, dtype=dtype)
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(dtype)
    ref, got, plan = run_both(model, x, device)
    assert_bits_equal(got, ref)
    assert any(c.kernel.name.startswith("tr_resize_apply_") for c in launches(plan))


@pytest.mark.parametrize(("attrs", "scales"), [
    ({"mode": "linear"}, [1, 1, 2, 0.5, 1.5]), ({"mode": "nearest"}, [1, 1, 0.5, 2, 3]),
    ({"mode": "cubic", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 1.5, 1, 0.7])],
    ids=["trilinear", "nearest", "cubic"])
def test_five_d_resizes_three_axes_bit_for_bit(attrs, scales, device):
    shape = (1, 2, 4, 3, 5)
    model = resize_model(attrs, scales, shape=shape)
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    ref, got, _ = run_both(model, x, device)
    assert_bits_equal(got, ref)


@pytest.mark.parametrize(("op", "opset", "attrs", "scales"), [
    ("Upsample", 7, {"mode": "nearest"}, [1, 1, 2, 3]),
    ("Upsample", 7, {"mode": "linear"}, [1, 1, 2, 1.5]),
    ("Upsample", 9, {"mode": "nearest"}, [1, 1, 0.5, 2]),
    ("Resize", 10, {"mode": "linear"}, [1, 1, 1.5, 0.5]),
    ("Resize", 11, {"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn"},
     [1, 1, 1.5, 0.5])], ids=["upsample7-nearest", "upsample7-linear", "upsample9-nearest",
                              "resize10-linear", "resize11-tf-half-pixel-for-nn"])
def test_legacy_resizes_use_their_own_coordinates_bit_for_bit(op, opset, attrs, scales, device):
    model = resize_model(attrs, scales, op=op, opset=opset)
    x = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    ref, got, plan = run_both(model, x, device)
    assert_bits_equal(got, ref)
    assert any(c.kernel.name.startswith("tr_resize_apply_") for c in launches(plan))


# ---- training ---------------------------------------------------------------------------------


def unet(mode: str, coord: str):
    """A tiny UNet: Conv -> Relu -> MaxPool -> Conv -> Resize(2x) -> Add(skip branch, a 1x1
    Conv) -> Conv -> Gemm. The skip joins by Add: Concat's gradient (Split) is the tensor
    family's binding."""
    rng = np.random.default_rng(0)

    def w(name, shape):
        return numpy_helper.from_array((0.2 * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    inits = [w("w1", (4, 3, 3, 3)), w("w2", (6, 4, 3, 3)), w("wa", (6, 4, 1, 1)),
             w("w3", (5, 6, 3, 3)), w("w4", (10, 5 * 8 * 8)),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "sc")]
    nodes = [helper.make_node("Conv", ["input", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("MaxPool", ["ar"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["b", "", "sc"], ["u"], mode=mode,
                              coordinate_transformation_mode=coord),
             helper.make_node("Conv", ["ar", "wa"], ["skip"]),
             helper.make_node("Add", ["skip", "u"], ["merged"]),
             helper.make_node("Conv", ["merged", "w3"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Gemm", ["f", "w4"], ["scores"], transB=1)]
    graph = helper.make_graph(
        nodes, "unet", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.filterwarnings("ignore::tr_onnx.errors.ExportAdviceWarning")
@pytest.mark.parametrize(("mode", "coord"), [("nearest", "asymmetric"),
                                             ("linear", "half_pixel"),
                                             ("cubic", "align_corners")])
def test_a_unet_trains_on_cuda_as_on_numpy(mode, coord, device, signatures):
    kw = dict(optimizer=SGD(lr=0.01), channel_align=8)
    cuda = tr_onnx.TrainingSession(unet(mode, coord), backend=CudaBackend(device=device), **kw)
    ref = tr_onnx.TrainingSession(unet(mode, coord), backend="numpy", **kw)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 2)
        np.testing.assert_allclose(cuda.train_step({"input": x}, y),
                                   ref.train_step({"input": x}, y), rtol=1e-5)
    a, b = cuda.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=1e-6, err_msg=name)
    plan = cuda._state.active
    grads = [n for n in plan.graph.nodes if n.op_type == "ResizeGrad"]
    assert grads and plan.memory.tensors[grads[0].outputs[0].name].layout.kind == \
        "channels_last"
    ls = launches(plan)
    check_launch_arguments(ls, plan, signatures)
    names = {c.kernel.name for c in ls}
    assert {"tr_resize_table", "tr_resize_transpose", "tr_resize_apply_f32_f32"} <= names


@pytest.mark.internal_ops
def test_resize_grad_is_the_transpose_of_the_forward_map(device):
    """<Resize(x), gy> = <x, ResizeGrad(gy)> on the device, for a cubic antialiased map (taps
    merged at the edges, rows of several lengths): the gather form lists every tap."""
    attrs = {"mode": "cubic", "antialias": 1, "exclude_outside": 0}
    scales = [1, 1, 0.6, 1.4]
    shape = (1, 2, 7, 5)
    out = [int(float(np.float32(s)) * d) for s, d in zip(scales, shape)]  # as geometry()
    nodes = [helper.make_node("ResizeGrad", ["gy", "", "scales"], ["gx"], domain="ai.tr_onnx",
                              forward_op="Resize", forward_version=19,
                              coordinate_transformation_mode="half_pixel",
                              nearest_mode="round_prefer_floor", cubic_coeff_a=-0.75,
                              extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
                              **attrs)]
    graph = helper.make_graph(
        nodes, "resize_grad", [helper.make_tensor_value_info("gy", TensorProto.FLOAT, out)],
        [helper.make_tensor_value_info("gx", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(np.asarray(scales, np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19),
                                                    helper.make_opsetid("ai.tr_onnx", 1)])
    rng = np.random.default_rng(5)
    gy = rng.standard_normal(out).astype(np.float32)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    (gx,) = sess.run(None, {"gy": gy})
    (gx_ref,) = tr_onnx.InferenceSession(model, backend="numpy").run(None, {"gy": gy})
    assert_bits_equal(gx, gx_ref)
    x = rng.standard_normal(shape).astype(np.float32)
    ref, y, _ = run_both(resize_model(attrs, scales, shape=shape), x, device)
    assert_bits_equal(y, ref)
    np.testing.assert_allclose(np.vdot(y.astype(np.float64), gy),
                               np.vdot(x.astype(np.float64), gx), rtol=1e-5)
