"""Gradient cases for the spatial transforms (tr_onnx.ops.spatial_transform): float64 finite
differences, see tests/gradcheck.py.

GridSample and AffineGrid use ``fd_oracle="ours"``: onnx.reference denormalizes GridSample's
coordinates in float32 and casts AffineGrid's output to float32, so its float64 differences
at step 1e-6 are noise. Our forward of both equals onnxruntime and PyTorch
(tests/test_spatial_transform.py) and the node suite. Grid values are drawn away from the
kinks (tap switches at integer coordinates) only by chance: a 1e-6 step crosses one with
probability ~1e-5 per value.
"""

import numpy as np
from gradcheck import Const, GradCase

RNG = np.random.default_rng(13)


def r(*shape):
    return RNG.standard_normal(shape)


def grid(*shape, reach=1.2):
    """Normalized coordinates in [-reach, reach]: some fall outside the map (padding)."""
    return RNG.uniform(-reach, reach, shape)


def i64(*values):
    return Const(np.array(values, np.int64))


def _gs(id_, mode, padding, align, x_shape=(2, 3, 4, 5), grid_shape=(2, 3, 4, 2), opset=20,
        reach=1.2):
    return GradCase(id_, "GridSample", [r(*x_shape), grid(*grid_shape, reach=reach)],
                    {"mode": mode, "padding_mode": padding, "align_corners": align},
                    opset=opset, fd_oracle="ours")


def _unpool_indices(n, c, h, w, k):
    """MaxPool-like indices: one position per kxk window of an [n, c, h*k, w*k] map."""
    oh, ow = h * k, w * k
    rows = np.arange(h)[:, None] * k + RNG.integers(0, k, (n, c, h, w))
    cols = np.arange(w)[None, :] * k + RNG.integers(0, k, (n, c, h, w))
    plane = (np.arange(n)[:, None, None, None] * c + np.arange(c)[None, :, None, None])
    return Const((plane * oh * ow + rows * ow + cols).astype(np.int64))


_BOXES = np.array([[0.5, 0.5, 5.2, 4.9], [-2.0, 1.0, 3.0, 7.5], [2.2, 3.1, 2.4, 3.3]])

CASES = [
    # ---- GridSample (v20 names), every padding, both corner conventions ----
    *[_gs(f"gridsample_linear_{p}_ac{a}", "linear", p, a)
      for p in ("zeros", "border", "reflection") for a in (0, 1)],
    *[_gs(f"gridsample_cubic_{p}_ac{a}", "cubic", p, a)
      for p, a in (("zeros", 0), ("border", 1), ("reflection", 0), ("reflection", 1))],
    _gs("gridsample_nearest_zeros", "nearest", "zeros", 0),
    _gs("gridsample_nearest_reflection_ac1", "nearest", "reflection", 1),
    _gs("gridsample_linear_3d", "linear", "zeros", 0, (1, 2, 3, 4, 3), (1, 2, 3, 2, 3)),
    _gs("gridsample_cubic_3d_border", "cubic", "border", 1, (1, 2, 3, 3, 4), (1, 2, 2, 2, 3)),
    _gs("gridsample_v16_bilinear", "bilinear", "border", 0, opset=16),
    _gs("gridsample_v16_bicubic", "bicubic", "zeros", 1, opset=16),
    GradCase("gridsample_wrt_grid_only", "GridSample", [Const(r(1, 2, 5, 5)), grid(1, 3, 3, 2)],
             {"mode": "linear"}, opset=20, fd_oracle="ours"),
    # ---- AffineGrid ----
    GradCase("affine_grid_2d", "AffineGrid", [r(2, 2, 3), i64(2, 3, 4, 5)], opset=20,
             fd_oracle="ours"),
    GradCase("affine_grid_2d_ac1", "AffineGrid", [r(2, 2, 3), i64(2, 1, 3, 1)],
             {"align_corners": 1}, opset=20, fd_oracle="ours"),
    GradCase("affine_grid_3d", "AffineGrid", [r(2, 3, 4), i64(2, 1, 2, 3, 4)],
             {"align_corners": 1}, opset=20, fd_oracle="ours"),
    # ---- MaxUnpool (linear in x: a gather at the indices) ----
    GradCase("maxunpool_2d", "MaxUnpool", [r(2, 3, 2, 3), _unpool_indices(2, 3, 2, 3, 2)],
             {"kernel_shape": [2, 2], "strides": [2, 2]}, opset=11),
    GradCase("maxunpool_output_shape", "MaxUnpool",
             [r(1, 2, 2, 2), _unpool_indices(1, 2, 2, 2, 2), i64(1, 2, 5, 5)],
             {"kernel_shape": [2, 2], "strides": [2, 2]}, opset=22,
             output_shapes=[(1, 2, 5, 5)]),  # ONNX infers no shape from an output_shape input
    GradCase("maxunpool_v9", "MaxUnpool", [r(1, 2, 3, 2), _unpool_indices(1, 2, 3, 2, 2)],
             {"kernel_shape": [2, 2], "strides": [2, 2]}, opset=9),
    # ---- Col2Im (linear: its gradient is im2col) ----
    GradCase("col2im_2d", "Col2Im", [r(2, 2 * 4, 12), i64(4, 5), i64(2, 2)], opset=18),
    GradCase("col2im_strides_pads_dilations", "Col2Im", [r(1, 3 * 6, 9), i64(5, 6), i64(2, 3)],
             {"strides": [2, 2], "pads": [1, 0, 1, 1], "dilations": [2, 1]}, opset=18),
    GradCase("col2im_3d", "Col2Im", [r(1, 2 * 8, 8), i64(3, 3, 3), i64(2, 2, 2)], opset=18),
    # ---- CenterCropPad (linear: its gradient is the centred pad/crop back) ----
    GradCase("center_crop_pad_crop_and_pad", "CenterCropPad", [r(3, 6, 5), i64(4, 3, 8)],
             opset=18),
    GradCase("center_crop_pad_axes", "CenterCropPad", [r(2, 5, 4, 3), i64(8, 1)],
             {"axes": [-3, 2]}, opset=18),
    # ---- RoiAlign (avg: linear in the map; boxes get no gradient) ----
    GradCase("roialign_avg_half_pixel_adaptive", "RoiAlign",
             [r(2, 3, 6, 7), Const(_BOXES), Const(np.array([1, 0, 1], np.int64))],
             {"output_height": 2, "output_width": 3, "sampling_ratio": 0}, opset=16),
    # onnx.reference places RoiAlign-10's samples half a pixel off (it applies v16's default
    # half_pixel; v10 predates the attribute and onnxruntime, like ours, uses output_half_pixel)
    GradCase("roialign_v10_scale_ratio2", "RoiAlign",
             [r(2, 2, 5, 5), Const(_BOXES * 2), Const(np.array([0, 1, 1], np.int64))],
             {"output_height": 2, "output_width": 2, "sampling_ratio": 2,
              "spatial_scale": 0.5}, opset=10, fd_oracle="ours"),
]
