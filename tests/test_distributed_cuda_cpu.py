"""The cuda backend's NCCL path for data parallelism, checked without a GPU.

* The communicator: rank 0 makes the NCCL unique id, the World broadcasts it (MPI under
  ``mpiexec -n 2``), every rank joins with it; one communicator per world and device.
* The prepared call: ``NcclAllReduce`` goes through ``DeviceAPI.nccl_all_reduce``; on the real
  device that is ``allReduce(ptr, ptr, count, dtype, op, stream)`` on the step's stream; the
  recorder checks its buffer like a launch's (position in the plan, the phase's regions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tr_onnx import distributed
from tr_onnx.backends.cuda import nccl
from tr_onnx.backends.cuda.capture import DeviceBuffer
from tr_onnx.backends.cuda.device import CupyDevice
from tr_onnx.errors import DistributedError
from tr_onnx.testing.host_nccl import HostNccl

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(autouse=True)
def fresh_communicators(monkeypatch):
    """Each test makes its own communicators (the cache is per process)."""
    monkeypatch.setattr(nccl, "_COMMUNICATORS", {})


class RecordingWorld:
    """A World's shape for one rank of two, whose broadcast hands out rank 0's object."""

    def __init__(self, rank: int, root_object=None):
        self.rank, self.size, self.local_rank, self.comm = rank, 2, rank, object()
        self.root_object, self.broadcasts = root_object, []

    def bcast_object(self, obj=None, root=0):
        self.broadcasts.append((obj, root))
        return obj if self.rank == root else self.root_object


# --------------------------------------------------------------------------------------------
# The communicator
# --------------------------------------------------------------------------------------------

def test_rank_0_makes_the_id_and_broadcasts_it_through_the_world():
    world = RecordingWorld(0)
    host = HostNccl(world)
    comm = nccl.communicator(world, 0, nccl=host)
    ((what, rank, uid), joined) = host.ids
    assert (what, rank) == ("made", 0) and joined == ("joined", 0, uid)
    assert world.broadcasts == [(uid, 0)]
    assert (comm.size, comm.rank) == (2, 0)
    assert nccl.communicator(world, 0, nccl=host) is comm  # one per world and device
    assert nccl.communicator(world, 1, nccl=host) is not comm


def test_other_ranks_make_no_id_and_join_with_rank_0s():
    root_id = tuple(range(128))
    world = RecordingWorld(1, root_object=root_id)
    host = HostNccl(world)
    comm = nccl.communicator(world, 1, nccl=host)
    assert host.ids == [("joined", 1, root_id)]
    assert world.broadcasts == [(None, 0)]
    assert (comm.size, comm.rank) == (2, 1)


def test_a_world_of_one_needs_no_mpi_for_its_communicator():
    world = distributed.World()
    host = HostNccl(world)
    nccl.communicator(world, 0, nccl=host)
    assert [w for w, _, _ in host.ids] == ["made", "joined"]


def test_a_failed_join_names_the_rank_and_the_device():
    class Refusing(HostNccl):
        def NcclCommunicator(self, ndev, uid, rank):
            raise RuntimeError("ncclInvalidUsage: duplicate GPU")

    world = RecordingWorld(1, root_object=(0,) * 128)
    with pytest.raises(DistributedError, match="rank 1 of 2: joining the NCCL communicator on "
                       "device 3 failed: RuntimeError: ncclInvalidUsage") as e:
        nccl.communicator(world, 3, nccl=Refusing(world))
    assert e.value.rank == 1


def test_two_ranks_join_one_communicator_with_rank_0s_id_over_mpi(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(TESTS / "dist_nccl_id.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    made = [i for i in r0["ids"] if i[0] == "made"]
    assert len(made) == 1 and not [i for i in r1["ids"] if i[0] == "made"]
    assert r0["ids"][-1] == ["joined", 0, made[0][2]] and r1["ids"] == [["joined", 1, made[0][2]]]
    assert r0["cached"] and r1["cached"]
    want = (np.arange(6) + 5.0).tolist()  # the mean of x and x + 10
    assert r0["mean"] == want and r1["mean"] == want


# --------------------------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------------------------

def test_the_real_device_reduces_in_place_on_the_steps_stream():
    calls = []
    comm = SimpleNamespace(allReduce=lambda *a: calls.append(a))
    dev = object.__new__(CupyDevice)  # no GPU here: only the stream the call goes on
    dev.stream = SimpleNamespace(ptr=0xABC0)
    call = nccl.NcclAllReduce(comm, DeviceBuffer(1 << 40, 4096, True, "g"), 1024,
                              nccl.nccl_dtype(np.float32), nccl.NCCL_AVG)
    call.issue(dev)
    assert calls == [(1 << 40, 1 << 40, 1024, 7, 4, 0xABC0)]


@pytest.mark.parametrize(("dtype", "code"), [("float32", 7), ("float16", 6), ("bfloat16", 9),
                                             ("float64", 8)])
def test_nccl_data_types_are_ncclh_s(dtype, code):
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    assert nccl.nccl_dtype(np_dtype) == code


def test_an_integer_span_has_no_nccl_reduction_here():
    with pytest.raises(DistributedError, match="not int32"):
        nccl.nccl_dtype(np.int32)
