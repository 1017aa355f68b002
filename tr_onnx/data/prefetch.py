"""Batches made by one background thread while the training thread runs the step before them.

Reading a batch (a read from memory-mapped files, the decoding of images by a ``Rows``) then
overlaps the step, which spends its time in BLAS, NumPy ufuncs and device calls that release the
GIL. One thread, so that a ``Rows`` is read by one thread at a time and batches come in order; a
bounded queue, so that at most ``depth`` batches wait (plus the one being made).

The thread is used only for batches that take time to make: handing a batch from one thread to
another costs the waiting thread a wake-up (tens of microseconds on an idle machine, a
millisecond and more on a busy one: docs/benchmarks.md, "Data loading"), more than a copy of
rows out of memory takes. So the first batch, which the step waits for in any case, is made in
the training thread and timed; a thread makes the rest only if it took ``min_read_s`` or more.
(On the cuda backend a batch made in the training thread already overlaps the previous step,
which runs on the device while the host prepares the next.)"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_END = object()
_POLL_S = 0.05  # how often a producer waiting on a full queue checks whether it was stopped
MIN_READ_S = 1e-3


class Prefetcher:
    """``make(i)`` for each ``i`` of ``items``, in order, made ahead by a background thread
    where making the first took ``min_read_s`` or more (see the module docstring).

    Use as ``with Prefetcher(make, items) as batches: for i, batch in batches: ...``. An
    exception raised by ``make(i)`` is raised again, the same object, in the thread that
    iterates, when it reaches ``i``, with a note ``describe(i)`` naming the batch. Leaving the
    ``with`` block (the end, an error, Ctrl-C in the training thread) stops the thread and
    waits for it: no thread outlives the block. ``depth=0`` makes every batch in the iterating
    thread when it is reached (the same batches, no thread). ``threaded``: whether a thread
    made them. ``waits``: per batch taken, the seconds the iterating thread waited for it (the
    time it took to make it where the iterating thread made it); ``waited`` their sum.
    """

    def __init__(self, make: Callable[[Any], Any], items: Iterable, depth: int = 2,
                 describe: Callable[[Any], str] = lambda i: f"batch {i}",
                 min_read_s: float | None = None):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._make, self._items, self._depth, self._describe = make, list(items), depth, describe
        self._min_read_s = MIN_READ_S if min_read_s is None else min_read_s
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._entered = False
        self.threaded = False
        self.waits: list[float] = []

    @property
    def waited(self) -> float:
        return sum(self.waits)

    def __enter__(self) -> Prefetcher:
        self._entered = True
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread (after the batch it is making) and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _made(self, i):
        """``(i, batch, None)``, or ``(i, None, exception)`` noting which batch it was."""
        try:
            return i, self._make(i), None
        except BaseException as exc:  # Ctrl-C included: it belongs to the iterating thread
            exc.add_note(f"while reading {self._describe(i)}")
            return i, None, exc

    def _here(self, i):
        """Batch ``i`` made in the iterating thread, timed."""
        start = time.perf_counter()
        _, batch, exc = self._made(i)
        if exc is not None:
            raise exc
        self.waits.append(time.perf_counter() - start)  # the read is all waiting
        return batch

    def _produce(self, items: list) -> None:
        for i in items:
            if self._stop.is_set():
                return
            item = self._made(i)
            if not self._put(item) or item[2] is not None:
                return
        self._put(_END)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if not self._entered:
            raise RuntimeError("iterate a Prefetcher inside its with block")
        if not self._items:
            return
        first, rest = self._items[0], self._items[1:]
        batch = self._here(first)
        self.threaded = bool(self._depth and rest and self.waits[-1] >= self._min_read_s)
        if self.threaded:
            self._thread = threading.Thread(target=self._produce, args=(rest,),
                                            name="tr_onnx-prefetch", daemon=True)
            self._thread.start()
        yield first, batch
        if not self.threaded:
            for i in rest:
                yield i, self._here(i)
            return
        while True:
            start = time.perf_counter()
            item = self._queue.get()
            if item is _END:
                return
            self.waits.append(time.perf_counter() - start)
            i, batch, exc = item
            if exc is not None:
                raise exc
            yield i, batch
