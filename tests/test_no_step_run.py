"""A run that applied no optimizer step (issue 12, item 7): the step guard skips a batch whose
loss or gradient is not finite and raises ``TrainingDiverged`` only after ``max_bad_steps`` in
a row, so a data set whose every batch is non-finite, in fewer batches than that, used to end
with exit status 0 and the untrained model exported. Now ``Trainer.fit`` raises
``NoStepApplied`` (a ``TrOnnxError``) saying no step was applied, and ``tr-onnx train`` exits
with status 2, one line, and writes no model.

The oracle for "no step was applied" is the model itself: its weights after the run equal the
file's initializers, read with onnx.numpy_helper, and the session counts no step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.optim import SGD
from tr_onnx.training.trainer import Trainer

MLP = str(Path(__file__).parent.parent / "model_zoo" / "mlp.onnx")
N = 24  # samples: 3 batches of 8 (or 2 of 12)


def initializers(path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


def data(poison: str | None, n: int = N):
    """Digits-shaped inputs, every sample holding ``poison`` (nan, inf) when given."""
    rng = np.random.default_rng(0)
    x = rng.random((n, 64), dtype=np.float32)
    if poison is not None:
        x[:, 5] = float(poison)
    return {"input": x}, rng.integers(0, 10, n)


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_every_batch_non_finite_is_an_error_not_a_trained_model(poison, epochs):
    session = tr_onnx.TrainingSession(MLP, optimizer=SGD(lr=0.1), backend="numpy",
                                      max_bad_steps=100)
    trainer = Trainer(session, data(poison), batch_size=8, epochs=epochs, log=None)
    with pytest.warns(RuntimeWarning, match="non-finite loss"), \
            pytest.raises(tr_onnx.NoStepApplied) as info:
        trainer.fit()
    msg = str(info.value)
    assert isinstance(info.value, tr_onnx.TrOnnxError) and "\n" not in msg
    assert "no optimizer step was applied" in msg
    batches = 3 * epochs
    assert f"all {batches} batches" in msg and "max_bad_steps=100" in msg
    assert session.step == 0 and trainer.status == "no step"
    want = initializers(MLP)
    got = session.parameters()
    assert all(np.array_equal(got[k], want[k]) for k in got)


def test_too_few_batches_for_one_accumulated_step_is_an_error():
    """3 finite batches never complete a step of grad_accumulation=4: nothing was trained."""
    session = tr_onnx.TrainingSession(MLP, optimizer=SGD(lr=0.1), backend="numpy",
                                      grad_accumulation=4)
    trainer = Trainer(session, data(None), batch_size=8, epochs=1, log=None)
    with pytest.raises(tr_onnx.NoStepApplied, match=r"0 of 3 batches .*grad_accumulation=4"):
        trainer.fit()
    want = initializers(MLP)
    got = session.parameters()
    assert session.step == 0 and all(np.array_equal(got[k], want[k]) for k in got)


def test_one_applied_step_is_a_run():
    """The control: one finite batch among non-finite ones trains and returns the history."""
    arrays, labels = data("nan")
    first = np.random.default_rng(0).permutation(N)[:8]  # epoch 1's first batch (seed 0)
    arrays["input"][first] = data(None)[0]["input"][first]
    session = tr_onnx.TrainingSession(MLP, optimizer=SGD(lr=0.1), backend="numpy",
                                      max_bad_steps=100)
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        history = Trainer(session, (arrays, labels), batch_size=8, epochs=1, log=None,
                          seed=0).fit()
    assert history[0]["skipped_batches"] == 2 and session.step == 1


def test_cli_train_writes_no_model_when_no_step_was_applied(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    arrays, labels = data("nan")
    np.savez(tmp_path / "data.npz", input=arrays["input"], labels=labels)
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        rc = main(["train", MLP, "--data", str(tmp_path / "data.npz"), "--epochs", "1",
                   "--batch-size", "8", "--val-split", "0", "--backend", "numpy",
                   "--optimizer", "sgd", "--lr", "0.1", "--out", "out.onnx", "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and rc == 2, err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert "no optimizer step was applied" in err
    assert not (tmp_path / "out.onnx").exists()
