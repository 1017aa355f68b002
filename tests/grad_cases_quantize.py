"""Gradient cases for QuantizeLinear and DequantizeLinear (tr_onnx/ops/quantize.py).

QuantizeLinear's rule is a straight-through estimator: the exact derivative of the surrogate
``clip(x / scale + zero_point, qmin - 1/2, qmax + 1/2)`` (rounding as the identity, constant
where the range clips), which ``fd_reference_ops`` gives for the finite differences; the
forward is still checked against onnx.reference's real op. Its output is an integer tensor, so
the check's cotangent is integer too (the rule's seed then). DequantizeLinear's rule is its
exact derivative; the cases differentiate the scale (a float input; the quantized input's
gradient is a float tensor the checker cannot perturb, tests/test_quantize.py checks it
through Q -> DQ pairs). Scales are float64 here, which the schemas do not list: neither the
importer nor onnx.reference insists, and float64 is what makes 1e-6 finite differences exact.
"""

from __future__ import annotations

import numpy as np
from grad_cases_plugins import off_half_steps
from gradcheck import Const, GradCase
from onnx.reference.op_run import OpRun

RNG = np.random.default_rng(20261201)


class QuantizeLinear(OpRun):
    """Surrogate of QuantizeLinear for its straight-through gradient: x / scale + zero_point
    clipped half a step beyond the quantized range (per-tensor and per-axis parameters)."""

    op_domain = ""

    def _run(self, x, y_scale, y_zero_point=None, axis=1, saturate=1, block_size=0,
             output_dtype=0, precision=0):
        info = np.iinfo(y_zero_point.dtype if y_zero_point is not None else np.uint8)
        shape = [1] * x.ndim
        if y_scale.size > 1:
            shape[axis] = y_scale.size
        s = y_scale.reshape(shape if y_scale.size > 1 else ())
        zp = 0.0 if y_zero_point is None else \
            y_zero_point.astype(np.float64).reshape(s.shape)
        return (np.clip(x / s + zp, info.min - 0.5, info.max + 0.5),)


SCALE = 0.05
X = off_half_steps(RNG.uniform(-9, 9, (4, 6)), SCALE)  # beyond +-127 steps on both sides
AXIS_SCALE = np.array([0.05, 0.02, 0.1])
X_AXIS = np.stack([off_half_steps(RNG.uniform(-4, 4, (2, 5)), s) for s in AXIS_SCALE], axis=1)
Q_INT8 = RNG.integers(-128, 128, (4, 6)).astype(np.int8)

CASES = [
    GradCase("QuantizeLinear_int8", "QuantizeLinear",
             [X, Const(np.array(SCALE)), Const(np.array(3, np.int8))],
             fd_reference_ops=(QuantizeLinear,)),
    GradCase("QuantizeLinear_uint8_scale", "QuantizeLinear",
             [off_half_steps(RNG.uniform(-2, 12, (2, 3, 2, 2)), SCALE), np.array(SCALE),
              Const(np.array(40, np.uint8))], fd_reference_ops=(QuantizeLinear,)),
    GradCase("QuantizeLinear_axis_int16", "QuantizeLinear",
             [X_AXIS, AXIS_SCALE, Const(np.array([5, -3, 0], np.int16))], {"axis": 1},
             opset=21, fd_reference_ops=(QuantizeLinear,)),
    GradCase("DequantizeLinear_scale", "DequantizeLinear",
             [Q_INT8, np.array(0.07), Const(np.array(-4, np.int8))], opset=19),
    GradCase("DequantizeLinear_axis_scale", "DequantizeLinear",
             [RNG.integers(0, 256, (2, 3, 4)).astype(np.uint8), np.array([0.1, 0.02, 0.3]),
              Const(np.array([7, 0, 200], np.uint8))], {"axis": -2}, opset=19),
    GradCase("DequantizeLinear_blocked_scale", "DequantizeLinear",
             [RNG.integers(-128, 128, (3, 7)).astype(np.int8), RNG.uniform(0.01, 0.1, (3, 3)),
              Const(RNG.integers(-5, 5, (3, 3)).astype(np.int8))],
             {"axis": 1, "block_size": 3}, opset=21),
]
