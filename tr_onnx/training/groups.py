"""Update groups: parameters whose optimizer update differs from the run's -- a learning-rate
multiplier by name pattern (discriminative fine-tuning, ``lr_groups``), or a count of steps of
their own (parameters unfrozen later, ``step_offsets``) -- updated one group at a time over
their run of the flat spans (``train_pass.add_group_updates``), as ``torch.optim`` parameter
groups; and the fine-tuning options' checks (issue 33).
"""

from __future__ import annotations

import fnmatch
import math
import numbers
from typing import TYPE_CHECKING

from .. import ir
from ..errors import OptionError
from ..ir import Value

if TYPE_CHECKING:
    from .options import TrainOptions
    from .train_pass import TrainConfig

def check_frozen_batchnorm(mode: str) -> str:
    if mode not in ("train", "eval"):
        raise OptionError(f"frozen_batchnorm={mode!r}; valid: 'train', 'eval'")
    return mode


def check_unfreeze_after(epochs: int | None) -> int | None:
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 0):
        raise OptionError(f"unfreeze_after={epochs!r}: must be a number of epochs >= 0 or None")
    return epochs


def check_lr_groups(groups: dict | None, backend: str, precision: str) -> dict | None:
    if not groups:
        return None
    if not isinstance(groups, dict) or not all(
            isinstance(k, str) and isinstance(m, numbers.Real) and not isinstance(m, bool)
            and math.isfinite(m) and m >= 0 for k, m in groups.items()):
        raise OptionError(f"lr_groups={groups!r}: must be {{name pattern: multiplier >= 0}}")
    if backend != "numpy" or precision != "fp32":
        # the cuda step guard and half precision wire their inputs into one update node
        raise OptionError(f"lr_groups: the numpy backend in fp32 only (not {backend}, "
                          f"{precision})")
    return {k: float(m) for k, m in groups.items()}


def unfreeze_due(options: TrainOptions, epoch: int) -> bool:
    """Whether epoch ``epoch`` (0-based) comes after the session's ``unfreeze_after`` epochs
    with something still frozen: then everything trains (``TrainingSession.unfreeze``)."""
    after = options.unfreeze_after
    return after is not None and epoch >= after and (
        options.trainable is not None or bool(options.frozen))


def lr_group_of(name: str, lr_groups: dict[str, float]) -> tuple[int, float]:
    """The index of the first pattern of ``lr_groups`` that ``name`` matches and its
    multiplier; (len(lr_groups), 1.0) where none does."""
    for k, (pattern, mult) in enumerate(lr_groups.items()):
        if fnmatch.fnmatchcase(name, pattern):
            return k, float(mult)
    return len(lr_groups), 1.0


def update_group(name: str, cfg: TrainConfig) -> tuple[tuple[int, int], float, int]:
    """The update group of parameter ``name``: its key (learning-rate group, step offset), its
    learning-rate multiplier and its step offset."""
    group, mult = lr_group_of(name, cfg.lr_groups)
    offset = int(cfg.step_offsets.get(name, 0))
    return (group, offset), mult, offset


def update_runs(trainable: list[Value], cfg: TrainConfig) -> list[tuple[float, int, int, int]]:
    """(lr multiplier, step offset, start, stop) of each run of adjacent trainable parameters
    of one update group (``update_group``)."""
    runs: list[tuple[float, int, int, int]] = []
    last = None
    for i, p in enumerate(trainable):
        key, mult, offset = update_group(p.name, cfg)
        if key == last:
            runs[-1] = (*runs[-1][:3], i + 1)
        else:
            runs.append((mult, offset, i, i + 1))
        last = key
    return runs


def unfrozen_offsets(plan, step: int, backend: str, options: TrainOptions) -> dict[str, int]:
    """The step offsets of parameters that ``plan`` (a CompiledPlan) does not train, for a
    re-plan that trains them from optimizer step ``step`` on: one update per offset, on the
    numpy backend in fp32 (elsewhere none: their updates count the run's steps)."""
    if not step or backend != "numpy" or options.precision != "fp32":
        return {}
    before, known = set(plan.info.trainable), options.step_offsets
    return {v.name: step for v in plan.graph.values.values()
            if v.kind == ir.PARAM and v.name not in before and v.name not in known}
