"""The registry of tr_onnx's own CUDA kernel sources: family name -> source text, kernel names
and NVRTC options.

Each family is one ``kernels/<family>.cu`` file holding macros (``TR_UNARY(op, T, dt)``, ...)
and the per-element math of ``kernels/elementwise.cuh``; the tables below append the macro
invocations, so the list of kernels is written once, here, and ``KernelSource.kernels`` names
every ``extern "C"`` entry point the text defines. Kernel names end in the storage type:
``_f32``, ``_f16`` or ``_bf16`` (``_<src>_<dst>`` for conversions); all compute in fp32.

The same text compiles with NVRTC for the device and with a host C++ compiler (the tests):
``elementwise.cuh`` defines ``TR_HD`` and ``TR_KERNEL`` for both. CuPy is imported only inside
the functions that compile, so importing this module needs no GPU, driver or CuPy.

Every source compiles with ``--fmad=false``: the plain arithmetic then rounds as NumPy's does
(the reference kernels), notably in the optimizer updates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")

# storage suffix -> C type (elementwise.cuh: tr_f16 is __half / _Float16, tr_bf16 is
# __nv_bfloat16 / a host shim)
DTYPES = {"f32": "float", "f16": "tr_f16", "bf16": "tr_bf16"}

UNARY_OPS = ("relu", "leaky_relu", "elu", "sigmoid", "hardsigmoid", "hardswish", "tanh", "gelu",
             "gelu_tanh", "softplus", "exp", "log", "sqrt", "neg", "abs", "sign", "clip")
"""Kernel stems of ``tr_<op>_fwd_<dt>`` / ``tr_<op>_bwd_<dt>``."""

ONNX_UNARY = {
    "Relu": ("relu", ()), "LeakyRelu": ("leaky_relu", ("alpha",)), "Elu": ("elu", ("alpha",)),
    "Sigmoid": ("sigmoid", ()), "HardSigmoid": ("hardsigmoid", ("alpha", "beta")),
    "HardSwish": ("hardswish", ()), "Tanh": ("tanh", ()), "Gelu": ("gelu", ()),
    "Softplus": ("softplus", ()), "Exp": ("exp", ()), "Log": ("log", ()), "Sqrt": ("sqrt", ()),
    "Neg": ("neg", ()), "Abs": ("abs", ()), "Sign": ("sign", ()),
    "Clip": ("clip", ("min", "max")),
}
"""ONNX op -> (kernel stem, the attributes passed as the kernels' ``a``, ``b``). Gelu with
``approximate="tanh"`` uses ``gelu_tanh``; Clip's bounds (inputs from opset 11) go in ``a, b``
(-inf/inf when absent)."""

BINARY_OPS = ("add", "sub", "mul", "div")

STORAGE_PAIRS = (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"),
                 ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the NHWC pad/unpad kernels."""

CONVERT_PAIRS = (("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source; the message carries NVRTC's log."""


@dataclass(frozen=True)
class KernelSource:
    """One family: ``file`` in ``kernels/`` plus ``instances`` (macro invocations appended to
    it); ``kernels`` are the ``extern "C"`` names the text defines."""

    name: str
    file: str
    instances: tuple[str, ...]
    kernels: tuple[str, ...]

    @cached_property
    def text(self) -> str:
        body = (KERNEL_DIR / self.file).read_text()
        return body + "\n// instances (tr_onnx/backends/cuda/sources.py)\n" + "\n".join(
            self.instances) + "\n"


def _unary() -> KernelSource:
    inst = tuple(f"TR_UNARY({op}, {t}, {dt})" for op in UNARY_OPS for dt, t in DTYPES.items())
    names = tuple(f"tr_{op}_{d}_{dt}" for op in UNARY_OPS for dt in DTYPES for d in ("fwd", "bwd"))
    return KernelSource("unary", "unary.cu", inst, names)


def _binary() -> KernelSource:
    inst = tuple(f"TR_BINARY({op}, {t}, {dt})" for op in BINARY_OPS for dt, t in DTYPES.items())
    return KernelSource("binary", "binary.cu", inst,
                        tuple(f"tr_{op}_{dt}" for op in BINARY_OPS for dt in DTYPES))


def _pairs(macro: str, pairs) -> tuple[str, ...]:
    return tuple(f"{macro}({DTYPES[s]}, {s}, {DTYPES[d]}, {d})" for s, d in pairs)


def _layout() -> KernelSource:
    names = tuple(f"tr_{k}_nhwc_{s}_{d}" for s, d in STORAGE_PAIRS for k in ("pad", "unpad"))
    return KernelSource("layout_convert", "layout_convert.cu", _pairs("TR_PAD", STORAGE_PAIRS),
                        names)


def _convert() -> KernelSource:
    return KernelSource("convert", "convert.cu", _pairs("TR_CONVERT", CONVERT_PAIRS),
                        tuple(f"tr_convert_{s}_{d}" for s, d in CONVERT_PAIRS))


def _per_dtype(name: str, macro: str, stems: tuple[str, ...], fixed: tuple[str, ...] = ()):
    inst = tuple(f"{macro}({t}, {dt})" for dt, t in DTYPES.items())
    names = tuple(f"tr_{s}_{dt}" for s in stems for dt in DTYPES) + fixed
    return KernelSource(name, f"{name}.cu", inst, names)


def _extra() -> KernelSource:
    """kernels/extra.cu: the executor's mixed-layout elementwise ops, Greater/Less/Equal,
    Where, Expand, GlobalAveragePool, column sums, BatchNorm inference and running statistics,
    gradient
    scale/clip and padded-lane zeroing."""
    inst = tuple(f"TR_MIXED_BINARY({op}, {t}, {dt})" for op in BINARY_OPS
                 for dt, t in DTYPES.items()) + tuple(f"TR_EXTRA({t}, {dt})"
                                                      for dt, t in DTYPES.items())
    names = (tuple(f"tr_{op}_mixed_{dt}" for op in BINARY_OPS for dt in DTYPES)
             + tuple(f"tr_{stem}_{dt}" for stem in EXTRA_STEMS for dt in DTYPES)
             + tuple(f"tr_zero_lanes_b{b}" for b in (1, 2, 4)))
    return KernelSource("extra", "extra.cu", inst, names)


EXTRA_STEMS = ("greater", "less", "equal", "where", "expand", "gap", "sum_rows", "bn_running",
               "bn_infer", "scale_clip_norm")
"""Kernel stems of ``tr_<stem>_<dt>`` in kernels/extra.cu."""

POOL_NORM_STEMS = ("maxpool_fwd", "maxpool_bwd", "avgpool_fwd", "avgpool_bwd", "softmax",
                   "layernorm_fwd", "layernorm_bwd_dx", "layernorm_bwd_params", "erf",
                   "reduce_mid", "matmul", "bcast_binary", "gather_grad")
"""Kernel stems of ``tr_<stem>_<dt>`` in kernels/pool_norm.cu (besides the bit-pattern movers
``tr_strided_copy_b<bytes>`` and ``tr_gather_b<bytes>``)."""


def _pool_norm() -> KernelSource:
    """kernels/pool_norm.cu: pools and their backward, softmax, layer norm and its backward,
    Erf, one-run reductions, batched MatMul, broadcasting binary ops, strided copies and
    Gather / GatherGrad."""
    inst = tuple(f"TR_POOL_NORM({t}, {dt})" for dt, t in DTYPES.items())
    names = (tuple(f"tr_{stem}_{dt}" for stem in POOL_NORM_STEMS for dt in DTYPES)
             + tuple(f"tr_{k}_b{b}" for k in ("strided_copy", "gather") for b in (1, 2, 4, 8)))
    return KernelSource("pool_norm", "pool_norm.cu", inst, names)


SOURCES: dict[str, KernelSource] = {s.name: s for s in (
    _unary(), _binary(), _layout(), _convert(), _extra(), _pool_norm(),
    _per_dtype("optimizers", "TR_OPTIM", ("sgd", "adam", "adagrad")),
    _per_dtype("amp", "TR_UNSCALE_CHECK", ("unscale_check",),
               ("tr_step_advance", "tr_loss_scale_update", "tr_flag_or", "tr_copy_unless_b4",
                "tr_zero_if_b4", "tr_step_check", "tr_step_report")),
    _per_dtype("losses", "TR_LOSS", ("sce_fwd", "sce_bwd", "mse_fwd", "mse_bwd"),
               ("tr_sce_reduce",)),
)}
"""Family name -> KernelSource."""

_FAMILY_OF = {name: family for family, src in SOURCES.items() for name in src.kernels}


def family_of(kernel: str) -> str:
    """The family whose source defines ``kernel`` (an ``extern "C"`` name)."""
    family = _FAMILY_OF.get(kernel)
    if family is None:
        raise KeyError(f"no kernel source defines {kernel!r}")
    return family

HEADERS = ("elementwise.cuh", "layout.cuh")


def cuda_include_dir() -> str:
    """A directory holding ``cuda_fp16.h`` / ``cuda_bf16.h``: the ``nvidia-cuda-runtime`` wheel
    or a toolkit, as ``cuda.pathfinder`` (a CuPy 14 dependency) finds them, else ``$CUDA_PATH``
    / ``$CUDA_HOME`` / ``/usr/local/cuda``."""
    candidates = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "include"))
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
    src = SOURCES[name]
    return nvrtc_compile(src.text, src.file, compile_options(arch),
                         f"kernels/{src.file} ({name})")


def compile_all_nvrtc(arch: str = "sm_90") -> dict[str, bytes]:
    """Every family compiled for ``arch``: {name: cubin (or PTX) bytes}."""
    return {name: compile_nvrtc(name, arch) for name in SOURCES}
