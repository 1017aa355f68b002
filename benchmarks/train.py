"""Training time and memory of the model_zoo models and of bench_models' ResNet-18, MobileNetV2
(64x64) and BERT-shaped encoder: tr_onnx vs PyTorch eager (CPU) vs ONNX Runtime training 1.19.2,
same weights, same batches, same loss, optimizer and thread count.

    python benchmarks/train.py [--models mlp,resnet18] [--batch N] [--threads 2]
                               [--optimizer sgd|adamw] [--lr LR] [--loss cross_entropy|mse]
                               [--warmup N] [--steps N] [--peers tr_onnx,torch,ort]
                               [--rounds 2] [--blas-env given|unset|both]

Every peer trains in a process of its own (its peak RSS is then its own), ``--rounds`` times,
the peers taking turns (their timed steps pooled): tr_onnx and PyTorch
with this python, ORT training with ``benchmarks/.venv-ort/bin/python`` (``bash
benchmarks/setup_ort_training.sh`` makes it; without it that column says why it is empty).
Prints one markdown table per model: median (and min) ms per step over the timed steps,
tr_onnx's median over each peer's (within one OpenBLAS setting), peak RSS (and RSS after
imports), the loss of the first and last step, the largest loss difference from PyTorch over all
steps and the BLAS kernel the peer ran. Step-1 losses should agree to ~1e-5: all three start from
the same weights and see the same batch (later steps drift apart in deep ReLU networks, see
benchmarks/README.md). A peer that cannot train a model gets its error message
in the table. Every model/peer runs once per OpenBLAS setting (``--blas-env``): with
OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given and with both unset (in the peers' environment only).
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
from peer_common import ROOT, SHAPES, ZOO_SHAPES

HERE = Path(__file__).resolve().parent
ORT_PYTHON = HERE / ".venv-ort" / "bin" / "python"
# (warm-up, timed) steps: a bench model's step takes ~100x a zoo model's
ZOO_STEPS, BENCH_STEPS = (5, 30), (2, 10)
CLASSES = 10  # every zoo model ends in a 10-way linear layer
PEERS = {"tr_onnx": "tr_onnx", "torch": "PyTorch eager", "ort": "ORT training"}
DEFAULT_LR = {"sgd": 0.01, "adamw": 1e-3}
ERROR_CHARS = 300  # an error longer than this is cut in the table (the log has all of it)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES),
                   help="comma-separated zoo stems and bench_models names")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: " + ",".join(PEERS))
    p.add_argument("--batch", type=int, help=f"default {peer_common.ZOO_BATCH} for zoo models, "
                   f"{peer_common.BENCH_BATCH} for the others")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, help="default 0.01 for sgd, 1e-3 for adamw")
    p.add_argument("--weight-decay", type=float, default=0.01, help="adamw only")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                   help="mse: float targets [batch, 10]")
    p.add_argument("--warmup", type=int, help=f"untimed steps; default {ZOO_STEPS[0]} for zoo "
                   f"models, {BENCH_STEPS[0]} for the others")
    p.add_argument("--steps", type=int, help=f"timed steps; default {ZOO_STEPS[1]} for zoo "
                   f"models, {BENCH_STEPS[1]} for the others")
    p.add_argument("--blas-env", choices=peer_common.BLAS_MODES, default="both",
                   help="OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given, unset, or both runs")
    p.add_argument("--rounds", type=int, default=2,
                   help="processes per peer, taking turns (the machine's speed drifts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per peer process")
    p.add_argument("--keep", type=Path, help="keep job files, results and logs in this folder")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.peers = [m for m in args.peers.split(",") if m]
    if peer_common.check_models(args.models):
        p.error(peer_common.check_models(args.models))
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; valid: {', '.join(PEERS)}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    return args


def plan_of(model: str, args) -> dict:
    """Batch, warm-up and timed steps of ``model``: the per-model defaults unless given."""
    warmup, steps = ZOO_STEPS if model in ZOO_SHAPES else BENCH_STEPS
    return {"batch": args.batch or peer_common.default_batch(model),
            "warmup": warmup if args.warmup is None else args.warmup,
            "steps": steps if args.steps is None else args.steps, "rounds": args.rounds}


def write_data(path: Path, model: str, plan: dict, args) -> None:
    """Seeded inputs and labels for every step, one file that all peers read."""
    import numpy as np

    rng = np.random.default_rng([args.seed, list(SHAPES).index(model)])
    n, batch = plan["warmup"] + plan["steps"], plan["batch"]
    x = rng.standard_normal((n, batch, *SHAPES[model]), dtype=np.float32)
    if args.loss == "cross_entropy":
        y = rng.integers(0, CLASSES, (n, batch), dtype=np.int64)
    else:
        y = rng.standard_normal((n, batch, CLASSES), dtype=np.float32)
    np.savez(path, x=x, y=y)


def ort_missing() -> str | None:
    """Why the ORT-training peer cannot run, or None."""
    if not ORT_PYTHON.exists():
        return f"no venv: run `bash {HERE.relative_to(ROOT)}/setup_ort_training.sh`"
    return None


def run_process(cmd: list[str], job: dict, work: Path, tag: str, timeout: float,
                env: dict[str, str]) -> dict:
    """Run one peer process on ``job`` in ``env``; its result dict (``error`` set on any
    failure)."""
    job_path, log_path = work / f"{tag}.job.json", work / f"{tag}.log"
    job = dict(job, out=str(work / f"{tag}.result.json"))
    job_path.write_text(json.dumps(job, indent=1))
    Path(job["out"]).unlink(missing_ok=True)
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


def run_peer(peer: str, job: dict, work: Path, args, setting: str, round_index: int = 0) -> dict:
    """Train ``job`` with ``peer`` in OpenBLAS ``setting``; the peer's result dict."""
    tag = f"{job['model']}.{setting}.{peer}.{round_index}"
    if peer in ("tr_onnx", "torch"):
        return run_process([sys.executable, str(HERE / f"peer_{peer}.py")], job, work, tag,
                           args.timeout, peer_common.peer_env(setting))
    reason = ort_missing()
    if reason:
        return {"ok": False, "error": f"skipped: {reason}"}
    cmd = [str(ORT_PYTHON), str(HERE / "peer_ort_training.py")]
    env = peer_common.peer_env(setting, tr_onnx_tree=False)
    job = dict(job, artifacts=str(work / f"{job['model']}.{setting}.ort_artifacts"))
    made = run_process(cmd, dict(job, phase="artifacts"), work, tag + ".artifacts", args.timeout,
                       env)
    if not made["ok"]:
        return dict(made, error="generate_artifacts: " + made["error"])
    result = run_process(cmd, dict(job, phase="train"), work, tag, args.timeout, env)
    result["artifacts_s"] = made.get("artifacts_s")
    return result


def run_rounds(job: dict, work: Path, args, setting: str) -> dict[str, dict]:
    """Each peer's result over ``args.rounds`` processes that take turns (peer 1, peer 2, ...,
    peer 1, ...): this shared VM's speed drifts by up to 2x over minutes, and one process per
    peer put that drift into the ratio (PyTorch's zoo resnet: 18.1 then 11.7 ms). The timed
    steps of all rounds pool into one median; peak RSS is the largest; losses are round 1's
    (every round trains the same steps from the same weights)."""
    rounds = {peer: [] for peer in args.peers}
    for index in range(args.rounds):
        for peer in args.peers:
            if index and not rounds[peer][0]["ok"]:
                continue  # a peer that cannot train the model fails the same way again
            rounds[peer].append(run_peer(peer, job, work, args, setting, index))
    merged = {}
    for peer, results in rounds.items():
        failed = [r for r in results if not r["ok"]]
        merged[peer] = failed[0] if failed else dict(
            results[0], ms=[ms for r in results for ms in r["ms"]],
            peak_rss_mb=max(r["peak_rss_mb"] for r in results))
    return merged


def cell(text: str) -> str:
    """One markdown table cell: no pipes, no line breaks, not too long."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "…"


def fmt_ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def table(model: str, runs: dict[str, dict[str, dict]], plan: dict) -> str:
    """One markdown table for ``model``: a row per (OpenBLAS setting, peer) of ``runs``
    (setting -> peer -> result); ratios and loss differences are taken within one setting."""
    n = plan["warmup"] + plan["steps"]
    lines = [f"### {model} [{plan['batch']}, {', '.join(map(str, SHAPES[model]))}], "
             f"{plan['warmup']} warm-up + {plan['steps']} timed steps per process, "
             f"{plan['rounds']} processes per peer taking turns", "",
             "| OpenBLAS env | peer | ms/step median (min) | tr_onnx / peer | "
             f"peak RSS MB (after imports) | loss step 1 | loss step {n} | "
             "\\|Δloss\\| vs torch step 1 (max) | BLAS kernel |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, results in runs.items():
        ok = {p: r for p, r in results.items() if r["ok"]}
        med = {p: peer_common.median(r["ms"]) for p, r in ok.items()}
        ref = ok.get("torch", {}).get("losses")
        for peer, r in results.items():
            name = PEERS[peer] + (f" {r['version']}" if r.get("version") else "")
            blas = cell(r.get("blas", "–"))
            if not r["ok"]:
                lines.append(f"| {setting} | {name} | {cell(r['error'])} | – | – | – | – | – | "
                             f"{blas} |")
                continue
            ratio = f"{med['tr_onnx'] / med[peer]:.2f}x" if "tr_onnx" in med else "–"
            after = r.get("rss_after_imports_mb")
            rss = f"{r['peak_rss_mb']:.0f}" + (f" ({after:.0f})" if after else "")
            losses = r["losses"]
            diff = (f"{abs(losses[0] - ref[0]):.1e} "
                    f"({max(abs(a - b) for a, b in zip(losses, ref)):.1e})"
                    if ref and peer != "torch" else "–")
            ms = f"{fmt_ms(med[peer])} ({fmt_ms(min(r['ms']))})"
            lines.append(f"| {setting} | {name} | {ms} | {ratio} | {rss} | {losses[0]:.6f} | "
                         f"{losses[-1]:.6f} | {diff} | {blas} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    # numpy (used here only to write the data) gets the same thread count as the peers
    peer_common.pin_threads(args.threads)
    opt = (f"SGD lr {args.lr}" if args.optimizer == "sgd"
           else f"AdamW lr {args.lr} weight decay {args.weight_decay}")
    print(f"{args.threads} threads, loss {args.loss}, {opt}; batch and steps per model in each "
          f"table header; each peer in its own process; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    print(peer_common.blas_line(args.blas_env) + "\n")
    if "ort" in args.peers and ort_missing():
        print(f"ORT training column skipped: {ort_missing()} "
              "(downloads ~300 MB from PyPI, ~1 GB on disk)\n")
    settings = peer_common.blas_settings(args.blas_env)
    with tempfile.TemporaryDirectory(prefix="tr_onnx_bench_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        peer_common.export_bench_models(args.models, work)
        for model in args.models:
            plan = plan_of(model, args)
            data = work / f"{model}.data.npz"
            write_data(data, model, plan, args)
            job = {"model": model, "model_path": str(peer_common.model_path(model, work)),
                   "data": str(data), "loss": args.loss, "optimizer": args.optimizer,
                   "lr": args.lr, "weight_decay": args.weight_decay, "threads": args.threads,
                   "warmup": plan["warmup"], "batch": plan["batch"]}
            runs = {s: run_rounds(job, work, args, s) for s in settings}
            print(table(model, runs, plan) + "\n", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end (other processes on these CPUs "
          "distort the times, most of all with more than one thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
