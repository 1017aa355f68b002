"""Finite-difference cases for the normalisation, reduction and softmax-family gradient rules
(tr_onnx/ops/normalization.py, tr_onnx/ops/reduce.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from gradcheck import Const, GradCase

_rng = np.random.default_rng(7)


def r(*shape, scale=1.0, shift=0.0):
    return _rng.standard_normal(shape) * scale + shift


def pos(*shape):
    return _rng.uniform(0.5, 1.5, shape)


def distinct(*shape):
    """Well-separated values (no ties near the max/min) in random order."""
    n = int(np.prod(shape))
    return _rng.permutation(np.linspace(-3.0, 3.0, n)).reshape(shape)


def ax(*a):
    return Const(np.array(a, dtype=np.int64))


CASES: list[GradCase] = []
add = CASES.append
# Cases whose outputs ONNX shape inference cannot type (GroupNormalization has no inference
# function, BatchNormalization-9's optional outputs): gradcheck.build_model
# leaves them untyped and onnx.checker rejects the model. They carry their output shapes and
# run in tests/test_grad_torch_norm.py with a builder that types them, until build_model can.
TYPED_OUTPUT_CASES: list[tuple[GradCase, list[tuple[int, ...]]]] = []


def typed(case: GradCase, output_shapes: list[tuple[int, ...]]) -> None:
    TYPED_OUTPUT_CASES.append((case, output_shapes))

# ---------------------------------------------------------------------- BatchNormalization
# onnx.reference's BatchNormalization v7/v9 is wrong: v9 always normalises with the momentum
# blend of running and batch statistics (momentum has a schema default, so its "momentum is
# None" test-mode branch never runs), and v6/v7 treat an absent is_test as training. Those
# versions use our forward ("ours"), whose inference/training modes node-suite cases check.
add(GradCase("bn_inference_4d_v15", "BatchNormalization",
             [r(2, 3, 4, 5), r(3), r(3), Const(r(3)), Const(pos(3))], {"epsilon": 1e-3},
             opset=15))
add(GradCase("bn_inference_4d_v9", "BatchNormalization",
             [r(2, 3, 4, 5), r(3), r(3), Const(r(3)), Const(pos(3))], {"epsilon": 1e-3},
             opset=9, fd_oracle="ours"))
add(GradCase("bn_inference_2d", "BatchNormalization",
             [r(4, 5), r(5), r(5), Const(r(5)), Const(pos(5))], opset=15))
add(GradCase("bn_training_mode_4d_v15", "BatchNormalization",
             [r(3, 5, 3, 4), r(5), r(5), Const(r(5)), Const(pos(5))],
             {"training_mode": 1, "momentum": 0.8}, n_outputs=3, opset=15, rtol=1e-5))
typed(GradCase("bn_training_mode_3d_v9", "BatchNormalization",
               [r(4, 3, 5), r(3), r(3), Const(r(3)), Const(pos(3))], n_outputs=5, opset=9,
               rtol=1e-5, fd_oracle="ours"), [(4, 3, 5)] + [(3,)] * 4)
# ai.tr_onnx BatchNormTraining: onnx.reference has no kernel for the internal op, so the finite
# differences run through our own forward ("ours").
for shape in ((6, 3), (3, 5, 4, 3), (2, 3, 2, 3, 2)):
    add(GradCase(f"bn_training_internal_{len(shape)}d", "BatchNormTraining",
                 [r(*shape), r(shape[1]), r(shape[1]), Const(r(shape[1])),
                  Const(pos(shape[1]))],
                 {"epsilon": 1e-5, "momentum": 0.9, "unbiased_running_var": 1}, n_outputs=5,
                 domain="ai.tr_onnx", fd_oracle="ours", rtol=1e-5))

# ------------------------------------------------------------- Instance / Group / LRN / Layer
add(GradCase("instnorm_4d", "InstanceNormalization", [r(2, 3, 4, 5), r(3), r(3)],
             {"epsilon": 1e-3}, rtol=1e-5))
add(GradCase("instnorm_3d_v22", "InstanceNormalization", [r(2, 5, 7), r(5), r(5)],
             opset=22, rtol=1e-5))
# GroupNormalization-18 (per-group scale/bias) is deprecated and rejected by onnx.checker, so
# no model can use it: its per-group path is checked on GroupNormGrad against PyTorch
# (tests/test_grad_torch_norm.py). v21 has no ONNX shape inference: typed outputs.
typed(GradCase("groupnorm_v21_per_channel", "GroupNormalization", [r(2, 6, 3, 4), r(6), r(6)],
               {"num_groups": 2, "stash_type": 11}, opset=21, rtol=1e-5), [(2, 6, 3, 4)])
typed(GradCase("groupnorm_v21_3d", "GroupNormalization", [r(3, 4, 5), r(4), r(4)],
               {"num_groups": 4, "epsilon": 1e-2, "stash_type": 11}, opset=21, rtol=1e-5),
      [(3, 4, 5)])
# onnx.reference's LRN is wrong: it loops ``for c in range(x.shape[0])`` (the batch size, not
# the channels) and casts the square sum to x's dtype through float32 attributes; it also
# takes rank 4 only. LRN cases use our forward, which the node suite checks.
add(GradCase("lrn_size3_4d", "LRN", [r(2, 5, 3, 4)],
             {"size": 3, "alpha": 0.3, "beta": 0.75, "bias": 2.0}, fd_oracle="ours"))
add(GradCase("lrn_size4_even_3d", "LRN", [r(2, 6, 5)],
             {"size": 4, "alpha": 0.5, "beta": 0.6, "bias": 1.0}, opset=13, fd_oracle="ours"))
add(GradCase("lrn_size7_wider_than_c", "LRN", [r(1, 3, 2, 2)], {"size": 7, "alpha": 1.0},
             opset=1, fd_oracle="ours"))
add(GradCase("layernorm_last_axis", "LayerNormalization", [r(3, 4, 6), r(6), r(6)],
             {"axis": -1}, rtol=1e-5))
add(GradCase("layernorm_axis1_4d", "LayerNormalization", [r(2, 3, 4, 5), r(3, 4, 5),
                                                          r(3, 4, 5)], {"axis": 1}, rtol=1e-5))
add(GradCase("layernorm_broadcast_scale_no_bias", "LayerNormalization", [r(4, 3, 5), r(1, 5)],
             {"axis": 1, "epsilon": 1e-3}, rtol=1e-5))
# The Mean/InvStdDev outputs: stash_type=11 keeps them float64 (the default stashes them in
# float32, too coarse for differences), which onnx.reference does not implement ("not
# implemented for stash_type=11"): our forward is the oracle.
add(GradCase("layernorm_mean_output", "LayerNormalization", [r(3, 7), r(7), r(7)],
             {"stash_type": 11}, output=1, n_outputs=3, fd_oracle="ours"))
add(GradCase("layernorm_invstd_output", "LayerNormalization", [r(3, 7), r(7), r(7)],
             {"stash_type": 11}, output=2, n_outputs=3, wrt=(0,), fd_oracle="ours"))
# onnx.reference runs MVN's function body, which adds a float32 epsilon constant to the
# float64 data and fails ("Input type mismatch"): our forward is the oracle.
add(GradCase("mvn_default_axes", "MeanVarianceNormalization", [r(2, 3, 4, 5)], rtol=1e-5,
             opset=9, fd_oracle="ours"))  # v13: ONNX infers no output shape (see below)
add(GradCase("mvn_axes_last", "MeanVarianceNormalization", [r(3, 4, 6)], {"axes": [-1]},
             opset=9, rtol=1e-5, fd_oracle="ours"))
add(GradCase("lpnorm_p2_axis_last", "LpNormalization", [r(3, 4, 5)]))
# onnx.reference's p=1 norm sums x, not |x| (np.power(x, 1).sum()): our forward is the oracle.
add(GradCase("lpnorm_p1_axis0_4d", "LpNormalization", [r(3, 4, 2, 2)], {"axis": 0, "p": 1},
             opset=22, fd_oracle="ours"))

# ------------------------------------------------------------------------------- Reduce*
_REDUCE_INPUTS = {
    "ReduceSum": r, "ReduceMean": r, "ReduceMax": distinct, "ReduceMin": distinct,
    "ReduceProd": lambda *s: pos(*s) * np.sign(r(*s)), "ReduceL1": lambda *s: distinct(*s) + 0.01,
    "ReduceL2": r, "ReduceSumSquare": r, "ReduceLogSum": pos, "ReduceLogSumExp": r,
}
_AXES_INPUT_SINCE = {"ReduceSum": 13}
for op, make in _REDUCE_INPUTS.items():
    new = _AXES_INPUT_SINCE.get(op, 18)
    add(GradCase(f"{op}_axes_input_keepdims", op, [make(2, 3, 4, 5), ax(1, -1)],
                 {"keepdims": 1}, opset=new))
    add(GradCase(f"{op}_axes_input_no_keepdims", op, [make(3, 4, 5), ax(0, 2)],
                 {"keepdims": 0}, opset=new))
    add(GradCase(f"{op}_all_axes_no_keepdims", op, [make(3, 4)], {"keepdims": 0}, opset=new))
    add(GradCase(f"{op}_noop_empty_axes", op, [make(3, 4)], {"noop_with_empty_axes": 1},
                 opset=new))
    add(GradCase(f"{op}_axes_attr_v11", op, [make(2, 3, 4)], {"axes": [-2], "keepdims": 0},
                 opset=11))
add(GradCase("ReduceMax_ties_share", "ReduceMax",
             [np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 0.5, 2.0, -2.0]]), ax(1)], opset=18))
# (pairs of ties only: there central differences see (max d + min d) / 2 over the tied
# elements, which equals the even split only for two of them)

# ------------------------------------------------------------------------ Softmax family
for op in ("Softmax", "LogSoftmax"):
    add(GradCase(f"{op}_v13_axis1", op, [r(3, 4, 5)], {"axis": 1}, opset=13))
    add(GradCase(f"{op}_v13_default_4d", op, [r(2, 3, 4, 5)], opset=13))
    # onnx.reference implements only the v13 semantics (one axis), not v1/v11's coercion to
    # 2-D at ``axis``: our forward (checked against numpy on the flattened rows) is the oracle.
    add(GradCase(f"{op}_v11_coerced_axis1", op, [r(2, 3, 4)], {"axis": 1}, opset=11,
                 fd_oracle="ours"))
    add(GradCase(f"{op}_v1_coerced_negative_axis", op, [r(2, 3, 4)], {"axis": -2}, opset=1,
                 fd_oracle="ours"))

# ------------------------------------------------------------ losses (tr_onnx/ops/losses.py)
# (their table lives here; labels and weights are constants, only the scores are differentiated)


def labels(shape, c, ignore=None, dtype=np.int64):
    t = _rng.integers(0, c, shape)
    if ignore is not None:
        t.flat[::3] = ignore
    return Const(t.astype(dtype))


for op, short in (("SoftmaxCrossEntropyLoss", "sce"), ("NegativeLogLikelihoodLoss", "nll")):
    for reduction in ("mean", "sum", "none"):
        add(GradCase(f"{short}_NC_{reduction}", op, [r(5, 4), labels((5,), 4)],
                     {"reduction": reduction}, opset=13))
    add(GradCase(f"{short}_NCd1d2_weights_ii_mean", op,
                 [r(3, 4, 2, 3), labels((3, 2, 3), 4, ignore=2), Const(pos(4))],
                 {"reduction": "mean", "ignore_index": 2}, opset=13))
    add(GradCase(f"{short}_NCd1_negative_ii_int32_none", op,
                 [r(3, 5, 4), labels((3, 4), 5, ignore=-1, dtype=np.int32)],
                 {"reduction": "none", "ignore_index": -1}, opset=12))
    add(GradCase(f"{short}_NCd1_weights_sum", op, [r(2, 3, 5), labels((2, 5), 3),
                                                   Const(pos(3))],
                 {"reduction": "sum"}, opset=22 if short == "nll" else 13))
add(GradCase("sce_log_prob_output", "SoftmaxCrossEntropyLoss",
             [r(3, 4, 5), labels((3, 5), 4)], {"reduction": "mean"}, n_outputs=2, output=1,
             opset=13))
add(GradCase("sce_loss_with_log_prob_output", "SoftmaxCrossEntropyLoss",
             [r(4, 3), labels((4,), 3, ignore=1), Const(pos(3))],
             {"reduction": "mean", "ignore_index": 1}, n_outputs=2, output=0, opset=13))

# ONNX shape inference cannot type these outputs (GroupNormalization-21 has no inference
# function; BatchNormalization-9's optional training outputs): the case states them
CASES += [replace(case, output_shapes=shapes) for case, shapes in TYPED_OUTPUT_CASES]
