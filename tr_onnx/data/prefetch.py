"""Batches made by one background thread while the training thread runs the step before them.

Reading a batch (``arrays[k][idx]``: a copy out of memory, a read from memory-mapped files, the
decoding of images by a ``Rows``) overlaps the step, which spends its time in BLAS, NumPy ufuncs
and device calls that release the GIL. One thread, so that a ``Rows`` is read by one thread at a
time and batches come in order; a bounded queue, so that at most ``depth`` batches wait (plus
the one being made)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_END = object()
_POLL_S = 0.05  # how often a producer waiting on a full queue checks whether it was stopped


class Prefetcher:
    """``make(i)`` for each ``i`` of ``items``, in order, made ahead by a background thread.

    Use as ``with Prefetcher(make, items) as batches: for i, batch in batches: ...``. An
    exception raised by ``make(i)`` is raised again, the same object, in the thread that
    iterates, when it reaches ``i``, with a note ``describe(i)`` naming the batch. Leaving the
    ``with`` block (the end, an error, Ctrl-C in the training thread) stops the thread and
    waits for it: no thread outlives the block. ``depth=0`` makes each batch in the iterating
    thread when it is reached (the same batches, no thread). ``waits``: per batch taken, the
    seconds the iterating thread waited for it (depth 0: the time it took to make it);
    ``waited`` their sum.
    """

    def __init__(self, make: Callable[[Any], Any], items: Iterable, depth: int = 2,
                 describe: Callable[[Any], str] = lambda i: f"batch {i}"):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._make, self._items, self._depth, self._describe = make, list(items), depth, describe
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.waits: list[float] = []

    @property
    def waited(self) -> float:
        return sum(self.waits)

    def __enter__(self) -> Prefetcher:
        if self._depth:
            self._thread = threading.Thread(target=self._produce, name="tr_onnx-prefetch",
                                            daemon=True)
            self._thread.start()
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

    def _produce(self) -> None:
        for i in self._items:
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
        if not self._depth:
            for i in self._items:
                start = time.perf_counter()
                _, batch, exc = self._made(i)
                if exc is not None:
                    raise exc
                self.waits.append(time.perf_counter() - start)  # the read is all waiting
                yield i, batch
            return
        if self._thread is None:
            raise RuntimeError("iterate a Prefetcher inside its with block")
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
