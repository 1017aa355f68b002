"""The numpy backend: one ``uint8`` arena, strided views at the plan's offsets, and a step that is
a flat list of bound kernel calls. ``BACKEND`` is its ``Backend``: kernels are the functions
the registry's factories return, compact channels, an arena no larger than the machine's
memory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np

from ..errors import ArenaSizeError, DistributedError, TrOnnxError
from ..ir import Phase
from ..layouts import GatherRowsLayout
from ..memory import (
    ALIGN,
    MemoryPlan,
    host_reader,
    host_writer,
    pad_lanes_are_zero,
    read_host,
    write_host,
)
from . import Backend, ExecutorAPI, HostTransfers

# NumPy 2 keeps its floating-point error handling in a context variable, which np.errstate
# sets and resets: done here directly it costs 0.2 us where the context manager costs 0.75 us
# per run (the zoo MLP's whole inference run is ~16 us). Any other NumPy: np.errstate.
try:
    from numpy._core.umath import _extobj_contextvar as _FP_STATE
    from numpy._core.umath import _make_extobj as _make_fp_state

    _FP_STATE.reset(_FP_STATE.set(_make_fp_state(all="ignore")))
except (ImportError, AttributeError, TypeError, ValueError):
    _FP_STATE = _make_fp_state = None


class KernelError(TrOnnxError):
    """A kernel failed while running; the message names the node."""


def allocate_arena(nbytes: int) -> np.ndarray:
    """A zeroed arena whose first byte is 256-byte aligned (padded lanes start, and stay, zero)."""
    try:
        raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    except MemoryError as exc:
        raise ArenaSizeError(f"the plan's arena of {nbytes} bytes could not be allocated "
                             f"({exc}); feed smaller inputs") from None
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


class BoundStep:
    """One prepared kernel call: the function, the views it reads and writes, and the padded
    lanes of its outputs to zero first (outputs living in reused memory)."""

    __slots__ = ("label", "run", "ins", "outs", "ws", "pads", "out_tensors", "phase")

    def __init__(self, label: str, run: Callable, ins: list, outs: list, ws: list, pads: list,
                 out_tensors: list, phase: str):
        self.label, self.run, self.ins, self.outs, self.ws = label, run, ins, outs, ws
        self.pads, self.out_tensors, self.phase = pads, out_tensors, phase


class NumpyExecutor(HostTransfers):
    """Owns the arena of one plan and replays its bound steps. Implements ``ExecutorAPI``
    with direct views of the arena."""

    def __init__(self, plan: MemoryPlan, steps: list[tuple[str, Callable, list, list, list]]):
        self.plan = plan
        self.arena = allocate_arena(plan.total_bytes)
        self._writers: dict[str, Callable[[np.ndarray], None]] = {}  # write_input's, made once
        self._readers: dict[str, Callable[[], np.ndarray]] = {}
        tensors = plan.tensors

        shared = plan.padded_in_shared_slots()

        def view(name):
            return None if name is None else tensors[name].kernel_view(self.arena)

        def pad_views(names):
            return [v for n in names if n in shared
                    for v in tensors[n].layout.pad_views(self.arena, tensors[n].offset,
                                                         tensors[n].dtype)]

        self.steps = [BoundStep(label, run, [view(n) for n in ins], [view(n) for n in outs],
                                [t.kernel_view(self.arena) for t in ws], pad_views(outs),
                                [tensors[n] for n in outs if n is not None], phase)
                      for label, run, ins, outs, ws, phase in steps]
        self.phases: dict[str, list[BoundStep]] = {}
        for step in self.steps:
            self.phases.setdefault(step.phase, []).append(step)
        if len(self.phases) > 1 and Phase.FORWARD in self.phases:
            node = self.phases[Phase.FORWARD][0].label
            raise TrOnnxError(f"{node} has no training phase; a pass that adds nodes to a "
                              "training graph must give them one")

    def load_constants(self, values: dict[str, np.ndarray]) -> None:
        """Initial contents: parameters, constants, optimizer state with a non-zero start."""
        for name, data in values.items():
            t = self.plan.tensors[name]
            if t.alias_of is None:
                write_host(self.arena, t, data)

    # -- ExecutorAPI: host transfers are views of the arena ------------------------------------
    @property
    def memory(self) -> MemoryPlan:
        return self.plan

    def write_input(self, name: str, array) -> None:
        # a training step writes its batch here every step: the writer is made once
        writer = self._writers.get(name)
        if writer is None:
            writer = self._writers[name] = self.input_writer(name)
        write_host(self.arena, self.plan.tensors[name], array, writer=writer)

    write_tensor = write_input

    def read_output(self, name: str) -> np.ndarray:
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = self.output_reader(name)
        return read_host(self.arena, self.plan.tensors[name], reader=reader)

    def input_writer(self, name: str) -> Callable[[np.ndarray], None]:
        return host_writer(self.arena, self.plan.tensors[name])

    def output_reader(self, name: str) -> Callable[[], np.ndarray]:
        return host_reader(self.arena, self.plan.tensors[name])

    def read_scalar(self, name: str) -> float:
        return float(self.plan.tensors[name].kernel_view(self.arena).reshape(-1)[0])

    def write_scalar(self, name: str, value) -> None:
        self.plan.tensors[name].kernel_view(self.arena)[...] = value

    def copy_state_from(self, other: ExecutorAPI, names: Iterable[str]) -> None:
        if not isinstance(other, NumpyExecutor):
            super().copy_state_from(other, names)
            return
        tensors = self.plan.tensors
        for name in names:
            if name not in tensors:
                continue
            value = other.plan.tensors[name].kernel_view(other.arena)
            if isinstance(tensors[name].layout, GatherRowsLayout):  # rows in another order
                write_host(self.arena, tensors[name], value)
            else:
                np.copyto(tensors[name].kernel_view(self.arena), value)

    def all_finite(self, name: str) -> bool:
        x = self.plan.tensors[name].kernel_view(self.arena)
        return bool(np.isfinite(np.dot(x, x)))

    def zero(self, name: str) -> None:
        self.plan.tensors[name].kernel_view(self.arena).fill(0)

    def run(self, check_pads: bool = False, phase: str | None = None) -> None:
        """Replay the step. ``check_pads`` (a debug aid, slow) verifies after every kernel that
        the padded lanes of what it wrote are still zero, and names the node that broke them.
        Floating-point exceptions follow IEEE (log(0) = -inf, 0/0 = nan) silently, as in other
        ONNX runtimes."""
        steps = self.steps if phase is None else self.phases.get(phase, [])
        if _FP_STATE is None:
            with np.errstate(all="ignore"):
                self._run(check_pads, steps)
            return
        token = _FP_STATE.set(_make_fp_state(all="ignore"))  # np.errstate(all="ignore")
        try:
            self._run(check_pads, steps)
        finally:
            _FP_STATE.reset(token)

    def _run(self, check_pads: bool, steps: list[BoundStep]) -> None:
        for step in steps:
            for pad in step.pads:
                pad.fill(0)
            try:
                step.run(step.ins, step.outs, step.ws)
            except DistributedError:  # names the rank and the collective: what a user needs
                raise
            except Exception as exc:  # re-raised with the node named; the cause is chained
                raise KernelError(f"{step.label} failed in the numpy backend: {exc!r}") from exc
            if check_pads:
                for t in step.out_tensors:
                    if not pad_lanes_are_zero(self.arena, t):
                        raise KernelError(f"{step.label} left non-zero padded lanes in {t.name!r}")


def physical_memory_bytes() -> int | None:
    """This machine's RAM, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class NumpyBackend(Backend):
    name = "numpy"
    channel_align = 1

    def arena_limit(self) -> tuple[int | None, str]:
        limit = physical_memory_bytes()
        return limit, "this machine's physical memory"

    def executor(self, plan, cuda_graphs: str = "fallback") -> NumpyExecutor:
        memory = plan.memory
        steps = [(node.label, run, [v.name if v is not None else None for v in node.inputs],
                  [v.name if v is not None else None for v in node.outputs],
                  memory.workspaces.get(index, []), node.phase)
                 for index, node, run in plan.bindings]
        executor = NumpyExecutor(memory, steps)
        executor.load_constants({v.name: v.data for v in plan.graph.values.values()
                                 if v.data is not None and v.span_of is None})
        return executor

    def host_arrays(self, plan) -> list:
        return [step.run for step in plan.executor.steps]


BACKEND = NumpyBackend()
