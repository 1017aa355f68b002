"""Gradient cases for the installed plugin packages in plugins/ (run by tests/test_gradients.py
with the builtin tables): com.example Swish and BiasGelu, com.example.quant FakeQuantize and
the straight-through Round of tr_onnx_qat.

The plugins' ``REFERENCE_OPS`` (onnx.reference implementations) are the oracles. A
straight-through estimator is the exact derivative of a surrogate forward (Round -> identity,
FakeQuantize -> clip at the rounding range's edges), which ``fd_reference_ops`` gives for the
finite differences; the forward itself is still checked against the real op.
"""

from __future__ import annotations

import numpy as np
import tr_onnx_example_ops
import tr_onnx_qat
from gradcheck import Const, GradCase
from onnx.reference.op_run import OpRun

RNG = np.random.default_rng(20260412)
EXAMPLE = {"domain": tr_onnx_example_ops.DOMAIN,
           "reference_ops": tuple(tr_onnx_example_ops.REFERENCE_OPS)}
QUANT = {"domain": tr_onnx_qat.DOMAIN, "reference_ops": tuple(tr_onnx_qat.REFERENCE_OPS)}


class Round(OpRun):
    """Surrogate of Round for its straight-through gradient: the identity."""

    op_domain = ""

    def _run(self, x):
        return (x.copy(),)


class FakeQuantize(OpRun):
    """Surrogate of FakeQuantize for its clipped straight-through gradient: x clipped where
    round(x / scale) + zero_point leaves [qmin, qmax]."""

    op_domain = tr_onnx_qat.DOMAIN

    def _run(self, x, scale, zero_point=0, qmin=-128, qmax=127):
        return (np.clip(x, (qmin - zero_point - 0.5) * scale, (qmax - zero_point + 0.5) * scale),)


def off_half_steps(x, scale, margin=0.05):
    """x moved away from rounding ties and quantization-range edges (x/scale +- 0.5)."""
    frac = x / scale - np.floor(x / scale)
    near = np.abs(frac - 0.5) < margin
    x = x.copy()
    x[near] += 2 * margin * scale
    return x


SCALE = 0.05
FQ_X = off_half_steps(RNG.uniform(-9, 9, (4, 6)), SCALE)  # beyond +-127 steps on both sides

CASES = [
    GradCase("Swish", "Swish", [RNG.standard_normal((3, 4)) * 3], **EXAMPLE),
    GradCase("Swish_beta_nchw", "Swish", [RNG.standard_normal((2, 3, 4, 5)) * 3],
             {"beta": 1.7}, **EXAMPLE),
    GradCase("BiasGelu", "BiasGelu", [RNG.standard_normal((4, 5)) * 2,
                                      RNG.standard_normal(5)], **EXAMPLE),
    GradCase("BiasGelu_nchw", "BiasGelu", [RNG.standard_normal((2, 3, 4, 5)) * 2,
                                           RNG.standard_normal(5)], **EXAMPLE),
    GradCase("BiasGelu_const_bias", "BiasGelu", [RNG.standard_normal((3, 4)) * 2,
                                                 Const(RNG.standard_normal(4))], **EXAMPLE),
    GradCase("FakeQuantize", "FakeQuantize", [FQ_X, Const(np.array(SCALE))],
             fd_reference_ops=(FakeQuantize,), **QUANT),
    GradCase("FakeQuantize_uint8_nchw", "FakeQuantize",
             [off_half_steps(RNG.uniform(-1, 12, (2, 3, 2, 2)), SCALE), Const(np.array(SCALE))],
             {"zero_point": 10, "qmin": 0, "qmax": 255}, fd_reference_ops=(FakeQuantize,),
             **QUANT),
    GradCase("Round_ste", "Round", [off_half_steps(RNG.standard_normal((3, 4)) * 3, 1.0)],
             fd_reference_ops=(Round,)),
    GradCase("Round_ste_v22", "Round", [off_half_steps(RNG.standard_normal((3, 4)) * 3, 1.0)],
             opset=22, fd_reference_ops=(Round,)),
]
