"""Forward (inference) time of the model_zoo models and of bench_models' ResNet-18, MobileNetV2
(64x64) and BERT-shaped encoder: tr_onnx numpy backend vs onnxruntime CPU, same model, same
batch, same thread count. Prints a markdown table of median ms per run and the ratio, once per
OpenBLAS setting (``--blas-env``, as in ``train.py``). Training benchmarks are in ``train.py``.

    python benchmarks/forward.py [--models mlp,bert] [--batch N] [--threads 2] [--repeat N]
                                 [--blas-env given|unset|both]

Each OpenBLAS setting runs in a process of its own (this script again, with ``--blas-setting``),
because numpy reads the variables once, when it loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import peer_common
from peer_common import SHAPES, ZOO_SHAPES

# a bench model's forward takes ~100x a zoo model's
ZOO_REPEAT, BENCH_REPEAT = 400, 20
ROUNDS = 10
IDLE_S = 0.2  # long enough for spinning pool threads to go to sleep
# untimed calls before each block: at least WARM_CALLS, and for WARM_S. After the pause both
# runtimes' first calls are slow (zoo MLP, median over 20 blocks, 2-core Zen 3 VM, 2026-12-02:
# ours 0.097 ms for calls 1-5, 0.085 for 11-20, 0.073 from the 40th on; onnxruntime's 0.067,
# 0.061, 0.059), so blocks of a dozen calls after 3 untimed ones timed mostly the warming-up
WARM_CALLS, WARM_S = 3, 0.005


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES),
                   help="comma-separated zoo stems and bench_models names")
    p.add_argument("--batch", type=int, help=f"default {peer_common.ZOO_BATCH} for zoo models, "
                   f"{peer_common.BENCH_BATCH} for the others")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, help=f"timed runs; default {ZOO_REPEAT} for zoo models, "
                   f"{BENCH_REPEAT} for the others")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="blocks per runtime, taking turns (each a share of --repeat)")
    p.add_argument("--blas-env", choices=peer_common.BLAS_MODES, default="both",
                   help="OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given, unset, or both runs")
    # set by the parent process for the run of one OpenBLAS setting
    p.add_argument("--blas-setting", help=argparse.SUPPRESS)
    p.add_argument("--bench-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    args.models = [m for m in args.models.split(",") if m]
    if peer_common.check_models(args.models):
        p.error(peer_common.check_models(args.models))
    return args


def interleaved_blocks_ms(fns, repeat: int, rounds: int = ROUNDS) -> list[list[list[float]]]:
    """ms of each call of each of ``fns``, per block: ``repeat`` timed calls each, made in
    ``rounds`` blocks that take turns (each block after untimed calls: ``WARM_CALLS``, and
    for ``WARM_S``); ``[fn][block]``. On a shared VM the machine's speed drifts by up to 2x
    between seconds; timing all of one
    runtime's calls and then all of the other's would put that drift into the ratio. Blocks,
    not single calls, and an idle pause before each: a runtime's threads spin for a while after
    its call (onnxruntime's by default), and on 2 cores they slowed the next runtime's calls by
    up to 2x (MobileNetV2: 15.7 ms right after onnxruntime's calls, 7.6 ms alone)."""
    times = [[[] for _ in range(rounds)] for _ in fns]
    for r in range(rounds):
        for fn, blocks in zip(fns, times):
            time.sleep(IDLE_S)
            warm_until, calls = time.perf_counter() + WARM_S, 0
            while calls < WARM_CALLS or time.perf_counter() < warm_until:
                fn()
                calls += 1
            for _ in range(repeat // rounds + (r < repeat % rounds)):
                start = time.perf_counter()
                fn()
                blocks[r].append((time.perf_counter() - start) * 1e3)
    return times


def paired_ratios(ours: list[list[float]], theirs: list[list[float]]) -> list[float]:
    """Per round, the median of our block over the median of theirs (blocks of the same round
    run seconds apart, so the VM's drift between rounds cancels in each ratio); rounds
    without timed calls are left out."""
    return [peer_common.median(a) / peer_common.median(b)
            for a, b in zip(ours, theirs) if a and b]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile), each a median of a half for the quartiles."""
    s = sorted(values)
    half = len(s) // 2
    low, high = (s[:half], s[half + len(s) % 2:]) if half else (s, s)
    return peer_common.median(low), peer_common.median(s), peer_common.median(high)


def measure(args) -> None:
    """The table of one OpenBLAS setting (this process's environment)."""
    import numpy as np
    import onnxruntime as ort

    import tr_onnx

    print(f"{args.threads} threads, median of --repeat runs, in {args.rounds} blocks per "
          f"runtime taking turns (untimed calls for {WARM_S * 1e3:g} ms, at least "
          f"{WARM_CALLS}, before each); the last column: align 1's "
          f"block median over onnxruntime's in the same round, the median and quartiles of "
          f"those {args.rounds} ratios; onnxruntime "
          f"{ort.__version__}; numpy's BLAS: {peer_common.blas_kernels()}\n")
    print("| model | batch | runs | tr_onnx align 1 (ms) | tr_onnx align 8 (ms) | "
          "onnxruntime (ms) | tr_onnx / ORT | per block: median (quartiles) |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        path = peer_common.model_path(model, args.bench_dir)
        batch = args.batch or peer_common.default_batch(model)
        repeat = args.repeat or (ZOO_REPEAT if model in ZOO_SHAPES else BENCH_REPEAT)
        feed = {"input": np.random.default_rng(0).standard_normal(
            (batch, *SHAPES[model])).astype(np.float32)}
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        ref = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        sessions = [tr_onnx.InferenceSession(path, channel_align=align) for align in (1, 8)]
        runs = [partial(sess.run, None, feed) for sess in (*sessions, ref)]
        blocks = interleaved_blocks_ms(runs, repeat, args.rounds)
        *ours, t_ort = [peer_common.median([t for b in fn for t in b]) for fn in blocks]
        low, mid, high = quartiles(paired_ratios(blocks[0], blocks[2]))
        # 4 significant digits: a zoo model's run is ~0.01-0.02 ms on a fast machine, where 3
        # decimals would round the times by up to 5% and the ratio would not follow from them
        print(f"| {model} | {batch} | {repeat} | {ours[0]:.4g} | {ours[1]:.4g} | {t_ort:.4g} | "
              f"{ours[0] / t_ort:.2f}x | {mid:.2f}x ({low:.2f}-{high:.2f}) |", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    return peer_common.main_per_blas_setting(__file__, args, argv, args.models, measure)


if __name__ == "__main__":
    sys.exit(main())
