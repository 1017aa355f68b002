"""Gradient cases for tr_onnx/ops/elementwise.py (run by tests/test_gradients.py).

Inputs stay away from kinks and discontinuities (Relu at 0, clamps, Mod's jumps, ties in
Max/Min): a finite difference across one measures nothing the rule claims. The internal
``ai.tr_onnx.DropoutTraining`` is checked in test_grad_torch_elementwise.py (gradcheck's
model builder leaves a custom op's outputs untyped).
"""

from __future__ import annotations

import numpy as np
from gradcheck import Const, GradCase

RNG = np.random.default_rng(20240611)
F8 = np.float64


def randn(*shape):
    return RNG.standard_normal(shape)


def uniform(lo, hi, *shape):
    return RNG.uniform(lo, hi, shape)


def away(*shape, kinks=(0.0,), margin=0.1, scale=2.0):
    """Normal values moved at least ``margin`` away from every kink."""
    x = RNG.standard_normal(shape) * scale
    for k in kinks:
        near = np.abs(x - k) < margin
        x[near] = k + np.where(x[near] >= k, margin, -margin) * 2
    return x


def separated(n, *shape):
    """``n`` arrays whose values differ by >= 0.1 at every position (no ties in Max/Min)."""
    ranks = np.argsort(RNG.random((n,) + shape), axis=0)
    return [r * 0.5 + RNG.uniform(0, 0.3, shape) for r in ranks]


def unary(op, x, opset=17, id_suffix="", oracle="reference", **attrs):
    return GradCase(f"{op}{id_suffix}", op, [x], attrs, opset=opset, fd_oracle=oracle)


# onnx.reference computes these in float32 whatever the input's dtype (Erf, and so Gelu,
# through np.vectorize(math.erf, otypes=["f"]); HardSwish and Gelu's tanh form with float32
# constants): ~1e-8 off in float64, so our forward (checked against onnxruntime in
# test_ops_elementwise.py) is the finite-difference oracle.
F32_REFERENCE = "ours"


CASES = [
    # ---- unary math and activations --------------------------------------------------------
    unary("Relu", away(2, 3, 4, 5), id_suffix="_nchw"),
    unary("Relu", away(7), opset=6, id_suffix="_v6"),
    unary("LeakyRelu", away(3, 4), alpha=0.1),
    unary("LeakyRelu", away(2, 3, 4, 5), id_suffix="_default_nchw"),
    unary("Elu", away(3, 4), alpha=0.7),
    unary("Selu", away(3, 4)),
    unary("Selu", away(3, 4), id_suffix="_attrs", alpha=1.2, gamma=0.9),
    unary("Celu", away(3, 4), opset=12, alpha=1.5),
    unary("ThresholdedRelu", away(3, 4, kinks=(1.0,)), opset=10),
    unary("ThresholdedRelu", away(3, 4, kinks=(0.3,)), opset=10, id_suffix="_alpha", alpha=0.3),
    unary("Sigmoid", randn(2, 3, 4, 5) * 3, id_suffix="_nchw"),
    unary("HardSigmoid", away(3, 4, kinks=(-2.5, 2.5), scale=3.0)),
    unary("HardSigmoid", away(3, 4, kinks=(-2.0, 0.0), scale=2.0), id_suffix="_attrs",
          alpha=0.5, beta=1.0),
    unary("HardSwish", away(4, 5, kinks=(-3.0, 3.0), scale=3.0), opset=14,
          oracle=F32_REFERENCE),
    unary("Tanh", randn(3, 4)),
    unary("Erf", randn(3, 4) * 1.5, opset=13, oracle=F32_REFERENCE),
    unary("Gelu", randn(2, 3, 4, 5) * 2, opset=20, id_suffix="_nchw", oracle=F32_REFERENCE),
    unary("Gelu", randn(3, 4) * 2, opset=20, id_suffix="_tanh", oracle=F32_REFERENCE,
          approximate="tanh"),
    unary("Softplus", randn(3, 4) * 3),
    unary("Softsign", randn(3, 4) * 2),
    unary("Mish", randn(3, 4) * 2, opset=18),
    unary("Exp", randn(3, 4)),
    unary("Log", uniform(0.3, 3, 3, 4)),
    unary("Sqrt", uniform(0.3, 3, 3, 4)),
    unary("Reciprocal", away(3, 4, margin=0.3)),
    unary("Neg", randn(3, 4)),
    unary("Abs", away(2, 3, 4, 5), id_suffix="_nchw"),
    unary("Sin", randn(3, 4) * 2),
    unary("Cos", randn(3, 4) * 2),
    unary("Tan", uniform(-1.2, 1.2, 3, 4)),
    unary("Asin", uniform(-0.85, 0.85, 3, 4)),
    unary("Acos", uniform(-0.85, 0.85, 3, 4)),
    unary("Atan", randn(3, 4) * 2),
    unary("Sinh", randn(3, 4)),
    unary("Cosh", randn(3, 4)),
    unary("Asinh", randn(3, 4) * 2),
    unary("Acosh", uniform(1.2, 3, 3, 4)),
    unary("Atanh", uniform(-0.85, 0.85, 3, 4)),
    unary("Shrink", away(3, 4, kinks=(-0.5, 0.5)), opset=9),
    unary("Shrink", away(3, 4, kinks=(-1.0, 1.0)), opset=9, id_suffix="_attrs", lambd=1.0,
          bias=0.3),
    # ---- binary, with broadcasting -------------------------------------------------------------
    GradCase("Add_same", "Add", [randn(3, 4), randn(3, 4)]),
    GradCase("Add_bcast", "Add", [randn(2, 3, 4), randn(3, 1)]),
    GradCase("Add_nchw_channel", "Add", [randn(2, 5, 3, 3), randn(5, 1, 1)]),
    GradCase("Add_v7_scalar", "Add", [randn(1), randn(2, 3)], opset=7),
    GradCase("Sub_bcast", "Sub", [randn(4, 1, 5), randn(3, 1)]),
    GradCase("Sub_wrt_second", "Sub", [randn(3, 4), randn(4)], wrt=(1,)),
    GradCase("Mul_bcast", "Mul", [randn(2, 3, 4), randn(1, 4)]),
    GradCase("Mul_nchw_channel", "Mul", [randn(2, 5, 3, 3), randn(1, 5, 1, 1)]),
    GradCase("Div_bcast", "Div", [randn(2, 3, 4), away(3, 1, margin=0.5)]),
    GradCase("Div_same", "Div", [randn(3, 4), away(3, 4, margin=0.5)], opset=13),
    GradCase("Pow_both", "Pow", [uniform(0.5, 2, 3, 4), randn(3, 4)]),
    GradCase("Pow_bcast_exponent", "Pow", [uniform(0.5, 2, 2, 3, 4), randn(4)]),
    GradCase("Pow_negative_base", "Pow", [randn(3, 4), Const(np.array([2.0, 3.0, 1.0, 4.0]))]),
    # Pow-12+: an integer exponent (no gradient) with a float base
    GradCase("Pow_int_exponent", "Pow", [randn(3, 4), np.array([2, 3, 1, 0], np.int64)],
             opset=15),
    GradCase("Pow_v7", "Pow", [uniform(0.5, 2, 3, 4), randn(3, 4)], opset=7),
    # x1 / x2 stays 0.25..0.75 away from integers: no jump within the finite differences
    GradCase("Mod_fmod", "Mod", [(RNG.integers(-3, 4, (3, 4)) + uniform(0.25, 0.75, 3, 4))
                                 * np.array([1.5, -0.7, 2.0, -1.1]),
                                 np.array([1.5, -0.7, 2.0, -1.1])], {"fmod": 1}, opset=13),
    GradCase("PRelu_channel", "PRelu", [away(2, 3, 4, 5), uniform(0.05, 0.5, 3, 1, 1)], opset=16),
    GradCase("PRelu_scalar_slope", "PRelu", [away(3, 4), uniform(0.05, 0.5, 1)], opset=9),
    GradCase("PRelu_same", "PRelu", [away(3, 4), uniform(-0.5, 0.5, 3, 4)], opset=7),
    GradCase("PRelu_last_axis", "PRelu", [away(2, 3, 4), randn(4)], opset=16),
    # ---- variadic ------------------------------------------------------------------------------
    GradCase("Sum_three_bcast", "Sum", [randn(2, 3, 4), randn(3, 1), randn(4)]),
    GradCase("Sum_one", "Sum", [randn(3, 4)]),
    GradCase("Sum_v6", "Sum", [randn(3, 4), randn(3, 4)], opset=6),
    GradCase("Mean_three_bcast", "Mean", [randn(2, 3, 4), randn(3, 1), randn(4)]),
    GradCase("Mean_v6", "Mean", [randn(3, 4), randn(3, 4)], opset=6),
    GradCase("Max_two", "Max", separated(2, 3, 4)),
    GradCase("Max_three_bcast", "Max", [x[sl] for x, sl in zip(
        separated(3, 2, 3, 4), [np.s_[:], np.s_[0, :, :1], np.s_[0, 0]])]),
    GradCase("Max_nchw", "Max", separated(2, 2, 3, 4, 5), opset=12),
    GradCase("Max_wrt_last", "Max", separated(3, 3, 4), wrt=(2,)),
    GradCase("Min_two", "Min", separated(2, 3, 4)),
    GradCase("Min_three_bcast", "Min", [x[sl] for x, sl in zip(
        separated(3, 2, 3, 4), [np.s_[0, 0], np.s_[:], np.s_[0, :1, :]])], opset=8),
    # ---- Clip, Where, casts, identities --------------------------------------------------------
    GradCase("Clip_inputs", "Clip", [away(3, 4, kinks=(-0.5, 0.8)), Const(np.array(-0.5)),
                                     Const(np.array(0.8))], opset=13),
    GradCase("Clip_min_only", "Clip", [away(3, 4, kinks=(-0.5,)), Const(np.array(-0.5))],
             opset=13),
    GradCase("Clip_max_only", "Clip", [away(3, 4, kinks=(0.8,)), None, Const(np.array(0.8))],
             opset=12),
    GradCase("Clip_no_bounds", "Clip", [randn(3, 4)], opset=11),
    GradCase("Clip_runtime_bounds", "Clip", [away(3, 4, kinks=(-0.5, 0.8)), np.array(-0.5),
                                             np.array(0.8)], opset=13, wrt=(0,)),
    GradCase("Clip_attrs", "Clip", [away(2, 3, 4, 5, kinks=(-0.5, 0.8))],
             {"min": -0.5, "max": 0.8}, opset=6),
    GradCase("Where_bcast", "Where", [Const(RNG.random((3, 4)) < 0.5), randn(3, 1), randn(4)]),
    GradCase("Where_same", "Where", [Const(RNG.random((2, 3, 4)) < 0.5), randn(2, 3, 4),
                                     randn(2, 3, 4)], opset=9),
    GradCase("Cast_f64", "Cast", [randn(3, 4)], {"to": 11}),
    # to float32: finite differences in float32 need a larger step and tolerance
    GradCase("Cast_to_f32", "Cast", [randn(3, 4)], {"to": 1}, opset=13, step=1e-2, rtol=1e-4),
    GradCase("CastLike_f64", "CastLike", [randn(3, 4), Const(np.zeros(1))], opset=15),
    GradCase("CastLike_to_f32", "CastLike", [randn(3, 4), Const(np.zeros(1, np.float32))],
             opset=19, step=1e-2, rtol=1e-4),
    GradCase("Identity", "Identity", [randn(3, 4)]),
    GradCase("Identity_nchw", "Identity", [randn(2, 3, 4, 5)], opset=16),
    GradCase("Dropout_inference", "Dropout", [randn(3, 4), Const(np.array(0.3))], opset=13),
    GradCase("Dropout_with_mask", "Dropout", [randn(3, 4)], opset=22, n_outputs=2),
    GradCase("Dropout_v7", "Dropout", [randn(3, 4)], {"ratio": 0.2}, opset=7),
    # training mode with a seed outside the training session: onnx.reference reseeds each run,
    # so its finite differences see the one mask (ops.dropout.seeded_dropout_mask)
    GradCase("Dropout_training_seeded", "Dropout",
             [randn(3, 4), Const(np.array(0.3)), Const(np.array(True))], {"seed": 5}, opset=22),
]
