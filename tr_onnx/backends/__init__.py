"""Backends run a compiled plan. ``numpy`` is the reference (the CPU); ``cuda`` (CuPy, cuDNN,
CUDA Graphs) is imported only when asked for, so ``import tr_onnx`` never loads CuPy.

Both executors implement ``ExecutorAPI``: the sessions move data and run phases through it
and never index an arena themselves, so the same session code drives a NumPy arena on the CPU
and a device arena on the GPU.

Each backend is one ``Backend`` object (``numpy_backend.BACKEND``, ``cuda.backend.BACKEND``):
what the compiler and the sessions ask of a backend, so that compiling a plan compares no
backend names. They are found by name (``backend_named``) in a registry that the builtins join when
first asked for, by module name (as pytest loads its own builtin plugins), and that a plugin
fills with ``register_backend``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ..errors import TrOnnxError

if TYPE_CHECKING:
    from ..ir import Graph
    from ..opdef import KernelContext

BUILTIN_BACKENDS = {"numpy": "tr_onnx.backends.numpy_backend",
                    "cuda": "tr_onnx.backends.cuda.backend"}
"""The builtin backends' names and the modules whose ``BACKEND`` each is."""
BACKENDS = tuple(BUILTIN_BACKENDS)
AUTO_ORDER = ("cuda", "numpy")  # what ``auto`` tries, the first usable one wins
HOST_BACKEND = "numpy"
"""The backend that runs on the host, where the reference kernels are: a data-dependent
region's sub-plans run there whatever the outer plan's backend."""


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


CUDA_GRAPHS = ("fallback", "require", "off")
"""The sessions' ``cuda_graphs=``: capture with an eager fallback that warns, capture or fail,
never capture (``CudaExecutor``)."""


def check_cuda_graphs(mode: str) -> str:
    if mode not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs={mode!r}; valid: {', '.join(CUDA_GRAPHS)}")
    return mode


class Backend:
    """One backend: everything a plan's compilation and a session ask of it. ``name`` is the
    key of its kernels in the op registry; ``channel_align`` the channel multiple its plans pad
    to unless the session says otherwise. A subclass per backend overrides what differs."""

    name: ClassVar[str]
    channel_align: ClassVar[int]
    decides_steps: ClassVar[bool] = False
    """Whether a training plan carries the step guard (``train_pass.add_step_guard``): the
    device decides inside the captured step whether a batch is kept, and the host reads one
    report per step (``training.step_policy``), instead of deciding between the phases."""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here (None when it can). Never raises."""
        return None

    def usable(self) -> bool:
        """Whether ``auto`` may pick it: a cheap check, never importing a heavy library where
        it could not run anyway."""
        return self.unavailable_reason() is None

    def kernel_factory(self, kernel) -> Callable[[KernelContext], Any]:
        """The factory a registry kernel of this backend stands for (``opdef.kernels[name]``);
        called once per node at plan time, it sizes its scratch and returns what runs."""
        return kernel

    def min_workspace_bytes(self, graph: Graph) -> int:
        """The smallest WORKSPACE region a plan of ``graph`` needs besides its kernels'
        scratch (the cuda backend stages host transfers through it)."""
        return 0

    def arena_limit(self) -> tuple[int | None, str]:
        """The arena size a plan may not exceed when the session sets no ``max_arena_bytes``,
        and how to name that limit (None: no check before allocating, the device says)."""
        return None, ""

    def executor(self, plan, cuda_graphs: str = "fallback") -> ExecutorAPI:
        """The executor of ``plan`` (a ``compiler.CompiledPlan`` for this backend, its kernels
        made in ``plan.bindings``), its arena allocated and the plan's constants loaded.
        ``cuda_graphs``: the sessions' capture mode, for a backend that captures its steps."""
        raise NotImplementedError

    def on_device(self, device: Callable[[Any], Any]) -> Backend:
        """This backend with its executors over ``device`` (``device(plan)``: a test double
        such as a recorder, which binds a plan without running it); a backend with no device
        of its own is itself."""
        return self

    def plan_report(self, plan, target=None) -> dict:
        """What ``tr-onnx inspect`` adds about a plan of this backend: ``paths``, per
        (domain, op, since_version), how its nodes run ({path: count}), and ``cudnn_graphs``;
        ``target``: the GPU properties to check graphs against. Nothing by default."""
        return {}

    def host_arrays(self, plan) -> list:
        """The objects whose NumPy arrays ``plan``'s bound kernels made for themselves at plan
        time (``compiler.plan_bytes`` counts them): none where kernels run on a device."""
        return []


_REGISTERED: dict[str, Backend] = {}


def register_backend(backend: Backend, replace: bool = False) -> None:
    """Make ``backend`` known by its name, to the sessions' ``backend=`` and the CLI. A name
    registered twice raises unless ``replace``."""
    if backend.name in _REGISTERED and not replace:
        raise ValueError(f"backend {backend.name!r} is registered already "
                         f"({type(_REGISTERED[backend.name]).__qualname__})")
    _REGISTERED[backend.name] = backend


def available_backends() -> list[str]:
    """The names ``backend=`` takes (besides ``auto``): the builtins, then those registered."""
    return list(dict.fromkeys((*BACKENDS, *_REGISTERED)))


def backend_named(name: str) -> Backend:
    """The ``Backend`` registered as ``name`` (a builtin's module is imported when first asked
    for); an unknown name lists the valid ones. Says nothing about whether it can run here."""
    if name not in _REGISTERED and name in BUILTIN_BACKENDS:
        register_backend(importlib.import_module(BUILTIN_BACKENDS[name]).BACKEND)
    if name not in _REGISTERED:
        raise TrOnnxError(f"unknown backend {name!r}; available: "
                          f"{', '.join(available_backends())} (or 'auto')")
    return _REGISTERED[name]


def backend_for(spec: str | Backend) -> Backend:
    """The ``Backend`` a session's ``backend=`` names: a ``Backend`` itself (a test's emulated
    cuda) or a name (``resolve_backend``)."""
    if isinstance(spec, Backend):
        _check_usable(spec)
        return spec
    return backend_named(resolve_backend(spec))


def resolve_backend(name: str) -> str:
    """``auto`` picks cuda when a GPU is usable, numpy otherwise; ``cuda`` without a usable GPU
    raises ``TrOnnxError`` saying why (no CuPy, no driver) and what to install; unknown names
    list the valid ones."""
    if name == "auto":  # no reason needed: CuPy is imported only where a driver loads
        return next(n for n in AUTO_ORDER if backend_named(n).usable())
    _check_usable(backend_named(name))
    return name


def _check_usable(backend: Backend) -> None:
    reason = backend.unavailable_reason()
    if reason is not None:
        raise TrOnnxError(f"backend {backend.name!r} is not usable here: {reason}. Use "
                          "backend='numpy' (or 'auto', which picks numpy without a GPU)")
