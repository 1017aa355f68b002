"""Finite-difference gradient cases for Conv, ConvTranspose and the pools (see gradcheck.py).

Odd channel counts (3, 5, 13) make channel_align=8 pad the feature maps; depthwise convs with a
channel multiplier, 1-D and 3-D windows, and every window attribute that changes the backward
(pads, strides, dilations, groups, auto_pad, ceil_mode, count_include_pad) are covered.
MaxPool inputs are distinct random values (no ties at a window's maximum).
"""

from __future__ import annotations

import numpy as np
from gradcheck import Const, GradCase

RNG = np.random.default_rng(20240617)


def _r(*shape):
    return RNG.standard_normal(shape)


def _distinct(*shape):
    """Well-separated values (a permutation of a grid): no max-pool window has a tie."""
    n = int(np.prod(shape))
    return (RNG.permutation(n).reshape(shape) - n / 2) * 0.1


def _conv(id, x, w, b=None, const_w=False, **attrs):
    ins = [x, Const(w) if const_w else w] + ([b] if b is not None else [])
    return GradCase(id, "Conv", ins, attrs)


def _convt(id, x, w, b=None, **attrs):
    return GradCase(id, "ConvTranspose", [x, w] + ([b] if b is not None else []), attrs)


CONV = [
    _conv("conv2d_basic", _r(2, 3, 5, 6), _r(4, 3, 3, 3), _r(4)),
    _conv("conv2d_pads_strides", _r(1, 5, 7, 6), _r(3, 5, 3, 2), _r(3),
          pads=[1, 0, 2, 1], strides=[2, 3]),
    _conv("conv2d_dilations", _r(1, 3, 8, 7), _r(5, 3, 2, 3), dilations=[2, 3], pads=[1, 1, 0, 2]),
    _conv("conv2d_groups", _r(2, 6, 5, 5), _r(4, 3, 3, 3), _r(4), group=2, pads=[1, 1, 1, 1]),
    _conv("conv2d_groups_odd", _r(1, 13, 5, 4), _r(13, 1, 2, 3), group=13, strides=[2, 1]),
    _conv("conv2d_depthwise_mult", _r(1, 5, 6, 6), _r(10, 1, 3, 3), _r(10), group=5,
          pads=[1, 2, 0, 1], strides=[2, 2]),
    _conv("conv2d_depthwise_dilated", _r(2, 3, 7, 7), _r(6, 1, 2, 2), group=3, dilations=[2, 2]),
    _conv("conv2d_same_upper", _r(1, 3, 5, 7), _r(2, 3, 3, 4), auto_pad="SAME_UPPER",
          strides=[2, 2]),
    _conv("conv2d_same_lower", _r(1, 3, 6, 5), _r(2, 3, 4, 3), _r(2), auto_pad="SAME_LOWER"),
    _conv("conv2d_valid", _r(1, 5, 6, 6), _r(3, 5, 3, 3), auto_pad="VALID", strides=[2, 2]),
    _conv("conv2d_pointwise", _r(2, 13, 3, 4), _r(5, 13, 1, 1), _r(5)),
    _conv("conv2d_kernel_shape_attr", _r(1, 3, 5, 5), _r(2, 3, 2, 3), kernel_shape=[2, 3]),
    _conv("conv2d_const_weight", _r(1, 5, 5, 5), _r(3, 5, 3, 3), const_w=True, pads=[1, 1, 1, 1]),
    _conv("conv1d", _r(2, 3, 9), _r(4, 3, 3), _r(4), pads=[2, 1], strides=[2], dilations=[2]),
    _conv("conv1d_groups", _r(1, 6, 7), _r(9, 2, 2), group=3),
    _conv("conv3d", _r(1, 3, 4, 5, 4), _r(2, 3, 2, 3, 2), _r(2), pads=[1, 0, 1, 0, 1, 1],
          strides=[1, 2, 2]),
    _conv("conv3d_depthwise", _r(1, 3, 4, 4, 4), _r(3, 1, 2, 2, 2), group=3, dilations=[1, 2, 1]),
    GradCase("conv2d_opset1", "Conv", [_r(1, 3, 5, 5), _r(2, 3, 3, 3)], {"pads": [1, 1, 1, 1]},
             opset=1),
    GradCase("conv2d_wrt_x_only", "Conv", [_r(1, 3, 4, 4), _r(3, 3, 3, 3), _r(3)], {},
             wrt=(0,)),
    GradCase("conv2d_wrt_w_only", "Conv", [_r(1, 3, 4, 4), _r(3, 3, 3, 3), _r(3)],
             {"strides": [2, 2]}, wrt=(1,)),
]

CONV_TRANSPOSE = [
    _convt("convt2d_basic", _r(1, 3, 4, 5), _r(3, 2, 3, 3), _r(2)),
    _convt("convt2d_strides_pads", _r(2, 5, 3, 4), _r(5, 3, 3, 2), _r(3), strides=[2, 3],
           pads=[1, 0, 1, 1]),
    _convt("convt2d_output_padding", _r(1, 3, 3, 3), _r(3, 2, 3, 3), strides=[2, 2],
           output_padding=[1, 1], pads=[0, 1, 0, 0]),
    # onnx.reference's ConvTranspose stores one output channel per group (its group loop
    # writes final[:, g:g+1]), so with 2 per group it fails; our forward is checked against
    # onnxruntime in test_ops_conv_pool.py
    GradCase("convt2d_dilations_groups", "ConvTranspose",
             [_r(1, 6, 4, 4), _r(6, 2, 2, 3), _r(6)], {"group": 3, "dilations": [2, 1]},
             fd_oracle="ours"),
    # onnx.reference adds the whole bias to every group's single-group run and keeps channel
    # 0 of it, so a grouped ConvTranspose with bias is wrong there (ours equals torch's
    # conv_transpose2d, see test_grad_torch_conv_pool.py)
    GradCase("convt2d_depthwise", "ConvTranspose", [_r(1, 5, 3, 4), _r(5, 1, 3, 3), _r(5)],
             {"group": 5, "strides": [2, 1], "pads": [1, 1, 0, 1]}, fd_oracle="ours"),
    _convt("convt2d_same_upper", _r(1, 3, 3, 4), _r(3, 5, 3, 3), strides=[2, 2],
           auto_pad="SAME_UPPER"),
    # onnx.reference's ConvTranspose with output_shape fails inside its Col2Im (it checks the
    # shape against pads it never derived)
    GradCase("convt2d_output_shape", "ConvTranspose", [_r(1, 3, 3, 3), _r(3, 2, 3, 3)],
             {"strides": [2, 2], "output_shape": [6, 7]}, fd_oracle="ours"),
    _convt("convt1d", _r(2, 3, 5), _r(3, 4, 3), _r(4), strides=[2], pads=[1, 0]),
    _convt("convt3d", _r(1, 3, 2, 3, 2), _r(3, 2, 2, 2, 2), strides=[2, 1, 2]),
]



def _pool(id, op, x, opset=17, fd_oracle="reference", **attrs):
    return GradCase(id, op, [x], attrs, opset=opset, fd_oracle=fd_oracle)


MAX_POOL = [
    _pool("maxpool2d_basic", "MaxPool", _distinct(2, 3, 6, 6), kernel_shape=[2, 2],
          strides=[2, 2]),
    # onnx.reference's MaxPool gives a [6, 7] output for these asymmetric pads where ONNX
    # shape inference and onnxruntime give [8, 5]; our forward equals onnxruntime's
    _pool("maxpool2d_overlap_pads", "MaxPool", _distinct(1, 5, 7, 6), kernel_shape=[3, 3],
          pads=[1, 0, 2, 1], fd_oracle="ours"),
    _pool("maxpool2d_strides_dilations", "MaxPool", _distinct(1, 13, 9, 8), kernel_shape=[2, 3],
          strides=[2, 1], dilations=[2, 2], pads=[1, 1, 0, 1]),
    _pool("maxpool2d_ceil_mode", "MaxPool", _distinct(1, 3, 7, 8), kernel_shape=[3, 3],
          strides=[2, 2], ceil_mode=1),
    _pool("maxpool2d_same_upper", "MaxPool", _distinct(1, 3, 5, 7), kernel_shape=[3, 2],
          strides=[2, 2], auto_pad="SAME_UPPER"),
    _pool("maxpool2d_same_lower", "MaxPool", _distinct(1, 5, 6, 5), kernel_shape=[2, 3],
          auto_pad="SAME_LOWER"),
    _pool("maxpool2d_opset8", "MaxPool", _distinct(1, 3, 5, 5), opset=8, kernel_shape=[3, 3],
          strides=[2, 2], pads=[1, 1, 1, 1]),
    GradCase("maxpool2d_with_indices", "MaxPool", [_distinct(1, 3, 6, 5)],
             {"kernel_shape": [2, 2], "strides": [1, 2]}, n_outputs=2),
    _pool("maxpool1d", "MaxPool", _distinct(2, 3, 11), kernel_shape=[3], strides=[2], pads=[1, 1],
          dilations=[2]),
    _pool("maxpool3d", "MaxPool", _distinct(1, 3, 4, 5, 4), kernel_shape=[2, 2, 2],
          strides=[2, 1, 2], pads=[0, 1, 0, 1, 0, 1]),
]

AVERAGE_POOL = [
    _pool("avgpool2d_basic", "AveragePool", _r(2, 3, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    _pool("avgpool2d_pads_exclude", "AveragePool", _r(1, 5, 7, 6), kernel_shape=[3, 3],
          pads=[1, 0, 2, 1]),
    _pool("avgpool2d_pads_include", "AveragePool", _r(1, 5, 7, 6), kernel_shape=[3, 3],
          pads=[1, 1, 2, 1], strides=[2, 1], count_include_pad=1),
    _pool("avgpool2d_ceil_mode", "AveragePool", _r(1, 13, 7, 8), kernel_shape=[3, 3],
          strides=[2, 2], ceil_mode=1, pads=[1, 0, 0, 1]),
    _pool("avgpool2d_ceil_mode_include", "AveragePool", _r(1, 3, 6, 7), kernel_shape=[2, 3],
          strides=[3, 2], ceil_mode=1, count_include_pad=1, pads=[1, 1, 1, 0]),
    _pool("avgpool2d_same_upper", "AveragePool", _r(1, 3, 5, 7), kernel_shape=[3, 2],
          strides=[2, 2], auto_pad="SAME_UPPER"),
    _pool("avgpool2d_dilations", "AveragePool", _r(1, 3, 8, 7), opset=19, kernel_shape=[2, 2],
          dilations=[2, 3], pads=[1, 0, 1, 1]),
    _pool("avgpool2d_opset7", "AveragePool", _r(1, 3, 5, 5), opset=7, kernel_shape=[3, 3],
          pads=[1, 1, 1, 1], count_include_pad=1),
    _pool("avgpool1d", "AveragePool", _r(2, 5, 9), kernel_shape=[3], strides=[2], pads=[1, 2]),
    _pool("avgpool3d", "AveragePool", _r(1, 3, 4, 5, 4), kernel_shape=[2, 3, 2],
          strides=[2, 1, 2], pads=[1, 1, 0, 0, 1, 1]),
]

LP_POOL = [
    _pool("lppool2d_p2", "LpPool", _r(1, 3, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    _pool("lppool2d_p3_pads", "LpPool", _r(1, 5, 6, 5), kernel_shape=[3, 2], pads=[1, 0, 1, 1],
          p=3),
    _pool("lppool2d_p1", "LpPool", _r(1, 3, 5, 5), kernel_shape=[2, 2], p=1),
    _pool("lppool1d_p4", "LpPool", _r(2, 3, 8), kernel_shape=[3], strides=[2], p=4),
]

GLOBAL_POOL = [
    _pool("globalavgpool2d", "GlobalAveragePool", _r(2, 13, 4, 5)),
    _pool("globalavgpool1d", "GlobalAveragePool", _r(2, 3, 7)),
    _pool("globalavgpool3d", "GlobalAveragePool", _r(1, 5, 3, 2, 4)),
    _pool("globalmaxpool2d", "GlobalMaxPool", _distinct(2, 5, 4, 3)),
    # onnx.reference's GlobalMaxPool reduces axes (r, r+1) for r spatial axes: right for 2-D
    # only (1-D reduces C too, 3-D keeps a spatial axis)
    _pool("globalmaxpool1d", "GlobalMaxPool", _distinct(1, 3, 7), fd_oracle="ours"),
    _pool("globalmaxpool3d", "GlobalMaxPool", _distinct(1, 3, 2, 3, 4), fd_oracle="ours"),
    # onnx.reference has no GlobalLpPool
    _pool("globallppool2d_p2", "GlobalLpPool", _r(2, 3, 4, 4), fd_oracle="ours"),
    _pool("globallppool2d_p3", "GlobalLpPool", _r(1, 5, 3, 4), p=3, fd_oracle="ours"),
    _pool("globallppool1d_p1", "GlobalLpPool", _r(1, 3, 6), p=1, fd_oracle="ours"),
]

CASES = CONV + CONV_TRANSPOSE + MAX_POOL + AVERAGE_POOL + LP_POOL + GLOBAL_POOL
