"""Conv, ConvTranspose, MaxPool and AveragePool gradients against PyTorch autograd (float64).

torch is an oracle only: the same random inputs and cotangent go through tr_onnx's autodiff
(``vjp``) and through ``torch.autograd``; y, gx, gw and gb must agree to rounding, with compact
(align 1) and padded (align 8) channels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gradcheck import GradCase, build_model

from tr_onnx.training.gradients import vjp

ALIGNS = [1, 8]
RTOL, ATOL = 1e-10, 1e-11  # float64; sums are taken in another order than torch's


def _ours(op, inputs, attrs, align):
    """y and the gradients of sum(y * cot) w.r.t. every input, with the cotangent used."""
    case = GradCase(op, op, inputs, attrs)
    model = build_model(case)
    feed = {f"x{i}": a for i, a in enumerate(inputs)}
    out_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    cot = np.random.default_rng(7).standard_normal(out_shape)
    y, grads = vjp(model, feed, list(feed), cot, channel_align=align)
    return y, [grads[f"x{i}"] for i in range(len(inputs))], cot


def _torch(fn, inputs, cot):
    ts = [torch.tensor(a, requires_grad=True) for a in inputs]
    y = fn(*ts)
    y.backward(torch.tensor(cot))
    return y.detach().numpy(), [t.grad.numpy() for t in ts]


def _compare(ours, theirs):
    (y, grads, _), (ty, tgrads) = ours, theirs
    np.testing.assert_allclose(y, ty, rtol=RTOL, atol=ATOL)
    for name, g, tg in zip(("gx", "gw", "gb"), grads, tgrads):
        np.testing.assert_allclose(g, tg, rtol=RTOL, atol=ATOL, err_msg=name)


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


# id: (x shape, w shape, stride, padding, dilation, groups)
CONV2D = {
    "plain": ((2, 3, 7, 6), (4, 3, 3, 3), 1, 0, 1, 1),
    "stride_pad": ((1, 5, 8, 9), (6, 5, 3, 2), (2, 3), (1, 2), 1, 1),
    "dilation": ((2, 3, 9, 8), (5, 3, 3, 2), 1, (2, 1), (2, 3), 1),
    "groups": ((1, 6, 6, 7), (9, 2, 3, 3), (2, 1), 1, 1, 3),
    "depthwise": ((2, 13, 6, 5), (13, 1, 3, 3), 1, 1, 1, 13),
    "depthwise_mult": ((1, 5, 7, 7), (15, 1, 3, 2), 2, (1, 0), (1, 2), 5),
    "pointwise": ((2, 13, 4, 5), (7, 13, 1, 1), 1, 0, 1, 1),
    # stride 1 on maps large enough for ops.conv_grid's per-tap GEMMs (grid <= 1.6x output)
    "grid_pad": ((2, 6, 12, 11), (5, 6, 3, 3), 1, 1, 1, 1),
    "grid_groups": ((2, 6, 14, 12), (8, 3, 3, 3), 1, 1, 1, 2),
    "grid_dilation": ((1, 4, 16, 15), (6, 4, 3, 2), 1, (2, 1), (2, 3), 1),
    "grid_valid": ((2, 3, 16, 16), (4, 3, 3, 3), 1, 0, 1, 1),
}
def _pair(v):
    return list(v) if isinstance(v, tuple) else [v, v]


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", list(CONV2D.values()), ids=list(CONV2D))
def test_conv2d(spec, align):
    xs, wsh, stride, padding, dilation, groups = spec
    x, w, b = _rand(1, *xs), _rand(2, *wsh), _rand(3, wsh[0])
    attrs = {"strides": _pair(stride), "pads": _pair(padding) * 2,
             "dilations": _pair(dilation), "group": groups}
    ours = _ours("Conv", [x, w, b], attrs, align)
    _compare(ours, _torch(lambda x, w, b: F.conv2d(x, w, b, stride, padding, dilation, groups),
                          [x, w, b], ours[2]))


# which kernels of ops.conv_grid / ops.conv_grad (the BLAS ones) each case must run
FAST_KERNELS = {
    "grid_pad": ("conv_grid_numpy", "conv_grad_data_grid_numpy", "_grad_filter_blas"),
    "grid_groups": ("conv_grid_numpy", "conv_grad_data_grid_numpy", "_grad_filter_blas"),
    "pointwise": ("conv_grad_filter_grid_numpy",),
}


@pytest.mark.parametrize("cblas", [True, False], ids=["cblas", "numpy_gemm"])
@pytest.mark.parametrize("spec_id", list(FAST_KERNELS))
def test_conv2d_blas_kernels_are_used(spec_id, cblas, monkeypatch):
    """These windows run the per-tap GEMM kernels and the direct-output filter gradient, and
    give the same results where GEMMs go through NumPy instead of CBLAS (no symbol found)."""
    from tr_onnx import host_blas
    from tr_onnx.ops import conv_grad, conv_grid

    used = []
    for name in FAST_KERNELS[spec_id]:
        module = conv_grid if hasattr(conv_grid, name) else conv_grad
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, real=real, name=name: used.append(name) or real(*a))
    if not cblas:
        monkeypatch.setattr(host_blas, "_gemm_symbol", lambda dtype: None)
        monkeypatch.setattr(host_blas, "available", lambda dtype: True)
    test_conv2d(CONV2D[spec_id], 8)
    assert sorted(set(used)) == sorted(FAST_KERNELS[spec_id])


# id: (x shape, w shape, stride, padding, output_padding, dilation, groups)
CONV_TRANSPOSE2D = {
    "plain": ((2, 3, 4, 5), (3, 4, 3, 3), 1, 0, 0, 1, 1),
    "stride_pad_outpad": ((1, 5, 4, 3), (5, 3, 3, 2), (2, 3), (1, 0), (1, 2), 1, 1),
    "groups_dilation": ((1, 6, 3, 4), (6, 2, 2, 3), 1, 1, 0, (2, 1), 3),
}


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", list(CONV_TRANSPOSE2D.values()), ids=list(CONV_TRANSPOSE2D))
def test_conv_transpose2d(spec, align):
    xs, wsh, stride, padding, out_pad, dilation, groups = spec
    x, w, b = _rand(4, *xs), _rand(5, *wsh), _rand(6, wsh[1] * groups)
    attrs = {"strides": _pair(stride), "pads": _pair(padding) * 2,
             "output_padding": _pair(out_pad), "dilations": _pair(dilation), "group": groups}
    ours = _ours("ConvTranspose", [x, w, b], attrs, align)
    _compare(ours, _torch(lambda x, w, b: F.conv_transpose2d(x, w, b, stride, padding, out_pad,
                                                             groups, dilation), [x, w, b],
                          ours[2]))


# id: (x shape, kernel, stride, padding, dilation, ceil_mode)
MAX_POOL2D = {
    "2x2s2": ((2, 3, 6, 6), 2, 2, 0, 1, False),
    "3x3s1_pad": ((1, 5, 7, 6), 3, 1, 1, 1, False),
    "3x2_s2_dil_ceil": ((1, 13, 9, 8), (3, 2), 2, (1, 0), (1, 2), True),
}


def _distinct(seed, *shape):
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) - n / 2) * 0.1


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", list(MAX_POOL2D.values()), ids=list(MAX_POOL2D))
def test_max_pool2d(spec, align):
    xs, kernel, stride, padding, dilation, ceil = spec
    x = _distinct(8, *xs)
    attrs = {"kernel_shape": _pair(kernel), "strides": _pair(stride),
             "pads": _pair(padding) * 2, "dilations": _pair(dilation), "ceil_mode": int(ceil)}
    ours = _ours("MaxPool", [x], attrs, align)
    _compare(ours, _torch(lambda x: F.max_pool2d(x, kernel, stride, padding, dilation, ceil),
                          [x], ours[2]))


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", [MAX_POOL2D["3x3s1_pad"], ((2, 5, 9, 8), 3, 2, 1, 1, False)],
                         ids=["3x3s1_pad", "3x3s2_pad_resnet_stem"])
def test_max_pool2d_ties_go_to_the_first_maximum_as_in_pytorch(spec, align):
    """Few distinct values (as after a ReLU, whose zeros tie): every window's gradient goes to
    its first maximum in scan order, and only there."""
    xs, kernel, stride, padding, dilation, ceil = spec
    x = np.random.default_rng(5).integers(-1, 3, xs).astype(np.float64)
    attrs = {"kernel_shape": _pair(kernel), "strides": _pair(stride),
             "pads": _pair(padding) * 2, "dilations": _pair(dilation), "ceil_mode": int(ceil)}
    ours = _ours("MaxPool", [x], attrs, align)
    _compare(ours, _torch(lambda x: F.max_pool2d(x, kernel, stride, padding, dilation, ceil),
                          [x], ours[2]))


# id: (x shape, kernel, stride, padding, ceil_mode, count_include_pad)
AVG_POOL2D = {
    "2x2s2": ((2, 3, 6, 6), 2, 2, 0, False, False),
    "3x3_pad_exclude": ((1, 5, 7, 6), 3, 1, 1, False, False),
    "3x3_pad_include": ((1, 5, 7, 6), 3, 2, 1, False, True),
    "3x2_ceil": ((1, 13, 8, 7), (3, 2), 2, (1, 0), True, False),
}


@pytest.mark.parametrize("align", ALIGNS, ids=[f"align{a}" for a in ALIGNS])
@pytest.mark.parametrize("spec", list(AVG_POOL2D.values()), ids=list(AVG_POOL2D))
def test_avg_pool2d(spec, align):
    xs, kernel, stride, padding, ceil, include = spec
    x = _rand(9, *xs)
    attrs = {"kernel_shape": _pair(kernel), "strides": _pair(stride),
             "pads": _pair(padding) * 2, "ceil_mode": int(ceil),
             "count_include_pad": int(include)}
    ours = _ours("AveragePool", [x], attrs, align)
    _compare(ours, _torch(lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil, include),
                          [x], ours[2]))
