"""Spatial transforms (tr_onnx.ops.spatial_transform) against oracles nobody here wrote:
PyTorch autograd for F.grid_sample and F.affine_grid (float64 forward and gradients, every
mode x padding x corner convention), onnxruntime for the float32 forward of every op and
schema version, and the issue's must-show: a spatial transformer exported by PyTorch trains
here as it trains in PyTorch (tests/torch_parity.py)."""

import itertools

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import assert_close_relative, ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.training.gradients import vjp

TORCH_ATOL = 1e-10  # float64; measured max |diff| ~1e-14 (the issue asks 1e-5)


def single_node(op, inputs, attrs=None, opset=20, inits=None, out_shape=None):
    """A one-node model: ``inputs`` become graph inputs, ``inits`` initializers; the output's
    type comes from shape inference, or ``out_shape`` where ONNX cannot infer it."""
    inits = inits or {}
    names = list(inputs) + list(inits)
    node = helper.make_node(op, names, ["y"], **(attrs or {}))
    first = np.asarray(next(iter(inputs.values())))
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(k, onnx_elem_type(v.dtype), v.shape)
                     for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", onnx_elem_type(first.dtype), out_shape)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model) if out_shape is None else model


# ---- PyTorch autograd, float64 ------------------------------------------------------------

_TORCH_MODES = {"linear": "bilinear", "nearest": "nearest", "cubic": "bicubic"}
_GRID_CASES = [(m, p, a, 2) for m, p, a in itertools.product(
    _TORCH_MODES, ("zeros", "border", "reflection"), (0, 1))] + [
    (m, p, a, 3) for m, p, a in itertools.product(("linear", "nearest"),
                                                   ("zeros", "border", "reflection"), (0, 1))]


@pytest.mark.parametrize("mode,padding,align,nd", _GRID_CASES,
                         ids=[f"{m}-{p}-ac{a}-{n}d" for m, p, a, n in _GRID_CASES])
def test_grid_sample_and_its_gradients_equal_pytorch(mode, padding, align, nd):
    """Grid values reach 1.5 (past the map), so every padding mode is exercised."""
    rng = np.random.default_rng(len(mode) * 7 + nd + align)
    spatial, out = ((4, 5), (3, 4)) if nd == 2 else ((3, 4, 3), (2, 3, 2))
    x = rng.standard_normal((2, 3, *spatial))
    grid = rng.uniform(-1.5, 1.5, (2, *out, nd))
    cot = rng.standard_normal((2, 3, *out))
    model = single_node("GridSample", {"x": x, "grid": grid},
                        {"mode": mode, "padding_mode": padding, "align_corners": align})
    y, grads = vjp(model, {"x": x, "grid": grid}, ["x", "grid"], cot)
    xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(grid, requires_grad=True)
    yt = F.grid_sample(xt, gt, mode=_TORCH_MODES[mode], padding_mode=padding,
                       align_corners=bool(align))
    (yt * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=TORCH_ATOL)
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=0, atol=TORCH_ATOL)
    np.testing.assert_allclose(grads["grid"], gt.grad.numpy(), rtol=0, atol=TORCH_ATOL)


@pytest.mark.parametrize("nd,align", [(2, 0), (2, 1), (3, 0), (3, 1)],
                         ids=["2d-ac0", "2d-ac1", "3d-ac0", "3d-ac1"])
def test_affine_grid_and_its_gradient_equal_pytorch(nd, align):
    rng = np.random.default_rng(nd * 2 + align)
    size = (2, 3, 4, 5) if nd == 2 else (2, 1, 3, 4, 2)
    theta = rng.standard_normal((2, nd, nd + 1))
    cot = rng.standard_normal((size[0], *size[2:], nd))
    model = single_node("AffineGrid", {"theta": theta}, {"align_corners": align},
                        inits={"size": np.array(size, np.int64)})
    y, grads = vjp(model, {"theta": theta}, ["theta"], cot)
    tt = torch.tensor(theta, requires_grad=True)
    yt = F.affine_grid(tt, list(size), align_corners=bool(align))
    (yt * torch.from_numpy(cot)).sum().backward()
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=0, atol=TORCH_ATOL)
    np.testing.assert_allclose(grads["theta"], tt.grad.numpy(), rtol=0, atol=TORCH_ATOL)


def test_grid_sample_between_convs_is_the_same_with_padded_channels_last_maps():
    """Conv -> GridSample -> Conv: with channel_align 8 the convs' maps are channels-last with
    padded channels, and the layout pass hands GridSample (and its backward op) compact NCHW
    arrays; every gradient equals the plain align-1 run."""
    rng = np.random.default_rng(5)
    arrays = {"x": rng.standard_normal((2, 3, 6, 5)), "w1": rng.standard_normal((5, 3, 3, 3)),
              "grid": rng.uniform(-1.2, 1.2, (2, 4, 3, 2)),
              "w2": rng.standard_normal((4, 5, 2, 2))}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("GridSample", ["a", "grid"], ["s"], mode="cubic",
                              padding_mode="reflection"),
             helper.make_node("Conv", ["s", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "conv_gs_conv", [
        helper.make_tensor_value_info(k, onnx.TensorProto.DOUBLE, v.shape)
        for k, v in arrays.items()],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    cot = rng.standard_normal((2, 4, 3, 2))
    y1, g1 = vjp(model, arrays, list(arrays), cot, channel_align=1)
    y8, g8 = vjp(model, arrays, list(arrays), cot, channel_align=8)
    np.testing.assert_allclose(y8, y1, rtol=0, atol=1e-12)
    for name in arrays:
        np.testing.assert_allclose(g8[name], g1[name], rtol=0, atol=1e-12, err_msg=name)


# ---- onnxruntime, float32 forward -----------------------------------------------------------

_RNG = np.random.default_rng(2026)


def _f(*shape):
    return _RNG.standard_normal(shape).astype(np.float32)


def _i(*values):
    return np.array(values, np.int64)


_BOXES = np.array([[0.5, 0.5, 6.2, 4.9], [-2.0, 1.0, 3.0, 9.5], [2.2, 3.1, 2.4, 3.3],
                   [1.0, 0.0, 7.9, 7.9]], np.float32)
_BATCH = _i(1, 0, 1, 0)
_UNPOOL_IDX = _i(5, 7, 13, 15, 16, 19, 25, 30).reshape(1, 2, 2, 2)  # 4x4 planes, 2 channels

# id -> (op, graph inputs, initializers, attrs, opset, out_shape)
ORT_CASES = {
    "gridsample_v16_bicubic_border": (
        "GridSample", {"x": _f(2, 3, 5, 4), "g": _RNG.uniform(-1.5, 1.5, (2, 3, 6, 2))
                       .astype(np.float32)}, {},
        {"mode": "bicubic", "padding_mode": "border"}, 16, None),
    "gridsample_v16_bilinear_reflection_ac1": (
        "GridSample", {"x": _f(1, 2, 4, 4), "g": _RNG.uniform(-1.5, 1.5, (1, 5, 3, 2))
                       .astype(np.float32)}, {},
        {"mode": "bilinear", "padding_mode": "reflection", "align_corners": 1}, 16, None),
    "gridsample_v22_volumetric_border": (
        "GridSample", {"x": _f(1, 2, 3, 4, 5), "g": _RNG.uniform(-1.3, 1.3, (1, 2, 3, 2, 3))
                       .astype(np.float32)}, {}, {"padding_mode": "border"}, 22, None),
    "affine_grid_2d_ac0": ("AffineGrid", {"t": _f(2, 2, 3)}, {"s": _i(2, 1, 5, 6)}, {}, 20,
                           None),
    "affine_grid_3d_ac1": ("AffineGrid", {"t": _f(2, 3, 4)}, {"s": _i(2, 1, 2, 3, 4)},
                           {"align_corners": 1}, 20, None),
    "roialign_v10_default": ("RoiAlign", {"x": _f(2, 3, 8, 8), "r": _BOXES}, {"b": _BATCH},
                             {"output_height": 3, "output_width": 2}, 10, None),
    "roialign_v16_half_pixel_adaptive": (
        "RoiAlign", {"x": _f(2, 3, 8, 8), "r": _BOXES}, {"b": _BATCH},
        {"output_height": 2, "output_width": 3, "sampling_ratio": 0}, 16, None),
    "roialign_v16_output_half_pixel_max": (
        "RoiAlign", {"x": _f(2, 3, 8, 8), "r": _BOXES}, {"b": _BATCH},
        {"coordinate_transformation_mode": "output_half_pixel", "mode": "max",
         "sampling_ratio": 2, "output_height": 2, "output_width": 2}, 16, None),
    # onnxruntime has no RoiAlign-22 (it only widens the types); the node suite's cases are v22
    "roialign_v16_scale_half": (
        "RoiAlign", {"x": _f(2, 3, 5, 6), "r": _BOXES * 2}, {"b": _BATCH},
        {"spatial_scale": 0.5, "output_height": 3, "output_width": 3}, 16, None),
    "maxunpool_v9": ("MaxUnpool", {"x": _f(1, 2, 2, 2)}, {"i": _UNPOOL_IDX},
                     {"kernel_shape": [2, 2], "strides": [2, 2]}, 9, None),
    "maxunpool_v11_3d": ("MaxUnpool", {"x": _f(1, 2, 1, 2, 2)}, {"i": _UNPOOL_IDX.reshape(
        1, 2, 1, 2, 2) * 2}, {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, 11, None),
    "col2im_strides_pads_dilations": (
        "Col2Im", {"x": _f(2, 3 * 6, 9)}, {"s": _i(5, 6), "k": _i(2, 3)},
        {"strides": [2, 2], "pads": [1, 0, 1, 1], "dilations": [2, 1]}, 18, None),
    "col2im_3d": ("Col2Im", {"x": _f(1, 2 * 8, 8)}, {"s": _i(3, 3, 3), "k": _i(2, 2, 2)}, {},
                  18, None),
    "center_crop_pad_mixed_negative_axes": (
        "CenterCropPad", {"x": _f(2, 5, 4, 3)}, {"s": _i(8, 2)}, {"axes": [-3, 2]}, 18, None),
    "center_crop_pad_all_axes": ("CenterCropPad", {"x": _f(3, 6, 5)}, {"s": _i(4, 3, 8)}, {},
                                 18, None),
}


@pytest.mark.parametrize("case", list(ORT_CASES))
def test_forward_equals_onnxruntime(case):
    op, inputs, inits, attrs, opset, out_shape = ORT_CASES[case]
    model = single_node(op, inputs, attrs, opset, inits, out_shape)
    (ours,) = tr_onnx.InferenceSession(model).run(["y"], inputs)
    (theirs,) = ort_run(model, inputs)
    assert_close_relative(ours, theirs, rel=1e-5)


def test_max_unpool_with_output_shape_puts_the_unpooled_map_in_the_corner():
    """The indices address the window-given [4, 4] plane, which sits in the leading corner of
    the [5, 5] output (ONNX's own example, onnx.reference, the node suite's
    test_maxunpool_export_with_output_shape). onnxruntime 1.32 indexes the [5, 5] plane
    instead (PyTorch's max_unpool2d convention) and fails that suite case, so the oracle here
    is onnx.reference."""
    x, idx, shape = _f(1, 2, 2, 2), _UNPOOL_IDX, _i(1, 2, 5, 5)
    model = single_node("MaxUnpool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2]}, 11,
                        {"i": idx, "s": shape}, [1, 2, 5, 5])
    (ours,) = tr_onnx.InferenceSession(model).run(["y"], {"x": x})
    (ref,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(ours, ref)
    assert np.count_nonzero(ours[:, :, 4, :]) == np.count_nonzero(ours[:, :, :, 4]) == 0


def test_max_mode_roi_align_has_no_gradient_and_says_so():
    x = _f(1, 2, 6, 6).astype(np.float64)
    model = single_node("RoiAlign", {"x": x}, {"mode": "max", "output_height": 2,
                                               "output_width": 2}, 16,
                        {"r": _BOXES[:2].astype(np.float64), "b": _i(0, 0)})
    with pytest.raises(UnsupportedModelError, match="RoiAlign.*mode 'max'"):
        vjp(model, {"x": x}, ["x"], np.ones((2, 2, 2, 2)))


# ---- must-show: a spatial transformer network -----------------------------------------------


class SpatialTransformer(torch.nn.Module):
    """Localization conv net -> theta [N, 2, 3] -> affine_grid -> grid_sample -> classifier."""

    def __init__(self):
        super().__init__()
        self.loc = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 6))
        self.cls = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(4 * 8 * 8, 5))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.cls(F.grid_sample(x, grid, align_corners=False))


def _build_stn():
    torch.manual_seed(0)
    m = SpatialTransformer()
    with torch.no_grad():  # near identity, as STN code starts (small weights, identity bias)
        m.loc[-1].weight.mul_(0.1)
        m.loc[-1].bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
    return m


def _stn_batch(k):
    rng = np.random.default_rng(100 + k)
    return ({"x": rng.standard_normal((4, 1, 10, 10)).astype(np.float32)},
            rng.integers(0, 5, 4).astype(np.int64))


@pytest.mark.parametrize("exporter,emits", [
    ("classic", {"AffineGrid", "GridSample"}),
    # dynamo decomposes affine_grid (Transpose, Unsqueeze, Mul, ReduceSum, Reshape) and emits
    # GridSample
    ("dynamo", {"GridSample"}),
])
def test_spatial_transformer_trains_as_in_pytorch(exporter, emits, tmp_path):
    # The default trainable set is PyTorch's parameters: the dynamo export stores
    # affine_grid's base grid as a [H*W, 3, 1] initializer multiplied into theta, folded from
    # constants (its folded_from metadata), so it stays frozen.
    params = {name for name, _ in _build_stn().named_parameters()}
    case = ParityCase(f"stn-{exporter}", _build_stn, _stn_batch, exporter=exporter, opset=20,
                      dynamic_axes={"x": {0: "batch"}})
    result = run_case(case, tmp_path)
    ops = {n.op_type for n in onnx.load(str(result.path)).graph.node}
    assert emits <= ops, sorted(ops)
    assert {n for n, r in result.session.parameter_roles.items() if r.trainable} == params
    assert_parity(result)
