"""The cuda bindings of the spatial-transform family (``backends/cuda/ops/spatial_transform.py``,
``kernels/spatial_transform.cu``), checked without a GPU: single-node models on
``backend="cuda"`` through the host emulator (the kernels' g++ build) against
``backend="numpy"``, launch arguments against the kernels' C parameters, and a small spatial
transformer (Conv -> Gemm -> AffineGrid -> GridSample -> Conv -> Gemm) trained three SGD steps
on both backends.

Tolerances, per op:

* GridSample (every mode, padding mode, align_corners, 2-D and 3-D, v16 and v20 names) and
  GridSampleGrad's gx: bit for bit in float32, float16 and bfloat16 (the taps are ``_GridTaps``'
  fp32 operations in its order, the kernels compile without FMA contraction, and products and
  sums round to the storage type where NumPy stores them).
* GridSampleGrad's ggrid: the channel sum of x[tap] * gy runs in fp32 in channel order where
  NumPy's einsum has its own order, so each term may differ by a few ulp of the sum's
  magnitude: |got - ref| <= 1e-5 * max|ref| in float32 (seen: equal on these sizes); float16
  rounds that sum to the storage type, where one storage ulp of it can move: 4e-3 of max|ref|
  (seen 5e-4). bfloat16 GridSampleGrad has no oracle (the numpy kernel's einsum takes no
  bfloat16).
* AffineGrid: NumPy's matmul is BLAS's sum order over nd + 1 terms: rtol 1e-6 / atol 1e-6
  (float32; seen 2.4e-7 absolute, on elements of order 1).
* RoiAlign avg and RoiAlignGrad: the weight matrices are NumPy's bits; NumPy then runs two
  BLAS matmuls, the kernels sum in fp32 in their own order: rtol 1e-5, atol 1e-6 (seen 2.4e-7
  absolute on values up to 2.7); in float16 / bfloat16 NumPy's half matmuls round once more,
  so within one storage ulp of the largest value (the gradient: two, see its test). RoiAlign
  max: bit for bit, every dtype.
* Col2Im, Col2ImGrad, CenterCropPad(Grad), MaxUnpool: bit for bit (sums in NumPy's tap order,
  or data movement).
* Training: the spatial nodes are exact or within the bounds above; the convolutions' and
  matmuls' backward run as their numpy kernels in the emulator, but the numpy plan folds its
  gradient accumulators and the cuda plan does not, so sums of gradient contributions round
  differently: losses rtol 1e-5, parameters rtol 2e-4 / atol 1e-6 (as the resize family's
  training test states; seen: losses 2e-6 relative, parameters 7.4e-7 absolute).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int64): TensorProto.INT64}
INTERNAL = "ai.tr_onnx"
DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("spatial_kernels")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def node_model(op: str, feeds: dict, outputs: dict, attrs: dict | None = None,
               inits: dict | None = None, opset: int = 22, domain: str = "",
               node_outputs: list[str] | None = None) -> onnx.ModelProto:
    """One ``op`` node over graph inputs ``feeds`` (name -> array) then initializers ``inits``;
    ``outputs``: name -> (shape, dtype) of the graph's outputs; ``node_outputs``: the node's
    (default: those; "" for an absent optional one)."""
    inits = inits or {}
    names = list(feeds) + list(inits)
    node = helper.make_node(op, names, node_outputs or list(outputs), domain=domain,
                            **(attrs or {}))
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(k, ELEM[np.dtype(d)], s) for k, (s, d) in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


def run_both(model, feeds, device, **kw):
    """(numpy's outputs, the emulated cuda backend's outputs, the cuda session's plan)."""
    ref = tr_onnx.InferenceSession(model, backend="numpy", **kw).run(None, feeds)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), **kw)
    got = sess.run(None, feeds)
    (plan,) = sess._plans.values()
    return ref, got, plan


def launches(plan) -> list[Launch]:
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


GATHER = {"tr_grid_sample_taps_f32", "tr_zero_lanes_b4", "tr_gs_count", "tr_gs_scan",
          "tr_gs_bucket", "tr_grid_sample_grad_x_f32"}
"""GridSampleGrad's gx: the tap table, its buckets by map position, the gather."""


def kernels_of(plan) -> set[str]:
    return {c.kernel.name for c in launches(plan)}


def assert_bits_equal(got, ref):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    diff = got.view(bits) != ref.view(bits)
    assert not diff.any(), (f"{diff.sum()} of {diff.size} differ; max abs "
                            f"{np.abs(got.astype(np.float64) - ref.astype(np.float64)).max()}")


def assert_close_to_scale(got, ref, frac: float):
    """|got - ref| <= frac * max|ref| elementwise (a sum's error is relative to its terms)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(got - ref).max() <= frac * scale, (np.abs(got - ref).max(), scale)


# ---- GridSample ---------------------------------------------------------------------------------

MODES20 = ["linear", "nearest", "cubic"]
PADDINGS = ["zeros", "border", "reflection"]


def grid_sample_case(spatial, out_spatial, dtype, seed=0, span=1.3):
    """x [2, 3, *spatial] and a grid [2, *out_spatial, nd] in [-span, span] (outside the map
    to exercise the padding modes), both of ``dtype``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, *spatial)).astype(dtype)
    grid = rng.uniform(-span, span, (2, *out_spatial, len(spatial))).astype(dtype)
    return x, grid


def grid_sample_model(x, grid, mode, padding, align, opset):
    out = (*x.shape[:2], *grid.shape[1:-1])
    return node_model("GridSample", {"x": x, "grid": grid}, {"y": (out, x.dtype)},
                      {"mode": mode, "padding_mode": padding, "align_corners": align},
                      opset=opset)


GRID_CASES = (
    [pytest.param(m, p, a, (5, 6), (4, 7), 20, id=f"2d-{m}-{p}-align{a}")
     for m in MODES20 for p in PADDINGS for a in (0, 1)]
    + [pytest.param(m, p, a, (3, 4, 5), (2, 3, 4), 20, id=f"3d-{m}-{p}-align{a}")
       for m in MODES20 for p in ("zeros", "reflection") for a in (0, 1)]
    + [pytest.param(m, "border", 0, (3, 4, 5), (2, 3, 4), 22, id=f"3d-{m}-border-v22")
       for m in MODES20]
    + [pytest.param(m, p, 0, (5, 6), (4, 7), 16, id=f"v16-{m}-{p}")
       for m in ("bilinear", "bicubic", "nearest") for p in ("zeros", "reflection")]
    + [pytest.param("linear", "reflection", 1, (1, 6), (3, 3), 20, id="one-row-aligned"),
       pytest.param("cubic", "reflection", 0, (2, 2), (5, 5), 20, id="tiny-map-far-bounces")])


@pytest.mark.parametrize(("mode", "padding", "align", "spatial", "out", "opset"), GRID_CASES)
def test_grid_sample_equals_the_numpy_kernel_bit_for_bit(mode, padding, align, spatial, out,
                                                         opset, device, signatures):
    span = 3.5 if spatial == (2, 2) else 1.3
    x, grid = grid_sample_case(spatial, out, np.float32, span=span)
    model = grid_sample_model(x, grid, mode, padding, align, opset)
    (ref,), (got,), plan = run_both(model, {"x": x, "grid": grid}, device)
    assert_bits_equal(got, ref)
    check_launch_arguments(launches(plan), plan, signatures)
    assert kernels_of(plan) == {"tr_grid_sample_f32"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES20)
def test_half_storage_grid_sample_rounds_as_numpy(mode, dtype, device):
    x, grid = grid_sample_case((5, 6), (4, 7), dtype, seed=1)
    model = grid_sample_model(x, grid, mode, "border", 0, 20)
    (ref,), (got,), _ = run_both(model, {"x": x, "grid": grid}, device)
    assert_bits_equal(got, ref)


def grid_sample_grad_model(gy, x, grid, mode, padding, align, outputs=("gx", "ggrid")):
    """GridSampleGrad; ``outputs``: the node's (gx, ggrid), "" for one not asked for."""
    shapes = {"gx": (x.shape, x.dtype), "ggrid": (grid.shape, grid.dtype)}
    return node_model("GridSampleGrad", {"gy": gy, "x": x, "grid": grid},
                      {k: shapes[k] for k in outputs if k},
                      {"mode": mode, "padding_mode": padding, "align_corners": align},
                      domain=INTERNAL, node_outputs=list(outputs))


GRAD_CASES = (
    [pytest.param(m, p, a, (5, 6), (6, 7), id=f"2d-{m}-{p}-align{a}")
     for m in MODES20 for p in PADDINGS for a in (0, 1)]
    + [pytest.param(m, "border", 1, (3, 4, 5), (3, 3, 4), id=f"3d-{m}") for m in MODES20])


@pytest.mark.parametrize(("mode", "padding", "align", "spatial", "out"), GRAD_CASES)
def test_grid_sample_grad_scatters_as_add_at_and_matches_the_grid_gradient(
        mode, padding, align, spatial, out, device, signatures):
    """More grid points than map positions, so many taps land on one position (np.add.at's
    repeated indices)."""
    x, grid = grid_sample_case(spatial, out, np.float32, seed=2)
    gy = np.random.default_rng(3).standard_normal((*x.shape[:2], *out)).astype(np.float32)
    model = grid_sample_grad_model(gy, x, grid, mode, padding, align)
    (gx_ref, gg_ref), (gx, gg), plan = run_both(model, {"gy": gy, "x": x, "grid": grid}, device)
    assert_bits_equal(gx, gx_ref)
    if mode == "nearest":
        np.testing.assert_array_equal(gg, gg_ref)
        assert not gg.any()
    else:
        assert_close_to_scale(gg, gg_ref, 1e-5)
    check_launch_arguments(launches(plan), plan, signatures)
    assert kernels_of(plan) == {*GATHER, "tr_grid_sample_grad_grid_f32"}


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_half_storage_grid_sample_grad_rounds_as_numpy(mode, device):
    """float16 only: the numpy kernel's einsum takes no bfloat16, so there is no oracle."""
    dtype = np.float16
    x, grid = grid_sample_case((5, 6), (6, 7), dtype, seed=4)
    gy = np.random.default_rng(5).standard_normal((2, 3, 6, 7)).astype(dtype)
    model = grid_sample_grad_model(gy, x, grid, mode, "zeros", 0)
    (gx_ref, gg_ref), (gx, gg), _ = run_both(model, {"gy": gy, "x": x, "grid": grid}, device)
    assert_bits_equal(gx, gx_ref)
    assert_close_to_scale(gg, gg_ref, 4e-3)


@pytest.mark.parametrize("output", ["gx", "ggrid"])
def test_grid_sample_grad_with_one_output_launches_only_its_kernels(output, device):
    x, grid = grid_sample_case((4, 5), (3, 3), np.float32, seed=6)
    gy = np.random.default_rng(7).standard_normal((2, 3, 3, 3)).astype(np.float32)
    outputs = ("gx", "") if output == "gx" else ("", "ggrid")
    model = grid_sample_grad_model(gy, x, grid, "linear", "zeros", 0, outputs=outputs)
    (ref,), (got,), plan = run_both(model, {"gy": gy, "x": x, "grid": grid}, device)
    if output == "gx":
        assert_bits_equal(got, ref)
        assert "tr_grid_sample_grad_grid_f32" not in kernels_of(plan)
    else:
        assert_close_to_scale(got, ref, 1e-5)
        assert kernels_of(plan) == {"tr_grid_sample_grad_grid_f32"}


# ---- AffineGrid ---------------------------------------------------------------------------------


@pytest.mark.parametrize("align", [0, 1], ids=["centres", "corners"])
@pytest.mark.parametrize("size", [[2, 3, 5, 7], [2, 1, 3, 4, 5], [2, 3, 1, 6]],
                         ids=["2d", "3d", "one-row"])
def test_affine_grid_equals_the_numpy_kernel(size, align, device, signatures):
    nd = len(size) - 2
    theta = np.random.default_rng(8).standard_normal((size[0], nd, nd + 1)).astype(np.float32)
    model = node_model("AffineGrid", {"theta": theta},
                       {"grid": ((size[0], *size[2:], nd), np.float32)},
                       {"align_corners": align}, inits={"size": np.asarray(size, np.int64)},
                       opset=20)
    (ref,), (got,), plan = run_both(model, {"theta": theta}, device)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    check_launch_arguments(launches(plan), plan, signatures)
    assert kernels_of(plan) == {"tr_affine_grid_f32"}


# ---- RoiAlign -----------------------------------------------------------------------------------

ROIS = np.array([[0.5, 1.0, 6.2, 5.1], [2.0, 0.0, 3.0, 1.5], [-2.0, -1.0, 9.5, 8.0],
                 [4.0, 4.0, 4.0, 4.0], [1.0, 2.0, 7.0, 3.0]], np.float32)
BATCH = np.array([1, 0, 1, 0, 1], np.int64)


def roi_model(x, attrs, opset, grad: bool = False):
    r, (oh, ow) = len(ROIS), (attrs["output_height"], attrs["output_width"])
    if grad:
        return node_model("RoiAlignGrad", {"gy": x, "rois": ROIS, "batch": BATCH},
                          {"gx": ((2, x.shape[1], 7, 8), np.float32)}, attrs, domain=INTERNAL)
    return node_model("RoiAlign", {"x": x, "rois": ROIS, "batch": BATCH},
                      {"y": ((r, x.shape[1], oh, ow), np.float32)}, attrs, opset=opset)


ROI_CASES = [
    pytest.param(m, 2, "half_pixel", 16, id=f"{m}-ratio2-half-pixel") for m in ("avg", "max")
] + [
    pytest.param(m, 0, "output_half_pixel", 22, id=f"{m}-adaptive-output-half-pixel")
    for m in ("avg", "max")
] + [pytest.param("avg", 0, None, 10, id="avg-v10"), pytest.param("max", 1, None, 10,
                                                                   id="max-v10-ratio1")]


@pytest.mark.parametrize(("mode", "ratio", "coord", "opset"), ROI_CASES)
def test_roi_align_equals_the_numpy_kernel(mode, ratio, coord, opset, device, signatures):
    x = np.random.default_rng(9).standard_normal((2, 3, 7, 8)).astype(np.float32)
    attrs = {"mode": mode, "output_height": 3, "output_width": 2, "sampling_ratio": ratio,
             "spatial_scale": 0.8}
    if coord is not None:
        attrs["coordinate_transformation_mode"] = coord
    (ref,), (got,), plan = run_both(roi_model(x, attrs, opset),
                                    {"x": x, "rois": ROIS, "batch": BATCH}, device)
    if mode == "max":
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    check_launch_arguments(launches(plan), plan, signatures)
    assert kernels_of(plan) == ({"tr_roi_align_max_f32"} if mode == "max" else
                                {"tr_roi_align_matrix_f32", "tr_roi_align_avg_f32"})


@pytest.mark.parametrize(("ratio", "coord"), [(2, "half_pixel"), (0, "output_half_pixel")],
                         ids=["ratio2-half-pixel", "adaptive"])
def test_roi_align_grad_equals_the_numpy_kernel(ratio, coord, device, signatures):
    attrs = {"mode": "avg", "output_height": 3, "output_width": 2, "sampling_ratio": ratio,
             "spatial_scale": 0.8, "coordinate_transformation_mode": coord}
    gy = np.random.default_rng(10).standard_normal((len(ROIS), 3, 3, 2)).astype(np.float32)
    (ref,), (got,), plan = run_both(roi_model(gy, attrs, 22, grad=True),
                                    {"gy": gy, "rois": ROIS, "batch": BATCH}, device)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    check_launch_arguments(launches(plan), plan, signatures)


@pytest.mark.parametrize(("dtype", "eps"), [pytest.param(np.float16, 2.0 ** -10, id="f16"),
                                            pytest.param(BFLOAT16, 2.0 ** -7, id="bf16")])
@pytest.mark.parametrize("mode", ["avg", "max", "grad"])
def test_half_storage_roi_align_is_within_one_storage_step(mode, dtype, eps, device):
    """The matrices round to the storage type as NumPy's do; NumPy's half matmuls round
    their sums once more than the kernels' fp32 sums: avg within one storage ulp of the
    largest value. The gradient rounds four times per box in NumPy (two matmuls, the
    division, the add into gx: half an ulp each), so within two (seen: f16 2 ulp at
    1.92, bf16 below 1). Max is exact."""
    rng = np.random.default_rng(16)
    rois = ROIS.astype(dtype)
    attrs = {"mode": "avg" if mode == "grad" else mode, "output_height": 3, "output_width": 2,
             "sampling_ratio": 0, "spatial_scale": 0.8}
    if mode == "grad":
        gy = rng.standard_normal((len(ROIS), 3, 3, 2)).astype(dtype)
        model = node_model("RoiAlignGrad", {"gy": gy, "rois": rois, "batch": BATCH},
                           {"gx": ((2, 3, 7, 8), dtype)},
                           {**attrs, "coordinate_transformation_mode": "half_pixel"},
                           domain=INTERNAL)
        feeds = {"gy": gy, "rois": rois, "batch": BATCH}
    else:
        x = rng.standard_normal((2, 3, 7, 8)).astype(dtype)
        model = node_model("RoiAlign", {"x": x, "rois": rois, "batch": BATCH},
                           {"y": ((len(ROIS), 3, 3, 2), dtype)}, attrs)
        feeds = {"x": x, "rois": rois, "batch": BATCH}
    (ref,), (got,), _ = run_both(model, feeds, device)
    if mode == "max":
        assert_bits_equal(got, ref)
    else:
        assert_close_to_scale(got, ref, 2 * eps if mode == "grad" else eps)


# ---- Col2Im -------------------------------------------------------------------------------------

COL2IM_CASES = [
    pytest.param([5, 6], [2, 3], {}, id="2d-plain"),
    pytest.param([7, 8], [3, 2], {"strides": [2, 3], "dilations": [1, 2],
                                  "pads": [1, 0, 2, 1]}, id="2d-strided-dilated-padded"),
    pytest.param([9], [3], {"strides": [2], "pads": [1, 1]}, id="1d"),
    pytest.param([4, 5, 3], [2, 2, 2], {"strides": [1, 2, 1], "pads": [0, 1, 1, 1, 0, 0]},
                 id="3d"),
]


def col2im_geometry(image, block, attrs):
    nd = len(image)
    st, dil = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * (2 * nd))
    return [(i + pads[a] + pads[nd + a] - ((k - 1) * dil[a] + 1)) // st[a] + 1
            for a, (i, k) in enumerate(zip(image, block))]


@pytest.mark.parametrize("dtype", [pytest.param(np.float32, id="f32"), *DTYPES])
@pytest.mark.parametrize(("image", "block", "attrs"), COL2IM_CASES)
def test_col2im_and_its_gradient_equal_numpy_bit_for_bit(image, block, attrs, dtype, device,
                                                         signatures):
    c, kk = 2, int(np.prod(block))
    ll = int(np.prod(col2im_geometry(image, block, attrs)))
    rng = np.random.default_rng(11)
    cols = rng.standard_normal((2, c * kk, ll)).astype(dtype)
    consts = {"image": np.asarray(image, np.int64), "block": np.asarray(block, np.int64)}
    model = node_model("Col2Im", {"cols": cols}, {"y": ((2, c, *image), dtype)}, attrs,
                       inits=consts, opset=18)
    (ref,), (got,), plan = run_both(model, {"cols": cols}, device)
    assert_bits_equal(got, ref)
    check_launch_arguments(launches(plan), plan, signatures)
    gy = rng.standard_normal((2, c, *image)).astype(dtype)
    grad = node_model("Col2ImGrad", {"gy": gy}, {"gcols": (cols.shape, dtype)}, attrs,
                      inits=consts, opset=18, domain=INTERNAL)
    (ref,), (got,), plan = run_both(grad, {"gy": gy}, device)
    assert_bits_equal(got, ref)
    check_launch_arguments(launches(plan), plan, signatures)


# ---- CenterCropPad ------------------------------------------------------------------------------


def crop_model(shape, target, axes, conv: bool, dtype=np.float32, grad: bool = False):
    """x -> [Conv 1x1 (5 channels: channels-last, padded to 8) ->] CenterCropPad(target)."""
    rng = np.random.default_rng(12)
    inits, nodes, data = [], [], "x"
    if conv:
        w = rng.standard_normal((5, shape[1], 1, 1)).astype(dtype)
        inits.append(numpy_helper.from_array(w, "w"))
        nodes.append(helper.make_node("Conv", ["x", "w"], ["h"]))
        data = "h"
    inner = (shape[0], 5, *shape[2:]) if conv else tuple(shape)
    out = list(inner)
    for a, t in zip(axes if axes is not None else range(len(inner)), target):
        out[a] = t
    inits.append(numpy_helper.from_array(np.asarray(target, np.int64), "target"))
    kw = {"axes": axes} if axes is not None else {}
    if grad:
        nodes.append(helper.make_node("CenterCropPadGrad", [data], ["y"], domain=INTERNAL))
    else:
        nodes.append(helper.make_node("CenterCropPad", [data, "target"], ["y"], **kw))
    graph = helper.make_graph(nodes, "crop",
                              [helper.make_tensor_value_info("x", ELEM[np.dtype(dtype)], shape)],
                              [helper.make_tensor_value_info("y", ELEM[np.dtype(dtype)], out)],
                              inits)
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(INTERNAL, 1)] if grad else [])
    return helper.make_model(graph, opset_imports=opsets)


CROP_CASES = [pytest.param([4, 5], [2, 3], id="crop-hw"),
              pytest.param([9, 3], [2, 3], id="pad-h-crop-w"),
              pytest.param([8, 10], [2, 3], id="pad-both")]


@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize(("target", "axes"), CROP_CASES)
def test_center_crop_pad_copies_the_centred_window(target, axes, conv, device, signatures):
    shape = (2, 3, 6, 7)
    x = np.random.default_rng(13).standard_normal(shape).astype(np.float32)
    (ref,), (got,), plan = run_both(crop_model(shape, target, axes, conv), {"x": x}, device,
                                    channel_align=8)
    assert_bits_equal(got, ref)
    check_launch_arguments(launches(plan), plan, signatures)
    if conv:
        (node,) = [n for n in plan.graph.nodes if n.op_type == "CenterCropPad"]
        assert plan.memory.tensors[node.inputs[0].name].layout.kind == "channels_last"


@pytest.mark.parametrize("dtype", [pytest.param(np.float32, id="f32"), *DTYPES])
@pytest.mark.parametrize("shape", [(2, 3, 4, 9), (3, 2, 8, 3)], ids=["pad-w", "crop-n-h"])
def test_center_crop_pad_grad_crops_or_pads_to_its_output(shape, dtype, device):
    x = np.random.default_rng(14).standard_normal(shape).astype(dtype)
    out = [2, 3, 6, 7]
    nodes = [helper.make_node("CenterCropPadGrad", ["x"], ["y"], domain=INTERNAL)]
    graph = helper.make_graph(nodes, "crop_grad",
                              [helper.make_tensor_value_info("x", ELEM[np.dtype(dtype)], shape)],
                              [helper.make_tensor_value_info("y", ELEM[np.dtype(dtype)], out)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(INTERNAL, 1)])
    (ref,), (got,), _ = run_both(model, {"x": x}, device)
    assert_bits_equal(got, ref)


# ---- MaxUnpool ----------------------------------------------------------------------------------


def pool_indices(x, kernel, strides):
    """Flat indices of each window's maximum (MaxPool's Indices) over x [N, C, H, W]."""
    n, c, h, w = x.shape
    oh, ow = (h - kernel) // strides + 1, (w - kernel) // strides + 1
    idx = np.empty((n, c, oh, ow), np.int64)
    for i in range(oh):
        for j in range(ow):
            win = x[:, :, i * strides:i * strides + kernel, j * strides:j * strides + kernel]
            k = win.reshape(n, c, -1).argmax(-1)
            hh, ww = i * strides + k // kernel, j * strides + k % kernel
            idx[:, :, i, j] = ((np.arange(n)[:, None] * c + np.arange(c)) * h + hh) * w + ww
    return idx


@pytest.mark.parametrize("dtype", [pytest.param(np.float32, id="f32"), *DTYPES])
@pytest.mark.parametrize(("kernel", "strides", "output_shape"), [
    pytest.param(2, 2, None, id="2x2-stride2"),
    pytest.param(3, 1, None, id="overlapping-repeated-indices"),
    pytest.param(2, 2, [2, 3, 9, 8], id="output-shape-corner")])
def test_max_unpool_puts_values_as_np_put(kernel, strides, output_shape, dtype, device,
                                          signatures):
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    idx = pool_indices(x, kernel, strides)
    vals = rng.standard_normal(idx.shape).astype(dtype)  # distinct from the maxima: the last
    out = output_shape or [2, 3, (idx.shape[2] - 1) * strides + kernel,  # write must win
                           (idx.shape[3] - 1) * strides + kernel]
    inits = {"shape": np.asarray(output_shape, np.int64)} if output_shape else {}
    model = node_model("MaxUnpool", {"x": vals, "idx": idx}, {"y": (out, dtype)},
                       {"kernel_shape": [kernel, kernel], "strides": [strides, strides]},
                       inits=inits)
    if strides == 1:
        assert len(np.unique(idx)) < idx.size
    (ref,), (got,), plan = run_both(model, {"x": vals, "idx": idx}, device)
    assert_bits_equal(got, ref)
    check_launch_arguments(launches(plan), plan, signatures)
    assert "tr_max_unpool_winner" in kernels_of(plan)


# ---- training: a spatial transformer ------------------------------------------------------------


def spatial_transformer(mode: str, padding: str, align: int, source: str = "ar"
                        ) -> onnx.ModelProto:
    """input [2, 3, 8, 8] -> Conv(4) -> Relu ("ar") -> (localisation: Flatten -> Gemm(6, bias
    the identity transform) -> Reshape [2, 2, 3] -> AffineGrid [2, 6, 6, 2]) -> GridSample of
    ``source`` ("ar", or the image "input", whose gradient nothing needs) -> Conv(5) -> Flatten
    -> Gemm -> scores [2, 10]."""
    rng = np.random.default_rng(0)
    c = 4 if source == "ar" else 3

    def w(name, shape, scale=0.2):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    inits = [w("w1", (4, 3, 3, 3)), w("wl", (6, 4 * 8 * 8), 0.02),
             numpy_helper.from_array(np.array([0.9, 0.1, 0.05, -0.1, 0.8, 0.0], np.float32),
                                     "bl"),
             w("w2", (5, c, 3, 3)), w("w3", (10, 5 * 6 * 6), 0.05),
             numpy_helper.from_array(np.array([2, 2, 3], np.int64), "theta_shape"),
             numpy_helper.from_array(np.array([2, c, 6, 6], np.int64), "size")]
    nodes = [helper.make_node("Conv", ["input", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Flatten", ["ar"], ["af"]),
             helper.make_node("Gemm", ["af", "wl", "bl"], ["t6"], transB=1),
             helper.make_node("Reshape", ["t6", "theta_shape"], ["theta"]),
             helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align),
             helper.make_node("GridSample", [source, "grid"], ["s"], mode=mode,
                              padding_mode=padding, align_corners=align),
             helper.make_node("Conv", ["s", "w2"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["b"], ["f"]),
             helper.make_node("Gemm", ["f", "w3"], ["scores"], transB=1)]
    graph = helper.make_graph(
        nodes, "stn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.filterwarnings("ignore::tr_onnx.errors.ExportAdviceWarning")
@pytest.mark.parametrize(("mode", "padding", "align", "source"), [
    ("linear", "zeros", 0, "ar"), ("cubic", "reflection", 1, "ar"),
    ("linear", "border", 1, "ar"), ("linear", "zeros", 1, "input")])
def test_a_spatial_transformer_trains_on_cuda_as_on_numpy(mode, padding, align, source, device,
                                                          signatures):
    """Sampling the image itself (source "input"), GridSampleGrad's gx has no reader, so its
    gather is not launched."""
    kw = dict(optimizer=SGD(lr=0.01), channel_align=8)
    model = spatial_transformer(mode, padding, align, source)
    cuda = tr_onnx.TrainingSession(model, backend=CudaBackend(device=device), **kw)
    ref = tr_onnx.TrainingSession(model, backend="numpy", **kw)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 2)
        np.testing.assert_allclose(cuda.train_step({"input": x}, y),
                                   ref.train_step({"input": x}, y), rtol=1e-5)
    a, b = cuda.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=1e-6, err_msg=name)
    initial = numpy_helper.to_array(model.graph.initializer[1])
    assert not np.array_equal(b["wl"], initial)  # the gradient reached the localisation net
    plan = cuda._state.active
    check_launch_arguments(launches(plan), plan, signatures)
    gather = GATHER
    assert {"tr_grid_sample_f32", "tr_affine_grid_f32", "tr_grid_sample_grad_grid_f32"} <= \
        kernels_of(plan)
    assert (gather <= kernels_of(plan)) == (source == "ar")


def roi_head(kind: str) -> onnx.ModelProto:
    """input [2, 3, 8, 8] -> Conv(4, channels-last) -> a spatial op -> Conv(5) -> Flatten ->
    Gemm -> scores [2, 10]. ``kind``: "roi" (CenterCropPad to 6x6, then an average RoiAlign of
    two boxes per image, 4x4 bins: RoiAlignGrad and CenterCropPadGrad in the backward) or
    "unpool" (MaxPool 2x2, then MaxUnpool at the graph input "idx": its gradient gathers)."""
    rng = np.random.default_rng(0)

    def w(name, shape, scale=0.2):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    rois = np.array([[0.5, 0.0, 5.0, 4.5], [1.0, 2.0, 5.5, 5.5], [0.0, 0.0, 6.0, 6.0],
                     [2.5, 1.5, 4.0, 5.0]], np.float32)
    nodes = [helper.make_node("Conv", ["input", "w1"], ["a"], pads=[1, 1, 1, 1])]
    inits = [w("w1", (4, 3, 3, 3)), w("w2", (5, 4, 3, 3))]
    if kind == "roi":
        side, batch = 4, 4
        inits += [numpy_helper.from_array(np.array([6, 6], np.int64), "crop"),
                  numpy_helper.from_array(np.array([0, 0, 1, 1], np.int64), "batch")]
        nodes += [helper.make_node("CenterCropPad", ["a", "crop"], ["c"], axes=[2, 3]),
                  helper.make_node("Constant", [], ["rois"],
                                   value=numpy_helper.from_array(rois)),
                  helper.make_node("RoiAlign", ["c", "rois", "batch"], ["s"], mode="avg",
                                   output_height=side, output_width=side, sampling_ratio=2,
                                   coordinate_transformation_mode="half_pixel")]
    else:
        side, batch = 8, 2
        nodes += [helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                  helper.make_node("MaxUnpool", ["p", "idx"], ["s"], kernel_shape=[2, 2],
                                   strides=[2, 2])]
    inits.append(w("w3", (10, 5 * side * side * batch // 2), 0.05))
    nodes += [helper.make_node("Conv", ["s", "w2"], ["b"], pads=[1, 1, 1, 1]),
              helper.make_node("Reshape", ["b", "flat"], ["f"]),
              helper.make_node("Gemm", ["f", "w3"], ["scores"], transB=1)]
    inits.append(numpy_helper.from_array(np.array([2, -1], np.int64), "flat"))
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 3, 8, 8])]
    if kind == "unpool":
        inputs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 4, 4, 4]))
    graph = helper.make_graph(nodes, kind, inputs,
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT,
                                                             [2, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.filterwarnings("ignore::tr_onnx.errors.ExportAdviceWarning")
@pytest.mark.parametrize(("kind", "ops", "kernels"), [
    ("roi", {"RoiAlignGrad", "CenterCropPadGrad"},
     {"tr_roi_align_matrix_f32", "tr_roi_align_avg_f32", "tr_roi_align_grad_f32"}),
    ("unpool", {"MaxUnpool", "Gather"}, {"tr_max_unpool_winner", "tr_max_unpool_b4"})])
def test_roi_align_and_max_unpool_heads_train_on_cuda_as_on_numpy(kind, ops, kernels, device,
                                                                  signatures):
    kw = dict(optimizer=SGD(lr=0.01), channel_align=8)
    cuda = tr_onnx.TrainingSession(roi_head(kind), backend=CudaBackend(device=device), **kw)
    ref = tr_onnx.TrainingSession(roi_head(kind), backend="numpy", **kw)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
        feeds = {"input": x}
        if kind == "unpool":
            feeds["idx"] = pool_indices(rng.standard_normal((2, 4, 8, 8)), 2, 2)
        y = rng.integers(0, 10, 2)
        np.testing.assert_allclose(cuda.train_step(feeds, y), ref.train_step(feeds, y),
                                   rtol=1e-5)
    a, b = cuda.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=1e-6, err_msg=name)
    plan = cuda._state.active
    check_launch_arguments(launches(plan), plan, signatures)
    assert ops <= {n.op_type for n in plan.graph.nodes}
    assert kernels <= kernels_of(plan)
