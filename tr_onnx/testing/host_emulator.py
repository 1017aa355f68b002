"""Runs the cuda executor on the CPU through the kernels' host build, for CI and debugging.

``build_host_library()`` compiles the CUDA kernel sources with the host C++ compiler (their
host-and-device macro makes them plain C++); ``HostEmulator`` is a device for ``CudaExecutor``
that records like ``FakeRecorder`` (capture discipline, pointers, write regions) and runs what
it records on a NumPy arena at a fake device address: kernels through the host build, cuDNN
graphs through their nodes' numpy kernels (with the activation fused into a conv's epilogue),
copies with memmove. ``emulated_cuda(lib)`` is the cuda ``Backend`` over it that the sessions'
``backend=`` and ``compile_plan`` take; ``host_emulator(lib)`` its device factory.

A kernel that brings its own source text (a plugin's ``CudaKernel``, an op set's own
``KernelSource`` passed as ``BindContext.launch(..., family=...)``) runs from a host build of
that text: ``family_library`` compiles it on first use with the same command as
``build_host_library`` (``compile_host``), once per text and process, so the many plans of a
test session share it. Such a source must compile as host C++: written over
``elementwise.cuh``'s helpers (``TR_KERNEL``, ``TR_HD``, ``TR_GRID_STRIDE``, ``tr_get`` /
``tr_put``) it does; CUDA-only code (``__global__`` / ``__device__`` rather than those macros,
PTX ``asm``, intrinsics such as ``__expf``) is a ``HostCompileError`` naming the family.

Importing this module needs no GPU and does not import CuPy.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..backends.cuda import sources
from ..backends.cuda.backend import CudaBackend
from ..backends.cuda.capture import DeviceBuffer
from ..backends.cuda.executor import EXECUTOR_POLICY
from ..backends.numpy_backend import allocate_arena
from ..compiler import kernel_context
from ..errors import InternalError
from .recorder import FakeRecorder

BASE = 1 << 40
"""The fake device address of the emulated arena."""

_CTYPES = {np.int64: ctypes.c_longlong, np.float32: ctypes.c_float,
           np.float64: ctypes.c_double, np.int32: ctypes.c_int}


def host_compiler() -> str:
    """The host C++ compiler: ``$CXX``, else g++, c++ or clang++ on PATH."""
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise RuntimeError("the host build of the cuda kernels needs a C++ compiler (g++) on PATH")


HOST_FLAGS = ("-x", "c++", "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared")
"""The host build's flags: the text as C++17, no FMA contraction (as NVRTC's ``--fmad=false``:
plain arithmetic rounds as NumPy's does), a shared library for ctypes."""


class HostCompileError(sources.KernelCompileError, RuntimeError):
    """The host C++ compiler rejected a kernel source; the message names the source (the
    family) and carries the command and the compiler's log. A ``KernelCompileError`` like
    NVRTC's rejections, and a RuntimeError as ``build_host_library`` always raised."""


def compile_host(text: str, out_dir: Path, stem: str, label: str,
                 extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """``text`` compiled with ``host_compiler()`` and ``HOST_FLAGS`` (then ``extra_flags``; a
    later ``-O`` wins) against the headers in ``sources.KERNEL_DIR``, into
    ``out_dir/<stem>.so``, loaded. Raises HostCompileError naming ``label``."""
    src, lib = out_dir / f"{stem}.cpp", out_dir / f"{stem}.so"
    src.write_text(text)
    cmd = [host_compiler(), *HOST_FLAGS, *extra_flags, f"-I{sources.KERNEL_DIR}", str(src),
           "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostCompileError(f"the host build of {label} failed:\n{' '.join(cmd)}\n"
                               f"{done.stderr}")
    return ctypes.CDLL(str(lib))


def build_host_library(out_dir: str | Path | None = None,
                       extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Every kernel source of ``sources.SOURCES`` compiled into one shared library under
    ``out_dir`` (default: a new temporary folder). ``extra_flags`` go after the defaults (the
    kernel tests add ``-O2 -Wall -Werror``; a later ``-O`` wins). Raises HostCompileError with
    the compiler's message if it fails."""
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="tr_onnx_host_kernels_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    text = "\n".join(s.text for s in sources.SOURCES.values())
    built = _BUILT.get((text, tuple(extra_flags)))
    if built is not None and built.exists():  # the same build in this process: a copy
        shutil.copyfile(built, out_dir / "kernels.so")
        return ctypes.CDLL(str(out_dir / "kernels.so"))
    lib = compile_host(text, out_dir, "kernels", "tr_onnx's kernel sources", extra_flags)
    _BUILT[(text, tuple(extra_flags))] = out_dir / "kernels.so"
    return lib


_BUILT: dict[tuple[str, tuple[str, ...]], Path] = {}
"""(source text, extra flags) -> a host build of this process (the tests build one per
module: compiling every family takes seconds, copying the library does not)."""


_FAMILY_LIBS: dict[str, ctypes.CDLL] = {}  # source text -> its host build, for this process
_family_dir: Path | None = None


def family_library(text: str, family: str) -> ctypes.CDLL:
    """The host build of a kernel source that is not one of tr_onnx's own (``KernelRef.source``
    of family ``family``): compiled on first use into a folder of this process, then cached by
    its text. Raises HostCompileError naming ``family`` if it does not compile as host C++."""
    lib = _FAMILY_LIBS.get(text)
    if lib is None:
        global _family_dir
        if _family_dir is None:
            _family_dir = Path(tempfile.mkdtemp(prefix="tr_onnx_host_families_"))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        label = f"kernel family {family!r} (as host C++: CUDA-only code has no host build)"
        lib = _FAMILY_LIBS[text] = compile_host(text, _family_dir, f"family_{digest}", label)
    return lib


class HostEmulator(FakeRecorder):
    """A ``CudaExecutor`` device on the CPU for ``plan`` (a ``CompiledPlan``).

    ``lib``: the library of ``build_host_library``; ``arena``: the device arena's starting
    contents (default: zeros, a fresh device arena, which the executor's ``load_constants``
    fills). Eager calls run at once; captured calls run when their graph is launched.
    """

    def __init__(self, plan, lib: ctypes.CDLL, arena: np.ndarray | None = None):
        super().__init__(plan.memory, BASE, policy=EXECUTOR_POLICY)
        self.lib = lib
        self.arena = allocate_arena(plan.memory.total_bytes) if arena is None else arena
        self.nodes = {n.label: n for n in plan.graph.nodes}
        self.producers = {v.name: n.label for n in plan.graph.nodes for v in n.outputs
                          if v is not None}
        self._numpy: dict[str, tuple] = {}  # node label -> its numpy kernel, bound (lazily)
        self._shared = plan.memory.padded_in_shared_slots()
        self.fused: dict[str, list[str]] = {}  # cuDNN node label -> nodes in its epilogue
        self.launched_graphs = 0

    def prepare_kernel(self, ref) -> None:
        """Find ``ref``'s entry point in its host build (at bind time): tr_onnx's library, or
        the source ``ref`` carries, compiled on first use (``family_library``)."""
        self.function(ref)

    def function(self, ref):
        """``ref``'s entry point (a ctypes function) in its host build."""
        lib = self.lib if ref.source is None else family_library(ref.source, ref.family)
        try:
            return getattr(lib, ref.name)
        except AttributeError:
            where = "tr_onnx's kernels" if ref.source is None else f"family {ref.family!r}"
            raise AttributeError(f"{self.node}: the host build of {where} has no kernel "
                                 f"{ref.name!r}") from None

    def build_cudnn(self, desc):
        """The declaration is the graph; a ReLU fused into the epilogue writes Y, so the node
        producing Y runs (as numpy) after the conv's own node."""
        if "relu" in desc.epilogue:
            self.fused.setdefault(desc.node, []).append(self.producers[desc.outputs["Y"].name])
        return desc

    def addr(self, x) -> int:
        """The host address of a device buffer (or of a host array)."""
        if isinstance(x, DeviceBuffer):
            if not BASE <= x.ptr <= BASE + self.arena.size:
                raise InternalError(f"{self.node}: pointer {x.ptr:#x} outside the emulated "
                                    "arena (the recorder's checks should have refused it)")
            return self.arena.ctypes.data + x.ptr - BASE
        return x.ctypes.data

    def _eager(self, call) -> None:
        if not self.capturing:  # a captured call runs when the graph is launched
            self.replay(call)

    def launch(self, kernel, grid, block, args):
        super().launch(kernel, grid, block, args)
        self._eager(self.calls[-1])

    def cudnn_execute(self, graph, pointers, workspace):
        super().cudnn_execute(graph, pointers, workspace)
        self._eager(self.calls[-1])

    def memcpy_async(self, dst, src, nbytes, kind):
        super().memcpy_async(dst, src, nbytes, kind)
        self._eager(self.calls[-1])

    def memcpy(self, dst, src, nbytes, kind):
        super().memcpy(dst, src, nbytes, kind)
        self.replay(self.calls[-1])

    def nccl_all_reduce(self, comm, buf, count, dtype, op):
        super().nccl_all_reduce(comm, buf, count, dtype, op)
        self._eager(self.calls[-1])

    def nccl_broadcast(self, comm, buf, count, dtype, root):
        super().nccl_broadcast(comm, buf, count, dtype, root)
        self._eager(self.calls[-1])

    def launch_graph(self, graph):
        self._record("launch_graph", calls=len(graph.calls))
        self.launched_graphs += 1
        for call in graph.calls:
            self.replay(call)

    def replay(self, call) -> None:
        """Run one recorded call on the arena."""
        if call.op == "launch":
            args = [ctypes.c_void_p(None) if a is None else
                    ctypes.c_void_p(self.addr(a)) if isinstance(a, DeviceBuffer) else
                    _CTYPES[type(a)](a) for a in call.args["args"]]
            fn = self.function(call.args["kernel"])
            fn.argtypes, fn.restype = [type(a) for a in args], None
            fn(*args)
        elif call.op == "cudnn_execute":
            self.numpy_node(call.node, call.args.get("node_inputs"))
            for label in self.fused.get(call.node, ()):
                self.numpy_node(label)
        elif call.op == "nccl_all_reduce":  # a host communicator (the tests'), host pointers
            a = call.args
            ptr = self.addr(a["buf"])
            a["comm"].allReduce(ptr, ptr, a["count"], a["dtype"], a["redop"], 0)
        elif call.op == "nccl_broadcast":
            a = call.args
            ptr = self.addr(a["buf"])
            a["comm"].broadcast(ptr, ptr, a["count"], a["dtype"], a["root"], 0)
        elif call.op in ("memcpy_async", "memcpy"):
            a = call.args
            ctypes.memmove(self.addr(a["dst"]), self.addr(a["src"]), a["nbytes"])

    def numpy_node(self, label: str, inputs: tuple[int, ...] | None = None) -> None:
        """Node ``label``'s numpy kernel (made from the registry's OpDef, with scratch of its
        own outside the arena), on this arena's views of its tensors; ``inputs``: only those
        of its inputs (what a cuDNN graph computes with, ``GraphDesc.node_inputs``)."""
        bound = self._numpy.get(label)
        if bound is None:
            node = self.nodes[label]
            if inputs is not None:
                node = copy.copy(node)
                node.inputs = [node.inputs[k] for k in inputs]
            ctx = kernel_context(node, "numpy")
            run = node.opdef.kernels["numpy"](ctx)
            scratch = [np.zeros(shape, dtype) for shape, dtype in ctx.workspace_requests]
            tensors = self.plan.tensors

            def views(values):
                return [None if v is None else tensors[v.name].kernel_view(self.arena)
                        for v in values]

            pads = [p for v in node.outputs if v is not None and v.name in self._shared
                    for p in tensors[v.name].layout.pad_views(self.arena, tensors[v.name].offset,
                                                              tensors[v.name].dtype)]
            bound = self._numpy[label] = (run, views(node.inputs), views(node.outputs), scratch,
                                          pads)
        run, ins, outs, scratch, pads = bound
        for pad in pads:
            pad.fill(0)
        with np.errstate(all="ignore"):
            run(ins, outs, scratch)


def host_emulator(lib: ctypes.CDLL | None = None):
    """The device factory of ``emulated_cuda``, ``CudaBackend(device=...)``:
    ``factory(plan) -> HostEmulator`` over ``lib`` (default: a fresh ``build_host_library()``)."""
    lib = build_host_library() if lib is None else lib

    def factory(plan) -> HostEmulator:
        return HostEmulator(plan, lib)

    return factory


def emulated_cuda(lib: ctypes.CDLL | None = None) -> CudaBackend:
    """The cuda backend with the host emulator over ``lib`` as its device (default: a fresh
    ``build_host_library()``): a session or ``compile_plan`` given it as ``backend=`` plans
    for cuda and runs on the CPU."""
    return CudaBackend(device=host_emulator(lib))
