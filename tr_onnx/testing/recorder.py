"""The recording device: a ``DeviceAPI`` without a device, for the CPU tests and for planning.

``FakeRecorder`` records every call and checks what the GPU would only tell by crashing or by
silently wrong results. Always: every launch's arguments against its kernel's PTX parameter
list (``ptx.check_launch``); every pointer inside ``[arena_base, arena_base +
plan.total_bytes)``, within one region, at the offset the MemoryPlan gives the named tensor;
writes only to the regions the current phase may write (``capture.WRITE_POLICY``: e.g. PARAM
only in ``commit``/``apply``). While capturing: no allocation, no synchronize, no synchronous
copy. ``tr_onnx.testing.host_emulator`` builds on it to also run what it records.

A test double: the backend never imports this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.cuda.capture import (
    WRITE_POLICY,
    AllocationDuringCapture,
    DeviceBuffer,
    PointerOutsideArena,
    RegionViolation,
    SyncDuringCapture,
)
from ..backends.cuda.device import KernelRef
from ..ir import Phase
from ..memory import MemoryPlan, Region
from . import ptx


@dataclass
class Call:
    """One recorded device call."""

    op: str
    node: str
    phase: str
    capturing: bool
    args: dict = field(default_factory=dict)


@dataclass
class RecordedGraph:
    """What ``FakeRecorder.end_capture`` returns: the captured calls, in order."""

    calls: list[Call]


class FakeRecorder:
    """A ``DeviceAPI`` without a device: records every call and enforces the capture rules.

    ``arena_base`` is a fake device address (256-aligned); ``plan`` the MemoryPlan whose
    arena lives there. Checks that hold always: pointers inside the arena, in one region, at
    the offset of the tensor they name, writes allowed by ``policy`` for the current phase.
    Checks that hold while capturing: no allocation, no synchronize, no synchronous copy.
    """

    def __init__(self, plan: MemoryPlan, arena_base: int = 1 << 40,
                 policy: dict[str, frozenset[Region]] | None = None):
        if arena_base % 256:
            raise ValueError(f"arena_base {arena_base:#x} is not 256-byte aligned")
        self.plan, self.arena_base = plan, arena_base
        self.policy = WRITE_POLICY if policy is None else policy
        self.calls: list[Call] = []
        self.capturing = False
        self.node, self.phase = "<no node>", Phase.FORWARD
        self._heap = arena_base + plan.total_bytes + (1 << 30)  # fake allocations go above
        self._named = {t.name: t for t in plan.all_tensors()}
        self._owner = {t.id: t for t in plan.all_tensors()}
        self._regions = sorted((start, start + size, region)
                               for region, (start, size) in plan.regions.items() if size)

    # -- recording ---------------------------------------------------------------------------
    def _record(self, op: str, **args) -> None:
        self.calls.append(Call(op, self.node, self.phase, self.capturing, args))

    def begin_node(self, label: str, phase: str) -> None:
        self.node, self.phase = label, phase

    # -- checks ------------------------------------------------------------------------------
    def region_of(self, ptr: int, nbytes: int) -> Region:
        """The region holding ``[ptr, ptr + nbytes)``; raises ``PointerOutsideArena``."""
        start, end = ptr - self.arena_base, ptr - self.arena_base + max(nbytes, 1)
        if start < 0 or end > self.plan.total_bytes:
            raise PointerOutsideArena(self.node, f"pointer {ptr:#x} (+{nbytes} bytes) is outside "
                                      f"the arena [{self.arena_base:#x}, "
                                      f"{self.arena_base + self.plan.total_bytes:#x})")
        for r_start, r_end, region in self._regions:
            if r_start <= start < r_end:
                if end > r_end:
                    raise PointerOutsideArena(self.node, f"buffer at arena offset {start} "
                                              f"(+{nbytes}) straddles the end of {region.name}")
                return region
        raise PointerOutsideArena(self.node, f"arena offset {start} is in no region")

    def check_buffer(self, buf: DeviceBuffer) -> Region:
        region = self.region_of(buf.ptr, buf.nbytes)
        if buf.name is not None:
            t = self._named.get(buf.name)
            if t is None:
                raise RegionViolation(self.node, f"{buf.name!r} is not a tensor of the plan")
            owner = self._owner[t.alias_of] if t.alias_of is not None else t
            offset = buf.ptr - self.arena_base
            if offset != t.offset or offset + buf.nbytes > owner.offset + max(owner.slot_bytes,
                                                                                t.nbytes):
                raise RegionViolation(self.node, f"{buf.name!r} passed at arena offset {offset} "
                                      f"(+{buf.nbytes}); the plan puts it at {t.offset} "
                                      f"(slot {owner.slot_bytes} bytes)")
        if buf.writes and region not in self.policy.get(self.phase, frozenset()):
            what = buf.name or f"{buf.ptr:#x}"
            raise RegionViolation(self.node, f"writes {what} in region {region.name} during "
                                  f"phase {self.phase!r}, which may write only "
                                  f"{sorted(r.name for r in self.policy.get(self.phase, ()))}")
        return region

    def _device_ptr(self, value, nbytes: int, writes: bool) -> None:
        if isinstance(value, DeviceBuffer):
            self.check_buffer(value)
        elif isinstance(value, int):
            self.check_buffer(DeviceBuffer(value, nbytes, writes))

    # -- DeviceAPI ---------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        self._record("allocate", nbytes=nbytes)
        if self.capturing:
            raise AllocationDuringCapture(self.node, f"allocate({nbytes}) while capturing")
        ptr, self._heap = self._heap, self._heap + -(-nbytes // 256) * 256
        return ptr

    def memcpy_async(self, dst, src, nbytes: int, kind: str) -> None:
        self._record("memcpy_async", dst=dst, src=src, nbytes=nbytes, kind=kind)
        if kind not in ("h2d", "d2h", "d2d"):
            raise ValueError(f"copy kind {kind!r}; valid: h2d, d2h, d2d")
        if kind in ("h2d", "d2d"):
            self._device_ptr(dst, nbytes, True)
        if kind in ("d2h", "d2d"):
            self._device_ptr(src, nbytes, False)

    def memcpy(self, dst, src, nbytes: int, kind: str) -> None:
        self._record("memcpy", dst=dst, src=src, nbytes=nbytes, kind=kind)
        if self.capturing:
            raise SyncDuringCapture(self.node, f"a synchronous {kind} copy of {nbytes} bytes "
                                    "(use memcpy_async on the capture stream)")

    def launch(self, kernel, grid: tuple, block: tuple, args: Sequence[Any]) -> None:
        self._record("launch", kernel=kernel, grid=tuple(grid), block=tuple(block),
                     args=tuple(args))
        # the arguments as the device will read them (testing/ptx.py); a kernel that is no
        # KernelRef is a test's stand-in with no source
        if isinstance(kernel, KernelRef) and ptx.available():
            ptx.check_launch(kernel, args, self.node)
        for a in args:
            if isinstance(a, DeviceBuffer):
                self.check_buffer(a)

    def cudnn_execute(self, graph, pointers: dict[str, int], workspace: int) -> None:
        """``graph`` is a ``BuiltGraph`` or a ``GraphDesc`` (both describe their tensors)."""
        desc = getattr(graph, "desc", graph)
        self._record("cudnn_execute", kind=desc.kind, pointers=dict(pointers),
                     workspace=workspace, node_inputs=desc.node_inputs)
        tensors = desc.tensors()
        missing = {p for p, t in tensors.items() if not t.virtual} - set(pointers)
        if missing:
            raise RegionViolation(self.node, f"cuDNN {desc.kind}: no pointer for {sorted(missing)}")
        for port, ptr in pointers.items():
            t = tensors[port]
            self.check_buffer(DeviceBuffer(ptr, t.span_bytes, port in desc.outputs, t.name))
        ws_start, ws_bytes = desc.workspace
        if ws_bytes:
            buf = DeviceBuffer(workspace, ws_bytes, True)
            if self.check_buffer(buf) != Region.WORKSPACE or workspace != self.arena_base + \
                    ws_start:
                raise RegionViolation(self.node, f"cuDNN {desc.kind}: workspace {workspace:#x} is "
                                      "not the plan's WORKSPACE region")

    def nccl_all_reduce(self, comm, buf: DeviceBuffer, count: int, dtype: int,
                        op: int) -> None:
        """Recorded with its communicator; ``buf`` is checked as a launch's written buffer."""
        self._record("nccl_all_reduce", comm=comm, buf=buf, count=count, dtype=dtype, redop=op)
        self.check_buffer(buf)

    def nccl_broadcast(self, comm, buf: DeviceBuffer, count: int, dtype: int,
                       root: int) -> None:
        """Recorded with its communicator; ``buf`` is checked as a launch's written buffer."""
        self._record("nccl_broadcast", comm=comm, buf=buf, count=count, dtype=dtype, root=root)
        self.check_buffer(buf)

    def synchronize(self) -> None:
        self._record("synchronize")
        if self.capturing:
            raise SyncDuringCapture(self.node, "synchronize() while capturing")

    def record_host_buffer(self, index: int) -> None:
        """The event of pinned host buffer ``index`` (``CupyDevice``): recorded, no wait."""
        self._record("record_event", index=index)

    def wait_host_buffer(self, index: int) -> None:
        """Waiting on that event: a host synchronization, refused while capturing."""
        self._record("wait_event", index=index)
        if self.capturing:
            raise SyncDuringCapture(self.node, f"waiting on host buffer {index} while capturing")

    allocation_guard = None  # nothing allocates behind the recorder's back

    def prepare_kernel(self, ref) -> None:
        """Nothing to compile: the CPU tests compile every source with NVRTC separately."""

    def build_cudnn(self, desc):
        """The declaration stands for the built graph (``cudnn_execute`` reads its tensors)."""
        return desc

    def pinned_buffers(self, nbytes: int, count: int) -> list:
        return [np.zeros(nbytes, np.uint8) for _ in range(count)]

    def launch_graph(self, graph) -> None:
        """Record the launch; the captured calls are not issued again (nothing runs here)."""
        self._record("launch_graph", calls=len(graph.calls))

    def begin_capture(self) -> None:
        self._record("begin_capture")
        self.capturing = True
        self._capture_start = len(self.calls)

    def end_capture(self) -> RecordedGraph:
        self.capturing = False
        captured = self.calls[self._capture_start:]
        self._record("end_capture")
        return RecordedGraph(captured)

    def abort_capture(self) -> None:
        self.capturing = False
        self._record("abort_capture")


__all__ = ["Call", "FakeRecorder", "RecordedGraph"]
