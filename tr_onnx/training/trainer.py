"""``Trainer``: epochs of shuffled batches over a ``TrainingSession``, with validation, metrics
(JSON lines), a progress line, a plot, and checkpoints that resume bit for bit.

The data order is a pure function of ``(seed, epoch)``: epoch ``e`` visits the samples in the
order ``np.random.default_rng(seed + e).permutation(n)``, in batches of ``batch_size`` (the last
one partial). A checkpoint records the position (epoch, next batch), so a resumed run sees
exactly the batches it would have seen had it not stopped, and its parameters end up equal,
bit for bit, to an uninterrupted run's.

Across ranks (the session's ``World``, from ``mpiexec``/``srun``): ``batch_size`` is the batch of
one rank, and the batches above are global batches of ``size * batch_size`` rows, drawn in the
same order on every rank (one seed). Rank r takes rows ``[r*m//size, (r+1)*m//size)`` of a global
batch of m rows (``[r*b, (r+1)*b)`` of a full one), so N ranks with batch b see the samples one
process with batch N*b sees, and with each rank's gradient weighted by its rows (a last batch's
shares differ, some may be empty) they train like it. Losses and
accuracies are sums and counts reduced across ranks each batch, never a mean of means. Rank 0
alone prints, draws the progress line and writes metrics, plots and checkpoints; a checkpoint
records the global batch size, so a run of another world size resumes it at the same sample.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..data import Dataset, Rows, num_samples
from ..data.prefetch import Prefetcher
from ..distributed import World
from ..errors import (
    CheckpointError,
    InputError,
    NoStepApplied,
    TrainingDiverged,
    TrOnnxError,
)
from .batches import Batches, prepare
from .losses import INTEGER_LABELS, LossSpec
from .metrics import default_metrics, make_metrics, metric_values
from .plots import plot_format, plot_history
from .progress import ProgressBar
from .records import (
    EpochTotals,
    MetricsFile,
    accuracy_kind,
    count_correct,
    finite,
    status_text,
    summary,
)
from .session import TrainingSession

CHECKPOINT_NAME = "last.ckpt.npz"
REGRESSION = frozenset({"mse", "l1", "smooth_l1"})  # the losses whose runs get MSE and MAE


def label_kind(session: TrainingSession) -> tuple[str, np.dtype]:
    """What the session's loss takes as labels: ``("index", int64)`` for class indices,
    ``("dense", dtype)`` for targets shaped like the model output."""
    if isinstance(session.loss, LossSpec):
        if session.loss.name in INTEGER_LABELS:
            return "index", np.dtype(np.int64)
        out = next(o for o in session.imported.outputs if o.name == session.output_name)
        return "dense", np.dtype(out.dtype)
    dtype = np.dtype(session.loss.inputs[1].dtype)
    return ("index" if dtype.kind in "iu" else "dense"), dtype


def session_world(session: TrainingSession) -> World:
    """The ranks ``session`` trains with (a world of 1 unless it was made with
    ``distributed=``)."""
    return session.world if session.world is not None else World()


def _fingerprint(data: Dataset) -> int:
    """CRC-32 of every array's shape, dtype and bytes (of a ``Rows``, its own fingerprint:
    what identifies its files, not their decoded bytes): a resumed run must see the same
    data."""
    arrays, labels = data
    crc = 0
    for name, x in [*sorted(arrays.items()), ("labels", labels)]:
        if isinstance(x, Rows):
            crc = zlib.crc32(f"{name}{x.shape}{x.dtype}{x.fingerprint()}".encode(), crc)
            continue
        x = np.ascontiguousarray(x)
        crc = zlib.crc32(f"{name}{x.shape}{x.dtype}".encode(), crc)
        crc = zlib.crc32(x.view(np.uint8).reshape(-1), crc)
    return crc


# ---- the trainer -----------------------------------------------------------------------------

class Trainer:
    """Train ``session`` on ``train_data`` for ``epochs`` epochs (the total: a resumed run
    continues up to it).

    ``train_data``/``val_data``: ``(arrays by model input name, labels)``, as
    ``tr_onnx.data.load_dataset`` returns, or anything ``training.batches.prepare`` takes (a
    path, whole arrays, an iterable of batches: ``tr_onnx.fit``'s data). Per epoch: shuffle (a
    function of ``seed`` and the epoch; batches from an iterable come in its order),
    ``session.train_step`` per batch, validation with ``session.run_loss`` in batches of
    ``val_batch_size`` (default ``batch_size``), a metrics line, a checkpoint, then the
    ``callbacks``' ``on_epoch_end(trainer, record)`` (a plain function is called as that);
    ``on_step(trainer, record)`` after every batch, with the epoch's running record;
    ``on_record(trainer, record)`` for every record the metrics file gets (each epoch's and,
    with ``metrics_every``, the step records), whether or not there is a file. A callback
    that sets ``stop_training`` ends ``fit`` after the epoch. ``metrics``: names of
    ``training.metrics`` (default: those of the task, ``default_metrics``).

    ``checkpoint_dir``: ``last.ckpt.npz`` is written there (atomically) at each epoch end and,
    with ``checkpoint_every=N``, after every N-th batch (counted from the start of training).
    ``metrics_path``: JSON lines, one per epoch (``"kind": "epoch"``) and, with
    ``metrics_every=N``, one every N batches (``"kind": "step"``, the epoch's running values):
    ``epoch`` (1-based), ``step`` (optimizer steps so far), ``train_loss``, ``train_acc``,
    ``val_loss``, ``val_acc`` (null in step lines and without validation data),
    ``train_<metric>`` and ``val_<metric>`` per metric (``f1`` adds ``*_f1_per_class``),
    ``lr`` (of the next step), ``samples_per_s`` (training only), ``seconds``, and
    ``skipped_batches`` (epoch lines) or ``batch`` (step lines). ``plot_path``: the per-epoch
    curves written when ``fit`` ends, in the format its suffix names (``plot_format``).
    ``progress``: progress on stderr (``training.progress``: redrawn in place on a terminal,
    plain lines elsewhere). ``log``: where summaries go (``print``; None for silence).

    Losses are averages over samples of the per-batch losses (weighted by batch size); batches
    whose loss or gradient is non-finite are not applied by the session, not counted in the
    loss or accuracy, and counted in ``skipped_batches``.

    With a session of several ranks (``distributed=``), ``batch_size`` and ``val_batch_size``
    are per rank and every rank calls ``fit`` (see the module docstring for the sharding); the
    loss, accuracy and samples/s are those of all ranks, and rank 0 alone logs, shows progress
    and writes files. In a last global batch with fewer rows than ranks, the ranks without a
    row add nothing.
    """

    def __init__(self, session: TrainingSession, train_data: Dataset,
                 val_data: Dataset | None = None, batch_size: int = 32, epochs: int = 1,
                 seed: int = 0, checkpoint_dir: str | Path | None = None,
                 metrics_path: str | Path | None = None, plot_path: str | Path | None = None,
                 progress: bool = True, log=print, *, checkpoint_every: int | None = None,
                 metrics_every: int | None = None, val_batch_size: int | None = None,
                 metrics: Sequence[str] | None = None, callbacks: Sequence = ()):
        for name, value in (("batch_size", batch_size), ("checkpoint_every", checkpoint_every),
                            ("metrics_every", metrics_every),
                            ("val_batch_size", val_batch_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        self.session = session
        self.world = session_world(session)
        kind, dtype = label_kind(session)
        train_data = prepare(train_data, session.imported.inputs, kind, dtype, batch_size,
                             "train_data")
        val_data = prepare(val_data, session.imported.inputs, kind, dtype, batch_size,
                           "val_data")
        streams = [d for d in (train_data, val_data) if isinstance(d, Batches)]
        if streams and self.world.size > 1:
            raise InputError(f"{streams[0].what}: batches from an iterable train on one "
                             "process; across ranks give a data set (arrays, labels), which "
                             "each rank shards")
        if isinstance(train_data, Batches) and checkpoint_every:
            raise ValueError("checkpoint_every: a mid-epoch checkpoint resumes at a batch of "
                             "the epoch, which batches from an iterable cannot replay; "
                             "checkpoints are written at each epoch end")
        for data in streams:
            if data.one_shot and epochs > 1:
                raise InputError(f"{data.what}: a generator or iterator gives its batches "
                                 f"once, and epochs={epochs}: pass a callable that returns a "
                                 "fresh one each epoch (lambda: make_batches()) or a list")
        self.train_data = self._check_data(train_data, "train_data")
        self.val_data = self._check_data(val_data, "val_data") if val_data is not None and (
            isinstance(val_data, Batches) or num_samples(val_data)) else None
        self.batch_size, self.epochs, self.seed = batch_size, int(epochs), int(seed)
        self.global_batch_size = batch_size * self.world.size
        if not self.world.is_root:  # rank 0 alone prints and writes files
            log, progress, metrics_path, plot_path = None, False, None, None
        self.val_batch_size = val_batch_size or batch_size
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.metrics_every = checkpoint_every, metrics_every
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        self.plot_path = Path(plot_path) if plot_path is not None else None
        if self.plot_path is not None:
            with contextlib.suppress(ImportError):  # fit() says that matplotlib is missing
                plot_format(self.plot_path)  # a format it cannot write fails now, not at the end
        self.progress = progress
        self.log = log or (lambda *_: None)
        if isinstance(self.train_data, Batches):
            self.n_train, self.batches_per_epoch = None, self.train_data.length
            # dense labels: known at the first batch (one-hot rows have an accuracy)
            self.accuracy_kind = ("index" if self.train_data.converter.label_dtype.kind in "iu"
                                  else None)
        else:
            self.n_train = num_samples(self.train_data)
            self.batches_per_epoch = self._count_batches()
            self.accuracy_kind = accuracy_kind(self.train_data[1])
        self.ignore_index = (session.loss.ignore_index if isinstance(session.loss, LossSpec)
                             else None)
        self.class_axis = session.loss.class_axis if isinstance(session.loss, LossSpec) else 1
        self.metrics = self._make_metrics(metrics)
        self.callbacks = list(callbacks)
        self.stop_training = False  # a callback sets it to end fit() after this epoch
        self.epoch = 0  # epochs completed
        self.batch = 0  # next batch of the epoch in progress
        self.history: list[dict] = []
        self.totals = EpochTotals()
        self.status = "new"  # "running", "done", "diverged" or "no step"
        self._run_batches = self._run_skipped = 0  # batches this fit() trained, skipped
        self._metrics_file = MetricsFile(self.metrics_path)
        self._data_crc: int | None = None
        self._stream_batches = 0  # batches from an iterable trained so far (metrics_every)

    def _make_metrics(self, names: Sequence[str] | None) -> list:
        """The metrics ``names`` (``training.metrics``), by default those of the task: the
        loss's labels, the output's rank and its number of classes."""
        if names is None:
            out = next(o for o in self.session.imported.outputs
                       if o.name == self.session.output_name)
            rank = len(out.shape) if out.shape is not None else 0
            classes = None
            if rank >= 2 and -rank <= self.class_axis < rank:
                dim = out.shape[self.class_axis]
                classes = dim if isinstance(dim, int) else None
            loss = self.session.loss
            task = ("regression" if isinstance(loss, LossSpec) and loss.name in REGRESSION
                    else "classes" if label_kind(self.session)[0] == "index" else "other")
            names = default_metrics(task, rank, self.class_axis, classes)
        loss = self.session.loss
        plain = (isinstance(loss, LossSpec) and loss.name == "cross_entropy"
                 and loss.reduction == "mean" and not loss.weights
                 and not loss.label_smoothing)
        return make_metrics(names, class_axis=self.class_axis, ignore_index=self.ignore_index,
                            loss_is_nll=plain)

    def _count_batches(self) -> int:
        # a last batch of fewer rows than ranks leaves some ranks none: they add nothing (the
        # session weighs each rank's gradient by its rows)
        return -(-self.n_train // self.global_batch_size)

    def _shard(self, rows: np.ndarray) -> np.ndarray:
        """This rank's part of the global batch ``rows``: ``[r*m//size, (r+1)*m//size)``."""
        m, r, size = len(rows), self.world.rank, self.world.size
        return rows[m * r // size:m * (r + 1) // size]

    @property
    def data_crc(self) -> int | None:
        """CRC-32 of the training data (computed once; checkpoints record it; None for batches
        from an iterable)."""
        if self._data_crc is None and not isinstance(self.train_data, Batches):
            self._data_crc = _fingerprint(self.train_data)
        return self._data_crc

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint_dir / CHECKPOINT_NAME if self.checkpoint_dir else None

    def _check_data(self, data: Dataset | Batches, what: str) -> Dataset | Batches:
        if isinstance(data, Batches):
            return data
        arrays, labels = data
        names = [s.name for s in self.session.imported.inputs]
        if sorted(arrays) != sorted(names):
            raise InputError(f"{what}: arrays {sorted(arrays)} do not match the model's inputs "
                             f"{names}")
        labels = np.asarray(labels)
        n = len(labels)
        bad = {k: len(v) for k, v in arrays.items() if len(v) != n}
        if bad:
            raise InputError(f"{what}: {n} labels but samples per input {bad}")
        if not n:
            raise InputError(f"{what}: 0 samples; need at least one")
        return dict(arrays), labels

    # ---- resume ------------------------------------------------------------------------------

    @classmethod
    def resume(cls, checkpoint_dir: str | Path, train_data: Dataset,
               val_data: Dataset | None = None, *, session: TrainingSession | None = None,
               plugins=(), **kwargs) -> Trainer:
        """A Trainer positioned where ``checkpoint_dir/last.ckpt.npz`` left off: the session
        from the checkpoint (or ``session``, already loaded from it with
        ``TrainingSession.from_checkpoint``), the same seed and batch size (an explicit
        different one is an error), ``epochs`` defaulting to the saved total. The data must be
        the same as when the checkpoint was written (checked by a CRC of its arrays).

        On several ranks every rank resumes a ``session`` made with
        ``TrainingSession.from_checkpoint(path, distributed=world)`` (rank 0 reads the file and
        broadcasts it: the other machines need no copy); the checkpoint's global batch is split
        over them (``resumed_batch_size``), whatever world size wrote it."""
        path = Path(checkpoint_dir) / CHECKPOINT_NAME
        if session is None:
            if not path.exists():
                raise TrOnnxError(f"{path}: no checkpoint to resume from")
            session = TrainingSession.from_checkpoint(path, plugins=plugins)
        extra = session.checkpoint_extra
        missing = [k for k in ("epoch", "batch", "seed", "batch_size", "history", "n_train")
                   if k not in extra]
        if missing:
            raise CheckpointError(f"{path}: not written by a Trainer (extra lacks {missing})")
        try:  # a damaged position is named here, not a TypeError further down
            position = (int(extra["epoch"]), int(extra["batch"]), list(extra["history"]),
                        EpochTotals(**extra.get("totals", {})),
                        int(extra.get("metrics_lines", 0)))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: its Trainer position is not valid ({exc})") from None
        if kwargs.get("seed") is not None and kwargs["seed"] != extra["seed"]:
            raise ValueError(f"resume: seed {kwargs['seed']} differs from the checkpoint's "
                             f"{extra['seed']} ({path}); the batches would differ")
        kwargs["seed"] = extra["seed"]
        kwargs["batch_size"] = cls.resumed_batch_size(path, extra, session_world(session),
                                                       kwargs.get("batch_size"))
        kwargs.setdefault("epochs", extra.get("epochs", extra["epoch"]))
        kwargs.setdefault("checkpoint_dir", checkpoint_dir)
        trainer = cls(session, train_data, val_data, **kwargs)
        if trainer.n_train != extra["n_train"] or (
                "data_crc" in extra and trainer.data_crc != extra["data_crc"]):
            raise InputError(f"resume: the training data ({trainer.n_train} samples) is not the "
                             f"data {path} was trained on ({extra['n_train']} samples)")
        trainer.epoch, trainer.batch, trainer.history, trainer.totals, \
            trainer._metrics_file.lines = position
        trainer.log(f"resuming from {path}: epoch {trainer.epoch + 1}, batch "
                    f"{trainer.batch + 1} of {trainer.batches_per_epoch}, step {session.step}")
        return trainer

    @staticmethod
    def resumed_batch_size(path: Path, extra: dict, world: World, given: int | None) -> int:
        """The per-rank batch that continues the checkpoint's global batches on ``world``
        (``given``, if given, must be it)."""
        saved = int(extra.get("global_batch_size", extra["batch_size"]))
        ranks = world.size
        if given is None and saved % ranks == 0:
            return saved // ranks
        if given is not None and given * ranks == saved:
            return given
        what = (f"batch_size {given} on {ranks} rank(s) is a global batch of {given * ranks}"
                if given is not None else f"its global batch does not split over {ranks} ranks")
        fix = (f"resume with batch_size {saved // ranks}" if saved % ranks == 0
               else "resume on a number of ranks that divides it")
        raise ValueError(f"resume: {path} trained with global batches of {saved} "
                         f"({extra.get('world_size', 1)} rank(s) x {extra['batch_size']}); "
                         f"{what}, so the batches would differ: {fix}")

    # ---- training ----------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train up to ``epochs``; returns the history (one dict per epoch, as in the metrics
        file). First every label of the training and validation data is checked: a class
        index out of range is an ``InputError`` naming it, before any step.

        If the session raises ``TrainingDiverged``, the trainer logs where, writes the plot of
        the epochs completed, sets ``status = "diverged"`` and re-raises (with a note naming
        the last good checkpoint); no checkpoint is written from the diverged state, so
        ``last.ckpt.npz`` stays the last good one.

        A run that trained batches but applied no optimizer step (each skipped as non-finite,
        fewer than ``max_bad_steps`` in a row) raises ``NoStepApplied`` with ``status = "no
        step"``: its weights are those it started from, not a result to export.
        """
        if self.epoch < self.epochs:
            self._check_class_labels()
        self.status = "running"
        start_step, self._run_batches, self._run_skipped = self.session.step, 0, 0
        if self.epoch >= self.epochs:
            self.log(f"{self.epoch} epochs done already (epochs={self.epochs}): nothing to train")
        try:
            self.stop_training = False
            with self._metrics_file.open():
                while self.epoch < self.epochs and not self.stop_training:
                    if (note := self.session.begin_epoch(self.epoch)) is not None:
                        self.log(note)  # unfrozen (fine-tuning's unfreeze_after)
                    if isinstance(self.train_data, Batches):
                        self._run_stream_epoch()
                    else:
                        self._run_epoch()
        except TrainingDiverged as exc:
            self.status = "diverged"
            path = self.checkpoint_path
            kept = (f"last good checkpoint: {path}" if path is not None and path.exists()
                    else "no checkpoint was written")
            msg = (f"training diverged in epoch {self.epoch + 1}, batch {self.batch + 1}: "
                   f"{exc}; {kept}")
            exc.add_note(kept)
            self.log(msg)
            self._plot()
            raise
        if self._run_batches and self.session.step == start_step:
            self.status = "no step"
            raise NoStepApplied(self._no_step_message())
        self.status = "done"
        self._plot()
        return self.history

    def _no_step_message(self) -> str:
        n, skipped = self._run_batches, self._run_skipped
        why = (f"all {n} batches had a non-finite loss or gradient and were skipped"
               if skipped == n else f"{skipped} of {n} batches were skipped as non-finite and "
               f"the others completed no step (grad_accumulation="
               f"{self.session.options.grad_accumulation}, or fp16 gradient overflows)")
        return (f"no optimizer step was applied: {why} (fewer than max_bad_steps="
                f"{self.session.options.max_bad_steps} in a row, so not reported as "
                "diverged); the weights are those the run started from: check the data for NaN "
                "or infinity, or lower the learning rate")

    def _check_class_labels(self) -> None:
        """Every label of the training and validation data, before the first step: one out of
        range of the loss's classes is an ``InputError`` naming it and its position."""
        sets = [(what, data) for what, data in (("train_data", self.train_data),
                                                ("val_data", self.val_data))
                if data is not None and not isinstance(data, Batches)]  # checked per step
        if sets:
            feed = {k: v[:self.batch_size] for k, v in sets[0][1][0].items()}
        for what, data in sets:
            self.session.check_class_labels(data[1], feed, what)

    # batches that take time to read (files, decoding) made ahead by a background thread
    # while a step runs (Prefetcher, which says when); 0: each in the training thread
    prefetch = 2

    def _run_epoch(self) -> None:
        epoch, gb, nb = self.epoch, self.global_batch_size, self.batches_per_epoch
        order = np.random.default_rng(self.seed + epoch).permutation(self.n_train)
        arrays, labels = self.train_data
        # a source that augments (an image folder) draws per (seed, epoch, sample): a resumed
        # run draws the same, and validation data, never passed through here, is not augmented
        arrays = {k: v.for_epoch(self.seed, epoch) if hasattr(v, "for_epoch") else v
                  for k, v in arrays.items()}
        totals = self.totals
        bar = ProgressBar(nb, f"epoch {epoch + 1}/{self.epochs}", enabled=self.progress)
        # On the cuda backend each batch is accounted for after the next one was launched
        # (train_step(..., wait=False): the host prepares batch b+1 while the GPU runs b),
        # except the last of the epoch and where a checkpoint or a metrics line follows it.
        waiting: list = []  # (pending step, labels, global rows) launched, not accounted for

        def account(pending, y, rows) -> None:
            self._account(pending, y, rows, totals)
            bar.update(self.batch, self._status_text(totals))

        def fetch(b: int):
            rows = order[b * gb:(b + 1) * gb]
            idx = self._shard(rows)
            return rows, labels[idx], {k: v[idx] for k, v in arrays.items()}

        try:
            with Prefetcher(fetch, range(self.batch, nb), self.prefetch,
                            lambda b: f"epoch {epoch + 1}, batch {b + 1}") as batches:
                start = time.perf_counter()  # waiting for a batch counts as training time
                for b, (rows, y, feed) in batches:
                    pending = self.session.train_step(feed, y, wait=False)
                    for done in waiting:
                        account(*done)
                    waiting = [(pending, y, len(rows))]
                    if pending.done or not pending.keeps_outputs or b + 1 == nb \
                            or self._due(epoch * nb + b + 1):
                        account(pending, y, len(rows))
                        waiting = []
                    totals.train_seconds += time.perf_counter() - start
                    if not waiting:
                        self._after_batch(epoch * nb + b + 1)
                    start = time.perf_counter()
        finally:
            bar.close()
        self._end_epoch(totals)

    def _run_stream_epoch(self) -> None:
        """One epoch over batches from an iterable, in the order it gives them, each step read
        back before the next batch is fetched."""
        totals, data = self.totals, self.train_data
        bar = ProgressBar(data.length or 0, f"epoch {self.epoch + 1}/{self.epochs}",
                          enabled=self.progress and data.length is not None)
        batches = data.epoch()
        try:
            while True:
                start = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                feed, y = batch
                if self.accuracy_kind is None and not self.batch and self.epoch == 0:
                    self.accuracy_kind = accuracy_kind(y)
                self._account(self.session.train_step(feed, y, wait=False), y, len(y), totals)
                totals.train_seconds += time.perf_counter() - start
                bar.update(self.batch, self._status_text(totals))
                self._stream_batches += 1
                self._after_batch(self._stream_batches)
        finally:
            bar.close()
        if not self.batch:
            raise InputError(f"{data.what}: no batches in epoch {self.epoch + 1}")
        self._end_epoch(totals)

    def _end_epoch(self, totals: EpochTotals) -> None:
        """Validation, the epoch's record (history, metrics file, summary), the checkpoint,
        then the callbacks' ``on_epoch_end``."""
        start = time.perf_counter()
        val = (self.evaluate(self.val_data, shown=f"epoch {self.epoch + 1}/{self.epochs} "
                             "validation") if self.val_data else None)
        record = self._record("epoch", totals, val,
                              totals.train_seconds + time.perf_counter() - start)
        record["skipped_batches"] = totals.skipped
        self.history.append(record)
        self.epoch, self.batch, self.totals = self.epoch + 1, 0, EpochTotals()
        self._write_metrics(record)
        self.log(self._summary(record))
        self._checkpoint()
        for callback in self.callbacks:
            if hasattr(callback, "on_epoch_end"):
                callback.on_epoch_end(self, record)
            elif callable(callback):  # a plain function
                callback(self, record)

    def _account(self, pending, y: np.ndarray, rows: int, totals: EpochTotals) -> None:
        """Add one batch's loss, accuracy and metric sums to ``totals``: the sums of all
        ranks in one message, so that every rank (and each checkpoint) holds the totals of the
        global batch. A non-finite batch adds nothing but its count."""
        if pending.bad:
            scalars = [1.0, 0.0, 0.0, 0.0, 0.0]
            # zeros of each metric's size: every rank sends a message of the same length
            sums = [] if self.world.size == 1 else [
                np.zeros(m.size(pending.outputs()[self.session.output_name].shape))
                for m in self.metrics]
        else:
            x = pending.outputs()[self.session.output_name]
            c, k = count_correct(self.accuracy_kind, x, y, self.ignore_index, self.class_axis)
            loss = pending.loss()
            scalars = [0.0, loss * len(y), len(y), c, k]
            sums = [m.sums(x, y, loss) for m in self.metrics]
        scalars, sums = self._allreduce(scalars, sums)
        bad, loss_sum, samples, correct, counted = scalars
        totals.seen += rows
        self._run_batches += 1
        if bad:
            totals.skipped += 1
            self._run_skipped += 1
        else:
            totals.loss_sum += loss_sum
            totals.samples += round(samples)
            totals.correct += round(correct)
            totals.counted += round(counted)
            totals.add_metric_sums(sums)
        self.batch += 1
        for callback in self.callbacks:
            if hasattr(callback, "on_step"):
                callback.on_step(self, self._record("step", totals, None, totals.train_seconds))

    def _allreduce(self, scalars: list[float], sums: list[np.ndarray]
                   ) -> tuple[list[float], list[np.ndarray]]:
        """``scalars`` and the metric ``sums`` summed over the ranks, in one message."""
        if self.world.size == 1:
            return scalars, sums
        flat = self.world.allreduce_scalars([*scalars, *(v for s in sums for v in s)])
        out, at = [], len(scalars)
        for s in sums:
            out.append(np.asarray(flat[at:at + len(s)]))
            at += len(s)
        return flat[:len(scalars)], out

    def _due(self, global_batch: int) -> bool:
        """Whether a metrics line or a checkpoint follows this batch (it is then accounted
        for, and its step read back, before the next one is launched)."""
        return bool(self.metrics_every and global_batch % self.metrics_every == 0
                    or self.checkpoint_every and global_batch % self.checkpoint_every == 0)

    def _after_batch(self, global_batch: int) -> None:
        if self.metrics_every and global_batch % self.metrics_every == 0:
            self._write_metrics(self._record("step", self.totals, None,
                                             self.totals.train_seconds))
        if (self.checkpoint_every and global_batch % self.checkpoint_every == 0
                and self.batch < self.batches_per_epoch):  # the epoch end writes its own
            self._checkpoint()

    def _record(self, kind: str, totals: EpochTotals, val: dict | None, seconds) -> dict:
        """A metrics record: ``val`` is ``evaluate``'s result (None: no validation)."""
        val = val or {}
        record = {"kind": kind, "epoch": self.epoch + 1, "step": self.session.step,
                  "train_loss": totals.loss, "train_acc": totals.acc,
                  "val_loss": val.get("loss"), "val_acc": val.get("acc"),
                  **metric_values(self.metrics, totals.metric_sums, "train_"),
                  **{f"val_{k}": val.get(k) for k in self._metric_keys()},
                  "lr": self.session.lr, "samples_per_s": totals.samples_per_s(),
                  "seconds": seconds}
        if kind == "step":
            record["batch"] = self.batch
        return {k: finite(v) for k, v in record.items()}

    def _metric_keys(self) -> list[str]:
        """The record keys of the metrics beyond loss and accuracy, without their prefix."""
        return list(metric_values(self.metrics, None, ""))

    def _status_text(self, totals: EpochTotals) -> str:
        return status_text(totals, self.world.size)

    def _summary(self, record: dict) -> str:
        return summary(record, self.epochs, self._metric_keys(), self.accuracy_kind is not None,
                       bool(self.val_data), self.world.size)

    # ---- evaluation --------------------------------------------------------------------------

    def evaluate(self, data, shown: str | None = None) -> dict:
        """The loss and metrics of the current weights on ``data`` in eval mode:
        ``{"loss", "acc", <metric>...}`` (the record's ``val_`` keys without the prefix). The
        loss as the training loss (sample-weighted batch losses), accuracy None for regression
        targets, every metric from sums over all of ``data``. ``data``: a data set ``(arrays,
        labels)``, evaluated in batches of ``val_batch_size`` (across ranks, every rank calls
        it: rank r evaluates rows ``[r*n//size, (r+1)*n//size)`` and the sums and counts are
        reduced), or ``Batches`` (``training.batches``), evaluated batch by batch. ``shown``:
        the label of a progress line through the batches, where the Trainer shows progress."""
        output = self.session.output_name
        loss_sum, correct, counted, n, sums = 0.0, 0, 0, 0, None
        bar = ProgressBar(self._eval_batch_count(data), shown or "",
                          enabled=bool(shown) and self.progress)
        for done, (feed, y) in enumerate(self._eval_batches(data), 1):
            x, loss = self.session.run_loss(feed, y)
            bar.update(done, "")
            loss_sum += loss * len(y)
            c, k = count_correct(self.accuracy_kind, x, y, self.ignore_index, self.class_axis)
            correct, counted, n = correct + c, counted + k, n + len(y)
            batch = [m.sums(x, y, loss) for m in self.metrics]
            sums = batch if sums is None else [a + b for a, b in zip(sums, batch)]
        bar.close()
        if sums is None:  # a rank without rows: zeros of the sizes the others send
            feed, _ = next(iter(self._eval_batches(data, shard=False)))
            (x,) = self.session.run([output], {k: v[:1] for k, v in feed.items()})
            sums = [np.zeros(m.size(x.shape)) for m in self.metrics]
        (loss_sum, correct, counted, n), sums = self._allreduce([loss_sum, correct, counted, n],
                                                               sums)
        return {"loss": finite(loss_sum / n) if n else None,
                "acc": correct / counted if counted else None,
                **metric_values(self.metrics, sums, "")}

    def _eval_batch_count(self, data) -> int:
        """This rank's evaluation batches of ``data`` (0: a stream of unknown length)."""
        if isinstance(data, Batches):
            return data.length or 0
        n, r, size = len(data[1]), self.world.rank, self.world.size
        return -(-(n * (r + 1) // size - n * r // size) // self.val_batch_size)

    def _eval_batches(self, data, shard: bool = True):
        """``(feed, labels)`` batches of ``data``: this rank's rows of a data set in batches
        of ``val_batch_size`` (all rows with ``shard=False``), or the batches of a stream."""
        if isinstance(data, Batches):
            yield from data.epoch()
            return
        arrays, labels = data
        n, bs, r, size = len(labels), self.val_batch_size, self.world.rank, self.world.size
        first, end = (n * r // size, n * (r + 1) // size) if shard else (0, n)
        for start in range(first, end, bs):
            stop = min(start + bs, end)
            yield {k: v[start:stop] for k, v in arrays.items()}, labels[start:stop]

    # ---- files -------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        if self.checkpoint_path is None or not self.world.is_root:
            return
        # the position is in global batches: a run on another number of ranks resumes it with
        # global_batch_size // its size per rank
        extra = {"epoch": self.epoch, "batch": self.batch, "seed": self.seed,
                 "batch_size": self.batch_size, "world_size": self.world.size,
                 "global_batch_size": self.global_batch_size, "epochs": self.epochs,
                 "history": self.history,
                 "totals": asdict(self.totals), "n_train": self.n_train,
                 "data_crc": self.data_crc,
                 "metrics_lines": self._metrics_file.lines}
        self.session.save_checkpoint(self.checkpoint_path, extra=extra)

    def _write_metrics(self, record: dict) -> None:
        """Append one JSON line, then hand the record to the callbacks' ``on_record``."""
        self._metrics_file.write(record)
        for callback in self.callbacks:
            if hasattr(callback, "on_record"):
                callback.on_record(self, record)

    def _plot(self) -> None:
        if self.plot_path is None or not self.history:
            return
        try:
            plot_history(self.history, self.plot_path)
        except ImportError:
            self.log(f"matplotlib is not installed: no plot written to {self.plot_path} "
                     "(pip install 'tr_onnx[train]')")
