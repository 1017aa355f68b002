"""``TrainingSession``: train an ONNX model, evaluate it, export it, checkpoint it."""

from __future__ import annotations

import inspect
import io
import json
import math
import numbers
import warnings
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .. import ir
from ..backends import Backend, backend_for, check_cuda_graphs
from ..compiler import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    CompiledPlan,
    PlanCache,
    compile_plan,
    plan_key,
)
from ..distributed import World, register
from ..errors import (
    CheckpointError,
    ExportAdviceWarning,
    InputError,
    ModelLoadError,
    OptionError,
    TrainingDiverged,
    TrOnnxError,
)
from ..export_advice import export_advice
from ..feeds import (
    check_batch_rows,
    check_class_indices,
    check_feed,
    check_labels,
    check_output_names,
)
from ..importer import (
    DEFAULT_FOLD_LIMIT_BYTES,
    ImportedModel,
    check_byte_limit,
    import_model,
)
from ..optim import AdamW, Optimizer, Schedule, make_optimizer, make_schedule
from ..passes.control_flow import output_value
from ..registry import build_registry, default_registry
from . import checkpoints, groups
from .data_parallel import REDUCE
from .export import export_model
from .losses import ClassLabels, LossSpec, check_loss_model, class_labels, make_loss_spec
from .parameters import (
    ParamRole,
    name_patterns,
    parameter_roles,
    parameter_sharing,
    share_parameters,
    shared_value,
)
from .pipeline import build_training_step
from .precision import (
    check_loss_scale,
    check_precision,
)
from .step import StepReport, finish_step, run_step
from .storage import (
    CHECKPOINT_FORMAT,
    atomic_write,
    read_checkpoint,
    shared_checkpoint,
)
from .train_pass import (
    GRAD_SCALE,
    HAS_ROWS,
    LOSS_SCALE,
    LR,
    RNG,
    ROW_WEIGHT,
    SAMPLE_OFFSET,
    STEP,
    TrainConfig,
    TrainInfo,
    to_inference_mode,
)


@dataclass(eq=False)
class _Launch:
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

    def __init__(self, session: TrainingSession, launch: _Launch):
        self._session, self._launch = session, launch

    @property
    def done(self) -> bool:
        return self._launch not in self._session._inflight and self._launch.report is not None

    def _wait(self) -> StepReport:
        inflight = self._session._inflight
        while self._launch in inflight:
            self._session._resolve_oldest()
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
        session = self._session
        if session._last is not self._launch:
            raise TrOnnxError("the outputs of this step were not kept (only a step's model "
                              "output the executor reads back with it, or the last step's)")
        return session.last_outputs()


class TrainingSession:
    """Train an ONNX model.

    ``model``: path, bytes or ModelProto. ``loss``: ``"cross_entropy"`` (ONNX
    SoftmaxCrossEntropyLoss), ``"mse"``, ``"l1"``, ``"bce_with_logits"``, ``"smooth_l1"``, a
    ``LossSpec`` (reduction, ignore_index, class weights, beta), or an ONNX loss model (path or
    ModelProto) taking (model output, labels) and returning a scalar. ``optimizer``: a
    ``tr_onnx.optim`` optimizer or its name. ``trainable``: initializer names or fnmatch
    patterns (None: the model's parameters the loss depends on -- what PyTorch's
    ``model.parameters()`` would be; constants the exporter materialised, such as Clip bounds,
    Pow exponents and scalar multipliers, and buffers are frozen: ``parameter_roles`` and
    ``tr-onnx inspect`` say why for each); ``frozen`` removes names/patterns from that.
    ``lr_schedule``: ``tr_onnx.optim`` schedule or name. ``grad_accumulation``: k micro-batches
    per optimizer step (gradients averaged). ``clip_grad_norm``: global-norm clipping.
    ``bn_running_var``: ``"biased"`` (ONNX spec) or ``"unbiased"`` (PyTorch).
    ``tie_shared_initializers``: None (default) trains equal initializers that are not
    constant-filled and have >= 256 elements as one parameter (an exporter's copies, or a
    weight and its folded transpose, as GPT-2's tied embedding) and keeps the rest apart (a
    fresh BatchNorm's weight and running variance, shared by an eval export through Identity,
    were separate parameters); True also keeps every Identity copy one parameter; False keeps
    all apart (``training.parameters``).
    ``max_bad_steps``: raise ``TrainingDiverged`` after this many non-finite steps in a row.
    ``backend``: ``"numpy"``, ``"cuda"``, ``"auto"`` (cuda when a GPU is usable) or a
    ``backends.Backend`` (the tests' cuda over the host emulator, ``host_emulator.emulated_cuda``).
    ``precision``: ``"fp32"`` (default) or, on the cuda backend, ``"fp16"`` / ``"bf16"``:
    activations and gradients stored in float16 / bfloat16, float32 master weights updated by
    the fused optimizer, which also writes the half copy the next step reads
    (``training.precision``). ``loss_scale`` (fp16 only): dynamic loss scaling as
    ``torch.amp.GradScaler``, on by default with fp16; a dict overrides ``init`` (65536),
    ``growth_factor`` (2), ``backoff_factor`` (0.5) and ``growth_interval`` (2000);
    ``False`` turns it off. A step whose gradients overflow is skipped (weights and optimizer
    state unchanged, ``step`` does not advance, the scale backs off) with a warning naming
    it; it does not count towards ``max_bad_steps``. ``loss_scale`` the property: the scale.
    ``cuda_graphs`` (cuda): ``"fallback"`` (default; a step that cannot be captured into a
    CUDA graph warns naming the node and runs eagerly), ``"require"`` (raise) or ``"off"``.
    ``external_data_dir``: the folder a model (or ONNX loss model) given as bytes or a ModelProto
    keeps its external data in; without it, such a model may not reference external data.
    ``fold_limit_bytes``, ``max_arena_bytes``: as ``InferenceSession``'s. ``max_plans``: compiled
    training-step plans kept, and evaluation plans kept (default 8 each, the most recently
    used); the training state moves with the active plan, so an evicted plan loses nothing.
    ``max_plan_bytes``: of those, each cache keeps only as many as fit in this many bytes
    (default 256 MiB; None: no limit), as ``InferenceSession``'s.
    ``distributed``: the ``tr_onnx.distributed.World`` this process trains in (data parallel,
    one session per rank, each fed its own shard of every global batch): each rank's gradient
    is weighted by its rows (``size * rows / global rows``; a rank with no rows adds nothing
    and its ``train_step`` returns 0) and averaged over the ranks before each optimizer step
    (``ops.collective``), so N ranks train as one process with their batches together,
    however the global batch splits; rank 0's parameters, optimizer state and
    running statistics are broadcast before the first step and the first step after
    ``load_parameters`` (every rank calls it; rank 0's values win). BatchNorm running
    statistics are rank 0's, broadcast every step (DDP's default); ``sync_batchnorm=True``
    computes the batch statistics (and their gradients) over every rank's batch instead, as
    ``torch.nn.SyncBatchNorm`` (numpy: MPI all-reduces of the per-channel sums; cuda: NCCL
    all-reduces inside the captured step, between kernels of its own instead of cuDNN's
    BatchNorm). A non-finite loss or gradient on any rank skips the step on
    all of them. ``train_step`` returns this rank's loss. ``grad_bucket_mb``: the gradients
    are all-reduced in buckets of about this size, each started as soon as the backward pass
    has finished it (DDP's ``bucket_cap_mb``).
    Fine-tuning (docs/finetune.md, ``training.groups``): ``frozen_batchnorm="eval"`` (frozen
    BatchNorms in inference mode), ``unfreeze_after`` epochs (``begin_epoch``), ``lr_groups``
    {pattern: lr multiplier}, ``step_offsets`` (``unfreeze`` records them). ``lora``: the
    ``LoraInfo`` of ``finetune.lora.add_lora`` that made ``model`` (trainable by default
    ``lora.trainable``): checkpoints then hold the trained tensors alone (``checkpoints``).
    """

    def __init__(self, model, loss="cross_entropy", optimizer: Optimizer | str | None = None,
                 trainable=None, backend: str | Backend = "auto", label_name: str = "labels", *,
                 output_name: str | None = None, frozen=(), lr: float | None = None,
                 lr_schedule: Schedule | str | None = None, grad_accumulation: int = 1,
                 clip_grad_norm: float | None = None, bn_running_var: str = "biased",
                 tie_shared_initializers: bool | None = None, seed: int = 0,
                 channel_align: int | None = None, max_bad_steps: int = 5, plugins=(),
                 precision: str = "fp32",
                 loss_scale=None, cuda_graphs: str = "fallback",
                 external_data_dir: str | Path | None = None,
                 fold_limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES,
                 max_arena_bytes: int | None = None, max_plans: int = DEFAULT_MAX_PLANS,
                 max_plan_bytes: int | None = DEFAULT_MAX_PLAN_BYTES,
                 distributed: World | None = None, sync_batchnorm: bool = False,
                 grad_bucket_mb: float = 25.0, frozen_batchnorm: str = "train",
                 unfreeze_after: int | None = None, lr_groups: dict | None = None,
                 step_offsets: dict | None = None, lora=None):
        self.target: Backend = backend_for(backend)  # what its plans are compiled for
        self.backend = self.target.name
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        precision = check_precision(precision, self.backend)
        loss_scale = check_loss_scale(loss_scale, precision)
        self.channel_align = channel_align or self.target.channel_align
        self.registry = build_registry(plugins) if plugins else default_registry()
        self._external_data_dir = external_data_dir
        self.max_arena_bytes = check_byte_limit("max_arena_bytes", max_arena_bytes)
        self.fold_limit_bytes = fold_limit_bytes
        # training steps (the active one holds the state), evaluation
        self._plans = PlanCache(max_plans, max_plan_bytes)
        self._eval_plans = PlanCache(max_plans, max_plan_bytes)
        self.imported: ImportedModel = import_model(model, self.registry, self.backend,
                                                    external_data_dir=external_data_dir,
                                                    fold_limit_bytes=fold_limit_bytes)
        self.optimizer = make_optimizer(optimizer if optimizer is not None else AdamW(), lr)
        self.schedule = make_schedule(lr_schedule)
        if grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be >= 1, got {grad_accumulation}")
        if bn_running_var not in ("biased", "unbiased"):
            raise ValueError(f"bn_running_var {bn_running_var!r}; valid: biased, unbiased")
        self.loss = self._loss(loss)
        self.output_name = output_name or self.imported.outputs[0].name
        if self.output_name not in {o.name for o in self.imported.outputs}:
            raise InputError(f"output_name {self.output_name!r}; the model's outputs are "
                             f"{[o.name for o in self.imported.outputs]}")
        self.label_name = label_name
        if tie_shared_initializers not in (None, True, False):
            raise OptionError(f"tie_shared_initializers must be None, True or False, got "
                              f"{tie_shared_initializers!r}")
        if clip_grad_norm is not None and (
                isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real)
                or not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0):
            raise OptionError(f"clip_grad_norm={clip_grad_norm!r}: must be a finite number > 0 "
                              "(the largest global gradient norm; None: no clipping)")
        if isinstance(max_bad_steps, bool) or not isinstance(max_bad_steps, numbers.Integral) \
                or max_bad_steps < 1:
            raise OptionError(f"max_bad_steps={max_bad_steps!r}: must be an integer >= 1 (the "
                              "non-finite steps in a row that stop training)")
        if isinstance(grad_bucket_mb, bool) or not isinstance(grad_bucket_mb, numbers.Real) \
                or not 0 < grad_bucket_mb < math.inf:
            raise OptionError(f"grad_bucket_mb={grad_bucket_mb!r}: must be a finite number > 0 "
                              "(the size of the gradient all-reduce buckets, in MiB)")
        self.sharing = parameter_sharing(self.imported, tie_shared_initializers)
        self.parameter_roles: dict[str, ParamRole] = parameter_roles(self.imported,
                                                                     self.sharing)
        # trains as written, which may not be what was intended
        for advice in export_advice(self.imported, tied=self.sharing.tie,
                                    split=self.sharing.split):
            warnings.warn(f"{self.imported.source}: {advice}", ExportAdviceWarning, stacklevel=2)
        initializers = {i.name for i in self.imported.proto.graph.initializer}
        initializers |= set(self.parameter_roles)
        self.lora = checkpoints.check_lora(lora, initializers)
        trainable = lora.trainable if trainable is None and lora is not None else trainable
        self.options = dict(trainable=(name_patterns("trainable", trainable, initializers)
                                       if trainable is not None else None),
                            frozen=name_patterns("frozen", frozen, initializers),
                            grad_accumulation=int(grad_accumulation),
                            clip_grad_norm=clip_grad_norm, bn_running_var=bn_running_var,
                            tie_shared_initializers=tie_shared_initializers,
                            seed=int(seed), max_bad_steps=int(max_bad_steps),
                            precision=precision, loss_scale=loss_scale,
                            fold_limit_bytes=fold_limit_bytes,
                            sync_batchnorm=bool(sync_batchnorm), grad_bucket_mb=grad_bucket_mb,
                            frozen_batchnorm=groups.check_frozen_batchnorm(frozen_batchnorm),
                            unfreeze_after=groups.check_unfreeze_after(unfreeze_after),
                            lr_groups=groups.check_lr_groups(lr_groups, self.backend, precision),
                            step_offsets={str(k): int(v) for k, v in (step_offsets or {}).items()})
        # a world of one trains as no world at all: the plan gets no collective nodes
        self.world = distributed if distributed is not None and distributed.size > 1 else None
        self._world_id = register(self.world) if self.world is not None else None
        self._broadcast_due = self.world is not None  # rank 0's state before the next step
        self.step = 0  # optimizer steps taken
        self.micro_step = 0  # micro-batches accumulated towards the next step
        self.rng_counter = 0  # micro-batches seen (dropout masks depend on it)
        self.bad_steps = 0  # non-finite steps in a row
        self._inflight: list[_Launch] = []  # launched, not yet read back (oldest first)
        self._last: _Launch | None = None  # the last step given to the executor
        # plan id -> (the plan, its class-index labels)
        self._class_labels: dict[int, tuple[weakref.ref, list[ClassLabels]]] = {}
        self._active: CompiledPlan | None = None
        self._pending: dict[str, np.ndarray] = {}  # state to load into the next plan
        self._version = 0  # bumped whenever weights or running statistics change
        self._eval_synced: dict[int, int] = {}  # eval plan id -> version its weights hold
        self._plugins = plugins
        self.last_grad_norm: float | None = None
        # (file, arrays) of from_checkpoint, until the first plan holds them
        self._checkpoint: tuple[Path, dict[str, np.ndarray]] | None = None

    # ---- configuration -----------------------------------------------------------------

    def _loss(self, loss):
        if isinstance(loss, (onnx.ModelProto, bytes)) or (
                isinstance(loss, (str, Path)) and str(loss).endswith(".onnx")):
            loss_model = import_model(loss, self.registry, self.backend,
                                      external_data_dir=self._external_data_dir,
                                      fold_limit_bytes=self.fold_limit_bytes)
            check_loss_model(loss_model)
            return loss_model
        return make_loss_spec(loss)

    def config(self) -> dict:
        loss = self.loss.config() if isinstance(self.loss, LossSpec) else {
            "onnx": self.loss.original.SerializeToString().hex()}
        return {"loss": loss, "optimizer": self.optimizer.config(),
                "lr_schedule": self.schedule.config(), "label_name": self.label_name,
                "output_name": self.output_name, "backend": self.backend,
                "channel_align": self.channel_align, **self.options}

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return self._lr_of_step(self.step + 1)

    def _lr_of_step(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based)."""
        return self.optimizer.lr * self.schedule.factor(step)

    # ---- plans ---------------------------------------------------------------------------

    def _train_plan(self, feed: dict[str, np.ndarray]) -> CompiledPlan:
        key, shapes, const_feeds = plan_key(feed, self.imported.const_feeds)
        plan = self._plans.lookup(key)
        if plan is None:
            plan = self._compile(shapes, const_feeds)
            self._plans[key] = plan
        if plan is not self._active:
            self._drain()
            self._check_checkpoint_state(plan)
            state = self._read_state(self._active) if self._active is not None else {}
            state.update(self._pending)
            self._pending = {}
            self._active = plan
            self._write_state(plan, state)
            self._checkpoint = None
            guard = plan.info.step_guard
            if guard is not None:  # the step guard counts applied steps on the device
                plan.executor.write_scalar(guard.applied, self.step)
        self._plans.evict()  # after the state moved: the active plan is the most recent
        return plan

    def _compile(self, shapes: dict[str, tuple], const_feeds: dict[str, np.ndarray]
                 ) -> CompiledPlan:
        opts = self.options
        cfg = TrainConfig(
            self.loss, self.optimizer, self.output_name, self.label_name,
            trainable=opts["trainable"], frozen=opts["frozen"],
            default_trainable=frozenset(n for n, r in self.parameter_roles.items()
                                        if r.trainable),
            clip_grad_norm=opts["clip_grad_norm"],
            bn_unbiased_running_var=opts["bn_running_var"] == "unbiased",
            sharing=self.sharing, seed=opts["seed"],
            precision=opts["precision"], loss_scale=opts["loss_scale"],
            step_guard=self.target.decides_steps,
            data_inputs=tuple(i.name for i in self.imported.inputs),
            world=self._world_id, sync_batchnorm=opts["sync_batchnorm"],
            grad_bucket_bytes=max(1, int(opts["grad_bucket_mb"] * (1 << 20))),
            grad_accumulation=opts["grad_accumulation"],
            frozen_batchnorm_eval=opts["frozen_batchnorm"] == "eval",
            lr_groups=opts["lr_groups"] or {}, step_offsets=opts["step_offsets"])
        return compile_plan(self.imported, shapes, const_feeds,
                            self.target, self.channel_align,
                            transform=partial(build_training_step, registry=self.registry,
                                              backend=self.backend, cfg=cfg),
                            absorb_flatten=False,
                            cuda_graphs=self.cuda_graphs, max_arena_bytes=self.max_arena_bytes)

    def begin_epoch(self, epoch: int) -> str | None:
        """Before epoch ``epoch`` (0-based): ``unfreeze`` if due (``groups.unfreeze_due``)."""
        if not groups.unfreeze_due(self.options, epoch):
            return None
        self.unfreeze()
        return f"epoch {epoch + 1}: unfrozen after {epoch} epochs, every parameter trains"

    def unfreeze(self, trainable=None, frozen=()) -> None:
        """Train ``trainable`` minus ``frozen`` (default: the model's parameters) in new plans:
        new optimizer state starts at zero and counts its own steps (``unfrozen_offsets``), as
        torch's ``add_param_group``; everything else carries over."""
        self._drain()
        if self._active is not None:
            self._pending = self._read_state(self._active) | self._pending
            self.options["step_offsets"].update(groups.unfrozen_offsets(
                self._active, self.step, self.backend, self.options))
        self._plans.clear()
        self._plans.sizes.clear()
        self._active = None
        self.options.update(trainable=list(trainable) if trainable is not None else None,
                            frozen=list(frozen))

    def _mutable_names(self, plan: CompiledPlan) -> list[str]:
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

    def _read_state(self, plan: CompiledPlan) -> dict[str, np.ndarray]:
        state = plan.executor.read_state(self._mutable_names(plan))
        if plan.info.grads_overwritten:  # GRAD holds the last step's gradients: nothing is
            for name in plan.info.grads.values():  # accumulated between steps
                state[name] = np.zeros_like(state[name])
        return state

    def _write_state(self, plan: CompiledPlan, state: dict[str, np.ndarray]) -> None:
        plan.executor.write_state(state)
        if self.options["precision"] != "fp32":  # the half weights follow their masters
            for name in plan.info.trainable:
                if name in state:
                    plan.executor.write_tensor(f"{name}.half", state[name])
            for name, copy in plan.info.frozen_half.items():
                if name in state:
                    plan.executor.write_tensor(copy, state[name])

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale the next step uses (None without loss scaling)."""
        cfg = self.options["loss_scale"]
        if not cfg:
            return None
        if self._active is None:
            return float(self._pending.get(LOSS_SCALE, cfg["init"]))
        self._drain()
        return float(self._active.executor.read_scalar(LOSS_SCALE))

    # ---- training ------------------------------------------------------------------------

    def train_step(self, feed: dict[str, np.ndarray], labels, wait: bool = True):
        """Forward, backward and (every ``grad_accumulation``-th call) an optimizer step.

        Returns the loss. A batch with a non-finite loss or gradient changes nothing (weights,
        optimizer state, running statistics); a warning names the step. With loss scaling the
        gradients are checked on the device in the apply phase instead: an overflow skips the
        optimizer step (running statistics of the batch are kept, as with GradScaler) and is
        not counted as a bad step.

        ``wait=False`` returns a ``PendingStep`` at once (``.loss()`` or ``float()`` waits for
        it). On the cuda backend (``grad_accumulation=1``) the step is then launched before the
        previous one is read back, so the host prepares batch k+1 while the GPU runs step k;
        the result is the same as waiting: step k+1 is launched assuming step k is applied,
        and if it was not (a bad batch, an fp16 overflow), the device rejects k+1 (nothing
        changes) and it is launched again. The warnings and ``TrainingDiverged`` of step k come
        from the call that launches step k+1 (whose batch then is not trained); reading state
        (parameters, checkpoints, ``run``, ``last_outputs``) first waits for every pending
        step. Elsewhere (numpy, accumulation) ``wait=False`` runs the step as ``wait=True``.

        A feed or labels the model does not take is an ``InputError`` naming the input
        (``tr_onnx.feeds``), raised before the step runs: nothing changes. So is a class-index
        label out of range (``check_class_labels``) and a batch of 0 samples
        (``check_batch_rows``).
        """
        feed = check_feed(feed, self.imported.inputs)
        if self.world is None:  # a rank of a data-parallel step may have no rows of its own
            check_batch_rows(feed, self.imported.const_feeds)
        plan = self._train_plan(feed)
        if self._broadcast_due:
            self._broadcast_state(plan)
        want = plan.graph.values[self.label_name]
        labels = check_labels(labels, self.label_name, want.shape, want.dtype)
        self._check_class_labels(plan, labels, f"labels {self.label_name!r}")
        executor = plan.executor
        for name, x in feed.items():
            if name not in self.imported.const_feeds:  # a plan-time constant of this plan
                executor.write_input(name, x)
        executor.write_input(self.label_name, labels)
        launch = _Launch(plan, self.rng_counter, self.micro_step + 1 ==
                         self.options["grad_accumulation"], *self._rank_rows(feed))
        self.rng_counter += 1
        self._last = launch
        pending = PendingStep(self, launch)
        if not (self._pipelined(plan) and not wait):
            self._drain()
            self._launch(launch)
            self._inflight.append(launch)
            self._drain()
            return pending.loss() if wait else pending
        self._launch(launch)
        self._inflight.append(launch)
        try:
            while len(self._inflight) > 1:  # at most one step in flight when this returns
                self._resolve_oldest()
        except TrainingDiverged:  # the newer steps were launched assuming the bad one applied:
            self.rng_counter = self._inflight[0].rng  # the device rejected them, drop them
            self._inflight.clear()
            raise
        return pending

    def _rank_rows(self, feed: dict[str, np.ndarray]) -> tuple[int, float]:
        """Data parallelism: where this rank's rows start in the global batch (the rows of the
        ranks before it), so its batch-major dropout masks are those rows of the global
        batch's (``train_pass.sample_offset``), and its gradient's weight ``size * rows /
        total rows`` (``train_pass.ROW_WEIGHT``), so the ranks' mean gradient is the mean over
        every row of the global batch however it was split (0 for a rank with no rows). A
        rank's rows: the axis-0 extent its data feeds share; where they share none on some
        rank, every rank weighs 1 (the ranks' plain mean). One collective per step, on every
        rank."""
        if self.world is None:
            return 0, 1.0
        extents = {np.shape(x)[0] for name, x in feed.items()
                   if np.ndim(x) and name not in self.imported.const_feeds}
        rows = self.world.allgather_int(extents.pop() if len(extents) == 1 else -1)
        before = sum(max(r, 0) for r in rows[:self.world.rank])
        if min(rows) < 0 or not sum(rows):
            return before, 1.0
        return before, self.world.size * rows[self.world.rank] / sum(rows)

    def _broadcast_state(self, plan: CompiledPlan) -> None:
        """Every rank takes rank 0's training state (parameters, optimizer state, running
        statistics, accumulators, counters), so the ranks start identical; as raw bytes, so
        any dtype travels."""
        self._drain()
        state = self._read_state(plan)
        for name in self._mutable_names(plan):  # the same plan, so the same order everywhere
            value = np.array(state[name], order="C")  # a scalar stays 0-d (not ascontiguous)
            self.world.bcast_(value.reshape(-1).view(np.uint8))
            state[name] = value
        self._write_state(plan, state)
        (self.step, self.micro_step, self.rng_counter, self.bad_steps) = self.world.bcast_object(
            (self.step, self.micro_step, self.rng_counter, self.bad_steps))
        self._version += 1
        self._broadcast_due = False

    def check_class_labels(self, labels, feed, what: str = "labels") -> None:
        """An ``InputError`` naming the first of ``labels`` (any number of samples: a whole
        data set) that the loss cannot read as a class index -- outside ``0..C - 1``, C from
        the model output's class axis, and not the loss's ignore_index -- with its position;
        ``what`` names the labels in the message. The training plan of a batch ``feed`` says
        how many classes there are (compiled now if no step has used it yet). Labels of losses
        that take no class indices (mse, ...) are not checked."""
        labels = np.asarray(labels)
        if labels.dtype.kind in "iu":
            self._check_class_labels(self._train_plan(check_feed(feed, self.imported.inputs)),
                                     labels, what)

    def _check_class_labels(self, plan: CompiledPlan, labels: np.ndarray, what: str) -> None:
        cached = self._class_labels.get(id(plan))
        if cached is None or cached[0]() is not plan:  # an evicted plan's id may be reused
            cached = self._class_labels[id(plan)] = (weakref.ref(plan),
                                                     class_labels(plan.graph, self.label_name))
        for entry in cached[1]:
            scores = (f"model output {self.output_name!r} (class axis {self.loss.class_axis})"
                      if isinstance(self.loss, LossSpec) else
                      f"the loss model's {entry.node}")
            check_class_indices(labels, what, entry.classes, entry.ignore_index, scores)

    def _pipelined(self, plan: CompiledPlan) -> bool:
        """Whether steps of ``plan`` may be launched before the previous one is read back."""
        return self.options["grad_accumulation"] == 1 and \
            getattr(plan.executor, "can_launch_steps", False)

    def _launch(self, launch: _Launch) -> None:
        """Upload the per-step scalars of ``launch`` (assuming every earlier step still in
        flight is applied) and launch it; the batch is already in the plan's INPUT."""
        ex, k = launch.plan.executor, self.options["grad_accumulation"]
        inflight = self._inflight
        earlier = inflight[:inflight.index(launch)] if launch in inflight else inflight
        step = self.step + sum(1 for e in earlier if e.apply)
        ex.write_scalar(LR, self._lr_of_step(step + 1))
        ex.write_scalar(STEP, step + 1)
        ex.write_scalar(GRAD_SCALE, 1.0 / k)
        ex.write_scalar(RNG, launch.rng)
        if self.world is not None:  # the gradients are reduced on the steps that apply
            ex.write_scalar(REDUCE, float(launch.apply))
            ex.write_scalar(ROW_WEIGHT, launch.row_weight)
            ex.write_scalar(HAS_ROWS, launch.row_weight != 0.0)
            if SAMPLE_OFFSET in ex.memory.tensors:
                ex.write_scalar(SAMPLE_OFFSET, launch.rows_before)
        if self._pipelined(launch.plan):
            want = [self.output_name] if self.output_name in ex.step_outputs else []
            launch.token = ex.launch_step(launch.apply, want)
            launch.outputs = dict.fromkeys(want) if want else None  # filled when read back
        else:
            launch.report = run_step(ex, launch.plan.info, launch.apply)

    def _resolve_oldest(self) -> None:
        """Read back the oldest step in flight and account for it (warnings, counters,
        ``TrainingDiverged``); if it was not applied, the newer ones were rejected on the
        device and are launched again."""
        launch = self._inflight.pop(0)
        if launch.report is None:
            ex = launch.plan.executor
            launch.report = finish_step(ex, launch.token, launch.apply)
            if launch.outputs:
                launch.outputs = {n: ex.step_output(launch.token, n) for n in launch.outputs}
        if launch.report.rejected:
            raise TrOnnxError(f"step {self.step + 1} was rejected by the device's step guard "
                              "(its step count disagreed with the session's): was "
                              "session.step changed while steps were in flight?")
        applied = self._account(launch)
        if not applied:
            for later in self._inflight:
                self._launch(later)

    def _drain(self) -> None:
        """Wait for every step in flight (reading state needs them applied)."""
        while self._inflight:
            self._resolve_oldest()

    def _account(self, launch: _Launch) -> bool:
        """The host's side of a finished step; returns whether it was applied as the launch
        of the next one assumed."""
        report = launch.report
        loss = report.loss
        if report.bad:  # nothing changed; the micro-batches accumulated since the last step
            self.micro_step = 0  # were dropped too
            self.bad_steps += 1
            where = f" on one of the {self.world.size} ranks" if self.world is not None else ""
            warnings.warn(f"step {self.step + 1}: non-finite loss ({loss}) or gradient{where}; "
                          f"the step was not applied ({self.bad_steps} in a row)",
                          RuntimeWarning, stacklevel=4)
            if self.bad_steps >= self.options["max_bad_steps"]:
                raise TrainingDiverged(f"{self.bad_steps} steps in a row had a non-finite loss "
                                       f"or gradient (last at step {self.step + 1}); weights "
                                       "are those of the last good step")
            return not launch.apply
        self.bad_steps = 0
        self._version += 1  # running statistics (and below, maybe weights) changed
        self.micro_step += 1
        if launch.apply:
            self.last_grad_norm = report.grad_norm
            self.micro_step = 0
            if report.overflow:
                scale = launch.plan.executor.read_scalar(LOSS_SCALE)  # a rejected step keeps it
                warnings.warn(f"step {self.step + 1}: fp16 gradient overflow; the step was "
                              f"skipped and the loss scale lowered to {scale:g} (not "
                              "counted towards max_bad_steps)", RuntimeWarning, stacklevel=4)
                return False
            self.step += 1
        return True

    def last_outputs(self) -> dict[str, np.ndarray]:
        """The model outputs of the last ``train_step`` (training mode), as host arrays."""
        self._drain()
        plan = self._active
        if plan is None:
            raise TrOnnxError("no training step has run yet")
        return plan.executor.read_state(plan.info.outputs)

    # ---- parameters ----------------------------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Current parameters, running statistics, optimizer state and gradient accumulators
        (logical NCHW host copies), by name."""
        self._drain()
        if self._active is None:
            return self._initial_state() | dict(self._pending)
        return self._read_state(self._active)

    def _initial_state(self) -> dict[str, np.ndarray]:
        return {i.name: numpy_helper.to_array(i) for i in self.imported.proto.graph.initializer
                if i.name in self.imported.param_names}

    def _untied_names(self) -> dict[str, str]:
        """Identity copies of parameters that train as parameters of their own."""
        return {copy: self.sharing.identity[copy] for copy in self.sharing.untie}

    def parameters(self) -> dict[str, np.ndarray]:
        """Current values of every parameter and running statistic (what export writes),
        untied Identity copies and tied copies included, by name."""
        self._drain()
        params = self._initial_state()
        copies = {**self._untied_names(), **self.sharing.split_sources()}
        for name, source in copies.items():  # trained separately: their own values follow
            params[name] = params[source]
        if self._active is None:
            params.update({k: v for k, v in self._pending.items() if k in params})
        else:
            state = self._read_state(self._active)
            params.update({k: v for k, v in state.items() if k in params})
        for copy, shared in self.sharing.tie.items():  # one parameter: the source's value
            params[copy] = shared_value(params, shared)
        return params

    def load_parameters(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite parameters (and any other state) by name. Data parallel: call it on every
        rank; rank 0's values reach all of them before the next step."""
        self._drain()
        self._version += 1
        self._broadcast_due = self.world is not None
        if self._active is None:
            self._pending.update(values)
        else:
            self._write_state(self._active, values)

    # ---- evaluation ----------------------------------------------------------------------

    def run(self, output_names: list[str] | None, feed: dict[str, np.ndarray]) -> list:
        """Eval mode (running statistics, no dropout) with the current weights. Bad output
        names or feeds are an ``InputError`` (``tr_onnx.feeds``) before anything runs."""
        names = check_output_names(output_names, self.imported.outputs)
        feed = check_feed(feed, self.imported.inputs)
        self._drain()
        key, shapes, const_feeds = plan_key(feed, self.imported.const_feeds)
        plan = self._eval_plans.lookup(key)
        if plan is None:
            def eval_graph(graph: ir.Graph) -> None:
                share_parameters(graph, self.sharing, self.registry, self.backend)
                to_inference_mode(graph)

            plan = compile_plan(self.imported, shapes, const_feeds,
                                self.target, self.channel_align, transform=eval_graph,
                                cuda_graphs=self.cuda_graphs,
                                max_arena_bytes=self.max_arena_bytes)
            self._eval_plans[key] = plan
            for dropped in self._eval_plans.evict():  # (a later plan may reuse its id)
                self._eval_synced.pop(id(dropped), None)
        if self._eval_synced.get(id(plan)) != self._version:  # weights changed since last time
            self._sync_eval_weights(plan)
            self._eval_synced[id(plan)] = self._version
        for name, x in feed.items():
            if name not in self.imported.const_feeds:
                plan.executor.write_input(name, x)
        plan.executor.run()
        types = {vi.name: vi.type for vi in self.imported.proto.graph.output}
        listed = [v.name for v in plan.graph.outputs]
        return [output_value(plan.executor.read_output, n, types[n], listed) for n in names]

    def _sync_eval_weights(self, plan: CompiledPlan) -> None:
        """Copy parameters and running statistics into an eval plan's arena (view to view on
        numpy)."""
        if self._active is None:
            plan.executor.write_state(self.parameters())
            return
        info = self._active.info
        plan.executor.copy_state_from(self._active.executor,
                                      [*info.trainable, *info.running_stats, *info.untied])

    # ---- export --------------------------------------------------------------------------

    def export_proto(self) -> onnx.ModelProto:
        """The original model with trained initializers (NCHW, unpadded), same names, in
        inference form (``training.export``)."""
        return export_model(self.imported.original, self.parameters(), self._untied_names(),
                            self.sharing.split)

    def export(self, path: str | Path) -> Path:
        """Write the trained model to ``path`` (atomically); onnxruntime can run it."""
        atomic_write(path, self.export_proto().SerializeToString())
        return Path(path)

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Parameters, optimizer state, accumulators, step, schedule, RNG counter, the model
        and the configuration, in one .npz written atomically (a ``lora=`` session's: what
        training changed and the base's hash, no model: ``checkpoints``)."""
        self._drain()
        meta = {"format": CHECKPOINT_FORMAT, "config": self.config(), "step": self.step,
                "micro_step": self.micro_step, "rng_counter": self.rng_counter,
                "bad_steps": self.bad_steps, "extra": extra or {}}
        state, arrays = self.state_arrays(), {}
        if self.lora is not None:  # the trained tensors alone: the base gives the rest
            meta["lora"], state = checkpoints.lora_state(self, state)
        else:
            arrays["__model__"] = np.frombuffer(self.imported.original.SerializeToString(),
                                                np.uint8)
        arrays |= {f"state/{k}": v for k, v in state.items()}
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(path, buf.getvalue())
        return Path(path)

    @classmethod
    def from_checkpoint(cls, path: str | Path, plugins=(), base=None,
                        **overrides) -> TrainingSession:
        """Resume exactly: the same weights, state, step and RNG counter as when it was saved.

        A file that cannot be resumed from (truncated, not a checkpoint, another format, an
        entry missing or garbled, pickled objects, arrays that do not fit the model, a model
        referencing external data) is a ``CheckpointError`` naming it and what is wrong; arrays
        of the optimizer's state are checked against the plan before the first step writes
        anything.

        With ``distributed=`` a world of several ranks, rank 0 reads the file and broadcasts
        it (``storage.shared_checkpoint``): the other ranks' machines need no copy of it.
        ``base``: the base model (path or ModelProto) of a LoRA run's checkpoint, which holds
        only the trained tensors (``checkpoints.lora_model``); a full checkpoint ignores it."""
        path = Path(path)
        world = overrides.get("distributed")
        shared = shared_checkpoint(path, world) if world is not None and world.size > 1 \
            else None
        meta, model, state = read_checkpoint(path, shared)
        lora = None
        if "lora" in meta:
            model, lora = checkpoints.lora_model(path, meta["lora"], state, base)
        cfg, loss, optimizer, schedule = checkpoints.session_arguments(path, meta["config"])
        options = set(inspect.signature(cls).parameters) - {
            "model", "loss", "optimizer", "lr_schedule", "plugins", "lora"}  # passed below
        unknown = sorted(set(cfg) - options)
        if unknown:
            raise CheckpointError(f"{path}: its configuration has unknown option(s) {unknown}; "
                                  "the file is damaged or written by another version")
        cfg.update(overrides)
        try:
            session = cls(model, loss=loss, optimizer=optimizer, lr_schedule=schedule,
                          plugins=plugins, lora=lora, **cfg)
        except ModelLoadError as exc:
            raise CheckpointError(f"{path}: its model does not load: {exc}") from None
        except TrOnnxError:
            raise
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot resume with its configuration"
                                  f"{' and the overrides' if overrides else ''}: {exc}") from None
        checkpoints.check_parameters(path, session.imported, state)
        session.step, session.micro_step = meta["step"], meta["micro_step"]
        session.rng_counter, session.bad_steps = meta["rng_counter"], meta["bad_steps"]
        session._pending = dict(state)
        session._checkpoint = (path, state)
        session.checkpoint_extra = meta.get("extra", {})
        return session

    def _check_checkpoint_state(self, plan: CompiledPlan) -> None:
        """The checkpoint's arrays that ``plan`` holds fit it exactly (its optimizer state and
        accumulators are only known once a plan exists); checked before anything is written.
        bfloat16 arrays (half-precision gradients) come back from ``np.load`` as raw 2-byte
        values: they are viewed as the plan's dtype again."""
        if self._checkpoint is None:
            return
        path, arrays = self._checkpoint
        raw = {}
        for name, value in arrays.items():
            t = plan.memory.tensors.get(name)
            if t is None or self._pending.get(name) is not value:
                continue  # not in this plan, or replaced by load_parameters
            is_raw = value.dtype.kind == "V" and value.dtype.itemsize == t.dtype.itemsize
            if value.shape != tuple(t.shape) or not (value.dtype == t.dtype or is_raw):
                raise CheckpointError(
                    f"{path}: array {name!r} is {value.dtype}{list(value.shape)}, but the "
                    f"training plan's {name!r} is {t.dtype}{list(t.shape)}; the file is damaged "
                    "or its arrays were replaced (nothing was changed)")
            if is_raw:
                raw[name] = value.view(t.dtype)
        self._pending.update(raw)
