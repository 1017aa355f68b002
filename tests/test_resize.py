"""Resize and Upsample beyond the node suite and the finite-difference table.

- PyTorch autograd (float64): ``F.interpolate`` in each mode against the ONNX Resize it maps
  to, forward and input gradient, with compact and padded (align 8) channels.
- onnxruntime: the legacy semantics (Resize 10, Upsample 7 and 9), which onnx.reference does
  not implement, and integer tensors.
- plan-time inputs: scales and sizes fed as graph inputs (the plan specialises on them).
- layout: Conv -> Resize -> Conv stays channels-last (no LayoutTranspose).
- must-show: a small UNet (bilinear and nearest upsampling, a transposed convolution, skip
  concatenations, BatchNorm) exported by both exporters trains like PyTorch with per-pixel
  cross-entropy over [N, C, H, W] logits and [N, H, W] labels.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from gradcheck import Const, GradCase, build_model
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run
from torch import nn
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.errors import TrOnnxError
from tr_onnx.training.gradients import vjp

ALIGNS = [1, 8]
RTOL, ATOL = 1e-10, 1e-12  # float64: the same weights, summed in another order than torch's


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


# ---- PyTorch autograd ---------------------------------------------------------------------
# id: (x shape, F.interpolate keywords, the ONNX Resize it is). The output size is given to both
# as sizes; the "scale" case gives torch scale_factor and ONNX scales. PyTorch's antialiasing
# weighs only the taps inside the input (exclude_outside), its bicubic with Keys' a = -0.5.
TORCH = {
    "nearest_up": ((2, 3, 4, 5), {"size": (7, 9), "mode": "nearest"},
                   {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                    "nearest_mode": "floor"}),
    "nearest_down": ((1, 3, 7, 5), {"size": (3, 2), "mode": "nearest"},
                     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                      "nearest_mode": "floor"}),
    "nearest_scale": ((1, 5, 3, 4), {"scale_factor": 2.0, "mode": "nearest"},
                      {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                       "nearest_mode": "floor"}),
    "nearest_exact": ((2, 3, 4, 5), {"size": (7, 3), "mode": "nearest-exact"},
                      {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                       "nearest_mode": "round_prefer_ceil"}),
    "bilinear": ((2, 3, 4, 5), {"size": (7, 9), "mode": "bilinear", "align_corners": False},
                 {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "bilinear_down": ((1, 3, 8, 7), {"size": (3, 4), "mode": "bilinear",
                                     "align_corners": False},
                      {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "bilinear_align_corners": ((1, 5, 4, 5), {"size": (7, 3), "mode": "bilinear",
                                              "align_corners": True},
                               {"mode": "linear",
                                "coordinate_transformation_mode": "align_corners"}),
    "bicubic": ((1, 3, 4, 5), {"size": (7, 3), "mode": "bicubic", "align_corners": False},
                {"mode": "cubic", "cubic_coeff_a": -0.75,
                 "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "bicubic_align_corners": ((1, 3, 5, 4), {"size": (3, 7), "mode": "bicubic",
                                             "align_corners": True},
                              {"mode": "cubic", "cubic_coeff_a": -0.75,
                               "coordinate_transformation_mode": "align_corners"}),
    "trilinear": ((1, 3, 3, 4, 3), {"size": (5, 6, 2), "mode": "trilinear",
                                    "align_corners": False},
                  {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "linear_1d": ((2, 3, 5), {"size": (8,), "mode": "linear", "align_corners": False},
                  {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "bilinear_antialias": ((1, 3, 9, 8), {"size": (4, 3), "mode": "bilinear",
                                          "align_corners": False, "antialias": True},
                           {"mode": "linear", "antialias": 1, "exclude_outside": 1,
                            "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "bicubic_antialias": ((1, 3, 9, 8), {"size": (4, 3), "mode": "bicubic",
                                         "align_corners": False, "antialias": True},
                          {"mode": "cubic", "antialias": 1, "cubic_coeff_a": -0.5,
                           "exclude_outside": 1,
                           "coordinate_transformation_mode": "pytorch_half_pixel"}),
}


def _onnx_inputs(x, kwargs):
    if "scale_factor" in kwargs:
        scales = [1.0, 1.0] + [float(kwargs["scale_factor"])] * (x.ndim - 2)
        return [x, None, np.asarray(scales, np.float32)]
    sizes = np.asarray(list(x.shape[:2]) + list(kwargs["size"]), np.int64)
    return [x, None, None, sizes]


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", list(TORCH.values()), ids=list(TORCH))
def test_resize_matches_pytorch_interpolate_and_its_gradient(spec, align):
    shape, kwargs, attrs = spec
    x = _rand(1, *shape)
    inputs = _onnx_inputs(x, kwargs)
    case = GradCase("resize", "Resize", [x] + [None if a is None else Const(a)
                                            for a in inputs[1:]], attrs, opset=19)
    model = build_model(case)
    out_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    cot = np.random.default_rng(7).standard_normal(out_shape)
    y, grads = vjp(model, {"x0": x}, ["x0"], cot, channel_align=align)
    tx = torch.tensor(x, requires_grad=True)
    ty = F.interpolate(tx, **kwargs)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads["x0"], tx.grad.numpy(), rtol=RTOL, atol=ATOL)


# ---- legacy semantics against onnxruntime --------------------------------------------------


def _legacy_model(op, opset, x, mode, scales, as_attr=False):
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))]
    inits, names, attrs = [], ["x"], {"mode": mode}
    if as_attr:
        attrs["scales"] = [float(s) for s in scales]
    else:
        inits.append(onnx.numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
        names.append("scales")
    out = [int(d * s) for d, s in zip(x.shape, scales)]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph([node], op, inputs, [helper.make_tensor_value_info(
        "y", onnx.TensorProto.FLOAT, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


# id: (op, opset, mode, scales, scales as an attribute)
LEGACY = {
    "resize10_nearest_up": ("Resize", 10, "nearest", [1, 1, 2, 1.5], False),
    "resize10_nearest_down": ("Resize", 10, "nearest", [1, 1, 0.5, 0.7], False),
    "resize10_linear_up": ("Resize", 10, "linear", [1, 1, 2, 1.5], False),
    "resize10_linear_down": ("Resize", 10, "linear", [1, 1, 0.5, 0.7], False),
    "upsample9_nearest": ("Upsample", 9, "nearest", [1, 1, 2, 2.5], False),
    "upsample9_linear": ("Upsample", 9, "linear", [1, 1, 2, 2.5], False),
    "upsample7_nearest": ("Upsample", 7, "nearest", [1, 1, 3, 1.5], True),
    "upsample7_linear": ("Upsample", 7, "linear", [1, 1, 2, 2], True),
}


@pytest.mark.parametrize("spec", list(LEGACY.values()), ids=list(LEGACY))
def test_legacy_resize_and_upsample_match_onnxruntime(spec):
    op, opset, mode, scales, as_attr = spec
    x = _rand(2, 2, 3, 6, 7).astype(np.float32)
    model = _legacy_model(op, opset, x, mode, scales, as_attr)
    (ours,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    (theirs,) = ort_run(model, {"x": x})
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


class _Interpolate(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return F.interpolate(x, **self.kwargs)


@pytest.mark.parametrize("opset", [9, 10])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_classic_exports_at_opset_9_and_10_run_as_onnxruntime_runs_them(mode, opset, tmp_path):
    """torch's classic exporter writes Upsample 9 / Resize 10 (asymmetric coordinates)."""
    x = _rand(8, 2, 3, 5, 6).astype(np.float32)
    path = tmp_path / f"{mode}{opset}.onnx"
    with warnings.catch_warnings():  # the exporter's note that opset < 11 is not PyTorch's
        warnings.simplefilter("ignore")  # interpolation: true, so onnxruntime is the oracle
        torch.onnx.export(_Interpolate(scale_factor=1.5, mode=mode), (torch.from_numpy(x),),
                          str(path), dynamo=False, opset_version=opset, input_names=["x"])
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ("Upsample" if opset == 9 else "Resize") in ops
    (ours,) = tr_onnx.InferenceSession(path).run(None, {"x": x})
    np.testing.assert_allclose(ours, ort_run(str(path), {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_opset6_upsample_is_converted_and_runs_as_upsample7():
    """Upsample 1 (height_scale, width_scale, "bilinear") comes in through the importer's
    conversion to opset 7; onnxruntime has no Upsample 1, so the oracle is the same model
    written at opset 7 (and np.repeat for nearest)."""
    x = _rand(6, 1, 2, 3, 4).astype(np.float32)
    for mode, new_mode in (("nearest", "nearest"), ("bilinear", "linear")):
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, height_scale=2.0,
                                width_scale=3.0)
        graph = helper.make_graph(
            [node], "u1", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 6, 12])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
        (ours,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
        (theirs,) = ort_run(_legacy_model("Upsample", 7, x, new_mode, [1, 1, 2, 3], True),
                            {"x": x})
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ours.shape, (1, 2, 6, 12))
    nearest = tr_onnx.InferenceSession(_legacy_model("Upsample", 7, x, "nearest", [1, 1, 2, 3],
                                                     True)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(nearest, x.repeat(2, axis=2).repeat(3, axis=3))


def test_resize11_tf_half_pixel_for_nn_matches_onnxruntime():
    x = _rand(7, 1, 2, 5, 6).astype(np.float32)
    node = helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="nearest",
                            coordinate_transformation_mode="tf_half_pixel_for_nn")
    graph = helper.make_graph(
        [node], "r11", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 8, 9])],
        [onnx.numpy_helper.from_array(np.zeros(0, np.float32), "roi"),
         onnx.numpy_helper.from_array(np.asarray([1, 1, 1.7, 1.5], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    (ours,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    np.testing.assert_array_equal(ours, ort_run(model, {"x": x})[0])


def test_nearest_resize_moves_integers_exactly():
    x = np.random.default_rng(3).integers(0, 255, (1, 2, 3, 4)).astype(np.uint8)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")
    graph = helper.make_graph(
        [node], "u8", [helper.make_tensor_value_info("x", onnx.TensorProto.UINT8, x.shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, [1, 2, 7, 6])],
        [onnx.numpy_helper.from_array(np.asarray([1, 1, 2.5, 1.5], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    (ours,) = tr_onnx.InferenceSession(model).run(None, {"x": x})
    np.testing.assert_array_equal(ours, ort_run(model, {"x": x})[0])


# ---- plan-time inputs and named errors -----------------------------------------------------


def _fed_model(which: str):
    """Resize whose scales or sizes is a graph input."""
    kind = onnx.TensorProto.FLOAT if which == "scales" else onnx.TensorProto.INT64
    names = ["x", "", "scales"] if which == "scales" else ["x", "", "", "sizes"]
    node = helper.make_node("Resize", names, ["y"], mode="linear")
    graph = helper.make_graph(
        [node], which, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 4, 5]),
                        helper.make_tensor_value_info(which, kind, [4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None] * 4)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("which, values", [
    ("scales", [np.asarray([1, 1, 2, 1.5], np.float32), np.asarray([1, 1, 0.5, 3], np.float32)]),
    ("sizes", [np.asarray([1, 3, 7, 2], np.int64), np.asarray([1, 3, 3, 9], np.int64)]),
], ids=["scales", "sizes"])
def test_scales_or_sizes_fed_at_run_time_specialise_the_plan(which, values):
    model = _fed_model(which)
    sess = tr_onnx.InferenceSession(model)
    x = _rand(4, 1, 3, 4, 5).astype(np.float32)
    for v in values:
        (ours,) = sess.run(None, {"x": x, which: v})
        (theirs,) = ort_run(model, {"x": x, which: v})
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_nearest_with_antialias_is_an_error_naming_the_node():
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest", antialias=1,
                            name="up")
    graph = helper.make_graph(
        [node], "aa", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 2, 2])],
        [onnx.numpy_helper.from_array(np.asarray([1, 1, 0.5, 0.5], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    with pytest.raises(TrOnnxError, match="'up'.*antialias"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.zeros((1, 1, 4, 4), np.float32)})


# ---- layout ----------------------------------------------------------------------------------


def test_resize_between_convolutions_stays_channels_last():
    """Conv -> Resize -> Conv with padded channels: no LayoutTranspose, and onnxruntime's
    result."""
    rng = np.random.default_rng(5)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((5, 3, 3, 3)).astype(np.float32), "w1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((2, 5, 1, 1)).astype(np.float32), "w2")
    scales = onnx.numpy_helper.from_array(np.asarray([1, 1, 2, 1.5], np.float32), "scales")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["a", "", "scales"], ["b"], mode="cubic"),
             helper.make_node("Conv", ["b", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "crc", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2, 8, 9])],
        [w1, w2, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    feed = {"x": rng.standard_normal((2, 3, 4, 6)).astype(np.float32)}
    sess = tr_onnx.InferenceSession(model, channel_align=8)
    (ours,) = sess.run(None, feed)
    plan = sess.plan_for(feed)
    assert plan.layout.transposes == []
    resize = next(n for n in plan.graph.nodes if n.op_type == "Resize")
    assert resize.inputs[0].layout.is_channels_last and resize.outputs[0].layout.is_channels_last
    np.testing.assert_allclose(ours, ort_run(model, feed)[0], rtol=1e-5, atol=1e-5)


# ---- must-show: a UNet trained with per-pixel cross-entropy ----------------------------------


def _block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """Two downsamplings (max pools), then up by bilinear nn.Upsample (align_corners=False) and
    by a stride-2 ConvTranspose2d, each concatenated with its skip; a nearest nn.Upsample of the
    bottleneck joins the head. Per-pixel class scores [N, classes, H, W]."""

    def __init__(self, cin=3, classes=3):
        super().__init__()
        self.enc1, self.enc2, self.mid = _block(cin, 4), _block(4, 6), _block(6, 8)
        self.pool = nn.MaxPool2d(2)
        self.up_bilinear = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec1 = _block(8 + 6, 6)
        self.up_transposed = nn.ConvTranspose2d(6, 6, 2, stride=2)
        self.dec2 = _block(6 + 4, 4)
        self.up_nearest = nn.Upsample(scale_factor=4, mode="nearest")
        self.head = nn.Conv2d(4 + 8, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        m = self.mid(self.pool(e2))
        d1 = self.dec1(torch.cat([self.up_bilinear(m), e2], 1))
        d2 = self.dec2(torch.cat([self.up_transposed(d1), e1], 1))
        return self.head(torch.cat([d2, self.up_nearest(m)], 1))


def _unet():
    torch.manual_seed(0)
    return UNet()


def _pixels(k):
    rng = np.random.default_rng(k)
    return ({"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)},
            rng.integers(0, 3, (2, 8, 8)).astype(np.int64))


# BatchNorm stays BatchNorm only without constant folding (docs/export.md); PyTorch's
# running variance is the unbiased one.
UNET_EXPORTS = {"classic": (17, {"do_constant_folding": False}),
                "dynamo": (18, {"optimize": False})}


@pytest.fixture(scope="module", params=list(UNET_EXPORTS))
def unet(request, tmp_path_factory):
    opset, export_kwargs = UNET_EXPORTS[request.param]
    case = ParityCase(f"unet-{request.param}", _unet, _pixels, exporter=request.param,
                      opset=opset, dynamic_axes={"x": {0: "batch"}}, export_kwargs=export_kwargs,
                      session_kwargs={"bn_running_var": "unbiased"})
    return run_case(case, tmp_path_factory.mktemp("unet"))


def test_unet_trains_like_pytorch_with_per_pixel_cross_entropy(unet):
    assert_parity(unet)
    ops = {n.op_type for n in onnx.load(str(unet.path)).graph.node}
    assert {"Resize", "ConvTranspose", "Concat", "BatchNormalization"} <= ops


def test_unet_resizes_run_channels_last_with_padded_channels(unet):
    feed, _ = _pixels(9)
    sess = tr_onnx.InferenceSession(unet.path, channel_align=8)
    (ours,) = sess.run(None, feed)
    plan = sess.plan_for(feed)
    resizes = [n for n in plan.graph.nodes if n.op_type == "Resize"]
    assert len(resizes) == 2 and plan.layout.transposes == []
    assert all(n.outputs[0].layout.is_channels_last for n in resizes)
    np.testing.assert_allclose(ours, ort_run(str(unet.path), feed)[0], rtol=1e-5, atol=1e-5)


def _upsample_net(scales=None):
    """Resize by ``scales`` (a graph input when None: fed with each batch), then a 1x1 conv
    and a global mean: a model whose shapes the fed scales decide."""
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 2, 1, 1)).astype(np.float32), "w")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 4, 4])]
    if scales is None:
        inputs.append(helper.make_tensor_value_info("scales", TensorProto.FLOAT, [4]))
    else:
        inits.append(numpy_helper.from_array(np.asarray(scales, np.float32), "scales"))
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["up"], mode="linear"),
             helper.make_node("Conv", ["up", "w"], ["c"]),
             helper.make_node("ReduceMean", ["c"], ["out"], axes=[2, 3], keepdims=0)]
    graph = helper.make_graph(nodes, "up", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                             ["n", 3])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_scales_fed_with_each_batch_train_as_the_same_scales_stored():
    """A fed scales input decides shapes: each value gets its plan (training and eval), and
    each step trains exactly as a model with those scales stored, from the same weights."""
    rng = np.random.default_rng(9)
    fed = tr_onnx.TrainingSession(_upsample_net(), optimizer=tr_onnx.optim.SGD(lr=0.1),
                                  backend="numpy")
    for scales in ([1, 1, 2, 2], [1, 1, 1.5, 1.5], [1, 1, 2, 2]):
        x, y = rng.standard_normal((2, 2, 4, 4)).astype(np.float32), np.array([0, 2])
        stored = tr_onnx.TrainingSession(_upsample_net(scales), backend="numpy",
                                         optimizer=tr_onnx.optim.SGD(lr=0.1))
        stored.load_parameters({"w": fed.parameters()["w"]})
        s = np.asarray(scales, np.float32)
        assert float(fed.train_step({"x": x, "scales": s}, y)) == \
            float(stored.train_step({"x": x}, y))
        np.testing.assert_array_equal(fed.parameters()["w"], stored.parameters()["w"])
        (got,) = fed.run(["out"], {"x": x, "scales": s})
        (want,) = ort_run(fed.export_proto(), {"x": x, "scales": s})
        np.testing.assert_allclose(got, want, atol=1e-6)
