"""Finite-difference gradient cases for Resize and Upsample (see gradcheck.py).

Resize is linear in its data input, so central differences are exact up to rounding and every
mode is checked: nearest with each nearest_mode, linear and cubic with each
coordinate_transformation_mode, exclude_outside, tf_crop_and_resize's extrapolated positions
(no gradient flows from them), antialias, axes, keep_aspect_ratio_policy, resized batch and
channel axes, 3-D and 5-D inputs, and scales fed as a graph input (the plan specialises on
them). Odd channel counts make channel_align=8 pad the feature maps.

The oracle is onnx.reference's Resize with its float attributes read as Python floats
(``Resize``): the evaluator hands them over as float32 scalars, and under NumPy 2's promotion
rules ``A * (ratio + 1)`` then rounds the cubic weights to float32 (1.3e-6 off in float64).
onnx.reference implements Resize only with the opset 11+ attributes and Upsample only for
nearest with integer scales (and not opset 7's scales attribute); the legacy cases it cannot
evaluate (Resize 10, Upsample linear) use ``fd_oracle="ours"`` and their forward is checked
against onnxruntime in test_resize.py. Scales fed as a graph input are tested there too (the
gradient helper plans with constants only).
"""

from __future__ import annotations

import numpy as np
from gradcheck import Const, GradCase
from onnx.reference.ops.op_resize import Resize as _ReferenceResize
from onnx.reference.ops.op_upsample import Upsample as _ReferenceUpsample


class Resize(_ReferenceResize):  # named as the op: ReferenceEvaluator keys new_ops by class name
    """onnx.reference's Resize computing in float64 throughout (see the module docstring)."""

    op_domain = ""

    def _run(self, x, roi, scales=None, sizes=None, **attrs):
        attrs = {k: float(v) if isinstance(v, np.floating) else v for k, v in attrs.items()}
        roi = None if roi is None else np.asarray(roi, np.float64)
        return super()._run(x, roi, scales, sizes, **attrs)


class Upsample(_ReferenceUpsample):
    """onnx.reference's Upsample with opset 7's ``scales`` attribute as its scales input."""

    op_domain = ""

    def _run(self, x, scale=None, mode=None, scales=None):
        return super()._run(x, np.asarray(scales if scale is None else scale), mode=mode)

RNG = np.random.default_rng(20261201)


def _r(*shape):
    return RNG.standard_normal(shape)


def _f(*values):
    return Const(np.asarray(values, np.float32))


def _i(*values):
    return Const(np.asarray(values, np.int64))


def _resize(id, inputs, opset=19, **attrs):
    return GradCase(id, "Resize", inputs, attrs, opset=opset, reference_ops=(Resize,))


def _scales(id, x, scales, opset=19, **attrs):
    return _resize(id, [x, None, _f(*scales)], opset, **attrs)


def _sizes(id, x, sizes, opset=19, **attrs):
    return _resize(id, [x, None, None, _i(*sizes)], opset, **attrs)


NEAREST = [
    _scales("resize_nearest_up_2x3", _r(2, 3, 3, 4), [1, 1, 2, 3], mode="nearest"),
    _scales("resize_nearest_down", _r(1, 3, 6, 7), [1, 1, 0.5, 0.6], mode="nearest"),
    _sizes("resize_nearest_floor_align_corners", _r(1, 5, 3, 4), [1, 5, 7, 5], mode="nearest",
           nearest_mode="floor", coordinate_transformation_mode="align_corners"),
    _sizes("resize_nearest_ceil_half_pixel", _r(1, 3, 4, 3), [1, 3, 7, 8], mode="nearest",
           nearest_mode="ceil"),
    _sizes("resize_nearest_prefer_ceil_asymmetric", _r(1, 3, 5, 4), [1, 3, 8, 3],
           mode="nearest", nearest_mode="round_prefer_ceil",
           coordinate_transformation_mode="asymmetric"),
    _sizes("resize_nearest_opset13", _r(2, 3, 3, 3), [2, 3, 5, 6], opset=13, mode="nearest"),
]

LINEAR = [
    _scales("resize_linear_half_pixel_up", _r(2, 3, 3, 4), [1, 1, 2, 1.5], mode="linear"),
    _scales("resize_linear_half_pixel_down", _r(1, 3, 7, 6), [1, 1, 0.6, 0.5], mode="linear"),
    _sizes("resize_linear_align_corners", _r(1, 3, 4, 5), [1, 3, 7, 3], mode="linear",
           coordinate_transformation_mode="align_corners"),
    _sizes("resize_linear_pytorch_half_pixel", _r(1, 5, 5, 4), [1, 5, 1, 9], mode="linear",
           coordinate_transformation_mode="pytorch_half_pixel"),
    _scales("resize_linear_asymmetric", _r(1, 3, 4, 4), [1, 1, 1.7, 2.5], mode="linear",
            coordinate_transformation_mode="asymmetric"),
    _scales("resize_linear_half_pixel_symmetric", _r(1, 3, 5, 4), [1, 1, 1.7, 0.8],
            mode="linear", coordinate_transformation_mode="half_pixel_symmetric"),
    _scales("resize_trilinear_5d", _r(1, 3, 3, 4, 3), [1, 1, 2, 1.5, 2], mode="linear"),
    _scales("resize_linear_3d", _r(2, 3, 5), [1, 1, 1.8], mode="linear", opset=13),
    _scales("resize_linear_batch_and_channels", _r(2, 3, 3, 4), [1.5, 2, 1, 1], mode="linear"),
    _resize("resize_linear_axes_channels", [_r(2, 3, 4, 3), None, _f(2.5)], mode="linear",
            axes=[1]),
    _resize("resize_tf_crop_and_resize_extrapolation",
            [_r(1, 3, 5, 5), _f(0, 0, -0.2, 0.3, 1, 1, 0.9, 1.3), None, _i(1, 3, 4, 6)],
            mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
            extrapolation_value=2.5),
    _resize("resize_tf_crop_and_resize_axes",
            [_r(1, 3, 6, 5), _f(0.1, 0.2, 0.8, 0.9), None, _i(4, 3)], mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize", axes=[3, 2]),
    _resize("resize_cubic_tf_crop_and_resize", [_r(1, 3, 5, 4), _f(0, 0, 0.2, -0.1, 1, 1, 0.7,
                                                                       1.1), None,
                                                 _i(1, 3, 3, 5)],
            mode="cubic", coordinate_transformation_mode="tf_crop_and_resize"),
]

CUBIC = [
    _scales("resize_cubic_up", _r(1, 3, 4, 4), [1, 1, 1.5, 2], mode="cubic"),
    _scales("resize_cubic_down_align_corners", _r(1, 3, 7, 6), [1, 1, 0.6, 0.5], mode="cubic",
            coordinate_transformation_mode="align_corners"),
    _sizes("resize_cubic_exclude_outside", _r(1, 3, 4, 5), [1, 3, 7, 3], mode="cubic",
           cubic_coeff_a=-0.5, exclude_outside=1),
    _scales("resize_cubic_asymmetric", _r(1, 3, 4, 4), [1, 1, 2, 1.3], mode="cubic",
            coordinate_transformation_mode="asymmetric"),
]

ANTIALIAS_AND_POLICY = [
    _scales("resize_linear_antialias_down", _r(1, 3, 8, 7), [1, 1, 0.5, 0.4], mode="linear",
            antialias=1),
    _sizes("resize_cubic_antialias_down", _r(1, 3, 8, 6), [1, 3, 3, 5], mode="cubic",
           antialias=1),
    _resize("resize_keep_aspect_not_larger", [_r(1, 3, 4, 6), None, None, _i(7, 7)],
            mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
    _resize("resize_keep_aspect_not_smaller", [_r(1, 3, 4, 6), None, None, _i(3, 3)],
            mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_smaller"),
]

LEGACY = [
    # onnx.reference has no Resize 10 (it reads the opset 11+ attributes) nor linear Upsample
    GradCase("resize10_nearest", "Resize", [_r(1, 3, 3, 4), _f(1, 1, 2, 1.5)],
             {"mode": "nearest"}, opset=10, fd_oracle="ours"),
    GradCase("resize10_linear_down", "Resize", [_r(1, 3, 6, 5), _f(1, 1, 0.5, 0.7)],
             {"mode": "linear"}, opset=10, fd_oracle="ours"),
    GradCase("upsample9_nearest", "Upsample", [_r(2, 3, 2, 3), _f(1, 1, 2, 3)],
             {"mode": "nearest"}, opset=9),
    GradCase("upsample9_linear", "Upsample", [_r(1, 3, 3, 4), _f(1, 1, 2, 2.5)],
             {"mode": "linear"}, opset=9, fd_oracle="ours"),
    GradCase("upsample7_nearest", "Upsample", [_r(1, 3, 2, 3)],
             {"mode": "nearest", "scales": [1.0, 1.0, 3.0, 2.0]}, opset=7,
             reference_ops=(Upsample,)),
    GradCase("upsample7_linear", "Upsample", [_r(1, 5, 3, 3)],
             {"mode": "linear", "scales": [1.0, 1.0, 2.0, 2.0]}, opset=7, fd_oracle="ours"),
]

CASES = NEAREST + LINEAR + CUBIC + ANTIALIAS_AND_POLICY + LEGACY
