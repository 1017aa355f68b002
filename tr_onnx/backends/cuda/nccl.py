"""NCCL for the cuda backend: the communicator of a ``distributed.World`` and the all-reduce
call a binding prepares (``ops/distributed.py``).

``NcclBroadcast`` gives every rank rank 0's running statistics (BroadcastStats), the same way.

The communicator is made once per world and device, when the first plan carrying a
``GradAllReduce`` is bound (every rank binds the same plan, so every rank takes part): rank 0
makes the NCCL unique id, the world broadcasts it with MPI (``World.bcast_object``), and each
rank joins with its rank. ``NcclAllReduce`` is a prepared call like ``bind.Launch``: issued
through ``DeviceAPI.nccl_all_reduce`` on the step's stream, so it is captured in the step's
CUDA graph (NCCL >= 2.9 calls can be captured) and ordered before the step guard reads the
reduced gradients.

CuPy's ``cupy.cuda.nccl`` is imported only inside ``nccl_module`` (it needs libnccl from
``nvidia-nccl-cu12`` / ``-cu13``); tests pass a module of their own to ``communicator``.
Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import DistributedError
from ...ir import Phase
from .capture import DeviceBuffer

# ncclDataType_t and ncclRedOp_t of nccl.h: the C ABI NCCL keeps across releases (CuPy names
# them NCCL_FLOAT32, NCCL_SUM...; written here so planning needs no libnccl)
NCCL_DTYPES = {"float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
NCCL_SUM, NCCL_MAX, NCCL_AVG = 0, 2, 4
"""ncclAvg (NCCL >= 2.10) divides by the number of ranks inside the reduction, so a mean
costs no kernel of its own; ncclMax spreads a rank's bad-batch flag to all (StepCheck)."""


def nccl_module():
    """``cupy.cuda.nccl``, or ``DistributedError`` saying what to install when libnccl is
    missing (CuPy imports the module anyway and only fails when it is used)."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise DistributedError(f"the cuda backend's all-reduce needs CuPy's NCCL binding: {e}"
                               ) from e
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise DistributedError("the cuda backend's all-reduce needs libnccl: pip install "
                               "nvidia-nccl-cu13 (or -cu12, as the CuPy wheel)")
    return nccl


_COMMUNICATORS: dict[tuple, Any] = {}
"""(id of the MPI communicator, rank, size, device id) -> the NCCL communicator, for the
process: every plan of a session (and every session of one world) shares one."""


def communicator(world, device_id: int = 0, nccl=None):
    """The NCCL communicator of ``world`` on CUDA device ``device_id`` (made on first use:
    rank 0's unique id broadcast through ``world.bcast_object``, then every rank joins; a
    collective call, so every rank must make it). ``nccl``: the module (default
    ``nccl_module()``)."""
    key = (id(world.comm), world.rank, world.size, device_id)
    comm = _COMMUNICATORS.get(key)
    if comm is None:
        nccl = nccl_module() if nccl is None else nccl
        uid = nccl.get_unique_id() if world.rank == 0 else None
        uid = world.bcast_object(uid, root=0)
        try:
            comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        except Exception as e:  # NcclError: two ranks on one GPU, a network that is down...
            raise DistributedError(f"rank {world.rank} of {world.size}: joining the NCCL "
                                   f"communicator on device {device_id} failed: "
                                   f"{type(e).__name__}: {e}", rank=world.rank) from e
        _COMMUNICATORS[key] = comm
    return comm


def nccl_dtype(dtype) -> int:
    """The ``ncclDataType_t`` of a NumPy dtype (float16/32/64, bfloat16)."""
    name = np.dtype(dtype).name
    if name not in NCCL_DTYPES:
        raise DistributedError(f"NCCL all-reduces {', '.join(NCCL_DTYPES)}, not {name}")
    return NCCL_DTYPES[name]


@dataclass
class NcclAllReduce:
    """An in-place all-reduce of ``count`` elements of ``buf`` (``dtype``: ncclDataType_t,
    ``op``: ncclRedOp_t) over ``comm``; ``rank``/``size`` name the world in errors."""

    comm: Any
    buf: DeviceBuffer
    count: int
    dtype: int
    op: int
    rank: int = 0
    size: int = 1

    def issue(self, device) -> None:
        device.nccl_all_reduce(self.comm, self.buf, self.count, self.dtype, self.op)


def node_communicator(b, node) -> tuple[Any, Any]:
    """(world, NCCL communicator) of a collective node: the ``distributed.World`` its
    ``world`` attribute names, on the device the plan is bound to (``b``: the BindContext)."""
    from ...distributed import lookup

    world = lookup(int(node.attrs["world"]))
    return world, communicator(world, getattr(b.device, "device_id", 0))


def node_all_reduce(b, node, buf: DeviceBuffer, count: int, dtype: int,
                    op: int) -> NcclAllReduce:
    """The in-place all-reduce of ``count`` elements of ``buf`` over ``node``'s world."""
    world, comm = node_communicator(b, node)
    return NcclAllReduce(comm, buf, count, dtype, op, world.rank, world.size)


BROADCAST_PHASE = Phase.BROADCAST
"""The write policy a broadcast of rank 0's running statistics runs under
(``capture.WRITE_POLICY``): it writes PARAM at the start of the step, before any BatchNorm reads
them, as the commit phase writes them at its end."""


@dataclass
class NcclBroadcast:
    """Rank ``root``'s ``count`` elements of ``buf`` into every rank's, in place, over
    ``comm``. Issued under ``BROADCAST_PHASE``'s write policy, then the node's own phase again."""

    comm: Any
    buf: DeviceBuffer
    count: int
    dtype: int
    root: int = 0

    def issue(self, device) -> None:
        label, phase = device.node, device.phase
        device.begin_node(label, BROADCAST_PHASE)
        try:
            device.nccl_broadcast(self.comm, self.buf, self.count, self.dtype, self.root)
        finally:
            device.begin_node(label, phase)


__all__ = ["BROADCAST_PHASE", "NCCL_AVG", "NCCL_DTYPES", "NCCL_MAX", "NCCL_SUM", "NcclAllReduce",
           "NcclBroadcast", "communicator", "nccl_dtype", "nccl_module", "node_all_reduce",
           "node_communicator"]
