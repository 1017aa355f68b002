"""NumPy loops that give wrong values on this project's pinned NumPy, and what tr_onnx calls
instead. Kernels work on views of the arena, whose padded channels and NHWC rows make inputs
and outputs strided, which is where these loops differ from their contiguous form."""

from __future__ import annotations

import numpy as np


def negate(x: np.ndarray, out: np.ndarray, where=True) -> np.ndarray:
    """``out = -x`` (where ``where``). Not ``np.negative``: NumPy 2.4.6's loop of it writes
    wrong values into a strided ``out`` when the input's stride is 16 bytes (float32, int32)
    or 64 bytes (float64, int64), in place too. A Conv to one channel padded to 4, then Neg,
    was off by 2.05 (issue 35); so was an LSTM of hidden_size 1. ``x * -1`` gives the same
    bits for every finite value, infinity and signed zero; the 16 other unary and binary
    loops probed over the same strides are right."""
    return np.multiply(x, -1, out=out, where=where)
