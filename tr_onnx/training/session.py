"""``TrainingSession``: train an ONNX model, evaluate it, export it, checkpoint it.

The facade over three parts: ``options`` (the checked choices, ``TrainOptions``), ``state``
(what training changes and which plan's arena holds it, ``TrainingState``) and ``steps``
(launching steps and reading them back, ``StepLauncher``); ``checkpoints`` saves and resumes.
The session itself picks the plan for each batch shape (training and evaluation caches) and
feeds it.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import onnx

from .. import ir
from ..backends import Backend
from ..compiler import (
    DEFAULT_MAX_PLAN_BYTES,
    DEFAULT_MAX_PLANS,
    CompiledPlan,
    PlanCache,
    compile_plan,
    plan_key,
)
from ..distributed import World, register
from ..errors import ExportAdviceWarning, TrOnnxError
from ..export_advice import export_advice
from ..feeds import (
    check_batch_rows,
    check_class_indices,
    check_feed,
    check_labels,
    check_output_names,
)
from ..importer import DEFAULT_FOLD_LIMIT_BYTES, ImportedModel, import_model
from ..optim import AdamW, Optimizer, Schedule, make_optimizer, make_schedule
from ..passes.autodiff import GradBuilder
from ..passes.control_flow import output_value
from ..registry import build_registry, default_registry
from . import checkpoints, groups
from .export import export_model
from .losses import ClassLabels, LossSpec, check_loss_model, class_labels, make_loss_spec
from .options import TrainOptions
from .parameters import ParamRole, parameter_roles, parameter_sharing, share_parameters
from .pipeline import build_training_step
from .state import TrainingState
from .steps import StepLauncher, rank_rows
from .storage import atomic_write
from .train_pass import add_labels, add_loss, to_inference_mode


class _Of:
    """An attribute of the session that is one of its part's (``options`` or ``_state``):
    read there, and written there where ``writable``."""

    def __init__(self, part: str, writable: bool = False):
        self.part, self.writable = part, writable

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, session, owner=None):
        if session is None:
            return self
        return getattr(getattr(session, self.part), self.name)

    def __set__(self, session, value) -> None:
        if not self.writable:
            raise AttributeError(f"{self.name} is one of the session's options (read only)")
        setattr(getattr(session, self.part), self.name, value)


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

    # the counters and the world are the training state's; the settings the options'
    step = _Of("_state", writable=True)  # optimizer steps taken
    micro_step = _Of("_state", writable=True)  # micro-batches accumulated towards the next
    rng_counter = _Of("_state", writable=True)  # micro-batches seen (dropout masks)
    bad_steps = _Of("_state", writable=True)  # non-finite steps in a row
    last_grad_norm = _Of("_state")
    world = _Of("_state", writable=True)  # more than one rank, or None
    backend, channel_align, target = _Of("options"), _Of("options"), _Of("options")
    cuda_graphs, label_name, output_name = _Of("options"), _Of("options"), _Of("options")
    fold_limit_bytes, max_arena_bytes = _Of("options"), _Of("options")

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
        options = TrainOptions.from_kwargs(
            backend=backend, label_name=label_name, output_name=output_name,
            trainable=trainable, frozen=frozen, grad_accumulation=grad_accumulation,
            clip_grad_norm=clip_grad_norm, bn_running_var=bn_running_var,
            tie_shared_initializers=tie_shared_initializers, seed=seed,
            channel_align=channel_align, max_bad_steps=max_bad_steps,
            precision=precision, loss_scale=loss_scale, cuda_graphs=cuda_graphs,
            external_data_dir=external_data_dir, fold_limit_bytes=fold_limit_bytes,
            max_arena_bytes=max_arena_bytes, max_plans=max_plans, max_plan_bytes=max_plan_bytes,
            sync_batchnorm=sync_batchnorm, grad_bucket_mb=grad_bucket_mb,
            frozen_batchnorm=frozen_batchnorm, unfreeze_after=unfreeze_after,
            lr_groups=lr_groups, step_offsets=step_offsets)
        self.registry = build_registry(plugins) if plugins else default_registry()
        # training steps (the active one holds the state), evaluation
        self._plans = PlanCache(max_plans, max_plan_bytes)
        self._eval_plans = PlanCache(max_plans, max_plan_bytes)
        self.imported: ImportedModel = import_model(model, self.registry, options.backend,
                                                    external_data_dir=external_data_dir,
                                                    fold_limit_bytes=fold_limit_bytes)
        self.optimizer = make_optimizer(optimizer if optimizer is not None else AdamW(), lr)
        self.schedule = make_schedule(lr_schedule)
        self.loss = self._loss(loss, options)
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
        if trainable is None and lora is not None:
            options = replace(options, trainable=lora.trainable)
        self.options = options.for_model(self.imported, initializers)
        # a world of one trains as no world at all: the plan gets no collective nodes
        world = distributed if distributed is not None and distributed.size > 1 else None
        self._state = TrainingState(self.imported, self.sharing, world,
                                    register(world) if world is not None else None)
        self._steps = StepLauncher(self._state, options.grad_accumulation,
                                   options.max_bad_steps, self._lr_of_step,
                                   self.options.output_name)
        # plan id -> (the plan, its class-index labels)
        self._class_labels: dict[int, tuple[weakref.ref, list[ClassLabels]]] = {}
        self._eval_synced: dict[int, int] = {}  # eval plan id -> state version its weights hold
        self.checkpoint_extra: dict = {}  # from_checkpoint: what the saver stored with it

    # ---- configuration -----------------------------------------------------------------

    def _loss(self, loss, options: TrainOptions):
        if isinstance(loss, (onnx.ModelProto, bytes)) or (
                isinstance(loss, (str, Path)) and str(loss).endswith(".onnx")):
            loss_model = import_model(loss, self.registry, options.backend,
                                      external_data_dir=options.external_data_dir,
                                      fold_limit_bytes=options.fold_limit_bytes)
            check_loss_model(loss_model)
            return loss_model
        return make_loss_spec(loss)

    def config(self) -> dict:
        loss = self.loss.config() if isinstance(self.loss, LossSpec) else {
            "onnx": self.loss.original.SerializeToString().hex()}
        return {"loss": loss, "optimizer": self.optimizer.config(),
                "lr_schedule": self.schedule.config(), **self.options.recorded()}

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
        if plan is not self._state.active:
            self._steps.drain()
            self._state.activate(plan)
        self._plans.evict()  # after the state moved: the active plan is the most recent
        return plan

    def _compile(self, shapes: dict[str, tuple], const_feeds: dict[str, np.ndarray]
                 ) -> CompiledPlan:
        o = self.options
        default_trainable = frozenset(n for n, r in self.parameter_roles.items() if r.trainable)
        cfg = o.train_config(self.loss, self.optimizer, default_trainable, self.sharing,
                             tuple(i.name for i in self.imported.inputs), self._state.world_id)
        return compile_plan(self.imported, shapes, const_feeds, o.target, o.channel_align,
                            transform=partial(build_training_step, registry=self.registry,
                                              backend=o.backend, cfg=cfg),
                            absorb_flatten=False,
                            cuda_graphs=o.cuda_graphs, max_arena_bytes=o.max_arena_bytes)

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
        self._steps.drain()
        offsets = self.options.step_offsets
        if self._state.active is not None:
            offsets = offsets | groups.unfrozen_offsets(
                self._state.active, self.step, self.backend, self.options)
        self._state.deactivate()
        self._plans.clear()
        self._plans.sizes.clear()
        self.options = replace(self.options, step_offsets=offsets,
                               trainable=tuple(trainable) if trainable is not None else None,
                               frozen=tuple(frozen))

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale the next step uses (None without loss scaling)."""
        loss_scale = self.options.loss_scale
        if loss_scale and self._state.active is not None:
            self._steps.drain()
        return self._state.loss_scale(loss_scale)

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
        the result is the same as waiting (``training.steps``). The warnings and
        ``TrainingDiverged`` of step k come from the call that launches step k+1 (whose batch
        then is not trained); reading state (parameters, checkpoints, ``run``,
        ``last_outputs``) first waits for every pending step. Elsewhere (numpy, accumulation)
        ``wait=False`` runs the step as ``wait=True``.

        A feed or labels the model does not take is an ``InputError`` naming the input
        (``tr_onnx.feeds``), raised before the step runs: nothing changes. So is a class-index
        label out of range (``check_class_labels``) and a batch of 0 samples
        (``check_batch_rows``).
        """
        feed = check_feed(feed, self.imported.inputs)
        if self.world is None:  # a rank of a data-parallel step may have no rows of its own
            check_batch_rows(feed, self.imported.const_feeds)
        plan = self._train_plan(feed)
        if self._state.broadcast_due:
            self._steps.drain()
            self._state.broadcast(plan)
        label_name = self.options.label_name
        want = plan.graph.values[label_name]
        labels = check_labels(labels, label_name, want.shape, want.dtype)
        self._check_class_labels(plan, labels, f"labels {label_name!r}")
        executor = plan.executor
        for name, x in feed.items():
            if name not in self.imported.const_feeds:  # a plan-time constant of this plan
                executor.write_input(name, x)
        executor.write_input(label_name, labels)
        rows = rank_rows(self.world, feed, self.imported.const_feeds)
        return self._steps.submit(plan, rows, wait, self.last_outputs)

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
            cached = self._class_labels[id(plan)] = (
                weakref.ref(plan), class_labels(plan.graph, self.options.label_name))
        for entry in cached[1]:
            scores = (f"model output {self.output_name!r} (class axis {self.loss.class_axis})"
                      if isinstance(self.loss, LossSpec) else
                      f"the loss model's {entry.node}")
            check_class_indices(labels, what, entry.classes, entry.ignore_index, scores)

    def last_outputs(self) -> dict[str, np.ndarray]:
        """The model outputs of the last ``train_step`` (training mode), as host arrays."""
        self._steps.drain()
        plan = self._state.active
        if plan is None:
            raise TrOnnxError("no training step has run yet")
        return plan.executor.read_state(plan.info.outputs)

    # ---- parameters ----------------------------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Current parameters, running statistics, optimizer state and gradient accumulators
        (logical NCHW host copies), by name."""
        self._steps.drain()
        return self._state.arrays()

    def parameters(self) -> dict[str, np.ndarray]:
        """Current values of every parameter and running statistic (what export writes),
        untied Identity copies and tied copies included, by name."""
        self._steps.drain()
        return self._state.parameters()

    def load_parameters(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite parameters (and any other state) by name. Data parallel: call it on every
        rank; rank 0's values reach all of them before the next step."""
        self._steps.drain()
        self._state.load(values)

    # ---- evaluation ----------------------------------------------------------------------

    def run(self, output_names: list[str] | None, feed: dict[str, np.ndarray]) -> list:
        """Eval mode (running statistics, no dropout) with the current weights. Bad output
        names or feeds are an ``InputError`` (``tr_onnx.feeds``) before anything runs."""
        names = check_output_names(output_names, self.imported.outputs)
        feed = check_feed(feed, self.imported.inputs)
        self._steps.drain()
        plan = self._eval_plan(feed)
        self._write_feed(plan, feed)
        plan.executor.run()
        types = {vi.name: vi.type for vi in self.imported.proto.graph.output}
        listed = [v.name for v in plan.graph.outputs]
        return [output_value(plan.executor.read_output, n, types[n], listed) for n in names]

    def run_loss(self, feed: dict[str, np.ndarray], labels) -> tuple[np.ndarray, float]:
        """Eval mode, as ``run``: the model output the loss reads, and the loss of ``labels``
        computed by the loss the training plans compile (forward and loss, no backward).
        Feeds and labels are checked as ``train_step`` checks them."""
        feed = check_feed(feed, self.imported.inputs)
        self._steps.drain()
        plan = self._eval_plan(feed, with_loss=True)
        label_name = self.options.label_name
        want = plan.graph.values[label_name]
        labels = check_labels(labels, label_name, want.shape, want.dtype)
        self._check_class_labels(plan, labels, f"labels {label_name!r}")
        self._write_feed(plan, feed)
        plan.executor.write_input(label_name, labels)
        plan.executor.run()
        return (plan.executor.read_output(self.output_name),
                float(np.asarray(plan.executor.read_output(plan.graph.outputs[-1].name))))

    def _write_feed(self, plan: CompiledPlan, feed: dict[str, np.ndarray]) -> None:
        for name, x in feed.items():
            if name not in self.imported.const_feeds:  # a plan-time constant of this plan
                plan.executor.write_input(name, x)

    def _eval_plan(self, feed: dict[str, np.ndarray], with_loss: bool = False) -> CompiledPlan:
        """The evaluation plan of ``feed``'s shapes (``with_loss``: with the labels and the
        loss appended, the loss its last output), holding the current weights."""
        o = self.options
        key, shapes, const_feeds = plan_key(feed, self.imported.const_feeds)
        key = (key, with_loss)
        plan = self._eval_plans.lookup(key)
        if plan is None:
            def eval_graph(graph: ir.Graph) -> None:
                model_outputs = list(graph.outputs)
                share_parameters(graph, self.sharing, self.registry, o.backend)
                to_inference_mode(graph)
                if not with_loss:
                    return
                cfg = o.train_config(self.loss, self.optimizer, frozenset(), self.sharing,
                                     tuple(i.name for i in self.imported.inputs), None)
                output, labels = add_labels(graph, cfg, model_outputs)
                loss = add_loss(GradBuilder(graph, self.registry, o.backend, prefix="loss"),
                                cfg, output, labels)
                graph.outputs = [output, loss]

            plan = compile_plan(self.imported, shapes, const_feeds, o.target, o.channel_align,
                                transform=eval_graph,
                                cuda_graphs=o.cuda_graphs, max_arena_bytes=o.max_arena_bytes)
            self._eval_plans[key] = plan
            for dropped in self._eval_plans.evict():  # (a later plan may reuse its id)
                self._eval_synced.pop(id(dropped), None)
        if self._eval_synced.get(id(plan)) != self._state.version:  # weights changed since
            self._sync_eval_weights(plan)
            self._eval_synced[id(plan)] = self._state.version
        return plan

    def _sync_eval_weights(self, plan: CompiledPlan) -> None:
        """Copy parameters and running statistics into an eval plan's arena (view to view on
        numpy)."""
        active = self._state.active
        if active is None:
            plan.executor.write_state(self._state.parameters())
            return
        info = active.info
        plan.executor.copy_state_from(active.executor,
                                      [*info.trainable, *info.running_stats, *info.untied])

    # ---- export --------------------------------------------------------------------------

    def export_proto(self) -> onnx.ModelProto:
        """The original model with trained initializers (NCHW, unpadded), same names, in
        inference form (``training.export``)."""
        return export_model(self.imported.original, self.parameters(),
                            self._state.untied_names(), self.sharing.split,
                            registry=self.registry)  # a plugins= op's export rule

    def export(self, path: str | Path) -> Path:
        """Write the trained model to ``path`` (atomically); onnxruntime can run it."""
        atomic_write(path, self.export_proto().SerializeToString())
        return Path(path)

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Parameters, optimizer state, accumulators, step, schedule, RNG counter, the model
        and the configuration, in one .npz written atomically (a ``lora=`` session's: what
        training changed and the base's hash, no model: ``checkpoints``)."""
        self._steps.drain()
        return checkpoints.save(self, path, extra)

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
        return checkpoints.resume(cls, path, plugins, base, overrides)
