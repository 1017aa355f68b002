"""``StepLauncher``: training steps given to the executor, and read back in order.

On the cuda backend (``grad_accumulation=1``) a step may be launched before the previous one
is read back, so the host prepares batch k+1 while the device runs step k. Step k+1 is
launched assuming step k is applied; if it was not (a bad batch, an fp16 overflow), the
device's step guard rejects k+1 (nothing changes) and it is launched again. Elsewhere each
step is run and read back at once. ``PendingStep`` is the caller's handle on a launched step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..compiler import CompiledPlan
from ..distributed import World
from ..errors import TrainingDiverged, TrOnnxError
from .reserved import Reserved
from .state import TrainingState
from .step_policy import StepReport, finish_step, run_step


@dataclass(eq=False)
class Launch:
    """A training step given to the executor: its plan, RNG counter (dropout masks), whether
    it applies the optimizer, and what the executor returned: a token to read it back with
    (``launch_step``), or its report."""

    plan: CompiledPlan
    rng: int
    apply: bool
    rows_before: int = 0  # data parallelism: the global batch's rows before this rank's
    row_weight: float = 1.0  # data parallelism: size * this rank's rows / the global batch's
    token: Any = None
    report: StepReport | None = None
    outputs: dict[str, np.ndarray] | None = None  # read back with the step (launch_step)


class PendingStep:
    """A step launched by ``TrainingSession.train_step(..., wait=False)``. ``loss()`` (or
    ``float(step)``) waits for it (and the steps before it) and returns its loss; ``done``
    says whether it has been read back."""

    def __init__(self, launcher: StepLauncher, launch: Launch,
                 last_outputs: Callable[[], dict[str, np.ndarray]]):
        self._launcher, self._launch, self._last_outputs = launcher, launch, last_outputs

    @property
    def done(self) -> bool:
        return self._launch not in self._launcher.inflight and self._launch.report is not None

    def _wait(self) -> StepReport:
        inflight = self._launcher.inflight
        while self._launch in inflight:
            self._launcher.resolve_oldest()
        return self._launch.report

    def loss(self) -> float:
        return self._wait().loss

    __float__ = loss

    @property
    def keeps_outputs(self) -> bool:
        """Whether ``outputs()`` stays readable after later steps were launched."""
        return self._launch.outputs is not None

    @property
    def bad(self) -> bool:
        """The batch's loss or gradient was not finite: the step changed nothing."""
        return self._wait().bad

    def outputs(self) -> dict[str, np.ndarray]:
        """The step's model outputs (training mode): those read back with it, or, for the
        last step when nothing is in flight, ``last_outputs()``."""
        self._wait()
        if self._launch.outputs is not None:
            return self._launch.outputs
        if self._launcher.last is not self._launch:
            raise TrOnnxError("the outputs of this step were not kept (only a step's model "
                              "output the executor reads back with it, or the last step's)")
        return self._last_outputs()


class StepLauncher:
    """Launches the steps of one session's ``TrainingState`` and accounts for each when it is
    read back (warnings, counters, ``TrainingDiverged``). ``lr_of_step(k)``: the learning rate
    of optimizer step k (1-based); ``output_name``: the model output read back with a
    pipelined step."""

    def __init__(self, state: TrainingState, grad_accumulation: int, max_bad_steps: int,
                 lr_of_step: Callable[[int], float], output_name: str):
        self.state = state
        self.grad_accumulation, self.max_bad_steps = grad_accumulation, max_bad_steps
        self.lr_of_step, self.output_name = lr_of_step, output_name
        self.inflight: list[Launch] = []  # launched, not yet read back (oldest first)
        self.last: Launch | None = None  # the last step given to the executor

    def pipelined(self, plan: CompiledPlan) -> bool:
        """Whether steps of ``plan`` may be launched before the previous one is read back."""
        return self.grad_accumulation == 1 and \
            getattr(plan.executor, "can_launch_steps", False)

    def submit(self, plan: CompiledPlan, rank_rows: tuple[int, float], wait: bool,
               last_outputs: Callable[[], dict[str, np.ndarray]]):
        """Launch a step of ``plan`` (its batch already in the plan's INPUT): its loss when
        ``wait``, else a ``PendingStep`` with at most this step in flight."""
        state = self.state
        launch = Launch(plan, state.rng_counter,
                        state.micro_step + 1 == self.grad_accumulation, *rank_rows)
        state.rng_counter += 1
        self.last = launch
        pending = PendingStep(self, launch, last_outputs)
        if not (self.pipelined(plan) and not wait):
            self.drain()
            self._launch(launch)
            self.inflight.append(launch)
            self.drain()
            return pending.loss() if wait else pending
        self._launch(launch)
        self.inflight.append(launch)
        try:
            while len(self.inflight) > 1:  # at most one step in flight when this returns
                self.resolve_oldest()
        except TrainingDiverged:  # the newer steps were launched assuming the bad one applied:
            state.rng_counter = self.inflight[0].rng  # the device rejected them, drop them
            self.inflight.clear()
            raise
        return pending

    def _launch(self, launch: Launch) -> None:
        """Upload the per-step scalars of ``launch`` (assuming every earlier step still in
        flight is applied) and launch it; the batch is already in the plan's INPUT."""
        ex, k, state = launch.plan.executor, self.grad_accumulation, self.state
        inflight = self.inflight
        earlier = inflight[:inflight.index(launch)] if launch in inflight else inflight
        step = state.step + sum(1 for e in earlier if e.apply)
        ex.write_scalar(Reserved.LR, self.lr_of_step(step + 1))
        ex.write_scalar(Reserved.STEP, step + 1)
        ex.write_scalar(Reserved.GRAD_SCALE, 1.0 / k)
        ex.write_scalar(Reserved.RNG, launch.rng)
        if state.world is not None:  # the gradients are reduced on the steps that apply
            ex.write_scalar(Reserved.REDUCE, float(launch.apply))
            ex.write_scalar(Reserved.ROW_WEIGHT, launch.row_weight)
            ex.write_scalar(Reserved.HAS_ROWS, launch.row_weight != 0.0)
            if Reserved.SAMPLE_OFFSET in ex.memory.tensors:
                ex.write_scalar(Reserved.SAMPLE_OFFSET, launch.rows_before)
        if self.pipelined(launch.plan):
            want = [self.output_name] if self.output_name in ex.step_outputs else []
            launch.token = ex.launch_step(launch.apply, want)
            launch.outputs = dict.fromkeys(want) if want else None  # filled when read back
        else:
            launch.report = run_step(ex, launch.plan.info, launch.apply)

    def resolve_oldest(self) -> None:
        """Read back the oldest step in flight and account for it; if it was not applied, the
        newer ones were rejected on the device and are launched again."""
        launch = self.inflight.pop(0)
        if launch.report is None:
            ex = launch.plan.executor
            launch.report = finish_step(ex, launch.token, launch.apply)
            if launch.outputs:
                launch.outputs = {n: ex.step_output(launch.token, n) for n in launch.outputs}
        if launch.report.rejected:
            raise TrOnnxError(f"step {self.state.step + 1} was rejected by the device's step "
                              "guard (its step count disagreed with the session's): was "
                              "session.step changed while steps were in flight?")
        applied = self._account(launch)
        if not applied:
            for later in self.inflight:
                self._launch(later)

    def drain(self) -> None:
        """Wait for every step in flight (reading state needs them applied)."""
        while self.inflight:
            self.resolve_oldest()

    def _account(self, launch: Launch) -> bool:
        """The host's side of a finished step; returns whether it was applied as the launch
        of the next one assumed."""
        report, state = launch.report, self.state
        loss = report.loss
        if report.bad:  # nothing changed; the micro-batches accumulated since the last step
            state.micro_step = 0  # were dropped too
            state.bad_steps += 1
            where = f" on one of the {state.world.size} ranks" if state.world is not None \
                else ""
            warnings.warn(f"step {state.step + 1}: non-finite loss ({loss}) or gradient{where}; "
                          f"the step was not applied ({state.bad_steps} in a row)",
                          RuntimeWarning, stacklevel=5)
            if state.bad_steps >= self.max_bad_steps:
                raise TrainingDiverged(f"{state.bad_steps} steps in a row had a non-finite loss "
                                       f"or gradient (last at step {state.step + 1}); weights "
                                       "are those of the last good step")
            return not launch.apply
        state.bad_steps = 0
        state.version += 1  # running statistics (and below, maybe weights) changed
        state.micro_step += 1
        if launch.apply:
            state.last_grad_norm = report.grad_norm
            state.micro_step = 0
            if report.overflow:
                # a rejected step keeps it
                scale = launch.plan.executor.read_scalar(Reserved.LOSS_SCALE)
                warnings.warn(f"step {state.step + 1}: fp16 gradient overflow; the step was "
                              f"skipped and the loss scale lowered to {scale:g} (not "
                              "counted towards max_bad_steps)", RuntimeWarning, stacklevel=5)
                return False
            state.step += 1
        return True


def rank_rows(world: World | None, feed: dict[str, np.ndarray],
              const_feeds) -> tuple[int, float]:
    """Data parallelism: where this rank's rows start in the global batch (the rows of the
    ranks before it), so its batch-major dropout masks are those rows of the global
    batch's (``train_pass.sample_offset``), and its gradient's weight ``size * rows /
    total rows`` (``train_pass.ROW_WEIGHT``), so the ranks' mean gradient is the mean over
    every row of the global batch however it was split (0 for a rank with no rows). A
    rank's rows: the axis-0 extent its data feeds share; where they share none on some
    rank, every rank weighs 1 (the ranks' plain mean; ``const_feeds``, the model's plan-time
    constants, are no rows). One collective per step, on every rank."""
    if world is None:
        return 0, 1.0
    extents = {np.shape(x)[0] for name, x in feed.items()
               if np.ndim(x) and name not in const_feeds}
    rows = world.allgather_int(extents.pop() if len(extents) == 1 else -1)
    before = sum(max(r, 0) for r in rows[:world.rank])
    if min(rows) < 0 or not sum(rows):
        return before, 1.0
    return before, world.size * rows[world.rank] / sum(rows)
