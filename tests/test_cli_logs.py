"""TensorBoard event files (``tr-onnx train --log-dir``) and plots per task (issue 32).

The event files are read back record by record: TFRecord framing (length, masked CRC, data,
masked CRC) around tensorboardX's own ``Event`` protobuf, and every scalar is compared with the
metrics line the Trainer wrote for the same epoch or step. The plot: one panel per metric the
records hold (a regression gets no accuracy panel), per-step points with --metrics-every."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tr_onnx.cli import main
from tr_onnx.training.plots import history_figure, metric_names

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "model_zoo" / "mlp.onnx")


def read_events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the event files of ``log_dir``."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list] = {}
    files = sorted(log_dir.glob("events.out.tfevents.*"))
    assert files
    for path in files:
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def mlp_data(path: Path, n: int = 48) -> str:
    rng = np.random.default_rng(0)
    np.savez(path, input=rng.standard_normal((n, 64)).astype(np.float32),
             labels=rng.integers(0, 10, n).astype(np.int64))
    return str(path)


def test_log_dir_holds_every_metric_of_every_epoch_and_step_record(tmp_path, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.chdir(tmp_path)
    assert main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--epochs", "2",
                 "--batch-size", "8", "--metrics-every", "2", "--metrics", "m.jsonl",
                 "--log-dir", "tb", "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    scalars = read_events(tmp_path / "tb")
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    # 5 batches per epoch (38 of 48 train), a step line every 2nd of the 10
    assert len(epochs) == 2 and len(steps) == 5
    for tag, kind, key, at in [("epoch/loss/train", epochs, "train_loss", "epoch"),
                               ("epoch/loss/val", epochs, "val_loss", "epoch"),
                               ("epoch/acc/val", epochs, "val_acc", "epoch"),
                               ("epoch/lr", epochs, "lr", "epoch"),
                               ("step/loss/train", steps, "train_loss", "step")]:
        expected = [(r[at], pytest.approx(r[key], rel=1e-6)) for r in kind]
        assert scalars[tag] == expected, tag
    assert "epoch/acc/train" in scalars and "step/epoch" not in scalars


def test_log_dir_that_is_a_file_is_refused_before_the_first_step(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tb").write_text("a file")
    assert main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--log-dir", "tb"]) == 2
    assert "--log-dir tb" in capsys.readouterr().err
    assert not (tmp_path / "mlp_trained.onnx").exists()


CLASSIFICATION = [{"kind": "epoch", "epoch": e, "step": 4 * e, "train_loss": 2.0 / e,
                   "train_acc": 0.2 * e, "val_loss": 2.1 / e, "val_acc": 0.1 * e, "lr": 1e-3}
                  for e in (1, 2)]
REGRESSION = [{"kind": "epoch", "epoch": e, "step": 4 * e, "train_loss": 2.0 / e,
               "train_acc": None, "val_loss": None, "val_acc": None, "lr": 1e-3}
              for e in (1, 2)]
WITH_METRICS = [r | {"val_macro_f1": 0.3 * r["epoch"], "val_per_class_f1": [0.1, 0.2]}
                for r in CLASSIFICATION]


@pytest.mark.parametrize("history, panels", [
    pytest.param(CLASSIFICATION, ["loss", "accuracy"], id="classification"),
    pytest.param(REGRESSION, ["loss"], id="regression-no-accuracy-panel"),
    pytest.param(WITH_METRICS, ["loss", "accuracy", "macro_f1"], id="a-panel-per-metric"),
])
def test_the_plot_has_a_panel_per_metric_in_the_records(history, panels):
    pytest.importorskip("matplotlib")
    fig = history_figure(history)
    assert [ax.get_ylabel() for ax in fig.axes] == panels
    loss = fig.axes[0]
    train = next(line for line in loss.lines if line.get_label() == "train")
    assert list(train.get_xdata()) == [1, 2]
    np.testing.assert_allclose(train.get_ydata(), [2.0, 1.0])


def test_metric_names_skip_nulls_lists_and_positions():
    assert metric_names(WITH_METRICS) == ["loss", "acc", "macro_f1"]
    assert metric_names(REGRESSION) == ["loss"]


def test_the_plot_draws_per_step_points_at_the_optimizer_step(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    from tr_onnx.training import plots

    drawn = {}
    figure = plots.history_figure

    def keep(history, steps=None):
        drawn["fig"] = fig = figure(history, steps)
        drawn["steps"] = steps
        return fig

    monkeypatch.setattr(plots, "history_figure", keep)
    assert main(["train", MLP, "--data", mlp_data(tmp_path / "d.npz"), "--epochs", "2",
                 "--batch-size", "8", "--metrics-every", "1", "--plot", "c.png",
                 "--no-progress"]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loss = drawn["fig"].axes[0]
    assert loss.get_xlabel() == "step"
    per_step = next(line for line in loss.lines if line.get_label() == "train (per step)")
    assert list(per_step.get_xdata()) == list(range(1, 11))  # 5 batches x 2 epochs
    np.testing.assert_allclose(per_step.get_ydata(),
                               [r["train_loss"] for r in drawn["steps"]])
