"""A batch of 0 samples (issue 31, item 8): ``train_step`` trained it as a NaN loss (0/0), warned
of a non-finite step and counted it as a bad step. It is an ``InputError`` naming the input and
its shape, raised before anything runs: weights, optimizer state, gradient accumulators, the
step counters and the bad-step count stay bit for bit, and the next step equals that of a twin
session that never saw the empty batch. A data file with 0 rows is one line and exit 2."""

from pathlib import Path

import numpy as np
import pytest

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.cli import main
from tr_onnx.optim import AdamW
from tr_onnx.training.trainer import Trainer

MLP = Path(__file__).resolve().parent.parent / "model_zoo" / "mlp.onnx"
EMPTY = {"input": np.zeros((0, 64), np.float32)}
MESSAGE = r"^input 'input': a batch of 0 samples \(shape \[0, 64\]\); a training step needs"


def batch(seed: int):
    rng = np.random.default_rng(seed)
    return ({"input": rng.standard_normal((4, 64)).astype(np.float32)},
            rng.integers(0, 10, 4))


def counters(session) -> tuple:
    return session.step, session.micro_step, session.rng_counter, session.bad_steps


def _session(backend):
    return tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend=backend,
                                   grad_accumulation=2)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    from tr_onnx.testing.host_emulator import build_host_library, host_emulator
    return host_emulator(build_host_library(tmp_path_factory.mktemp("empty_batch_host")))


@pytest.mark.parametrize("backend", ["numpy", "cuda"], ids=["numpy", "cuda_emulated"])
def test_an_empty_batch_is_an_input_error_that_changes_nothing(backend, request):
    if backend == "cuda":
        backend = CudaBackend(device=request.getfixturevalue("emulator"))
    session, twin = _session(backend), _session(backend)
    for i in range(3):  # mid-accumulation: the gradients hold one micro-batch
        assert session.train_step(*batch(i)) == twin.train_step(*batch(i))
    before, count, plans = session.state_arrays(), counters(session), list(session._plans)
    for labels in (np.zeros(0, np.int64), np.zeros(4, np.int64)):
        with pytest.raises(tr_onnx.InputError, match=MESSAGE):
            session.train_step(EMPTY, labels)
    after = session.state_arrays()
    assert counters(session) == count and list(session._plans) == plans
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name].view(np.uint8), before[name].view(np.uint8),
                                      name)
    assert session.train_step(*batch(3)) == twin.train_step(*batch(3))
    for name, value in twin.state_arrays().items():
        np.testing.assert_array_equal(session.state_arrays()[name].view(np.uint8),
                                      value.view(np.uint8), name)


def test_a_trainer_given_no_samples_says_so():
    session = tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend="numpy")
    with pytest.raises(tr_onnx.InputError,
                       match=r"^train_data: 0 samples; need at least one$"):
        Trainer(session, (EMPTY, np.zeros(0, np.int64)), progress=False)


def test_cli_data_file_of_0_rows_is_one_line_and_exit_2(tmp_path, capsys):
    data = tmp_path / "empty.npz"
    np.savez(data, input=EMPTY["input"], labels=np.zeros(0, np.int64))
    assert main(["train", str(MLP), "--data", str(data), "--epochs", "1", "--no-progress",
                 "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert f"{data}: 'labels' has shape [0]; need at least one sample along axis 0" in err
