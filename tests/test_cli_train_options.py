"""The fine-tuning controls of ``tr-onnx train`` and ``tr-onnx evaluate`` (issue 32): what is
trained (``--frozen``/``--trainable``, and ``frozen=``/``trainable=`` of the Python API, where
a typo was silently ignored), with which optimizer settings (``--weight-decay``,
``--momentum``), on which output (``--output``), validated on which data (``--val-data``); the
runs the command line refuses (``--epochs 0``, options ``--resume`` would ignore) and what it
says (did you mean, a softmax output under cross-entropy, Ctrl-C without checkpoints).

Oracles: torch.optim.SGD on the same Linear layers and batches, onnxruntime running the
exported model, torch's cross_entropy of its outputs, and the ONNX file's initializers."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.training.trainer import CHECKPOINT_NAME

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "model_zoo" / "mlp.onnx")
TRAIN_STEP = tr_onnx.TrainingSession.train_step


def mlp_data(path: Path, n: int = 32, seed: int = 0) -> str:
    """An .npz for model_zoo/mlp.onnx (input [N, 64] float32, labels 0..9 int64)."""
    rng = np.random.default_rng(seed)
    np.savez(path, input=rng.standard_normal((n, 64)).astype(np.float32),
             labels=rng.integers(0, 10, n).astype(np.int64))
    return str(path)


def initializers(path) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def count_steps(monkeypatch, interrupt_at: int | None = None) -> list:
    """Record every train_step call; with ``interrupt_at``, that call raises
    KeyboardInterrupt (Ctrl-C) instead of training."""
    calls = []
    step = TRAIN_STEP

    def train_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(tr_onnx.TrainingSession, "train_step", train_step)
    return calls


def torch_ce(logits: np.ndarray, labels: np.ndarray) -> float:
    import torch

    return float(torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(),
                                                   torch.from_numpy(labels)))


# ---- what trains and how ---------------------------------------------------------------------

def test_frozen_layer_stays_and_the_rest_trains_as_torch_sgd_with_momentum_and_weight_decay(
        tmp_path, monkeypatch):
    import torch

    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    status = main(["train", MLP, "--data", data, "--epochs", "1", "--batch-size", "8",
                   "--val-split", "0", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                   "--weight-decay", "0.01", "--frozen", "0.*", "--no-progress",
                   "--out", "m.onnx"])
    assert status == 0
    start, trained = initializers(MLP), initializers(tmp_path / "m.onnx")
    layers = [torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 10)]
    for i, layer in zip((0, 2, 4), layers):
        layer.weight.data = torch.from_numpy(start[f"{i}.weight"].copy())
        layer.bias.data = torch.from_numpy(start[f"{i}.bias"].copy())
    layers[0].requires_grad_(False)
    net = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9, weight_decay=0.01)
    with np.load(data) as d:
        x, y = d["input"], d["labels"]
    order = np.random.default_rng(0).permutation(len(y))  # the Trainer's epoch-1 order, seed 0
    for b in range(4):
        idx = order[b * 8:(b + 1) * 8]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(x[idx])),
                                          torch.from_numpy(y[idx])).backward()
        opt.step()
    for i, layer in zip((0, 2, 4), layers):
        np.testing.assert_allclose(trained[f"{i}.weight"], layer.weight.detach().numpy(),
                                   rtol=0, atol=2e-6)
        np.testing.assert_allclose(trained[f"{i}.bias"], layer.bias.detach().numpy(),
                                   rtol=0, atol=2e-6)
    assert np.array_equal(trained["0.weight"], start["0.weight"])  # frozen: bit for bit
    (out,) = ort_run(str(tmp_path / "m.onnx"), {"input": x})
    np.testing.assert_allclose(out, net(torch.from_numpy(x)).detach().numpy(), atol=1e-5)


def test_trainable_pattern_trains_only_the_matching_initializers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    assert main(["train", MLP, "--data", data, "--epochs", "1", "--val-split", "0",
                 "--trainable", "4.*", "--no-progress", "--out", "m.onnx"]) == 0
    start, trained = initializers(MLP), initializers(tmp_path / "m.onnx")
    changed = sorted(k for k in start if not np.array_equal(start[k], trained[k]))
    assert changed == ["4.bias", "4.weight"]


TYPOS = [
    pytest.param("frozen", "0.weigth", "'0.weight'", id="frozen-typo"),
    pytest.param("trainable", "4.bais", "'4.bias'", id="trainable-typo"),
    pytest.param("frozen", "fc*", "'0.bias', '0.weight'", id="frozen-nothing-near"),
]


@pytest.mark.parametrize("option, pattern, named", TYPOS)
def test_a_pattern_matching_no_initializer_is_an_error_naming_the_nearest_cli(
        tmp_path, monkeypatch, capsys, option, pattern, named):
    monkeypatch.chdir(tmp_path)
    steps = count_steps(monkeypatch)
    status = main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--no-progress",
                   f"--{option}", pattern])
    err = capsys.readouterr().err
    assert status == 2 and not steps and err.count("\n") == 1
    assert f"{option}: {pattern!r} matches no initializer" in err and named in err
    assert not (tmp_path / "mlp_trained.onnx").exists()


@pytest.mark.parametrize("option, pattern, named", TYPOS)
def test_a_pattern_matching_no_initializer_is_an_error_in_the_python_api(option, pattern,
                                                                          named):
    with pytest.raises(tr_onnx.OptionError, match="matches no initializer") as exc:
        tr_onnx.TrainingSession(MLP, backend="numpy", **{option: [pattern]})
    assert named in str(exc.value)


def test_one_string_is_one_pattern_not_its_characters():
    session = tr_onnx.TrainingSession(MLP, backend="numpy", frozen="0.*")
    assert session.options.frozen == ("0.*",)


@pytest.mark.parametrize("optimizer, option, takes", [
    pytest.param("adamw", "--momentum", "sgd does", id="adamw-momentum"),
    pytest.param("adagrad", "--momentum", "sgd does", id="adagrad-momentum"),
])
def test_an_option_the_optimizer_does_not_take_is_an_error_naming_it(
        tmp_path, monkeypatch, capsys, optimizer, option, takes):
    monkeypatch.chdir(tmp_path)
    steps = count_steps(monkeypatch)
    status = main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--optimizer",
                   optimizer, option, "0.9", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and not steps
    assert f"{option}: optimizer {optimizer} takes no momentum; {takes}" in err


# ---- validation data and evaluate ------------------------------------------------------------

def test_val_data_is_what_the_final_val_loss_is_of(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, val = mlp_data(tmp_path / "t.npz"), mlp_data(tmp_path / "v.npz", n=20, seed=5)
    assert main(["train", MLP, "--data", train, "--val-data", val, "--epochs", "2",
                 "--batch-size", "4", "--metrics", "m.jsonl", "--no-progress",
                 "--out", "m.onnx"]) == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    with np.load(val) as v:
        (logits,) = ort_run(str(tmp_path / "m.onnx"), {"input": v["input"]})
        expected = torch_ce(logits, v["labels"])
        acc = float((logits.argmax(1) == v["labels"]).mean())
    assert records[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert records[-1]["val_acc"] == pytest.approx(acc)
    # all 32 samples of --data trained, none held out (0.2 would leave 26: 7 batches of 4)
    assert records[-1]["step"] == 2 * 8


def test_val_data_with_other_named_classes_is_refused(tmp_path, monkeypatch, capsys):
    """A table's text labels are numbered in sorted order per file: a validation file without
    class 'b' would number 'c' as 1, which the model learned as 'b'."""
    pytest.importorskip("pyarrow")
    monkeypatch.chdir(tmp_path)
    model = two_output_model(tmp_path / "heads.onnx")
    rng = np.random.default_rng(0)

    def table(name: str, classes: str) -> str:
        rows = [",".join(f"{v:.3f}" for v in rng.standard_normal(4)) + f",{c}"
                for c in classes * 4]
        (tmp_path / name).write_text("f0,f1,f2,f3,label\n" + "\n".join(rows) + "\n")
        return name

    steps = count_steps(monkeypatch)
    assert main(["train", model, "--output", "a", "--data", table("t.csv", "abc"),
                 "--val-data", table("v.csv", "ac"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert not steps
    assert "--val-data v.csv: its classes ['a', 'c'] are not those of --data t.csv" in err
    assert main(["train", model, "--output", "a", "--data", "t.csv", "--epochs", "1",
                 "--val-data", table("v2.csv", "cab"), "--no-progress", "--out", "m.onnx"]) == 0
    # evaluate holds data to the classes recorded beside the trained model (m.data.json)
    capsys.readouterr()
    assert main(["evaluate", "m.onnx", "--output", "a", "--data", "v.csv"]) == 2
    assert "its classes ['a', 'c'] are not those of m.data.json" in capsys.readouterr().err
    assert main(["evaluate", "m.onnx", "--output", "a", "--data", "v2.csv"]) == 0


def test_val_data_and_val_split_together_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    assert main(["train", MLP, "--data", data, "--val-data", data, "--val-split", "0.1"]) == 2
    assert "--val-data" in capsys.readouterr().err


def test_evaluate_prints_the_loss_and_accuracy_onnxruntime_and_torch_give(tmp_path, capsys):
    data = mlp_data(tmp_path / "d.npz", n=40, seed=3)
    assert main(["evaluate", MLP, "--data", data, "--batch-size", "16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    with np.load(data) as d:
        (logits,) = ort_run(MLP, {"input": d["input"]})
        assert info["loss"] == pytest.approx(torch_ce(logits, d["labels"]), rel=1e-5)
        assert info["acc"] == pytest.approx(float((logits.argmax(1) == d["labels"]).mean()))
    assert info["samples"] == 40
    assert main(["evaluate", MLP, "--data", data]) == 0
    assert "loss" in capsys.readouterr().out


# ---- which output ----------------------------------------------------------------------------

def two_output_model(path: Path, softmax: bool = False) -> str:
    """x [N, 4] -> a = x @ Wa (+ Softmax), b = x @ Wb: two heads, each its own weight."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "Wa"], ["za" if softmax else "a"]),
             helper.make_node("MatMul", ["x", "Wb"], ["b"])]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["za"], ["a"], name="head_softmax", axis=1))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in "ab"]
    graph = helper.make_graph(
        nodes, "heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        outputs, [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), w)
                  for w in ("Wa", "Wb")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def heads_data(path: Path) -> str:
    rng = np.random.default_rng(1)
    np.savez(path, x=rng.standard_normal((16, 4)).astype(np.float32),
             labels=rng.integers(0, 3, 16).astype(np.int64))
    return str(path)


def test_a_model_with_several_outputs_needs_output_and_trains_the_one_named(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model, data = two_output_model(tmp_path / "heads.onnx"), heads_data(tmp_path / "d.npz")
    steps = count_steps(monkeypatch)
    assert main(["train", model, "--data", data, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert not steps and "2 outputs (a, b)" in err and "--output NAME" in err
    assert main(["train", model, "--data", data, "--output", "c", "--no-progress"]) == 2
    assert "--output c: not an output" in capsys.readouterr().err
    assert main(["train", model, "--data", data, "--output", "b", "--epochs", "1",
                 "--no-progress", "--out", "m.onnx"]) == 0
    start, trained = initializers(model), initializers(tmp_path / "m.onnx")
    assert np.array_equal(trained["Wa"], start["Wa"])  # head a: not what the loss reads
    assert not np.array_equal(trained["Wb"], start["Wb"])


def test_cross_entropy_on_a_softmax_output_warns_that_the_model_applies_softmax(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, data = two_output_model(tmp_path / "h.onnx", softmax=True), heads_data(tmp_path / "d")
    with pytest.warns(UserWarning, match="already applies softmax") as caught:
        assert main(["train", model, "--data", data + ".npz", "--output", "a", "--epochs", "1",
                     "--no-progress"]) == 0
    assert "output 'a'" in str(caught[0].message) and "head_softmax" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert main(["train", model, "--data", data + ".npz", "--output", "b", "--epochs", "1",
                     "--no-progress"]) == 0


# ---- runs refused, and what the command line says --------------------------------------------

@pytest.mark.parametrize("argv, hint", [
    pytest.param(["trian", MLP], "did you mean train?", id="command"),
    pytest.param(["evalute", MLP], "did you mean evaluate?", id="command-evaluate"),
    pytest.param(["train", MLP, "--data", "digits", "--frozn", "x"],
                 "--frozn: did you mean --frozen?", id="train-option"),
    pytest.param(["train", MLP, "--data", "digits", "--lr-shedule", "cosine"],
                 "--lr-shedule: did you mean --lr-schedule?", id="train-option-2"),
    pytest.param(["inspect", MLP, "--jsn"], "--jsn: did you mean --json?", id="inspect-option"),
    pytest.param(["train", MLP, "--data", "digits", "--epoch", "3"],
                 "--epoch: did you mean --epochs?", id="no-abbreviations"),
    pytest.param(["train", MLP, "--data", "digits", "--lr-schedule", "cosin"],
                 "did you mean cosine?", id="option-choice"),
    pytest.param(["train", MLP, "--data", "digits", "--backend", "cdua"],
                 "did you mean cuda?", id="option-choice-2"),
])
def test_a_mistyped_command_or_option_says_did_you_mean(capsys, argv, hint):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and hint in err


def test_epochs_0_is_refused_and_leaves_the_trained_model_as_it_was(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlp_trained.onnx").write_bytes(b"an earlier run's model")
    steps = count_steps(monkeypatch)
    assert main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert "--epochs" in err and "would train nothing" in err and not steps
    assert (tmp_path / "mlp_trained.onnx").read_bytes() == b"an earlier run's model"


def resume_args(data: str) -> list[str]:
    return ["--data", data, "--batch-size", "8", "--val-split", "0", "--no-progress",
            "--checkpoint-dir", "ck"]


def test_ctrl_c_then_resume_without_epochs_continues_to_the_checkpoints_epochs(
        tmp_path, monkeypatch, capsys):
    """3 epochs of 4 batches, Ctrl-C in the 7th batch (after the epoch-1 checkpoint), resumed
    without --epochs: 3 epochs (not the default 5), and the weights of an uninterrupted run."""
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz")
    assert main(["train", MLP, "--epochs", "3", *resume_args(data), "--out", "whole.onnx",
                 "--checkpoint-dir", "whole"]) == 0
    capsys.readouterr()
    steps = count_steps(monkeypatch, interrupt_at=7)
    assert main(["train", MLP, "--epochs", "3", *resume_args(data)]) == 130
    err = capsys.readouterr().err
    assert err == ("tr-onnx: interrupted after 6 steps; continue with --resume "
                   "--checkpoint-dir ck\n")
    steps = count_steps(monkeypatch)
    assert main(["train", MLP, "--resume", *resume_args(data), "--out", "m.onnx"]) == 0
    assert "after 3 epochs" in capsys.readouterr().out
    assert len(steps) == 8  # epochs 2 and 3 (the checkpoint was written at the end of epoch 1)
    whole, resumed = initializers(tmp_path / "whole.onnx"), initializers(tmp_path / "m.onnx")
    assert all(np.array_equal(whole[k], resumed[k]) for k in whole)


def test_ctrl_c_without_checkpoint_dir_says_what_was_lost(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    count_steps(monkeypatch, interrupt_at=3)
    assert main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--batch-size", "8",
                 "--no-progress"]) == 130
    assert capsys.readouterr().err == ("tr-onnx: interrupted after 2 steps; nothing saved: use "
                                       "--checkpoint-dir to resume\n")
    assert not (tmp_path / "mlp_trained.onnx").exists()


@pytest.mark.parametrize("option", [
    ["--lr", "0.1"], ["--optimizer", "sgd"], ["--loss", "mse"], ["--frozen", "0.*"],
    ["--trainable", "4.*"], ["--grad-accumulation", "2"], ["--lr-schedule", "cosine"],
    ["--clip-grad-norm", "1"], ["--weight-decay", "0"], ["--momentum", "0.9"],
], ids=lambda o: o[0])
def test_resume_refuses_an_option_that_would_change_what_the_checkpoint_trains(
        tmp_path, monkeypatch, capsys, option):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz", n=16)
    assert main(["train", MLP, "--epochs", "1", *resume_args(data)]) == 0
    kept = (tmp_path / "ck" / CHECKPOINT_NAME).read_bytes()
    capsys.readouterr()
    steps = count_steps(monkeypatch)
    assert main(["train", MLP, "--resume", "--epochs", "2", *resume_args(data), *option]) == 2
    err = capsys.readouterr().err
    assert not steps and err.count("\n") == 1
    assert "--resume continues the checkpoint's training" in err
    assert f"{option[0]} {option[1]} (the checkpoint's: " in err
    assert (tmp_path / "ck" / CHECKPOINT_NAME).read_bytes() == kept


def test_resume_accepts_the_first_commands_options_repeated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz", n=16)
    first = ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--weight-decay",
             "0.001", "--lr-schedule", "cosine", "--frozen", "0.*", "--output", "logits",
             "--loss", "cross_entropy", "--grad-accumulation", "2", "--clip-grad-norm", "1"]
    assert main(["train", MLP, "--epochs", "1", *resume_args(data), *first]) == 0
    steps = count_steps(monkeypatch)
    assert main(["train", MLP, "--epochs", "2", "--resume", *resume_args(data), *first]) == 0
    assert len(steps) == 2


def test_resume_honours_checkpoint_every_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path / "d.npz", n=16)
    assert main(["train", MLP, "--epochs", "1", *resume_args(data)]) == 0
    capsys.readouterr()
    saved = []
    save = tr_onnx.TrainingSession.save_checkpoint
    monkeypatch.setattr(tr_onnx.TrainingSession, "save_checkpoint",
                        lambda self, *a, **k: (saved.append(self.step), save(self, *a, **k)))
    assert main(["train", MLP, "--resume", "--epochs", "2", *resume_args(data),
                 "--checkpoint-every", "1"]) == 0
    assert "--resume: --checkpoint-every 1 applies from the resumed step on" in \
        capsys.readouterr().out
    assert saved == [3, 4]  # after batch 1 of epoch 2, and at its end
