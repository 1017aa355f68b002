"""``tr_onnx.fit`` / ``tr_onnx.evaluate`` and the public ``Trainer``: every form of batches
trains as the same batches given to the session step by step, which equals PyTorch's SGD on
the module the model was exported from; callbacks, early stopping and keeping the best epoch;
evaluation against onnxruntime's outputs scored by torch and scikit-learn."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from oracles import ort_run
from sklearn import metrics as skm

import tr_onnx
from tr_onnx.errors import InputError
from tr_onnx.optim import SGD

torch = pytest.importorskip("torch")

N, BATCH, EPOCHS, LR = 128, 32, 2, 0.1


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data[:N] / 16.0).astype(np.float32), d.target[:N].astype(np.int64)


def torch_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "mlp.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch_mlp(), (torch.zeros(2, 64),), str(path), dynamo=False,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    return str(path)


def batches(x, y):
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(y), BATCH)]


@pytest.fixture(scope="module")
def stepwise(mlp_path, digits):
    """The parameters after the batches given to the session one step at a time."""
    session = tr_onnx.TrainingSession(mlp_path, optimizer=SGD(lr=LR), backend="numpy")
    for _ in range(EPOCHS):
        for xb, yb in batches(*digits):
            session.train_step({"input": xb}, yb)
    return session.parameters()


def test_stepwise_training_equals_torch_sgd(mlp_path, digits, stepwise, tmp_path):
    """The reference the forms below are held to: PyTorch's SGD on the exported module, over a
    DataLoader that ``fit`` takes as it is; the trained export runs in onnxruntime."""
    x, y = digits
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=BATCH, shuffle=False)
    module = torch_mlp()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for _ in range(EPOCHS):
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(module(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    result = tr_onnx.fit(mlp_path, loader, optimizer=SGD(lr=LR), epochs=EPOCHS,
                         backend="numpy", log=None)
    assert [r["train_loss"] for r in result.history] == pytest.approx(
        [np.mean(losses[:4]), np.mean(losses[4:])], rel=1e-5)
    (ours,) = ort_run(str(result.export(tmp_path / "trained.onnx")), {"input": x})
    np.testing.assert_allclose(ours, module(torch.from_numpy(x)).detach().numpy(), atol=1e-5)
    for name, value in result.session.parameters().items():
        np.testing.assert_array_equal(value, stepwise[name], err_msg=name)


def hf_dataset(x, y):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({"input": x.tolist(), "label": y.tolist(),
                                       "text": [str(v) for v in y]})


FORMS = [
    pytest.param(lambda x, y: batches(x, y), id="tuples-of-arrays"),
    pytest.param(lambda x, y: [({"input": a}, b) for a, b in batches(x, y)], id="dict-inputs"),
    pytest.param(lambda x, y: [((a,), b) for a, b in batches(x, y)], id="tuple-inputs"),
    pytest.param(lambda x, y: [{"input": a, "label": b} for a, b in batches(x, y)],
                 id="dict-batches"),
    pytest.param(lambda x, y: [(a.astype(np.float64), b.astype(np.int32))
                               for a, b in batches(x, y)], id="float64-and-int32"),
    pytest.param(lambda x, y: [(torch.from_numpy(a), torch.from_numpy(b))
                               for a, b in batches(x, y)], id="torch-tensors"),
    pytest.param(lambda x, y: lambda: iter(batches(x, y)), id="callable-of-generators"),
    pytest.param(hf_dataset, id="datasets-Dataset"),
]


@pytest.mark.parametrize("make", FORMS)
def test_every_form_of_batches_trains_as_the_same_steps(mlp_path, digits, stepwise, make):
    result = tr_onnx.fit(mlp_path, make(*digits), optimizer=SGD(lr=LR), epochs=EPOCHS,
                         batch_size=BATCH, backend="numpy", log=None)
    assert result.session.step == EPOCHS * N // BATCH
    for name, value in result.session.parameters().items():
        np.testing.assert_array_equal(value, stepwise[name], err_msg=name)


def test_float64_arrays_train_as_the_cli_trains_the_same_float64_npz(mlp_path, digits,
                                                                     tmp_path, monkeypatch):
    x, y = digits
    np.savez(tmp_path / "data.npz", input=x.astype(np.float64), labels=y)
    monkeypatch.chdir(tmp_path)
    assert tr_onnx.cli.main(["train", mlp_path, "--data", "data.npz", "--val-split", "0",
                             "--epochs", "2", "--seed", "3", "--backend", "numpy",
                             "--out", "cli.onnx", "--no-progress"]) == 0
    result = tr_onnx.fit(mlp_path, (x.astype(np.float64), y), epochs=2, seed=3,
                         backend="numpy", log=None)
    (cli,) = ort_run("cli.onnx", {"input": x})
    (ours,) = ort_run(str(result.export(tmp_path / "fit.onnx")), {"input": x})
    np.testing.assert_array_equal(ours, cli)


def generator(x, y):
    yield from batches(x, y)


def test_the_trainer_takes_a_generator_for_one_epoch_and_names_the_fix_for_two(mlp_path,
                                                                              digits):
    session = tr_onnx.TrainingSession(mlp_path, optimizer=SGD(lr=LR), backend="numpy")
    history = tr_onnx.Trainer(session, generator(*digits), epochs=1, log=None).fit()
    assert len(history) == 1 and session.step == N // BATCH
    with pytest.raises(InputError, match="train_data: a generator .* epochs=2: pass a "
                                         "callable that returns a fresh one"):
        tr_onnx.Trainer(session, generator(*digits), epochs=2, log=None)
    with pytest.raises(InputError, match="val_data: a generator .* epochs=2"):
        tr_onnx.Trainer(session, batches(*digits), generator(*digits), epochs=2, log=None)


def test_batches_that_are_not_batches_are_named(mlp_path, digits):
    x, y = digits
    with pytest.raises(InputError, match="batch 1: a dict batch holds its labels under "
                                         "'labels' or 'label'; it has \\['input'\\]"):
        tr_onnx.fit(mlp_path, [{"input": x}], backend="numpy", log=None)
    with pytest.raises(InputError, match="batch 1: no array for the model input\\(s\\) "
                                         "\\['input'\\]; it has \\['x'\\]"):
        tr_onnx.fit(mlp_path, [({"x": x}, y)], backend="numpy", log=None)
    with pytest.raises(InputError, match="a batch is \\(inputs, labels\\)"):
        tr_onnx.fit(mlp_path, [(x, y, y)], backend="numpy", log=None)


def test_a_session_given_as_the_model_keeps_its_own_options(mlp_path, digits):
    session = tr_onnx.TrainingSession(mlp_path, backend="numpy")
    with pytest.raises(InputError, match="\\['loss', 'frozen'\\]: options of a new session"):
        tr_onnx.fit(session, digits, loss="mse", frozen=["x"], log=None)


# ---- callbacks, early stopping, the best epoch -------------------------------------------------

class Recorder:
    def __init__(self):
        self.steps, self.epochs = [], []

    def on_step(self, trainer, record):
        self.steps.append(record)

    def on_epoch_end(self, trainer, record):
        self.epochs.append(record)


def test_callbacks_see_every_step_and_epoch_and_can_stop_the_run(mlp_path, digits):
    recorder, seen = Recorder(), []

    def stop_after_two(trainer, record):
        seen.append(record["epoch"])
        trainer.stop_training = record["epoch"] == 2

    result = tr_onnx.fit(mlp_path, batches(*digits), epochs=5, backend="numpy", log=None,
                         callbacks=[recorder, stop_after_two])
    assert seen == [1, 2] and recorder.epochs == result.history
    assert [(r["epoch"], r["batch"]) for r in recorder.steps] == [
        (e, b) for e in (1, 2) for b in range(1, N // BATCH + 1)]
    last = recorder.steps[-1]  # the epoch's running values, at its last batch
    assert last["train_loss"] == result.history[-1]["train_loss"]
    assert last["train_f1"] == result.history[-1]["train_f1"]


def test_early_stopping_restores_and_checkpoints_the_best_epoch(mlp_path, digits, tmp_path):
    """Validation labels that are noise: the validation loss rises once the model fits the
    training labels, and the run stops ``patience`` epochs after its best."""
    x, y = digits
    noise = np.random.default_rng(0).permutation(y)
    result = tr_onnx.fit(mlp_path, (x, y), val_data=(x, noise), epochs=30, lr=0.01,
                         backend="numpy", log=None, checkpoint_dir=tmp_path,
                         early_stopping={"patience": 2})
    best = result.best
    assert result.stopped_early and len(result.history) == best["epoch"] + 2
    later = [r["val_loss"] for r in result.history[best["epoch"]:]]
    assert min(later) >= best["val_loss"]
    # the session holds the best epoch's weights: evaluated again, its validation loss
    again = tr_onnx.evaluate(result.session, (x, noise))
    assert again["loss"] == pytest.approx(best["val_loss"], rel=1e-12)
    saved = tr_onnx.TrainingSession.from_checkpoint(tmp_path / "best.ckpt.npz")
    for name, value in result.session.parameters().items():
        np.testing.assert_array_equal(saved.parameters()[name], value, err_msg=name)
    assert saved.checkpoint_extra["best"]["epoch"] == best["epoch"]


def test_keep_best_by_a_metric_to_maximise(mlp_path, digits):
    x, y = digits
    result = tr_onnx.fit(mlp_path, (x, y), val_data=(x[:64], y[:64]), epochs=3,
                         backend="numpy", log=None, keep_best="val_f1")
    scores = [r["val_f1"] for r in result.history]
    assert result.best["val_f1"] == max(scores) and not result.stopped_early


def test_a_monitor_missing_from_the_records_lists_those_there(mlp_path, digits):
    with pytest.raises(InputError, match="monitor 'val_loss' has no value in the epoch "
                                         "records; they hold \\['train_loss', 'train_acc'"):
        tr_onnx.fit(mlp_path, digits, epochs=2, backend="numpy", log=None,
                    early_stopping=tr_onnx.EarlyStopping(monitor="val_loss"))


# ---- evaluate ----------------------------------------------------------------------------------

def test_evaluate_scores_the_onnxruntime_outputs_as_torch_and_sklearn_do(mlp_path, digits):
    x, y = digits
    result = tr_onnx.evaluate(mlp_path, batches(x, y), backend="numpy")
    (logits,) = ort_run(mlp_path, {"input": x})
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y))
    assert result["loss"] == pytest.approx(want.item(), rel=1e-5)
    assert result["acc"] == skm.accuracy_score(y, logits.argmax(1))
    assert result["f1"] == pytest.approx(skm.f1_score(y, logits.argmax(1), average="macro"))
    assert result["top5"] == pytest.approx(skm.top_k_accuracy_score(y, logits, k=5))


def test_fit_reads_what_the_command_line_reads_and_trains_a_given_session(tmp_path):
    mlp = str(__import__("pathlib").Path(__file__).parent.parent / "model_zoo" / "mlp.onnx")
    session = tr_onnx.TrainingSession(mlp, backend="numpy")
    result = tr_onnx.fit(session, "digits", val_data="digits", epochs=1, log=None)
    assert result.session is session and session.step == -(-1797 // 32)
    assert result.history[-1]["val_acc"] > 0.5


def test_batches_from_an_iterable_resume_at_an_epoch_end_bit_for_bit(mlp_path, digits,
                                                                    tmp_path):
    full = tr_onnx.fit(mlp_path, batches(*digits), epochs=2, backend="numpy", log=None)
    tr_onnx.fit(mlp_path, batches(*digits), epochs=1, backend="numpy", log=None,
                checkpoint_dir=tmp_path)
    resumed = tr_onnx.Trainer.resume(tmp_path, batches(*digits), epochs=2, log=None)
    resumed.fit()
    assert [r["train_loss"] for r in resumed.history] == [r["train_loss"]
                                                          for r in full.history]
    for name, value in full.session.parameters().items():
        np.testing.assert_array_equal(resumed.session.parameters()[name], value, err_msg=name)
    with pytest.raises(ValueError, match="checkpoint_every: a mid-epoch checkpoint"):
        tr_onnx.Trainer(full.session, batches(*digits), checkpoint_every=2, log=None)


def test_every_public_name_resolves():
    missing = [name for name in tr_onnx.__all__ if getattr(tr_onnx, name, None) is None]
    assert not missing
    assert tr_onnx.fit is tr_onnx.training.fit.fit and tr_onnx.Trainer.fit


def test_a_dict_of_arrays_with_labels_in_a_list_is_a_data_set(mlp_path, digits):
    x, y = digits
    result = tr_onnx.fit(mlp_path, ({"input": x}, y.tolist()), epochs=1, backend="numpy",
                         log=None)
    assert result.session.step == N // BATCH


def test_a_mistyped_option_names_the_nearest(mlp_path, digits):
    with pytest.raises(tr_onnx.OptionError, match="unknown option\\(s\\) \\['epoch'\\] "
                                                  "\\(epoch: did you mean epochs"):
        tr_onnx.fit(mlp_path, digits, epoch=3, backend="numpy", log=None)
    with pytest.raises(tr_onnx.OptionError, match="frozn: did you mean frozen"):
        tr_onnx.evaluate(mlp_path, digits, frozn=["x"], backend="numpy")
