"""Metrics beyond the loss and accuracy: top-k accuracy, per-class and macro F1, perplexity,
mIoU, MSE and MAE, each accumulated exactly over an epoch.

A metric is a pure pair: ``sums(x, y)`` turns one batch (the model output ``x``, the labels
``y``) into a float64 vector of sums and counts, and ``value(sums)`` turns the vector summed
over every batch (and every rank) into the metric. Sums add, averages of batch averages do not:
an epoch's F1 is that of its whole confusion matrix, its perplexity the exponential of its
summed token loss over its token count. The vectors travel in one message per batch across
ranks, and into mid-epoch checkpoints, as plain lists.

Which metrics a run gets by default follows the loss and the output's shape
(``default_metrics``): class scores [N, C] get top-5 accuracy (C > 5) and macro F1, token
logits [N, T, V] perplexity, segmentation scores [N, C, H, W] mIoU, the regression losses (mse,
l1, smooth_l1) MSE and MAE; bce_with_logits and a loss model with float labels none.
Accuracy itself stays the Trainer's (``train_acc``/``val_acc``), for every class-label run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError


def _keep(y: np.ndarray, ignore_index: int | None) -> np.ndarray:
    return np.ones(y.shape, bool) if ignore_index is None else y != ignore_index


@dataclass(frozen=True)
class TopK:
    """The fraction of labels among the ``k`` highest scores (``sklearn.metrics.
    top_k_accuracy_score``; a label tied with the k-th score counts as a hit, where sklearn
    breaks the tie by class index); labels equal to ``ignore_index`` do not count."""

    k: int = 5
    class_axis: int = 1
    ignore_index: int | None = None

    @property
    def name(self) -> str:
        return f"top{self.k}"

    def size(self, shape: Sequence[int]) -> int:
        return 2

    def sums(self, x: np.ndarray, y: np.ndarray, loss: float | None = None) -> np.ndarray:
        scores = np.moveaxis(x, self.class_axis, -1)
        keep = _keep(y, self.ignore_index)
        label_score = np.take_along_axis(scores, np.where(keep, y, 0)[..., None], axis=-1)
        # among the k best: fewer than k classes score higher (a tie counts as a hit)
        hit = ((scores > label_score).sum(axis=-1) < self.k) & keep
        return np.array([hit.sum(), keep.sum()], np.float64)

    def value(self, sums: np.ndarray) -> float | None:
        return float(sums[0] / sums[1]) if sums[1] else None


@dataclass(frozen=True)
class Confusion:
    """Metrics of the confusion matrix of argmax predictions over ``classes`` classes (rows:
    labels, columns: predictions; ``ignore_index`` labels left out). ``kind``: ``"f1"`` (macro
    F1, plus per-class F1 in ``per_class``) or ``"miou"`` (mean intersection over union).
    Classes that neither occur nor are predicted have no F1 or IoU and are left out of the
    mean, as scikit-learn leaves out labels absent from both ``y_true`` and ``y_pred``."""

    kind: str = "f1"
    class_axis: int = 1
    ignore_index: int | None = None

    @property
    def name(self) -> str:
        return self.kind

    def size(self, shape: Sequence[int]) -> int:
        return int(shape[self.class_axis]) ** 2

    def sums(self, x: np.ndarray, y: np.ndarray, loss: float | None = None) -> np.ndarray:
        c = x.shape[self.class_axis]
        pred = x.argmax(axis=self.class_axis)
        keep = _keep(y, self.ignore_index)
        return np.bincount(y[keep].astype(np.int64) * c + pred[keep],
                           minlength=c * c).astype(np.float64)

    def per_class(self, sums: np.ndarray) -> list[float | None]:
        c = math.isqrt(len(sums))
        m = np.asarray(sums).reshape(c, c)
        tp = np.diag(m)
        fp, fn = m.sum(0) - tp, m.sum(1) - tp
        if self.kind == "f1":
            num, den = 2 * tp, 2 * tp + fp + fn
        else:
            num, den = tp, tp + fp + fn
        return [float(n / d) if d else None for n, d in zip(num, den)]

    def value(self, sums: np.ndarray) -> float | None:
        scores = [s for s in self.per_class(sums) if s is not None]
        return float(np.mean(scores)) if scores else None


@dataclass(frozen=True)
class Perplexity:
    """``exp`` of the mean negative log-likelihood per token over the epoch (the unweighted,
    unsmoothed cross-entropy of every label not equal to ``ignore_index``). ``loss_is_nll``:
    the batch loss given to ``sums`` is that mean over the batch's tokens (a plain
    cross_entropy), so its sum is the loss times the tokens, without a log-softmax over the
    vocabulary on the host."""

    class_axis: int = -1
    ignore_index: int | None = None
    loss_is_nll: bool = False
    name: str = "perplexity"

    def size(self, shape: Sequence[int]) -> int:
        return 2

    def sums(self, x: np.ndarray, y: np.ndarray, loss: float | None = None) -> np.ndarray:
        keep = _keep(y, self.ignore_index)
        if not keep.any():  # every label ignored: nothing to add (the loss is 0/0)
            return np.zeros(2)
        if self.loss_is_nll and loss is not None:
            return np.array([loss * keep.sum(), keep.sum()], np.float64)
        z = np.moveaxis(x.astype(np.float64), self.class_axis, -1)
        z = z - z.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(z).sum(axis=-1))
        picked = np.take_along_axis(z, np.where(keep, y, 0)[..., None], axis=-1)[..., 0]
        return np.array([((log_norm - picked) * keep).sum(), keep.sum()], np.float64)

    def value(self, sums: np.ndarray) -> float | None:
        if not sums[1]:
            return None
        mean = sums[0] / sums[1]
        return float(math.exp(mean)) if mean < 700 else math.inf  # exp overflows past ~709


@dataclass(frozen=True)
class Regression:
    """``"mse"`` (mean squared error) or ``"mae"`` (mean absolute error) over every element of
    the output against targets of its shape."""

    name: str = "mse"

    def size(self, shape: Sequence[int]) -> int:
        return 2

    def sums(self, x: np.ndarray, y: np.ndarray, loss: float | None = None) -> np.ndarray:
        d = x.astype(np.float64) - y.astype(np.float64)
        err = d * d if self.name == "mse" else np.abs(d)
        return np.array([err.sum(), d.size], np.float64)

    def value(self, sums: np.ndarray) -> float | None:
        return float(sums[0] / sums[1]) if sums[1] else None


METRIC_NAMES = ("top5", "f1", "miou", "perplexity", "mse", "mae")  # and top<k> for any k


def make_metric(name: str, *, class_axis: int, ignore_index: int | None,
                loss_is_nll: bool = False):
    """The metric called ``name``: one of ``METRIC_NAMES`` or ``top<k>``; ``loss_is_nll``:
    the loss is the mean token NLL (``Perplexity``)."""
    if name.startswith("top") and name[3:].isdigit() and int(name[3:]) >= 1:
        return TopK(int(name[3:]), class_axis, ignore_index)
    if name in ("f1", "miou"):
        return Confusion(name, class_axis, ignore_index)
    if name == "perplexity":
        return Perplexity(class_axis, ignore_index, loss_is_nll)
    if name in ("mse", "mae"):
        return Regression(name)
    raise InputError(f"unknown metric {name!r}; known: {', '.join(METRIC_NAMES)} (top<k> for "
                     "any k)")


def default_metrics(task: str, output_rank: int, class_axis: int,
                    classes: int | None) -> list[str]:
    """The metrics of a run by its ``task`` (``"classes"``: the loss takes class indices;
    ``"regression"``: a builtin regression loss, mse/l1/smooth_l1; anything else gets none),
    the model output's rank, the loss's class axis, and the number of classes where known."""
    if task == "regression":
        return ["mse", "mae"]
    if task != "classes":
        return []
    axis = class_axis % output_rank if output_rank else 0
    if output_rank == 2:
        return (["top5"] if classes is None or classes > 5 else []) + ["f1"]
    if output_rank == 3 and axis == 2:
        return ["perplexity"]
    if output_rank == 4 and axis == 1:
        return ["miou"]
    return []


def make_metrics(names: Sequence[str], *, class_axis: int, ignore_index: int | None,
                 loss_is_nll: bool = False) -> list:
    """The metrics called ``names`` (``make_metric``), each once."""
    if isinstance(names, str):
        names = [names]
    seen: dict[str, object] = {}
    for name in names:
        seen.setdefault(name, make_metric(name, class_axis=class_axis,
                                          ignore_index=ignore_index, loss_is_nll=loss_is_nll))
    return list(seen.values())


def metric_values(metrics: Sequence, sums: Sequence[Sequence[float]] | None,
                  prefix: str) -> dict:
    """``{prefix + name: value}`` of each metric (None without sums); F1 adds its per-class
    scores as ``prefix + "f1_per_class"``."""
    out: dict = {}
    for i, m in enumerate(metrics):
        s = np.asarray(sums[i], np.float64) if sums and len(sums[i]) else None
        out[f"{prefix}{m.name}"] = m.value(s) if s is not None else None
        if isinstance(m, Confusion) and m.kind == "f1":
            out[f"{prefix}f1_per_class"] = m.per_class(s) if s is not None else None
    return out
