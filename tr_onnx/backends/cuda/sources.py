"""The registry of tr_onnx's own CUDA kernel sources: family name -> source text, kernel names
and NVRTC options.

A family is one op family, named like its NumPy module in ``tr_onnx/ops/`` (``unary``,
``elementwise``, ``pool``, ...; ``amp`` is the training step's loss scaling and step guard),
and one ``kernels/<family>.cu`` file. The file defines macros (``TR_UNARY(op, T, dt)``, ...)
over the shared headers (``HEADERS``: the host/device shim and per-element math of
``elementwise.cuh``, the index math of ``layout.cuh`` and ``strided.cuh``); each family's table
(``KERNELS`` in the family's bindings module, ``FAMILY_MODULES``) appends the macro invocations
and names the ``extern "C"`` entry points they define, both from the same loops, so the list of
kernels is written once, beside the code that launches them; this module has the helpers those
tables are written with and the compilers. Kernel names end in the
storage type: ``_f32``, ``_f16`` or ``_bf16`` (``_<src>_<dst>`` for conversions, ``_b<bytes>``
for the kernels that move bit patterns); all compute in fp32.

The executor names kernels only (``b.launch("tr_relu_fwd_f32", ...)``); ``family_of`` finds the
family whose module holds one, so kernels can move between families without touching bindings.

The same text compiles with NVRTC for the device and with a host C++ compiler (the tests):
``elementwise.cuh`` defines ``TR_HD`` and ``TR_KERNEL`` for both. CuPy is imported only inside
the functions that compile, so importing this module needs no GPU, driver or CuPy.

Every source compiles with ``--fmad=false``: the plain arithmetic then rounds as NumPy's does
(the reference kernels), notably in the optimizer updates.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ...errors import TrOnnxError
from ...registry import BUILTIN_BACKEND_KERNELS

KERNEL_DIR = Path(__file__).with_name("kernels")

HEADERS = ("elementwise.cuh", "layout.cuh", "strided.cuh")
"""The headers in ``kernels/`` that families share (never a second copy of a helper in a .cu)."""

# storage suffix -> C type (elementwise.cuh: tr_f16 is __half / _Float16, tr_bf16 is
# __nv_bfloat16 / a host shim)
DTYPES = {"f32": "float", "f16": "tr_f16", "bf16": "tr_bf16"}


class KernelCompileError(TrOnnxError):
    """NVRTC rejected a source (or found no CUDA headers); the message carries NVRTC's log."""


@dataclass(frozen=True)
class KernelSource:
    """One family: ``file`` in ``directory`` (tr_onnx's ``kernels/`` by default; an op set
    outside tr_onnx keeps its .cu beside its module) plus ``instances`` (macro invocations
    appended to it); ``kernels`` are the ``extern "C"`` names the text defines. The text may
    include the shared headers (``HEADERS``): every compile puts ``kernels/`` on the include
    path."""

    name: str
    file: str
    instances: tuple[str, ...]
    kernels: tuple[str, ...]
    directory: Path = KERNEL_DIR

    @cached_property
    def text(self) -> str:
        body = (self.directory / self.file).read_text()
        return (body + "\n// instances (the family's KERNELS table in its bindings' module)\n"
                + "\n".join(self.instances) + "\n")


# ---- helpers of the family tables ------------------------------------------------------------
# An axis is a tuple of field dicts; ``instantiate`` formats a macro invocation and the kernel
# names it defines for every combination of its axes' fields.

Fields = dict[str, str]
Table = tuple[tuple[str, ...], tuple[str, ...]]
"""(macro invocations, kernel names)."""

STORAGE: tuple[Fields, ...] = tuple({"dt": dt, "T": t} for dt, t in DTYPES.items())
"""The storage types: ``{dt}`` the kernel-name suffix, ``{T}`` its C type."""

BIT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
"""Element size in bytes -> the unsigned C type a bit-pattern kernel moves."""


def values(field: str, items: Sequence[str]) -> tuple[Fields, ...]:
    """An axis of one field: ``{field}`` takes each of ``items``."""
    return tuple({field: v} for v in items)


def widths(*sizes: int) -> tuple[Fields, ...]:
    """An axis of element sizes: ``{bytes}`` and its unsigned C type ``{U}``."""
    return tuple({"bytes": str(b), "U": BIT_TYPES[b]} for b in sizes)


def storage_pairs(pairs: Sequence[tuple[str, str]]) -> tuple[Fields, ...]:
    """An axis of (source, destination) storage: ``{sdt}``/``{S}`` and ``{ddt}``/``{D}``."""
    return tuple({"sdt": s, "S": DTYPES[s], "ddt": d, "D": DTYPES[d]} for s, d in pairs)


def instantiate(macro: str, kernels: str | tuple[str, ...], *axes: tuple[Fields, ...]) -> Table:
    """``macro`` (a format string) once per combination of ``axes``, and the ``kernels``
    (format strings over the same fields) each invocation defines."""
    kernels = (kernels,) if isinstance(kernels, str) else kernels
    inst, names = [], []
    for combo in itertools.product(*axes):
        fields = {k: v for f in combo for k, v in f.items()}
        inst.append(macro.format(**fields))
        names += [k.format(**fields) for k in kernels]
    return tuple(inst), tuple(names)


def plain(*kernels: str) -> Table:
    """Kernels the .cu text defines itself (no macro, one type)."""
    return (), kernels


def kernel_source(family: str, *tables: Table) -> KernelSource:
    """Family ``family``: ``kernels/<family>.cu`` with the ``tables``' invocations appended."""
    return KernelSource(family, f"{family}.cu", tuple(i for t in tables for i in t[0]),
                        tuple(k for t in tables for k in t[1]))


FAMILY_MODULES = tuple(m for m in BUILTIN_BACKEND_KERNELS
                       if m.startswith("tr_onnx.backends.cuda.ops."))
"""The modules (the registry's builtin cuda op sets) whose ``KERNELS`` (one KernelSource, or
several) are tr_onnx's kernel families: each family's table sits in its bindings' module
(``backends/cuda/ops/<family>.py``), beside the code that launches it; ``amp`` (loss scaling,
the step guard) with the optimizers'; conv has none (cuDNN only)."""


@functools.cache
def builtin_sources() -> dict[str, KernelSource]:
    """Family name -> KernelSource of every module of ``FAMILY_MODULES``."""
    families = []
    for module in FAMILY_MODULES:
        kernels = getattr(importlib.import_module(module), "KERNELS", ())  # conv: cuDNN only
        families += kernels if isinstance(kernels, tuple) else [kernels]
    return {f.name: f for f in families}


@functools.cache
def _family_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for family, src in builtin_sources().items():
        for name in src.kernels:
            if name in index:
                raise KeyError(f"kernel {name!r} is defined by families {index[name]!r} and "
                               f"{family!r}")
            index[name] = family
    return index


def family_of(kernel: str) -> str:
    """The family whose source defines ``kernel`` (an ``extern "C"`` name)."""
    family = _family_index().get(kernel)
    if family is None:
        raise KeyError(f"no kernel source defines {kernel!r}")
    return family


def __getattr__(name: str):
    if name == "SOURCES":  # built on first use: the family modules import this one
        return builtin_sources()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cuda_include_dir() -> str:
    """A directory holding ``cuda_fp16.h`` / ``cuda_bf16.h``: ``$CUDA_PATH`` / ``$CUDA_HOME``
    when set (what a user names wins over what is found), else the ``nvidia-cuda-runtime``
    wheel or a toolkit as ``cuda.pathfinder`` (a CuPy 14 dependency) finds them, else
    ``/usr/local/cuda``."""
    candidates = [os.path.join(os.environ[env], "include") for env in ("CUDA_PATH", "CUDA_HOME")
                  if os.environ.get(env)]
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except ImportError:
        pass
    candidates.append("/usr/local/cuda/include")
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            return d
    raise KernelCompileError(
        f"no CUDA headers (cuda_fp16.h) in {candidates}; install the test extra "
        "(nvidia-cuda-runtime) or a CUDA toolkit, or set CUDA_PATH")


def compile_options(arch: str = "sm_90") -> list[str]:
    """NVRTC options of every source (``arch``: ``sm_XX`` for a cubin, ``compute_XX`` for PTX)."""
    return [f"-arch={arch}", "-std=c++17", "--fmad=false", f"-I{KERNEL_DIR}",
            f"-I{cuda_include_dir()}"]


def nvrtc_compile(text: str, file: str, options: list[str], label: str) -> bytes:
    """Compile CUDA ``text`` with CuPy's low-level NVRTC binding (no driver or GPU needed): the
    cubin for ``-arch=sm_XX``, PTX for ``-arch=compute_XX``. Raises KernelCompileError naming
    ``label``, with the compiler log."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(text, file, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise KernelCompileError(f"NVRTC failed on {label} with {options}:\n"
                                     f"{nvrtc.getProgramLog(prog)}") from e
        ptx = any(o.startswith("-arch=compute_") for o in options)
        return nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_nvrtc(name: str, arch: str = "sm_90") -> bytes:
    """Compile family ``name``: the cubin for ``sm_XX``, PTX for ``compute_XX``."""
    src = builtin_sources()[name]
    return nvrtc_compile(src.text, src.file, compile_options(arch),
                         f"kernels/{src.file} ({name})")


def compile_all_nvrtc(arch: str = "sm_90") -> dict[str, bytes]:
    """Every family compiled for ``arch``: {name: cubin (or PTX) bytes}."""
    return {name: compile_nvrtc(name, arch) for name in builtin_sources()}
