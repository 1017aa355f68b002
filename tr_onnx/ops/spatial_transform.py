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

Allocation: GridSample's taps depend on the grid's values; they are computed each step into
plan-time workspaces, as are its [N, C, positions] gathers and products. RoiAlign's sampling
depends on the box values and allocates per box; MaxUnpool's and GridSampleGrad's scatters
use ``np.put``/``np.add.at`` (no ``out=``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, STRIDED_TO_PLAIN, OpDef
from .conv_window import Window, col2im_nhwc, col2im_slices_nhwc, windows_nhwc
from .tensor import DATA_INPUT, first_only

# ---- GridSample's sampling arithmetic -------------------------------------------------------

_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic",
          "nearest": "nearest"}  # v16 names -> v20 names
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75  # Keys' cubic convolution constant, as ONNX and PyTorch use


def sample_attrs(ctx) -> tuple[str, str, bool]:
    mode = _MODES.get(ctx.attrs["mode"])
    padding = ctx.attrs["padding_mode"]
    if mode is None or padding not in _PADDINGS:
        raise ctx.error(f"mode {ctx.attrs['mode']!r} / padding_mode {padding!r} unknown "
                        f"(valid: {sorted(_MODES)} / {list(_PADDINGS)})")
    return mode, padding, bool(ctx.attrs["align_corners"])


def _keys_weights(t, out, s):
    """Cubic convolution weights of the taps at floor-1 .. floor+2 for fraction ``t``, into
    the four arrays ``out`` (``s`` is scratch)."""
    a = _CUBIC_A
    for k, (shift, sign) in enumerate(((1, 1), (0, 1), (1, -1), (2, -1))):
        np.multiply(t, sign, out=s)
        s += shift  # |distance| of tap k: t + 1, t, 1 - t, 2 - t
        w = out[k]
        if k in (0, 3):  # a s^3 - 5a s^2 + 8a s - 4a
            np.multiply(s, a, out=w)
            w -= 5 * a
            w *= s
            w += 8 * a
            w *= s
            w -= 4 * a
        else:  # (a + 2) s^3 - (a + 3) s^2 + 1
            np.multiply(s, a + 2, out=w)
            w -= a + 3
            w *= s
            w *= s
            w += 1


def _keys_slopes(t, out, s):
    """d/dt of ``_keys_weights``, into the four arrays ``out``."""
    a = _CUBIC_A
    for k, (shift, sign) in enumerate(((1, 1), (0, 1), (1, -1), (2, -1))):
        np.multiply(t, sign, out=s)
        s += shift
        w = out[k]
        if k in (0, 3):  # d/ds: 3a s^2 - 10a s + 8a
            np.multiply(s, 3 * a, out=w)
            w -= 10 * a
            w *= s
            w += 8 * a
        else:  # d/ds: 3(a + 2) s^2 - 2(a + 3) s
            np.multiply(s, 3 * (a + 2), out=w)
            w -= 2 * (a + 3)
            w *= s
        w *= sign  # ds/dt


class _GridTaps:
    """GridSample's taps over a ``[N, Q, nd]`` grid (``grid[..., j]`` addresses spatial axis
    ``nd - 1 - j``), computed each step into plan-time workspaces (the taps depend on the
    grid's values). ``taps`` yields, per combination of one tap per axis, the flat index into
    the map ``[N, Q]``, its weight and (``slopes``) d weight / d coordinate per axis; the
    arrays are reused, so each is read before the next is yielded. ``dus[d]``: d coordinate /
    d grid value along axis d (zero where a border clamp holds the coordinate)."""

    def __init__(self, ctx, n: int, q: int, spatial, dtype):
        self.mode, self.padding, self.align = sample_attrs(ctx)
        self.spatial, self.nd = tuple(spatial), len(spatial)
        k = {"nearest": 1, "linear": 2, "cubic": 4}[self.mode]
        self.k = k
        # float32 at least: float16 coordinates would misplace samples on wide maps
        self.dtype = np.promote_types(dtype, np.float32)
        self.rows_f = self.nd * (2 + 2 * k) + 5 + self.nd + 1  # see ``_views``
        self.rows_i = self.nd * k + 2
        self.shape = (n, q)
        self.ws = (ctx.workspace((self.rows_f, n, q), self.dtype),
                   ctx.workspace((self.rows_i, n, q), np.int64),
                   ctx.workspace((4, n, q), np.bool_))

    def _views(self, ws):
        f, i, b = (ws[j] for j in self.ws)
        nd, k = self.nd, self.k
        per = 2 + 2 * k  # u, du, weights, slopes per axis
        axes = [(f[a * per], f[a * per + 1], f[a * per + 2:a * per + 2 + k],
                 f[a * per + 2 + k:a * per + 2 + 2 * k], i[a * k:(a + 1) * k])
                for a in range(nd)]
        rest = nd * per
        tmp = f[rest:rest + 5]
        weight, dws = f[rest + 5], f[rest + 6:rest + 6 + nd]
        return axes, tmp, weight, dws, i[nd * k], i[nd * k + 1], b

    def _reflect(self, v, lo, hi, tmp, b, dv=None):
        """``v`` reflected in place by the near border until it lies in [lo, hi]
        (``onnx.reference``'s ``_gs_reflect``); ``dv`` times d reflected / d v (-1 or +1)."""
        span = hi - lo
        below, outside, even, lo_side = b
        if span <= 0:  # a one-pixel axis with corners aligned: every position is that pixel
            v.fill(lo)
            if dv is not None:
                dv.fill(0)
            return
        np.less(v, lo, out=below)
        np.greater(v, hi, out=outside)
        np.logical_or(below, outside, out=outside)
        dist, bounces, value = tmp[0], tmp[1], tmp[2]
        np.subtract(v, hi, out=dist)
        np.subtract(lo, v, out=value)
        np.copyto(dist, value, where=below)
        np.divide(dist, span, out=bounces)
        np.floor(bounces, out=bounces)
        np.multiply(bounces, span, out=value)
        np.subtract(dist, value, out=dist)  # what is left after the whole bounces
        np.remainder(bounces, 2, out=bounces)
        np.equal(bounces, 0, out=even)
        np.equal(even, below, out=lo_side)  # ends measured from lo: even below, odd above
        np.subtract(hi, dist, out=value)
        np.add(dist, lo, out=dist)
        np.copyto(value, dist, where=lo_side)
        np.copyto(v, value, where=outside)
        if dv is not None:
            np.logical_and(outside, even, out=even)
            np.negative(dv, out=dv, where=even)

    def _axis(self, g, length, axis, tmp, b, slopes):
        u, du, weights, dweights, idx = axis
        lo, hi = (0.0, length - 1.0) if self.align else (-0.5, length - 0.5)
        scale = (length - 1) / 2.0 if self.align else length / 2.0
        np.copyto(u, g)  # first, so float16 grids are computed on in float32
        u += 1
        if self.align:
            u *= scale
        else:
            u *= length
            u -= 1
            u *= 0.5
        du.fill(scale)
        if self.mode == "nearest":
            np.rint(u, out=u)  # half to even, as PyTorch and onnx.reference
        if self.padding == "border" and self.mode != "cubic":
            # cubic clamps each tap instead (PyTorch and onnxruntime; onnx.reference also
            # clamps the coordinate, which differs once it is half a pixel outside)
            outside, high = b[0], b[1]
            np.less(u, lo, out=outside)
            np.greater(u, hi, out=high)
            np.logical_or(outside, high, out=outside)
            np.clip(u, 0, length - 1, out=tmp[0])
            np.copyto(u, tmp[0], where=outside)
            np.copyto(du, 0, where=outside)
        elif self.padding == "reflection":
            self._reflect(u, lo, hi, tmp, b, du)
        frac = tmp[3]
        if self.mode == "nearest":
            np.copyto(idx[0], u, casting="unsafe")  # integral already: truncation is exact
            weights[0].fill(1)
            dweights[0].fill(0)
            offsets = (0,)
        else:
            np.floor(u, out=frac)
            np.copyto(idx[0], frac, casting="unsafe")
            np.subtract(u, frac, out=frac)
            if self.mode == "linear":
                offsets = (0, 1)
                np.subtract(1, frac, out=weights[0])
                np.copyto(weights[1], frac)
                dweights[0].fill(-1)
                dweights[1].fill(1)
            else:
                offsets = (-1, 0, 1, 2)
                _keys_weights(frac, weights, tmp[4])
                if slopes:
                    _keys_slopes(frac, dweights, tmp[4])
        first = idx[0]
        for k in reversed(range(len(offsets))):  # idx[0] holds the floor until the last
            i, w, dw = idx[k], weights[k], dweights[k]
            np.add(first, offsets[k], out=i)
            if self.padding == "zeros":
                valid, invalid = b[0], b[1]
                np.greater_equal(i, 0, out=valid)
                np.less(i, length, out=invalid)
                np.logical_and(valid, invalid, out=valid)
                np.logical_not(valid, out=invalid)
                np.copyto(i, 0, where=invalid)
                np.copyto(w, 0, where=invalid)
                np.copyto(dw, 0, where=invalid)
            elif self.padding == "border":
                np.clip(i, 0, length - 1, out=i)
            else:
                np.copyto(tmp[3], i, casting="unsafe")
                self._reflect(tmp[3], lo, hi, tmp, b)
                np.copyto(i, tmp[3], casting="unsafe")

    def taps(self, grid, ws, slopes=False):
        """(per-tap iterator of (flat index, weight, d weight per axis or None), dus)."""
        axes, tmp, weight, dws, flat, scratch, b = self._views(ws)
        nd = self.nd
        for d in range(nd):
            self._axis(grid[..., nd - 1 - d], self.spatial[d], axes[d], tmp, b, slopes)
        strides = [math.prod(self.spatial[d + 1:]) for d in range(nd)]
        with_slopes = slopes and self.mode != "nearest"

        def combos():
            for combo in itertools.product(range(self.k), repeat=nd):
                flat.fill(0)
                weight.fill(1)
                for d, k in enumerate(combo):
                    np.multiply(axes[d][4][k], strides[d], out=scratch)
                    np.add(flat, scratch, out=flat)
                    np.multiply(weight, axes[d][2][k], out=weight)
                if with_slopes:
                    for d in range(nd):
                        np.copyto(dws[d], axes[d][3][combo[d]])
                        for e, k in enumerate(combo):
                            if e != d:
                                dws[d] *= axes[e][2][k]
                yield flat, weight, dws if with_slopes else None

        return combos(), [axes[d][1] for d in range(nd)]


def _gather(xf: np.ndarray, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[n, c, q] = xf[n, c, flat[n, q]]`` into the workspace ``out`` (indices in range)."""
    for n in range(xf.shape[0]):
        np.take(xf[n], flat[n], axis=1, out=out[n], mode="clip")
    return out


def grid_sample_numpy(ctx):
    """GridSample: ``y[n, c, *o] = sum over taps of weight * x[n, c, tap]`` at the positions
    ``grid[n, *o]`` (normalized to [-1, 1], last axis in reversed spatial order)."""
    n, c, *spatial = ctx.inputs[0].shape
    if ctx.since_version < 20 and len(spatial) != 2:
        raise ctx.error(f"GridSample-{ctx.since_version} samples 4-D inputs only, got rank "
                        f"{len(spatial) + 2} (N-D sampling is GridSample-20)")
    q = math.prod(ctx.outputs[0].shape[2:])
    nd, p = len(spatial), math.prod(spatial)
    taps = _GridTaps(ctx, n, q, spatial, ctx.outputs[0].dtype)
    buf = ctx.workspace((n, c, q), ctx.outputs[0].dtype)

    def run(ins, outs, ws):
        x, grid, y = ins[0].reshape(n, c, p), ins[1].reshape(n, q, nd), outs[0].reshape(n, c, q)
        y.fill(0)
        combos, _ = taps.taps(grid, ws)
        for flat, weight, _ in combos:
            vals = _gather(x, flat, ws[buf])
            np.multiply(vals, weight[:, None, :], out=vals)
            np.add(y, vals, out=y)

    return run


def grid_sample_grad_numpy(ctx):
    """GridSampleGrad(gy, x, grid) -> (gx, ggrid): gx scatter-adds ``weight * gy`` at each
    tap; ggrid sums ``gy * x[tap] * d weight / d coordinate`` over channels and taps, times
    d coordinate / d grid. Attributes are the forward's (mode in v20 names)."""
    n, c, *spatial = ctx.inputs[1].shape
    q = math.prod(ctx.inputs[0].shape[2:])
    nd, p = len(spatial), math.prod(spatial)
    dtype = ctx.inputs[0].dtype
    taps = _GridTaps(ctx, n, q, spatial, dtype)
    buf, dot = ctx.workspace((n, c, q), dtype), ctx.workspace((n, q), dtype)
    acc = ctx.workspace((nd, n, q), dtype)

    def run(ins, outs, ws):
        gy, x, grid = ins[0].reshape(n, c, q), ins[1].reshape(n, c, p), ins[2].reshape(n, q, nd)
        gx = outs[0].reshape(n, c, p) if outs[0] is not None else None
        combos, dus = taps.taps(grid, ws, slopes=True)
        if gx is not None:
            gx.fill(0)
        ws[acc].fill(0)
        for flat, weight, dws in combos:
            if gx is not None:
                np.multiply(gy, weight[:, None, :], out=ws[buf])
                for b in range(n):  # repeated positions accumulate: add.at, per batch item
                    np.add.at(gx[b].T, flat[b], ws[buf][b].T)
            if dws is not None:
                vals = _gather(x, flat, ws[buf])
                np.einsum("ncq,ncq->nq", vals, gy, out=ws[dot])
                for d in range(nd):
                    dws[d] *= ws[dot]  # the combination's own scratch: rebuilt for the next
                    ws[acc][d] += dws[d]
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


def grid_sample_vjp(b, node, gys, needed):
    """Both gradients from one GridSampleGrad (the taps are computed once)."""
    x, grid = node.inputs
    attrs = {"mode": _MODES[node.attrs["mode"]], "padding_mode": node.attrs["padding_mode"],
             "align_corners": int(node.attrs["align_corners"])}
    gx, ggrid = b.op("GridSampleGrad", [gys[0], x, grid], attrs, domain=INTERNAL_DOMAIN,
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
        OpDef("GridSampleGrad", (1,), {"numpy": grid_sample_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of GridSample: (gx, ggrid) from gy, x, grid"),
        OpDef("CenterCropPadGrad", (1,), {"numpy": center_crop_pad_numpy}, domain=INTERNAL_DOMAIN,
              layout=STRIDED_TO_PLAIN,
              doc="gradient of CenterCropPad: gy centre-cropped/padded to the input's shape"),
        OpDef("RoiAlignGrad", (1,), {"numpy": roi_align_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of an average RoiAlign to its map"),
        OpDef("Col2ImGrad", (1,), {"numpy": col2im_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, const_inputs=(1, 2),
              doc="gradient of Col2Im: im2col of gy"),
    ]
