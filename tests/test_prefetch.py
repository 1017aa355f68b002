"""Batches read by a background thread while the step runs: the same batches and the same
trained weights as reading them in the training thread, errors raised there as they were, and no
thread left behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from data_models import export_mlp

import tr_onnx
from tr_onnx.data import load, split
from tr_onnx.data import prefetch as prefetch_module
from tr_onnx.data.npy_folder import MappedRows
from tr_onnx.data.prefetch import Prefetcher
from tr_onnx.errors import InputError
from tr_onnx.training.trainer import Trainer, label_kind

FEATURES, CLASSES = 10, 3


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tr_onnx-prefetch"]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_batches_come_in_order_at_most_depth_plus_one_ahead(depth):
    consumed, ahead = [], []

    def make(i):
        ahead.append(i - len(consumed))
        return i * i

    with Prefetcher(make, range(20), depth, min_read_s=0) as batches:
        for i, batch in batches:
            time.sleep(0.002)  # a step: the producer fills the queue meanwhile
            consumed.append((i, batch))
    assert consumed == [(i, i * i) for i in range(20)]
    assert max(ahead) <= depth + 1 and (depth == 0 or max(ahead) > 1)
    assert len(batches.waits) == 20 and batches.waited == sum(batches.waits)
    assert batches.threaded == (depth > 0)


@pytest.mark.parametrize(("read_s", "threaded"), [(0.0, False), (0.08, True)])
def test_a_thread_makes_the_batches_only_where_the_first_took_min_read_s(read_s, threaded):
    made_by = []

    def make(i):
        made_by.append(threading.current_thread().name)
        if read_s:
            time.sleep(read_s)
        return i

    # far apart, as a busy machine may pause a thread for milliseconds
    with Prefetcher(make, range(6), 2, min_read_s=0.04) as batches:
        assert [i for i, _ in batches] == list(range(6))
    assert batches.threaded == threaded
    main = threading.current_thread().name
    assert made_by == [main] + [("tr_onnx-prefetch" if threaded else main)] * 5
    assert not prefetch_threads()


class Failing(Exception):
    pass


def test_an_error_in_a_read_is_raised_in_the_training_thread_naming_the_batch():
    error = Failing("row 7 is broken")

    def make(i):
        if i == 3:
            raise error
        return i

    seen = []
    with pytest.raises(Failing) as info, Prefetcher(make, range(10), 2, lambda i: f"batch {i + 1}",
                                                    min_read_s=0) as batches:
        for i, _ in batches:
            seen.append(i)
    assert info.value is error
    assert seen == [0, 1, 2]  # the batches before it were trained
    assert "while reading batch 4" in info.value.__notes__
    assert not prefetch_threads()


def test_ctrl_c_in_the_step_stops_the_thread():
    made = []

    def make(i):
        made.append(i)
        return i

    with pytest.raises(KeyboardInterrupt), Prefetcher(make, range(1000), 2,
                                                      min_read_s=0) as batches:
        for i, _ in batches:
            if i == 5:
                raise KeyboardInterrupt
    assert not prefetch_threads()
    assert len(made) <= 5 + 3  # it stopped, not read on to the end


class ReadLog(MappedRows):
    """MappedRows that take 2 ms a batch (as a read from disk would: long enough for the
    prefetch thread), record which thread reads its batches (row numbers; the checks before
    training read slices), and fail at one row if asked to."""

    def __init__(self, rows: MappedRows, threads: list, bad_row: int | None = None):
        super().__init__(rows.array, rows.dtype, rows.rows)
        self.threads, self.bad_row = threads, bad_row

    def __getitem__(self, idx):
        if not isinstance(idx, slice):
            self.threads.append(threading.current_thread().name)
            time.sleep(0.002)
        rows = np.arange(len(self))[idx]
        if self.bad_row is not None and self.bad_row in rows:
            raise InputError(f"x.npy: row {self.bad_row + 1} cannot be read")
        return super().__getitem__(idx)


class InMemory(np.ndarray):
    """An array in memory that records which thread reads its batches."""

    threads: list

    def __getitem__(self, idx):
        if not isinstance(idx, slice):
            self.threads.append(threading.current_thread().name)
        return super().__getitem__(idx)


def trained(tmp_path, prefetch: int, bad_row: int | None = None, in_memory: bool = False):
    model = tmp_path / "mlp.onnx"
    if not model.exists():
        export_mlp(model, FEATURES, CLASSES)
        rng = np.random.default_rng(0)
        (tmp_path / "data").mkdir()
        np.save(tmp_path / "data" / "x.npy", rng.normal(size=(300, FEATURES)))
        np.save(tmp_path / "data" / "labels.npy", rng.integers(0, CLASSES, 300))
    session = tr_onnx.TrainingSession(str(model), backend="numpy", seed=0)
    kind, dtype = label_kind(session)
    train, val = split(*load(tmp_path / "data", session.imported.inputs, kind, dtype).data, 0.2)
    threads: list = []
    if in_memory:
        x = train[0]["x"][:].view(InMemory)
        x.threads = threads
        train = ({"x": x}, train[1])
    else:
        train = ({"x": ReadLog(train[0]["x"], threads, bad_row)}, train[1])
    trainer = Trainer(session, train, val, batch_size=16, epochs=2, log=None, progress=False)
    trainer.prefetch = prefetch
    trainer.fit()
    return session, threads


def test_prefetched_training_equals_reading_in_the_training_thread_bit_for_bit(tmp_path):
    threaded, read_by = trained(tmp_path, prefetch=2)
    unthreaded, read_by_unthreaded = trained(tmp_path, prefetch=0)
    main = threading.current_thread().name
    # per epoch: the first batch in the training thread (timed: 2 ms), the other 14 prefetched
    assert read_by == 2 * ([main] + 14 * ["tr_onnx-prefetch"])
    assert read_by_unthreaded == 30 * [main]
    a, b = threaded.parameters(), unthreaded.parameters()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert not prefetch_threads()


def test_arrays_in_memory_are_read_in_the_training_thread_a_copy_is_too_quick_to_hand_off(
        tmp_path, monkeypatch):
    # the read timed by a clock that moves 10 us per reading (a copy of rows in memory): a
    # real clock on a busy machine may pause the training thread past any threshold
    class Clock:
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 1e-5
            return self.now

    monkeypatch.setattr(prefetch_module, "time", Clock())
    _, read_by = trained(tmp_path, prefetch=2, in_memory=True)
    assert set(read_by) == {threading.current_thread().name}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_rows_read_error_surfaces_as_the_same_input_error(tmp_path, prefetch):
    with pytest.raises(InputError) as info:
        trained(tmp_path, prefetch, bad_row=99)
    assert str(info.value) == "x.npy: row 100 cannot be read"
    assert any(note.startswith("while reading epoch 1, batch ")
               for note in info.value.__notes__)
    assert not prefetch_threads()
