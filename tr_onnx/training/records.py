"""What a ``Trainer`` records: each batch's accuracy counts, the running totals of the epoch in
progress (saved in mid-epoch checkpoints), the metrics file (JSON lines, cut back to the lines
a checkpoint had seen when a run resumes, never left with half a line), and the lines it
prints (the progress status, the epoch summary).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .storage import write_all, write_error


def accuracy_kind(labels: np.ndarray) -> str | None:
    """``"index"`` (class indices), ``"one_hot"`` (rows with a single 1) or None (no accuracy:
    regression targets)."""
    if labels.dtype.kind in "iu":
        return "index"
    if labels.ndim == 2 and np.all((labels == 0) | (labels == 1)) and np.all(labels.sum(1) == 1):
        return "one_hot"
    return None


def count_correct(kind: str | None, x: np.ndarray, y: np.ndarray,
                  ignore_index: int | None = None, class_axis: int = 1) -> tuple[int, int]:
    """(correct, counted) predictions: argmax over the class axis of the output (every token
    of a [N, T, V] output counts)."""
    if kind is None or x.ndim < 2:
        return 0, 0
    pred = x.argmax(axis=class_axis)
    if kind == "one_hot":
        return int((pred == y.argmax(axis=1)).sum()), len(y)
    keep = np.ones(y.shape, bool) if ignore_index is None else y != ignore_index
    return int(((pred == y) & keep).sum()), int(keep.sum())


def finite(v):
    """JSON-safe metric: non-finite floats become None (strict JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@dataclass
class EpochTotals:
    """Running sums of the epoch in progress (saved in mid-epoch checkpoints)."""

    loss_sum: float = 0.0
    samples: int = 0  # samples of applied (finite) batches
    seen: int = 0  # samples of every batch (throughput)
    correct: int = 0
    counted: int = 0
    skipped: int = 0  # batches with a non-finite loss or gradient (not applied)
    train_seconds: float = 0.0
    metric_sums: list = field(default_factory=list)  # per metric (training.metrics), as lists

    def add_metric_sums(self, sums: Sequence[np.ndarray]) -> None:
        if not self.metric_sums:
            self.metric_sums = [[0.0] * len(v) for v in sums]
        self.metric_sums = [np.add(t, v).tolist() for t, v in zip(self.metric_sums, sums)]

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.samples if self.samples else None

    @property
    def acc(self) -> float | None:
        return self.correct / self.counted if self.counted else None

    def samples_per_s(self) -> float | None:
        return self.seen / self.train_seconds if self.train_seconds > 0 else None


class MetricsFile:
    """The metrics file at ``path`` (None: none), open while training (``open``); ``lines``:
    the lines of it that belong to this run (a resumed run's: the checkpoint's count)."""

    def __init__(self, path: Path | None, lines: int = 0):
        self.path, self.lines = path, lines
        self._file = None

    @contextlib.contextmanager
    def open(self):
        """New for a fresh run; for a resumed one, cut (in place: cutting needs no disk space)
        to the lines the checkpoint had seen (a run that stopped after them wrote lines that
        the resume repeats). Failing to open or cut it is a ``WriteError``."""
        if self.path is None:
            yield
            return
        path, keep = self.path, 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.lines and path.exists():
                kept = path.read_bytes().splitlines(keepends=True)[:self.lines]
                self.lines, keep = len(kept), sum(map(len, kept))
            else:
                self.lines = 0
            f = open(path, "r+b" if keep else "wb", buffering=0)  # unbuffered: see write_all
        except OSError as exc:
            raise write_error(path, exc, "opening the metrics file") from None
        with f:
            if keep:
                try:
                    f.truncate(keep)
                    f.seek(keep)
                except OSError as exc:
                    raise write_error(path, exc, "cutting it to the checkpoint's lines") \
                        from None
            self._file = f
            try:
                yield
            finally:
                self._file = None

    def write(self, record: dict) -> None:
        """Append one JSON line (while open). Failing (disk full) is a ``WriteError``; the file
        is cut back to the lines written before it (never half a line)."""
        if self._file is None:
            return
        f = self._file
        start = f.tell()
        try:
            write_all(f.fileno(), (json.dumps(record) + "\n").encode())
        except OSError as exc:
            with contextlib.suppress(OSError):
                f.truncate(start)
                f.seek(start)
            raise write_error(self.path, exc, f"metrics line {self.lines + 1}") from None
        self.lines += 1


def printed_metrics(record: dict, prefix: str, metric_keys: Sequence[str],
                    with_acc: bool) -> str:
    """`` acc 0.9123 f1 0.9001``: the accuracy where the labels are classes (``with_acc``),
    then each metric (per-class lists are left to the metrics file)."""
    def fmt(v):
        return "-" if v is None else format(v, ".4f")
    text = f" acc {fmt(record[prefix + 'acc'])}" if with_acc else ""
    for key in metric_keys:
        if not key.endswith("_per_class"):
            text += f" {key} {fmt(record[prefix + key])}"
    return text


def status_text(totals: EpochTotals, ranks: int) -> str:
    """The progress line's status: the epoch's running loss, accuracy and throughput."""
    parts = []
    if totals.loss is not None:
        parts.append(f"loss {totals.loss:.4f}")
    if totals.acc is not None:
        parts.append(f"acc {totals.acc:.3f}")
    if totals.samples_per_s() is not None:
        parts.append(f"{totals.samples_per_s():.0f} samples/s")
    if ranks > 1:
        parts.append(f"{ranks} ranks")
    return "  ".join(parts)


def summary(r: dict, epochs: int, metric_keys: Sequence[str], with_acc: bool, with_val: bool,
            ranks: int) -> str:
    """The line an epoch's record ``r`` is logged as."""
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    text = (f"epoch {r['epoch']}/{epochs}: train loss {fmt(r['train_loss'], '.4f')}"
            f"{printed_metrics(r, 'train_', metric_keys, with_acc)}")
    if with_val:
        val_loss = "not finite" if r["val_loss"] is None else format(r["val_loss"], ".4f")
        text += (f", val loss {val_loss}"
                 f"{printed_metrics(r, 'val_', metric_keys, with_acc)}")
    on_ranks = f" on {ranks} ranks" if ranks > 1 else ""
    text += (f", {fmt(r['samples_per_s'], '.0f')} samples/s{on_ranks}, {r['seconds']:.2f} s, "
             f"step {r['step']}")
    if r["skipped_batches"]:
        text += f", {r['skipped_batches']} non-finite batches skipped"
    return text
