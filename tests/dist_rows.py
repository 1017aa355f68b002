"""Run under ``mpiexec -n 2`` by tests/test_distributed.py: the ranks' shares of a global batch
need not be equal. Global batches of 8 rows split 4+4, 5+3, 1+7, and 1+0 (rank 1 has no
rows), trained by two ranks against one process with each whole global batch (rank 0 runs it).
Writes ``<out>/rows.npz`` (rank 0): both curves, the steps each applied, every parameter of
both sides and rank 1's, and the losses rank 1 reported. Then the Trainer, whose last global
batch leaves rank 0 no row, against one process: ``<out>/trainer.npz``, both epoch curves and
final parameters and running statistics.

Usage: ``dist_rows.py OUT``
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx import distributed
from tr_onnx.optim import SGD
from tr_onnx.training.trainer import Trainer

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SPLITS = [(4, 4), (5, 3), (1, 7), (1, 0), (4, 4), (1, 0)]  # rows of rank 0, rank 1


def batches():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((a + b, 64)).astype(np.float32), rng.integers(0, 10, a + b))
            for a, b in SPLITS]


def session(world=None):
    return tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1, momentum=0.9),
                                   backend="numpy", distributed=world)


def trainer_run(world=None) -> tuple[dict, list]:
    """The Trainer on 25 samples in global batches of 8 (4 per rank): the last batch's one row
    is rank 1's, rank 0 has none; ResNet with BatchNorm synchronised across the ranks."""
    rng = np.random.default_rng(1)
    data = ({"input": rng.standard_normal((25, 3, 16, 16)).astype(np.float32)},
            rng.integers(0, 10, 25))
    ranks = world.size if world is not None else 1
    sess = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(lr=0.05, momentum=0.9),
                                   backend="numpy", distributed=world, sync_batchnorm=True)
    trainer = Trainer(sess, data, batch_size=8 // ranks, epochs=2, progress=False,
                              log=None)
    trainer.fit()
    return sess.parameters(), [h["train_loss"] for h in trainer.history]


def empty_rank_statistics(world) -> dict:
    """ResNet, BatchNorm not synchronised: two steps, rank 1 without rows in the second. Rank
    0's running statistics after the first step, and rank 1's after the second (those of no
    rows would be NaN)."""
    rng = np.random.default_rng(2)
    sess = tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(lr=0.05),
                                   backend="numpy", distributed=world)
    x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    sess.train_step({"input": x}, y)
    first = sess.state_arrays()
    rows = slice(None) if world.rank == 0 else slice(0, 0)
    sess.train_step({"input": x[rows]}, y[rows])
    stats = sess._state.active.info.running_stats
    return {f"first/{k}": first[k] for k in stats} | {
        f"second/{k}": v for k, v in sess.state_arrays().items() if k in stats}


def main(out: Path) -> None:
    world = distributed.init()
    stats = empty_rank_statistics(world)
    if world.rank == 1:
        world.comm.send(stats, dest=0)
    else:
        np.savez(out / "empty_rank_statistics.npz", **{
            k: v for k, v in world.comm.recv(source=1).items() if k.startswith("second/")},
            **{k: v for k, v in stats.items() if k.startswith("first/")})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        params, curve = trainer_run(world)
    if world.rank == 0:
        want, want_curve = trainer_run()
        result = {"curve": curve, "want_curve": want_curve}
        for k, v in params.items():
            result[f"got/{k}"], result[f"want/{k}"] = v, want[k]
        np.savez(out / "trainer.npz", **result)
    ranked = session(world)
    local = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a skipped step would warn
        for (x, y), (a, _) in zip(batches(), SPLITS, strict=True):
            rows = slice(0, a) if world.rank == 0 else slice(a, None)
            local.append(ranked.train_step({"input": x[rows]}, y[rows]))
    params = ranked.parameters()
    if world.rank == 1:
        world.comm.send((params, local, ranked.step), dest=0)
    else:
        other, other_local, other_steps = world.comm.recv(source=1)
        single = session()
        want = [single.train_step({"input": x}, y) for x, y in batches()]
        counts = np.array(SPLITS, np.float64)
        # the global batch's mean loss from the ranks': weighted by their rows
        losses = (counts[:, 0] * local + counts[:, 1] * np.array(other_local)) / counts.sum(1)
        result = {"losses": losses, "want_losses": np.array(want),
                  "rank1_local_losses": np.array(other_local), "steps_applied": ranked.step,
                  "rank1_steps_applied": other_steps, "want_steps_applied": single.step}
        for k, v in params.items():
            result[f"got/{k}"], result[f"rank1/{k}"] = v, other[k]
        for k, v in single.parameters().items():
            result[f"want/{k}"] = v
        np.savez(out / "rows.npz", **result)
    world.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
