"""The registry of tr_onnx's own CUDA kernel sources: family name -> source text, kernel names
and NVRTC options.

A family is one op family, named like its NumPy module in ``tr_onnx/ops/`` (``unary``,
``elementwise``, ``pool``, ...; ``amp`` is the training step's loss scaling and step guard),
and one ``kernels/<family>.cu`` file. The file defines macros (``TR_UNARY(op, T, dt)``, ...)
over the shared headers (``HEADERS``: the host/device shim and per-element math of
``elementwise.cuh``, the index math of ``layout.cuh`` and ``strided.cuh``); each family's table
below appends the macro invocations and names the ``extern "C"`` entry points they define, both
from the same loops, so the list of kernels is written once, here. Kernel names end in the
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

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ...errors import TrOnnxError

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


# ---- unary (ops/unary.py) ---------------------------------------------------------------------

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


def unary_source() -> KernelSource:
    """kernels/unary.cu: forward and backward of every op of ``UNARY_OPS``, and Erf."""
    return kernel_source(
        "unary",
        instantiate("TR_UNARY({op}, {T}, {dt})", ("tr_{op}_fwd_{dt}", "tr_{op}_bwd_{dt}"),
                    values("op", UNARY_OPS), STORAGE),
        instantiate("TR_ERF({T}, {dt})", "tr_erf_{dt}", STORAGE))


# ---- elementwise (ops/elementwise.py) ---------------------------------------------------------

BINARY_OPS = ("add", "sub", "mul", "div")
"""Kernel stems of ``tr_<op>_<dt>`` and ``tr_<op>_mixed_<dt>``."""

COMPARE_OPS = {"greater": ">", "less": "<", "equal": "=="}
"""Kernel stem of ``tr_<op>_<dt>`` -> the C comparison it makes."""

CONVERT_PAIRS = (("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the Cast kernels ``tr_convert_<src>_<dst>``."""


def elementwise_source() -> KernelSource:
    """kernels/elementwise.cu: binary ops by period, by operand spec (mixed layouts) and by
    strides (general broadcasting), Greater/Less/Equal, Where and Cast."""
    ops = values("op", BINARY_OPS)
    compares = tuple({"op": op, "cmp": cmp} for op, cmp in COMPARE_OPS.items())
    return kernel_source(
        "elementwise",
        instantiate("TR_BINARY({op}, {T}, {dt})", "tr_{op}_{dt}", ops, STORAGE),
        instantiate("TR_MIXED_BINARY({op}, {T}, {dt})", "tr_{op}_mixed_{dt}", ops, STORAGE),
        instantiate("TR_COMPARE({op}, {cmp}, {T}, {dt})", "tr_{op}_{dt}", compares, STORAGE),
        instantiate("TR_WHERE({T}, {dt})", "tr_where_{dt}", STORAGE),
        instantiate("TR_BCAST_BINARY({T}, {dt})", "tr_bcast_binary_{dt}", STORAGE),
        instantiate("TR_CONVERT({S}, {sdt}, {D}, {ddt})", "tr_convert_{sdt}_{ddt}",
                    storage_pairs(CONVERT_PAIRS)))


# ---- tensor: data movement (ops/tensor.py) ----------------------------------------------------

def tensor_source() -> KernelSource:
    """kernels/tensor.cu: strided copies (Transpose, Slice, Concat), Expand and the zeroing of
    padded lanes (ZeroFill, flags)."""
    return kernel_source(
        "tensor",
        instantiate("TR_STRIDED_COPY({U}, {bytes})", "tr_strided_copy_b{bytes}",
                    widths(1, 2, 4, 8)),
        instantiate("TR_EXPAND({T}, {dt})", "tr_expand_{dt}", STORAGE),
        instantiate("TR_ZERO_LANES({U}, {bytes})", "tr_zero_lanes_b{bytes}", widths(1, 2, 4)))


# ---- indexing (ops/indexing.py) ---------------------------------------------------------------

def indexing_source() -> KernelSource:
    """kernels/indexing.cu: Gather along one axis (bit patterns) and GatherGrad."""
    return kernel_source(
        "indexing",
        instantiate("TR_GATHER({U}, {bytes})", "tr_gather_b{bytes}", widths(1, 2, 4, 8)),
        instantiate("TR_GATHER_GRAD({T}, {dt})", "tr_gather_grad_{dt}", STORAGE))


# ---- matmul (ops/matmul.py) -------------------------------------------------------------------

def matmul_source() -> KernelSource:
    """kernels/matmul.cu: the batched MatMul where no cuDNN matmul graph is bound."""
    return kernel_source("matmul", instantiate("TR_MATMUL({T}, {dt})", "tr_matmul_{dt}", STORAGE))


# ---- pool (ops/pool.py) -----------------------------------------------------------------------

def pool_source() -> KernelSource:
    """kernels/pool.cu: MaxPool / AveragePool forward and backward, GlobalAveragePool."""
    return kernel_source(
        "pool",
        instantiate("TR_POOL({T}, {dt})", ("tr_maxpool_fwd_{dt}", "tr_maxpool_bwd_{dt}",
                                           "tr_avgpool_fwd_{dt}", "tr_avgpool_bwd_{dt}"),
                    STORAGE),
        instantiate("TR_GAP({T}, {dt})", "tr_gap_{dt}", STORAGE))


# ---- normalization (ops/normalization.py) -----------------------------------------------------

def normalization_source() -> KernelSource:
    """kernels/normalization.cu: LayerNormalization and LayerNormGrad; BatchNormalization's
    inference and running statistics."""
    return kernel_source(
        "normalization",
        instantiate("TR_LAYERNORM({T}, {dt})", ("tr_layernorm_fwd_{dt}", "tr_layernorm_bwd_dx_{dt}",
                                                "tr_layernorm_bwd_params_{dt}"), STORAGE),
        instantiate("TR_BATCHNORM({T}, {dt})", ("tr_bn_running_{dt}", "tr_bn_infer_{dt}"),
                    STORAGE))


# ---- reduce (ops/reduce.py, Softmax included) -------------------------------------------------

def reduce_source() -> KernelSource:
    """kernels/reduce.cu: Softmax / LogSoftmax rows, ReduceSum / ReduceMean over one run of
    axes, and column sums (ReduceSum over leading rows)."""
    return kernel_source(
        "reduce",
        instantiate("TR_REDUCE({T}, {dt})", ("tr_softmax_{dt}", "tr_reduce_mid_{dt}",
                                             "tr_sum_rows_{dt}"), STORAGE))


# ---- losses (ops/losses.py) -------------------------------------------------------------------

def losses_source() -> KernelSource:
    """kernels/losses.cu: softmax cross-entropy and MSE, forward and backward."""
    return kernel_source(
        "losses",
        instantiate("TR_LOSS({T}, {dt})", ("tr_sce_fwd_{dt}", "tr_sce_bwd_{dt}", "tr_mse_fwd_{dt}",
                                           "tr_mse_bwd_{dt}"), STORAGE),
        plain("tr_sce_reduce"))


# ---- optimizers (ops/optimizers.py) -----------------------------------------------------------

def optimizers_source() -> KernelSource:
    """kernels/optimizers.cu: the fused SGD / Adam(W) / Adagrad updates and ScaleClipGrad."""
    return kernel_source(
        "optimizers",
        instantiate("TR_OPTIM({T}, {dt})", ("tr_sgd_{dt}", "tr_adam_{dt}", "tr_adagrad_{dt}"),
                    STORAGE),
        instantiate("TR_SCALE_CLIP_NORM({T}, {dt})", "tr_scale_clip_norm_{dt}", STORAGE))


# ---- layout_convert (ops/layout_convert.py) ---------------------------------------------------

STORAGE_PAIRS = (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"),
                 ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the NHWC pad/unpad kernels."""


def layout_convert_source() -> KernelSource:
    """kernels/layout_convert.cu: NHWC pad/unpad between host and device layouts."""
    return kernel_source(
        "layout_convert",
        instantiate("TR_PAD({S}, {sdt}, {D}, {ddt})",
                    ("tr_pad_nhwc_{sdt}_{ddt}", "tr_unpad_nhwc_{sdt}_{ddt}"),
                    storage_pairs(STORAGE_PAIRS)))


# ---- amp: the training step's loss scaling and step guard (no op family) ----------------------

def amp_source() -> KernelSource:
    """kernels/amp.cu: dynamic loss scaling and the one-graph step's guard."""
    return kernel_source(
        "amp",
        instantiate("TR_UNSCALE_CHECK({T}, {dt})", "tr_unscale_check_{dt}", STORAGE),
        plain("tr_step_advance", "tr_loss_scale_update", "tr_flag_or", "tr_copy_unless_b4",
              "tr_zero_if_b4", "tr_step_check", "tr_step_report"))


SOURCES: dict[str, KernelSource] = {s.name: s for s in (
    unary_source(), elementwise_source(), tensor_source(), indexing_source(), matmul_source(),
    pool_source(), normalization_source(), reduce_source(), losses_source(),
    optimizers_source(), layout_convert_source(), amp_source(),
)}
"""Family name -> KernelSource."""

_FAMILY_OF = {name: family for family, src in SOURCES.items() for name in src.kernels}


def family_of(kernel: str) -> str:
    """The family whose source defines ``kernel`` (an ``extern "C"`` name)."""
    family = _FAMILY_OF.get(kernel)
    if family is None:
        raise KeyError(f"no kernel source defines {kernel!r}")
    return family


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
