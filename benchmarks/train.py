"""Training time and memory of the model_zoo models: tr_onnx vs PyTorch eager (CPU) vs ONNX
Runtime training 1.19.2, same weights, same batches, same loss, optimizer and thread count.

    python benchmarks/train.py [--models mlp,resnet] [--batch 32] [--threads 2]
                               [--optimizer sgd|adamw] [--lr LR] [--loss cross_entropy|mse]
                               [--warmup 5] [--steps 30] [--peers tr_onnx,torch,ort]

Every peer trains in a process of its own (its peak RSS is then its own): tr_onnx and PyTorch
with this python, ORT training with ``benchmarks/.venv-ort/bin/python`` (``bash
benchmarks/setup_ort_training.sh`` makes it; without it that column says why it is empty).
Prints one markdown table per model: median (and min) ms per step over the timed steps,
tr_onnx's median over each peer's, peak RSS (and RSS after imports), the loss of the first and
last step and the largest loss difference from PyTorch over all steps. Step-1 losses should
agree to ~1e-5: all
three start from the same weights and see the same batch. A peer that cannot train a model gets
its error message in the table.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ZOO = ROOT / "model_zoo"
ORT_PYTHON = HERE / ".venv-ort" / "bin" / "python"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16), "mobilenet": (3, 16, 16),
          "transformer": (8, 32)}
CLASSES = 10  # every zoo model ends in a 10-way linear layer
PEERS = {"tr_onnx": "tr_onnx", "torch": "PyTorch eager", "ort": "ORT training"}
DEFAULT_LR = {"sgd": 0.01, "adamw": 1e-3}
ERROR_CHARS = 300  # an error longer than this is cut in the table (the log has all of it)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated zoo stems")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: " + ",".join(PEERS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, help="default 0.01 for sgd, 1e-3 for adamw")
    p.add_argument("--weight-decay", type=float, default=0.01, help="adamw only")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                   help="mse: float targets [batch, 10]")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per peer process")
    p.add_argument("--keep", type=Path, help="keep job files, results and logs in this folder")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.peers = [m for m in args.peers.split(",") if m]
    for name in args.models:
        if name not in SHAPES:
            p.error(f"unknown model {name!r}; the zoo has {', '.join(SHAPES)}")
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; valid: {', '.join(PEERS)}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    return args


def write_data(path: Path, model: str, args) -> None:
    """Seeded inputs and labels for every step, one file that all peers read."""
    import numpy as np

    rng = np.random.default_rng([args.seed, list(SHAPES).index(model)])
    n = args.warmup + args.steps
    x = rng.standard_normal((n, args.batch, *SHAPES[model]), dtype=np.float32)
    if args.loss == "cross_entropy":
        y = rng.integers(0, CLASSES, (n, args.batch), dtype=np.int64)
    else:
        y = rng.standard_normal((n, args.batch, CLASSES), dtype=np.float32)
    np.savez(path, x=x, y=y)


def ort_missing() -> str | None:
    """Why the ORT-training peer cannot run, or None."""
    if not ORT_PYTHON.exists():
        return f"no venv: run `bash {HERE.relative_to(ROOT)}/setup_ort_training.sh`"
    return None


def run_process(cmd: list[str], job: dict, work: Path, tag: str, timeout: float) -> dict:
    """Run one peer process on ``job``; its result dict (``error`` set on any failure)."""
    job_path, log_path = work / f"{tag}.job.json", work / f"{tag}.log"
    job = dict(job, out=str(work / f"{tag}.result.json"))
    job_path.write_text(json.dumps(job, indent=1))
    Path(job["out"]).unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the ORT venv must not see this python's packages
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([*cmd, str(job_path)], stdout=log, stderr=subprocess.STDOUT,
                                  cwd=ROOT, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s (log: {log_path})"}
    try:
        return json.loads(Path(job["out"]).read_text())
    except (OSError, ValueError):
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        return {"ok": False, "error": f"exit code {proc.returncode}: {tail[0]}"}


def run_peer(peer: str, job: dict, work: Path, args) -> dict:
    tag = f"{job['model']}.{peer}"
    if peer == "tr_onnx":
        return run_process([sys.executable, str(HERE / "peer_tr_onnx.py")], job, work, tag,
                           args.timeout)
    if peer == "torch":
        return run_process([sys.executable, str(HERE / "peer_torch.py")], job, work, tag,
                           args.timeout)
    reason = ort_missing()
    if reason:
        return {"ok": False, "error": f"skipped: {reason}"}
    cmd = [str(ORT_PYTHON), str(HERE / "peer_ort_training.py")]
    job = dict(job, artifacts=str(work / f"{job['model']}.ort_artifacts"))
    made = run_process(cmd, dict(job, phase="artifacts"), work, tag + ".artifacts", args.timeout)
    if not made["ok"]:
        return dict(made, error="generate_artifacts: " + made["error"])
    result = run_process(cmd, dict(job, phase="train"), work, tag, args.timeout)
    result["artifacts_s"] = made.get("artifacts_s")
    return result


def cell(text: str) -> str:
    """One markdown table cell: no pipes, no line breaks, not too long."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "…"


def fmt_ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def table(model: str, results: dict[str, dict], args) -> str:
    ok = {p: r for p, r in results.items() if r["ok"]}
    med = {p: peer_common.median(r["ms"]) for p, r in ok.items()}
    ref = ok.get("torch", {}).get("losses")
    n = args.warmup + args.steps
    header = (f"| peer | ms/step median (min) | tr_onnx / peer | peak RSS MB (after imports) | "
              f"loss step 1 | loss step {n} | max \\|Δloss\\| vs torch |")
    lines = [f"### {model} [{args.batch}, {', '.join(map(str, SHAPES[model]))}]", "", header,
             "|---|---|---|---|---|---|---|"]
    for peer, r in results.items():
        name = PEERS[peer] + (f" {r['version']}" if r.get("version") else "")
        if not r["ok"]:
            lines.append(f"| {name} | {cell(r['error'])} | – | – | – | – | – |")
            continue
        ratio = f"{med['tr_onnx'] / med[peer]:.2f}x" if "tr_onnx" in med else "–"
        after = r.get("rss_after_imports_mb")
        rss = f"{r['peak_rss_mb']:.0f}" + (f" ({after:.0f})" if after else "")
        losses = r["losses"]
        diff = (f"{max(abs(a - b) for a, b in zip(losses, ref)):.1e}"
                if ref and peer != "torch" else "–")
        ms = f"{fmt_ms(med[peer])} ({fmt_ms(min(r['ms']))})"
        lines.append(f"| {name} | {ms} | {ratio} | {rss} | {losses[0]:.6f} | {losses[-1]:.6f} | "
                     f"{diff} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    # numpy (used here only to write the data) gets the same thread count as the peers
    peer_common.pin_threads(args.threads)
    opt = (f"SGD lr {args.lr}" if args.optimizer == "sgd"
           else f"AdamW lr {args.lr} weight decay {args.weight_decay}")
    print(f"batch {args.batch}, {args.threads} threads, loss {args.loss}, {opt}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; each peer in its own process; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start\n")
    if "ort" in args.peers and ort_missing():
        print(f"ORT training column skipped: {ort_missing()} "
              "(downloads ~300 MB from PyPI, ~1 GB on disk)\n")
    with tempfile.TemporaryDirectory(prefix="tr_onnx_bench_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for model in args.models:
            data = work / f"{model}.data.npz"
            write_data(data, model, args)
            job = {"model": model, "model_path": str(ZOO / f"{model}.onnx"), "data": str(data),
                   "loss": args.loss, "optimizer": args.optimizer, "lr": args.lr,
                   "weight_decay": args.weight_decay, "threads": args.threads,
                   "warmup": args.warmup, "batch": args.batch}
            results = {peer: run_peer(peer, job, work, args) for peer in args.peers}
            print(table(model, results, args) + "\n", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end (other processes on these CPUs "
          "distort the times, most of all with more than one thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
