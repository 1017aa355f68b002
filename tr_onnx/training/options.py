"""``TrainOptions``: a ``TrainingSession``'s choices, checked once when the session is made.

``TrainOptions.from_kwargs`` takes ``TrainingSession``'s keyword options and checks each (the
messages name the option and what it accepts); ``for_model`` then checks the ones that name
parts of the imported model (the output, ``trainable=``/``frozen=`` patterns). The session
keeps the result and every later step reads it: the compile step, the step launcher, the
checkpoint's configuration (``recorded``, the options a checkpoint stores and ``from_checkpoint``
passes back, in the order checkpoints have always stored them).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..backends import Backend, backend_for, check_cuda_graphs
from ..compiler import DEFAULT_MAX_PLAN_BYTES, DEFAULT_MAX_PLANS
from ..errors import InputError, OptionError
from ..importer import DEFAULT_FOLD_LIMIT_BYTES, ImportedModel, check_byte_limit
from . import groups
from .parameters import ParamSharing, name_patterns
from .precision import check_loss_scale, check_precision
from .train_pass import TrainConfig

# What a checkpoint's configuration holds besides the loss, optimizer and schedule, in the order
# it has always been written (the JSON of old and new checkpoints is the same bytes)
RECORDED = ("label_name", "output_name", "backend", "channel_align", "trainable", "frozen",
            "grad_accumulation", "clip_grad_norm", "bn_running_var", "tie_shared_initializers",
            "seed", "max_bad_steps", "precision", "loss_scale", "fold_limit_bytes",
            "sync_batchnorm", "grad_bucket_mb", "frozen_batchnorm", "unfreeze_after",
            "lr_groups", "step_offsets")


@dataclass(frozen=True)
class TrainOptions:
    """The checked options (``TrainingSession``'s docstring says what each does). ``backend``
    is resolved (never ``"auto"``), ``channel_align`` and ``loss_scale`` hold their defaults
    filled in, ``trainable``/``frozen`` the patterns checked against the model's initializers
    (``trainable`` None: the model's parameters), ``output_name`` the model output the loss
    reads (None until ``for_model``)."""

    backend: str
    channel_align: int
    label_name: str = "labels"
    output_name: str | None = None
    trainable: tuple[str, ...] | None = None
    frozen: tuple[str, ...] = ()
    grad_accumulation: int = 1
    clip_grad_norm: float | None = None
    bn_running_var: str = "biased"
    tie_shared_initializers: bool | None = None
    seed: int = 0
    max_bad_steps: int = 5
    precision: str = "fp32"
    loss_scale: dict | None = None  # dynamic loss scaling (``precision.check_loss_scale``)
    fold_limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES
    sync_batchnorm: bool = False
    grad_bucket_mb: float = 25.0
    frozen_batchnorm: str = "train"
    unfreeze_after: int | None = None
    lr_groups: dict[str, float] | None = None
    # parameter -> optimizer steps taken before it became trainable (``TrainingSession.
    # unfreeze``)
    step_offsets: dict[str, int] = field(default_factory=dict)
    # not recorded in checkpoints: where and how this process runs, not what it trains
    target: Backend | None = None  # the Backend plans are compiled for (``backend`` its name)
    cuda_graphs: str = "fallback"
    external_data_dir: str | Path | None = None
    max_arena_bytes: int | None = None
    max_plans: int = DEFAULT_MAX_PLANS
    max_plan_bytes: int | None = DEFAULT_MAX_PLAN_BYTES

    @classmethod
    def from_kwargs(cls, *, backend: str | Backend, label_name: str, output_name: str | None,
                    trainable, frozen, grad_accumulation: int, clip_grad_norm: float | None,
                    bn_running_var: str, tie_shared_initializers: bool | None, seed: int,
                    channel_align: int | None, max_bad_steps: int, precision: str, loss_scale,
                    cuda_graphs: str, external_data_dir: str | Path | None,
                    fold_limit_bytes: int | None, max_arena_bytes: int | None, max_plans: int,
                    max_plan_bytes: int | None, sync_batchnorm: bool, grad_bucket_mb: float,
                    frozen_batchnorm: str, unfreeze_after: int | None,
                    lr_groups: dict | None, step_offsets: dict | None) -> TrainOptions:
        """The options checked (``TrainingSession``'s keywords, whose defaults are the only
        ones: every option is passed); ``trainable``/``frozen`` as given until
        ``for_model`` checks them against the model."""
        target = backend_for(backend)
        backend = target.name
        precision = check_precision(precision, backend)
        _check_session_options(grad_accumulation, bn_running_var, tie_shared_initializers,
                               clip_grad_norm, max_bad_steps, grad_bucket_mb)
        return cls(
            backend=backend, channel_align=channel_align or target.channel_align,
            label_name=label_name, output_name=output_name,
            trainable=trainable, frozen=frozen, grad_accumulation=int(grad_accumulation),
            clip_grad_norm=clip_grad_norm, bn_running_var=bn_running_var,
            tie_shared_initializers=tie_shared_initializers, seed=int(seed),
            max_bad_steps=int(max_bad_steps), precision=precision,
            loss_scale=check_loss_scale(loss_scale, precision),
            fold_limit_bytes=fold_limit_bytes, sync_batchnorm=bool(sync_batchnorm),
            grad_bucket_mb=grad_bucket_mb,
            frozen_batchnorm=groups.check_frozen_batchnorm(frozen_batchnorm),
            unfreeze_after=groups.check_unfreeze_after(unfreeze_after),
            lr_groups=groups.check_lr_groups(lr_groups, backend, precision),
            step_offsets={str(k): int(v) for k, v in (step_offsets or {}).items()},
            target=target, cuda_graphs=check_cuda_graphs(cuda_graphs),
            external_data_dir=external_data_dir,
            max_arena_bytes=check_byte_limit("max_arena_bytes", max_arena_bytes),
            max_plans=max_plans, max_plan_bytes=max_plan_bytes)

    def for_model(self, imported: ImportedModel, initializers: set[str]) -> TrainOptions:
        """These options with the model's names checked: the output the loss reads (default
        the first) and the ``trainable``/``frozen`` patterns (each must match one of
        ``initializers``)."""
        outputs = [o.name for o in imported.outputs]
        if not outputs:
            raise InputError("the model has no outputs: training needs one for the loss to read")
        output_name = self.output_name or outputs[0]
        if output_name not in outputs:
            raise InputError(f"output_name {output_name!r}; the model's outputs are {outputs}")
        return replace(self, output_name=output_name,
                       trainable=(tuple(name_patterns("trainable", self.trainable, initializers))
                                  if self.trainable is not None else None),
                       frozen=tuple(name_patterns("frozen", self.frozen, initializers)))

    def train_config(self, loss, optimizer, default_trainable: frozenset[str],
                     sharing: ParamSharing, data_inputs: tuple[str, ...],
                     world: int | None) -> TrainConfig:
        """What the training pipeline reads (``TrainConfig``): these options with the session's
        loss, optimizer, the model's parameters (``default_trainable``), how they are shared,
        its data inputs and the registered world's id."""
        return TrainConfig(
            loss, optimizer, self.output_name, self.label_name,
            trainable=list(self.trainable) if self.trainable is not None else None,
            frozen=list(self.frozen), default_trainable=default_trainable,
            clip_grad_norm=self.clip_grad_norm,
            bn_unbiased_running_var=self.bn_running_var == "unbiased",
            sharing=sharing, seed=self.seed, precision=self.precision,
            loss_scale=self.loss_scale, step_guard=self.target.decides_steps,
            data_inputs=data_inputs, world=world, sync_batchnorm=self.sync_batchnorm,
            grad_bucket_bytes=max(1, int(self.grad_bucket_mb * (1 << 20))),
            grad_accumulation=self.grad_accumulation,
            frozen_batchnorm_eval=self.frozen_batchnorm == "eval",
            lr_groups=self.lr_groups or {}, step_offsets=dict(self.step_offsets))

    def recorded(self) -> dict:
        """The options a checkpoint stores, as ``TrainingSession`` keyword arguments that
        JSON holds (patterns as lists)."""
        record = {name: getattr(self, name) for name in RECORDED}
        for name in ("trainable", "frozen"):
            if record[name] is not None:
                record[name] = list(record[name])
        record["step_offsets"] = dict(self.step_offsets)
        return record


def _check_session_options(grad_accumulation, bn_running_var, tie_shared_initializers,
                           clip_grad_norm, max_bad_steps, grad_bucket_mb) -> None:
    if grad_accumulation < 1:
        raise ValueError(f"grad_accumulation must be >= 1, got {grad_accumulation}")
    if bn_running_var not in ("biased", "unbiased"):
        raise ValueError(f"bn_running_var {bn_running_var!r}; valid: biased, unbiased")
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
