"""The MemoryPlan: where every tensor lives in one 256-byte-aligned arena.

A pure function of the scheduled graph: schedule -> first/last use -> alloc/free events ->
aligned offsets. It holds descriptors (DTensor), never memory; a backend allocates one arena
of ``total_bytes`` and takes views at the offsets. ``reuse=False`` turns lifetime reuse off.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from . import ir
from .errors import InputError, PlanError
from .layouts import GatherRowsLayout, Layout, StridedLayout, compact_strides, round_up

ALIGN = 256


class Region(enum.IntEnum):
    """Arena regions, in arena order."""

    PARAM = 0  # trainable-candidate initializers
    CONST = 1  # other initializers and folded constants
    GRAD = 2  # parameter gradients (training)
    OPT_STATE = 3  # optimizer moments (training)
    INPUT = 4  # graph inputs (``input_buffers`` copies)
    SAVED = 5  # activations kept for the backward pass (training)
    ACTIVATION = 6  # intermediate values; lifetimes reused
    WORKSPACE = 7  # per-node scratch, live only while that node runs


_KIND_REGION = {ir.PARAM: Region.PARAM, ir.CONST: Region.CONST, ir.INPUT: Region.INPUT,
                ir.ACTIVATION: Region.ACTIVATION, ir.GRAD: Region.GRAD,
                ir.STATE: Region.OPT_STATE}


@dataclass
class DTensor:
    """A tensor's descriptor: logical shape, dtype, layout, region and place in the arena."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    region: Region
    layout: Layout
    offset: int = 0
    slot_bytes: int = 0
    alias_of: int | None = None  # id of the DTensor whose memory this one views
    span: bool = False  # a flat view over consecutive tensors of one region (no slot of its own)
    first_use: int = -1  # schedule index of the producer (-1: before the step)
    last_use: int = -1  # schedule index of the last reader (len(schedule): a graph output)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes(self.dtype.itemsize)

    @property
    def phys_shape(self) -> tuple[int, ...]:
        return self.layout.phys_shape

    @property
    def padded_channels(self) -> int | None:
        return self.layout.padded_channels

    @property
    def device_strides(self) -> tuple[int, ...]:
        """Byte strides of the arena view, logical axis order (padded, permuted)."""
        return self.layout.view_strides(self.dtype.itemsize)

    @property
    def host_strides(self) -> tuple[int, ...]:
        """Byte strides of the compact host array in logical (NCHW) order."""
        return compact_strides(self.shape, self.dtype.itemsize)

    def kernel_view(self, arena: np.ndarray) -> np.ndarray:
        return self.layout.kernel_view(arena, self.offset, self.dtype)

    def physical_view(self, arena: np.ndarray) -> np.ndarray:
        return self.layout.physical_view(arena, self.offset, self.dtype)


@dataclass
class MemoryPlan:
    tensors: dict[str, DTensor]
    workspaces: dict[int, list[DTensor]]  # schedule index -> that node's scratch buffers
    regions: dict[Region, tuple[int, int]]  # region -> (start, bytes)
    total_bytes: int
    naive_bytes: int
    schedule_length: int
    reuse: bool = True
    finalized: bool = field(default=False, repr=False)

    def all_tensors(self) -> list[DTensor]:
        return list(self.tensors.values()) + [t for ws in self.workspaces.values() for t in ws]

    def region_bytes(self, region: Region) -> int:
        return self.regions[region][1]

    def finalize(self) -> MemoryPlan:
        """Validate alignment, region bounds and order, and that no two live tensors overlap."""
        start = 0
        for region in Region:
            r_start, r_size = self.regions[region]
            if r_start != start or r_start % ALIGN or r_size % ALIGN:
                raise PlanError(f"region {region.name} at {r_start} (+{r_size}) breaks the arena "
                                f"order or the {ALIGN}-byte alignment")
            start += r_size
        if start != self.total_bytes:
            raise PlanError(f"regions add up to {start} bytes, arena is {self.total_bytes}")
        by_id = {t.id: t for t in self.all_tensors()}
        for t in self.all_tensors():
            if t.span:
                r_start, r_size = self.regions[t.region]
                if not r_start <= t.offset <= t.offset + t.nbytes <= r_start + r_size:
                    raise PlanError(f"span {t.name!r} leaves region {t.region.name}")
                continue
            if t.offset % ALIGN or t.slot_bytes % ALIGN:
                raise PlanError(f"tensor {t.name!r}: offset {t.offset} / slot {t.slot_bytes} not "
                                f"a multiple of {ALIGN}")
            owner = by_id[t.alias_of] if t.alias_of is not None else t
            r_start, r_size = self.regions[owner.region]
            if t.nbytes > owner.slot_bytes or not (
                    r_start <= t.offset and t.offset + t.nbytes <= r_start + r_size):
                raise PlanError(f"tensor {t.name!r} ({t.nbytes} bytes at {t.offset}) does not fit "
                                f"its slot in region {owner.region.name}")
        self._check_overlaps()
        self.finalized = True
        return self

    def _check_overlaps(self) -> None:
        """One sweep over the schedule: each tensor, when it becomes live, is checked against
        its neighbours in address order among the live ones (live ones never overlap, so the
        neighbours are the only candidates). O(n log n): a long chain shares few slots among
        thousands of tensors, and a pairwise check over a slot's occupants is quadratic."""
        owned = sorted((t for t in self.tensors.values() if t.alias_of is None and t.slot_bytes),
                       key=lambda t: (t.first_use, t.offset))
        live: list[tuple[int, int]] = []  # (offset, index into owned), sorted by offset
        ends: list[tuple[int, int]] = []  # heap of (last_use, index into owned)
        for i, t in enumerate(owned):
            while ends and ends[0][0] < t.first_use:
                _, j = heapq.heappop(ends)
                del live[bisect.bisect_left(live, (owned[j].offset, j))]
            k = bisect.bisect_left(live, (t.offset, i))
            for n in (k - 1, k):
                other = owned[live[n][1]] if 0 <= n < len(live) else None
                if other is not None and t.offset < other.offset + other.slot_bytes \
                        and other.offset < t.offset + t.slot_bytes:
                    raise PlanError(f"tensors {other.name!r} and {t.name!r} are live at the same "
                                    f"time but overlap in the arena ({other.offset}+"
                                    f"{other.slot_bytes}, {t.offset}+{t.slot_bytes})")
            live.insert(k, (t.offset, i))
            heapq.heappush(ends, (t.last_use, i))
        for ws in self.workspaces.values():
            spans = sorted((t.offset, t.offset + t.slot_bytes, t.name) for t in ws)
            for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
                if start < end:
                    raise PlanError(f"workspaces {name!r} and {other!r} overlap")

    def padded_in_shared_slots(self) -> set[str]:
        """Padded tensors whose bytes other tensors also use at other times.

        Their padded lanes may hold a previous occupant's data, so whoever writes them must
        zero those lanes first; padded tensors with a slot of their own stay zero from arena
        creation. One pass in address order: a tensor shares its bytes when one that starts
        before it ends past its start, or the next one starts before it ends.
        """
        owned = sorted((t for t in self.tensors.values() if t.alias_of is None and t.slot_bytes),
                       key=lambda t: t.offset)
        shared = set()
        reach = -1  # the furthest end of the tensors before this one
        for i, t in enumerate(owned):
            end = t.offset + t.slot_bytes
            if t.layout.is_padded and (reach > t.offset or i + 1 < len(owned)
                                       and owned[i + 1].offset < end):
                shared.add(t.name)
            reach = max(reach, end)
        return shared


def _slot(nbytes: int) -> int:
    return round_up(nbytes, ALIGN)


class _Allocator:
    """Best-fit reuse of freed blocks inside one region (the smallest block that fits, the lowest
    offset among equals); grows at the top when nothing fits. Free blocks are kept merged, by
    size for the fit and by both ends for merging: O(log n) comparisons per call."""

    def __init__(self, reuse: bool):
        self.reuse, self.top = reuse, 0
        self.by_size: list[tuple[int, int]] = []  # (size, offset), sorted
        self.at: dict[int, int] = {}  # start -> size
        self.ending: dict[int, int] = {}  # end -> start

    def _take(self, offset: int, size: int) -> None:
        del self.by_size[bisect.bisect_left(self.by_size, (size, offset))]
        del self.at[offset], self.ending[offset + size]

    def _put(self, offset: int, size: int) -> None:
        bisect.insort(self.by_size, (size, offset))
        self.at[offset], self.ending[offset + size] = size, offset

    def alloc(self, size: int) -> int:
        if self.reuse:
            k = bisect.bisect_left(self.by_size, (size, -1))
            if k < len(self.by_size):
                length, offset = self.by_size[k]
                self._take(offset, length)
                if length > size:
                    self._put(offset + size, length - size)
                return offset
        offset, self.top = self.top, self.top + size
        return offset

    def release(self, offset: int, size: int) -> None:
        if not self.reuse or not size:
            return
        if offset in self.ending:  # merge with the free block below
            below = self.ending[offset]
            self._take(below, offset - below)
            offset, size = below, size + offset - below
        if offset + size in self.at:  # and the one above
            above = self.at[offset + size]
            self._take(offset + size, above)
            size += above
        if offset + size == self.top:
            self.top = offset
        else:
            self._put(offset, size)


def plan_memory(graph: ir.Graph, schedule: list[ir.Node],
                workspace_requests: dict[int, list[tuple[tuple[int, ...], np.dtype]]],
                reuse: bool = True, input_buffers: int = 1, min_workspace: int = 0
                ) -> MemoryPlan:
    """Lay every value of ``graph`` out in one arena.

    ``schedule`` is the order nodes run in (alias nodes included: they are uses);
    ``workspace_requests[i]`` the scratch buffers node ``schedule[i]`` asked for;
    ``min_workspace``: bytes the WORKSPACE region holds at least (what the backend stages
    there between steps, e.g. the cuda executor's host transfers).
    """
    end = len(schedule)
    tensors: dict[str, DTensor] = {}
    ids = iter(range(1 << 62))
    # slot_order first: a training graph's parameters, gradients and optimizer state sit in
    # the same order with the same slot sizes, so their regions line up as flat spans
    values = sorted(graph.values.values(), key=lambda v: v.slot_order)
    for v in values:
        region = _KIND_REGION[v.kind]
        tensors[v.name] = DTensor(next(ids), v.name, tuple(v.shape), v.dtype, region,
                                  v.get_layout(), span=v.span_of is not None)
    _lifetimes(graph, schedule, tensors)
    _mark_saved(graph, schedule, tensors)
    for v in values:
        if v.alias_of is not None:
            tensors[v.name].alias_of = tensors[v.alias_of.name].id

    regions: dict[Region, tuple[int, int]] = {}
    cursor = 0
    naive = 0
    owners = [t for t in tensors.values() if t.alias_of is None and not t.span]
    widen = mirror_widening(graph)
    for t in owners:
        t.slot_bytes = slot_bytes(graph.values[t.name], widen)
        naive += t.slot_bytes
    ws_plan: dict[int, list[DTensor]] = {}
    ws_size = _slot(min_workspace) if min_workspace else 0
    for index, requests in workspace_requests.items():
        offset, bufs = 0, []
        for k, (shape, dtype) in enumerate(requests):
            name = f"{schedule[index].name}:ws{k}"
            t = DTensor(next(ids), name, shape, dtype, Region.WORKSPACE,
                        StridedLayout.plain(shape), first_use=index, last_use=index)
            t.slot_bytes = _slot(t.nbytes)
            t.offset, offset = offset, offset + t.slot_bytes
            bufs.append(t)
        naive += offset
        ws_size = max(ws_size, offset)
        ws_plan[index] = bufs

    for region in Region:
        members = [t for t in owners if t.region == region]
        if region in (Region.ACTIVATION, Region.SAVED):
            size = _place_by_lifetime(members, cursor, reuse)
        elif region == Region.WORKSPACE:
            for bufs in ws_plan.values():
                for t in bufs:
                    t.offset += cursor
            size = ws_size
        else:
            size = 0
            for t in members:
                t.offset, size = cursor + size, size + t.slot_bytes
            if region == Region.INPUT:
                size *= input_buffers
        regions[region] = (cursor, size)
        cursor += size
    by_id = {o.id: o for o in owners}
    for t in tensors.values():
        if t.alias_of is not None:
            owner = by_id[t.alias_of]
            t.offset, t.region = owner.offset, owner.region
    for v in values:
        if v.span_of is not None:
            _place_span(tensors[v.name], [tensors[m.name] for m in v.span_of])
    return MemoryPlan(tensors, ws_plan, regions, cursor, naive, end, reuse).finalize()


def _lifetimes(graph: ir.Graph, schedule: list[ir.Node], tensors: dict[str, DTensor]) -> None:
    end = len(schedule)
    position = {id(n): i for i, n in enumerate(schedule)}
    outputs = {id(v) for v in graph.outputs}

    def owner(v: ir.Value) -> ir.Value:
        return v.alias_of if v.alias_of is not None else v

    for v in graph.values.values():
        t = tensors[owner(v).name]
        first = position[id(v.producer)] if v.producer is not None and v.kind == ir.ACTIVATION \
            else -1
        t.first_use = first if t.first_use < 0 else min(t.first_use, first)
        last = max([position[id(c)] for c in v.consumers if id(c) in position] + [first])
        if id(v) in outputs or v.kind != ir.ACTIVATION:
            last = end
        t.last_use = max(t.last_use, last)
    for v in graph.values.values():
        if v.alias_of is not None:
            a, o = tensors[v.name], tensors[owner(v).name]
            a.first_use, a.last_use = o.first_use, o.last_use


def _mark_saved(graph: ir.Graph, schedule: list[ir.Node], tensors: dict[str, DTensor]) -> None:
    """Activations made before the backward pass and read during it live in SAVED."""
    start = graph.backward_start
    if start is None:
        return
    for t in tensors.values():
        if t.region == Region.ACTIVATION and t.alias_of is None and t.first_use < start \
                <= t.last_use < len(schedule):
            t.region = Region.SAVED


def mirror_widening(graph: ir.Graph) -> dict[str, int]:
    """Parameters mirrored by a narrower value (a float16 copy of float32 master weights) ->
    how many times wider the parameter is. Such a parameter's slot is rounded to that many
    ALIGNs, so its narrower mirrors' slots are still multiples of ALIGN."""
    widen: dict[str, int] = {}
    for v in graph.values.values():
        m = v.mirror_of
        if m is not None and m.dtype.itemsize > v.dtype.itemsize:
            widen[m.name] = max(widen.get(m.name, 1), m.dtype.itemsize // v.dtype.itemsize)
    return widen


def slot_bytes(v: ir.Value, widen: dict[str, int]) -> int:
    """The slot of ``v``: its bytes rounded up to ``ALIGN`` (times its widening); a mirror takes
    its parameter's slot scaled by the itemsizes, so element i of every span over mirrors is
    element i of the PARAM span (a float32 slot is the size of two float16 slots)."""
    m = v.mirror_of
    if m is not None:
        return slot_bytes(m, widen) * v.dtype.itemsize // m.dtype.itemsize
    return round_up(v.get_layout().nbytes(v.dtype.itemsize), ALIGN * widen.get(v.name, 1))


def span_elements(members: list[ir.Value], widen: dict[str, int]) -> int:
    """Elements of a flat span over ``members`` placed consecutively (slots and gaps included)."""
    itemsize = members[0].dtype.itemsize
    return sum(slot_bytes(m, widen) for m in members) // itemsize


def _place_span(span: DTensor, members: list[DTensor]) -> None:
    span.region = members[0].region
    span.offset = members[0].offset
    for a, b in zip(members, members[1:]):
        if b.offset != a.offset + a.slot_bytes or b.region != a.region:
            raise PlanError(f"span {span.name!r}: {a.name!r} and {b.name!r} are not adjacent")
    if span.nbytes != members[-1].offset + members[-1].slot_bytes - span.offset:
        raise PlanError(f"span {span.name!r} does not cover its members exactly")


def _place_by_lifetime(members: list[DTensor], base: int, reuse: bool) -> int:
    alloc = _Allocator(reuse)
    live: list[tuple[int, int, DTensor]] = []  # heap of (last_use, order, tensor)
    for order, t in enumerate(sorted(members, key=lambda t: (t.first_use, -t.slot_bytes))):
        while live and live[0][0] < t.first_use:
            done = heapq.heappop(live)[2]
            alloc.release(done.offset - base, done.slot_bytes)
        t.offset = base + alloc.alloc(t.slot_bytes)
        heapq.heappush(live, (t.last_use, order, t))
    return max([t.offset - base + t.slot_bytes for t in members] + [0])


# ---- host <-> arena transfer ---------------------------------------------------------------

def write_host(arena: np.ndarray, t: DTensor, array: np.ndarray, host_layout: str = "nchw",
               writer: Callable[[np.ndarray], None] | None = None) -> None:
    """Copy a compact host array (logical NCHW, or NHWC with ``host_layout='nhwc'``) into the
    arena in ``t``'s padded physical layout. Padded lanes are left untouched (zero).
    ``writer``: ``host_writer(arena, t)`` made once by a caller that writes ``t`` again and
    again (else a plain copy is made for this call)."""
    array = np.asarray(array)
    if host_layout == "nhwc" and array.ndim >= 3:
        array = np.moveaxis(array, -1, 1)
    if array.shape != t.shape:
        raise InputError(f"{t.name!r}: expected shape {list(t.shape)}, got {list(array.shape)}")
    (writer or host_writer(arena, t, fast=False))(array)


def read_host(arena: np.ndarray, t: DTensor, host_layout: str = "nchw",
              reader: Callable[[], np.ndarray] | None = None) -> np.ndarray:
    """A compact host copy of ``t`` (logical NCHW, or NHWC with ``host_layout='nhwc'``);
    ``reader``: ``host_reader(arena, t)`` made once by a caller that reads ``t`` again and
    again."""
    out = (reader or host_reader(arena, t, fast=False))()
    if host_layout == "nhwc" and out.ndim >= 3:
        out = np.ascontiguousarray(np.moveaxis(out, 1, -1))
    return out


def host_writer(arena: np.ndarray, t: DTensor, fast: bool = True) -> Callable[[np.ndarray], None]:
    """``write_host(arena, t, x)`` for a caller that writes, again and again, compact NCHW
    arrays it has checked have ``t``'s shape: the view is made once, so a call is one copy (a
    session run's input write: ~1 µs instead of ~5). ``fast``: a large float32 map is copied
    by oneDNN (``_onednn_copier``; ~0.1 ms to prepare, so not for a single write)."""
    if isinstance(t.layout, GatherRowsLayout):
        physical, to_physical = t.physical_view(arena), t.layout.to_physical

        def write(array: np.ndarray) -> None:
            physical[...] = to_physical(array)

        return write
    view = t.kernel_view(arena)
    # ``casting="unsafe"``: the conversions ``view[...] = x`` makes (an input kept wider)
    copy = partial(np.copyto, view, casting="unsafe")
    copier = _onednn_copier(view, into_view=True) if fast else None
    if copier is None:
        return copy

    def write(array: np.ndarray) -> None:
        if type(array) is np.ndarray and array.dtype == np.float32 \
                and array.flags.c_contiguous:
            copier(array, view)
        else:
            copy(array)

    return write


def host_reader(arena: np.ndarray, t: DTensor, fast: bool = True) -> Callable[[], np.ndarray]:
    """``read_host(arena, t)`` for repeated calls: the view is made once, and a call is its
    bound ``copy`` (a C-ordered array, as ``np.array(view, copy=True, order="C")``, in half
    the time: 0.36 vs 0.71 us for the MLP's [32, 10] output, 2026-12-02), or with ``fast`` a
    oneDNN copy of a large float32 channels-last map (``_onednn_copier``)."""
    if isinstance(t.layout, GatherRowsLayout):
        return partial(t.layout.to_logical, t.physical_view(arena))
    view = t.kernel_view(arena)
    copier = _onednn_copier(view, into_view=False) if fast else None
    if copier is None:
        return view.copy

    def read() -> np.ndarray:
        out = np.empty(view.shape, np.float32)
        copier(view, out)
        return out

    return read


# oneDNN's reorder copies a float32 map between NCHW and a channels-last arena view in one
# vectorised pass on its threads, where NumPy's strided copy loops over the short channel axis:
# [32, 3, 16, 16] written 83 -> 20 us, [32, 3, 64, 64] 911 -> 103 us, [32, 16, 16, 16] read
# 54 -> 23 us; a call costs ~9 us whatever the size, so below this many elements NumPy's copy
# is as fast (2 threads, Zen 3, 2026-12-02)
_ONEDNN_COPY_MIN = 16384


def _onednn_copier(view: np.ndarray, into_view: bool):
    """oneDNN's copy (``onednn.Copier``) between the strided arena ``view`` and a C-contiguous
    array of its shape (into the view, or out of it), or None where NumPy's copy does as well
    (a compact view, a small one, not float32) or oneDNN is not there."""
    if view.dtype != np.float32 or view.size < _ONEDNN_COPY_MIN or view.flags.c_contiguous:
        return None
    from . import onednn

    compact = compact_strides(view.shape, view.itemsize)
    return onednn.copier(view.shape, compact, view.strides) if into_view else \
        onednn.copier(view.shape, view.strides, compact)


def pad_lanes_are_zero(arena: np.ndarray, t: DTensor) -> bool:
    """True when every padded lane of ``t`` in the arena holds zero bits."""
    if t.nbytes == 0 or t.layout.is_plain:
        return True
    phys = t.physical_view(arena)
    raw = phys.view(np.uint8).reshape(phys.shape + (-1,)) if phys.ndim else phys
    return not np.any(raw[t.layout.pad_mask()])


__all__ = ["ALIGN", "DTensor", "MemoryPlan", "Region", "plan_memory", "read_host", "write_host",
           "host_reader", "host_writer", "pad_lanes_are_zero", "math"]
