"""Run under ``mpiexec -n 2`` by tests/test_distributed_cuda_cpu.py: data-parallel training on
the cuda backend's NCCL path, emulated -- the cuda executor over the host emulator (the
kernels' host build at ``LIB``), ``testing.host_nccl`` in place of ``cupy.cuda.nccl`` (its
all-reduce is MPI's on the emulated arena) -- next to the numpy backend's data parallelism in
the same two processes, each rank on its shard of every global batch. Writes
``<out>/<case>-rank<r>.npz``: both sides' losses, final parameters, steps and bad steps.

Usage: ``dist_cuda_emulated.py OUT LIB CASE [CASE ...]`` with cases from ``CASES``.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx import distributed
from tr_onnx.backends.cuda import nccl
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import emulated_cuda
from tr_onnx.testing.host_nccl import HostNccl

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16),
          "mobilenet_train": (3, 16, 16)}
# case -> (model, steps, per-rank batch, options, (step, rank) whose first row is +inf)
CASES = {
    "mlp": ("mlp", 6, 4, {}, None),
    "lenet-small-buckets": ("lenet", 4, 4, {"grad_bucket_mb": 1 / 64}, None),
    "mlp-inf-on-rank1": ("mlp", 5, 4, {}, (2, 1)),
    "resnet-bn-ddp": ("resnet", 3, 4, {}, None),  # rank 0's running statistics every step
    # the batch statistics over both ranks' rows (NCCL sums between the BatchNorm kernels)
    "resnet-sync-batchnorm": ("resnet", 3, 4, {"sync_batchnorm": True}, None),
    "mlp-accum-inf-on-rank1": ("mlp", 6, 4, {"grad_accumulation": 2}, (2, 1)),  # a micro-step
    # half precision on the cuda side only (numpy trains float32): the half GRAD buckets, the
    # float32 loss deciding the poison; fp16's loss scaling with an inf batch on rank 1
    "mlp-fp16-inf-on-rank1": ("mlp", 5, 4, {}, (2, 1)),
    "resnet-bf16-ddp": ("resnet", 3, 4, {}, None),
    # Dropout(0.2): each rank draws its rows of the global batch's mask, on the device too
    "mobilenet-dropout-sync-batchnorm": ("mobilenet_train", 3, 4, {"sync_batchnorm": True},
                                         None),
    # unequal shares of the global batch, and a rank with none (SPLITS): gradients by rows
    "mlp-unequal-rows": ("mlp", 6, 4, {}, None),
}
# case -> rank 0's rows of each global batch of 2 * batch (rank 1 has the rest; 8: none)
SPLITS = {"mlp-unequal-rows": [4, 5, 1, 8, 4, 8]}
CUDA_ONLY = {"mlp-fp16-inf-on-rank1": {"precision": "fp16"},
             "resnet-bf16-ddp": {"precision": "bf16"}}


def main(out: Path, lib: Path, cases: list[str]) -> None:
    world = distributed.init(timeout_s=120)
    host = HostNccl(world)
    nccl.nccl_module = lambda: host
    cuda = emulated_cuda(ctypes.CDLL(str(lib)))
    warnings.simplefilter("ignore", RuntimeWarning)  # the inf step's warning, on both sides
    for case in cases:
        model, steps, batch, opts, bad = CASES[case]
        rng = np.random.default_rng(0)
        sessions = {name: tr_onnx.TrainingSession(
            ZOO / f"{model}.onnx", optimizer=SGD(lr=0.05, momentum=0.9), channel_align=8,
            distributed=world, **kw, **opts) for name, kw in (
                ("cuda", {"backend": cuda, **CUDA_ONLY.get(case, {})}),
                ("numpy", {"backend": "numpy"}))}
        losses = {name: [] for name in sessions}
        for step in range(steps):
            x = rng.standard_normal((2 * batch, *SHAPES[model])).astype(np.float32)
            y = rng.integers(0, 10, 2 * batch)
            if bad is not None and bad[0] == step:
                x[bad[1] * batch] = np.inf
            shard = slice(world.rank * batch, (world.rank + 1) * batch)
            if case in SPLITS:
                rows = SPLITS[case][step]
                shard = slice(0, rows) if world.rank == 0 else slice(rows, None)
            for name, sess in sessions.items():
                losses[name].append(sess.train_step({"input": x[shard]}, y[shard]))
        arrays = {}
        for name, sess in sessions.items():
            arrays[f"{name}/losses"] = np.array(losses[name])
            arrays[f"{name}/counts"] = np.array([sess.step, sess.bad_steps])
            stats = set(sess._state.active.info.running_stats)
            arrays.update({f"{name}/{'stat' if k in stats else 'param'}/{k}": v
                           for k, v in sess.parameters().items()})
        np.savez(out / f"{case}-rank{world.rank}.npz", **arrays)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
