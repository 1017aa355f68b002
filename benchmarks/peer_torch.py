"""PyTorch eager (CPU) peer of ``benchmarks/train.py``: the model rebuilt with the weights of
its .onnx file (zoo models by ``model_zoo.export_models.build_torch_model``, the others by
``bench_models.build``), in train mode.

    python benchmarks/peer_torch.py JOB.json

The zoo files are exported from eval-mode models, so they hold no Dropout node; the other peers
train that graph, so dropout is switched off here too (p=0) to train the same function.
BatchNorm uses batch statistics, as it does in the other peers' training graphs.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import bench_models
import peer_common

ROOT = Path(__file__).resolve().parent.parent


def no_dropout(model) -> int:
    """Set every dropout probability to 0; return how many were non-zero."""
    from torch import nn

    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p:
            module.p, changed = 0.0, changed + 1
        elif isinstance(module, nn.MultiheadAttention) and module.dropout:
            module.dropout, changed = 0.0, changed + 1
    return changed


def torch_blas(torch) -> str:
    """torch's own BLAS (linked statically, so threadpoolctl cannot see it), the CPU kernels it
    dispatches to and its thread count, then the BLAS that numpy loaded."""
    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    blas = found.group(1) if found else "?"
    return (f"torch {blas} {torch.backends.cpu.get_cpu_capability()} x{torch.get_num_threads()}"
            f"; numpy {peer_common.blas_kernels()}")


def body(job: dict, result: dict) -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from model_zoo.export_models import build_torch_model

    torch.set_num_threads(job["threads"])
    result["rss_after_imports_mb"] = peer_common.rss_mb()
    result["version"] = torch.__version__
    xs, ys = peer_common.load_data(job)
    start = time.perf_counter()
    if job["model"] in bench_models.SHAPES:
        model = bench_models.build(job["model"])
    else:
        model = build_torch_model(job["model"])
    result["dropout_disabled"] = no_dropout(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if job["optimizer"] == "adamw":
        opt = torch.optim.AdamW(params, lr=job["lr"], weight_decay=job["weight_decay"])
    else:
        opt = torch.optim.SGD(params, lr=job["lr"])
    result["setup_s"] = time.perf_counter() - start
    xs = torch.from_numpy(xs)
    ys = torch.from_numpy(ys)
    if job["loss"] == "cross_entropy":
        ys, loss_fn = ys.long(), F.cross_entropy
    else:
        loss_fn = F.mse_loss

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    result["ms"], result["losses"] = peer_common.timed_loop(step, xs, ys, job["warmup"])
    result["blas"] = torch_blas(torch)


if __name__ == "__main__":
    job = peer_common.load_job()
    peer_common.pin_threads(job["threads"])
    peer_common.run_peer(job, body)
