"""What every peer process of ``benchmarks/train.py`` shares: the job file, thread pinning, the
timed loop and the result file. Standard library only until ``pin_threads`` has run, because the
ORT-training peer imports it from a virtual environment of its own (numpy<2, no tr_onnx).

A peer is run as ``python benchmarks/peer_X.py JOB.json``; JOB.json is written by the driver
(model, data file, loss, optimizer, steps, threads, result path) and the peer writes its result
JSON (per-step ms, per-step losses, memory, or the error) to ``job["out"]``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def load_job() -> dict:
    """The job of this peer process (the JSON file named by the first argument)."""
    with open(sys.argv[1]) as f:
        return json.load(f)


def pin_threads(n: int) -> None:
    """Fix BLAS/OpenMP pools to ``n`` threads; they are sized when numpy/torch load, so this
    must run before either is imported."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)


def rss_mb() -> float:
    """Resident set size now, in MB (from /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_data(job: dict):
    """(inputs [steps, batch, ...] float32, labels [steps, batch(, classes)]) from the npz."""
    import numpy as np

    with np.load(job["data"]) as data:
        return data["x"], data["y"]


def timed_loop(step, xs, ys, warmup: int) -> tuple[list[float], list[float]]:
    """Call ``step(x, y) -> loss`` on every batch; return (ms of each step after ``warmup``,
    loss of every step)."""
    times, losses = [], []
    for i in range(len(xs)):
        start = time.perf_counter()
        loss = float(step(xs[i], ys[i]))
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= warmup:
            times.append(elapsed * 1e3)
    return times, losses


def run_peer(job: dict, body) -> None:
    """Run ``body(job, result)`` (which fills ``result``) and write the result file, also when
    it raises: then ``result["error"]`` holds the message (one line) for the driver's table,
    and the exception goes on to print its traceback into the peer's log."""
    result = {"ok": False, "rss_after_imports_mb": None}
    try:
        body(job, result)
        result["ok"] = True
    finally:
        exc = sys.exc_info()[1]
        if exc is not None:
            text = " ".join(str(exc).split()) or "(no message)"
            result["error"] = f"{type(exc).__name__}: {text}"
        result["peak_rss_mb"] = peak_rss_mb()
        with open(job["out"], "w") as f:
            json.dump(result, f)


def median(values: list[float]) -> float:
    """Median of ``values`` (the ms of the timed steps)."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

