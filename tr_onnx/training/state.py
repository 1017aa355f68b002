"""``TrainingState``: what training changes, and where it lives between plans.

A session compiles one training plan per batch shape; the parameters, optimizer state,
gradient accumulators, running statistics and loss scale live in the arena of one of them,
the active plan, and move to another when a batch of another shape comes (``activate``).
Before any plan exists (or after ``unfreeze`` dropped them) they are host arrays waiting for
the next plan (``pending``: the model's initializers, ``load_parameters``' values, a
checkpoint's arrays). The counters (optimizer steps, micro-batches, RNG counter, non-finite
steps in a row) are the host's side of the same state.

Reading or writing the arena assumes no step is in flight: ``TrainingSession`` drains its
``StepLauncher`` first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import numpy_helper

from .. import ir
from ..compiler import CompiledPlan
from ..distributed import World
from ..errors import CheckpointError
from ..importer import ImportedModel
from .parameters import ParamSharing, shared_value
from .reserved import Reserved
from .train_pass import TrainInfo


class TrainingState:
    """The state of one session's training (module docstring). ``world``: the data-parallel
    world of more than one rank (None: one process), and ``world_id`` what
    ``distributed.register`` gave it (the plans' collective nodes name it)."""

    def __init__(self, imported: ImportedModel, sharing: ParamSharing, world: World | None,
                 world_id: int | None):
        self.imported, self.sharing = imported, sharing
        self.world, self.world_id = world, world_id
        self.broadcast_due = world is not None  # rank 0's state before the next step
        self.step = 0  # optimizer steps taken
        self.micro_step = 0  # micro-batches accumulated towards the next step
        self.rng_counter = 0  # micro-batches seen (dropout masks depend on it)
        self.bad_steps = 0  # non-finite steps in a row
        self.last_grad_norm: float | None = None
        self.version = 0  # bumped whenever weights or running statistics change
        self.active: CompiledPlan | None = None
        self.pending: dict[str, np.ndarray] = {}  # state to load into the next plan
        # (file, arrays) of from_checkpoint, until the first plan holds them
        self.checkpoint: tuple[Path, dict[str, np.ndarray]] | None = None

    # ---- between plans ---------------------------------------------------------------------

    def activate(self, plan: CompiledPlan) -> None:
        """Move the state into ``plan``'s arena (from the active plan's and ``pending``)."""
        if plan is self.active:
            return
        self._check_checkpoint_state(plan)
        state = self.read(self.active) if self.active is not None else {}
        state.update(self.pending)
        self.pending = {}
        self.active = plan
        self.write(plan, state)
        self.checkpoint = None
        guard = plan.info.step_guard
        if guard is not None:  # the step guard counts applied steps on the device
            plan.executor.write_scalar(guard.applied, self.step)

    def deactivate(self) -> None:
        """Take the state out of the active plan's arena into ``pending`` (the plans are about
        to be dropped)."""
        if self.active is not None:
            self.pending = self.read(self.active) | self.pending
        self.active = None

    def mutable_names(self, plan: CompiledPlan) -> list[str]:
        """What a step of ``plan`` may change, in a fixed order (the same on every rank)."""
        info: TrainInfo = plan.info
        names = list(info.trainable) + list(info.running_stats) + list(info.grads.values())
        names += [v for s in info.states.values() for v in s.values()]
        names += [p for p in info.untied if p not in names]
        # frozen parameters too: load_parameters may have changed them, and a re-plan for
        # another batch shape must carry that over
        names += [v.name for v in plan.graph.values.values() if v.kind == ir.PARAM
                  and v.span_of is None and v.dtype.kind == "f" and v.name not in names]
        scaling = info.loss_scaling
        if scaling is not None:
            names += [scaling.scale, scaling.inv_scale, scaling.growth_tracker]
        return names

    def read(self, plan: CompiledPlan) -> dict[str, np.ndarray]:
        state = plan.executor.read_state(self.mutable_names(plan))
        if plan.info.grads_overwritten:  # GRAD holds the last step's gradients: nothing is
            for name in plan.info.grads.values():  # accumulated between steps
                state[name] = np.zeros_like(state[name])
        return state

    def write(self, plan: CompiledPlan, state: dict[str, np.ndarray]) -> None:
        plan.executor.write_state(state)
        for name, copy in plan.info.half_copies.items():  # half weights follow their masters
            if name in state:
                plan.executor.write_tensor(copy, state[name])

    def _check_checkpoint_state(self, plan: CompiledPlan) -> None:
        """The checkpoint's arrays that ``plan`` holds fit it exactly (its optimizer state and
        accumulators are only known once a plan exists); checked before anything is written.
        bfloat16 arrays (half-precision gradients) come back from ``np.load`` as raw 2-byte
        values: they are viewed as the plan's dtype again."""
        if self.checkpoint is None:
            return
        path, arrays = self.checkpoint
        raw = {}
        for name, value in arrays.items():
            t = plan.memory.tensors.get(name)
            if t is None or self.pending.get(name) is not value:
                continue  # not in this plan, or replaced by load_parameters
            is_raw = value.dtype.kind == "V" and value.dtype.itemsize == t.dtype.itemsize
            if value.shape != tuple(t.shape) or not (value.dtype == t.dtype or is_raw):
                raise CheckpointError(
                    f"{path}: array {name!r} is {value.dtype}{list(value.shape)}, but the "
                    f"training plan's {name!r} is {t.dtype}{list(t.shape)}; the file is damaged "
                    "or its arrays were replaced (nothing was changed)")
            if is_raw:
                raw[name] = value.view(t.dtype)
        self.pending.update(raw)

    # ---- the state as host arrays --------------------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """Parameters, running statistics, optimizer state and gradient accumulators."""
        if self.active is None:
            return self._initial() | dict(self.pending)
        return self.read(self.active)

    def _initial(self) -> dict[str, np.ndarray]:
        return {i.name: numpy_helper.to_array(i) for i in self.imported.proto.graph.initializer
                if i.name in self.imported.param_names}

    def untied_names(self) -> dict[str, str]:
        """Identity copies of parameters that train as parameters of their own."""
        return {copy: self.sharing.identity[copy] for copy in self.sharing.untie}

    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter and running statistic (what export writes), untied Identity copies
        and tied copies included."""
        params = self._initial()
        copies = {**self.untied_names(), **self.sharing.split_sources()}
        for name, source in copies.items():  # trained separately: their own values follow
            params[name] = params[source]
        if self.active is None:
            params.update({k: v for k, v in self.pending.items() if k in params})
        else:
            state = self.read(self.active)
            params.update({k: v for k, v in state.items() if k in params})
        for copy, shared in self.sharing.tie.items():  # one parameter: the source's value
            params[copy] = shared_value(params, shared)
        return params

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite parameters (and any other state) by name; across ranks, rank 0's values
        win before the next step."""
        self.version += 1
        self.broadcast_due = self.world is not None
        if self.active is None:
            self.pending.update(values)
        else:
            self.write(self.active, values)

    def loss_scale(self, loss_scale: dict | None) -> float | None:
        """The dynamic loss scale the next step uses (``loss_scale``: the session's option)."""
        if not loss_scale:
            return None
        if self.active is None:
            return float(self.pending.get(Reserved.LOSS_SCALE, loss_scale["init"]))
        return float(self.active.executor.read_scalar(Reserved.LOSS_SCALE))

    def broadcast(self, plan: CompiledPlan) -> None:
        """Every rank takes rank 0's training state (parameters, optimizer state, running
        statistics, accumulators, counters), so the ranks start identical; as raw bytes, so
        any dtype travels."""
        state = self.read(plan)
        for name in self.mutable_names(plan):  # the same plan, so the same order everywhere
            value = np.array(state[name], order="C")  # a scalar stays 0-d (not ascontiguous)
            self.world.bcast_(value.reshape(-1).view(np.uint8))
            state[name] = value
        self.write(plan, state)
        (self.step, self.micro_step, self.rng_counter, self.bad_steps) = self.world.bcast_object(
            (self.step, self.micro_step, self.rng_counter, self.bad_steps))
        self.version += 1
        self.broadcast_due = False
