"""What the benchmark scripts and every peer process of ``benchmarks/train.py`` share: the model
catalog, the job file, thread pinning, the OpenBLAS environment settings, the timed loop and the
result file. Standard library only until ``pin_threads`` has run, because the ORT-training peer
imports it from a virtual environment of its own (numpy<2, no tr_onnx), and because numpy reads
the thread and OpenBLAS variables once, when it loads.

A peer is run as ``python benchmarks/peer_X.py JOB.json``; JOB.json is written by the driver
(model, data file, loss, optimizer, steps, threads, result path) and the peer writes its result
JSON (per-step ms, per-step losses, memory, or the error) to ``job["out"]``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_models

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "model_zoo"
# per model: the input shape without the batch axis; zoo stems first, then bench_models' names
ZOO_SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16), "mobilenet": (3, 16, 16),
              "transformer": (8, 32)}
SHAPES = {**ZOO_SHAPES, **bench_models.SHAPES}
# the 64x64 CNNs and the encoder are ~100x the zoo models' work per sample
BENCH_BATCH, ZOO_BATCH = 8, 32
# OpenBLAS reads these when numpy loads. A machine may set them as a safety setting (a generic
# core type, a small L2 size) that makes current numpy's kernels slower than torch's own BLAS.
BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
BLAS_MODES = ("given", "unset", "both")
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


def default_batch(model: str) -> int:
    """The batch a model is benchmarked at unless ``--batch`` says otherwise."""
    return ZOO_BATCH if model in ZOO_SHAPES else BENCH_BATCH


def model_path(model: str, bench_dir: Path) -> Path:
    """The .onnx file of ``model``: the zoo's, or the export of ``bench_models`` in bench_dir."""
    return ZOO / f"{model}.onnx" if model in ZOO_SHAPES else Path(bench_dir) / f"{model}.onnx"


def check_models(models: list[str]) -> str | None:
    """Why ``models`` is not a valid model list, or None."""
    unknown = [m for m in models if m not in SHAPES]
    return f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(SHAPES)}" if unknown else None


def export_bench_models(models: list[str], out_dir: Path) -> None:
    """Export the bench_models among ``models`` into ``out_dir``, in a child process: the caller
    then never loads torch (its thread pools and memory stay those of a light driver)."""
    names = [m for m in models if m in bench_models.SHAPES]
    if not names:
        return
    proc = subprocess.run([sys.executable, bench_models.__file__, str(out_dir), *names],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"exporting {', '.join(names)} failed: {proc.stderr.strip()[-2000:]}")


def blas_given() -> dict[str, str | None]:
    """The OpenBLAS variables of this environment (None where unset)."""
    return {var: os.environ.get(var) for var in BLAS_VARS}


def blas_settings(mode: str) -> list[str]:
    """The OpenBLAS settings ``--blas-env mode`` runs: ``given`` (this environment), ``unset``
    (both variables removed), or both, except that both is one run when they are unset here:
    the two runs would be the same."""
    if mode != "both":
        return [mode]
    return ["given", "unset"] if any(v is not None for v in blas_given().values()) else ["given"]


def blas_line(mode: str) -> str:
    """One line for a benchmark's header: the variables' values and which settings run."""
    given = ", ".join(f"{k}={'unset' if v is None else v}" for k, v in blas_given().items())
    settings = blas_settings(mode)
    if mode == "both" and len(settings) == 1:
        return (f"OpenBLAS env: {given}; 'given' and 'unset' are the same setting here, "
                "so it runs once")
    return (f"OpenBLAS env: {given}; settings run: {', '.join(settings)} (unset: both variables "
            "removed in the benchmark processes only)")


def peer_env(setting: str, tr_onnx_tree: bool = True) -> dict[str, str]:
    """The environment of a benchmark process in OpenBLAS ``setting``. ``tr_onnx_tree``: put
    this checkout first on PYTHONPATH, so the tr_onnx measured is the one next to the benchmark,
    not whichever is installed; otherwise drop PYTHONPATH (the ORT venv must not see this
    python's packages)."""
    env = dict(os.environ)
    if setting == "unset":
        for var in BLAS_VARS:
            env.pop(var, None)
    if tr_onnx_tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    else:
        env.pop("PYTHONPATH", None)
    return env


def main_per_blas_setting(script: str, args, argv: list[str] | None, models: list[str],
                          measure) -> int:
    """The ``main`` of a script measured once per OpenBLAS setting (forward.py,
    profile_step.py): in a rerun (``--blas-setting`` given) ``measure(args)``; else export the
    bench models ``models`` needs once and rerun this script per setting of ``args.blas_env``.
    BLAS threads are pinned first: numpy loads in the export process and in the reruns."""
    pin_threads(args.threads)
    if args.blas_setting is not None:
        measure(args)
        return 0
    argv = sys.argv[1:] if argv is None else list(argv)
    with tempfile.TemporaryDirectory(prefix="tr_onnx_bench_") as tmp:
        export_bench_models(models, Path(tmp))
        return rerun_per_blas_setting(script, [*argv, "--bench-dir", tmp], args.blas_env)


def rerun_per_blas_setting(script: str, argv: list[str], mode: str) -> int:
    """Run ``script argv --blas-setting S`` once per OpenBLAS setting of ``mode``, each in a
    process whose environment has that setting (numpy reads it once, at import); the output goes
    straight through. Returns the first non-zero exit code, or 0."""
    print(blas_line(mode), flush=True)
    codes = []
    for setting in blas_settings(mode):
        print(f"\n## OpenBLAS env: {setting}\n", flush=True)
        codes.append(subprocess.run([sys.executable, script, *argv, "--blas-setting", setting],
                                    env=peer_env(setting), check=False).returncode)
    return next((c for c in codes if c), 0)


def blas_kernels() -> str:
    """The BLAS libraries loaded in this process as threadpoolctl sees them, e.g. ``openblas
    Haswell x2 (numpy.libs)``: the kernel OpenBLAS picked, its thread count and the folder of
    the library (numpy and scipy each bring an OpenBLAS of their own)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "? (no threadpoolctl)"
    libs = [f"{i['internal_api']} {i.get('architecture') or '?'} x{i['num_threads']} "
            f"({Path(i['filepath']).parent.name})"
            for i in threadpool_info() if i["user_api"] == "blas"]
    return ", ".join(libs) or "no BLAS loaded"


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
        result.setdefault("blas", blas_kernels())
        result["peak_rss_mb"] = peak_rss_mb()
        with open(job["out"], "w") as f:
            json.dump(result, f)


def median(values: list[float]) -> float:
    """Median of ``values`` (the ms of the timed steps)."""
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

