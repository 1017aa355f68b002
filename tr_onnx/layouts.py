"""Physical layouts: how a value's logical (ONNX, NCHW) tensor sits in arena memory.

Two kinds exist:

* ``StridedLayout`` -- a permutation of the logical axes, with some physical axes padded
  (channels-last feature maps ``[N, *S, Cp]``, conv weights ``[Op, *K, Ip]``). The logical
  tensor is a strided view of the physical buffer, so a kernel may read it in ONNX axis order
  and padded lanes are never touched (they stay zero from arena creation).
* ``GatherRowsLayout`` -- one axis whose physical positions are a permutation of the logical
  ones, with ``-1`` for zero rows. A feature map flattened for a Gemm/MatMul keeps its
  physical (h, w, c) element order this way, and the Gemm's weight gets the same row order,
  so no runtime transpose is needed.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import numpy as np


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def compact_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class StridedLayout:
    """Physical axis ``i`` holds logical axis ``perm[i]``, padded to ``phys_shape[i]``."""

    shape: tuple[int, ...]
    perm: tuple[int, ...]
    phys_shape: tuple[int, ...]
    kind: str = "plain"  # "plain" | "channels_last" | "conv_weight" | "channel_vector"

    @staticmethod
    def plain(shape) -> StridedLayout:
        shape = tuple(shape)
        return StridedLayout(shape, tuple(range(len(shape))), shape)

    @staticmethod
    def channels_last(shape, align: int) -> StridedLayout:
        """``[N, C, *S]`` -> physical ``[N, *S, round_up(C, align)]``."""
        shape = tuple(shape)
        perm = (0, *range(2, len(shape)), 1)
        phys = tuple(shape[p] for p in perm[:-1]) + (round_up(shape[1], align),)
        return StridedLayout(shape, perm, phys, "channels_last")

    @staticmethod
    def conv_weight(shape, align: int, pad_in: bool) -> StridedLayout:
        """``[O, I/g, *K]`` -> physical ``[Op, *K, Ip]`` (OHWI); I is padded for groups == 1."""
        shape = tuple(shape)
        perm = (0, *range(2, len(shape)), 1)
        i = round_up(shape[1], align) if pad_in else shape[1]
        phys = (round_up(shape[0], align), *shape[2:], i)
        return StridedLayout(shape, perm, phys, "conv_weight")

    @staticmethod
    def channel_vector(shape, align: int) -> StridedLayout:
        """A per-channel ``[C]`` vector padded to ``[Cp]`` (BatchNorm scale, conv bias)."""
        shape = tuple(shape)
        return StridedLayout(shape, (0,), (round_up(shape[0], align),), "channel_vector")

    @property
    def is_plain(self) -> bool:
        return self.kind == "plain"

    @property
    def is_channels_last(self) -> bool:
        return self.kind == "channels_last"

    @property
    def channel_axis(self) -> int | None:
        """The logical axis stored last (and padded), if the layout moves one."""
        return self.perm[-1] if self.kind != "plain" and self.shape else None

    @property
    def padded_channels(self) -> int | None:
        return self.phys_shape[-1] if self.kind != "plain" and self.shape else None

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.phys_shape) * itemsize

    def view_strides(self, itemsize: int) -> tuple[int, ...]:
        """Byte strides of the logical view over the padded physical buffer (logical axis order)."""
        phys = compact_strides(self.phys_shape, itemsize)
        strides = [0] * len(self.shape)
        for i, axis in enumerate(self.perm):
            strides[axis] = phys[i]
        return tuple(strides)

    def kernel_view(self, buf: np.ndarray, offset: int, dtype: np.dtype) -> np.ndarray:
        """The logical tensor as a strided view of ``buf`` (padded lanes excluded)."""
        return np.ndarray(self.shape, dtype, buf, offset, self.view_strides(dtype.itemsize))

    def physical_view(self, buf: np.ndarray, offset: int, dtype: np.dtype) -> np.ndarray:
        """The whole padded physical buffer, physical axis order."""
        return np.ndarray(self.phys_shape, dtype, buf, offset)

    @property
    def is_padded(self) -> bool:
        return self.phys_shape != tuple(self.shape[p] for p in self.perm)

    def pad_views(self, buf: np.ndarray, offset: int, dtype: np.dtype) -> list[np.ndarray]:
        """Views covering every padded lane of the physical buffer (they may overlap)."""
        phys = self.physical_view(buf, offset, dtype)
        views = []
        for i, axis in enumerate(self.perm):
            if self.phys_shape[i] > self.shape[axis]:
                views.append(phys[(slice(None),) * i + (slice(self.shape[axis], None),)])
        return views

    def pad_mask(self) -> np.ndarray:
        """Boolean array over the physical buffer: True on padded lanes."""
        mask = np.ones(self.phys_shape, dtype=bool)
        mask[tuple(slice(0, self.shape[p]) for p in self.perm)] = False
        return mask

    def describe(self) -> str:
        if self.kind == "plain":
            return "plain"
        names = "".join("NCDHW"[a] if len(self.shape) == 5 else "NCHW"[a] if len(self.shape) == 4
                        else "NCL"[a] if len(self.shape) == 3 else str(a) for a in self.perm)
        return f"{self.kind} {names} {list(self.phys_shape)}"


@dataclass(frozen=True, eq=False)
class GatherRowsLayout:
    """Axis ``axis`` is stored in the order ``index`` (the logical position of each physical
    one; -1 for a zero row)."""

    shape: tuple[int, ...]
    axis: int
    index: np.ndarray = field(repr=False)
    kind: str = "gather_rows"

    @staticmethod
    def flattened_channels_last(src: StridedLayout, batch_axes: int = 1) -> GatherRowsLayout:
        """The layout of ``Flatten(x, axis=1)`` read straight from channels-last ``x``'s memory."""
        c, spatial = src.shape[1], src.shape[2:]
        cp, s = src.phys_shape[-1], math.prod(spatial)
        pos_c = np.arange(cp)[None, :]
        pos_s = np.arange(s)[:, None]
        index = np.where(pos_c < c, pos_c * s + pos_s, -1).reshape(-1)
        return GatherRowsLayout((src.shape[0], c * s), 1, index)

    def for_matrix(self, shape, axis: int) -> GatherRowsLayout:
        """The same row order applied to axis ``axis`` of a weight matrix ``shape``."""
        return GatherRowsLayout(tuple(shape), axis, self.index)

    @property
    def phys_shape(self) -> tuple[int, ...]:
        s = list(self.shape)
        s[self.axis] = len(self.index)
        return tuple(s)

    @property
    def is_plain(self) -> bool:
        return False

    is_channels_last = False
    channel_axis = None
    padded_channels = None

    @property
    def is_padded(self) -> bool:
        return bool(np.any(self.index < 0))

    def pad_views(self, buf: np.ndarray, offset: int, dtype: np.dtype) -> list[np.ndarray]:
        # Only weights take this layout as owners (activations alias their source), and
        # weights are never in reused memory.
        return []

    @property
    def is_identity(self) -> bool:
        return len(self.index) == self.shape[self.axis] and bool(
            np.all(self.index == np.arange(len(self.index))))

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.phys_shape) * itemsize

    def view_strides(self, itemsize: int) -> tuple[int, ...]:
        return compact_strides(self.phys_shape, itemsize)

    def kernel_view(self, buf: np.ndarray, offset: int, dtype: np.dtype) -> np.ndarray:
        """Kernels that accept this layout (Gemm, MatMul) compute on the physical matrix."""
        return np.ndarray(self.phys_shape, dtype, buf, offset)

    physical_view = kernel_view

    def to_physical(self, logical: np.ndarray) -> np.ndarray:
        taken = np.take(logical, np.maximum(self.index, 0), axis=self.axis)
        zero = (self.index < 0).reshape([-1 if a == self.axis else 1 for a in range(taken.ndim)])
        return np.where(zero, np.zeros((), taken.dtype), taken)

    def to_logical(self, phys: np.ndarray) -> np.ndarray:
        out = np.empty(self.shape, phys.dtype)
        keep = np.nonzero(self.index >= 0)[0]
        np.moveaxis(out, self.axis, 0)[self.index[keep]] = np.moveaxis(
            np.take(phys, keep, axis=self.axis), self.axis, 0)
        return out

    def pad_mask(self) -> np.ndarray:
        mask = (self.index < 0).reshape([-1 if a == self.axis else 1
                                         for a in range(len(self.shape))])
        return np.broadcast_to(mask, self.phys_shape).copy()

    def describe(self) -> str:
        return f"gather_rows(axis={self.axis}) {list(self.phys_shape)}"


Layout = StridedLayout | GatherRowsLayout

# Kernels are called every step with the same arena views, and a spatial kernel's first move
# is to look at them channels-last; np.moveaxis costs ~20 us of Python per call (about 10% of a
# small ResNet's training step), so the moved view is made once per array and remembered while
# that array lives.
_CHANNELS_LAST: dict[tuple[int, int], tuple[weakref.ref, np.ndarray]] = {}


def channels_last_view(a: np.ndarray, axis: int = 1) -> np.ndarray:
    """``np.moveaxis(a, axis, -1)``, made once per (array, axis) and cached while ``a`` lives."""
    key = (id(a), axis)
    hit = _CHANNELS_LAST.get(key)
    if hit is not None and hit[0]() is a:
        return hit[1]
    view = np.moveaxis(a, axis, -1)
    _CHANNELS_LAST[key] = (weakref.ref(a, lambda _, key=key: _CHANNELS_LAST.pop(key, None)), view)
    return view
