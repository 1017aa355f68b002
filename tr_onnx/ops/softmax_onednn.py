"""Softmax in float32 through oneDNN's softmax (``tr_onnx.onednn``): the numpy
backend's fast path, with reduce.py's NumPy kernel as the reference and the fallback.

NumPy makes five passes (row max, subtract, exp, sum, divide), each single-threaded: BERT's
attention scores [8, 4, 64, 64] took 0.6-0.8 ms per Softmax, oneDNN's one pass 0.13 ms
(2 threads, AMD EPYC Zen 3 with AVX2, 2026-12-02).

oneDNN's max skips NaN and its sum does not see a NaN or an infinity the way ONNX's
exp(x - max) / sum does: [NaN, 1, 2, 3] gives [NaN, 0, 0, 0] where ONNX gives NaN in every
place, [+inf, 1, 2, 3] gives [NaN, 0, 0, 0] (measured, oneDNN 3.2). So each run first sums
the squares of the input (one BLAS dot, ~5% of the softmax): oneDNN runs only where that is
finite, i.e. every value is finite (and below ~1.8e19 in magnitude); otherwise the NumPy
kernel runs, and gives ONNX's NaN rows exactly. For finite inputs oneDNN's result is ONNX's
up to its exp's rounding (~1e-6 relative, ``tests/test_softmax_onednn.py``).

oneDNN's own kernels take the last axis (or v1/v11's trailing axes folded into one); for a
middle axis it offers its reference loop, and NumPy runs it. LogSoftmax stays on NumPy:
oneDNN's log-softmax was 3.6e-6 from float64 where onnxruntime is within 5e-7 (its
logarithm's rounding), past the 1e-6 the op tests hold it to.
"""

from __future__ import annotations

import math

import numpy as np

from .. import host_blas, onednn
from ..layouts import compact_strides


def contiguous_rows(info, axes: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """(shape, axis) of a C-contiguous plain float32 tensor as oneDNN's softmax takes it: the
    one axis of ``axes``, or several trailing axes (Softmax v1/v11) folded into one; None for
    anything else (other dtypes, strided or padded views, axes not trailing)."""
    shape = tuple(int(n) for n in info.shape)
    if info.dtype != np.float32 or not shape or 0 in shape or len(shape) > onednn.MAX_DIMS:
        return None
    if tuple(int(s) for s in info.layout.view_strides(4)) != tuple(compact_strides(shape, 4)):
        return None
    if len(axes) == 1:
        return shape, axes[0]
    if list(axes) != list(range(axes[0], len(shape))):
        return None
    return shape[:axes[0]] + (math.prod(shape[axes[0]:]),), axes[0]


def softmax_step(ctx, axes: tuple[int, ...], exact):
    """The step: oneDNN's softmax where this run's input is finite, ``exact`` (the NumPy
    kernel's ``make(ins, outs, ws)``, returning its calls) otherwise. None where oneDNN is not
    there, the operands are not contiguous float32 rows laid out alike, or oneDNN offers only
    its reference loop."""
    x_info, y_info = ctx.inputs[0], ctx.outputs[0]
    rows = contiguous_rows(x_info, axes)
    if rows is None or not onednn.available() or y_info.dtype != np.float32 \
            or contiguous_rows(y_info, axes) != rows:
        return None
    shape, axis = rows
    md = onednn.MemoryDesc.strided(shape, compact_strides(shape, 4))
    try:
        primitive = onednn.softmax(md, axis)
    except onednn.OneDnnError:
        return None
    if primitive.implementation.startswith("ref"):
        return None
    scratch = onednn.scratchpad(ctx, primitive)

    def make(ins, outs, ws):
        x, y = onednn.reshaped(ins[0], shape), onednn.reshaped(outs[0], shape)
        flat = onednn.reshaped(x, -1)
        bound = onednn.bind(primitive, [("src", md, x), ("dst", md, y)], scratch, ws)
        execute = bound.execute
        calls = exact(ins, outs, ws)

        def run():
            if onednn.finite(flat):  # else the NumPy kernel
                status = execute()
                if status:
                    bound.failed(status)
            else:
                for call in calls:
                    call()

        return [run]

    return host_blas.prepared_step(make)
