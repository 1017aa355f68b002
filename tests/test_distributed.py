"""Data parallelism (tr_onnx.distributed): a single process is a world of 1 without MPI, and
under ``mpiexec -n 2`` every collective gives the known sums, means and broadcasts, and a
collective that a rank joins too late raises DistributedError naming the waiting rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tr_onnx import TrainingSession, distributed
from tr_onnx.errors import DistributedError, OptionError
from tr_onnx.optim import SGD

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LAUNCH_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE",
              "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_NTASKS")


def mpiexec(script: str, *args, ranks: int = 2, timeout: float = 120) -> None:
    """Run ``tests/<script>`` on ``ranks`` ranks with this checkout's tr_onnx; fail with both
    ranks' output when the job fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    # the mpich wheel installs mpiexec beside the interpreter, which need not be on PATH
    launcher = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    proc = subprocess.run([launcher, "-n", str(ranks), sys.executable, str(TESTS / script),
                           *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"


def test_a_single_process_is_a_world_of_one_without_importing_mpi(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    code = ("import sys, numpy as np; from tr_onnx import distributed as d; w = d.init(); "
            "a = np.ones(3); w.allreduce_mean_(a); w.bcast_(a); w.barrier(); "
            "print(w.rank, w.size, w.local_rank, w.comm, w.is_root, a.tolist(), "
            "w.allreduce_scalars([2.0]), w.bcast_object('x'), 'mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    assert out.stdout.split() == ["0", "1", "0", "None", "True", "[1.0,", "1.0,", "1.0]",
                                  "[2.0]", "x", "False"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=2, size=2, comm=object()), "rank 2 is outside 0..1"),
    (dict(rank=0, size=2), "no communicator"),
    (dict(rank=0, size=1, timeout_s=0), "timeout_s must be > 0"),
], ids=["rank-out-of-range", "no-comm", "zero-timeout"])
def test_a_world_that_cannot_be_is_refused(kwargs, match):
    with pytest.raises(DistributedError, match=match):
        distributed.World(**kwargs)


def test_a_launcher_environment_says_how_many_ranks(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    assert distributed.launched_size() == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")  # inside sbatch without srun: one process
    assert distributed.launched_size() == 1
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert distributed.launched_size() == 4
    monkeypatch.setenv("PMI_SIZE", "2")
    assert distributed.launched_size() == 2


def test_a_kernel_finds_its_world_by_id_and_an_unknown_id_is_named():
    world = distributed.World()
    assert distributed.lookup(distributed.register(world)) is world
    with pytest.raises(DistributedError, match="no World registered under id 12345"):
        distributed.lookup(12345)


def test_a_world_of_one_trains_exactly_as_no_world():
    """``distributed=World()`` (one process) adds no collective to the plan: the same curve
    and weights, bitwise."""
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((4, 64)).astype(np.float32), rng.integers(0, 10, 4))
            for _ in range(3)]
    sessions = [TrainingSession(ROOT / "model_zoo" / "mlp.onnx", optimizer=SGD(lr=0.1),
                                backend="numpy", **kw)
                for kw in ({}, {"distributed": distributed.World()})]
    curves = [[s.train_step({"input": x}, y) for x, y in data] for s in sessions]
    assert curves[0] == curves[1]
    assert not {"GradAllReduceStart", "GradAllReduceWait", "BroadcastStats"} & {
        n.op_type for n in sessions[1]._state.active.graph.nodes}
    for name, value in sessions[0].parameters().items():
        np.testing.assert_array_equal(value, sessions[1].parameters()[name])


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    """dist_collectives.py's 2-rank job: what each rank saw, and rank 0's failure."""
    out = tmp_path_factory.mktemp("dist_collectives")
    mpiexec("dist_collectives.py", out)
    return out


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "25", True],
                         ids=["zero", "negative", "inf", "string", "bool"])
def test_a_bucket_size_that_cannot_be_is_refused(value):
    with pytest.raises(OptionError, match=r"grad_bucket_mb=.*finite number > 0"):
        TrainingSession(ROOT / "model_zoo" / "mlp.onnx", backend="numpy",
                        grad_bucket_mb=value)


def _two_dropouts_model():
    """logits = Dropout(x) @ W + Transpose(Dropout(Transpose(x))) @ V: one dropout of a
    batch-major [B, 6] tensor, one of its [6, B] transpose (axis 0 not the batch)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32), n)
             for n in ("W", "V")]
    nodes = [helper.make_node("Dropout", ["x"], ["xd"], name="batch_major"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("Dropout", ["xt"], ["xtd"], name="batch_last"),
             helper.make_node("Transpose", ["xtd"], ["xb"], perm=[1, 0]),
             helper.make_node("MatMul", ["xd", "W"], ["a"]),
             helper.make_node("MatMul", ["xb", "V"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["logits"])]
    graph = helper.make_graph(
        nodes, "two_dropouts", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                              ["batch", 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [4, 6])
def test_only_a_batch_major_dropout_draws_its_ranks_rows(batch):
    """The train pass gives the rows-before input to the dropout whose axis 0 is the batch,
    not to the transposed one (its rows are not this rank's samples), nor to any without a
    world; at batch 6 the transpose is [6, 6] and is taken for batch-major (the rule is the
    axis-0 extent: its masks then come from a disjoint part of the stream, which keeps ranks'
    masks apart but is not the one-process mask)."""
    from tr_onnx.compiler import compile_plan
    from tr_onnx.importer import import_model
    from tr_onnx.registry import default_registry
    from tr_onnx.training.losses import make_loss_spec
    from tr_onnx.training.pipeline import build_training_step
    from tr_onnx.training.reserved import Reserved
    from tr_onnx.training.train_pass import TrainConfig

    registry = default_registry()
    imported = import_model(_two_dropouts_model(), registry, "numpy")
    key = distributed.register(distributed.World())
    inputs = {}
    for world in (key, None):
        cfg = TrainConfig(make_loss_spec("cross_entropy"), SGD(lr=0.1), "logits", "labels",
                          data_inputs=("x",), world=world)
        plan = compile_plan(imported, {"x": (batch, 6)}, {}, "numpy", 1,
                            transform=lambda g, c=cfg: build_training_step(
                                g, registry=registry, backend="numpy", cfg=c))
        inputs[world] = {n.name: [v.name for v in n.inputs] for n in plan.graph.nodes
                         if n.op_type == "DropoutTraining"}
    assert Reserved.SAMPLE_OFFSET in inputs[key]["batch_major"]
    assert (Reserved.SAMPLE_OFFSET in inputs[key]["batch_last"]) == (batch == 6)
    assert not any(Reserved.SAMPLE_OFFSET in names for names in inputs[None].values())


def test_a_checkpoint_resumes_into_a_world_with_its_data_parallel_options(tmp_path):
    session = TrainingSession(ROOT / "model_zoo" / "mlp.onnx", optimizer=SGD(lr=0.1),
                              backend="numpy", grad_bucket_mb=2.0)
    x = np.ones((2, 64), np.float32)
    session.train_step({"input": x}, np.array([1, 2]))
    path = session.save_checkpoint(tmp_path / "ck.npz")
    resumed = TrainingSession.from_checkpoint(path, distributed=distributed.World())
    assert resumed.options.grad_bucket_mb == 2.0 and resumed.step == 1
    assert resumed.train_step({"input": x}, np.array([1, 2])) == \
        session.train_step({"input": x}, np.array([1, 2]))


def test_each_collective_on_two_ranks_and_the_deadline(collectives):
    seen = [json.loads((collectives / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert (s["rank"], s["size"], s["local_rank"], s["is_root"]) == (r, 2, r, r == 0)
        np.testing.assert_array_equal(s["sum"], 2 * np.arange(5) + 10)
        assert s["sum_in_place"]
        np.testing.assert_array_equal(s["mean"], [1.5] * 3)
        assert s["max"] == [1.0, 0.0, 0.0]
        assert s["allgather"] == [3, 4]
        assert s["shared_file"] == list(range(40))
        assert s["shared_missing"].endswith("nowhere.bin: no such checkpoint file (on rank 0, "
                                            "which reads it for all ranks)")
        np.testing.assert_array_equal(s["bcast_from_1"], [8] * 4)
        assert s["started"] == [[3.0] * 3, [0.0, 3.0, 6.0, 9.0]]
        assert s["scalars"] == [1.0, 5.0, -1.0]
        assert s["object"] == {"from": 0, "list": [0, 0, 0]}
    error = seen[0]["deadline_error"]
    assert error.startswith("rank 0 of 2: allreduce_sum_ of 2 float64 (16 bytes) did not "
                            "complete within 0.5 s"), error
    assert seen[0]["deadline_rank"] == 0
    assert 0.5 <= seen[0]["deadline_after_s"] < 1.5


def test_a_rank_that_stops_makes_the_other_fail_within_the_deadline(collectives):
    """Rank 1 exits after one step; rank 0's next step raises DistributedError naming rank 0
    and the step's first collective (every rank's rows: ``allgather_int``), after the 0.5 s
    deadline."""
    seen = json.loads((collectives / "failure.json").read_text())
    assert seen["type"] == "DistributedError" and seen["rank"] == 0
    assert seen["message"].startswith("rank 0 of 2: allgather_int of 2 int64"), seen
    assert "did not complete within 0.5 s" in seen["message"]
    assert 0.5 <= seen["after_s"] < 2.5 and seen["step"] == 1


# ---- training on two ranks (tests/dist_train.py) --------------------------------------------

TRAIN_CASES = ["mlp-SGD", "mlp-AdamW", "lenet-SGD", "lenet-AdamW",
               "mlp-rank1-loads-other-weights", "mlp-accumulate",
               "mlp-inf-on-rank1", "mlp-inf-in-a-micro-batch", "resnet-sync-batchnorm",
               "resnet-ddp", "mobilenet-dropout-sync-batchnorm"]
# one process with the doubled batch: losses and weights within 1e-6; with BatchNorm
# synchronised, within 1e-5 (the bounds); PyTorch DDP: within 1e-4
CASES_ACCUMULATING = {"mlp-accumulate", "mlp-inf-in-a-micro-batch"}  # grad_accumulation=2
TOLERANCE = {"resnet-sync-batchnorm": 1e-5, "resnet-ddp": 1e-4,
             "mobilenet-dropout-sync-batchnorm": 1e-5}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case of dist_train.py in one 2-rank job (the processes start and import once)."""
    out = tmp_path_factory.mktemp("dist_train")
    mpiexec("dist_train.py", out, *TRAIN_CASES, timeout=300)
    return {case: dict(np.load(out / f"{case}.npz")) for case in TRAIN_CASES}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_two_ranks_train_as_the_oracle(trained, case):
    """2 ranks with batch b each equal one process with batch 2b (or, for resnet-ddp, PyTorch
    DDP on the same shards): the loss curve, every parameter and running statistic."""
    got, tol = trained[case], TOLERANCE.get(case, 1e-6)
    if "want_losses" in got:
        np.testing.assert_allclose(got["losses"], got["want_losses"], rtol=0, atol=tol)
        assert got["steps_applied"] == got["want_steps_applied"]
    else:  # DDP: each rank's own loss
        np.testing.assert_allclose(got["local_losses"], got["want_local_losses"], rtol=0,
                                   atol=tol)
        np.testing.assert_allclose(got["rank1_local_losses"], got["want_rank1_local_losses"],
                                   rtol=0, atol=tol)
    names = [k.removeprefix("got/") for k in got if k.startswith("got/")]
    assert names and all(f"want/{n}" in got for n in names)
    for name in names:
        bound = tol + 2 * float(got.get(f"spread/{name}", 0.0))  # as on three ranks, below
        np.testing.assert_allclose(got[f"got/{name}"], got[f"want/{name}"], rtol=0, atol=bound,
                                   err_msg=f"{case}: {name}")


THREE_RANK_CASES = ["mlp-AdamW", "lenet-SGD", "resnet-sync-batchnorm",
                    "mobilenet-dropout-sync-batchnorm"]


@pytest.fixture(scope="module")
def trained_on_three(tmp_path_factory):
    """Three ranks on the two cores: beyond two, MPI does not promise every rank the same
    sum, and a rank's shard no longer starts at 0 or halfway."""
    out = tmp_path_factory.mktemp("dist_train_3")
    mpiexec("dist_train.py", out, *THREE_RANK_CASES, ranks=3, timeout=300)
    return {case: dict(np.load(out / f"{case}.npz")) for case in THREE_RANK_CASES}


@pytest.mark.parametrize("case", THREE_RANK_CASES)
def test_three_ranks_train_as_one_process_and_stay_bitwise_equal(trained_on_three, case):
    got, tol = trained_on_three[case], TOLERANCE.get(case, 1e-6)
    np.testing.assert_allclose(got["losses"], got["want_losses"], rtol=0, atol=tol)
    names = [k.removeprefix("got/") for k in got if k.startswith("got/")]
    assert names and all(f"want/{n}" in got for n in names)
    for name in names:
        # where the oracle moves under a 1-ulp change of its input, by that much more
        # (tests/dist_train.py: ORACLE_SPREAD_CASES); a wrong synchronisation is 0.14 away
        bound = tol + 2 * float(got.get(f"spread/{name}", 0.0))
        np.testing.assert_allclose(got[f"got/{name}"], got[f"want/{name}"], rtol=0, atol=bound,
                                   err_msg=f"{case}: {name}")
        for r in (1, 2):  # running statistics too: synchronised, or none
            np.testing.assert_array_equal(got[f"rank{r}/{name}"], got[f"got/{name}"],
                                          err_msg=f"{case}: rank {r}'s {name}")
    assert got["steps_applied"] == got["rank1_steps_applied"] == got["rank2_steps_applied"]


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_the_ranks_end_with_the_same_weights(trained, case):
    """The reduced gradient is the same on both ranks, so the weights are bitwise equal; only
    DDP-style BatchNorm statistics differ (rank 1's last step used its own batch)."""
    got = trained[case]
    assert got["steps_applied"] == got["rank1_steps_applied"]
    # one micro-batch per step: gradients computed straight into GRAD (fold_accumulators)
    assert bool(got["grads_overwritten"]) == (case not in CASES_ACCUMULATING)
    for name in (k.removeprefix("got/") for k in got if k.startswith("got/")):
        if case == "resnet-ddp" and name.endswith(("running_mean", "running_var")):
            continue
        np.testing.assert_array_equal(got[f"got/{name}"], got[f"rank1/{name}"], err_msg=name)


@pytest.mark.parametrize("case, buckets", [("lenet-SGD", 3), ("resnet-ddp", 4)])
def test_buckets_start_while_the_backward_pass_still_runs(trained, case, buckets):
    """With small buckets (grad_bucket_mb=1/64) the gradients travel in several all-reduces,
    the first started before the backward pass of the early layers."""
    got = trained[case]
    assert got["buckets"] == buckets
    assert got["computed_after_first_start"] > 0


@pytest.mark.parametrize("case, skipped", [("mlp-inf-on-rank1", 1),
                                           ("mlp-inf-in-a-micro-batch", 1)])
def test_an_infinite_row_on_one_rank_skips_the_step_on_both(trained, case, skipped):
    got = trained[case]
    steps = len(got["local_losses"]) // (2 if "micro" in case else 1)
    assert got["steps_applied"] == got["rank1_steps_applied"] == steps - skipped
    assert np.isnan(got["rank1_local_losses"]).sum() == 1  # the rank that had the inf
    assert np.isfinite(got["local_losses"]).all()  # the other one's loss was fine


@pytest.fixture(scope="module")
def unequal_rows(tmp_path_factory):
    """dist_rows.py's 2-rank job: sessions fed unequal shares, and a Trainer."""
    out = tmp_path_factory.mktemp("dist_rows")
    mpiexec("dist_rows.py", out, timeout=300)
    return out


def test_ranks_with_unequal_rows_and_none_train_as_one_process(unequal_rows):
    """Each rank's gradient weighs by its rows (size * rows / total), so any split of the
    global batch trains as one process with the whole batch, and a rank with no rows adds
    nothing (its mean over no rows is NaN: it reports 0 and the step applies on both).
    Measured (2026-12-06): 3.0e-8 max weight difference, 2.4e-7 in the losses; averaged per
    rank, the weights ended 0.22 apart and the two batches of no rows skipped their steps."""
    got = dict(np.load(unequal_rows / "rows.npz"))
    np.testing.assert_allclose(got["losses"], got["want_losses"], rtol=0, atol=1e-6)
    assert got["steps_applied"] == got["rank1_steps_applied"] == got["want_steps_applied"] == 6
    assert got["rank1_local_losses"][3] == got["rank1_local_losses"][5] == 0.0
    names = [k.removeprefix("want/") for k in got if k.startswith("want/")]
    assert names
    for name in names:
        np.testing.assert_allclose(got[f"got/{name}"], got[f"want/{name}"], rtol=0, atol=1e-6,
                                   err_msg=name)
        np.testing.assert_array_equal(got[f"rank1/{name}"], got[f"got/{name}"], err_msg=name)


def test_a_trainer_whose_last_batch_leaves_a_rank_no_row_trains_as_one_process(unequal_rows):
    """25 samples in global batches of 8: the last one's row is rank 1's, rank 0 has none
    (the Trainer used to leave such a batch out). ResNet with synchronised BatchNorm, 2 epochs:
    the curve and every parameter and running statistic as one process's, within 2e-6
    (measured 6.4e-7, 2026-12-06; with the empty rank counted as one row, 5.4e-2)."""
    got = dict(np.load(unequal_rows / "trainer.npz"))
    np.testing.assert_allclose(got["curve"], got["want_curve"], rtol=0, atol=1e-6)
    names = [k.removeprefix("want/") for k in got if k.startswith("want/")]
    assert any(n.endswith("running_var") for n in names)
    for name in names:
        np.testing.assert_allclose(got[f"got/{name}"], got[f"want/{name}"], rtol=0, atol=2e-6,
                                   err_msg=name)


def test_a_rank_with_no_rows_keeps_its_running_statistics(unequal_rows):
    """BatchNorm not synchronised: the statistics of no rows are NaN, so an empty rank keeps
    the ones it had (rank 0's, broadcast at the start of the step)."""
    got = dict(np.load(unequal_rows / "empty_rank_statistics.npz"))
    names = [k.removeprefix("first/") for k in got if k.startswith("first/")]
    assert any(n.endswith("running_var") for n in names)
    for name in names:
        np.testing.assert_array_equal(got[f"second/{name}"], got[f"first/{name}"], err_msg=name)
