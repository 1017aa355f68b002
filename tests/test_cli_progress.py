"""Progress on stderr (issue 32): elapsed time and ETA on a terminal's redrawn line; plain lines
(no ``\\r``) on anything else -- a pipe, a log file, rank 0's output under ``mpiexec`` -- one per
tenth of the epoch or per 10 s; nothing when disabled. The clock is the test's, so the ETA is
checked against arithmetic: steps left times the seconds per step since the first update."""

from __future__ import annotations

import io

import pytest

from tr_onnx.cli import main
from tr_onnx.training import progress
from tr_onnx.training.progress import ProgressBar, clock


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (59.4, "0:59"), (61, "1:01"),
                                           (3600 + 125, "1:02:05")])
def test_clock_reads_minutes_and_seconds(seconds, text):
    assert clock(seconds) == text


def test_a_terminal_gets_one_line_redrawn_with_elapsed_and_eta(fake_clock):
    stream = Terminal()
    bar = ProgressBar(10, "epoch 1/1", stream=stream, interval=0)
    fake_clock.now += 5  # the first step (plans, so slow): not in the rate
    bar.update(1, "loss 1.0")
    for done in range(2, 5):
        fake_clock.now += 2
        bar.update(done, "loss 0.5")
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r") == 4
    # 4 of 10 done after 11 s; 2 s per step since the first: 6 left -> 12 s
    assert text.rsplit("\r", 1)[1].startswith("epoch 1/1 [")
    assert "4/10 0:11<0:12 loss 0.5" in text
    assert "1/10 0:05<? loss 1.0" in text
    bar.close()
    assert stream.getvalue().endswith("\r")


def test_a_pipe_gets_a_plain_line_per_tenth_of_the_epoch(fake_clock):
    stream = io.StringIO()
    bar = ProgressBar(40, "epoch 2/3", stream=stream, interval=0)
    for done in range(1, 41):
        fake_clock.now += 0.1
        bar.update(done, "loss 0.5")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    # every 4th of 40 batches, but not the last (the epoch summary follows)
    assert [line.split()[2] for line in lines] == [f"{d}/40" for d in range(4, 40, 4)]
    assert lines[0] == "epoch 2/3: 4/40 (10%) 0:00<0:04 loss 0.5"


def test_a_pipe_gets_a_line_every_10_seconds_between_tenths(fake_clock):
    stream = io.StringIO()
    bar = ProgressBar(1000, "epoch 1/1", stream=stream)
    for done in range(1, 31):
        fake_clock.now += 1
        bar.update(done, "")
    # 30 of 1000 batches (no tenth yet): one line at 10 s, 20 s, 30 s
    assert [line.split()[2] for line in stream.getvalue().splitlines()] == \
        ["10/1000", "20/1000", "30/1000"]


@pytest.mark.parametrize("stream", [Terminal(), io.StringIO()], ids=["tty", "pipe"])
def test_disabled_draws_nothing(stream):
    bar = ProgressBar(4, "epoch 1/1", stream=stream, enabled=False, interval=0)
    for done in range(1, 5):
        bar.update(done, "")
    bar.close()
    assert stream.getvalue() == ""


def test_train_writes_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path, monkeypatch,
                                                                         capsys):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal((80, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 80).astype(np.int64))
    mlp = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "model_zoo"
              / "mlp.onnx")
    assert main(["train", mlp, "--data", str(tmp_path / "d.npz"), "--epochs", "1",
                 "--batch-size", "8", "--val-split", "0"]) == 0
    err = capsys.readouterr().err  # capsys's stderr is no terminal
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("epoch 1/1: ")]
    assert [line.split()[2] for line in lines] == [f"{d}/10" for d in range(1, 10)]


def test_an_unknown_total_shows_the_steps_and_elapsed_time_without_eta(fake_clock):
    stream, terminal = io.StringIO(), Terminal()
    lines = ProgressBar(0, "epoch 1/1", stream=stream)
    redrawn = ProgressBar(0, "epoch 1/1", stream=terminal, interval=0)
    for done in range(1, 26):
        fake_clock.now += 1
        lines.update(done, "")
        redrawn.update(done, "")
    assert stream.getvalue().splitlines() == ["epoch 1/1: 10/? 0:10 ", "epoch 1/1: 20/? 0:20 "]
    assert terminal.getvalue().endswith("\repoch 1/1 25/? 0:25 ")


def test_train_shows_validation_progress(tmp_path, monkeypatch, capsys):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal((48, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 48).astype(np.int64))
    mlp = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "model_zoo"
              / "mlp.onnx")
    # 24 validation samples in batches of 8: 3 runs, a line after each but the last
    assert main(["train", mlp, "--data", str(tmp_path / "d.npz"), "--epochs", "2",
                 "--batch-size", "8", "--val-split", "0.5"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "validation" in line]
    assert [line.split(":")[0] + " " + line.split()[3] for line in lines] == [
        f"epoch {e}/2 validation {d}/3" for e in (1, 2) for d in (1, 2)]
