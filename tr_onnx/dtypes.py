"""ONNX tensor element types <-> NumPy dtypes (the ones the numpy backend can hold)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
"""``ml_dtypes.bfloat16`` (numpy kind ``"V"``): the storage type of ``precision="bf16"``
plans; NumPy's ufuncs work on it through ml_dtypes."""

# ONNX element types NumPy represents natively. bfloat16 and the float8/int4 families
# need ml_dtypes; the numpy backend does not compute in them.
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
_NP_TO_ONNX = {v: k for k, v in _ONNX_TO_NP.items()}
# bfloat16 appears inside bf16 training plans (their Cast nodes), not in models we load
_NP_TO_ONNX[BFLOAT16] = onnx.TensorProto.BFLOAT16


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
    return elem_type in _ONNX_TO_NP


def is_float(dtype) -> bool:
    """A floating-point dtype, bfloat16 included (its numpy kind is ``"V"``, not ``"f"``)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == BFLOAT16


def finfo(dtype):
    """``np.finfo`` for every float dtype, bfloat16 included."""
    return ml_dtypes.finfo(dtype)


def accumulator_dtype(dtype) -> np.dtype:
    """The type sums of ``dtype`` accumulate in: float32 for the 16-bit floats (as onnxruntime
    and cuDNN do: even a 3x3 window loses digits in float16, and numpy's float16 matmul does
    not use BLAS), ``dtype`` itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 or dtype == BFLOAT16 else dtype
