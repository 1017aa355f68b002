"""Run under ``mpiexec -n 2`` by tests/test_distributed_cuda_cpu.py: each rank makes the cuda
backend's NCCL communicator (``backends.cuda.nccl.communicator``) over the host stand-in for
``cupy.cuda.nccl`` (``testing.host_nccl``), then all-reduces a host buffer through it, and
writes which ids it made and joined with, and the reduced values, to ``<out>/rank<r>.json``."""

import json
import sys
from pathlib import Path

import numpy as np

from tr_onnx import distributed
from tr_onnx.backends.cuda import nccl
from tr_onnx.testing.host_nccl import HostNccl


def main(out: Path) -> None:
    world = distributed.init(timeout_s=60)
    host = HostNccl(world)
    comm = nccl.communicator(world, device_id=world.local_rank, nccl=host)
    again = nccl.communicator(world, device_id=world.local_rank, nccl=host)
    x = np.arange(6, dtype=np.float32) + 10 * world.rank
    ptr = x.ctypes.data
    comm.allReduce(ptr, ptr, x.size, nccl.nccl_dtype(x.dtype), nccl.NCCL_AVG, 0)
    (out / f"rank{world.rank}.json").write_text(json.dumps({
        "ids": [[what, rank, list(uid)] for what, rank, uid in host.ids],
        "cached": again is comm, "mean": x.tolist()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
