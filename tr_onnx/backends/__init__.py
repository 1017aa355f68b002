"""Backends run a compiled plan. ``numpy`` is the reference (the CPU); ``cuda`` (CuPy, cuDNN,
CUDA Graphs) is imported only when asked for, so ``import tr_onnx`` never loads CuPy.

Both executors implement ``ExecutorAPI``: the sessions move data and run phases through it
and never index an arena themselves, so the same session code drives a NumPy arena on the CPU
and a device arena on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # the contract is training's; backends only read it
    from ..training.train_pass import TrainInfo

BACKENDS = ("numpy", "cuda")
DEFAULT_CHANNEL_ALIGN = {"numpy": 1, "cuda": 8}
CUDA_EXTRA = "pip install 'tr_onnx[cu13]'  (CUDA 12 drivers: 'tr_onnx[cu12]')"

@runtime_checkable
class ExecutorAPI(Protocol):
    """What a session asks of an executor. Arrays on the host side are compact logical (NCHW)
    NumPy arrays; the executor owns where and how they sit in its arena.

    ``write_input(name, array)``: a graph input or a per-step scalar (``__lr``...), before a run.
    ``read_output(name) -> array``: a host copy of any tensor of the plan (waits for the device).
    ``run(phase=None)``: one phase of the step (the plan's first when None).
    ``write_tensor(name, array)``: overwrite any tensor (parameters, optimizer state) between
    steps. ``read_scalar(name) -> float`` / ``write_scalar(name, value)``: one-element tensors.
    ``read_state(names) -> {name: array}`` / ``write_state({name: array})``: host copies of
    state by name (names the plan lacks are skipped on write). ``copy_state_from(other,
    names)``: the same tensors from another executor of the same plan family (the training
    plan's weights into an eval plan). ``all_finite(name)``: no NaN/Inf in the tensor.
    ``zero(name)``: fill the tensor (padded lanes too) with zeros. ``input_writer(name)`` /
    ``output_reader(name)``: ``write_input``/``read_output`` of that tensor prepared for a caller
    that calls them every run with arrays of the tensor's shape and dtype (checked by it).
    """

    def write_input(self, name: str, array) -> None: ...
    def read_output(self, name: str) -> np.ndarray: ...
    def input_writer(self, name: str) -> Callable[[np.ndarray], None]: ...
    def output_reader(self, name: str) -> Callable[[], np.ndarray]: ...
    def run(self, phase: str | None = None) -> None: ...
    def write_tensor(self, name: str, array) -> None: ...
    def read_scalar(self, name: str) -> float: ...
    def write_scalar(self, name: str, value) -> None: ...
    def read_state(self, names: Iterable[str]) -> dict[str, np.ndarray]: ...
    def write_state(self, values: dict[str, np.ndarray]) -> None: ...
    def copy_state_from(self, other: ExecutorAPI, names: Iterable[str]) -> None: ...
    def all_finite(self, name: str) -> bool: ...
    def zero(self, name: str) -> None: ...
    def run_step(self, info: TrainInfo, apply: bool) -> StepReport: ...


@dataclass(frozen=True)
class StepReport:
    """What one training step (``ExecutorAPI.run_step``) tells the host: the loss; ``bad``: the
    loss (or, without loss scaling, a gradient) was not finite, so nothing was committed or
    applied and the accumulated gradients were dropped; ``overflow``: loss scaling found a
    non-finite gradient and skipped the optimizer step; ``grad_norm``: the global gradient norm
    of an applied step (None otherwise); ``rejected``: the step was launched with a step number
    that assumed an earlier step applied, which was not -- it changed nothing and must be
    launched again (then ``bad`` is set too)."""

    loss: float
    bad: bool = False
    overflow: bool = False
    grad_norm: float | None = None
    rejected: bool = False


class HostTransfers:
    """``ExecutorAPI``'s state helpers on top of three primitives a backend provides:
    ``write_tensor``, ``read_output`` and ``memory`` (the MemoryPlan). The numpy executor
    overrides them with direct views; the cuda executor uses them as they are (each a host
    round trip, outside the captured step), except ``all_finite``, which it decides on the
    device and answers with a 4-byte flag."""

    def input_writer(self, name: str) -> Callable[[np.ndarray], None]:
        return partial(self.write_input, name)

    def output_reader(self, name: str) -> Callable[[], np.ndarray]:
        return partial(self.read_output, name)

    def read_scalar(self, name: str) -> float:
        return float(np.asarray(self.read_output(name)).reshape(-1)[0])

    def write_scalar(self, name: str, value) -> None:
        t = self.memory.tensors[name]
        self.write_tensor(name, np.full(t.shape, value, dtype=t.dtype))

    def read_state(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {n: self.read_output(n) for n in names}

    def write_state(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            if name in self.memory.tensors:
                self.write_tensor(name, value)

    def copy_state_from(self, other: ExecutorAPI, names: Iterable[str]) -> None:
        self.write_state(other.read_state([n for n in names if n in self.memory.tensors]))

    def all_finite(self, name: str) -> bool:
        x = self.read_output(name).reshape(-1)
        return bool(np.isfinite(np.dot(x, x)))

    def zero(self, name: str) -> None:
        t = self.memory.tensors[name]
        self.write_tensor(name, np.zeros(t.shape, t.dtype))

    def run_step(self, info: TrainInfo, apply: bool) -> StepReport:
        """One training step decided on the host between the phases (``info``: the plan's
        training contract): ``compute`` (and, when ``apply`` in a data-parallel plan,
        ``reduce``); a non-finite loss (or, without loss scaling, gradient) drops the batch and
        the gradients accumulated since the last step -- on every rank, when any rank's was
        -- else ``commit`` and, when ``apply``, ``apply`` (reading back the norm and the
        overflow flag)."""
        scaling = info.loss_scaling
        self.run(phase="compute")
        if apply and info.world is not None:  # GRAD averaged over the ranks (data parallel)
            self.run(phase="reduce")
        value = self.read_scalar(info.loss)
        bad = not (np.isfinite(value) and (scaling is not None
                                           or self.all_finite(info.grads_span)))
        if not apply and info.world is not None:
            # a micro-batch's fate is agreed, as one process with the ranks' batches together
            # would decide it; an applied step's is already the same on every rank (the
            # reduction spread any rank's non-finite loss or gradient to all)
            bad = info.world.allreduce_scalars([float(bad)])[0] > 0
        if bad:
            self.zero(info.grads_span)
            return StepReport(value, bad=True)
        self.run(phase="commit")
        if not apply:
            return StepReport(value)
        self.run(phase="apply")
        return StepReport(value, overflow=scaling is not None and
                          self.read_scalar(scaling.found_inf) != 0.0,
                          grad_norm=self.read_scalar(info.grad_norm))


CUDA_GRAPHS = ("fallback", "require", "off")
"""The sessions' ``cuda_graphs=``: capture with an eager fallback that warns, capture or fail,
never capture (``CudaExecutor``)."""


def check_cuda_graphs(mode: str) -> str:
    if mode not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs={mode!r}; valid: {', '.join(CUDA_GRAPHS)}")
    return mode


def cuda_unavailable_reason() -> str | None:
    """Why the cuda backend cannot run here (None when it can). Never raises; imports CuPy only
    inside ``tr_onnx.backends.cuda.device.cuda_available``."""
    from .cuda.device import cuda_available

    if cuda_available():
        return None
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy whose CUDA libraries do not load
        return f"CuPy is not importable ({type(exc).__name__}: {exc}); install {CUDA_EXTRA}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, or a driver too old for CuPy
        return (f"CuPy is installed but no CUDA driver/GPU is usable ({exc}); the cuda backend "
                f"needs an NVIDIA GPU with a driver matching the CuPy build ({CUDA_EXTRA})")
    return f"CuPy sees {count} usable GPU(s) but cupy.cuda.is_available() is False"


def resolve_backend(name: str) -> str:
    """``auto`` picks cuda when a GPU is usable, numpy otherwise; ``cuda`` without a usable GPU
    raises ``TrOnnxError`` saying why (no CuPy, no driver) and what to install; unknown names
    list the valid ones."""
    from ..errors import TrOnnxError

    if name == "auto":  # no reason needed: CuPy is imported only where a driver loads
        from .cuda.device import cuda_available

        return "cuda" if cuda_available() else "numpy"
    if name not in BACKENDS:
        raise TrOnnxError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)} (or 'auto')")
    if name == "cuda":
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise TrOnnxError(f"backend 'cuda' is not usable here: {reason}. Use backend='numpy' "
                              "(or 'auto', which picks numpy without a GPU)")
    return name
