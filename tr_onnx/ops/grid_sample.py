"""GridSample: linear, nearest and cubic sampling of an N-D feature map at a grid of normalized
coordinates (with AffineGrid, ``ops/spatial_transform.py``, a spatial transformer's two
halves), and its backward op GridSampleGrad.

It follows PyTorch's grid_sampler, as onnx.reference and onnxruntime do: a coordinate
outside the map's bounds is first clamped (border) or reflected (reflection), then each
interpolation tap reads the map with the padding mode applied to its integer index (zeros: 0
outside). Cubic sampling with border padding clamps only the taps, as PyTorch and
onnxruntime do (onnx.reference also clamps the coordinate; no node-suite case tells them
apart, and they differ only for coordinates over half a pixel outside the map).
Forward and backward share one computation of the taps (``_GridTaps``): flat indices
into the map, weights, and the weights' derivatives along each coordinate. The grid's
gradient is zero for nearest sampling and where a border clamp holds the coordinate.

Kernels read compact logical NCHW arrays (``PLAIN_ONLY``): the grid's last axis holds
coordinates, not channels. The taps depend on the grid's values; they are computed each step
into plan-time workspaces, as are the [N, C, positions] gathers and products; GridSampleGrad's
scatter into gx uses ``np.add.at`` (no ``out=``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..host_math import negate
from ..opdef import PLAIN_ONLY, OpDef

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
            negate(dv, dv, where=even)

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


def grid_sample_vjp(b, node, gys, needed):
    """Both gradients from one GridSampleGrad (the taps are computed once)."""
    x, grid = node.inputs
    attrs = {"mode": _MODES[node.attrs["mode"]], "padding_mode": node.attrs["padding_mode"],
             "align_corners": int(node.attrs["align_corners"])}
    gx, ggrid = b.op("GridSampleGrad", [gys[0], x, grid], attrs, domain=INTERNAL_DOMAIN,
                     like=[x, grid])
    return [gx if needed[0] else None, ggrid if needed[1] else None]


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("GridSample", (16, 20, 22), {"numpy": grid_sample_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=grid_sample_vjp, grad_inputs=(0, 1),
              doc="samples x at grid positions: linear/nearest/cubic (v16: bilinear/bicubic, "
                  "4-D only; v20+: N-D), zeros/border/reflection padding; gradients to x "
                  "and grid (zero for nearest)"),
        # backward-only op of the rule above
        OpDef("GridSampleGrad", (1,), {"numpy": grid_sample_grad_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, doc="gradient of GridSample: (gx, ggrid) from gy, x, grid"),
    ]
