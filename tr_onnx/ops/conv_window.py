"""The sliding-window arithmetic and channels-last window views that the convolutions, the
pools, QLinearConv, Col2Im and the CUDA bindings share: ``Window`` resolves a Conv/pool node's
window (pads, strides, dilations, ceil_mode) once; the ``*_nhwc`` helpers pad, gather
(im2col) and scatter (col2im) the windows of an ``[N, *S, C]`` view in plan-time workspaces;
``merged_view``/``as_2d`` see a strided tensor as a matrix without a copy where its strides
allow. It imports no op family, so every family (and ``ops.conv``'s NumPy and oneDNN
variants) builds on it without a cycle.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided


@dataclass(frozen=True)
class Window:
    """A sliding window over the spatial axes ``in_shape`` of a channels-last feature map.

    ``pads_begin``/``pads_end`` are the padding the op defines (explicit or from ``auto_pad``);
    ``padded_shape`` is the extent the windows actually read, which may reach past
    ``pads_end`` when ``ceil_mode`` adds a last, partial window.
    """

    in_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    out_shape: tuple[int, ...]

    @staticmethod
    def resolve(attrs, in_shape, kernel, ceil_mode: bool = False) -> Window:
        """The window from Conv/pool attributes (``auto_pad``, ``pads``, ``strides``,
        ``dilations``; absent ones mean none). Gradient rules call it on the forward node's
        attributes and hand the resolved pads to their backward ops. Raises ValueError for
        what it cannot do (negative pads)."""
        in_shape, kernel = tuple(int(d) for d in in_shape), tuple(int(k) for k in kernel)
        nd = len(in_shape)
        strides = tuple(int(s) for s in attrs.get("strides") or (1,) * nd)
        dilations = tuple(int(d) for d in attrs.get("dilations") or (1,) * nd)
        auto_pad = attrs["auto_pad"]
        spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = [-(-s // st) for s, st in zip(in_shape, strides)]
            total = [max(0, (o - 1) * st + sp - s)
                     for o, st, sp, s in zip(out, strides, spans, in_shape)]
            small = [t // 2 for t in total]
            big = [t - t // 2 for t in total]
            begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            begin = end = [0] * nd
            out = [(s - sp) // st + 1 for s, sp, st in zip(in_shape, spans, strides)]
        else:
            pads = [int(p) for p in attrs.get("pads") or (0,) * (2 * nd)]
            begin, end = pads[:nd], pads[nd:]
            if min(pads, default=0) < 0:
                raise ValueError(f"negative pads {pads} are not supported")
            out = []
            for s, b, e, sp, st in zip(in_shape, begin, end, spans, strides):
                room = s + b + e - sp
                o = (-(-room // st) if ceil_mode else room // st) + 1
                if ceil_mode and (o - 1) * st >= s + b:
                    o -= 1  # the last window must start inside the input or its left padding
                out.append(o)
        return Window(in_shape, kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))

    @staticmethod
    def for_node(ctx, in_shape, kernel, ceil_mode: bool = False, out_shape=None) -> Window:
        """The window of a Conv/pool node (or of a backward op, whose attributes carry the
        forward's resolved window). Checks the window's output shape against ``out_shape``
        (default: the one shape inference gave the node's output 0)."""
        try:
            win = Window.resolve(ctx.attrs, in_shape, kernel, ceil_mode)
        except ValueError as e:
            raise ctx.error(str(e)) from None
        want = tuple(ctx.outputs[0].shape[2:] if out_shape is None else out_shape)
        if win.out_shape != want:
            raise ctx.error(f"window arithmetic gives spatial output {list(win.out_shape)} but "
                            f"shape inference says {list(want)}")
        return win

    def attrs(self) -> dict:
        """The attributes a backward op needs to rebuild this window (explicit pads)."""
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides),
                "dilations": list(self.dilations),
                "pads": list(self.pads_begin) + list(self.pads_end), "auto_pad": "NOTSET"}

    @property
    def ndim(self) -> int:
        return len(self.in_shape)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return tuple(max(b + s, (o - 1) * st + (k - 1) * d + 1)
                     for b, s, o, st, k, d in zip(self.pads_begin, self.in_shape, self.out_shape,
                                                  self.strides, self.kernel, self.dilations))

    @property
    def needs_padding(self) -> bool:
        return any(self.pads_begin) or self.padded_shape != self.in_shape

    @property
    def taps(self) -> list[tuple[int, ...]]:
        """Kernel positions in row-major order (the order ONNX's pools scan a window)."""
        return list(itertools.product(*(range(k) for k in self.kernel)))

    def tap_slices_nhwc(self) -> list[tuple[slice, ...]]:
        """Per tap, the slice of the padded ``[N, *S_padded, C]`` input it reads for every
        output position at once."""
        return [(slice(None),) + tuple(
            slice(t * d, t * d + (o - 1) * st + 1, st)
            for t, d, o, st in zip(tap, self.dilations, self.out_shape, self.strides))
            + (slice(None),) for tap in self.taps]

    def tap_positions(self, axis: int) -> np.ndarray:
        """``[out, kernel]`` input coordinates (unpadded, may be outside) along ``axis``."""
        o = np.arange(self.out_shape[axis])[:, None] * self.strides[axis]
        k = np.arange(self.kernel[axis])[None, :] * self.dilations[axis]
        return o + k - self.pads_begin[axis]


def padding_slabs_nhwc(win: Window) -> tuple[tuple[slice, ...], list[tuple[slice, ...]]]:
    """(interior, border slabs) of the padded ``[N, *padded, C]`` workspace: the input goes to
    the interior, the fill value to the slabs (they cover everything else, corners twice)."""
    interior = (slice(None),) + tuple(slice(b, b + s) for b, s in zip(win.pads_begin,
                                                                      win.in_shape)) \
        + (slice(None),)
    slabs = []
    for axis, (b, s, p) in enumerate(zip(win.pads_begin, win.in_shape, win.padded_shape)):
        lead = (slice(None),) * (axis + 1)
        if b:
            slabs.append(lead + (slice(0, b),))
        if p > b + s:
            slabs.append(lead + (slice(b + s, p),))
    return interior, slabs


def pad_nhwc(x_nhwc: np.ndarray, xp: np.ndarray, interior, slabs, fill) -> np.ndarray:
    """Copy ``x_nhwc`` into the workspace ``xp`` and fill its borders; returns ``xp``."""
    for slab in slabs:
        xp[slab] = fill
    np.copyto(xp[interior], x_nhwc)
    return xp


def windows_nhwc(xp: np.ndarray, win: Window) -> np.ndarray:
    """Read-only ``[N, *S_out, *K, C]`` view of every window of the padded ``[N, *Sp, C]``."""
    sn, *ss, sc = xp.strides
    shape = (xp.shape[0], *win.out_shape, *win.kernel, xp.shape[-1])
    strides = (sn, *(a * st for a, st in zip(ss, win.strides)),
               *(a * d for a, d in zip(ss, win.dilations)), sc)
    return as_strided(xp, shape, strides, writeable=False)


def im2col_nhwc(xp: np.ndarray, win: Window, col: np.ndarray) -> np.ndarray:
    """Gather the windows of ``xp`` ``[N, *Sp, C]`` into the contiguous workspace ``col``
    ``[N*prod(S_out), prod(K)*C]`` (rows: output positions, columns: (tap, channel))."""
    np.copyto(col.reshape((xp.shape[0], *win.out_shape, *win.kernel, xp.shape[-1])),
              windows_nhwc(xp, win))
    return col


def col2im_slices_nhwc(win: Window, channels: slice = slice(None)) -> list[tuple]:
    """Per tap, (slice of the padded ``[N, *Sp, C]`` buffer, slice of the ``[N, *S_out, *K, C']``
    columns) for ``col2im_nhwc``; ``channels`` selects the buffer's channels (one group)."""
    lead = (slice(None),) * (1 + win.ndim)
    return [(dst[:-1] + (channels,), lead + tap)
            for dst, tap in zip(win.tap_slices_nhwc(), win.taps)]


def col2im_nhwc(cols: np.ndarray, xp: np.ndarray, scatter: list[tuple]) -> np.ndarray:
    """The adjoint of ``im2col_nhwc``: add every window of ``cols`` ``[N, *S_out, *K, C]`` back
    into the padded ``xp`` (not cleared here). One tap never hits a position twice, so each
    tap is one in-place add; ``scatter`` comes from ``col2im_slices_nhwc``."""
    for dst, src in scatter:
        d = xp[dst]
        np.add(d, cols[src], out=d)
    return xp


def merged_stride(shape, strides) -> int | None:
    """The common stride when the axes can be merged into one (size-1 axes ignored)."""
    inner = None
    for d, st in zip(reversed(shape), reversed(strides)):
        if d == 1:
            continue
        if inner is not None and st != inner[0] * inner[1]:
            return None
        if inner is None:
            inner = (st, d)
        else:
            inner = (inner[0], inner[1] * d)
    return inner[0] if inner is not None else 0


def merged_view(a: np.ndarray, splits: tuple[int, ...]) -> np.ndarray | None:
    """``a`` without a copy as one axis per group of consecutive axes, the groups split at
    ``splits`` (an empty group is an axis of 1), or None where a group's strides do not merge."""
    bounds = (0, *splits, a.ndim)
    groups = [(a.shape[lo:hi], a.strides[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    strides = [merged_stride(shape, st) for shape, st in groups]
    if any(st is None for st in strides):
        return None
    return as_strided(a, tuple(math.prod(shape) for shape, _ in groups), tuple(strides))


def as_2d(a: np.ndarray, split: int) -> np.ndarray | None:
    """``a`` seen as ``[prod(shape[:split]), prod(shape[split:])]`` without a copy, or None."""
    return merged_view(a, (split,))


def mergeable_2d(info, moved: bool, split: int) -> bool:
    """Whether a tensor's kernel view (``moved``: after ``channels_last_view(v)``) can be seen
    as a matrix split at ``split`` without a copy; decided at plan time from its layout."""
    strides = info.layout.view_strides(np.dtype(info.dtype).itemsize)
    shape = tuple(info.shape)
    if moved:
        shape = (shape[0], *shape[2:], shape[1])
        strides = (strides[0], *strides[2:], strides[1])
    return merged_stride(shape[:split], strides[:split]) is not None and \
        merged_stride(shape[split:], strides[split:]) is not None


def matrix_view_or_copy(a: np.ndarray, split: int, ws: np.ndarray | None) -> np.ndarray:
    """``a`` as a matrix: a view when its strides allow (``ws`` None), else copied into ``ws``."""
    if ws is None:
        return as_2d(a, split)
    np.copyto(ws.reshape(a.shape), a)
    return ws


def channel_groups(group: int, cg: int, og: int) -> list[tuple[slice, slice]]:
    """(input channels, output channels) of each group."""
    return [(slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)) for g in range(group)]
