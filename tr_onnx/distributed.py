"""Data parallelism across processes: the world (rank, size, local rank) and its collectives.

Processes are launched by ``mpiexec``/``srun``; MPI (mpi4py, the optional extra ``[mpi]``) is
the engine that exchanges arrays between them on the CPU. A single process is a world of size
1 and never imports mpi4py, so the rest of tr_onnx calls the collectives unconditionally.

Every collective is started nonblocking and then polled against ``World.timeout_s``: a rank
that died or stopped taking part makes the others raise ``DistributedError`` naming this rank
and what it waited for, instead of hanging forever in ``MPI_Wait``.

Kernels of the step (``ops.collective``, synchronised BatchNorm) are bound from their node,
whose attributes can only be numbers or strings, so ``register`` puts a world into a
module-level table and the node carries its id; ``lookup`` returns it when the kernel is
bound (once per plan, not per step). The table keeps the world for the life of the process,
as the MPI communicator lives that long anyway.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import DistributedError

# launchers and the variable each sets to the number of ranks: mpiexec (MPICH/Intel MPI: PMI,
# Open MPI, MVAPICH), PMIx-based launchers, and srun (SLURM_STEP_NUM_TASKS is set by srun for
# the job step; SLURM_NTASKS alone is also set inside a plain sbatch shell, so it comes last
# and only counts together with SLURM_PROCID)
_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE",
             "SLURM_STEP_NUM_TASKS")

DEFAULT_TIMEOUT_S = 300.0

# deadline polling: spin on MPI_Test first (a collective of a small array completes within
# microseconds), then sleep in growing steps up to this many seconds, which bounds the latency
# a long wait adds while leaving the core to the other ranks
_SPIN_TESTS = 200
_MAX_SLEEP_S = 1e-3

# requests abandoned at a deadline keep their buffers alive here: MPI may still write into
# them if the late rank joins after all, and freeing them under it would corrupt memory
_abandoned: list[tuple[Any, Any]] = []

_worlds: dict[int, World] = {}
_comm_world = None  # this process's duplicate of MPI_COMM_WORLD, made once by init()


def launched_size() -> int:
    """The number of ranks the launcher started, from its environment (1 when none did)."""
    for name in _SIZE_ENV:
        value = os.environ.get(name)
        if value:
            try:
                return max(1, int(value))
            except ValueError:
                continue
    if os.environ.get("SLURM_PROCID") is not None and os.environ.get("SLURM_NTASKS"):
        try:
            return max(1, int(os.environ["SLURM_NTASKS"]))
        except ValueError:
            return 1
    return 1


@dataclass(frozen=True)
class World:
    """The processes training together: this one's ``rank`` of ``size``, its ``local_rank`` on
    its machine (which GPU it takes), and the MPI communicator (None for a world of 1).

    Every collective is a no-op at size 1 and raises ``DistributedError`` when the other ranks
    have not joined it within ``timeout_s`` seconds."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    comm: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    # all-reduces started (``start_allreduce_sum_``) and not yet completed: (request, array)
    _started: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise DistributedError(f"World: rank {self.rank} is outside 0..{self.size - 1}")
        if self.size > 1 and self.comm is None:
            raise DistributedError(f"World: rank {self.rank} of {self.size} has no "
                                   f"communicator (comm=None is a world of 1)")
        if not self.timeout_s > 0:
            raise DistributedError(f"World: timeout_s must be > 0 seconds, got "
                                   f"{self.timeout_s!r}")

    @property
    def is_root(self) -> bool:
        """True on rank 0, the rank that prints, writes files and whose state is broadcast."""
        return self.rank == 0

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"timeout_s={self.timeout_s})")

    # -- the collectives --------------------------------------------------------------

    def allreduce_sum_(self, array: np.ndarray) -> np.ndarray:
        """Sum ``array`` over all ranks, in place (``MPI_IN_PLACE``: no copy); returns it.
        ``array`` must be C-contiguous and of a dtype MPI knows (float32/64, ints)."""
        return self._allreduce(array, "SUM", "allreduce_sum_")

    def allreduce_max_(self, array: np.ndarray) -> np.ndarray:
        """``array`` replaced by its elementwise maximum over all ranks, in place (a flag any
        rank raised, raised on all); returns it. As ``allreduce_sum_`` for the rest."""
        return self._allreduce(array, "MAX", "allreduce_max_")

    def _allreduce(self, array: np.ndarray, op: str, what: str) -> np.ndarray:
        if self.size == 1:
            return array
        from mpi4py import MPI
        self._check_buffer(array, what)
        req = self.comm.Iallreduce(MPI.IN_PLACE, array, op=getattr(MPI, op))
        self.wait(req, f"{what} of {_describe(array)}", keep=array)
        return array

    def start_allreduce_sum_(self, array: np.ndarray) -> None:
        """Start summing ``array`` over all ranks in place and return at once; the sum is
        there after ``wait_started``. Every rank must start the same arrays in the same order.
        Earlier ones are tested on the way, so the MPI library moves them along."""
        if self.size == 1:
            return
        from mpi4py import MPI
        self._check_buffer(array, "start_allreduce_sum_")
        self._started.append((self.comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), array))
        MPI.Request.Testall([req for req, _ in self._started])

    def wait_started(self) -> None:
        """Complete every all-reduce ``start_allreduce_sum_`` began, each within
        ``timeout_s``."""
        started, self._started[:] = list(self._started), []
        for k, (req, array) in enumerate(started):
            self.wait(req, f"allreduce_sum_ of {_describe(array)} (started, {k + 1} of "
                           f"{len(started)})", keep=array)

    def allreduce_mean_(self, array: np.ndarray) -> np.ndarray:
        """Average ``array`` over all ranks, in place (sum, then a divide by ``size``, as
        PyTorch DDP averages gradients); returns it."""
        if self.size == 1:
            return array
        self.allreduce_sum_(array)
        np.divide(array, self.size, out=array)
        return array

    def bcast_(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with rank ``root``'s, in place; returns it."""
        if self.size == 1:
            return array
        self._check_root(root, "bcast_")
        self._check_buffer(array, "bcast_")
        req = self.comm.Ibcast(array, root=root)
        self.wait(req, f"bcast_ of {_describe(array)} from rank {root}", keep=array)
        return array

    def allreduce_scalars(self, values: list[float]) -> list[float]:
        """The sum over ranks of each of ``values`` (float64), as a new list: one message for
        a handful of metrics (loss sums, sample counts)."""
        if self.size == 1:
            return [float(v) for v in values]
        buf = np.array(values, dtype=np.float64).reshape(-1)
        self.allreduce_sum_(buf)
        return [float(v) for v in buf]

    def allgather_int(self, value: int) -> list[int]:
        """Every rank's ``value`` (an integer), in rank order, on every rank: one all-reduce
        of a vector that holds this rank's value at its index and zeros elsewhere."""
        if self.size == 1:
            return [int(value)]
        buf = np.zeros(self.size, np.int64)
        buf[self.rank] = value
        self._allreduce(buf, "SUM", "allgather_int")
        return [int(v) for v in buf]

    def bcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` (any picklable object) on every rank; other ranks' ``obj``
        is ignored."""
        if self.size == 1:
            return obj
        self._check_root(root, "bcast_object")
        payload = (np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                                 dtype=np.uint8) if self.rank == root else None)
        length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
        self.bcast_(length, root)
        buf = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
        self.bcast_(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""
        if self.size == 1:
            return
        self.wait(self.comm.Ibarrier(), "barrier")

    # -- deadlines ----------------------------------------------------------------------

    def wait(self, request, what: str, keep: Any = None) -> None:
        """Complete the nonblocking MPI ``request`` (a collective started by this rank) within
        ``timeout_s``, or raise ``DistributedError`` naming this rank and ``what`` it waited
        for. ``keep`` is the buffer the request writes: kept alive if the wait is abandoned."""
        if request.Test():
            return
        for _ in range(_SPIN_TESTS):
            if request.Test():
                return
        start = time.monotonic()
        deadline = start + self.timeout_s
        sleep = 1e-5
        while not request.Test():
            now = time.monotonic()
            if now >= deadline:
                _abandoned.append((request, keep))
                raise DistributedError(
                    f"rank {self.rank} of {self.size}: {what} did not complete within "
                    f"{self.timeout_s:g} s; another rank died or stopped taking part (a "
                    f"collective cannot tell which one: look for the rank that failed first "
                    f"in the launcher's output)", rank=self.rank, waited_for=what)
            time.sleep(min(sleep, deadline - now))
            sleep = min(sleep * 2, _MAX_SLEEP_S)

    def _check_buffer(self, array, what: str) -> None:
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise DistributedError(f"rank {self.rank}: {what} needs a C-contiguous numpy "
                                   f"array, got {_describe(array)}", rank=self.rank)
        if array.dtype.kind not in "fiub" or array.dtype.itemsize > 8 or (
                array.dtype.kind == "f" and array.dtype.itemsize < 4):
            raise DistributedError(f"rank {self.rank}: {what} of dtype {array.dtype} has no MPI "
                                   f"datatype (float32/float64/integers do)", rank=self.rank)

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise DistributedError(f"rank {self.rank}: {what} root={root} is outside "
                                   f"0..{self.size - 1}", rank=self.rank)


def _describe(array) -> str:
    if isinstance(array, np.ndarray):
        return f"{array.size} {array.dtype} ({array.nbytes} bytes)"
    return type(array).__name__


def init(timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """This process's world: from MPI when the launcher (``mpiexec``, ``srun``) started more
    than one rank, else a world of 1 without importing mpi4py. Collectives wait at most
    ``timeout_s`` seconds for the other ranks."""
    global _comm_world
    if launched_size() == 1:
        return World(0, 1, 0, None, timeout_s)
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise DistributedError(
            f"the launcher started {launched_size()} ranks, but mpi4py is not installed: "
            f"pip install 'tr_onnx[mpi]' (and an MPI library, e.g. the mpich wheel)") from exc
    if _comm_world is None:
        # a duplicate, so that tr_onnx's collectives never match a user's own on COMM_WORLD
        _comm_world = MPI.COMM_WORLD.Dup()
    comm = _comm_world
    if comm.Get_size() == 1:
        return World(0, 1, 0, None, timeout_s)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank = node.Get_rank()
    node.Free()
    return World(comm.Get_rank(), comm.Get_size(), local_rank, comm, timeout_s)


def register(world: World) -> int:
    """Put ``world`` into the table kernels read it from; returns its id (a node attribute)."""
    key = id(world)
    _worlds[key] = world
    return key


def lookup(key: int) -> World:
    """The world ``register`` returned ``key`` for."""
    try:
        return _worlds[key]
    except KeyError:
        raise DistributedError(f"no World registered under id {key} (registered: "
                               f"{sorted(_worlds)}); a plan carrying a collective node "
                               f"must be made by the TrainingSession that registered it"
                               ) from None
