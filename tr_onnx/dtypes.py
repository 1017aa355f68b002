"""ONNX tensor element types <-> NumPy dtypes (the ones the numpy backend can hold).

The numpy backend holds every numeric ONNX element type: NumPy's own, and through ml_dtypes
bfloat16, the float8 family (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0), float6, float4 and the
4-bit and 2-bit integers. In the arena every element is unpacked, one byte or more (ml_dtypes'
int4 is one byte per element); ONNX's packing of the 4-, 2- and 6-bit types (two, four or four
per three bytes) exists only in TensorProtos, and ``onnx.numpy_helper`` does it both ways at the
proto boundary (import of initializers and constants, export).

Compute rule for the types NumPy has no arithmetic of its own for (``needs_upcast``): a kernel
computes in ``compute_dtype`` (float32) and rounds once at its output, as GPUs do for bf16.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import ml_dtypes
import numpy as np
import onnx

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
"""``ml_dtypes.bfloat16`` (numpy kind ``"V"``): the storage type of ``precision="bf16"``
plans; NumPy's ufuncs work on it through ml_dtypes."""

_T = onnx.TensorProto
# ONNX element types NumPy represents natively.
_ONNX_TO_NP: dict[int, np.dtype] = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.DOUBLE: np.dtype(np.float64),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.INT8: np.dtype(np.int8),
    onnx.TensorProto.INT16: np.dtype(np.int16),
    onnx.TensorProto.INT32: np.dtype(np.int32),
    onnx.TensorProto.INT64: np.dtype(np.int64),
    onnx.TensorProto.UINT8: np.dtype(np.uint8),
    onnx.TensorProto.UINT16: np.dtype(np.uint16),
    onnx.TensorProto.UINT32: np.dtype(np.uint32),
    onnx.TensorProto.UINT64: np.dtype(np.uint64),
    onnx.TensorProto.BOOL: np.dtype(np.bool_),
}
# ... and those ml_dtypes represents, each element unpacked (see the module docstring).
ML_DTYPES: dict[int, np.dtype] = {
    _T.BFLOAT16: BFLOAT16,
    _T.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    _T.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    _T.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    _T.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    _T.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    _T.UINT4: np.dtype(ml_dtypes.uint4),
    _T.INT4: np.dtype(ml_dtypes.int4),
    _T.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
}
# onnx < 1.19 has no 2-bit and 6-bit element types; ml_dtypes < 0.5 has no int2/float6
for _name, _ml in (("UINT2", "uint2"), ("INT2", "int2"), ("FLOAT6E2M3", "float6_e2m3fn"),
                   ("FLOAT6E3M2", "float6_e3m2fn")):
    if hasattr(_T, _name) and hasattr(ml_dtypes, _ml):
        ML_DTYPES[getattr(_T, _name)] = np.dtype(getattr(ml_dtypes, _ml))
_ONNX_TO_NP.update(ML_DTYPES)
_NP_TO_ONNX = {v: k for k, v in _ONNX_TO_NP.items()}

FLOAT8 = frozenset(ML_DTYPES[t] for t in (_T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ, _T.FLOAT8E5M2,
                                          _T.FLOAT8E5M2FNUZ))
"""The float8 types Cast saturates (``saturate=1``); e8m0 has its own rounding rule."""
SUB_BYTE_INT = frozenset(d for d in ML_DTYPES.values() if d.name in ("int4", "uint4", "int2",
                                                                     "uint2"))
"""The 4- and 2-bit integers (ml_dtypes ``iinfo`` knows them, NumPy does not)."""


def np_dtype(elem_type: int) -> np.dtype:
    """The NumPy dtype for an ONNX element type; raises ``TypeError`` for ones we cannot hold."""
    try:
        return _ONNX_TO_NP[elem_type]
    except KeyError:
        raise TypeError(f"ONNX element type {elem_type_name(elem_type)} is not supported by "
                        "tr_onnx") from None


def elem_type_name(elem_type: int) -> str:
    """``FLOAT``, ``UNDEFINED`` for 0, and a number ONNX does not define named as such."""
    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"{elem_type} (not an ONNX element type)"


def onnx_elem_type(dtype: np.dtype | type) -> int:
    """The ONNX element type for a NumPy dtype."""
    return _NP_TO_ONNX[np.dtype(dtype)]


def is_supported(elem_type: int) -> bool:
    """Whether the numpy backend can hold values of this ONNX element type (not STRING,
    not the complex types, not UNDEFINED)."""
    return elem_type in _ONNX_TO_NP


def is_ml_dtype(dtype) -> bool:
    """A dtype that only ml_dtypes knows (bfloat16, float8, float4/6, int4/2)."""
    return np.dtype(dtype) in _ML_SET


def is_float(dtype) -> bool:
    """A floating-point dtype, bfloat16 and the float8/6/4 types included (their numpy kind is
    ``"V"``, not ``"f"``)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype in _ML_SET and dtype not in SUB_BYTE_INT)


def is_integer(dtype) -> bool:
    """A signed or unsigned integer dtype, the 4- and 2-bit ones included (not bool)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "iu" or dtype in SUB_BYTE_INT


def iinfo(dtype):
    """``np.iinfo`` for every integer dtype, int4/uint4/int2/uint2 included."""
    return ml_dtypes.iinfo(dtype)


def needs_upcast(dtype) -> bool:
    """Whether a kernel should compute in ``compute_dtype(dtype)`` and round at the output:
    the ml_dtypes types, whose NumPy ufuncs either do not exist or round at every step."""
    return is_ml_dtype(dtype)


def compute_dtype(dtype) -> np.dtype:
    """The dtype a kernel computes ``dtype`` values in: float32 for the ml_dtypes floats
    (as GPUs do for bf16 and fp8), int32 for the sub-byte integers, ``dtype`` otherwise."""
    dtype = np.dtype(dtype)
    if dtype in SUB_BYTE_INT:
        return np.dtype(np.int32)
    return np.dtype(np.float32) if dtype in _ML_SET else dtype


def finfo(dtype):
    """``np.finfo`` for every float dtype, bfloat16 included."""
    return ml_dtypes.finfo(dtype)


_ML_SET = frozenset(ML_DTYPES.values())


def accumulator_dtype(dtype) -> np.dtype:
    """The type sums of ``dtype`` accumulate in: float32 for the 16-bit and ml_dtypes floats
    (as onnxruntime and cuDNN do: even a 3x3 window loses digits in float16, and numpy's
    float16 matmul does not use BLAS), ``dtype`` itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 or (is_float(dtype) and dtype in _ML_SET) \
        else dtype


# ---- ONNX Cast semantics ---------------------------------------------------------------------
# What onnx.reference's op_cast.py does, written into preallocated arrays: ``saturate`` clamps
# to the float8 type's finite range before rounding (NaN stays NaN, +-inf becomes +-max);
# without it ml_dtypes' rounding cast decides (e4m3fn overflows to NaN, e5m2 to inf). float8e8m0
# (a power of two, no sign) has its own rounding, ``round_mode`` up (default), down or nearest.
# Every other pair is NumPy's/ml_dtypes' C-style conversion (float -> int truncates).

def cast_scratch(src, dst, saturate: bool = True) -> tuple[np.dtype, ...]:
    """The scratch dtypes (each of the input's shape) ``cast_into`` needs for this pair."""
    src, dst = np.dtype(src), np.dtype(dst)
    if dst == ML_DTYPES[_T.FLOAT8E8M0]:
        u32, flag = np.dtype(np.uint32), np.dtype(np.bool_)
        return np.dtype(np.float32), u32, u32, flag, flag
    if dst in FLOAT8 and saturate and src != dst:
        return (src if is_float(src) else np.dtype(np.float64)),
    return ()


def cast_into(x: np.ndarray, out: np.ndarray, scratch=(), saturate: bool = True,
              round_mode: str = "up") -> None:
    """out = ONNX ``Cast(x, to=out.dtype, saturate, round_mode)``, allocating nothing;
    ``scratch`` are arrays of x's shape with the dtypes ``cast_scratch`` names."""
    if out.dtype == ML_DTYPES[_T.FLOAT8E8M0]:
        _to_e8m0_into(x, out, scratch, saturate, round_mode)
    elif scratch:  # saturating float8
        lo, hi = _saturation_bounds(scratch[0].dtype, out.dtype)
        np.copyto(scratch[0], x, casting="unsafe")
        np.clip(scratch[0], lo, hi, out=scratch[0])
        np.copyto(out, scratch[0], casting="unsafe")
    else:
        np.copyto(out, x, casting="unsafe")


@functools.cache
def _saturation_bounds(work: np.dtype, dst: np.dtype):
    """``dst``'s finite range as scalars of the dtype the clamp runs in (once per pair)."""
    info = finfo(dst)
    return work.type(float(info.min)), work.type(float(info.max))


def _to_e8m0_into(x, out, scratch, saturate: bool, round_mode: str) -> None:
    """float32 exponent bits, rounded as ``onnx.numpy_helper.to_float8e8m0``: NaN and inf give
    0xFF (NaN); a rounding that would reach 0xFF stays at 0xFE when saturating."""
    f, e, t, up, keep = scratch
    np.copyto(f, x, casting="unsafe")
    bits = f.view(np.uint32)
    np.right_shift(bits, 23, out=e)
    np.bitwise_and(e, 0xFF, out=e)  # drop the sign: e8m0 has none
    if round_mode == "up":  # any fraction bit rounds up
        np.bitwise_and(bits, 0x7FFFFF, out=t)
        np.not_equal(t, 0, out=up)
    elif round_mode == "nearest":  # guard bit and (round or sticky or the exponent's lsb)
        np.bitwise_and(bits, 0x3FFFFF, out=t)
        np.not_equal(t, 0, out=up)
        np.not_equal(e, 0, out=keep)  # the "lsb" of onnx's rule: a nonzero exponent
        np.logical_or(up, keep, out=up)
        np.bitwise_and(bits, 0x400000, out=t)
        np.not_equal(t, 0, out=keep)
        np.logical_and(up, keep, out=up)
    elif round_mode == "down":
        up.fill(False)
    else:
        raise ValueError(f"round_mode {round_mode!r} is not up, down or nearest")
    np.not_equal(e, 0xFF, out=keep)  # NaN/inf stay 0xFF
    np.logical_and(up, keep, out=up)
    if saturate:
        np.not_equal(e, 0xFE, out=keep)
        np.logical_and(up, keep, out=up)
    np.add(e, up, out=e, casting="unsafe")
    np.copyto(out.view(np.uint8), e, casting="unsafe")


# ---- the compute rule for kernels ------------------------------------------------------------

def compute_wide(factory):
    """A numpy kernel factory that computes ``needs_upcast`` values (bfloat16, float8...) in
    ``compute_dtype`` (float32): its inputs are copied into float32 scratch, the wrapped
    kernel runs on those, and each output is rounded once as it is written, as GPUs do for bf16
    (and as PyTorch's CPU bf16 matmul does), instead of NumPy rounding to bfloat16 after every
    ufunc. Nodes of other dtypes get ``factory``'s kernel unchanged."""

    def wide_factory(ctx):
        infos = list(ctx.inputs) + list(ctx.outputs)
        if not any(t is not None and needs_upcast(t.dtype) for t in infos):
            return factory(ctx)
        inner = copy.copy(ctx)  # shares workspace_requests: the slots stay one list
        widen = [t if t is None or not needs_upcast(t.dtype)
                 else dataclasses.replace(t, dtype=compute_dtype(t.dtype)) for t in infos]
        inner.inputs, inner.outputs = widen[:len(ctx.inputs)], widen[len(ctx.inputs):]
        run = factory(inner)
        slots = [None if t is None or w is t else ctx.workspace(t.shape, w.dtype)
                 for t, w in zip(infos, widen)]
        n_in = len(ctx.inputs)
        in_slots, out_slots = slots[:n_in], slots[n_in:]

        def run_wide(ins, outs, ws):
            wins = [x if k is None or x is None else ws[k] for x, k in zip(ins, in_slots)]
            for x, k in zip(ins, in_slots):
                if k is not None and x is not None:
                    np.copyto(ws[k], x, casting="unsafe")
            wouts = [y if k is None or y is None else ws[k] for y, k in zip(outs, out_slots)]
            run(wins, wouts, ws)
            for y, k in zip(outs, out_slots):
                if k is not None and y is not None:
                    np.copyto(y, ws[k], casting="unsafe")

        return run_wide

    wide_factory.__doc__ = factory.__doc__
    wide_factory.__name__ = getattr(factory, "__name__", "kernel")
    return wide_factory
