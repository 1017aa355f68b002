"""What to train while fine-tuning: the new head only (``train_only="head"``) or names matching
patterns, frozen BatchNorms in inference mode, and everything after N epochs (issue 33).

It turns those choices into ``TrainingSession`` keyword arguments (``trainable``,
``frozen_batchnorm``, ``unfreeze_after``); the session and its train pass do the freezing.
"""

from __future__ import annotations

from ..errors import TrOnnxError
from .head import HeadChoice


def train_only_names(train_only, head: HeadChoice | None = None) -> list[str]:
    """``"head"``: the initializers of ``head`` (``replace_head``'s choice); otherwise a
    pattern or a list of names / fnmatch patterns, as ``TrainingSession(trainable=)``."""
    if train_only == "head":
        if head is None:
            raise TrOnnxError("train_only='head' needs the head replace_head chose (num_classes)")
        return [n for n in (head.weight, head.bias) if n is not None]
    return [train_only] if isinstance(train_only, str) else list(train_only)


def finetune_options(train_only=None, head: HeadChoice | None = None,
                     unfreeze_after: int | None = None) -> dict:
    """``TrainingSession`` keyword arguments for fine-tuning: train ``train_only`` (None: the
    default trainable set), BatchNorms whose parameters are all frozen in inference mode, and
    after ``unfreeze_after`` epochs everything (``TrainingSession.unfreeze``)."""
    if unfreeze_after is not None and train_only is None:
        raise TrOnnxError("unfreeze_after needs train_only: nothing is frozen to unfreeze")
    kwargs: dict = {"frozen_batchnorm": "eval", "unfreeze_after": unfreeze_after}
    if train_only is not None:
        kwargs["trainable"] = train_only_names(train_only, head)
    return kwargs
