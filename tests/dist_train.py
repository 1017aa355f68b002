"""Run under ``mpiexec -n 2`` (or 3) by tests/test_distributed.py: data-parallel training of
model-zoo models, each rank on its shard of every global batch (rank r: rows [r*b, (r+1)*b)),
and the oracles next to it -- one process with the whole global batch (rank 0 runs it), or
PyTorch DDP (gloo; two processes). Writes ``<out>/<case>.npz`` (rank 0) with the curves and
the final parameters of both sides and every rank's (``rank<r>/...``).

Usage: ``dist_train.py OUT CASE [CASE ...]`` with cases from ``CASES``.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx import distributed
from tr_onnx.optim import SGD, AdamW

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (64,), "lenet": (1, 8, 8), "resnet": (3, 16, 16),
          "mobilenet_train": (3, 16, 16)}

# small all-reduce buckets, so that the models' gradients travel in several of them
BUCKETS = {"grad_bucket_mb": 1 / 64}
# case -> (model, optimizer, steps, per-rank batch, options, oracle, where a row is made
# infinite: (step, rank) or None)
CASES = {
    "mlp-SGD": ("mlp", SGD(lr=0.1), 20, 4, {}, "single", None),
    "mlp-AdamW": ("mlp", AdamW(lr=1e-3), 20, 4, BUCKETS, "single", None),
    "lenet-SGD": ("lenet", SGD(lr=0.1), 20, 4, BUCKETS, "single", None),
    "lenet-AdamW": ("lenet", AdamW(lr=1e-3), 20, 4, {}, "single", None),
    # rank 1 loads other weights before training: rank 0's reach it before the first step
    "mlp-rank1-loads-other-weights": ("mlp", AdamW(lr=1e-3), 4, 4, {}, "single", None),
    "mlp-accumulate": ("mlp", SGD(lr=0.1, momentum=0.9), 12, 4,
                       {"grad_accumulation": 2, **BUCKETS}, "single", None),
    "mlp-inf-on-rank1": ("mlp", SGD(lr=0.1), 6, 4, {}, "single", (2, 1)),
    "mlp-inf-in-a-micro-batch": ("mlp", SGD(lr=0.1), 8, 4,
                                 {"grad_accumulation": 2, **BUCKETS}, "single", (4, 1)),
    "resnet-ddp": ("resnet", SGD(lr=0.01), 10, 4, {"bn_running_var": "unbiased", **BUCKETS},
                   "torch", None),
    "resnet-sync-batchnorm": ("resnet", SGD(lr=0.01, momentum=0.9), 10, 4,
                              {"sync_batchnorm": True}, "single", None),
    # Dropout(0.2) before the classifier: each rank draws its rows of the global batch's mask
    "mobilenet-dropout-sync-batchnorm": ("mobilenet_train", SGD(lr=0.05, momentum=0.9), 10, 4,
                                         {"sync_batchnorm": True}, "single", None),
}


def global_batches(model: str, steps: int, batch: int, bad: tuple[int, int] | None,
                   ranks: int):
    """``steps`` global batches of ``ranks * batch`` rows, cycling over 3 fixed ones (so the
    loss falls); with ``bad`` = (step, rank), one row of that rank's shard is +inf."""
    rng = np.random.default_rng(0)
    n = ranks * batch
    fixed = [(rng.standard_normal((n, *SHAPES[model])).astype(np.float32),
              rng.integers(0, 10, n)) for _ in range(3)]
    data = [(fixed[i % 3][0].copy(), fixed[i % 3][1]) for i in range(steps)]
    if bad is not None:
        step, rank = bad
        data[step][0][rank * batch] = np.inf
    return data


def train(session, data, shard=None):
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the bad step's warning
        for x, y in data:
            if shard is not None:
                x, y = x[shard], y[shard]
            losses.append(session.train_step({"input": x}, y))
    return np.array(losses, np.float64)


def run_case(world, name: str, out: Path) -> None:
    model, opt, steps, b, options, oracle, bad = CASES[name]
    data = global_batches(model, steps, b, bad, world.size)
    shard = slice(world.rank * b, (world.rank + 1) * b)
    session = tr_onnx.TrainingSession(ZOO / f"{model}.onnx", optimizer=copy.deepcopy(opt),
                                      backend="numpy", distributed=world, **options)
    if name == "mlp-rank1-loads-other-weights" and world.rank == 1:
        session.load_parameters({k: v + 1.0 for k, v in session.parameters().items()})
    local = train(session, data, shard)
    # the global batch's mean loss is the mean of the ranks' (equal shards, mean reduction)
    mean = np.array(world.allreduce_scalars(list(local))) / world.size
    params = session.parameters()
    nodes = session._state.active.graph.nodes
    starts = [i for i, n in enumerate(nodes) if n.op_type == "GradAllReduceStart"]
    result = {"losses": mean, "local_losses": local, "steps_applied": session.step,
              "grads_overwritten": session._state.active.info.grads_overwritten,
              "buckets": len(starts),  # and how much backward work runs after the first start
              "computed_after_first_start": sum(
                  n.phase == "compute" and n.domain != "ai.tr_onnx"
                  or n.op_type.endswith("Grad") for n in nodes[starts[0]:])}
    if world.rank > 0:  # every other rank's parameters and curve, for rank 0 to write
        world.comm.send((params, local, session.step), dest=0)
    else:
        for r in range(1, world.size):
            other, other_local, other_steps = world.comm.recv(source=r)
            result[f"rank{r}_local_losses"] = other_local
            result[f"rank{r}_steps_applied"] = other_steps
            for k, v in other.items():
                result[f"rank{r}/{k}"] = v
    if oracle == "torch":
        want_local, want_params = torch_ddp(world, model, opt, data, shard)
        if world.rank == 0:
            result["want_local_losses"] = want_local
            result["want_rank1_local_losses"] = world.comm.recv(source=1)
            for k, v in want_params.items():
                result[f"want/{k}"] = v
        elif world.rank == 1:
            world.comm.send(want_local, dest=0)
    elif world.rank == 0:
        single = tr_onnx.TrainingSession(
            ZOO / f"{model}.onnx", optimizer=copy.deepcopy(opt), backend="numpy",
            **{k: v for k, v in options.items() if k not in ("sync_batchnorm", *BUCKETS)})
        result["want_losses"] = train(single, data)
        result["want_steps_applied"] = single.step
        want = single.parameters()
        for k, v in want.items():
            result[f"want/{k}"] = v
        if name in ORACLE_SPREAD_CASES:
            for k, v in oracle_spread(model, opt, options, data, want).items():
                result[f"spread/{k}"] = v
    if world.rank == 0:
        for k, v in params.items():
            result[f"got/{k}"] = v
        np.savez(out / f"{name}.npz", **result)
    world.barrier()


# cases whose single-process oracle is itself only known to float32 rounding amplified by
# training: a ReLU6 or dropout-scaled activation near a kink flips with a 1-ulp change of the
# input, and ten momentum steps carry the flip to ~2e-5 in the first convolution's weights
# (measured: one of three 1-ulp perturbations moves the oracle by 1.9e-5). Summing the
# BatchNorm statistics per rank is such a 1-ulp change, so the test allows the oracle's own
# spread on top of its bound; without synchronised BatchNorm the ranks differ by 0.14.
ORACLE_SPREAD_CASES = {"mobilenet-dropout-sync-batchnorm"}
SPREAD_TRIALS = 4


def oracle_spread(model: str, opt, options: dict, data, want: dict) -> dict:
    """Per parameter, the largest distance from ``want`` of the single-process run trained on
    the same batches with every input element moved by one float32 ulp (random sign)."""
    rng = np.random.default_rng(1)
    spread = {k: np.float32(0) for k in want}
    for _ in range(SPREAD_TRIALS):
        moved = [((x * (1 + rng.choice([-1.0, 1.0], x.shape) * 2.0**-23)).astype(np.float32), y)
                 for x, y in data]
        session = tr_onnx.TrainingSession(
            ZOO / f"{model}.onnx", optimizer=copy.deepcopy(opt), backend="numpy",
            **{k: v for k, v in options.items() if k not in ("sync_batchnorm", *BUCKETS)})
        train(session, moved)
        for k, v in session.parameters().items():
            spread[k] = max(spread[k], np.abs(v - want[k]).max())
    return spread


def torch_ddp(world, model: str, opt, data, shard):
    """PyTorch DDP (gloo, these two processes, the same shards and initial weights): each
    rank's loss curve and the final state (rank 0's)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from model_zoo.export_models import build_torch_model

    if not dist.is_initialized():
        port = world.bcast_object(_free_port() if world.is_root else None)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=world.rank, world_size=world.size)
    net = build_torch_model(model).train()
    ddp = DistributedDataParallel(net)
    cfg = {k: v for k, v in opt.config().items() if k != "name"}
    optim = {SGD: torch.optim.SGD, AdamW: torch.optim.AdamW}[type(opt)](ddp.parameters(), **cfg)
    losses = []
    for x, y in data:
        value = torch.nn.functional.cross_entropy(ddp(torch.from_numpy(x[shard])),
                                                  torch.from_numpy(y[shard]))
        optim.zero_grad()
        value.backward()
        optim.step()
        losses.append(value.item())
    state = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()
             if v.dtype.is_floating_point}
    return np.array(losses), state


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path, cases: list[str]) -> None:
    world = distributed.init(timeout_s=120)
    for name in cases:
        run_case(world, name, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
