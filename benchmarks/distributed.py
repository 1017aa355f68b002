"""Data-parallel training: step time and all-reduce time at 1 and 2 ranks on this machine, and
the scaling expected on paper for ResNet-50 on 8 H200s (and beyond one machine).

    python benchmarks/distributed.py [--models mlp,lenet,resnet] [--batch 16] [--steps 20]
                                     [--warmup 3] [--ranks 1,2] [--json OUT.json]

The driver runs one worker per rank count (``mpiexec -n R python benchmarks/distributed.py
--worker``; one rank runs without mpiexec). Each worker, per model_zoo model: the median ms of a
training step with ``--batch`` rows per rank (``TrainingSession(..., distributed=world)`` when
the session takes a world, else a single-process step, said in the table) and the median ms of
one MPI all-reduce (mean, in place) of a float32 buffer the size of the plan's GRAD region, the
bytes every step moves. Then the paper table: ring all-reduce moves 2(N-1)/N of the gradient
bytes per GPU over the slowest link of the ring; the bucketed all-reduce overlaps the backward
pass, so only what outlasts it (at least the last bucket) adds to the step. Every assumption
is printed with the table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ZOO = ROOT / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16)}
CLASSES = 10  # every zoo model ends in a 10-way linear layer

# -- the paper model: ResNet-50 on H200s (each figure is printed with the table) ---------------
PAPER = {
    "params": 25.6e6,  # ResNet-50 (torchvision): 25,557,032 parameters
    "grad_bytes_per_param": 4,  # fp32 gradients (master weights; a bf16 all-reduce halves it)
    "nvlink_GBps": 450.0,  # NVLink 4 on an HGX H200: 900 GB/s bidirectional per GPU
    "ib_GBps": 50.0,  # InfiniBand NDR 400 Gb/s, one NIC per GPU, per direction
    "link_efficiency": 0.8,  # what NCCL's ring reaches of a link's peak (large messages)
    "images_per_s_1gpu": 3000.0,  # bf16 ResNet-50 training on one H200 (MLPerf-class; assumed)
    "batch_per_gpu": 256,
    "backward_share": 2 / 3,  # of the step: the all-reduce can hide behind this much
    "bucket_MB": 25.0,  # PyTorch DDP's default bucket: the last one cannot overlap
    "gpus_per_machine": 8,
}


def paper_rows(p: dict = PAPER, gpu_counts=(1, 2, 4, 8, 16, 32, 64)) -> list[dict]:
    """The expected scaling of ResNet-50 data parallelism over ``gpu_counts`` GPUs."""
    grad_bytes = p["params"] * p["grad_bytes_per_param"]
    step_s = p["batch_per_gpu"] / p["images_per_s_1gpu"]
    rows = []
    for n in gpu_counts:
        inside = n <= p["gpus_per_machine"]
        link = (p["nvlink_GBps"] if inside else p["ib_GBps"]) * p["link_efficiency"] * 1e9
        moved = 2 * (n - 1) / n * grad_bytes  # per GPU, ring all-reduce
        comm_s = moved / link if n > 1 else 0.0
        last_bucket_s = (2 * (n - 1) / n * min(p["bucket_MB"] * 1e6, grad_bytes) / link
                         if n > 1 else 0.0)
        exposed_s = max(comm_s - p["backward_share"] * step_s, last_bucket_s)
        total_s = step_s + exposed_s
        rows.append({"gpus": n, "link": "-" if n == 1 else ("NVLink" if inside else "IB NDR"),
                     "moved_MB": moved / 1e6, "allreduce_ms": comm_s * 1e3,
                     "exposed_ms": exposed_s * 1e3, "step_ms": total_s * 1e3,
                     "images_per_s": n * p["batch_per_gpu"] / total_s,
                     "efficiency": step_s / total_s})
    return rows


def paper_table(p: dict = PAPER) -> str:
    grad_mb = p["params"] * p["grad_bytes_per_param"] / 1e6
    lines = [
        f"ResNet-50 on H200s, on paper: {p['params'] / 1e6:.1f}M parameters -> {grad_mb:.1f} MB "
        f"of fp32 gradients per step; ring all-reduce moves 2(N-1)/N of that per GPU.",
        "Assumptions: " + "; ".join([
            f"NVLink 4 {p['nvlink_GBps']:.0f} GB/s per direction per GPU (900 GB/s "
            f"bidirectional) inside a machine of {p['gpus_per_machine']}",
            f"InfiniBand NDR 400 Gb/s = {p['ib_GBps']:.0f} GB/s per direction, one NIC per GPU, "
            "bounds the ring across machines",
            f"NCCL reaches {p['link_efficiency']:.0%} of a link",
            f"{p['images_per_s_1gpu']:.0f} images/s on one H200 at batch {p['batch_per_gpu']} "
            "(bf16; assumed, not measured here)",
            f"the all-reduce overlaps the backward ({p['backward_share']:.0%} of the step) "
            f"except the last {p['bucket_MB']:.0f} MB bucket"]) + ".",
        "",
        "| GPUs | link | MB moved per GPU | all-reduce ms | exposed ms | step ms | images/s "
        "| scaling efficiency |",
        "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in paper_rows(p):
        lines.append(f"| {r['gpus']} | {r['link']} | {r['moved_MB']:.1f} | "
                     f"{r['allreduce_ms']:.2f} | {r['exposed_ms']:.2f} | {r['step_ms']:.1f} | "
                     f"{r['images_per_s']:,.0f} | {r['efficiency']:.1%} |")
    return "\n".join(lines)


# -- the worker: one process per rank ----------------------------------------------------------

def _slowest(world, value: float) -> float:
    """The largest ``value`` over the ranks (through sums: the world has no max)."""
    values = np.zeros(world.size)
    values[world.rank] = value
    return float(max(world.allreduce_scalars(list(values))))


def worker(args) -> tuple[int, dict]:
    """This rank's measurements (every rank's slowest), with its rank."""
    from tr_onnx import TrainingSession, distributed
    from tr_onnx.memory import Region

    world = distributed.init()
    takes_world = "distributed" in inspect.signature(TrainingSession.__init__).parameters
    out = {"ranks": world.size, "session_takes_world": takes_world, "models": {}}
    for stem in args.models:
        rng = np.random.default_rng(world.rank)
        x = rng.standard_normal((args.batch, *SHAPES[stem])).astype(np.float32)
        y = np.arange(args.batch) % CLASSES
        kw = {"distributed": world} if takes_world else {}
        sess = TrainingSession(ZOO / f"{stem}.onnx", optimizer="sgd", **kw)
        sess.train_step({"input": x}, y)
        grad_bytes = int(sess._state.active.memory.regions[Region.GRAD][1])

        def step(sess=sess, x=x, y=y):
            sess.train_step({"input": x}, y)

        grads = np.ones(grad_bytes // 4, np.float32)

        def allreduce(grads=grads):
            world.allreduce_mean_(grads)

        out["models"][stem] = {
            "grad_bytes": grad_bytes,
            "step_ms": _slowest(world, _timed(step, args.warmup, args.steps, world)),
            "allreduce_ms": _slowest(world, _timed(allreduce, args.warmup, args.steps, world))}
    return world.rank, out


def _timed(fn, warmup: int, steps: int, world) -> float:
    """Median ms of ``fn`` over ``steps`` calls after ``warmup``, every rank starting each call
    together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        world.barrier()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


# -- the driver ----------------------------------------------------------------------------------

def run_ranks(ranks: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tr_onnx_dist_bench_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result),
               "--models", ",".join(args.models), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        if ranks > 1:
            # the mpich wheel installs mpiexec beside the interpreter, which need not be on PATH
            mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or \
                shutil.which("mpiexec")
            if mpiexec is None:
                return {"error": "no mpiexec on PATH (pip install mpich mpi4py)"}
            cmd = [mpiexec, "-n", str(ranks), *cmd]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode != 0 or not result.exists():
            return {"error": f"rc {done.returncode}: {(done.stderr or done.stdout)[-600:]}"}
        return json.loads(result.read_text())


def measured_table(results: dict[int, dict], args) -> str:
    ranks = sorted(results)
    head = "| model | GRAD bytes per step | " + " | ".join(
        f"step ms ({r} rank{'s' if r > 1 else ''}) | all-reduce ms ({r})" for r in ranks) + " |"
    lines = [f"Measured here: {os.cpu_count()} CPU cores, batch {args.batch} per rank, median "
             f"of {args.steps} steps after {args.warmup}, 1 thread per rank; the numpy "
             "backend, MPI (mpi4py) all-reduce of a float32 buffer of the GRAD region's size.",
             "", head, "|---|---:|" + "---:|---:|" * len(ranks)]
    for stem in args.models:
        cells, grad = [], ""
        for r in ranks:
            res = results[r]
            if "error" in res:
                cells += [res["error"].replace("\n", " ").replace("|", "/")[:120], ""]
                continue
            m = res["models"][stem]
            grad = f"{m['grad_bytes']:,}"
            cells += [f"{m['step_ms']:.2f}", f"{m['allreduce_ms']:.3f}" if r > 1 else "-"]
        lines.append(f"| {stem} | {grad} | " + " | ".join(cells) + " |")
    if any("error" not in res and not res["session_takes_world"] for res in results.values()):
        lines.append("\nThe TrainingSession here takes no `distributed=` world yet: the step "
                     "times are single-process steps on each rank, and the all-reduce of the "
                     "GRAD-sized buffer is timed alone.")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated zoo stems")
    p.add_argument("--batch", type=int, default=16, help="rows per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--timeout", type=float, default=600, help="seconds per rank count")
    p.add_argument("--json", type=Path, help="also write every number here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--paper-only", action="store_true", help="print the paper table only")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.ranks = [int(r) for r in str(args.ranks).split(",") if r]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        rank, out = worker(args)
        if rank == 0:
            args.result.write_text(json.dumps(out))
        return 0
    results = {} if args.paper_only else {r: run_ranks(r, args) for r in args.ranks}
    if results:
        print(measured_table(results, args))
        print()
    print(paper_table())
    if args.json:
        args.json.write_text(json.dumps({"measured": {str(k): v for k, v in results.items()},
                                         "paper": {"assumptions": PAPER,
                                                   "rows": paper_rows()}}, indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
