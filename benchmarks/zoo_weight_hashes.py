"""Hashes of the model zoo's weights after 20 training steps, on the numpy backend and on the
cuda backend run through the kernels' host build (``tr_onnx.testing.host_emulator``): the proof
that a refactor moved no result. Run it before and after; the hashes must be equal.

    python benchmarks/zoo_weight_hashes.py                    # print the table
    python benchmarks/zoo_weight_hashes.py --write FILE.json  # keep the hashes
    python benchmarks/zoo_weight_hashes.py --check FILE.json  # exit 1 on any difference

Each run hashes (sha256) every parameter, every optimizer/statistics state array and the
exported model's initializers, in name order, together with the 20 losses' float32 bits. The
runs cover both optimizers, momentum, gradient clipping and accumulation, a warm-up schedule, and
fp16/bf16 master-weight training on the emulated cuda backend.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import tr_onnx  # noqa: E402

ZOO = ROOT / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "lenet_opset9": (1, 8, 8), "resnet": (3, 16, 16),
          "resnet_opset9": (3, 16, 16), "mobilenet": (3, 16, 16), "transformer": (8, 32)}
STEPS, BATCH, CLASSES = 20, 8, 10
# (name, backend, session options); the optimizer is built per run
RUNS = [
    ("sgd", "numpy", {"optimizer": ("SGD", {"lr": 0.05, "momentum": 0.9})}),
    ("adamw", "numpy", {"optimizer": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
                        "clip_grad_norm": 1.0, "grad_accumulation": 2}),
    ("sgd", "cuda", {"optimizer": ("SGD", {"lr": 0.05, "momentum": 0.9})}),
    ("adamw-fp16", "cuda", {"optimizer": ("AdamW", {"lr": 1e-3}), "precision": "fp16"}),
    ("sgd-bf16", "cuda", {"optimizer": ("SGD", {"lr": 0.05}), "precision": "bf16",
                          "lr_schedule": ("Warmup", 4, 20)}),
]


def batches(model: str, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        x = rng.standard_normal((BATCH, *SHAPES[model])).astype(np.float32)
        yield x, rng.integers(0, CLASSES, BATCH)


def emulated_cuda():
    """The cuda backend over the host emulator, its kernels built once per run."""
    from tr_onnx.testing.host_emulator import build_host_library
    from tr_onnx.testing.host_emulator import emulated_cuda as over
    if not hasattr(emulated_cuda, "lib"):
        emulated_cuda.lib = build_host_library()
    return over(emulated_cuda.lib)


def train(model: str, backend: str, options: dict) -> tuple[str, float]:
    options = dict(options)
    cls, kw = options.pop("optimizer")
    if "lr_schedule" in options:
        _, warmup, total = options["lr_schedule"]
        options["lr_schedule"] = tr_onnx.optim.Warmup(warmup, tr_onnx.optim.Cosine(total))
    proto = onnx.load(str(ZOO / f"{model}.onnx"))
    session = tr_onnx.TrainingSession(proto, optimizer=getattr(tr_onnx.optim, cls)(**kw),
                                      backend=emulated_cuda() if backend == "cuda" else backend,
                                      **options)
    input_name = [i.name for i in proto.graph.input
                  if i.name not in {t.name for t in proto.graph.initializer}][0]
    digest = hashlib.sha256()
    loss = float("nan")
    for x, y in batches(model, seed=len(model)):
        loss = float(session.train_step({input_name: x}, y))
        digest.update(np.float32(loss).tobytes())
    for group in (session.parameters(), session.state_arrays()):
        for name in sorted(group):
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(group[name]).tobytes())
    exported = session.export_proto()
    for init in sorted(exported.graph.initializer, key=lambda t: t.name):
        digest.update(init.name.encode())
        digest.update(np.ascontiguousarray(numpy_helper.to_array(init)).tobytes())
    return digest.hexdigest()[:16], loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--write", type=Path, help="write the hashes to this JSON file")
    p.add_argument("--check", type=Path, help="compare with the hashes in this JSON file")
    args = p.parse_args(argv)
    want = json.loads(args.check.read_text()) if args.check else {}
    got, differ = {}, []
    print("| model | run | backend | sha256 (16) | last loss | s | check |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for name, backend, options in RUNS:
            key = f"{model}/{name}/{backend}"
            start = time.perf_counter()
            try:
                got[key], loss = train(model, backend, options)
            except Exception as exc:  # a run that fails is a result too: its message
                got[key], loss = f"error: {type(exc).__name__}: {exc}"[:120], float("nan")
            verdict = "" if key not in want else ("equal" if want[key] == got[key] else "DIFFERS")
            if verdict == "DIFFERS":
                differ.append(key)
            print(f"| {model} | {name} | {backend} | {got[key]} | {loss:.6g} | "
                  f"{time.perf_counter() - start:.1f} | {verdict} |", flush=True)
    if args.write:
        args.write.write_text(json.dumps(got, indent=1) + "\n")
    missing = sorted(set(want) - set(got)) if args.check and args.models == ",".join(SHAPES) \
        else []
    if differ or missing:
        print(f"differ: {differ}; missing: {missing}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
