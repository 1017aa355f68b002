"""Capture discipline for the cuda backend's one-graph step.

The cuda executor talks to the GPU only through ``DeviceAPI`` (allocate, async copies, kernel
launches, cuDNN executions, synchronize, stream capture). ``capture_step`` drives it the way
TinyJit does: warm-up replays eagerly on the capture stream (cuDNN plans, NVRTC modules and
CuPy's caches get built there), then the whole step is recorded into one CUDA Graph. What
cannot be captured raises ``CaptureError`` naming the node being captured; the executor then
runs the step eagerly and says so (``CaptureError.eager_fallback``), never silently.

Two guards make mistakes loud:

* ``AllocationGuard`` -- installed with ``cupy.cuda.set_allocator`` while capturing, it turns
  any allocation (CuPy's reductions take CUB scratch from the pool, which a replayed graph
  would keep using after the pool handed it out again) into ``AllocationDuringCapture``.
* ``FakeRecorder`` -- a ``DeviceAPI`` for CPU tests that records every call and checks, while
  capturing: no allocation, no synchronize, no synchronous copy; every pointer inside
  ``[arena_base, arena_base + plan.total_bytes)``, within one region, at the offset the
  MemoryPlan gives the named tensor; and writes only to the regions the current phase may
  write (``WRITE_POLICY``: e.g. PARAM only in ``commit``/``apply``).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np

from ...errors import TrOnnxError
from ...memory import MemoryPlan, Region
from .. import check_cuda_graphs

# Which arena regions a step may write, per training phase. CONST is never written; INPUT
# (the batch, LR and step-count scalars) only by async copies issued before the graph launch.
WRITE_POLICY: dict[str, frozenset[Region]] = {
    "forward": frozenset({Region.ACTIVATION, Region.WORKSPACE}),
    "compute": frozenset({Region.ACTIVATION, Region.SAVED, Region.WORKSPACE, Region.GRAD}),
    "commit": frozenset({Region.ACTIVATION, Region.WORKSPACE, Region.PARAM}),  # BN running stats
    "apply": frozenset({Region.ACTIVATION, Region.WORKSPACE, Region.PARAM, Region.GRAD,
                        Region.OPT_STATE}),
    # the step guard (train_pass.add_step_guard): flags, a bad batch's GRAD, the report
    "guard": frozenset({Region.OPT_STATE, Region.WORKSPACE}),
    "discard": frozenset({Region.GRAD}),
    "report": frozenset({Region.OPT_STATE}),
}


class CaptureError(TrOnnxError):
    """A node's work cannot be captured into the step's CUDA Graph.

    ``node`` is the node's label, ``reason`` what went wrong; ``eager_fallback`` says whether
    the executor runs the step eagerly instead (the message says which).
    """

    def __init__(self, node: str, reason: str, eager_fallback: bool = True):
        self.node, self.reason, self.eager_fallback = node, reason, eager_fallback
        then = ("the step falls back to eager execution (one launch per kernel, slower)"
                if eager_fallback else "no eager fallback: the step cannot run")
        super().__init__(f"{node}: cannot be captured into a CUDA Graph: {reason}; {then}")


class AllocationDuringCapture(CaptureError):
    """Memory was allocated while the step was being captured."""


class SyncDuringCapture(CaptureError):
    """A synchronize or a synchronous copy was issued while capturing."""


class PointerOutsideArena(CaptureError):
    """A pointer does not lie inside the arena (or straddles two regions)."""


class RegionViolation(CaptureError):
    """A pointer is not where the MemoryPlan puts its tensor, or a write hits a region the
    current phase may not write."""


# --------------------------------------------------------------------------------------------
# The device protocol
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceBuffer:
    """A kernel argument that is device memory: ``ptr`` and the ``nbytes`` it may touch,
    whether the kernel ``writes`` it, and the plan tensor's ``name`` (for the checks)."""

    ptr: int
    nbytes: int
    writes: bool = False
    name: str | None = None


class DeviceAPI(Protocol):
    """What the cuda executor calls; the real one wraps CuPy and the cuDNN frontend.

    ``begin_node`` marks whose work follows (an NVTX range on the GPU, the name errors carry).
    ``launch`` args are scalars or ``DeviceBuffer``; ``cudnn_execute`` takes a built graph
    (``cudnn_graphs.BuiltGraph``), the device pointer of each of its ports and the workspace
    pointer. Copies name their direction: ``kind`` is ``"h2d"``, ``"d2h"`` or ``"d2d"``.
    ``launch_graph`` replays what ``end_capture`` returned. At bind time: ``prepare_kernel``
    (compile/load the kernel a ``KernelRef`` names), ``build_cudnn`` (a ``GraphDesc`` -> what
    ``cudnn_execute`` takes). Host transfers: ``pinned_buffers`` (``count`` host staging
    buffers of ``nbytes``), ``record_host_buffer`` / ``wait_host_buffer`` (the event behind
    buffer ``index``'s last copy). ``allocation_guard``: a context-manager factory held while
    capturing (``AllocationGuard``), or None where allocations cannot happen.
    """

    arena_base: int

    def begin_node(self, label: str, phase: str) -> None: ...
    def allocate(self, nbytes: int) -> int: ...
    def memcpy_async(self, dst: int | Any, src: int | Any, nbytes: int, kind: str) -> None: ...
    def memcpy(self, dst: int | Any, src: int | Any, nbytes: int, kind: str) -> None: ...
    def launch(self, kernel: Any, grid: tuple, block: tuple, args: Sequence[Any]) -> None: ...
    def cudnn_execute(self, graph: Any, pointers: dict[str, int], workspace: int) -> None: ...
    def synchronize(self) -> None: ...
    def begin_capture(self) -> None: ...
    def end_capture(self) -> Any: ...
    def abort_capture(self) -> None: ...
    def launch_graph(self, graph: Any) -> None: ...
    def prepare_kernel(self, ref: Any) -> None: ...
    def build_cudnn(self, desc: Any) -> Any: ...
    def pinned_buffers(self, nbytes: int, count: int) -> list: ...
    def record_host_buffer(self, index: int) -> None: ...
    def wait_host_buffer(self, index: int) -> None: ...

    allocation_guard: Callable[[Callable[[], str]], Any] | None


@dataclass
class CaptureStep:
    """One node's share of the step: ``run(device)`` issues its launches."""

    label: str
    phase: str
    run: Callable[[DeviceAPI], None]


def capture_step(plan_steps: Iterable[CaptureStep], device: DeviceAPI, warmup: int = 1,
                 allocation_guard: Callable[[Callable[[], str]], Any] | None = None) -> Any:
    """Replay ``plan_steps`` ``warmup`` times eagerly, then capture them into one graph.

    ``allocation_guard(label)`` makes the context manager held while capturing (the cuda
    executor passes ``AllocationGuard``; ``label()`` names the node being captured). Returns
    what ``device.end_capture()`` returns (the CUDA Graph). Raises ``CaptureError`` naming the
    node whose work failed to capture; any other exception raised while capturing is wrapped
    in one (the cause chained) after the capture is aborted, so the stream stays usable for
    the eager fallback.
    """
    steps = list(plan_steps)
    for _ in range(warmup):
        for step in steps:
            device.begin_node(step.label, step.phase)
            step.run(device)
    device.synchronize()  # warm-up work is done before capture starts
    current = ["<capture start>"]
    guard = (allocation_guard(lambda: current[0]) if allocation_guard is not None
             else contextlib.nullcontext())
    # the collector may not free CUDA modules, streams or cuDNN handles mid-capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        device.begin_capture()
        try:
            with guard:
                for step in steps:
                    current[0] = step.label
                    device.begin_node(step.label, step.phase)
                    step.run(device)
        except CaptureError:
            device.abort_capture()
            raise
        except Exception as e:  # a CUDA/cuDNN error inside capture: name the node, keep it
            device.abort_capture()
            raise CaptureError(current[0], f"{type(e).__name__}: {e}") from e
        try:
            return device.end_capture()
        except Exception as e:  # the driver invalidated the capture, or the upload failed
            device.abort_capture()
            raise CaptureError("<end of capture>", f"{type(e).__name__}: {e}") from e
    finally:
        if collecting:
            gc.enable()


class PhaseGraphs:
    """TinyJit's state machine for the phases of one plan: a phase (``"a+b"``: several as one)
    runs eagerly the first time (the warm-up: modules loaded, cuDNN plans built, caches filled
    on the capture stream), is captured into one graph the second and launched, and replayed
    after. ``mode`` (``backends.CUDA_GRAPHS``): ``"fallback"`` -- a phase that cannot be
    captured warns, naming the node, and runs eagerly from then on; ``"require"`` -- the
    ``CaptureError`` propagates; ``"off"`` -- nothing is captured (debugging, profiling)."""

    def __init__(self, device: DeviceAPI, mode: str = "fallback"):
        self.device, self.mode = device, check_cuda_graphs(mode)
        self.graphs: dict[str, Any] = {}
        self.eager_phases: set[str] = set()
        self.runs: dict[str, int] = {}

    def run(self, phase: str, steps: Callable[[str], list[CaptureStep]]) -> None:
        """Run ``phase``, whose work ``steps(phase)`` lists."""
        count = self.runs.get(phase, 0)
        self.runs[phase] = count + 1
        if count == 0 or phase in self.eager_phases or self.mode == "off":
            self._eager(steps(phase))
            return
        graph = self.graphs.get(phase)
        if graph is None:
            try:
                graph = capture_step(steps(phase), self.device, warmup=0,
                                     allocation_guard=self.device.allocation_guard)
            except CaptureError as e:
                if self.mode == "require":
                    raise type(e)(e.node, e.reason + " (cuda_graphs='fallback' runs this step "
                                  "eagerly instead)", False) from e
                warnings.warn(str(e), RuntimeWarning, stacklevel=3)
                self.eager_phases.add(phase)
                self._eager(steps(phase))
                return
            self.graphs[phase] = graph
        self.device.launch_graph(graph)

    def _eager(self, steps: list[CaptureStep]) -> None:
        for step in steps:
            self.device.begin_node(step.label, step.phase)
            step.run(self.device)


# --------------------------------------------------------------------------------------------
# Allocation guard
# --------------------------------------------------------------------------------------------

class AllocationGuard:
    """While entered, any allocation through the installed allocator raises
    ``AllocationDuringCapture`` naming ``label()`` (the node being captured).

    ``set_allocator``/``get_allocator`` default to ``cupy.cuda``'s, imported on entry, so the
    guard costs nothing where CuPy is absent; tests pass their own.
    """

    def __init__(self, label: Callable[[], str] = lambda: "<capture>",
                 set_allocator: Callable | None = None, get_allocator: Callable | None = None):
        self.label = label
        self._set, self._get = set_allocator, get_allocator
        self._previous = None

    def _allocate(self, nbytes: int):
        raise AllocationDuringCapture(self.label(), f"an allocation of {nbytes} bytes (CuPy's "
                                      "pool: a built-in reduction or a temporary array?)")

    def __enter__(self) -> Self:
        if self._set is None:
            import cupy

            self._set, self._get = cupy.cuda.set_allocator, cupy.cuda.get_allocator
        self._previous = self._get()
        self._set(self._allocate)
        return self

    def __exit__(self, *exc) -> None:
        self._set(self._previous)


# --------------------------------------------------------------------------------------------
# FakeRecorder
# --------------------------------------------------------------------------------------------

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
        self.node, self.phase = "<no node>", "forward"
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
        for a in args:
            if isinstance(a, DeviceBuffer):
                self.check_buffer(a)

    def cudnn_execute(self, graph, pointers: dict[str, int], workspace: int) -> None:
        """``graph`` is a ``BuiltGraph`` or a ``GraphDesc`` (both describe their tensors)."""
        desc = getattr(graph, "desc", graph)
        self._record("cudnn_execute", kind=desc.kind, pointers=dict(pointers),
                     workspace=workspace)
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


__all__ = ["WRITE_POLICY", "AllocationDuringCapture", "AllocationGuard", "Call", "CaptureError",
           "CaptureStep", "DeviceAPI", "DeviceBuffer", "FakeRecorder", "PhaseGraphs",
           "PointerOutsideArena", "RecordedGraph", "RegionViolation", "SyncDuringCapture",
           "capture_step"]
