"""The cuda backend's NCCL path for data parallelism, checked without a GPU.

* The communicator: rank 0 makes the NCCL unique id, the World broadcasts it (MPI under
  ``mpiexec -n 2``), every rank joins with it; one communicator per world and device.
* The prepared call: ``NcclAllReduce`` goes through ``DeviceAPI.nccl_all_reduce``; on the real
  device that is ``allReduce(ptr, ptr, count, dtype, op, stream)`` on the step's stream; the
  recorder checks its buffer like a launch's (position in the plan, the phase's regions).
* Synchronised BatchNorm (``sync_batchnorm=True``): its own kernels with NCCL sums of float64
  between them, at a world of 1 against cuDNN's BatchNorm and numpy, and on two emulated ranks
  against two numpy ranks. A caution for new tests: the host emulator runs a cuDNN node through
  its NumPy kernel, which honours a ``world`` attribute itself (MPI), so a synchronised node
  wrongly bound to cuDNN would still train synchronised here; the bound calls say which it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures
from test_distributed import mpiexec  # the mpich wheel's launcher, beside the interpreter

import tr_onnx
from tr_onnx import distributed
from tr_onnx.backends.cuda import device as cuda_device
from tr_onnx.backends.cuda import nccl
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.backends.cuda.capture import DeviceBuffer
from tr_onnx.backends.cuda.device import CupyDevice
from tr_onnx.errors import DistributedError
from tr_onnx.memory import Region
from tr_onnx.optim import SGD
from tr_onnx.registry import build_registry
from tr_onnx.testing.host_emulator import build_host_library, host_emulator
from tr_onnx.testing.host_nccl import HostNccl, with_nccl_path

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


@pytest.mark.parametrize(("module", "message"), [
    (SimpleNamespace(available=False), "needs libnccl: pip install nvidia-nccl-cu13"),
    (None, "needs CuPy's NCCL binding")], ids=["no-libnccl", "no-cupy"])
def test_a_missing_nccl_says_what_to_install(monkeypatch, module, message):
    cuda = SimpleNamespace() if module is None else SimpleNamespace(nccl=module)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.delitem(sys.modules, "cupy.cuda.nccl", raising=False)
    with pytest.raises(DistributedError, match=message):
        nccl.nccl_module()


def test_two_ranks_join_one_communicator_with_rank_0s_id_over_mpi(tmp_path):
    mpiexec("dist_nccl_id.py", tmp_path)
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


# --------------------------------------------------------------------------------------------
# The binding in a training plan: a world of 1 through the NCCL path (host emulator)
# --------------------------------------------------------------------------------------------

SHAPES = {"mlp": (4, 64), "lenet": (4, 1, 8, 8), "resnet": (4, 3, 16, 16)}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The sessions' device factory: the host emulator over one host build of the kernels."""
    return host_emulator(build_host_library(tmp_path_factory.mktemp("host_kernels")))


@pytest.fixture
def host_nccl(monkeypatch):
    """``cupy.cuda.nccl`` replaced by the host stand-in of a world of 1."""
    host = HostNccl(distributed.World())
    monkeypatch.setattr(nccl, "nccl_module", lambda: host)
    return host


def _batch(stem: str, i: int):
    x = np.random.default_rng(i).standard_normal(SHAPES[stem]).astype(np.float32)
    return {"input": x}, np.arange(SHAPES[stem][0]) % 10


def _session(stem, device, world: bool, **kw):
    sess = tr_onnx.TrainingSession(ROOT / "model_zoo" / f"{stem}.onnx", channel_align=8,
                                   optimizer=SGD(lr=0.05, momentum=0.9),
                                   backend=CudaBackend(device=device), **kw)
    if world:
        with_nccl_path(sess)
    return sess


@pytest.mark.parametrize("op", ["GradAllReduceStart", "GradAllReduceWait"])
def test_the_bindings_are_registered_for_the_cuda_backend(op):
    opdef = build_registry().lookup("ai.tr_onnx", op, 1, "cuda")
    assert opdef is not None and "cuda" in opdef.kernels and "numpy" in opdef.kernels


def test_a_world_of_one_plans_the_same_state_with_and_without_the_nccl_node(device,
                                                                           host_nccl):
    """PARAM, GRAD and OPT_STATE: regions of the same sizes, every tensor at the same offset
    in its region (state and checkpoints are interchangeable); CONST the same but for the
    backward pass's seed, a constant 1 in one process and the per-step ``ROW_WEIGHT`` input
    in a world (one 256-byte slot). The data-parallel pass moves each Accumulate up to its
    gradient's producer (buckets finish early) and adds the ``reduce`` flag and the row
    weight, so INPUT grows by three scalars and activations live shorter."""
    plain, nccl_path = _session("mlp", device, False), _session("mlp", device, True)
    feed, y = _batch("mlp", 0)
    a, b = plain._train_plan(feed), nccl_path._train_plan(feed)
    state = (Region.PARAM, Region.GRAD, Region.OPT_STATE)
    assert {r: a.memory.regions[r][1] for r in state} == \
        {r: b.memory.regions[r][1] for r in state}
    assert a.memory.regions[Region.CONST][1] == b.memory.regions[Region.CONST][1] + 256

    def layout(plan):
        return {(t.name, t.offset - plan.memory.regions[t.region][0], t.nbytes)
                for t in plan.memory.all_tensors()
                if t.region in state and "/bucket" not in t.name}

    assert layout(a) == layout(b)
    assert a.memory.regions[Region.ACTIVATION][1] >= b.memory.regions[Region.ACTIVATION][1]
    (node,) = [n for n in b.graph.nodes if n.op_type == "GradAllReduceWait"]
    assert node.phase == "reduce" and not [n for n in a.graph.nodes
                                            if n.op_type == "GradAllReduceWait"]
    # the step guard decides after the reduction: the one-graph step runs reduce, then guard
    nccl_path.train_step(feed, y)
    ex = nccl_path._state.active.executor
    order = [s.phase for s in ex.steps(ex.step_phases())]
    assert ex.step_phases() == "compute+reduce+guard+commit+discard+apply+report"
    assert order.index("reduce") < order.index("guard") and order.count("reduce") == 1
    assert ex.step_phases(apply=False) == "compute+guard+commit+discard+report"


def test_the_nccl_call_is_the_grad_span_averaged_in_place_in_the_captured_step(device,
                                                                             host_nccl):
    sess = _session("mlp", device, True)
    for i in range(3):  # eager, captured, replayed
        sess.train_step(*_batch("mlp", i))
    ex = sess._state.active.executor
    dev, info = ex.device, sess._state.active.info
    span = ex.memory.tensors[info.grads_span]
    calls = [c for c in dev.calls if c.op == "nccl_all_reduce" and c.phase == "reduce"]
    assert [c.capturing for c in calls] == [False, True]  # step 3 replays the graph
    for c in calls:
        assert "(GradAllReduceWait, ai.tr_onnx v1)" in c.node
        buf = c.args["buf"]
        assert (buf.ptr, buf.nbytes, buf.writes) == (dev.arena_base + span.offset, span.nbytes,
                                                     True)
        assert (c.args["count"], c.args["dtype"], c.args["redop"]) == (
            span.nbytes // 4, nccl.NCCL_DTYPES["float32"], nccl.NCCL_AVG)
        assert c.args["comm"].size == 1 and c.args["comm"].rank == 0
    # what ran: eager, then the graph's launch twice, on the emulator's host arena
    averages = [c for c in host_nccl.calls if c.get("op") == nccl.NCCL_AVG]
    assert [c["call"] for c in averages] == ["allReduce"] * 3
    assert {(c["send"] == c["recv"], c["count"], c["stream"]) for c in averages} == {
        (True, span.nbytes // 4, 0)}
    assert not [c for c in dev.calls if c.op == "launch" and c.phase == "reduce"]
    poison = [c for c in dev.calls if c.op == "launch"
              and c.args["kernel"].name == "tr_poison_nonfinite_f32"]
    assert poison and {c.phase for c in poison} == {"compute"}
    assert all("(GradAllReduceStart, ai.tr_onnx v1)" in c.node for c in poison)
    assert list(ex.graphs) == ["compute+reduce+guard+commit+discard+apply+report"]


@pytest.mark.parametrize(("stem", "kw"), [
    ("mlp", {}), ("lenet", {"grad_bucket_mb": 0.01}), ("mlp", {"grad_accumulation": 2}),
    ("resnet", {}), ("mlp", {"precision": "fp16"}),
    ("lenet", {"precision": "bf16", "grad_bucket_mb": 0.01}), ("resnet", {"precision": "fp16"})],
    ids=["mlp", "lenet-small-buckets", "mlp-accumulation", "resnet-bn", "mlp-fp16",
         "lenet-bf16-small-buckets", "resnet-fp16"])
def test_a_world_of_one_through_nccl_trains_exactly_as_without(stem, kw, device, host_nccl):
    plain, nccl_path = _session(stem, device, False, **kw), _session(stem, device, True, **kw)
    for i in range(4):
        feed, y = _batch(stem, i)
        assert nccl_path.train_step(feed, y) == plain.train_step(feed, y)
    a, b = plain.state_arrays(), nccl_path.state_arrays()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    starts = [n for n in nccl_path._state.active.graph.nodes if n.op_type == "GradAllReduceStart"]
    assert len(starts) > 1 if "grad_bucket_mb" in kw else len(starts) == 1
    reduces = [c for c in host_nccl.calls if c.get("op") == nccl.NCCL_AVG]
    assert len(reduces) == nccl_path.step  # one all-reduce per applied step
    flags = [c for c in host_nccl.calls if c.get("op") == nccl.NCCL_MAX]
    assert len(flags) == 4 and {c["count"] for c in flags} == {1}  # one per micro-batch
    broadcasts = [c for c in host_nccl.calls if c["call"] == "broadcast"]
    stats = nccl_path._state.active.info.running_stats
    assert len(broadcasts) == 4 * len(stats)  # one per running statistic and micro-batch


@pytest.mark.parametrize(("loss", "poisoned"), [(np.inf, True), (np.nan, True),
                                              (2.5, False)], ids=["inf", "nan", "finite"])
def test_a_rank_with_a_non_finite_loss_sends_nan_gradients(device, host_nccl, loss, poisoned):
    """So every rank's average is NaN and every rank's guard drops the same step."""
    sess = _session("mlp", device, True)
    sess.train_step(*_batch("mlp", 0))
    ex = sess._state.active.executor
    dev, info = ex.device, sess._state.active.info
    starts = [bn for bn in ex.bound if bn.node.op_type == "GradAllReduceStart"]
    grads = ex.memory.tensors[info.grads_span].kernel_view(dev.arena)
    grads[...] = np.linspace(-1, 1, grads.size, dtype=np.float32).reshape(grads.shape)
    before = grads.copy()
    ex.memory.tensors[info.loss].kernel_view(dev.arena)[...] = loss
    for bound in starts:  # the buckets together cover the span
        dev.begin_node(bound.label, bound.phase)
        bound.run(dev)
    if poisoned:
        assert np.isnan(grads).all()
    else:
        np.testing.assert_array_equal(grads, before)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_bad_batch_flag_is_the_ranks_maximum_in_the_guard_before_anything_reads_it(
        device, host_nccl, accumulation):
    """Ranks that judged a micro-batch alone would drop different ones, and one would then
    reduce while another accumulates: the flag StepCheck sets is all-reduced (ncclMax) right
    after it, before the commits, the discard, the update and the report read it."""
    sess = _session("mlp", device, True, grad_accumulation=accumulation)
    for i in range(3):
        sess.train_step(*_batch("mlp", i))
    ex = sess._state.active.executor
    dev, guard = ex.device, sess._state.active.info.step_guard
    flag = ex.memory.tensors[guard.bad_batch]
    calls = [c for c in dev.calls if c.op == "nccl_all_reduce" and c.phase == "guard"]
    assert len(calls) >= 2 and any(c.capturing for c in calls)
    for c in calls:
        assert "(StepCheck, ai.tr_onnx v1)" in c.node
        assert (c.args["buf"].ptr, c.args["buf"].writes, c.args["count"], c.args["dtype"],
                c.args["redop"]) == (dev.arena_base + flag.offset, True, 1,
                                     nccl.NCCL_DTYPES["float32"], nccl.NCCL_MAX)
    for key in ex.graphs:
        steps = ex.steps(key)
        check = next(k for k, s in enumerate(steps) if "StepCheck" in s.label)
        # nothing before it reads the flag (a step that applies reduces its gradients first)
        assert {s.phase for s in steps[:check]} <= {"compute", "reduce"}
    plain = _session("mlp", device, False, grad_accumulation=accumulation)
    plain.train_step(*_batch("mlp", 0))
    assert not [bound for bound in plain._state.active.executor.bound if
                bound.node.op_type == "StepCheck" and "world" in bound.node.attrs]


def test_a_non_finite_step_is_dropped_as_without_the_nccl_path(device, host_nccl):
    plain, nccl_path = _session("mlp", device, False), _session("mlp", device, True)
    feed, y = _batch("mlp", 0)
    bad = {"input": np.full_like(feed["input"], np.inf)}
    for sess in (plain, nccl_path):
        sess.train_step(feed, y)
        with pytest.warns(RuntimeWarning, match="non-finite loss"):
            sess.train_step(bad, y)
        sess.train_step(*_batch("mlp", 1))
    assert nccl_path.bad_steps == plain.bad_steps and nccl_path.step == plain.step == 2
    a, b = plain.state_arrays(), nccl_path.state_arrays()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_rank_0s_running_statistics_are_broadcast_first_under_their_own_write_policy(
        device, host_nccl):
    sess = _session("resnet", device, True)
    for i in range(2):
        sess.train_step(*_batch("resnet", i))
    ex = sess._state.active.executor
    dev, stats = ex.device, sess._state.active.info.running_stats
    calls = [c for c in dev.calls if c.op == "nccl_broadcast"]
    assert len(calls) == 2 * len(stats) and [c.capturing for c in calls] == (
        [False] * len(stats) + [True] * len(stats))
    for c, name in zip(calls, stats * 2):
        t = ex.memory.tensors[name]
        assert c.phase == "broadcast" and "(BroadcastStats, ai.tr_onnx v1)" in c.node
        assert (c.args["buf"].ptr, c.args["buf"].name, c.args["count"], c.args["root"]) == (
            dev.arena_base + t.offset, name, t.nbytes // 4, 0)
    first = ex.steps(ex.step_phases())[0]  # before any BatchNorm reads them
    assert first.phase == "compute" and "BroadcastStats" in first.label
    assert dev.phase != "broadcast"  # the node's own phase again after each call


def test_each_rank_takes_the_gpu_of_its_local_rank(device, host_nccl, monkeypatch):
    sess = _session("mlp", device, True)
    plan = sess._train_plan(_batch("mlp", 0)[0])
    opened = []

    def cupy_device(memory, device_id=0):
        opened.append(device_id)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(cuda_device, "CupyDevice", cupy_device)
    monkeypatch.setattr(plan.info, "world", distributed.World(0, 1, local_rank=3))
    with pytest.raises(RuntimeError, match="no GPU here"):
        CudaBackend().executor(plan)
    assert opened == [3]


# --------------------------------------------------------------------------------------------
# Synchronised BatchNorm: its own kernels, NCCL all-reduces of float64 sums between them
# --------------------------------------------------------------------------------------------

def _padded_bn_model():
    """x [N, 3, 8, 8] -> Conv(6) -> BatchNorm(6) -> Relu -> Conv(12) -> BatchNorm(12) -> Relu
    -> GlobalAveragePool -> Flatten -> Gemm(10): BatchNorm over 6 of 8 and 12 of 16 lanes."""
    rng = np.random.default_rng(3)
    inits = []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def conv_bn(x, k, cin, c):
        return [helper.make_node("Conv", [x, init(f"w{k}", rng.standard_normal((c, cin, 3, 3))
                                                  * 0.3)], [f"conv{k}"], pads=[1, 1, 1, 1]),
                helper.make_node("BatchNormalization", [
                    f"conv{k}", init(f"scale{k}", rng.uniform(0.5, 2, c)),
                    init(f"bias{k}", rng.standard_normal(c) * 0.1), init(f"mean{k}", np.zeros(c)),
                    init(f"var{k}", np.ones(c))], [f"bn{k}"]),
                helper.make_node("Relu", [f"bn{k}"], [f"relu{k}"])]

    nodes = [*conv_bn("input", 0, 3, 6), *conv_bn("relu0", 1, 6, 12),
             helper.make_node("GlobalAveragePool", ["relu1"], ["pool"]),
             helper.make_node("Flatten", ["pool"], ["flat"]),
             helper.make_node("Gemm", ["flat", init("fc", rng.standard_normal((10, 12)) * 0.3),
                                       init("fc_bias", np.zeros(10))], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "padded_bn", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                           ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])


def _sync_bn_nodes(executor) -> list:
    return [bound for bound in executor.bound
            if bound.node.op_type in ("BatchNormTraining", "BatchNormGrad")]


def test_sync_batchnorm_all_reduces_float64_sums_between_its_kernels_in_the_captured_step(
        device, host_nccl):
    """Forward: [sum x | rows] (C + 1) then the sums of (x - mean)^2 (C); backward:
    [sum gy (x - mean) | sum gy | rows] (2C + 1): ncclSum of float64, in place in the node's
    own scratch, between the kernels that need them; no cuDNN call, no broadcast of rank 0's
    running statistics."""
    sess = _session("resnet", device, True, sync_batchnorm=True)
    for i in range(3):  # eager, captured, replayed
        sess.train_step(*_batch("resnet", i))
    ex = sess._state.active.executor
    dev, scratch = ex.device, {t.name: t for t in ex.memory.all_tensors()}
    bound = _sync_bn_nodes(ex)
    assert len(bound) == 12 and all("world" in bn.node.attrs for bn in bound)
    f64, total = nccl.NCCL_DTYPES["float64"], nccl.NCCL_SUM
    want = {}
    for bn in bound:
        forward = bn.node.op_type == "BatchNormTraining"
        c = bn.node.inputs[0 if forward else 1].shape[1]
        want[bn.label] = [(c + 1, f64, total), (c, f64, total)] if forward else \
            [(2 * c + 1, f64, total)]
        steps = ["allReduce" if isinstance(call, nccl.NcclAllReduce) else call.kernel.name
                 for call in bn.calls]
        assert steps == ([
            "tr_bn_sums_f32", "tr_bn_sum_chunks", "allReduce", "tr_bn_sync_mean",
            "tr_bn_running_f32", "tr_bn_sum_chunks", "allReduce", "tr_bn_sync_finish",
            "tr_bn_normalize_f32"] if forward else [
            "tr_bn_grad_sums_f32", "tr_bn_sum_chunks", "tr_bn_grad_params", "allReduce",
            "tr_bn_grad_dx_f32"]), bn.label
    check_launch_arguments([c for bn in bound for c in bn.calls if isinstance(c, Launch)], ex,
                           kernel_signatures())
    calls = [c for c in dev.calls if c.op == "nccl_all_reduce" and c.phase == "compute"]
    per_step = sum(len(w) for w in want.values())
    assert per_step == 18 and [c.capturing for c in calls] == [False] * 18 + [True] * 18
    for step in (calls[:18], calls[18:]):
        got = {}
        for c in step:
            got.setdefault(c.node, []).append((c.args["count"], c.args["dtype"],
                                               c.args["redop"]))
            buf, t = c.args["buf"], scratch[c.args["buf"].name]
            assert t.region == Region.WORKSPACE and buf.name.startswith(c.node.split("'")[1])
            assert (buf.ptr, buf.nbytes, buf.writes) == (dev.arena_base + t.offset,
                                                         8 * c.args["count"], True)
        assert got == want
    sums = [(c["count"], c["dtype"]) for c in host_nccl.calls if c.get("op") == total]
    assert len(sums) == 3 * 18 and {d for _, d in sums} == {f64}  # eager, then two replays
    assert not [n for n in sess._state.active.graph.nodes if n.op_type == "BroadcastStats"]
    assert not [c for c in host_nccl.calls if c["call"] == "broadcast"]


SYNC_MODELS = {"resnet": lambda: ROOT / "model_zoo" / "resnet.onnx",
               "padded_lanes": _padded_bn_model}


@pytest.mark.parametrize("model", list(SYNC_MODELS))
def test_a_world_of_one_with_sync_batchnorm_trains_as_cudnn_and_numpy(model, device, host_nccl):
    """A world of 1 through the NCCL path, sync_batchnorm: the same losses, parameters,
    running statistics and optimizer state as the plain cuda session (cuDNN's BatchNorm, here
    its NumPy emulation) and the numpy backend, within float32 rounding."""
    shape = SHAPES["resnet"] if model == "resnet" else (4, 3, 8, 8)
    kw = {"channel_align": 8, "optimizer": SGD(lr=0.05, momentum=0.9)}
    sync = with_nccl_path(tr_onnx.TrainingSession(
        SYNC_MODELS[model](), backend=CudaBackend(device=device), sync_batchnorm=True, **kw))
    refs = {"cudnn": tr_onnx.TrainingSession(SYNC_MODELS[model](),
                                             backend=CudaBackend(device=device), **kw),
            "numpy": tr_onnx.TrainingSession(SYNC_MODELS[model](), backend="numpy", **kw)}
    for i in range(4):
        feed = {"input": np.random.default_rng(i).standard_normal(shape).astype(np.float32)}
        y = np.arange(shape[0]) % 10
        loss = sync.train_step(feed, y)
        for name, ref in refs.items():
            np.testing.assert_allclose(loss, ref.train_step(feed, y), rtol=1e-5, err_msg=name)
    assert len(_sync_bn_nodes(sync._state.active.executor)) == (12 if model == "resnet" else 4)
    got = sync.state_arrays()
    for name, ref in refs.items():
        want = ref.state_arrays()
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-6,
                                       err_msg=f"{name}: {k}")


# --------------------------------------------------------------------------------------------
# Two ranks, emulated: the NCCL path's all-reduce is MPI's on the host emulator's arena
# --------------------------------------------------------------------------------------------

EMULATED = ["mlp", "lenet-small-buckets", "mlp-inf-on-rank1", "resnet-bn-ddp",
            "mlp-accum-inf-on-rank1", "resnet-sync-batchnorm", "mlp-fp16-inf-on-rank1",
            "resnet-bf16-ddp", "mobilenet-dropout-sync-batchnorm", "mlp-unequal-rows"]
# cuda in half precision against numpy in float32: (losses' rtol, parameters' atol) of the
# storage's rounding -- fp16 keeps 11 significant bits, bf16 8 (an ulp of bf16 at 1.5, the
# largest ResNet weight, is 7.8e-3); measured 1.4e-5 / 1.6e-5 and 6e-4 / 1.5e-3
HALF = {"mlp-fp16-inf-on-rank1": (1e-4, 1e-4), "resnet-bf16-ddp": (2e-3, 4e-3)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/dist_cuda_emulated.py under ``mpiexec -n 2``, every case in one job."""
    lib_dir = tmp_path_factory.mktemp("host_kernels_2ranks")
    build_host_library(lib_dir)
    out = tmp_path_factory.mktemp("emulated")
    mpiexec("dist_cuda_emulated.py", out, lib_dir / "kernels.so", *EMULATED, timeout=300)
    return out


@pytest.mark.parametrize("case", EMULATED)
def test_two_emulated_cuda_ranks_train_as_two_numpy_ranks(two_ranks, case):
    r0, r1 = (np.load(two_ranks / f"{case}-rank{r}.npz") for r in (0, 1))
    params = [k for k in r0.files if k.startswith(("cuda/param/", "cuda/stat/"))]
    assert params and (case.startswith("mlp") or case.startswith("lenet")
                       or "cuda/stat/" in " ".join(params))
    synchronised = case.endswith("sync-batchnorm")
    for k in params:  # one average, one update: the ranks' parameters stay identical
        if "/stat/" not in k or synchronised:  # else each rank's own statistics (as DDP's)
            np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
    loss_rtol, param_atol = HALF.get(case, (1e-5, 2e-6))
    for r in (r0, r1):
        np.testing.assert_allclose(r["cuda/losses"], r["numpy/losses"], rtol=loss_rtol)
        np.testing.assert_array_equal(r["cuda/counts"], r["numpy/counts"])
        for k in params:
            np.testing.assert_allclose(r[k], r[k.replace("cuda/", "numpy/", 1)], rtol=2e-4,
                                       atol=param_atol, err_msg=k)
    steps, bad = r0["cuda/counts"]
    if "inf-on-rank1" in case:  # the inf micro-batch dropped on both ranks, then recovered
        assert not np.isfinite(r1["cuda/losses"][2]) and np.isfinite(r0["cuda/losses"][2])
    if case in ("mlp-inf-on-rank1", "mlp-fp16-inf-on-rank1"):
        assert bad == 0 and steps == 4
    if case == "mlp-unequal-rows":  # rank 1's batches of no rows: no step dropped
        assert bad == 0 and steps == 6 and r1["cuda/losses"][3] == r1["cuda/losses"][5] == 0
    if case == "mlp-accum-inf-on-rank1":  # 6 micro-batches of 2 per step, the third dropped
        assert bad == 0 and steps == 2  # (so are the ones accumulated with it: none here)
