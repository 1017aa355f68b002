"""Run under ``mpiexec -n 2`` by tests/test_distributed.py: both ranks train the MLP, then
rank 1 stops (exits) and rank 0's next step must fail within the world's deadline with a
DistributedError naming rank 0 and the all-reduce it waited for, written to
``<out>/failure.json``."""

import json
import sys
import time
from pathlib import Path

import numpy as np

import tr_onnx
from tr_onnx import distributed
from tr_onnx.errors import DistributedError

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def main(out: Path) -> None:
    world = distributed.init(timeout_s=1.0)
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer="sgd", lr=0.1,
                                      backend="numpy", distributed=world)
    rng = np.random.default_rng(world.rank)
    batch = rng.standard_normal((4, 64)).astype(np.float32), rng.integers(0, 10, 4)
    session.train_step({"input": batch[0]}, batch[1])
    if world.rank == 1:
        sys.exit(0)  # as a rank whose data ran out, or that crashed, stops taking part
    t0 = time.monotonic()
    try:
        session.train_step({"input": batch[0]}, batch[1])
    except DistributedError as exc:
        seen = {"type": type(exc).__name__, "message": str(exc), "rank": exc.rank,
                "after_s": time.monotonic() - t0, "step": session.step}
        (out / "failure.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
