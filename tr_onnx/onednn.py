"""oneDNN (the CPU kernel library PyTorch runs its convolutions on), through its C API and
ctypes, for the numpy backend's float32 convolutions and Gelu. Optional:
``pip install tr_onnx[onednn]`` installs the CPU-only build ``onednn-cpu-gomp`` (OpenMP
threads, no SYCL); without it, or with ``TR_ONNX_NO_ONEDNN=1``, the NumPy kernels run (and
the GELU chain stays unfused, ``passes/fusions.py``).

A kernel describes its operands at plan time (``strided`` memory descriptors of the arena
views, ``ANY`` for the weights so that oneDNN picks its blocked layout and its fast
implementation: with plain weights it falls back to a reference loop hundreds of times
slower), creates its primitives then, reserves their scratchpad and blocked-weight buffers
as arena workspaces, and binds memory objects to the arena on its first call
(``Bound``). A step then costs one ``dnnl_primitive_execute`` per primitive.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import math
import os
import sys
from functools import cache, partial

import numpy as np

from . import blas_threads, host_blas
from .errors import TrOnnxError

MAX_DIMS = 12
_Dims = ctypes.c_int64 * MAX_DIMS
_P = ctypes.c_void_p
F32 = 3
CPU = 1
FORWARD_TRAINING, FORWARD_INFERENCE = 64, 96
BACKWARD, BACKWARD_DATA, BACKWARD_WEIGHTS = 128, 160, 192
# normalization flags (dnnl_normalization_flags_t)
USE_SCALE, USE_SHIFT = 0x2, 0x4
CONVOLUTION_DIRECT = 1
# dnnl_alg_kind_t of oneDNN 3.x (dnnl_eltwise_relu = 0x20, then in declaration order)
ELTWISE_RELU, ELTWISE_GELU_TANH, ELTWISE_CLIP_V2, ELTWISE_GELU_ERF = 0x20, 0x2B, 0x2F, 0x31
ELTWISE_ELU, ELTWISE_MISH = 0x22, 0x33
BINARY_ADD = 0x1FFF0
SOFTMAX_ACCURATE = 0x30000
POOLING_MAX = 0x1FF
FORMAT_ANY = 1
SCRATCHPAD_USER = 1
QUERY_IMPL_INFO = 8
QUERY_MD = {"src": 129, "diff_src": 130, "weights": 131, "diff_weights": 132, "dst": 133,
            "diff_dst": 134, "scratchpad": 136}
# "post_op_0_src_1": the second operand of a binary post-op that comes first,
# DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1 (oneDNN 3.x's base, 32768)
ARG = {"src": 1, "dst": 17, "weights": 33, "bias": 41, "mean": 49, "variance": 50, "scale": 51,
       "shift": 52, "diff_scale": 255, "diff_shift": 256, "scratchpad": 80, "diff_src": 129,
       "diff_dst": 145, "diff_weights": 161, "post_op_0_src_1": 32768 | 2}
DISTRIBUTION = "onednn-cpu-gomp"
_LIBRARY_NAMES = ("libdnnl.so.3", "libdnnl.so")


class OneDnnError(TrOnnxError, RuntimeError):
    """A oneDNN call failed (the status code and the call are in the message). A TrOnnxError:
    where no caller falls back to NumPy it reaches the user as a clean error (issue 35 item
    12)."""


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class _Library:
    """The loaded library, one CPU engine and one in-order stream."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.dnnl_primitive_desc_query_md.restype = _P
        lib.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [_P]
        lib.dnnl_primitive_execute.argtypes = [_P, _P, ctypes.c_int, _P]
        lib.dnnl_memory_set_data_handle.argtypes = [_P, _P]  # Copier's per-call pointers
        self.engine, self.stream = _P(), _P()
        self.check(lib.dnnl_engine_create(ctypes.byref(self.engine), CPU, 0), "engine_create")
        self.check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, 1),
                   "stream_create")
        self.attr = _P()
        self.check(lib.dnnl_primitive_attr_create(ctypes.byref(self.attr)), "attr_create")
        self.check(lib.dnnl_primitive_attr_set_scratchpad_mode(self.attr, SCRATCHPAD_USER),
                   "set_scratchpad_mode")

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise OneDnnError(f"oneDNN {what} failed with status {status}")


@cache
def library() -> _Library | None:
    """The oneDNN library, or None when it is not installed or disabled."""
    if os.environ.get("TR_ONNX_NO_ONEDNN"):
        return None
    for path in _library_paths():
        if os.path.exists(path):
            try:
                return _Library(_load_openmp_library(path))
            except (OSError, OneDnnError, AttributeError):
                return None
    return None


def _library_paths() -> list[str]:
    """Where the wheel put ``libdnnl.so``: its RECORD says (a venv, ``--user``, any prefix:
    the files are the wheel's "data", installed under the prefix's lib/), else <prefix>/lib."""
    found = []
    try:
        files = importlib.metadata.distribution(DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for name in _LIBRARY_NAMES:
        found += [str(f.locate()) for f in files if f.name == name]
        found += [os.path.join(prefix, "lib", name) for prefix in (sys.prefix, sys.base_prefix)]
    return found


def _load_openmp_library(path: str) -> ctypes.CDLL:
    """Load the library. Its OpenMP runtime (libgomp) reads the environment once, when it
    loads. Where NumPy's OpenBLAS can run its jobs on libgomp's threads (``blas_threads``),
    they share that one pool and libgomp keeps its default wait policy (spin a little, then
    sleep). Otherwise its threads get OMP_WAIT_POLICY=PASSIVE unless the user chose a policy:
    spinning OpenMP threads would hold the cores OpenBLAS's own threads need between two
    convolutions (ResNet-18's training step: 265 ms with the default policy, 203 ms with
    PASSIVE; 2 threads, 2-core AMD EPYC, 2026-12-01). The process's environment is left as it
    was."""
    if blas_threads.share():
        return ctypes.CDLL(path)
    chosen = os.environ.get("OMP_WAIT_POLICY")
    if chosen is None:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        return ctypes.CDLL(path)
    finally:
        if chosen is None:
            del os.environ["OMP_WAIT_POLICY"]


def available() -> bool:
    return library() is not None


# dnnl_cpu_isa_t (oneDNN 3.x): avx2 0x7, avx512_core 0x27, +vnni 0x67, +bf16 0xe7, newer ones
# add bits above: 0x20 marks the AVX-512 family
_ISA_AVX512 = 0x20


@cache
def avx512() -> bool:
    """Whether oneDNN runs its AVX-512 kernels here (the CPU has them and ONEDNN_MAX_CPU_ISA
    does not hold it lower)."""
    lib = library()
    return lib is not None and bool(lib.lib.dnnl_get_effective_cpu_isa() & _ISA_AVX512)


class MemoryDesc:
    """A memory descriptor handle, destroyed with this object."""

    def __init__(self, handle: _P, owned: bool = True, empty: bool = False):
        # the library is held, not looked up, when the handle is destroyed (at interpreter
        # exit this module's globals may already be gone)
        self.handle, self.owned, self._lib = handle, owned, library()
        self.empty = empty  # a dimension is 0: no primitive may be made over it

    @staticmethod
    def strided(shape, byte_strides, itemsize: int = 4) -> MemoryDesc:
        """Logical ``shape`` (oneDNN's order: N, C, spatial... or [G,] O, I, spatial...) over
        memory with these byte strides."""
        lib = library()
        md = _P()
        strides = [int(s) // itemsize for s in byte_strides]
        lib.check(lib.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(shape), _Dims(*shape), F32, _Dims(*strides)), "memory desc")
        return MemoryDesc(md, empty=math.prod(shape) == 0)

    @staticmethod
    def any(shape) -> MemoryDesc:
        lib = library()
        md = _P()
        lib.check(lib.lib.dnnl_memory_desc_create_with_tag(
            ctypes.byref(md), len(shape), _Dims(*shape), F32, FORMAT_ANY), "memory desc")
        return MemoryDesc(md, empty=math.prod(shape) == 0)

    @property
    def nbytes(self) -> int:
        return int(library().lib.dnnl_memory_desc_get_size(self.handle))

    def __del__(self):
        if self.owned and self.handle:
            self._lib.lib.dnnl_memory_desc_destroy(self.handle)


def _refuse_empty(what: str, *descs: MemoryDesc | None) -> None:
    """Raise before a primitive is made over a tensor with a 0 dimension: oneDNN's descriptor
    construction divides by it (SIGFPE for a MaxPool with a zero-width output, issue 35 item
    3). Every caller falls back to NumPy, which computes the empty result."""
    if any(d is not None and d.empty for d in descs):
        raise OneDnnError(f"oneDNN {what}: an empty tensor (a dimension is 0) is not asked")


class Primitive:
    """A primitive and its descriptor: what memory each argument wants, the implementation
    oneDNN chose."""

    def __init__(self, pd: _P, keep: list):
        lib = self._lib = library()
        self.pd, self.keep = pd, keep  # keep: descriptors the pd was made from
        self.handle = _P()
        lib.check(lib.lib.dnnl_primitive_create(ctypes.byref(self.handle), pd),
                  "primitive_create")

    def md(self, what: str) -> MemoryDesc:
        handle = library().lib.dnnl_primitive_desc_query_md(self.pd, QUERY_MD[what], 0)
        return MemoryDesc(_P(handle), owned=False)

    @property
    def implementation(self) -> str:
        out = ctypes.c_char_p()
        library().lib.dnnl_primitive_desc_query(self.pd, QUERY_IMPL_INFO, 0, ctypes.byref(out))
        return (out.value or b"").decode()

    def __del__(self):
        self._lib.lib.dnnl_primitive_destroy(self.handle)
        self._lib.lib.dnnl_primitive_desc_destroy(self.pd)


class PostOps:
    """Primitive attributes with a chain of post-ops, which a forward convolution applies to
    each output value while it is still in registers: ``add`` (a tensor laid out as ``add``'s
    memory desc, passed as ``"post_op_0_src_1"``), then ``clip`` (lo, hi: -inf/inf for an open
    side; Relu is (0, inf)).

    oneDNN's max and min map NaN to the limit (relu(NaN) = 0, measured with oneDNN 3.2), where
    ONNX's Relu and Clip keep NaN: only a convolution whose output is proven finite may take
    ``clip`` (``passes.inference_folds.finite_rewrites``)."""

    def __init__(self, add: MemoryDesc | None = None, clip: tuple[float, float] | None = None):
        lib = self._lib = library()
        self.handle, chain = _P(), _P()
        lib.check(lib.lib.dnnl_primitive_attr_create(ctypes.byref(self.handle)), "attr_create")
        lib.check(lib.lib.dnnl_primitive_attr_set_scratchpad_mode(self.handle, SCRATCHPAD_USER),
                  "set_scratchpad_mode")
        lib.check(lib.lib.dnnl_post_ops_create(ctypes.byref(chain)), "post_ops_create")
        try:
            if add is not None:
                lib.check(lib.lib.dnnl_post_ops_append_binary(chain, BINARY_ADD, add.handle),
                          "post_ops_append_binary")
            if clip is not None:
                lo, hi = clip
                alg, alpha, beta = (ELTWISE_RELU, 0.0, 0.0) if (lo, hi) == (0.0, math.inf) \
                    else (ELTWISE_CLIP_V2, lo, hi)
                lib.check(lib.lib.dnnl_post_ops_append_eltwise(
                    chain, alg, ctypes.c_float(alpha), ctypes.c_float(beta)),
                    "post_ops_append_eltwise")
            lib.check(lib.lib.dnnl_primitive_attr_set_post_ops(self.handle, chain),
                      "set_post_ops")  # the attributes keep a copy of the chain
        finally:
            lib.lib.dnnl_post_ops_destroy(chain)

    def __del__(self):
        if self.handle:
            self._lib.lib.dnnl_primitive_attr_destroy(self.handle)


def convolution(kind: int, src: MemoryDesc, weights: MemoryDesc, bias: MemoryDesc | None,
                dst: MemoryDesc, strides, dilations, pad_l, pad_r,
                hint: Primitive | None = None, post_ops: PostOps | None = None) -> Primitive:
    """A convolution primitive: ``kind`` FORWARD_TRAINING (src, weights, bias, dst),
    BACKWARD_DATA (diff_src, weights, -, diff_dst) or BACKWARD_WEIGHTS (src, diff_weights,
    -, diff_dst); ``dilations`` as ONNX counts them (1 = none); backward ones need the
    forward primitive as ``hint``; a forward one may apply ``post_ops``."""
    _refuse_empty("convolution", src, weights, bias, dst)
    lib = library()
    pd = _P()
    geometry = (_Dims(*strides), _Dims(*(d - 1 for d in dilations)), _Dims(*pad_l),
                _Dims(*pad_r))
    if kind == FORWARD_TRAINING:
        status = lib.lib.dnnl_convolution_forward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, kind, CONVOLUTION_DIRECT, src.handle, weights.handle,
            bias.handle if bias is not None else None, dst.handle, *geometry,
            post_ops.handle if post_ops is not None else lib.attr)
    elif kind == BACKWARD_DATA:
        status = lib.lib.dnnl_convolution_backward_data_primitive_desc_create(
            ctypes.byref(pd), lib.engine, CONVOLUTION_DIRECT, src.handle, weights.handle,
            dst.handle, *geometry, hint.pd, lib.attr)
    else:
        status = lib.lib.dnnl_convolution_backward_weights_primitive_desc_create(
            ctypes.byref(pd), lib.engine, CONVOLUTION_DIRECT, src.handle, weights.handle,
            None, dst.handle, *geometry, hint.pd, lib.attr)
    lib.check(status, "convolution primitive descriptor")
    return Primitive(pd, [src, weights, bias, dst, post_ops])


def eltwise(alg: int, data: MemoryDesc, hint: Primitive | None = None, alpha: float = 0.0,
            beta: float = 0.0) -> Primitive:
    """An elementwise primitive over memory described by ``data`` (source, destination and
    both gradients share it): forward (``src -> dst``) without ``hint``, backward
    (``src, diff_dst -> diff_src``) with the forward primitive as ``hint``."""
    _refuse_empty("eltwise", data)
    lib = library()
    pd = _P()
    a, b = ctypes.c_float(alpha), ctypes.c_float(beta)
    if hint is None:
        status = lib.lib.dnnl_eltwise_forward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, FORWARD_TRAINING, alg, data.handle, data.handle, a,
            b, lib.attr)
    else:
        status = lib.lib.dnnl_eltwise_backward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, alg, data.handle, data.handle, data.handle, a, b,
            hint.pd, lib.attr)
    lib.check(status, "eltwise primitive descriptor")
    return Primitive(pd, [data])


def max_pooling(src: MemoryDesc, dst: MemoryDesc, strides, kernel, dilations, pad_l,
                pad_r) -> Primitive:
    """A max pooling primitive for inference (no workspace); ``dilations`` as ONNX counts
    them (1 = none). Its max drops NaN: only for inputs proven finite."""
    _refuse_empty("pooling", src, dst)
    lib = library()
    pd = _P()
    lib.check(lib.lib.dnnl_pooling_forward_primitive_desc_create(
        ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, POOLING_MAX, src.handle, dst.handle,
        _Dims(*strides), _Dims(*kernel), _Dims(*(d - 1 for d in dilations)), _Dims(*pad_l),
        _Dims(*pad_r), lib.attr), "pooling primitive descriptor")
    return Primitive(pd, [src, dst])


def matmul(src: MemoryDesc, weights: MemoryDesc, dst: MemoryDesc,
           bias: MemoryDesc | None = None) -> Primitive:
    """A matmul primitive: dst = src @ weights (+ bias, broadcast onto dst) over the last two
    axes, for each index of the leading (batch) axes; an operand whose leading axes are 1 is
    broadcast over the others'."""
    _refuse_empty("matmul", src, weights, dst, bias)
    lib = library()
    pd = _P()
    lib.check(lib.lib.dnnl_matmul_primitive_desc_create(
        ctypes.byref(pd), lib.engine, src.handle, weights.handle,
        bias.handle if bias is not None else None, dst.handle, lib.attr),
        "matmul primitive descriptor")
    return Primitive(pd, [src, weights, dst, bias])


def softmax(data: MemoryDesc, axis: int) -> Primitive:
    """A forward softmax over ``axis`` of ``data`` (source and destination share it):
    exp(x - max) / sum, each row shifted by its max."""
    _refuse_empty("softmax", data)
    lib = library()
    pd = _P()
    lib.check(lib.lib.dnnl_softmax_forward_primitive_desc_create(
        ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, SOFTMAX_ACCURATE,
        data.handle, data.handle, axis, lib.attr), "softmax primitive descriptor")
    return Primitive(pd, [data])


def layer_normalization(data: MemoryDesc, stats: MemoryDesc, epsilon: float, flags: int,
                        hint: Primitive | None = None) -> Primitive:
    """A layer normalization over the last axis of ``data`` (source, destination and both
    gradients share it), ``stats`` the per-row mean and variance: forward training (``src,
    scale, shift -> dst, mean, variance``) without ``hint``; backward (``src, mean, variance,
    diff_dst, scale, shift -> diff_src, diff_scale, diff_shift``) with the forward primitive
    as ``hint``. ``flags``: USE_SCALE, USE_SHIFT."""
    _refuse_empty("layer normalization", data, stats)
    lib = library()
    pd = _P()
    eps = ctypes.c_float(epsilon)
    if hint is None:
        status = lib.lib.dnnl_layer_normalization_forward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, FORWARD_TRAINING, data.handle, data.handle,
            stats.handle, eps, flags, lib.attr)
    else:
        status = lib.lib.dnnl_layer_normalization_backward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, BACKWARD, data.handle, data.handle, data.handle,
            stats.handle, eps, flags, hint.pd, lib.attr)
    lib.check(status, "layer normalization primitive descriptor")
    return Primitive(pd, [data, stats])


def batch_normalization(src: MemoryDesc, dst: MemoryDesc, epsilon: float, flags: int,
                        hint: Primitive | None = None,
                        diff_dst: MemoryDesc | None = None) -> Primitive:
    """A batch normalization over every axis but 1 (the channels), per-channel mean and
    variance: forward training (``src, scale, shift -> dst, mean, variance``) without
    ``hint``; backward (``src, mean, variance, diff_dst, scale -> diff_src, diff_scale,
    diff_shift``; ``dst`` then describes diff_src) with the forward primitive as ``hint``.
    ``flags``: USE_SCALE, USE_SHIFT."""
    _refuse_empty("batch normalization", src, dst, diff_dst)
    lib = library()
    pd = _P()
    eps = ctypes.c_float(epsilon)
    if hint is None:
        status = lib.lib.dnnl_batch_normalization_forward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, FORWARD_TRAINING, src.handle, dst.handle, eps, flags,
            lib.attr)
    else:
        status = lib.lib.dnnl_batch_normalization_backward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, BACKWARD, dst.handle, diff_dst.handle, src.handle,
            eps, flags, hint.pd, lib.attr)
    lib.check(status, "batch normalization primitive descriptor")
    return Primitive(pd, [src, dst, diff_dst])


def reorder(src: MemoryDesc, dst: MemoryDesc) -> Primitive:
    """A primitive copying memory described by ``src`` into the layout ``dst``."""
    _refuse_empty("reorder", src, dst)
    lib = library()
    pd = _P()
    lib.check(lib.lib.dnnl_reorder_primitive_desc_create(
        ctypes.byref(pd), src.handle, lib.engine, dst.handle, lib.engine, lib.attr),
        "reorder primitive descriptor")
    return Primitive(pd, [src, dst])


class Bound:
    """One primitive bound to arena memory: ``(argument, memory desc, array)`` triples become
    memory objects pointing into the arrays (kept alive here); ``()`` executes it."""

    def __init__(self, primitive: Primitive, args: list[tuple[str, MemoryDesc, np.ndarray]]):
        lib = self._lib = library()
        self.primitive, self.arrays, self.memories = primitive, [], []
        pairs = []
        for name, md, array in args:
            memory = _P()
            lib.check(lib.lib.dnnl_memory_create(ctypes.byref(memory), md.handle, lib.engine,
                                                 _P(array.ctypes.data)), "memory_create")
            self.memories.append(memory)
            self.arrays.append((md, array))
            pairs.append(_Arg(ARG[name], memory))
        self.args = (_Arg * len(pairs))(*pairs)
        # returns oneDNN's status: a prepared step calls this and ``failed`` (host_blas)
        self.execute = partial(lib.lib.dnnl_primitive_execute, primitive.handle, lib.stream,
                               len(pairs), ctypes.cast(self.args, _P))

    def __call__(self) -> None:
        status = self.execute()
        if status != 0:
            self.failed(status)

    def failed(self, status: int) -> None:
        raise OneDnnError(f"oneDNN execute ({self.primitive.implementation}) failed with "
                          f"status {status}")

    def __del__(self):
        for memory in self.memories:
            self._lib.lib.dnnl_memory_destroy(memory)


class Copier:
    """A float32 copy between two strided layouts of one shape as a oneDNN reorder, on arrays
    given per call (``copier(src, dst)``): a session's feed written into its channels-last arena
    view, an output read into a new array. The reorder moves bits (NaN payloads, -0 and
    infinities come through) and never writes outside ``dst``'s view."""

    def __init__(self, primitive: Primitive, src: MemoryDesc, dst: MemoryDesc):
        lib = self._lib = library()
        self.primitive, self.memories = primitive, []
        scratch_md = primitive.md("scratchpad")
        self._scratch = np.empty(-(-scratch_md.nbytes // 4), np.float32)
        pairs = []
        for name, md, handle in (("src", src, None), ("dst", dst, None),
                                 ("scratchpad", scratch_md, self._scratch.ctypes.data)):
            if name == "scratchpad" and not scratch_md.nbytes:
                continue
            memory = _P()
            lib.check(lib.lib.dnnl_memory_create(ctypes.byref(memory), md.handle, lib.engine,
                                                 _P(handle)), "memory_create")
            self.memories.append(memory)
            pairs.append(_Arg(ARG[name], memory))
        self.mds = (src, dst, scratch_md)  # the memories refer to them
        self.args = (_Arg * len(pairs))(*pairs)
        set_handle = lib.lib.dnnl_memory_set_data_handle
        self._set_src = partial(set_handle, self.memories[0])
        self._set_dst = partial(set_handle, self.memories[1])
        self._execute = partial(lib.lib.dnnl_primitive_execute, primitive.handle, lib.stream,
                                len(pairs), ctypes.cast(self.args, _P))

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> None:
        status = self._set_src(src.ctypes.data) or self._set_dst(dst.ctypes.data) or \
            self._execute()
        if status != 0:
            raise OneDnnError(f"oneDNN copy ({self.primitive.implementation}) failed with "
                              f"status {status}")

    def __del__(self):
        for memory in self.memories:
            self._lib.lib.dnnl_memory_destroy(memory)


def copier(shape, src_byte_strides, dst_byte_strides) -> Copier | None:
    """A ``Copier`` for float32 arrays of ``shape`` with these byte strides, or None where
    oneDNN is not there, refuses, or offers only its reference loop."""
    if not available() or not 1 <= len(shape) <= MAX_DIMS:
        return None
    try:
        src = MemoryDesc.strided(shape, src_byte_strides)
        dst = MemoryDesc.strided(shape, dst_byte_strides)
        primitive = reorder(src, dst)
    except OneDnnError:
        return None
    if primitive.implementation.startswith("ref"):
        return None
    return Copier(primitive, src, dst)


def finite(flat: np.ndarray) -> bool:
    """Whether every value of the float32 vector ``flat`` is finite (and below ~1.8e19 in
    magnitude): the sum of its squares, one BLAS dot, is finite; NaN compares False. The
    per-run guard of the kernels whose NaN and infinities oneDNN handles otherwise than ONNX
    (Softmax's max and sum skip them; an eltwise kernel's handling depends on the ISA)."""
    return np.dot(flat, flat) < np.inf


def reshaped(a: np.ndarray, shape) -> np.ndarray:
    """``a`` viewed with ``shape``; raises rather than copy (a copy would lose what oneDNN
    writes into it, or hold stale values where the kernel reads it)."""
    view = a.view()
    view.shape = shape
    return view


def scratchpad(ctx, primitive: Primitive) -> tuple[MemoryDesc, int] | None:
    """(memory desc, workspace key) of a primitive's scratchpad, reserved as an arena workspace
    with the kernel context's ``ctx.workspace``, or None if it needs none."""
    md = primitive.md("scratchpad")
    size = md.nbytes
    return (md, ctx.workspace((-(-size // 4),), np.float32)) if size else None


def bind(primitive: Primitive, args, scratch, ws) -> Bound:
    """``Bound`` with the scratchpad (``scratchpad``'s result, or None) added to ``args``."""
    if scratch is not None:
        args = [*args, ("scratchpad", scratch[0], ws[scratch[1]])]
    return Bound(primitive, args)


def source_to_destination_step(ctx, make, src: MemoryDesc, dst: MemoryDesc):
    """The step running ``make()``'s primitive (one source, one destination: a reorder, a
    pooling) from input 0 to output 0, or None where oneDNN refuses it or offers only its
    reference loop."""
    try:
        primitive = make()
    except OneDnnError:
        return None
    if primitive.implementation.startswith("ref"):
        return None
    scratch = scratchpad(ctx, primitive)
    return host_blas.prepared_step(lambda ins, outs, ws: [bind(
        primitive, [("src", src, ins[0]), ("dst", dst, outs[0])], scratch, ws)])


def execute_once(primitive: Primitive, args) -> None:
    """Run ``primitive`` now on host arrays (plan-time work, outside any arena), with a
    scratchpad of its own."""
    md = primitive.md("scratchpad")
    scratch = np.empty(-(-md.nbytes // 4), np.float32)
    bind(primitive, args, (md, 0) if md.nbytes else None, [scratch])()
