"""The cuda backend's check on a GPU: parity with the numpy backend, and a benchmark against
PyTorch. ``scripts/gpu_check.sh`` runs its functions on the lent H200, in the stages of
``scripts/gpu_stages.py``; ``--dry-run`` runs all of it on a CPU (CI), with the cuda executor
over ``tr_onnx.testing.host_emulator`` instead of a GPU.

    python scripts/gpu_check.py --benchmark [--out DIR] [--budget-s 300]
    python scripts/gpu_check.py --dry-run [--out DIR]

Parity (``forward_parity``, ``gradient_parity``, ``training_parity``, ``replay_parity``,
``precision_parity``, ``export_parity``, ``nccl_parity``, ``sync_batchnorm_parity``; the GPU tests
in tests/test_cuda_gpu.py call the same functions): a model_zoo model through ``backend="cuda"``
against ``backend="numpy"``, fp32, with the tolerances in ``TOL`` (they leave room for TF32 in
cuDNN's fp32 convolutions, about 1e-3 relative), fp16/bf16 training against the fp32 curve
(``HALF_TOL``), and the model trained on cuda and exported, run by onnxruntime (CUDA provider where
onnxruntime-gpu is installed).

Benchmark (``--benchmark``): training images/s and peak GPU memory, same batch, SGD momentum:
tr_onnx cuda in fp32 and fp16 (bf16 too on ResNet-50; the session's ``train_step`` waited and
pipelined, and the bare captured step: input upload + the step's one graph, no read-back),
PyTorch fp32 eager, AMP fp16 + channels_last eager (AMP bf16 too on ResNet-50) and fp16 with
``torch.compile(mode="reduce-overhead")``. Models: a ResNet-50-shaped net built in plain
torch (no torchvision) and exported with the TorchScript exporter at run time, and the
model_zoo models (their torch builders from model_zoo.export_models). A model the cuda
backend cannot run is a row saying which ops (``CudaUnsupported``), not a crash.

``--dry-run``: every parity check on mlp and resnet and every benchmark row (a small
ResNet-50-shaped net, batch 2, torch on the CPU, no torch.compile), one step each, no
timing: the plumbing, proven without a device. Results go to ``results.json``,
``results.md`` and ``gpu_check.log`` under ``--out`` ($OUT if set, else ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx.optim import SGD
from tr_onnx.training.reserved import Reserved

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16), "mobilenet": (3, 16, 16),
          "mobilenet_train": (3, 16, 16), "transformer": None}
PARITY_MODELS = ["mlp", "resnet", "mobilenet", "lenet", "transformer"]
TOL = {"forward": 2e-3, "gradient": 5e-3, "loss": 2e-3, "weights": 1e-2, "replay": 0.0,
       "export": 2e-3}
"""fp32 tolerances: forward max|a-b|/max|b| over the outputs; gradient max|a-b| over every
gradient / the largest |gradient|; weights per tensor ||a-b||/||b|| after the steps; loss per
step |a-b|/|b| over 20 SGD steps; replay: the captured steps equal the eager first step bit
for bit (lr=0, so every step sees the same weights); export: the model trained on cuda and
exported, run by onnxruntime, against the session's own outputs (as forward)."""
HALF_TOL = {"fp16": 3e-3, "bf16": 6e-3}
"""Mixed precision (``precision_parity``, batch 16: BatchNorm over 4 samples is too
ill-conditioned to compare curves): the loss per step |a-b|/|b| over 10 SGD steps against
the fp32 numpy run, as the emulator tests allow (tests/test_cuda_precision_cpu.py); the
weights' total change (all parameters at once) may drift from the fp32 run's by twice what
rounding the inputs and initial weights to the half type alone causes (``drift <= 2 *
baseline``). On the host emulator (2026-11-29) every zoo model passes, loss <= 2.6e-3, drift
up to 1.8x its baseline (bf16 mlp and lenet; fp16 <= 1.6x)."""
HALF_STEPS = 10


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# Parity with the numpy backend
# --------------------------------------------------------------------------------------------

def _batch(stem: str, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if stem == "transformer":
        sess = tr_onnx.InferenceSession(ZOO / "transformer.onnx")
        spec = sess.get_inputs()[0]
        shape = [n if isinstance(d, str) or d is None else d for d in spec.shape]
        return {spec.name: rng.standard_normal(shape).astype(np.float32)}
    return {"input": rng.standard_normal((n, *SHAPES[stem])).astype(np.float32)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (den if den > 0 else 1.0)


def _maxrel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = float(np.abs(b).max()) if b.size else 1.0
    return float(np.abs(a - b).max()) / (den if den > 0 else 1.0)


def host_emulator_module():
    """``tr_onnx.testing.host_emulator`` (the CPU stand-in for the GPU), imported here
    only: scripts/ reach it through this function, so a move of the module is one edit."""
    from tr_onnx.testing import host_emulator

    return host_emulator


def _cuda_kwargs(device) -> dict:
    """The sessions' cuda backend: the GPU's, or the same backend over ``device`` (the dry
    run's host emulator)."""
    from tr_onnx.backends.cuda.backend import CudaBackend

    return {"backend": "cuda" if device is None else CudaBackend(device=device)}


def forward_parity(stem: str, device=None, batch: int = 4) -> dict:
    """Inference outputs, cuda vs numpy (channel_align 8 on both: the same layout)."""
    feed = _batch(stem, batch, 0)
    want = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=8).run(None, feed)
    got = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", **_cuda_kwargs(device)).run(None, feed)
    return {"forward": max(_maxrel(g, w) for g, w in zip(got, want))}


def _session(stem: str, backend_kw: dict, optimizer=None, **kw):
    return tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=8,
                                   optimizer=optimizer or SGD(lr=0.05, momentum=0.9),
                                   **backend_kw, **kw)


def _sessions(stem: str, device, cuda_kw: dict | None = None, **kw):
    """A numpy and a cuda session of ``stem`` with the same options (``cuda_kw``: the cuda
    one's own, e.g. ``precision``)."""
    return (_session(stem, {"backend": "numpy"}, **kw),
            _session(stem, {**_cuda_kwargs(device), **(cuda_kw or {})}, **kw))


def _labels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).integers(0, 10, n).astype(np.int64)


def gradient_parity(stem: str, device=None, batch: int = 4) -> dict:
    """The gradient accumulators after one micro-batch (grad_accumulation=2 keeps them)."""
    ref, cuda = _sessions(stem, device, grad_accumulation=2)
    feed, y = _batch(stem, batch, 1), _labels(batch, 1)
    ref.train_step(feed, y)
    cuda.train_step(feed, y)
    names = list(ref._state.active.info.grads.values())
    a, b = cuda.state_arrays(), ref.state_arrays()
    # relative to the largest gradient: some (a bias before a BatchNorm) cancel to ~0, where a
    # per-tensor relative error means nothing
    scale = max(float(np.abs(b[n]).max()) for n in names) or 1.0
    err = max(float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in names)
    return {"gradient": err / scale, "tensors": len(names)}


def training_parity(stem: str, device=None, steps: int = 20, batch: int = 4) -> dict:
    """``steps`` SGD (momentum 0.9) steps on the same batches: losses and final weights."""
    ref, cuda = _sessions(stem, device)
    worst = 0.0
    for i in range(steps):
        feed, y = _batch(stem, batch, 10 + i), _labels(batch, i)
        want, got = ref.train_step(feed, y), cuda.train_step(feed, y)
        worst = max(worst, abs(got - want) / max(abs(want), 1e-12))
    a, b = cuda.parameters(), ref.parameters()
    return {"loss": worst, "weights": max(_rel(a[n], b[n]) for n in b), "steps": steps}


def real_export_parity(folder: Path, case: str, device=None) -> dict:
    """A real export written by scripts/export_real_sets.py (``<case>.onnx``, its batches in
    ``<case>.npz``, its options in ``sets.json``): plain SGD steps on numpy and cuda on the
    same batches, measured as ``training_parity`` measures the zoo's (the loss per step and
    the weights per tensor, relative)."""
    row = json.loads((folder / "sets.json").read_text())[case]
    batches = np.load(folder / f"{case}.npz")
    loss = tr_onnx.LossSpec("cross_entropy", class_axis=row["class_axis"])

    def session(backend_kw: dict) -> tr_onnx.TrainingSession:
        return tr_onnx.TrainingSession(folder / f"{case}.onnx", loss=loss,
                                       optimizer=SGD(lr=row["lr"]), **row["session_kwargs"],
                                       **backend_kw)

    ref, cuda = session({"backend": "numpy"}), session(_cuda_kwargs(device))
    worst = 0.0
    for k in range(row["steps"]):
        feed = {key.split("/", 1)[1]: batches[key] for key in batches.files
                if key.startswith(f"k{k}/") and key != f"k{k}/labels"}
        y = batches[f"k{k}/labels"]
        want, got = ref.train_step(feed, y), cuda.train_step(feed, y)
        worst = max(worst, abs(got - want) / max(abs(want), 1e-12))
    a, b = cuda.parameters(), ref.parameters()
    return {"loss": worst, "weights": max(_rel(a[n], b[n]) for n in b), "steps": row["steps"],
            "parameters": len(b)}


def export_parity(stem: str, device=None, steps: int = 3, batch: int = 4) -> dict:
    """Train ``steps`` SGD steps on cuda, export, and run the exported model in onnxruntime
    (its CUDA provider where onnxruntime-gpu is installed, else the CPU one): the trained
    model's outputs there against the cuda session's eval-mode ``run``."""
    import onnxruntime as ort

    _, cuda = _sessions(stem, device)
    for i in range(steps):
        cuda.train_step(_batch(stem, batch, 30 + i), _labels(batch, i))
    feed = _batch(stem, batch, 40)
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                 if p in ort.get_available_providers()]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(cuda.export_proto().SerializeToString(), options,
                                providers=providers)
    want = sess.run(None, feed)
    got = cuda.run(None, feed)
    return {"export": max(_maxrel(g, w) for g, w in zip(got, want)),
            "export_oracle": sess.get_providers()[0]}


def replay_parity(stem: str, device=None, batch: int = 4) -> dict:
    """lr=0: the eager first step, the captured second and the replayed third see the same
    weights, so their losses and outputs must be equal; inference likewise."""
    _, cuda = _sessions(stem, device, optimizer=SGD(lr=0.0))
    feed, y = _batch(stem, batch, 2), _labels(batch, 2)
    losses, outs = [], []
    for _ in range(3):
        losses.append(cuda.train_step(feed, y))
        outs.append(cuda.last_outputs())
    diff = max(abs(v - losses[0]) for v in losses)
    diff = max([diff] + [float(np.abs(o[k] - outs[0][k]).max()) for o in outs for k in o])
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", **_cuda_kwargs(device))
    runs = [sess.run(None, feed) for _ in range(3)]
    diff = max([diff] + [float(np.abs(r[0] - runs[0][0]).max()) for r in runs])
    graphs = list(cuda._state.active.executor.graphs)
    return {"replay": diff, "captured_graphs": graphs}


def nccl_parity(stem: str, device=None, steps: int = 5, batch: int = 4, **options) -> dict:
    """Data parallelism's NCCL path at a world of 1 (``testing.host_nccl.with_nccl_path``: the
    plan carries GradAllReduce, bound to one NCCL all-reduce in the step's graph) against the
    same cuda session without it: ``steps`` SGD steps, captured (``cuda_graphs="require"``:
    a capture that fails raises), the losses and weights bit for bit (``nccl``: the largest
    difference). ``options``: both sessions' (``precision="fp16"``: half GRAD buckets)."""
    from tr_onnx.testing.host_nccl import with_nccl_path

    plain = _session(stem, _cuda_kwargs(device), cuda_graphs="require", **options)
    world = with_nccl_path(_session(stem, _cuda_kwargs(device), cuda_graphs="require",
                                    **options))
    worst = 0.0
    for i in range(steps):
        feed, y = _batch(stem, batch, 50 + i), _labels(batch, i)
        worst = max(worst, abs(world.train_step(feed, y) - plain.train_step(feed, y)))
    a, b = world.parameters(), plain.parameters()
    worst = max([worst] + [float(np.abs(a[n] - b[n]).max()) for n in b])
    ex = world._state.active.executor
    nodes = [bn for bn in ex.bound if bn.node.op_type == "GradAllReduceWait"]
    return {"nccl": worst, "steps": world.step, "captured_graphs": list(ex.graphs),
            "ok": worst == 0.0 and world.step == steps and len(nodes) == 1
            and list(ex.graphs) == [ex.step_phases()] and "reduce" in ex.step_phases()}


def sync_batchnorm_parity(stem: str, device=None, steps: int = 5, batch: int = 4) -> dict:
    """Synchronised BatchNorm at a world of 1 through NCCL (``sync_batchnorm=True`` under
    ``testing.host_nccl.with_nccl_path``: BatchNorm's own kernels, their float64 sums NCCL
    all-reduced inside the step's graph, no cuDNN BatchNorm) against the plain cuda session
    (cuDNN's BatchNorm) and the numpy backend: ``steps`` SGD steps, captured
    (``cuda_graphs="require"``). ``loss``: the largest per-step |a-b|/|b|, ``weights``: the
    largest per-tensor ||a-b||/||b|| (running statistics included), over both references;
    ``vs``: each reference's own."""
    from tr_onnx.backends.cuda.bind import CudnnCall
    from tr_onnx.backends.cuda.nccl import NcclAllReduce
    from tr_onnx.testing.host_nccl import with_nccl_path

    sync = with_nccl_path(_session(stem, _cuda_kwargs(device), cuda_graphs="require",
                                   sync_batchnorm=True))
    refs = {"cudnn": _session(stem, _cuda_kwargs(device), cuda_graphs="require"),
            "numpy": _session(stem, {"backend": "numpy"})}
    vs = {name: {"loss": 0.0, "weights": 0.0} for name in refs}
    for i in range(steps):
        feed, y = _batch(stem, batch, 70 + i), _labels(batch, i)
        got = sync.train_step(feed, y)
        for name, ref in refs.items():
            want = ref.train_step(feed, y)
            vs[name]["loss"] = max(vs[name]["loss"], abs(got - want) / max(abs(want), 1e-12))
    a = sync.parameters()
    for name, ref in refs.items():
        b = ref.parameters()
        vs[name]["weights"] = max(_rel(a[k], b[k]) for k in b)
    ex = sync._state.active.executor
    nodes = [bn for bn in ex.bound if "world" in bn.node.attrs
             and bn.node.op_type in ("BatchNormTraining", "BatchNormGrad")]
    calls = [c for bn in nodes for c in bn.calls]
    loss, weights = (max(v[k] for v in vs.values()) for k in ("loss", "weights"))
    return {"loss": loss, "weights": weights, "vs": vs, "steps": sync.step,
            "sync_nodes": len(nodes),
            "all_reduces": sum(isinstance(c, NcclAllReduce) for c in calls),
            "captured_graphs": list(ex.graphs),
            "ok": loss <= TOL["loss"] and weights <= TOL["weights"] and sync.step == steps
            and bool(nodes) and not any(isinstance(c, CudnnCall) for c in calls)
            and list(ex.graphs) == [ex.step_phases()]}


def precision_parity(stem: str, device=None, precision: str = "fp16",
                     steps: int = HALF_STEPS, batch: int = 16) -> dict:
    """``steps`` SGD steps with ``precision`` on cuda against three fp32 numpy runs' worth of
    evidence: the plain run (the loss per step, and the weights' total change) and the run fed
    inputs and initial weights rounded to the half type (what rounding alone moves)."""
    from tr_onnx.training.precision import PRECISIONS

    half = PRECISIONS[precision]
    scaling = {"loss_scale": {"init": 1024.0}} if precision == "fp16" else {}
    ref, cuda = _sessions(stem, device, {"precision": precision, **scaling})
    rounded = _session(stem, {"backend": "numpy"})
    init = ref.parameters()
    rounded.load_parameters({k: v.astype(half).astype(np.float32) for k, v in init.items()})
    rinit = rounded.parameters()
    worst = 0.0
    for i in range(steps):
        feed, y = _batch(stem, batch, 10 + i), _labels(batch, i)
        want, got = ref.train_step(feed, y), cuda.train_step(feed, y)
        rounded.train_step({k: v.astype(half).astype(np.float32) for k, v in feed.items()}, y)
        worst = max(worst, abs(got - want) / max(abs(want), 1e-12))
    a, b, r = (np.concatenate([p[n].ravel() for n in sorted(init)])
               for p in (cuda.parameters(), ref.parameters(), rounded.parameters()))
    start, rstart = (np.concatenate([p[n].ravel() for n in sorted(init)]) for p in (init, rinit))
    # over all parameters at once: a tensor that hardly moves in fp32 (a bias before a
    # BatchNorm) makes a per-tensor ratio meaningless
    drift, baseline = _rel(a - start, b - start), _rel(r - rstart, b - start)
    return {"loss": worst, "drift": drift, "baseline": baseline, "steps": cuda.step,
            "ok": worst <= HALF_TOL[precision] and drift <= 2 * baseline
            and cuda.step == steps}


def run_parity(stems, device=None, steps: int = 20, rows: list | None = None,
               save=lambda: None) -> list[dict]:
    """Every parity check for each model; a model the cuda backend cannot run is one row that
    names its ops. Rows are appended to ``rows``, ``save()`` called after each."""
    from tr_onnx.backends.cuda.executor import CudaUnsupported

    rows = [] if rows is None else rows
    for stem in stems:
        row = {"model": stem}
        t0 = time.perf_counter()
        try:
            for check in (forward_parity, gradient_parity, replay_parity, export_parity):
                row.update(check(stem, device))
            row.update(training_parity(stem, device, steps))
            row["ok"] = all(row[k] <= TOL[k] for k in TOL if k in row)
            for precision in HALF_TOL:
                row[precision] = precision_parity(stem, device, precision)
                row["ok"] = row["ok"] and row[precision]["ok"]
        except CudaUnsupported as e:
            row.update(ok=None, unsupported=sorted({f"{d or 'ai.onnx'}:{o}"
                                                    for d, o, _, _ in e.missing}))
        except Exception as e:  # one model's failure is a row, the others still run
            traceback.print_exc()
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"parity {stem}: {row}")
        rows.append(row)
        save()
    return rows


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

def resnet50_like(width: int = 64, layers=(3, 4, 6, 3), classes: int = 1000, pool: bool = True):
    """A ResNet-50-shaped torch model (bottleneck blocks, expansion 4) in plain torch;
    ``width``/``layers`` shrink it for the dry run. ``pool=False`` replaces the stem's
    MaxPool by a stride-2 3x3 conv (for a backend without MaxPool)."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = mid * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    stem = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    stem.append(nn.MaxPool2d(3, 2, 1) if pool else nn.Conv2d(width, width, 3, 2, 1))
    blocks, cin = [], width
    for i, n in enumerate(layers):
        mid = width * 2 ** i
        for j in range(n):
            blocks.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
            cin = mid * 4
    return nn.Sequential(*stem, *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(cin, classes))


def export_onnx(model, shape) -> bytes:
    """The TorchScript exporter (dynamo=False), BatchNorm kept (PRESERVE, eval model)."""
    import torch

    model = model.eval()
    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and folding notices
        torch.onnx.export(model, (torch.randn(2, *shape[1:]),), buf, dynamo=False,
                          opset_version=17, input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          training=torch.onnx.TrainingMode.PRESERVE)
    return buf.getvalue()


@dataclass
class Bench:
    name: str
    torch_model: object
    onnx: bytes | Path
    shape: tuple  # with the batch
    classes: int


def bench_models(dry: bool, batch: int) -> list[Bench]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the model_zoo package (its torch builders)
    from model_zoo.export_models import build_torch_model

    if dry:
        r50 = resnet50_like(width=8, layers=(1, 1, 1, 1), classes=10)
        shape, classes = (2, 3, 32, 32), 10
    else:
        r50, shape, classes = resnet50_like(), (batch, 3, 224, 224), 1000
    out = [Bench("resnet50", r50, export_onnx(r50, shape), shape, classes)]
    b = 2 if dry else max(batch, 64)
    for stem in ("mlp", "resnet", "mobilenet", "lenet"):
        out.append(Bench(stem, build_torch_model(stem), ZOO / f"{stem}.onnx",
                         (b, *SHAPES[stem]), 10))
    return out


def _sync(device) -> None:
    if device is None:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()


def bench_tr_onnx(b: Bench, device, iters: int, dry: bool, precision: str = "fp32"
                  ) -> list[dict]:
    """Session ``train_step`` waited and pipelined (``wait=False``), and the bare captured
    step (upload + the step's one graph, nothing read back)."""
    from tr_onnx.backends.cuda.executor import CudaUnsupported

    rng = np.random.default_rng(0)
    x = rng.standard_normal(b.shape).astype(np.float32)
    y = (np.arange(b.shape[0]) % b.classes).astype(np.int64)
    rows = []
    # this row's own device memory: the pool's growth from here (earlier rows' sessions are
    # freed first, so their arenas do not count here)
    mem0 = _cupy_pool_bytes() if device is None else None
    try:
        t0 = time.perf_counter()
        sess = tr_onnx.TrainingSession(b.onnx, optimizer=SGD(lr=0.01, momentum=0.9),
                                       precision=precision, **_cuda_kwargs(device))
        sess.train_step({"input": x}, y)  # plan, bind, eager warm-up
        plan_s = time.perf_counter() - t0
    except CudaUnsupported as e:
        ops = sorted({f"{o}" for _, o, _, _ in e.missing})
        return [{"model": b.name, "runner": f"tr_onnx cuda {precision}", "batch": b.shape[0],
                 "note": "unsupported: " + ", ".join(ops)}]
    warm = 1 if dry else 3
    for _ in range(warm):
        sess.train_step({"input": x}, y)
    n = 1 if dry else iters
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        sess.train_step({"input": x}, y)
    _sync(device)
    dt = time.perf_counter() - t0
    mem = _cupy_pool_bytes() - mem0 if device is None else None
    rows.append({"model": b.name, "runner": f"tr_onnx cuda {precision} (train_step)",
                 "batch": b.shape[0], "images_s": None if dry else n * b.shape[0] / dt,
                 "peak_mem_mb": mem, "note": f"plan+bind+warm-up {plan_s:.1f}s"})
    t0 = time.perf_counter()
    for _ in range(n):  # step k+1 launched before step k is read back (the Trainer's loop)
        pending = sess.train_step({"input": x}, y, wait=False)
    float(pending)
    dt = time.perf_counter() - t0
    rows.append({"model": b.name, "runner": f"tr_onnx cuda {precision} (pipelined)",
                 "batch": b.shape[0], "images_s": None if dry else n * b.shape[0] / dt,
                 "peak_mem_mb": mem, "note": "train_step(..., wait=False)"})
    plan = sess._state.active
    ex, guard = plan.executor, plan.info.step_guard
    applied = int(ex.read_scalar(guard.applied))
    t0 = time.perf_counter()
    for i in range(n):  # the host stages batch k+1 while the GPU runs step k
        ex.write_input("input", x)
        # the step guard applies only the step numbered applied + 1: each gets the next
        ex.write_scalar(Reserved.STEP, applied + i + 1)
        ex.run(ex.step_phases())
    _sync(device)
    dt = time.perf_counter() - t0
    # an fp16 overflow skips a step (and the ones numbered after it are rejected): say so
    done = int(ex.read_scalar(guard.applied)) - applied
    rows.append({"model": b.name, "runner": f"tr_onnx cuda {precision} (captured step)",
                 "batch": b.shape[0], "images_s": None if dry else n * b.shape[0] / dt,
                 "peak_mem_mb": mem,
                 "note": f"upload + 1 graph launch, no read-back; {done}/{n} steps applied"})
    return rows


def _cupy_pool_bytes() -> float:
    """MB the CuPy pool holds now, after freeing what no session references any more."""
    import gc

    import cupy

    gc.collect()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    return pool.total_bytes() / 2**20


def bench_torch(b: Bench, variant: str, iters: int, dry: bool) -> dict:
    """PyTorch training steps (each uploading its batch from pinned memory): ``fp32`` eager
    NCHW, ``amp`` fp16 autocast (GradScaler) +
    channels_last eager, ``amp-bf16`` bf16 autocast (no scaler) + channels_last eager,
    ``amp+compile`` the fp16 one under torch.compile(mode="reduce-overhead")."""
    import copy

    import torch

    dev = "cpu" if dry else "cuda"
    model = copy.deepcopy(b.torch_model).to(dev).train()
    spatial = len(b.shape) == 4
    amp = variant.startswith("amp")
    if amp and spatial:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                          **({} if dry else {"fused": True}))
    run = torch.compile(model, mode="reduce-overhead") if variant == "amp+compile" else model
    # each step copies its batch from pinned host memory (DataLoader(pin_memory=True) and
    # .to(non_blocking=True)), as tr_onnx's train_step uploads its batch
    x_host = torch.randn(b.shape)
    y_host = torch.arange(b.shape[0]) % b.classes
    if not dry:
        x_host, y_host = x_host.pin_memory(), y_host.pin_memory()
    fmt = torch.channels_last if amp and spatial else torch.contiguous_format
    bf16 = variant == "amp-bf16"
    scaler = torch.amp.GradScaler(dev, enabled=amp and not bf16 and not dry)
    amp_dtype = torch.bfloat16 if dry or bf16 else torch.float16

    def step():
        x = x_host.to(dev, non_blocking=True).to(memory_format=fmt)
        y = y_host.to(dev, non_blocking=True)
        if variant == "amp+compile":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev, dtype=amp_dtype, enabled=amp):
            loss = torch.nn.functional.cross_entropy(run(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(1 if dry else 5):
        step()
    warm_s = time.perf_counter() - t0
    if not dry:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    n = 1 if dry else iters
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if not dry:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    names = {"fp32": "torch fp32 eager", "amp": "torch AMP fp16 channels_last eager",
             "amp-bf16": "torch AMP bf16 channels_last eager",
             "amp+compile": "torch AMP fp16 channels_last compile(reduce-overhead)"}
    return {"model": b.name, "runner": names[variant], "batch": b.shape[0],
            "images_s": None if dry else n * b.shape[0] / dt,
            "peak_mem_mb": None if dry else torch.cuda.max_memory_allocated() / 2**20,
            "note": f"warm-up {warm_s:.1f}s"}


def run_benchmark(device, dry: bool, batch: int, iters: int, budget_s: float,
                  compile_all: bool, rows: list | None = None, save=lambda: None,
                  models: list[str] | None = None, compile_last: bool = True) -> list[dict]:
    """Every benchmark row, appended to ``rows`` (``save()`` after each); ``models``: only
    those (default: all). The torch.compile rows (slow to warm up, optional) come after every
    other row, so a run cut at its time limit has lost only those."""
    start = time.perf_counter()
    rows = [] if rows is None else rows
    later = []
    for b in bench_models(dry, batch):
        if models is not None and b.name not in models:
            continue
        big = b.name == "resnet50"
        jobs = [("tr_onnx", "fp32"), ("tr_onnx", "fp16")] + [("tr_onnx", "bf16")] * big + [
            ("torch", "fp32"), ("torch", "amp")] + [("torch", "amp-bf16")] * big
        if not dry and (compile_all or big):
            if compile_last:
                later.append((b, ("torch", "amp+compile")))
            else:
                jobs.append(("torch", "amp+compile"))
        _bench_jobs(b, jobs, device, dry, iters, budget_s, start, rows, save)
    for b, job in later:
        _bench_jobs(b, [job], device, dry, iters, budget_s, start, rows, save)
    return rows


def _bench_jobs(b: Bench, jobs, device, dry: bool, iters: int, budget_s: float,
                start: float, rows: list, save) -> None:
    for kind, variant in jobs:
        label = f"{kind} {variant or ''}".strip()
        if time.perf_counter() - start > budget_s:
            rows.append({"model": b.name, "runner": label, "note": "skipped: time budget"})
            continue
        try:
            if kind == "tr_onnx":
                rows += bench_tr_onnx(b, device, iters, dry, variant)
            else:
                rows.append(bench_torch(b, variant, iters, dry))
        except Exception as e:  # one row's failure is a row, the others still run
            traceback.print_exc()
            rows.append({"model": b.name, "runner": label,
                         "note": f"error: {type(e).__name__}: {str(e)[:200]}"})
        log(f"bench {rows[-1]}")
        save()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

RATIO_BASE = "torch AMP fp16 channels_last eager"
"""The benchmark table's reference row: what a PyTorch user trains with on a GPU."""


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 100 else f"{v:.0f}"
    return str(v)


def markdown(results: dict) -> str:
    lines = [f"# tr_onnx gpu_check ({results['mode']})", "", f"- {results['env']}", ""]
    if results.get("parity"):
        keys = ["forward", "gradient", "loss", "weights", "replay", "export"]
        halves = list(HALF_TOL)
        lines += ["## Parity with the numpy backend (fp32; fp16/bf16: loss, drift/baseline)",
                  "", "| model | " + " | ".join(keys + halves) + " | ok | note |",
                  "|---" * (len(keys) + len(halves) + 3) + "|"]
        lines.append("| tolerance | " + " | ".join(
            [_fmt(TOL[k]) for k in keys] + [f"{_fmt(HALF_TOL[h])}, 2x" for h in halves])
            + " | | |")
        for r in results["parity"]:
            note = "unsupported: " + ", ".join(r["unsupported"]) if r.get("unsupported") else \
                r.get("error", "")
            half = [f"{_fmt(r[h]['loss'])}, {_fmt(r[h]['drift'])}/{_fmt(r[h]['baseline'])}"
                    if isinstance(r.get(h), dict) else "-" for h in halves]
            lines.append(f"| {r['model']} | " + " | ".join(
                [_fmt(r.get(k)) for k in keys] + half) + f" | {_fmt(r.get('ok'))} | {note} |")
        lines.append("")
    if results.get("benchmark"):
        lines += ["## Training throughput (same batch, SGD momentum)", "",
                  f"vs torch AMP fp16: images/s over the {RATIO_BASE} row's, same model "
                  "(> 1: faster).", "",
                  "| model | runner | batch | images/s | vs torch AMP fp16 | peak MB | note |",
                  "|---|---|---|---|---|---|---|"]
        base = {r["model"]: r.get("images_s") for r in results["benchmark"]
                if r.get("runner") == RATIO_BASE}
        for r in results["benchmark"]:
            ips, ref = r.get("images_s"), base.get(r["model"])
            ratio = f"{ips / ref:.2f}x" if ips and ref else "-"
            lines.append(f"| {r['model']} | {r['runner']} | {_fmt(r.get('batch'))} | "
                         f"{_fmt(ips)} | {ratio} | {_fmt(r.get('peak_mem_mb'))} | "
                         f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def environment(dry: bool) -> str:
    import platform

    parts = [f"python {platform.python_version()}", f"numpy {np.__version__}"]
    for name in ("torch", "cupy", "cudnn"):
        try:
            mod = __import__(name)
            parts.append(f"{name} {getattr(mod, '__version__', '?')}")
        except Exception:
            parts.append(f"{name} missing")
    if not dry:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        parts.append(f"GPU {props['name'].decode()}")
    return ", ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmark", action="store_true", help="run the benchmark")
    p.add_argument("--parity", action="store_true", help="run the parity checks")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only: the cuda executor over the host emulator, no timing")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--models", default=None, help="parity models, comma separated")
    p.add_argument("--steps", type=int, default=20, help="training steps of the parity check")
    p.add_argument("--batch", type=int, default=64, help="ResNet-50 batch")
    p.add_argument("--iters", type=int, default=20, help="timed steps per row")
    p.add_argument("--budget-s", type=float, default=300.0, help="benchmark time budget")
    p.add_argument("--compile-all", action="store_true",
                   help="torch.compile rows for every model, not only ResNet-50")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    parity, bench = args.parity or dry, args.benchmark or dry
    if not (parity or bench):
        p.error("nothing to do: --parity, --benchmark or --dry-run")
    device = None
    if dry:
        device = host_emulator_module().host_emulator()
    else:
        from tr_onnx.backends.cuda.backend import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            log(f"no GPU: {reason}")
            return 2
    results = {"mode": "dry run (CPU, host emulator, no timing)" if dry else "GPU",
               "env": environment(dry), "tolerances": TOL, "parity": [], "benchmark": []}

    def save() -> None:  # after every row: a run killed at its time limit still reports
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(markdown(results))

    if parity:
        stems = args.models.split(",") if args.models else (
            ["mlp", "resnet"] if dry else PARITY_MODELS)
        run_parity(stems, device, 3 if dry else args.steps, results["parity"], save)
    if bench:
        run_benchmark(device, dry, args.batch, args.iters, args.budget_s, args.compile_all,
                      results["benchmark"], save)
    save()
    print(markdown(results))
    bad = [r["model"] for r in results.get("parity", []) if r.get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
