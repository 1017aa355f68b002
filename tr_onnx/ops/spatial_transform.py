"""Spatial transforms: ops that resample a feature map at computed positions. GridSample
(linear, nearest and cubic sampling of an N-D map at a grid of normalized coordinates) and
AffineGrid (the grid of an affine transform: a spatial transformer's two halves), RoiAlign,
MaxUnpool, Col2Im and CenterCropPad, with the backward ops GridSampleGrad, RoiAlignGrad,
Col2ImGrad and CenterCropPadGrad.

GridSample follows PyTorch's grid_sampler, as onnx.reference and onnxruntime do: a coordinate
outside the map's bounds is first clamped (border) or reflected (reflection), then each
interpolation tap reads the map with the padding mode applied to its integer index (zeros: 0
outside). Cubic sampling with border padding clamps only the taps, as PyTorch and
onnxruntime do (onnx.reference also clamps the coordinate; no node-suite case tells them
apart, and they differ only for coordinates over half a pixel outside the map).
Its forward and backward share one computation of the taps (``_grid_taps``): flat indices
into the map, weights, and the weights' derivatives along each coordinate. The grid's
gradient is zero for nearest sampling and where a border clamp holds the coordinate.

Kernels read compact logical NCHW arrays (``PLAIN_ONLY``: the layout pass converts
channels-last maps): the grid's last axis holds coordinates, not channels, and RoiAlign,
MaxUnpool and Col2Im address pixels by flat index. Col2Im reuses Conv's window arithmetic
(``Window``, ``col2im_nhwc``) on a channels-last view of its columns.

Allocation: GridSample's taps depend on the grid's values, so their indices and weights
(grid-sized, per tap) are computed each step; the [N, C, positions] gathers and products go
through workspaces. RoiAlign's sampling depends on the box values and allocates per box;
MaxUnpool's and GridSampleGrad's scatters use ``np.put``/``np.add.at`` (no ``out=``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, STRIDED_TO_PLAIN, OpDef
from .conv import Window, col2im_nhwc, col2im_slices_nhwc, windows_nhwc
from .tensor import DATA_INPUT, INTERNAL, first_only

# ---- GridSample's sampling arithmetic -------------------------------------------------------

_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic",
          "nearest": "nearest"}  # v16 names -> v20 names
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75  # Keys' cubic convolution constant, as ONNX and PyTorch use


def _keys_weights(t: np.ndarray) -> list[np.ndarray]:
    """Cubic convolution weights of the taps at floor-1 .. floor+2 for fraction ``t``."""
    a = _CUBIC_A
    s0, s2, s3 = t + 1, 1 - t, 2 - t
    return [((a * s0 - 5 * a) * s0 + 8 * a) * s0 - 4 * a,
            ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * s2 - (a + 3)) * s2 * s2 + 1,
            ((a * s3 - 5 * a) * s3 + 8 * a) * s3 - 4 * a]


def _keys_slopes(t: np.ndarray) -> list[np.ndarray]:
    """d/dt of ``_keys_weights``."""
    a = _CUBIC_A
    s0, s2, s3 = t + 1, 1 - t, 2 - t
    return [(3 * a * s0 - 10 * a) * s0 + 8 * a,
            (3 * (a + 2) * t - 2 * (a + 3)) * t,
            -(3 * (a + 2) * s2 - 2 * (a + 3)) * s2,
            -((3 * a * s3 - 10 * a) * s3 + 8 * a)]


def _reflect(x: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """``x`` reflected by the near border until it lies in [lo, hi] (``onnx.reference``'s
    ``_gs_reflect``), and dx'/dx (+1 or -1)."""
    span = hi - lo
    if span <= 0:  # a one-pixel axis with corners aligned: every position is that pixel
        return np.full_like(x, lo), np.zeros_like(x)
    below = x < lo
    dist = np.where(below, lo - x, x - hi)
    bounces = np.floor(dist / span)
    rest = dist - bounces * span
    even = bounces % 2 == 0
    near, far = np.where(below, lo, hi), np.where(below, hi, lo)
    toward = np.where(below, 1.0, -1.0)  # the direction from the near border inwards
    out = np.where(even, near + toward * rest, far - toward * rest)
    slope = np.where(even, -1.0, 1.0)
    inside = (x >= lo) & (x <= hi)
    return np.where(inside, x, out), np.where(inside, 1.0, slope)


def _axis_taps(g, length: int, mode: str, padding: str, align: bool, slopes: bool):
    """One spatial axis: normalized coordinates ``g`` -> (per tap (index, weight, slope),
    d coordinate / d g). Out-of-range taps get weight 0 (zeros) or a clamped/reflected index;
    slopes (d weight / d coordinate) only when asked."""
    lo, hi = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    scale = (length - 1) / 2.0 if align else length / 2.0
    u = (g + 1) * scale if align else ((g + 1) * length - 1) / 2.0
    du = np.full_like(u, scale)
    if mode == "nearest":
        u = np.rint(u)  # half to even, as PyTorch and onnx.reference
    outside = (u < lo) | (u > hi)
    if padding == "border" and mode != "cubic":
        # cubic clamps each tap instead (PyTorch and onnxruntime; onnx.reference clamps the
        # coordinate, which differs once it is half a pixel outside)
        u = np.where(outside, np.clip(u, 0, length - 1), u)
        du = np.where(outside, 0.0, du)
    elif padding == "reflection":
        u, sign = _reflect(u, lo, hi)
        du = du * sign
    if mode == "nearest":
        base = u.astype(np.int64)
        offsets, weights, dweights = (0,), [np.ones_like(u)], [np.zeros_like(u)]
    else:
        base = np.floor(u)
        t = u - base
        base = base.astype(np.int64)
        if mode == "linear":
            offsets, weights = (0, 1), [1 - t, t]
            dweights = [np.full_like(t, -1.0), np.ones_like(t)] if slopes else None
        else:
            offsets, weights = (-1, 0, 1, 2), _keys_weights(t)
            dweights = _keys_slopes(t) if slopes else None
    taps = []
    for k, off in enumerate(offsets):
        i = base + off
        w, dw = weights[k], dweights[k] if dweights is not None else None
        if padding == "zeros":
            valid = (i >= 0) & (i < length)
            i = np.where(valid, i, 0)
            w = w * valid
            dw = dw * valid if dw is not None else None
        elif padding == "border":
            i = np.clip(i, 0, length - 1)
        else:
            i = _reflect(i.astype(u.dtype), lo, hi)[0].astype(np.int64)
        taps.append((i, w, dw))
    return taps, du


def _grid_taps(grid: np.ndarray, spatial, mode, padding, align, slopes=False):
    """The taps of GridSample over a ``[N, Q, nd]`` grid (``grid[..., j]`` addresses spatial
    axis ``nd - 1 - j``): a list of (flat index [N, Q], weight [N, Q], per-axis d weight / d
    coordinate or None), and per axis d coordinate / d grid value."""
    nd = len(spatial)
    # float16 coordinates would misplace samples by up to a pixel on a 2048-wide map:
    # positions are computed in float32 at least, as onnxruntime does
    grid = grid.astype(np.promote_types(grid.dtype, np.float32), copy=False)
    strides = [math.prod(spatial[d + 1:]) for d in range(nd)]
    per_axis, dus = [], []
    for d in range(nd):
        taps, du = _axis_taps(grid[..., nd - 1 - d], spatial[d], mode, padding, align, slopes)
        per_axis.append(taps)
        dus.append(du)
    out = []
    for combo in itertools.product(*per_axis):
        flat = sum(i * s for (i, _, _), s in zip(combo, strides))
        weight = math.prod(w for _, w, _ in combo)
        dws = None
        if slopes and mode != "nearest":
            dws = [math.prod(dw if e == d else w for e, (_, w, dw) in enumerate(combo))
                   for d in range(nd)]
        out.append((flat, weight, dws))
    return out, dus


def _sample_attrs(ctx) -> tuple[str, str, bool]:
    mode = _MODES.get(ctx.attrs["mode"])
    padding = ctx.attrs["padding_mode"]
    if mode is None or padding not in _PADDINGS:
        raise ctx.error(f"mode {ctx.attrs['mode']!r} / padding_mode {padding!r} unknown "
                        f"(valid: {sorted(_MODES)} / {list(_PADDINGS)})")
    return mode, padding, bool(ctx.attrs["align_corners"])


def _gather(xf: np.ndarray, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[n, c, q] = xf[n, c, flat[n, q]]`` into the workspace ``out`` (indices in range)."""
    for n in range(xf.shape[0]):
        np.take(xf[n], flat[n], axis=1, out=out[n], mode="clip")
    return out


def grid_sample_numpy(ctx):
    """GridSample: ``y[n, c, *o] = sum over taps of weight * x[n, c, tap]`` at the positions
    ``grid[n, *o]`` (normalized to [-1, 1], last axis in reversed spatial order)."""
    mode, padding, align = _sample_attrs(ctx)
    n, c, *spatial = ctx.inputs[0].shape
    if ctx.since_version < 20 and len(spatial) != 2:
        raise ctx.error(f"GridSample-{ctx.since_version} samples 4-D inputs only, got rank "
                        f"{len(spatial) + 2} (N-D sampling is GridSample-20)")
    q = math.prod(ctx.outputs[0].shape[2:])
    nd, p = len(spatial), math.prod(spatial)
    buf = ctx.workspace((n, c, q), ctx.outputs[0].dtype)

    def run(ins, outs, ws):
        x, grid, y = ins[0].reshape(n, c, p), ins[1].reshape(n, q, nd), outs[0].reshape(n, c, q)
        y.fill(0)
        taps, _ = _grid_taps(grid, spatial, mode, padding, align)
        for flat, weight, _ in taps:
            vals = _gather(x, flat, ws[buf])
            np.multiply(vals, weight[:, None, :], out=vals)
            np.add(y, vals, out=y)

    return run


def grid_sample_grad_numpy(ctx):
    """GridSampleGrad(gy, x, grid) -> (gx, ggrid): gx scatter-adds ``weight * gy`` at each
    tap; ggrid sums ``gy * x[tap] * d weight / d coordinate`` over channels and taps, times
    d coordinate / d grid. Attributes are the forward's (mode in v20 names)."""
    mode, padding, align = _sample_attrs(ctx)
    n, c, *spatial = ctx.inputs[1].shape
    q = math.prod(ctx.inputs[0].shape[2:])
    nd, p = len(spatial), math.prod(spatial)
    buf = ctx.workspace((n, c, q), ctx.inputs[0].dtype)
    dot = ctx.workspace((n, q), ctx.inputs[0].dtype)
    acc = ctx.workspace((nd, n, q), ctx.inputs[0].dtype)

    def run(ins, outs, ws):
        gy, x, grid = ins[0].reshape(n, c, q), ins[1].reshape(n, c, p), ins[2].reshape(n, q, nd)
        gx = outs[0].reshape(n, c, p) if outs[0] is not None else None
        taps, dus = _grid_taps(grid, spatial, mode, padding, align, slopes=True)
        if gx is not None:
            gx.fill(0)
        ws[acc].fill(0)
        for flat, weight, dws in taps:
            if gx is not None:
                np.multiply(gy, weight[:, None, :], out=ws[buf])
                for b in range(n):  # repeated positions accumulate: add.at, per batch item
                    np.add.at(gx[b].T, flat[b], ws[buf][b].T)
            if dws is not None:
                vals = _gather(x, flat, ws[buf])
                np.einsum("ncq,ncq->nq", vals, gy, out=ws[dot])
                for d in range(nd):
                    ws[acc][d] += ws[dot] * dws[d]
        if outs[1] is not None:
            g = outs[1].reshape(n, q, nd)
            for d in range(nd):
                np.multiply(ws[acc][d], dus[d], out=g[..., nd - 1 - d])

    return run


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
                                 domain=INTERNAL, like=x))


# ---- MaxUnpool ------------------------------------------------------------------------------


def _unpool_shape_of(x_shape, attrs) -> tuple[int, ...]:
    kernel = [int(k) for k in attrs["kernel_shape"]]
    nd = len(kernel)
    strides = [int(s) for s in attrs.get("strides") or [1] * nd]
    pads = [int(p) for p in attrs.get("pads") or [0] * (2 * nd)]
    return tuple(x_shape[:2]) + tuple((s - 1) * st - pads[i] - pads[nd + i] + k for i, (s, st, k)
                                      in enumerate(zip(x_shape[2:], strides, kernel)))


def max_unpool_numpy(ctx):
    """MaxUnpool: ``y.flat[indices] = x`` over the window-given shape; an ``output_shape``
    input larger than that puts it in the leading corner (onnx.reference), the rest 0."""
    full = _unpool_shape_of(ctx.inputs[0].shape, ctx.attrs)
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
    full = _unpool_shape_of(x.shape, node.attrs)
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


def _col2im_plan(ctx, cols_shape, image_shape, block_shape):
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
    win, c = _col2im_plan(ctx, ctx.inputs[0].shape, ctx.const(1), ctx.const(2))
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
    win, c = _col2im_plan(ctx, ctx.outputs[0].shape, ctx.const(1), ctx.const(2))
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
             domain=INTERNAL, like=cols)
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
    return first_only(node, b.op("CenterCropPadGrad", [gys[0]], domain=INTERNAL, like=x))


# ---- gradient rules -------------------------------------------------------------------------


def grid_sample_vjp(b, node, gys, needed):
    """Both gradients from one GridSampleGrad (the taps are computed once)."""
    x, grid = node.inputs
    attrs = {"mode": _MODES[node.attrs["mode"]], "padding_mode": node.attrs["padding_mode"],
             "align_corners": int(node.attrs["align_corners"])}
    gx, ggrid = b.op("GridSampleGrad", [gys[0], x, grid], attrs, domain=INTERNAL,
                     like=[x, grid])
    return [gx if needed[0] else None, ggrid if needed[1] else None]


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
        OpDef("GridSample", (16, 20, 22), {"numpy": grid_sample_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=grid_sample_vjp, grad_inputs=(0, 1),
              doc="samples x at grid positions: linear/nearest/cubic (v16: bilinear/bicubic, "
                  "4-D only; v20+: N-D), zeros/border/reflection padding; gradients to x "
                  "and grid (zero for nearest)"),
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
        OpDef("GridSampleGrad", (1,), {"numpy": grid_sample_grad_numpy}, domain=INTERNAL,
              layout=PLAIN_ONLY, doc="gradient of GridSample: (gx, ggrid) from gy, x, grid"),
        OpDef("CenterCropPadGrad", (1,), {"numpy": center_crop_pad_numpy}, domain=INTERNAL,
              layout=STRIDED_TO_PLAIN,
              doc="gradient of CenterCropPad: gy centre-cropped/padded to the input's shape"),
        OpDef("RoiAlignGrad", (1,), {"numpy": roi_align_grad_numpy}, domain=INTERNAL,
              layout=PLAIN_ONLY, doc="gradient of an average RoiAlign to its map"),
        OpDef("Col2ImGrad", (1,), {"numpy": col2im_grad_numpy}, domain=INTERNAL,
              layout=PLAIN_ONLY, const_inputs=(1, 2),
              doc="gradient of Col2Im: im2col of gy"),
    ]
