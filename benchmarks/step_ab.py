"""A/B of tr_onnx's training step between variants, one process per variant and round.

    python benchmarks/step_ab.py --model transformer [--batch N] [--steps 100] [--rounds 3]
        --variant base= --variant no_onednn=TR_ONNX_NO_ONEDNN=1
        [--variant old=@/path/to/a/worktree] [--threads 2]

A variant is ``name=`` followed by environment settings (``VAR=value``, comma-separated) and/or
``@PATH``, a tr_onnx tree to import instead of this one (a ``git worktree`` of another commit).
Each round runs every variant in a fresh process, the variants taking turns (the VM's speed
drifts within a minute), and the table gives each variant's step-time percentiles over all
rounds and its median over the first variant's.

Why processes: two sessions in one process share NumPy's OpenBLAS and libgomp's thread pool,
so a change that stalls the pool (a BLAS call threaded for microseconds of work) slows the
other session as much as its own, and an in-process A/B reads 0.93x where one process per
variant reads 1.7x (2026-12-02: the zoo transformer with its sums as a ones-vector GEMV).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import peer_common
from peer_common import ROOT, SHAPES

CLASSES = 10
WORKER = """
import json, sys, time
from pathlib import Path
import numpy as np
import tr_onnx
spec = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.standard_normal([spec["batch"], *spec["shape"]]).astype(np.float32)
y = rng.integers(0, spec["classes"], spec["batch"])
session = tr_onnx.TrainingSession(spec["model"], loss="cross_entropy", optimizer="sgd")
times = []
for i in range(spec["warmup"] + spec["steps"]):
    start = time.perf_counter()
    session.train_step({"input": x}, y)
    if i >= spec["warmup"]:
        times.append((time.perf_counter() - start) * 1e3)
print(json.dumps({"times": times, "tr_onnx": str(Path(tr_onnx.__file__).parent)}))
"""


def parse_variant(text: str) -> tuple[str, dict[str, str], str | None]:
    """``name=VAR=value,VAR2=value,@PATH`` -> (name, environment, tree or None)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected name=[VAR=value,...][@PATH]")
    env, tree = {}, None
    for item in filter(None, rest.split(",")):
        if item.startswith("@"):
            tree = item[1:]
        elif "=" in item:
            key, value = item.split("=", 1)
            env[key] = value
        else:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {item!r} is not VAR=value or "
                                             f"@PATH")
    return name, env, tree


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=list(SHAPES))
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, default=100, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", action="append", type=parse_variant, required=True)
    args = p.parse_args(argv)
    if len({v[0] for v in args.variant}) != len(args.variant):
        p.error("variant names must differ")
    return args


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main(argv=None) -> int:
    args = parse_args(argv)
    batch = args.batch or peer_common.default_batch(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        path = peer_common.model_path(args.model, Path(tmp))
        if not path.exists():
            peer_common.export_bench_models([args.model], Path(tmp))
        spec = json.dumps({"model": str(path), "shape": list(SHAPES[args.model]),
                           "batch": batch, "steps": args.steps, "warmup": args.warmup,
                           "classes": CLASSES})
        times: dict[str, list[float]] = {name: [] for name, _, _ in args.variant}
        trees: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, env, tree in args.variant:
                run_env = dict(os.environ, **env)
                for var in peer_common.THREAD_VARS:
                    run_env[var] = str(args.threads)
                run_env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (tree or str(ROOT), os.environ.get("PYTHONPATH")) if p)
                # cwd: ``python -c`` puts it first on sys.path, before PYTHONPATH
                proc = subprocess.run([sys.executable, "-c", WORKER, spec], env=run_env,
                                      cwd=tmp, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return proc.returncode
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                times[name] += result["times"]
                trees[name] = result["tr_onnx"]
    base = peer_common.median(times[args.variant[0][0]])
    print(f"### {args.model} batch {batch}, {args.threads} threads, {args.rounds} rounds of "
          f"{args.warmup} + {args.steps} steps per variant, one process each\n")
    print("| variant | ms median | min | p25 | p75 | p90 | median / first "
          "| tr_onnx imported from |")
    print("|---|---|---|---|---|---|---|---|")
    for name, _, _ in args.variant:
        t = times[name]
        med = peer_common.median(t)
        print(f"| {name} | {med:.3f} | {min(t):.3f} | {percentile(t, 0.25):.3f} | "
              f"{percentile(t, 0.75):.3f} | {percentile(t, 0.9):.3f} | {med / base:.2f}x | "
              f"{trees[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
