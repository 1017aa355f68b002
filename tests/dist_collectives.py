"""Run under ``mpiexec -n 2`` by tests/test_distributed.py: each collective of
``tr_onnx.distributed.World`` on known per-rank values, then a deadline (rank 1 joins a
collective late), each rank writing what it saw to ``<out>/rank<r>.json``; last, both ranks
train the MLP, rank 1 stops (exits), and rank 0's next step must fail within the world's
deadline with a DistributedError, which it writes to ``<out>/failure.json``."""

import json
import sys
import time
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx import distributed
from tr_onnx.errors import CheckpointError, DistributedError
from tr_onnx.training import storage

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def main(out: Path) -> None:
    world = distributed.init(timeout_s=60)
    r = world.rank
    seen = {"rank": r, "size": world.size, "local_rank": world.local_rank,
            "is_root": world.is_root}

    a = np.arange(5, dtype=np.float64) + 10 * r
    before = a.__array_interface__["data"][0]
    world.allreduce_sum_(a)
    seen["sum"] = a.tolist()
    seen["sum_in_place"] = a.__array_interface__["data"][0] == before

    m = np.full(3, r + 1, dtype=np.float32)
    world.allreduce_mean_(m)
    seen["mean"] = m.tolist()

    flags = np.array([float(r == 1), 0.0, -r], dtype=np.float32)  # a flag raised on rank 1
    world.allreduce_max_(flags)
    seen["max"] = flags.tolist()
    seen["allgather"] = world.allgather_int(3 + r)  # every rank's rows of a global batch

    b = np.full(4, r + 7, dtype=np.int64)
    world.bcast_(b, root=1)
    seen["bcast_from_1"] = b.tolist()

    started = [np.full(3, r + 1.0), np.arange(4, dtype=np.float32) * (r + 1)]
    for x in started:
        world.start_allreduce_sum_(x)
    world.wait_started()
    seen["started"] = [x.tolist() for x in started]

    seen["scalars"] = world.allreduce_scalars([r, 2.5, -r])
    seen["object"] = world.bcast_object({"from": r, "list": [r] * 3} if r == 0 else None)
    world.barrier()

    # a file on rank 0's machine only (rank 1's path names nothing), on every rank, broadcast
    # in 7-byte pieces
    storage.BCAST_CHUNK = 7
    mine = out / f"only-on-rank-{r}.bin"
    if r == 0:
        mine.write_bytes(bytes(range(40)))
    seen["shared_file"] = list(storage.shared_checkpoint(mine, world))
    try:
        storage.shared_checkpoint(out / "nowhere.bin", world)
    except CheckpointError as exc:
        seen["shared_missing"] = str(exc)

    # the deadline: rank 0 waits 0.5 s for an all-reduce rank 1 joins only after 1.5 s; rank 0
    # raises, then both match up so that the job ends cleanly
    short = distributed.World(r, world.size, world.local_rank, world.comm, timeout_s=0.5)
    late = np.ones(2)
    if r == 0:
        t0 = time.monotonic()
        try:
            short.allreduce_sum_(late)
        except DistributedError as exc:
            seen["deadline_error"] = str(exc)
            seen["deadline_rank"] = exc.rank
            seen["deadline_after_s"] = time.monotonic() - t0
    else:
        time.sleep(1.5)
        world.allreduce_sum_(late)
    world.barrier()
    (out / f"rank{r}.json").write_text(json.dumps(seen))
    a_rank_stops(short, out)


def a_rank_stops(world, out: Path) -> None:
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer="sgd", lr=0.1,
                                      backend="numpy", distributed=world)
    rng = np.random.default_rng(world.rank)
    x, y = rng.standard_normal((4, 64)).astype(np.float32), rng.integers(0, 10, 4)
    session.train_step({"input": x}, y)
    if world.rank == 1:
        sys.exit(0)  # as a rank whose data ran out, or that crashed, stops taking part
    t0 = time.monotonic()
    try:
        session.train_step({"input": x}, y)
    except DistributedError as exc:
        seen = {"type": type(exc).__name__, "message": str(exc), "rank": exc.rank,
                "after_s": time.monotonic() - t0, "step": session.step}
        (out / "failure.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
