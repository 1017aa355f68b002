"""Spatial transforms: ops that resample a feature map at computed positions. AffineGrid (the
grid of an affine transform, the half of a spatial transformer that GridSample,
``ops/grid_sample.py``, samples with), RoiAlign, MaxUnpool, Col2Im and CenterCropPad, with the
backward ops RoiAlignGrad, Col2ImGrad and CenterCropPadGrad.

Kernels read compact logical NCHW arrays (``PLAIN_ONLY``: the layout pass converts
channels-last maps): AffineGrid's last axis holds coordinates, not channels, and RoiAlign,
MaxUnpool and Col2Im address pixels by flat index. Col2Im reuses Conv's window arithmetic
(``Window``, ``col2im_nhwc``) on a channels-last view of its columns.

Allocation: RoiAlign's sampling depends on the box values and allocates per box; MaxUnpool's
scatter uses ``np.put`` (no ``out=``).
"""

from __future__ import annotations

import math

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, STRIDED_TO_PLAIN, OpDef
from .conv_window import Window, col2im_nhwc, col2im_slices_nhwc, windows_nhwc
from .tensor import DATA_INPUT, first_only

# ---- AffineGrid -----------------------------------------------------------------------------


def _normalized_positions(length: int, align: bool) -> np.ndarray:
    """Pixel centres (align 0) or corners (align 1) of one axis in [-1, 1]; a one-pixel axis
    sits at 0, as in PyTorch (onnx.reference divides by zero there)."""
    if length <= 1:
        return np.zeros(length)
    if align:
        return np.linspace(-1.0, 1.0, length)
    return (2 * np.arange(length) + 1) / length - 1


def affine_base_grid(spatial, align: bool, dtype) -> np.ndarray:
    """``[prod(spatial), nd + 1]`` homogeneous positions (x, y[, z], 1): column j addresses
    spatial axis ``nd - 1 - j``, rows in row-major order over ``spatial``."""
    nd = len(spatial)
    axes = np.meshgrid(*(_normalized_positions(s, align) for s in spatial), indexing="ij")
    cols = [axes[nd - 1 - j].reshape(-1) for j in range(nd)]
    return np.stack(cols + [np.ones(math.prod(spatial))], axis=1).astype(dtype)


def affine_grid_numpy(ctx):
    """AffineGrid: ``grid[n, *s] = theta[n] @ (x, y[, z], 1)`` at every output position."""
    n, *spatial, nd = ctx.outputs[0].shape
    base = affine_base_grid(spatial, bool(ctx.attrs["align_corners"]), ctx.outputs[0].dtype)
    q = len(base)

    def run(ins, outs, ws):
        np.matmul(base, ins[0].transpose(0, 2, 1), out=outs[0].reshape(n, q, nd))

    return run


# ---- RoiAlign -------------------------------------------------------------------------------


def _roi_axis(start, extent, bins: int, samples: int, length: int, dtype):
    """Sample positions of one box axis (``bins`` bins of ``samples`` each) as onnx.reference
    places them: (low index, high index, low weight, high weight), each ``[bins, samples]``;
    samples past [-1, length] weigh 0."""
    size = extent / bins
    pos = (start + np.arange(bins)[:, None] * size
           + (np.arange(samples)[None, :] + 0.5) * size / samples)
    valid = (pos >= -1.0) & (pos <= length)
    pos = np.maximum(pos, 0.0)
    low = pos.astype(np.int64)
    edge = low >= length - 1
    low = np.where(edge, length - 1, low)
    high = np.where(edge, low, low + 1)
    frac = np.where(edge, 0.0, pos - low)
    return low, high, ((1 - frac) * valid).astype(dtype), (frac * valid).astype(dtype)


def _roi_sampler(ctx, h: int, w: int, oh: int, ow: int, dtype):
    """``box -> ((y samples), (x samples), count)`` with ``_roi_axis``'s per-axis samples, or
    None for a box without samples (adaptive sampling of an empty box)."""
    # v10 has no attribute; its boxes behave as output_half_pixel
    half = ctx.attrs.get("coordinate_transformation_mode", "output_half_pixel") == "half_pixel"
    scale, ratio = float(ctx.attrs["spatial_scale"]), int(ctx.attrs["sampling_ratio"])

    def samples(box):
        x0, y0, x1, y1 = (float(v) * scale - (0.5 if half else 0.0) for v in box)
        bw, bh = x1 - x0, y1 - y0
        if not half:
            bw, bh = max(bw, 1.0), max(bh, 1.0)
        gh = ratio if ratio > 0 else math.ceil(bh / oh)
        gw = ratio if ratio > 0 else math.ceil(bw / ow)
        if gh <= 0 or gw <= 0:
            return None
        return _roi_axis(y0, bh, oh, gh, h, dtype), _roi_axis(x0, bw, ow, gw, w, dtype), gh * gw

    return samples


def _roi_matrix(axis_samples, bins: int, length: int, dtype) -> np.ndarray:
    """``[bins, length]``: each bin's summed sample weights per pixel row (or column)."""
    low, high, wl, wh = axis_samples
    m, rows = np.zeros((bins, length), dtype), np.arange(bins)[:, None]
    np.add.at(m, (rows, low), wl)
    np.add.at(m, (rows, high), wh)
    return m


def roi_align_numpy(ctx):
    """RoiAlign: each box's bins average (or max) bilinear samples of its batch item's map.
    The average is separable: ``Ay @ x @ Ax^T / count`` with per-axis weight matrices."""
    _, c, h, w = ctx.inputs[0].shape
    r, _, oh, ow = ctx.outputs[0].shape
    dtype = ctx.outputs[0].dtype
    samples = _roi_sampler(ctx, h, w, oh, ow, dtype)
    avg = ctx.attrs["mode"] == "avg"

    def one_box(x, box, y):
        found = samples(box)
        if found is None:
            y.fill(0)
            return
        ys, xs, count = found
        if avg:
            ay, ax = _roi_matrix(ys, oh, h, dtype), _roi_matrix(xs, ow, w, dtype)
            np.matmul(ay @ x, ax.T, out=y)
            y /= count
            return
        # max: the largest weighted corner of any sample (onnx.reference, onnxruntime)
        best = None
        for yi, wy in ((ys[0], ys[2]), (ys[1], ys[3])):
            for xi, wx in ((xs[0], xs[2]), (xs[1], xs[3])):
                v = x[:, yi[:, :, None, None], xi[None, None]]  # [C, oh, gh, ow, gw]
                v = v * (wy[:, :, None, None] * wx[None, None])
                best = v if best is None else np.maximum(best, v)
        np.copyto(y, best.max(axis=(2, 4)))

    def run(ins, outs, ws):
        x, boxes, batch = ins
        for k in range(r):
            one_box(x[int(batch[k])], boxes[k], outs[0][k])

    return run


def roi_align_grad_numpy(ctx):
    """RoiAlignGrad(gy, rois, batch_indices) -> gx of an average-mode RoiAlign (attributes
    the forward's): ``gx[batch[k]] += Ay^T @ gy[k] @ Ax / count`` per box."""
    _, c, h, w = ctx.outputs[0].shape
    r, _, oh, ow = ctx.inputs[0].shape
    dtype = ctx.outputs[0].dtype
    samples = _roi_sampler(ctx, h, w, oh, ow, dtype)

    def run(ins, outs, ws):
        gy, boxes, batch = ins
        gx = outs[0]
        gx.fill(0)
        for k in range(r):
            found = samples(boxes[k])
            if found is not None:
                ys, xs, count = found
                ay, ax = _roi_matrix(ys, oh, h, dtype), _roi_matrix(xs, ow, w, dtype)
                gx[int(batch[k])] += (ay.T @ gy[k] @ ax) / count

    return run


def roi_align_vjp(b, node, gys, needed):
    """Average mode: the map's gradient (the boxes get none, as in torchvision)."""
    if node.attrs["mode"] != "avg":
        raise UnsupportedModelError(f"{node.label}: no gradient for RoiAlign mode "
                                    f"{node.attrs['mode']!r} (avg has one); freeze the "
                                    f"parameters before it", [])
    x, rois, batch = node.inputs
    attrs = {k: node.attrs[k] for k in ("mode", "output_height", "output_width",
                                        "sampling_ratio", "spatial_scale")}
    attrs["coordinate_transformation_mode"] = node.attrs.get(
        "coordinate_transformation_mode", "output_half_pixel")
    return first_only(node, b.op("RoiAlignGrad", [gys[0], rois, batch], attrs,
                                 domain=INTERNAL_DOMAIN, like=x))


# ---- MaxUnpool ------------------------------------------------------------------------------


def unpool_shape_of(x_shape, attrs) -> tuple[int, ...]:
    kernel = [int(k) for k in attrs["kernel_shape"]]
    nd = len(kernel)
    strides = [int(s) for s in attrs.get("strides") or [1] * nd]
    pads = [int(p) for p in attrs.get("pads") or [0] * (2 * nd)]
    return tuple(x_shape[:2]) + tuple((s - 1) * st - pads[i] - pads[nd + i] + k for i, (s, st, k)
                                      in enumerate(zip(x_shape[2:], strides, kernel)))


def max_unpool_numpy(ctx):
    """MaxUnpool: ``y.flat[indices] = x`` over the window-given shape; an ``output_shape``
    input larger than that puts it in the leading corner (onnx.reference), the rest 0."""
    full = unpool_shape_of(ctx.inputs[0].shape, ctx.attrs)
    out = tuple(ctx.outputs[0].shape)
    if any(o < f for o, f in zip(out, full)):
        raise ctx.error(f"output_shape {list(out)} is smaller than the unpooled shape "
                        f"{list(full)} the indices address")
    corner = tuple(slice(0, f) for f in full)
    tmp = ctx.workspace(full, ctx.outputs[0].dtype) if out != full else None

    def run(ins, outs, ws):
        y = ws[tmp] if tmp is not None else outs[0]
        y.fill(0)
        np.put(y.reshape(-1), ins[1], ins[0])
        if tmp is not None:
            outs[0].fill(0)
            np.copyto(outs[0][corner], y)

    return run


def max_unpool_vjp(b, node, gys, needed):
    """x's gradient gathers gy at the indices (in the window-given shape's corner)."""
    x, idx = node.inputs[0], node.inputs[1]
    gy = gys[0]
    full = unpool_shape_of(x.shape, node.attrs)
    if tuple(gy.shape) != full:
        gy = b.op("Slice", [gy, b.ints([0] * len(full)), b.ints(full)])
    flat = b.op("Reshape", [gy, b.ints([-1])])
    return first_only(node, b.op("Gather", [flat, idx], {"axis": 0}, like=x))


# ---- Col2Im ---------------------------------------------------------------------------------


def _col2im_window(ctx, image, block) -> Window:
    attrs = {"auto_pad": "NOTSET", "pads": ctx.attrs.get("pads"),
             "strides": ctx.attrs.get("strides"), "dilations": ctx.attrs.get("dilations")}
    try:
        return Window.resolve(attrs, image, block)
    except ValueError as e:
        raise ctx.error(str(e)) from None


def col2im_plan(ctx, cols_shape, image_shape, block_shape):
    """(Window, channels) of a Col2Im with columns ``[N, C*prod(block), L]``."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    win = _col2im_window(ctx, image, block)
    kk = math.prod(block)
    if cols_shape[1] % kk or cols_shape[2] != math.prod(win.out_shape):
        raise ctx.error(f"columns {list(cols_shape)} do not fit blocks {block} sliding over "
                        f"{image} ({list(win.out_shape)} positions, C*{kk} rows)")
    return win, cols_shape[1] // kk


def _cols_nhwc(cols: np.ndarray, win: Window, c: int) -> np.ndarray:
    """``[N, C*prod(K), L]`` columns as the ``[N, *S_out, *K, C]`` view ``col2im_nhwc`` reads."""
    nd = win.ndim
    v = cols.reshape((cols.shape[0], c, *win.kernel, *win.out_shape))
    return v.transpose(0, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd), 1)


def _image_nhwc(y: np.ndarray) -> np.ndarray:
    return y.transpose(0, *range(2, y.ndim), 1)


def col2im_numpy(ctx):
    """Col2Im: every block of the columns added back into the (padded) image."""
    win, c = col2im_plan(ctx, ctx.inputs[0].shape, ctx.const(1), ctx.const(2))
    n = ctx.inputs[0].shape[0]
    xp = ctx.workspace((n, *win.padded_shape, c), ctx.outputs[0].dtype)
    scatter = col2im_slices_nhwc(win)
    interior = (slice(None),) + tuple(slice(b, b + s) for b, s in
                                      zip(win.pads_begin, win.in_shape)) + (slice(None),)

    def run(ins, outs, ws):
        ws[xp].fill(0)
        col2im_nhwc(_cols_nhwc(ins[0], win, c), ws[xp], scatter)
        np.copyto(_image_nhwc(outs[0]), ws[xp][interior])

    return run


def col2im_grad_numpy(ctx):
    """Col2ImGrad(gy, image_shape, block_shape) -> gcols: Col2Im's adjoint, im2col of gy."""
    win, c = col2im_plan(ctx, ctx.outputs[0].shape, ctx.const(1), ctx.const(2))
    n = ctx.outputs[0].shape[0]
    xp = ctx.workspace((n, *win.padded_shape, c), ctx.outputs[0].dtype)
    interior = (slice(None),) + tuple(slice(b, b + s) for b, s in
                                      zip(win.pads_begin, win.in_shape)) + (slice(None),)

    def run(ins, outs, ws):
        ws[xp].fill(0)
        np.copyto(ws[xp][interior], _image_nhwc(ins[0]))
        np.copyto(_cols_nhwc(outs[0], win, c), windows_nhwc(ws[xp], win))

    return run


def col2im_vjp(b, node, gys, needed):
    cols, image, block = node.inputs
    g = b.op("Col2ImGrad", [gys[0], image, block],
             {k: node.attrs[k] for k in ("dilations", "pads", "strides") if node.attrs.get(k)},
             domain=INTERNAL_DOMAIN, like=cols)
    return first_only(node, g)


# ---- CenterCropPad --------------------------------------------------------------------------


def center_crop_pad_numpy(ctx):
    """CenterCropPad: per axis, the centred crop (longer input) or zero padding (shorter)."""
    in_shape, out_shape = ctx.inputs[0].shape, ctx.outputs[0].shape
    src, dst = [], []
    for i, o in zip(in_shape, out_shape):
        src.append(slice((i - o) // 2, (i - o) // 2 + o) if i >= o else slice(None))
        dst.append(slice((o - i) // 2, (o - i) // 2 + i) if o > i else slice(None))
    pads = any(o > i for i, o in zip(in_shape, out_shape))
    src, dst = tuple(src), tuple(dst)

    def run(ins, outs, ws):
        if pads:
            outs[0].fill(0)
        np.copyto(outs[0][dst], ins[0][src])

    return run


def center_crop_pad_vjp(b, node, gys, needed):
    """The adjoint of a centred crop/pad is the centred pad/crop back to the input's shape
    (both start at ``(longer - shorter) // 2``): the same kernel, as a backward op (ONNX's
    CenterCropPad is newer than the opset gradient rules emit)."""
    x = node.inputs[0]
    return first_only(node, b.op("CenterCropPadGrad", [gys[0]], domain=INTERNAL_DOMAIN, like=x))


# ---- gradient rules -------------------------------------------------------------------------


def affine_grid_vjp(b, node, gys, needed):
    """d theta[n] = gy[n]^T @ base (the plan-time homogeneous positions)."""
    theta = node.inputs[0]
    n, *spatial, nd = gys[0].shape
    base = b.const(affine_base_grid(spatial, bool(node.attrs["align_corners"]), theta.dtype))
    gy = b.op("Reshape", [gys[0], b.ints([n, len(base.data), nd])])
    gyt = b.op("Transpose", [gy], {"perm": [0, 2, 1]})
    return first_only(node, b.op("MatMul", [gyt, base], like=theta))


# ---- registration ---------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("AffineGrid", (20,), {"numpy": affine_grid_numpy}, layout=PLAIN_ONLY,
              const_inputs=(1,), differentiable=True, gradient=affine_grid_vjp,
              grad_inputs=DATA_INPUT),
        OpDef("RoiAlign", (10, 16, 22), {"numpy": roi_align_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=roi_align_vjp, grad_inputs=DATA_INPUT,
              doc="avg/max pooling of bilinear samples in boxes; gradient to the map for "
                  "avg (the boxes get none)"),
        OpDef("MaxUnpool", (9, 11, 22), {"numpy": max_unpool_numpy}, layout=PLAIN_ONLY,
              const_inputs=(2,), differentiable=True, gradient=max_unpool_vjp,
              grad_inputs=DATA_INPUT),
        OpDef("Col2Im", (18,), {"numpy": col2im_numpy}, layout=PLAIN_ONLY,
              const_inputs=(1, 2), differentiable=True, gradient=col2im_vjp,
              grad_inputs=DATA_INPUT),
        OpDef("CenterCropPad", (18,), {"numpy": center_crop_pad_numpy},
              layout=STRIDED_TO_PLAIN, const_inputs=(1,), differentiable=True,
              gradient=center_crop_pad_vjp, grad_inputs=DATA_INPUT),
        # backward-only ops of the rules above
        OpDef("CenterCropPadGrad", (1,), {"numpy": center_crop_pad_numpy}, domain=INTERNAL_DOMAIN,
              layout=STRIDED_TO_PLAIN,
              doc="gradient of CenterCropPad: gy centre-cropped/padded to the input's shape"),
        OpDef("RoiAlignGrad", (1,), {"numpy": roi_align_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of an average RoiAlign to its map"),
        OpDef("Col2ImGrad", (1,), {"numpy": col2im_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, const_inputs=(1, 2),
              doc="gradient of Col2Im: im2col of gy"),
    ]
