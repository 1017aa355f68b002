"""Where one tr_onnx training step's time goes: per op type and in the executor's own Python.

    python benchmarks/profile_step.py --model resnet18 [--batch N] [--threads 2] [--steps 10]
                                      [--warmup 2] [--noop-repeat 200]
                                      [--blas-env given|unset|both]

For one model (a zoo stem or a bench_models name, at ``train.py``'s default batch) a
``TrainingSession`` (SGD lr 0.01, cross_entropy) warms up, then the script prints markdown tables:

* the median ``train_step`` time;
* per op type (the op of each bound step's label): ms per step, calls per step and µs per call
  (each bound step's median over ``--steps`` steps), and the µs per call at batch 1, an estimate
  of the call's fixed cost;
* the executor's own Python per kernel call: ``executor.run()`` with every bound step's kernel
  replaced by a no-op (the same loop: pad zeroing, the call, the error guard), over the number of
  bound steps; and ``train_step`` with no-op kernels (feeds, labels, loss read-back as well).

Each OpenBLAS setting (``--blas-env``, as in ``train.py``) runs in a process of its own.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings

import peer_common
from peer_common import SHAPES, median

CLASSES = 10
# "node '/x/Conv' (Conv, ai.onnx v11)": the op type is the first item of the last brackets
OP_TYPE = re.compile(r"\((\w+), [^()]*\)$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=list(SHAPES))
    p.add_argument("--batch", type=int, help=f"default {peer_common.ZOO_BATCH} for zoo models, "
                   f"{peer_common.BENCH_BATCH} for the others")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps (medians over these)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--noop-repeat", type=int, default=200,
                   help="executor runs with no-op kernels")
    p.add_argument("--blas-env", choices=peer_common.BLAS_MODES, default="both",
                   help="OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given, unset, or both runs")
    # set by the parent process for the run of one OpenBLAS setting
    p.add_argument("--blas-setting", help=argparse.SUPPRESS)
    p.add_argument("--bench-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def op_type(label: str) -> str:
    """The op type in a bound step's label (the whole label if it has none)."""
    found = OP_TYPE.search(label)
    return found.group(1) if found else label


def batch_of(model: str, batch: int):
    """(feed, labels) of one seeded batch."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *SHAPES[model]), dtype=np.float32)
    return {"input": x}, rng.integers(0, CLASSES, batch, dtype=np.int64)


def step_ms(session, feed, labels, steps: int) -> list[float]:
    """ms of each of ``steps`` train steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.train_step(feed, labels)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _noop(ins, outs, ws) -> None:
    return None


def _timed(run, times: list):
    def timed_run(ins, outs, ws):
        start = time.perf_counter()
        run(ins, outs, ws)
        times.append(time.perf_counter() - start)
    return timed_run


def per_op(session, feed, labels, steps: int) -> dict[str, tuple[float, float]]:
    """op type -> (ms per step, calls per step) over ``steps`` train steps, each bound step
    counted at its median time. The session's active plan must be the one of ``feed``."""
    bound = session._state.active.executor.steps
    runs = [s.run for s in bound]
    times: list[list[float]] = [[] for _ in bound]
    for s, t in zip(bound, times):
        s.run = _timed(s.run, t)
    try:
        for _ in range(steps):
            session.train_step(feed, labels)
    finally:
        for s, run in zip(bound, runs):
            s.run = run
    ops: dict[str, tuple[float, float]] = {}
    for s, t in zip(bound, times):
        if t:
            ms, calls = ops.get(op_type(s.label), (0.0, 0.0))
            ops[op_type(s.label)] = (ms + median(t) * 1e3 * len(t) / steps,
                                     calls + len(t) / steps)
    return ops


def noop_kernels(session, feed, labels, repeat: int) -> tuple[float, float]:
    """(µs of the executor's loop per bound step, ms of a train_step) with every kernel a no-op:
    what is left is the Python around the kernels."""
    executor = session._state.active.executor
    runs = [s.run for s in executor.steps]
    for s in executor.steps:
        s.run = _noop
    try:
        loop = []
        for _ in range(repeat):
            start = time.perf_counter()
            executor.run()
            loop.append(time.perf_counter() - start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the arena holds stale values: no finite checks
            step = step_ms(session, feed, labels, max(10, repeat // 10))
    finally:
        for s, run in zip(executor.steps, runs):
            s.run = run
    return median(loop) * 1e6 / len(executor.steps), median(step)


def measure(args) -> None:
    """The tables of one OpenBLAS setting (this process's environment)."""
    import tr_onnx

    batch = args.batch or peer_common.default_batch(args.model)
    path = peer_common.model_path(args.model, args.bench_dir)
    session = tr_onnx.TrainingSession(path, loss="cross_entropy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.01))
    feed, labels = batch_of(args.model, batch)
    step_ms(session, feed, labels, args.warmup)
    ms = step_ms(session, feed, labels, args.steps)
    ops = per_op(session, feed, labels, args.steps)
    n_bound = len(session._state.active.executor.steps)
    loop_us, noop_step_ms = noop_kernels(session, feed, labels, args.noop_repeat)
    feed1, labels1 = batch_of(args.model, 1)
    step_ms(session, feed1, labels1, args.warmup)
    ops1 = per_op(session, feed1, labels1, args.steps)

    kernels_ms = sum(t for t, _ in ops.values())
    print(f"### {args.model} [{batch}, {', '.join(map(str, SHAPES[args.model]))}], "
          f"{args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps; "
          f"BLAS: {peer_common.blas_kernels()}\n")
    print("| measure | value |\n|---|---|")
    print(f"| train_step, ms median (min) | {median(ms):.2f} ({min(ms):.2f}) |")
    print(f"| kernels, ms per step (sum of per-call medians) | {kernels_ms:.2f} |")
    print(f"| bound steps (kernel calls) per executor run | {n_bound} |")
    print(f"| executor Python per kernel call, µs (no-op kernels, median of "
          f"{args.noop_repeat} runs) | {loop_us:.2f} |")
    print(f"| executor Python per step, ms | {loop_us * n_bound / 1e3:.2f} |")
    print(f"| train_step with no-op kernels, ms | {noop_step_ms:.2f} |\n")
    print("| op type | ms/step | % of kernels | calls/step | µs/call | µs/call at batch 1 |")
    print("|---|---|---|---|---|---|")
    for op, (t, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0]):
        t1, calls1 = ops1.get(op, (0.0, 0.0))
        at1 = f"{t1 * 1e3 / calls1:.1f}" if calls1 else "–"
        print(f"| {op} | {t:.3f} | {100 * t / kernels_ms:.1f} | {calls:g} | "
              f"{t * 1e3 / calls:.1f} | {at1} |")
    print(flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    return peer_common.main_per_blas_setting(__file__, args, argv, [args.model], measure)


if __name__ == "__main__":
    sys.exit(main())
