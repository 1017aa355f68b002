"""Capture discipline for the cuda backend's one-graph step.

The cuda executor talks to the GPU only through ``DeviceAPI`` (allocate, async copies, kernel
launches, cuDNN executions, synchronize, stream capture). ``capture_step`` drives it the way
TinyJit does: warm-up replays eagerly on the capture stream (cuDNN plans, NVRTC modules and
CuPy's caches get built there), then the whole step is recorded into one CUDA Graph. What
cannot be captured raises ``CaptureError`` naming the node being captured; the executor then
runs the step eagerly and says so (``CaptureError.eager_fallback``), never silently.

``AllocationGuard`` makes a mistake loud: installed with ``cupy.cuda.set_allocator`` while
capturing, it turns any allocation (CuPy's reductions take CUB scratch from the pool, which a
replayed graph would keep using after the pool handed it out again) into
``AllocationDuringCapture``. ``WRITE_POLICY`` says which regions each phase may write; the test
doubles of ``tr_onnx.testing`` (the recorder, the host emulator) enforce it on the CPU.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from ...errors import TrOnnxError
from ...ir import Phase
from ...memory import Region
from .. import check_cuda_graphs

# Which arena regions a step may write, per training phase. CONST is never written; INPUT
# (the batch, LR and step-count scalars) only by async copies issued before the graph launch.
WRITE_POLICY: dict[Phase, frozenset[Region]] = {
    Phase.FORWARD: frozenset({Region.ACTIVATION, Region.WORKSPACE}),
    Phase.COMPUTE: frozenset({Region.ACTIVATION, Region.SAVED, Region.WORKSPACE, Region.GRAD}),
    # data parallelism (ops/collective.py): GRAD averaged over the ranks in place; rank 0's
    # BatchNorm running statistics (PARAM) broadcast at the start of the step (nccl.py)
    Phase.REDUCE: frozenset({Region.GRAD}),
    Phase.BROADCAST: frozenset({Region.PARAM}),
    # BatchNorm's running statistics
    Phase.COMMIT: frozenset({Region.ACTIVATION, Region.WORKSPACE, Region.PARAM}),
    Phase.APPLY: frozenset({Region.ACTIVATION, Region.WORKSPACE, Region.PARAM, Region.GRAD,
                            Region.OPT_STATE}),
    # the step guard (train_pass.add_step_guard): flags, a bad batch's GRAD, the report
    Phase.GUARD: frozenset({Region.OPT_STATE, Region.WORKSPACE}),
    Phase.DISCARD: frozenset({Region.GRAD}),
    Phase.REPORT: frozenset({Region.OPT_STATE}),
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
    ``nccl_all_reduce`` / ``nccl_broadcast``: an in-place all-reduce / broadcast of ``buf``
    over an NCCL communicator (``nccl.NcclAllReduce``, ``nccl.NcclBroadcast``), on the stream
    like a launch.
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
    def nccl_all_reduce(self, comm: Any, buf: DeviceBuffer, count: int, dtype: int,
                        op: int) -> None: ...
    def nccl_broadcast(self, comm: Any, buf: DeviceBuffer, count: int, dtype: int,
                       root: int) -> None: ...

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


__all__ = ["WRITE_POLICY", "AllocationDuringCapture", "AllocationGuard", "CaptureError",
           "CaptureStep", "DeviceAPI", "DeviceBuffer", "PhaseGraphs", "PointerOutsideArena",
           "RegionViolation", "SyncDuringCapture", "capture_step"]
