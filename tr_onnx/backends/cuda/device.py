"""The real device: ``CupyDevice`` implements ``capture.DeviceAPI`` with CuPy and the cuDNN
frontend, for one MemoryPlan.

Importing this module needs neither CuPy nor a GPU: ``cupy`` and ``cudnn`` are imported inside
``CupyDevice`` and ``cuda_available``, so only asking for the cuda backend loads them. The pure
helpers (``KernelRef``, ``launch_dims``) are shared with the executor and its CPU tests.

What the device owns: one arena (a single ``cupy.empty(total_bytes, uint8)`` whose base is
256-byte aligned, zeroed once so padded lanes start at zero), one non-blocking stream
(graph capture cannot use the legacy default stream), the compiled kernel modules (one per
source family, compiled by NVRTC for this device's architecture and cached), a cuDNN handle
bound to the stream, and the pinned host buffers of the input/output transfers.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...ir import Phase
from ...memory import ALIGN, MemoryPlan
from .capture import AllocationGuard, DeviceBuffer

BLOCK = 256  # threads per block of the grid-stride kernels
MAX_BLOCKS = 65535 * 4  # grid-stride loops cover the rest; keeps the grid well inside limits


@dataclass(frozen=True)
class KernelRef:
    """A kernel entry point: ``name`` in source ``family`` (a ``sources.SOURCES`` key), or in a
    plugin's ``CudaKernel.source`` (``family`` ``"plugin:<domain>/<op>"``, text in ``source``)."""

    family: str
    name: str
    source: str | None = field(default=None, compare=False, repr=False)


def launch_dims(n: int, block: int = BLOCK) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) for a grid-stride kernel over ``n`` elements: one thread per element up
    to ``MAX_BLOCKS`` blocks, at least one block (a kernel over 0 elements still launches, so a
    captured graph has the same nodes for every shape)."""
    blocks = max(1, min(-(-int(n) // block), MAX_BLOCKS))
    return (blocks, 1, 1), (block, 1, 1)


def driver_loads() -> bool:
    """Whether the CUDA driver library loads. Without it no GPU is usable, and importing CuPy
    to learn that costs about 200 MB of memory and a second (a numpy session made with the
    default backend ``auto`` paid both)."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def cuda_available() -> bool:
    """True when CuPy imports and sees a usable GPU. Never raises (False without CuPy, driver
    or device); without a driver library CuPy is not imported at all."""
    if not driver_loads():
        return False
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # ImportError, CUDARuntimeError, a broken install: not usable
        return False


def _c_arg(a: Any) -> Any:
    """A launch argument as CuPy passes it by value: pointers as 64-bit integers."""
    if isinstance(a, DeviceBuffer):
        return np.uint64(a.ptr)
    if a is None:
        return np.uint64(0)  # an absent optional buffer: a null pointer
    return a


class CupyDevice:
    """``DeviceAPI`` over CuPy for ``plan`` (see the module docstring).

    ``device_id``: the CUDA device; ``arch``: NVRTC target (default: this device's
    ``sm_XY``). Raises ``RuntimeError`` naming what is missing when CuPy or the GPU is not
    usable.
    """

    allocation_guard = AllocationGuard  # held while capturing: CuPy allocations raise

    def __init__(self, plan: MemoryPlan, device_id: int = 0, arch: str | None = None):
        import cupy

        if not cuda_available():
            raise RuntimeError("the cuda backend needs a usable GPU and CuPy "
                               "(cupy-cuda12x / cupy-cuda13x); cupy.cuda.is_available() is False")
        self.cupy = cupy
        self.plan = plan
        self.device_id = device_id
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        major, minor = self.device.compute_capability[:-1], self.device.compute_capability[-1]
        self.arch = arch or f"sm_{major}{minor}"
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # one allocation; the base is rounded up to 256 bytes inside it
        self._raw = cupy.zeros(plan.total_bytes + ALIGN, dtype=cupy.uint8)
        start = (-self._raw.data.ptr) % ALIGN
        self.arena = self._raw[start:start + plan.total_bytes]
        self.arena_base = int(self.arena.data.ptr)
        self._functions: dict[KernelRef, Any] = {}
        self._cudnn = None
        self._handle = None
        self._pinned: list[tuple[Any, np.ndarray, Any]] = []
        self._allocations: list[Any] = []
        self.node, self.phase = "<no node>", Phase.FORWARD
        self.device.synchronize()  # the zeroed arena is ready before any stream work

    # -- kernels -----------------------------------------------------------------------------
    def _module(self, ref: KernelRef):
        """The loaded module of ``ref``'s family: one per process and device (every plan's
        device shares it; modules are never unloaded, so none is collected mid-capture)."""
        key = (self.device.id, self.arch, ref.family, ref.source)
        mod = _MODULES.get(key)
        if mod is None:
            from cupy.cuda import function

            mod = function.Module()
            mod.load(kernel_image(ref.family, self.arch, ref.source))
            _MODULES[key] = mod
        return mod

    def prepare_kernel(self, ref: KernelRef) -> None:
        """Compile and load ``ref``'s module and look the function up (at bind time: never
        during capture)."""
        key = (ref, ref.source)
        if key not in self._functions:
            self._functions[key] = self._module(ref).get_function(ref.name)

    def launch(self, kernel: KernelRef, grid: tuple, block: tuple, args: Sequence[Any]) -> None:
        fn = self._functions.get((kernel, kernel.source))
        if fn is None:
            self.prepare_kernel(kernel)
            fn = self._functions[(kernel, kernel.source)]
        fn(tuple(grid), tuple(block), tuple(_c_arg(a) for a in args), stream=self.stream)

    # -- cuDNN -------------------------------------------------------------------------------
    def _cudnn_handle(self):
        if self._handle is None:
            import cudnn

            self._cudnn = cudnn
            self._handle = cudnn.create_handle()
            cudnn.set_stream(handle=self._handle, stream=self.stream.ptr)
        return self._handle

    def build_cudnn(self, desc):
        """Declare, validate and build ``desc`` (``cudnn_graphs.GraphDesc``) on this device,
        with the process's cuDNN kernel cache (the same kernels are not built for every plan)."""
        from .cudnn_graphs import build_pygraph

        handle = self._cudnn_handle()
        return build_pygraph(desc, self._cudnn, handle, kernel_cache=cudnn_kernel_cache())

    def cudnn_execute(self, graph, pointers: dict[str, int], workspace: int) -> None:
        """The graph's tensors at ``pointers``; its scalars are runtime parameters of the graph
        (``cudnn_graphs.declare_pygraph``), so nothing host-side enters the pack."""
        pack = {graph.tensors[p]: ptr for p, ptr in pointers.items()}
        graph.graph.execute(pack, workspace, handle=self._cudnn_handle())

    # -- memory and copies -------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        mem = self.cupy.cuda.alloc(nbytes)
        self._allocations.append(mem)  # kept alive as long as the device
        return int(mem.ptr)

    def pinned_buffers(self, nbytes: int, count: int = 2) -> list[np.ndarray]:
        """``count`` page-locked host buffers of ``nbytes`` (uint8 views), each with an event
        that ``wait_host_buffer`` waits on before the host overwrites it."""
        self._pinned = []
        for _ in range(count):
            mem = self.cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
            view = np.frombuffer(mem, np.uint8, max(nbytes, 1))
            self._pinned.append((mem, view, self.cupy.cuda.Event(disable_timing=True)))
        return [view for _, view, _ in self._pinned]

    def record_host_buffer(self, index: int) -> None:
        """Mark the copies issued so far from/to pinned buffer ``index``."""
        self.stream.record(self._pinned[index][2])

    def wait_host_buffer(self, index: int) -> None:
        """Block the host until pinned buffer ``index``'s recorded copies are done."""
        self._pinned[index][2].synchronize()

    @staticmethod
    def _ptr(x) -> int:
        if isinstance(x, DeviceBuffer):
            return x.ptr
        return x.ctypes.data if isinstance(x, np.ndarray) else int(x)

    def memcpy_async(self, dst, src, nbytes: int, kind: str) -> None:
        from cupy.cuda import runtime

        kinds = {"h2d": runtime.memcpyHostToDevice, "d2h": runtime.memcpyDeviceToHost,
                 "d2d": runtime.memcpyDeviceToDevice}
        runtime.memcpyAsync(self._ptr(dst), self._ptr(src), nbytes, kinds[kind], self.stream.ptr)

    def memcpy(self, dst, src, nbytes: int, kind: str) -> None:
        self.memcpy_async(dst, src, nbytes, kind)
        self.stream.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()

    # -- capture -----------------------------------------------------------------------------
    def begin_node(self, label: str, phase: str) -> None:
        self.node, self.phase = label, phase

    def begin_capture(self) -> None:
        self.stream.begin_capture()

    def end_capture(self):
        graph = self.stream.end_capture()
        graph.upload(self.stream)
        return graph

    def abort_capture(self) -> None:
        """End a capture that failed, whatever state it is in, so the stream is usable for the
        eager fallback: CuPy's capture query raises on a capture the driver invalidated, and
        the stream stays in capture mode until ``end_capture`` is called."""
        try:
            capturing = self.stream.is_capturing()
        except RuntimeError:  # cudaErrorStreamCaptureInvalidated: still capturing
            capturing = True
        if capturing:
            try:
                self.stream.end_capture()  # discards the partial graph
            except RuntimeError:  # an invalidated capture raises here; the stream is usable again
                pass

    def launch_graph(self, graph) -> None:
        graph.launch(self.stream)

    # -- collectives -------------------------------------------------------------------------
    def nccl_all_reduce(self, comm, buf: DeviceBuffer, count: int, dtype: int, op: int) -> None:
        """In-place NCCL all-reduce of ``buf`` on the step's stream (captured with the step)."""
        comm.allReduce(buf.ptr, buf.ptr, count, dtype, op, self.stream.ptr)

    def nccl_broadcast(self, comm, buf: DeviceBuffer, count: int, dtype: int, root: int) -> None:
        """In-place NCCL broadcast of rank ``root``'s ``buf`` on the step's stream."""
        comm.broadcast(buf.ptr, buf.ptr, count, dtype, root, self.stream.ptr)


@functools.cache
def cudnn_kernel_cache():
    """The process's cuDNN kernel cache (``cudnn.create_kernel_cache``), shared by every
    plan's graphs and kept for the process."""
    import cudnn

    return cudnn.create_kernel_cache()


_MODULES: dict[tuple, Any] = {}
"""(device id, arch, family, source) -> loaded CUDA module, for the process."""


@functools.cache
def kernel_image(family: str, arch: str, source: str | None = None) -> bytes:
    """Family ``family`` compiled by NVRTC for ``arch``, once per process (NVRTC takes
    seconds per family): tr_onnx's own when ``source`` is None, else the text an op set
    brings."""
    from . import sources

    if source is None:
        return sources.compile_nvrtc(family, arch)
    return compile_text_nvrtc(source, family, arch)


def compile_text_nvrtc(text: str, name: str, arch: str) -> bytes:
    """Compile CUDA source ``text`` that an op set brings (a plugin's ``CudaKernel``, a family
    of its own) with the options of tr_onnx's own sources: ``kernels/`` and the CUDA headers
    on the include path (so it may build on ``elementwise.cuh``), ``--fmad=false``."""
    from .sources import compile_options, nvrtc_compile

    return nvrtc_compile(text, name.replace("/", "_").replace(":", "_") + ".cu",
                         compile_options(arch), name)


__all__ = ["BLOCK", "CupyDevice", "KernelRef", "compile_text_nvrtc", "cuda_available",
           "launch_dims"]
