"""``tr-onnx train`` under ``mpiexec -n 2`` (the mpich wheel): two ranks with ``--batch-size 16``
train LeNet on the digits like one process with ``--batch-size 32`` (one progress line, one
metrics file, one exported model, equal to 4e-6); a rank that is killed ends the run, and its
last checkpoint resumes on one rank to the same model; a rank that hangs makes the other fail
within ``--dist-timeout`` with a line naming it and what it waited for.

SGD, not AdamW: the parity holds for any optimizer up to the summation order of the gradient
mean, but on these digits AdamW turns that rounding (1.5e-6 in the weights) into 3e-3 within one
epoch -- as it does in one process between batch 32 and two accumulated batches of 16
(``grad_accumulation=2``) -- so it would test Adam's sensitivity, not the sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tr_onnx.cli import main
from tr_onnx.distributed import World
from tr_onnx.training.storage import read_checkpoint
from tr_onnx.training.trainer import CHECKPOINT_NAME, Trainer

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
LENET = str(ROOT / "model_zoo" / "lenet.onnx")
TRAIN = ["train", LENET, "--data", "digits", "--epochs", "2", "--optimizer", "sgd", "--lr",
         "0.5", "--backend", "numpy"]
BATCHES = 45  # 1438 training digits (0.8 of 1797) in global batches of 32: the last has 30
# float32 sums in another order: the conv weight gradient over two ranks' 16 rows each, averaged,
# against one process's 32 rows. oneDNN's and OpenBLAS's own reduction orders (not np.matmul's)
# put LeNet's weights up to 1.6e-6 apart after 2 epochs of SGD at lr 0.5 (measured 2026-12-01)
TOL = 4e-6


def mpiexec(*argv: str, ranks: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``argv`` (after the interpreter) on ``ranks`` ranks with this checkout's tr_onnx;
    the finished process and its wall time."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    proc = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    return proc, time.monotonic() - start


def weights(path: Path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def assert_same_model(path: Path, expected: Path) -> None:
    got, want = weights(path), weights(expected)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=TOL, err_msg=name)


def epoch_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_epochs(path: Path, expected: Path) -> None:
    got, want = epoch_lines(path), epoch_lines(expected)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [BATCHES, 2 * BATCHES]
    for g, w in zip(got, want, strict=True):
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "train_f1", "val_f1",
                    "train_top5", "val_top5"):  # metrics: sums reduced over the ranks
            assert g[key] == pytest.approx(w[key], rel=0, abs=TOL), (g["epoch"], key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process, batch 32 (in this process: no launcher, so a world of 1)."""
    out = tmp_path_factory.mktemp("one_rank")
    assert main([*TRAIN, "--batch-size", "32", "--out", str(out / "model.onnx"),
                 "--metrics", str(out / "metrics.jsonl"), "--no-progress"]) == 0
    return out


def test_two_ranks_train_like_one_process_with_the_doubled_batch(tmp_path, reference):
    proc, _ = mpiexec("-m", "tr_onnx", *TRAIN, "--batch-size", "16",
                      "--out", str(tmp_path / "model.onnx"),
                      "--metrics", str(tmp_path / "metrics.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert_same_model(tmp_path / "model.onnx", reference / "model.onnx")
    assert_same_epochs(tmp_path / "metrics.jsonl", reference / "metrics.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "model.onnx"]
    # rank 0 alone shows progress (under mpiexec too): ranks write to pipes, so plain lines,
    # one per tenth of the epoch, with the world size, and no \r; and it alone logs
    assert "\r" not in proc.stderr
    for epoch in (1, 2):
        done = [int(line.split()[2].split("/")[0]) for line in proc.stderr.splitlines()
                if line.startswith(f"epoch {epoch}/2: ")]
        assert done == [b for b in range(1, BATCHES)
                        if (b - 1) * 10 // BATCHES < b * 10 // BATCHES], epoch
    assert "samples/s  2 ranks" in proc.stderr
    assert proc.stdout.count("samples/s on 2 ranks") == 2
    assert proc.stdout.count("final val accuracy") == 1


def test_a_killed_rank_ends_the_run_and_its_checkpoint_resumes_on_one_rank(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    run = ["--checkpoint-dir", str(ckpt), "--metrics", str(tmp_path / "metrics.jsonl"),
           "--out", str(tmp_path / "model.onnx"), "--no-progress"]
    # rank 1 is killed before step 66; the last checkpoint is of batch 60 (every 20)
    proc, seconds = mpiexec(str(TESTS / "dist_cli_fault.py"), "kill", "1", "65", *TRAIN,
                            "--batch-size", "16", "--checkpoint-every", "20", *run)
    assert proc.returncode != 0 and seconds < 120, proc.stderr
    assert "rank 1 fails (kill) at step 65" in proc.stderr
    assert "final val accuracy" not in proc.stdout and not (tmp_path / "model.onnx").exists()
    meta, _, _ = read_checkpoint(ckpt / CHECKPOINT_NAME)
    assert meta["step"] == 60
    assert {k: meta["extra"][k] for k in ("epoch", "batch", "world_size", "global_batch_size")} \
        == {"epoch": 1, "batch": 15, "world_size": 2, "global_batch_size": 32}
    # one rank continues the 2-rank run: the checkpoint's global batch of 32 on one rank
    assert main([*TRAIN, "--resume", *run]) == 0
    assert_same_model(tmp_path / "model.onnx", reference / "model.onnx")
    assert_same_epochs(tmp_path / "metrics.jsonl", reference / "metrics.jsonl")


def test_a_checkpoint_on_rank_0s_machine_alone_resumes_on_two_ranks(tmp_path, reference):
    """Machines without a shared file system: each rank runs in its own folder (hydra's
    ``-wdir``), every path relative, and only rank 0's folder has the checkpoint (rank 0
    alone writes them). Rank 0 reads it and broadcasts it, so the run resumes to the model of
    the uninterrupted one; and when rank 0 has none either, both ranks fail saying so."""
    first, rank1 = tmp_path / "machine0", tmp_path / "machine1"
    rank1.mkdir()
    run = ["--checkpoint-dir", "ckpt", "--metrics", "metrics.jsonl", "--out", "model.onnx",
           "--no-progress", "--batch-size", "16"]
    first.mkdir()
    assert main([*TRAIN[:-2], "--epochs", "1", "--backend", "numpy", "--checkpoint-dir",
                 str(first / "ckpt"), "--batch-size", "32", "--no-progress",
                 "--out", str(first / "epoch1.onnx")]) == 0  # one rank, one epoch of two
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def two_machines():
        rank = [sys.executable, "-m", "tr_onnx", *TRAIN, "--resume", *run]
        return subprocess.run(["mpiexec", "-n", "1", "-wdir", str(first), *rank, ":",
                               "-n", "1", "-wdir", str(rank1), *rank], env=env,
                              capture_output=True, text=True, timeout=240)

    proc = two_machines()
    assert proc.returncode == 0, proc.stderr
    assert "resuming from ckpt/last.ckpt.npz: epoch 2" in proc.stdout
    assert_same_model(first / "model.onnx", reference / "model.onnx")
    assert not (rank1 / "ckpt").exists() and not (rank1 / "model.onnx").exists()
    (first / "ckpt" / CHECKPOINT_NAME).unlink()
    proc = two_machines()
    assert proc.returncode != 0
    assert "--resume: no checkpoint ckpt/last.ckpt.npz" in proc.stderr, proc.stderr


def test_a_hung_rank_makes_the_other_fail_within_the_timeout(tmp_path):
    proc, seconds = mpiexec(str(TESTS / "dist_cli_fault.py"), "hang", "1", "2", *TRAIN,
                            "--batch-size", "16", "--dist-timeout", "2", "--no-progress",
                            "--out", str(tmp_path / "model.onnx"))
    assert proc.returncode == 3, proc.stderr  # the ranks lost each other
    assert seconds < 120
    line = next(x for x in proc.stderr.splitlines() if x.startswith("tr-onnx: error:"))
    # the step's first collective: every rank's rows of the global batch
    assert line.startswith("tr-onnx: error: rank 0 of 2: allgather_int of 2 int64"), line
    assert "did not complete within 2 s" in line
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("saved, ranks, given, expected", [
    ({"batch_size": 16, "world_size": 2, "global_batch_size": 32}, 1, None, 32),
    ({"batch_size": 16, "world_size": 2, "global_batch_size": 32}, 4, None, 8),
    ({"batch_size": 32}, 2, 16, 16),  # a checkpoint from before worlds: one rank
    ({"batch_size": 16, "world_size": 2, "global_batch_size": 32}, 1, 16,
     r"batch_size 16 on 1 rank\(s\) is a global batch of 16.*resume with batch_size 32"),
    ({"batch_size": 16, "world_size": 2, "global_batch_size": 32}, 3, None,
     "does not split over 3 ranks.*on a number of ranks that divides it"),
], ids=["2-ranks-to-1", "2-ranks-to-4", "old-checkpoint", "wrong-batch", "indivisible"])
def test_a_checkpoint_resumes_its_global_batch_on_another_world_size(saved, ranks, given,
                                                                     expected):
    world = World(0, ranks, 0, comm=object() if ranks > 1 else None)  # no exchange is made
    path = Path("ckpt") / CHECKPOINT_NAME
    if isinstance(expected, int):
        assert Trainer.resumed_batch_size(path, saved, world, given) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            Trainer.resumed_batch_size(path, saved, world, given)


# the example: 1797 digits in global batches of 32 leave a last batch of 5 rows (3 and
# 2 on the two ranks). Averaged per rank it ended 3.0e-3 from one process with the doubled batch
# (issue 31); weighted by rows the two differ by float32 summation order only, as sample counts
# that are a multiple of 32 do: 3.0e-8 measured (2026-12-06), bound 1e-6 (weights of order 0.1,
# float32 epsilon 6e-8, some hundred SGD steps of reordered sums)
MLP_TRAIN = ["train", str(ROOT / "model_zoo" / "mlp.onnx"), "--data", "digits", "--epochs", "2",
             "--optimizer", "sgd", "--lr", "0.05", "--val-split", "0", "--backend", "numpy",
             "--no-progress"]
MLP_TOL = 1e-6


def test_two_ranks_weigh_a_partial_last_batch_by_rows_as_one_process(tmp_path):
    assert main([*MLP_TRAIN, "--batch-size", "32", "--out", str(tmp_path / "one.onnx")]) == 0
    proc, _ = mpiexec("-m", "tr_onnx", *MLP_TRAIN, "--batch-size", "16",
                      "--out", str(tmp_path / "two.onnx"))
    assert proc.returncode == 0, proc.stderr
    got, want = weights(tmp_path / "two.onnx"), weights(tmp_path / "one.onnx")
    diff = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    print(f"max weight difference {diff:.2e}")
    assert diff <= MLP_TOL
