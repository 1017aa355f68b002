"""``tr_onnx.fit`` and ``tr_onnx.evaluate``: the Python API in one call each, over a
``TrainingSession`` and a ``Trainer``; and the callbacks that watch a metric,
``EarlyStopping`` and ``KeepBest``.

``fit`` keeps the best epoch's weights when asked (``keep_best``, or early stopping): they are
restored into the session when training ends, so ``result.export(path)`` writes them, and with
``checkpoint_dir`` they are also written to ``best.ckpt.npz`` (atomically) whenever an epoch
improves on the best so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError, OptionError
from .session import TrainingSession
from .trainer import Trainer

BEST_CHECKPOINT_NAME = "best.ckpt.npz"
_HIGHER_IS_BETTER = ("acc", "f1", "miou")  # and top<k>


def _mode(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode {mode!r}; valid: auto, min, max")
    if mode != "auto":
        return mode
    name = monitor.split("_", 1)[-1]
    return "max" if name in _HIGHER_IS_BETTER or name.startswith("top") else "min"


@dataclass
class _Monitor:
    """A metric of the epoch records, ``monitor`` (a record key: ``val_loss``, ``val_f1``...),
    better when lower (``mode="min"``) or higher (``"max"``; ``"auto"``: max for accuracy, F1,
    top-k and mIoU, min otherwise) by more than ``min_delta``."""

    monitor: str = "val_loss"
    mode: str = "auto"
    min_delta: float = 0.0
    best: float | None = field(default=None, init=False)
    best_record: dict | None = field(default=None, init=False)

    def __post_init__(self):
        self.mode = _mode(self.monitor, self.mode)
        if not self.min_delta >= 0:
            raise ValueError(f"min_delta must be >= 0, got {self.min_delta}")

    def reset(self) -> None:
        """Forget the best so far (``fit`` calls it: an instance may watch several runs)."""
        self.best = self.best_record = None

    def _improved(self, record: dict) -> bool:
        value = record.get(self.monitor)
        if value is None:  # not a metric of this run (a NaN loss is recorded as None too)
            known = [k for k, v in record.items() if isinstance(v, (int, float))
                     and k not in ("epoch", "step", "seconds", "lr", "skipped_batches")]
            if self.monitor in record and (self.best is not None
                                           or record.get("skipped_batches")):
                return False
            raise InputError(f"monitor {self.monitor!r} has no value in the epoch records; "
                             f"they hold {known} (val_* needs val_data)")
        if not math.isfinite(value):
            return False
        better = self.best is None or (value < self.best - self.min_delta
                                       if self.mode == "min" else
                                       value > self.best + self.min_delta)
        if better:
            self.best, self.best_record = value, record
        return better


@dataclass
class EarlyStopping(_Monitor):
    """Stop training after ``patience`` epochs in a row without an improvement of ``monitor``
    (Keras' and Lightning's rule); the best epoch's weights are restored at the end when
    ``restore_best`` (fit keeps them with ``KeepBest``). ``stopped_epoch``: the last epoch
    trained when it stopped the run, else None."""

    patience: int = 5
    restore_best: bool = True
    wait: int = field(default=0, init=False)
    stopped_epoch: int | None = field(default=None, init=False)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {self.patience!r}")

    def reset(self) -> None:
        super().reset()
        self.wait, self.stopped_epoch = 0, None

    def on_epoch_end(self, trainer: Trainer, record: dict) -> None:
        if self._improved(record):
            self.wait = 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.stop_training = True
            self.stopped_epoch = record["epoch"]
            trainer.log(f"early stopping: {self.monitor} has not improved for {self.patience} "
                        f"epochs (best {self.best} in epoch {self.best_record['epoch']})"
                        if self.best_record else
                        f"early stopping: {self.monitor} was never finite")


@dataclass
class KeepBest(_Monitor):
    """Keep the parameters of the epoch with the best ``monitor``: in memory (``restore(session)``
    puts them back) and, with ``path``, in a checkpoint written atomically each time an epoch
    improves on the best (``TrainingSession.from_checkpoint`` reads it)."""

    path: str | Path | None = None
    parameters: dict | None = field(default=None, init=False, repr=False)

    def reset(self) -> None:
        super().reset()
        self.parameters = None

    def on_epoch_end(self, trainer: Trainer, record: dict) -> None:
        if not self._improved(record):
            return
        session = trainer.session
        self.parameters = {k: np.array(v, copy=True) for k, v in session.parameters().items()}
        if self.path is not None and trainer.world.is_root:
            session.save_checkpoint(self.path, extra={"best": record})

    def restore(self, session: TrainingSession) -> None:
        if self.parameters is not None:
            session.load_parameters(self.parameters)


@dataclass
class FitResult:
    """What ``fit`` returns: the ``session`` (its weights: the best epoch's where the best
    was kept, else the last's), the ``history`` (one record per epoch, as in the metrics
    file), the ``best`` epoch's record (None unless the best was kept), ``stopped_early``,
    and the ``trainer``."""

    session: TrainingSession
    history: list[dict]
    trainer: Trainer
    best: dict | None = None
    stopped_early: bool = False

    def export(self, path: str | Path) -> Path:
        """The trained model as ONNX (``TrainingSession.export``)."""
        return self.session.export(path)


def _check_options(options, fn) -> None:
    """A keyword ``fn`` does not take and ``TrainingSession`` does not either is an
    ``OptionError`` naming the nearest of both (``epoch=`` for ``epochs=``), not a TypeError
    about ``TrainingSession.__init__``."""
    import difflib
    import inspect

    known = set(inspect.signature(TrainingSession).parameters) - {"model"}
    unknown = [k for k in options if k not in known]
    if unknown:
        names = sorted(known | set(inspect.signature(fn).parameters) - {"session_options"})
        near = {k: difflib.get_close_matches(k, names, n=2) for k in unknown}
        hints = "; ".join(f"{k}: did you mean {' or '.join(v)}?" if v else f"{k}: not an option"
                          for k, v in near.items())
        raise OptionError(f"{fn.__name__}() got unknown option(s) {unknown} ({hints})")


def _session(model, loss, optimizer, lr, seed, backend, options) -> TrainingSession:
    if isinstance(model, TrainingSession):
        given = [k for k, v in (("loss", loss), ("optimizer", optimizer), ("lr", lr),
                                ("backend", backend)) if v is not None] + sorted(options)
        if given:
            raise InputError(f"{given}: options of a new session; the TrainingSession given as "
                             "the model has its own (pass a model path or ModelProto instead)")
        return model
    return TrainingSession(model, loss="cross_entropy" if loss is None else loss,
                           optimizer=optimizer, lr=lr, seed=seed,
                           backend="auto" if backend is None else backend, **options)


def fit(model, data, *, loss=None, optimizer=None, lr: float | None = None, epochs: int = 1,
        batch_size: int = 32, val_data=None, callbacks: Sequence = (),
        early_stopping: EarlyStopping | dict | bool | None = None,
        keep_best: bool | str | None = None, checkpoint_dir: str | Path | None = None,
        metrics: Sequence[str] | None = None, metrics_path: str | Path | None = None,
        seed: int = 0, backend: str | None = None, progress: bool = True, log=print,
        **session_options) -> FitResult:
    """Train ``model`` on ``data`` for ``epochs`` epochs; returns a ``FitResult``.

    ``model``: a path, a ModelProto, or a ``TrainingSession`` (then ``loss``, ``optimizer``,
    ``lr``, ``backend`` and session options are its own and may not be given). ``loss``,
    ``optimizer``, ``lr``, ``seed``, ``backend`` (default ``"auto"``) and ``session_options``
    (``lr_schedule``, ``frozen``, ``grad_accumulation``...) make the ``TrainingSession``.

    ``data`` and ``val_data``: a path or ``"digits"`` (``tr_onnx.data.load``), a tuple
    ``(inputs, labels)`` of whole arrays (shuffled each epoch with ``seed``, in batches of
    ``batch_size``), or an iterable of batches read in its own order each epoch (a list, a
    torch ``DataLoader``, a ``datasets.Dataset`` read in batches of ``batch_size``, a callable
    returning a fresh iterable; a generator serves one epoch): see ``training.batches``.

    ``callbacks``: objects with ``on_step(trainer, record)`` and/or ``on_epoch_end(trainer,
    record)``, or functions called as ``on_epoch_end``; setting ``trainer.stop_training``
    ends the run after the epoch. ``early_stopping``: an ``EarlyStopping``, its keyword
    arguments as a dict, or True (``val_loss``, patience 5). ``keep_best``: True keeps the
    weights of the best epoch by the early stopping monitor (else ``val_loss`` with
    ``val_data``, ``train_loss`` without), a record key keeps them by that metric; on by
    default with early stopping (``restore_best``). The kept weights are restored into the
    session at the end; with ``checkpoint_dir`` they are also in ``best.ckpt.npz`` next to
    the ``last.ckpt.npz`` of every epoch. ``metrics``: names (``training.metrics``) instead
    of the task's defaults; ``metrics_path``: the JSON lines of every epoch.
    """
    _check_options(session_options, fit)
    session = _session(model, loss, optimizer, lr, seed, backend, session_options)
    stopper = _early_stopping(early_stopping, val_data is not None)
    best = _keep_best(keep_best, stopper, val_data is not None, checkpoint_dir)
    watchers = [w for w in (best, stopper) if w is not None]
    for watcher in watchers:
        watcher.reset()
    trainer = Trainer(session, data, val_data, batch_size=batch_size, epochs=epochs, seed=seed,
                      checkpoint_dir=checkpoint_dir, metrics_path=metrics_path,
                      progress=progress, log=log, metrics=metrics,
                      callbacks=[*callbacks, *watchers])
    history = trainer.fit()
    if best is not None:
        best.restore(session)
    return FitResult(session, history, trainer, best.best_record if best else None,
                     stopped_early=bool(stopper and stopper.stopped_epoch is not None))


def _early_stopping(given, has_val: bool) -> EarlyStopping | None:
    if given is None or given is False:
        return None
    if given is True:
        given = {}
    if isinstance(given, dict):
        given = EarlyStopping(**{"monitor": "val_loss" if has_val else "train_loss", **given})
    if not isinstance(given, EarlyStopping):
        raise InputError(f"early_stopping: an EarlyStopping, a dict of its options or True, "
                         f"got {type(given).__name__}")
    return given


def _keep_best(given, stopper: EarlyStopping | None, has_val: bool,
               checkpoint_dir) -> KeepBest | None:
    if given is None:
        given = stopper is not None and stopper.restore_best
    if given is False:
        return None
    if isinstance(given, str):
        monitor, mode = given, "auto"
    elif stopper is not None:
        monitor, mode = stopper.monitor, stopper.mode
    else:
        monitor, mode = ("val_loss" if has_val else "train_loss"), "auto"
    path = Path(checkpoint_dir) / BEST_CHECKPOINT_NAME if checkpoint_dir is not None else None
    return KeepBest(monitor, mode, stopper.min_delta if stopper else 0.0, path=path)


def evaluate(model, data, *, loss=None, batch_size: int = 32,
             metrics: Sequence[str] | None = None, backend: str | None = None,
             **session_options) -> dict:
    """The loss and metrics of ``model`` on ``data``, in eval mode: ``{"loss", "acc",
    <metric>...}`` (the keys of an epoch record's ``val_`` entries without the prefix).

    ``model``: a path, a ModelProto (evaluated with ``loss``, default cross_entropy, on
    ``backend``) or a ``TrainingSession`` (its loss and current weights). ``data``: as
    ``fit``'s (a data set is read in order, in batches of ``batch_size``)."""
    _check_options(session_options, evaluate)
    session = _session(model, loss, None, None, 0, backend, session_options)
    trainer = Trainer(session, data, epochs=0, batch_size=batch_size, progress=False,
                      log=None, metrics=metrics)
    return trainer.evaluate(trainer.train_data)
