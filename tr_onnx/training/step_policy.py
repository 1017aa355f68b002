"""A training step's outcome, and who decides it: the training policy over the executors.

``run_step`` runs one step of a training plan. A plan with the step guard on an executor that
launches whole steps (``can_launch_steps``: the cuda executor) decides on the device, inside
the captured step, and only its report comes back (``launch_step`` / ``finish_step``);
otherwise the host decides between the phases (``host_step``), and is the oracle the device's
decisions are tested against (tests/test_step_contract.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import ExecutorAPI
from ..ir import Phase
from .train_pass import TrainInfo


@dataclass(frozen=True)
class StepReport:
    """What one training step (``run_step``) tells the host: the loss; ``bad``: the
    loss (or, without loss scaling, a gradient) was not finite, so nothing was committed or
    applied and the accumulated gradients were dropped; ``overflow``: loss scaling found a
    non-finite gradient and skipped the optimizer step; ``grad_norm``: the global gradient norm
    of an applied step (None otherwise); ``rejected``: the step was launched with a step number
    that assumed an earlier step applied, which was not -- it changed nothing and must be
    launched again (then ``bad`` is set too)."""

    loss: float
    bad: bool = False
    overflow: bool = False
    grad_norm: float | None = None
    rejected: bool = False


def run_step(executor: ExecutorAPI, info: TrainInfo, apply: bool) -> StepReport:
    """One training step of ``executor``'s plan (``info``: its training contract), applied to
    the weights when ``apply``; waits for it."""
    if getattr(executor, "can_launch_steps", False):
        return finish_step(executor, executor.launch_step(apply), apply)
    return host_step(executor, info, apply)


def finish_step(executor: ExecutorAPI, token: int, apply: bool) -> StepReport:
    """The report of the step ``executor.launch_step`` returned ``token`` for (waiting for it):
    the device's fields (``ops.optimizers.REPORT_FIELDS``) as the host reads them."""
    fields = executor.finish_step(token)
    bad = fields["bad"] != 0.0
    return StepReport(fields["loss"], bad=bad, overflow=fields["overflow"] != 0.0 and not bad,
                      grad_norm=fields["grad_norm"] if apply and not bad else None,
                      rejected=fields["rejected"] != 0.0)


def host_step(executor: ExecutorAPI, info: TrainInfo, apply: bool) -> StepReport:
    """One training step decided on the host between the phases (``info``: the plan's
    training contract): ``compute`` (and, when ``apply`` in a data-parallel plan,
    ``reduce``); a non-finite loss (or, without loss scaling, gradient) drops the batch and
    the gradients accumulated since the last step -- on every rank, when any rank's was
    -- else ``commit`` and, when ``apply``, ``apply`` (reading back the norm and the
    overflow flag)."""
    scaling = info.loss_scaling
    executor.run(phase=Phase.COMPUTE)
    if apply and info.world is not None:  # GRAD averaged over the ranks (data parallel)
        executor.run(phase=Phase.REDUCE)
    value = executor.read_scalar(info.loss)
    bad = not (np.isfinite(value) and (scaling is not None
                                       or executor.all_finite(info.grads_span)))
    if not apply and info.world is not None:
        # a micro-batch's fate is agreed, as one process with the ranks' batches together
        # would decide it; an applied step's is already the same on every rank (the
        # reduction spread any rank's non-finite loss or gradient to all)
        bad = info.world.allreduce_scalars([float(bad)])[0] > 0
    if bad:
        executor.zero(info.grads_span)
        return StepReport(value, bad=True)
    executor.run(phase=Phase.COMMIT)
    if not apply:
        return StepReport(value)
    executor.run(phase=Phase.APPLY)
    return StepReport(value, overflow=scaling is not None and
                      executor.read_scalar(scaling.found_inf) != 0.0,
                      grad_norm=executor.read_scalar(info.grad_norm))
