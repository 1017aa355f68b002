"""A stand-in for ``cupy.cuda.nccl`` on the CPU: what the cuda backend's NCCL path calls, over
host memory, for the host emulator and the recorder.

``HostNccl(world)`` is a module-like object (``get_unique_id``, ``NcclCommunicator``) that
``nccl.communicator(world, device_id, nccl=...)`` takes, or that a test installs in place of
``nccl.nccl_module``. Its communicators record every ``allReduce`` / ``broadcast`` (pointers,
count, dtype, op or root, stream) in ``HostNccl.calls`` and run it over ``world`` with MPI on
the host pointers the host emulator passes (a world of 1 is its own sum and broadcast). Unique ids
are recorded too (``ids``), so a test sees which rank made one and that every rank joined with
rank 0's. ``with_nccl_path`` gives a session the data-parallel step at a world of 1.

A test double: the backend never imports this package.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import numpy as np

from ..backends.cuda.nccl import NCCL_AVG, NCCL_DTYPES, NCCL_MAX, NCCL_SUM
from ..dtypes import BFLOAT16

_NUMPY = {code: name for name, code in NCCL_DTYPES.items()}


@dataclass
class HostNccl:
    """``cupy.cuda.nccl`` for ``world`` on the host (see the module docstring)."""

    world: object
    calls: list[dict] = field(default_factory=list)
    ids: list[tuple] = field(default_factory=list)  # ("made" | "joined", rank, id)

    def get_unique_id(self) -> tuple:
        uid = tuple(os.urandom(128))  # ncclUniqueId is 128 bytes; CuPy returns a tuple
        self.ids.append(("made", self.world.rank, uid))
        return uid

    def NcclCommunicator(self, ndev: int, uid: tuple, rank: int) -> HostCommunicator:
        self.ids.append(("joined", rank, uid))
        if ndev != self.world.size or rank != self.world.rank:
            raise RuntimeError(f"NcclCommunicator({ndev}, id, {rank}) in a world of "
                               f"{self.world.size} at rank {self.world.rank}")
        return HostCommunicator(self, ndev, rank)


@dataclass
class HostCommunicator:
    """One rank's communicator: ``allReduce`` as NCCL's, on host pointers."""

    nccl: HostNccl
    size: int
    rank: int

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        self.nccl.calls.append({"call": "allReduce", "send": sendbuf, "recv": recvbuf,
                                "count": count, "dtype": datatype, "op": op, "stream": stream})
        if sendbuf != recvbuf:
            raise RuntimeError("the host communicator reduces in place only")
        if op not in (NCCL_SUM, NCCL_MAX, NCCL_AVG):
            raise RuntimeError(f"ncclRedOp_t {op}: the host communicator sums, averages or "
                               f"takes the maximum")
        dtype = _numpy_dtype(datatype)
        world = self.nccl.world
        if world.size == 1:  # the reduction over one rank is the buffer itself
            return
        array = _host_array(recvbuf, count, dtype)
        # MPI has no half types: half values are reduced in float32 and rounded once, as one
        # NCCL half add over two ranks rounds (its average scales by 1/2, exact in binary)
        wide = array.astype(np.float32) if dtype.itemsize == 2 else array
        if op == NCCL_MAX:
            world.allreduce_max_(wide)
        else:
            world.allreduce_sum_(wide)
            if op == NCCL_AVG:
                np.divide(wide, world.size, out=wide)
        if wide is not array:
            array[...] = wide.astype(dtype)  # round to nearest even, as the device does

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self.nccl.calls.append({"call": "broadcast", "send": sendbuf, "recv": recvbuf,
                                "count": count, "dtype": datatype, "root": root,
                                "stream": stream})
        if sendbuf != recvbuf:
            raise RuntimeError("the host communicator broadcasts in place only")
        if self.nccl.world.size > 1:
            self.nccl.world.bcast_(_host_array(recvbuf, count, _numpy_dtype(datatype))
                                   .view(np.uint8), root)


def _numpy_dtype(datatype: int) -> np.dtype:
    """The NumPy dtype of an ``ncclDataType_t`` (bfloat16: ml_dtypes', as tr_onnx's)."""
    name = _NUMPY[datatype]
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _host_array(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` at host address ``ptr``, as a NumPy view (no copy)."""
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype)


def with_nccl_path(session, world=None):
    """``session`` (a ``TrainingSession`` before its first step) planning the data-parallel
    step for ``world`` (default: a world of 1): the session trains a world of 1 as no world at
    all (no collective nodes), so the NCCL path is checked by registering one by hand. Returns
    the session."""
    from .. import distributed

    world = distributed.World() if world is None else world
    session.world = world
    session._state.world_id = distributed.register(world)
    return session


__all__ = ["HostCommunicator", "HostNccl", "with_nccl_path"]
