"""The names of the values the training passes add to a graph: the contract between the passes
that make them, the session that writes and reads them, and the executors. One enum, so a
name is never spelled twice and a model's own names can be checked against all of them."""

from __future__ import annotations

from enum import StrEnum

from ..errors import UnsupportedModelError
from ..ir import Graph


class Reserved(StrEnum):
    # per-step scalars the host writes: learning rate, optimizer step (1-based, the one being
    # taken), 1/k for k accumulated micro-batches, and the count of micro-batches seen (dropout)
    LR = "__lr"
    STEP = "__step"
    GRAD_SCALE = "__grad_scale"
    RNG = "__rng_counter"
    # dynamic loss scaling (``training.precision``): the scale lives in the arena (OPT_STATE)
    # and seeds the backward pass, d(loss * scale)/d(loss); its inverse, the steps since the
    # last overflow, and whether this step's gradients overflowed
    LOSS_SCALE = "__loss_scale"
    INV_LOSS_SCALE = "__inv_loss_scale"
    GROWTH_TRACKER = "__loss_scale_growth"
    FOUND_INF = "__found_inf"
    # the flat spans the update runs over (``train_pass.add_spans``); the half-precision
    # weight copies' span (mixed precision)
    PARAMS_SPAN = "__params"
    GRADS_SPAN = "__grads"
    HALF_SPAN = "__params_half"
    # data parallelism: the rows of the global batch before this rank's, written each step, so
    # a batch-major dropout mask is the global batch's, rows of this rank
    SAMPLE_OFFSET = "__sample_offset"
    # data parallelism: this rank's share of the global batch's gradient, size * rows / total
    # rows (1 when every rank has as many rows), written each step; it seeds the backward pass,
    # so the mean over the ranks (GradAllReduceWait) is the mean over the global batch's rows
    ROW_WEIGHT = "__row_weight"
    HAS_ROWS = "__has_rows"  # whether this rank has rows in this global batch
    REDUCE = "__reduce"  # 1.0 when the step applies (its gradients are reduced)
    # the step guard's OPT_STATE tensors (``train_pass.add_step_guard``)
    BAD_BATCH = "__bad_batch"
    REJECT = "__reject"
    APPLIED = "__applied"
    STEP_REPORT = "__step_report"
    # ``training.gradients``: the output gradient fed to a vector-Jacobian product
    COTANGENT = "__cotangent__"


def check_no_reserved_names(graph: Graph) -> None:
    """A model's own value with a reserved name would be taken for the pass's: refuse it."""
    clash = sorted(name for name in graph.values if name in _NAMES)
    if clash:
        raise UnsupportedModelError(
            f"the model's value(s) {', '.join(map(repr, clash))} use a name tr_onnx reserves for "
            "the values training adds (learning rate, step, spans...); rename them in the model",
            [])


_NAMES = frozenset(Reserved)
