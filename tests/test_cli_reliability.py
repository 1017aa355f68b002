"""The command line under bad paths, bad numbers and bad files (issue 12): ``tr-onnx train``
checks every output path before the first step and writes the model before the plot;
``--resume`` refuses another model; ``run`` and ``inspect`` name a bad ``--inputs`` file, a bad
count, a bad ``--shape`` and a negative declared dimension; ``--plot`` writes the format its
suffix names; and the command line as people expect it: ``--version``, ``python -m tr_onnx``,
help for every option, a closed pipe, warnings as one line each."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from paths import unwritable_folder

import tr_onnx
from tr_onnx.cli import build_parser, main
from tr_onnx.optim import OPTIMIZERS, SCHEDULES
from tr_onnx.training.losses import LOSSES
from tr_onnx.training.trainer import CHECKPOINT_NAME, Trainer

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "model_zoo"
MLP, LENET = str(ZOO / "mlp.onnx"), str(ZOO / "lenet.onnx")
RESNET_TRAIN = str(ZOO / "resnet_train.onnx")


def one_error_line(capsys) -> str:
    """stderr of a command that failed with a usage or input error: exactly one line."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def mlp_data(tmp_path: Path, n: int = 64, seed: int = 0, nan_at: int | None = None) -> str:
    """An .npz for model_zoo/mlp.onnx (input [N, 64] float32, labels 0..9 int64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    if nan_at is not None:
        x[nan_at] = np.nan
    path = tmp_path / "data.npz"
    np.savez(path, input=x, labels=rng.integers(0, 10, n).astype(np.int64))
    return str(path)


def count_steps(monkeypatch) -> list:
    """Record every TrainingSession.train_step call (the run's steps)."""
    calls = []
    step = tr_onnx.TrainingSession.train_step

    def train_step(self, *args, **kwargs):
        calls.append(1)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(tr_onnx.TrainingSession, "train_step", train_step)
    return calls


# ---- item 3: every output path is checked before the first step ------------------------------

def out_paths(tmp_path: Path, **given) -> list[str]:
    """Train options with every output inside tmp_path, ``given`` replacing some of them."""
    paths = {"--out": tmp_path / "m.onnx", "--plot": tmp_path / "c.png",
             "--metrics": tmp_path / "m.jsonl", "--checkpoint-dir": tmp_path / "ck"} | given
    return [x for k, v in paths.items() for x in (k, str(v))]


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


BAD_OUTPUTS = [
    pytest.param("--out", lambda p: p, "is a folder", id="out-is-a-folder"),
    pytest.param("--out", lambda p: a_file(p) / "m.onnx", "is a file, not a folder",
                 id="out-under-a-file"),
    pytest.param("--out", lambda p: unwritable_folder(p)[0] / "m.onnx", "cannot create files in",
                 id="out-in-an-unwritable-folder"),
    pytest.param("--plot", lambda p: p, "is a folder", id="plot-is-a-folder"),
    pytest.param("--plot", lambda p: a_file(p) / "sub" / "c.png", "is a file, not a folder",
                 id="plot-under-a-file"),
    pytest.param("--metrics", lambda p: p, "is a folder", id="metrics-is-a-folder"),
    pytest.param("--metrics", lambda p: unwritable_folder(p)[0] / "m.jsonl",
                 "cannot create files in", id="metrics-in-an-unwritable-folder"),
    pytest.param("--checkpoint-dir", a_file, "is a file, not a folder",
                 id="checkpoint-dir-is-a-file"),
    pytest.param("--checkpoint-dir", lambda p: unwritable_folder(p)[0] / "ck",
                 "cannot create files in", id="checkpoint-dir-in-an-unwritable-folder"),
]


@pytest.mark.parametrize("option, make, reason", BAD_OUTPUTS)
def test_train_refuses_an_output_it_cannot_write_before_the_first_step(
        tmp_path, monkeypatch, capsys, option, make, reason):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    bad = make(tmp_path)
    before = sorted(outputs.rglob("*"))
    steps = count_steps(monkeypatch)
    status = main(["train", MLP, "--data", data, "--epochs", "1", "--no-progress",
                   *out_paths(outputs, **{option: bad})])
    err = one_error_line(capsys)
    assert status == 2 and not steps
    assert err.startswith("tr-onnx: error: ") and option in err and str(bad) in err
    assert reason in err
    assert sorted(outputs.rglob("*")) == before  # nothing written: no model, metrics, checkpoint


def test_train_creates_missing_parent_folders_and_writes_the_plot_format_its_suffix_names(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path)
    out, plot = tmp_path / "a" / "b" / "m.onnx", tmp_path / "c" / "curves.svg"
    metrics, ckpt = tmp_path / "d" / "m.jsonl", tmp_path / "e" / "f"
    assert main(["train", MLP, "--data", data, "--epochs", "1", "--no-progress", "--out", str(out),
                 "--plot", str(plot), "--metrics", str(metrics), "--checkpoint-dir",
                 str(ckpt)]) == 0
    assert out.is_file() and metrics.is_file() and (ckpt / CHECKPOINT_NAME).is_file()
    assert ET.parse(plot).getroot().tag.endswith("svg")  # an SVG document, not PNG bytes


def supported_plot_suffixes() -> list[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return list(FigureCanvasBase.get_supported_filetypes())


def test_train_refuses_a_plot_suffix_matplotlib_cannot_write_before_the_first_step(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    steps = count_steps(monkeypatch)
    status = main(["train", MLP, "--data", mlp_data(tmp_path), "--epochs", "1", "--no-progress",
                   "--plot", "curves.xyz"])
    err = one_error_line(capsys)
    assert status == 2 and not steps and "--plot curves.xyz" in err and "'.xyz'" in err
    assert all(f".{suffix}" in err for suffix in supported_plot_suffixes())
    assert not list(tmp_path.glob("*.onnx")) and not Path("curves.xyz").exists()


def test_a_plot_that_fails_after_training_still_leaves_the_trained_model(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def disk_full(history, path, steps=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("tr_onnx.training.plots.plot_history", disk_full)
    data = mlp_data(tmp_path)
    status = main(["train", MLP, "--data", data, "--epochs", "1", "--no-progress", "--plot",
                   "c.png", "--val-split", "0"])
    err = one_error_line(capsys)
    assert status == 2 and "--plot c.png" in err and "No space left on device" in err
    assert "mlp_trained.onnx" in err  # where the model went
    x = np.load(data)["input"][:4]
    ort.InferenceSession("mlp_trained.onnx").run(None, {"input": x})  # a whole model


def test_a_diverged_run_still_plots_the_epochs_it_completed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    step, calls = tr_onnx.TrainingSession.train_step, []

    def train_step(self, feed, labels, **kwargs):
        calls.append(1)
        if len(calls) > 8:  # epoch 2 on (8 batches an epoch): every batch is NaN
            feed = {k: np.full_like(v, np.nan) for k, v in feed.items()}
        return step(self, feed, labels, **kwargs)

    monkeypatch.setattr(tr_onnx.TrainingSession, "train_step", train_step)
    status = main(["train", MLP, "--data", mlp_data(tmp_path), "--epochs", "3", "--batch-size",
                   "8", "--val-split", "0", "--no-progress", "--plot", "c.svg"])
    err = capsys.readouterr().err
    assert status == 1 and "tr-onnx: training diverged" in err
    assert ET.parse("c.svg").getroot().tag.endswith("svg")
    assert not Path("mlp_trained.onnx").exists()


def test_the_trainer_refuses_a_plot_format_before_training(tmp_path):
    session = tr_onnx.TrainingSession(MLP)
    x = np.zeros((4, 64), np.float32)
    with pytest.raises(tr_onnx.InputError, match=r"c\.xyz: plot format '\.xyz' is not supported"):
        Trainer(session, ({"input": x}, np.zeros(4, np.int64)), plot_path=tmp_path / "c.xyz")


# ---- item 4: --resume refuses another model -----------------------------------------------------

def train_then_resume(tmp_path, model: str, data: str, resume_with: str) -> int:
    args = ["--data", data, "--no-progress", "--val-split", "0", "--checkpoint-dir", "ck",
            "--batch-size", "8"]
    assert main(["train", model, "--epochs", "1", *args]) == 0
    return main(["train", resume_with, "--epochs", "2", "--resume", *args])


def test_resume_refuses_a_model_that_is_not_the_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = mlp_data(tmp_path, n=16)
    main(["train", MLP, "--epochs", "1", "--data", data, "--no-progress", "--val-split", "0",
          "--checkpoint-dir", "ck", "--batch-size", "8"])
    kept = (tmp_path / "ck" / CHECKPOINT_NAME).read_bytes()
    capsys.readouterr()
    steps = count_steps(monkeypatch)
    status = main(["train", LENET, "--epochs", "2", "--data", data, "--no-progress",
                   "--val-split", "0", "--checkpoint-dir", "ck", "--batch-size", "8",
                   "--resume"])
    err = one_error_line(capsys)
    assert status == 2 and not steps
    assert "lenet.onnx" in err and str(Path("ck") / CHECKPOINT_NAME) in err
    assert (tmp_path / "ck" / CHECKPOINT_NAME).read_bytes() == kept
    assert not (tmp_path / "lenet_trained.onnx").exists()


def digits_like(tmp_path: Path, shape: tuple[int, ...], n: int = 16) -> str:
    rng = np.random.default_rng(1)
    path = tmp_path / "data.npz"
    np.savez(path, input=rng.standard_normal((n, *shape)).astype(np.float32),
             labels=rng.integers(0, 10, n).astype(np.int64))
    return str(path)


@pytest.mark.parametrize("model, sample", [
    pytest.param(MLP, (64,), id="mlp"),
    # exported in training mode: export writes BatchNormalization training_mode=0 back
    pytest.param(RESNET_TRAIN, (3, 16, 16), id="resnet-train-mode"),
])
def test_resume_accepts_the_models_trained_export(tmp_path, monkeypatch, capsys, model, sample):
    monkeypatch.chdir(tmp_path)
    data = digits_like(tmp_path, sample)
    stem = Path(model).stem
    trained = f"{stem}_trained.onnx"
    status = train_then_resume(tmp_path, model, data, trained)
    assert status == 0, capsys.readouterr().err
    original = onnx.load(model)
    weights = {i.name for i in original.graph.initializer}
    exported = {i.name: i for i in onnx.load(trained).graph.initializer if i.name in weights}
    assert any(onnx.numpy_helper.to_array(i).tobytes()
               != onnx.numpy_helper.to_array(exported[i.name]).tobytes()
               for i in original.graph.initializer)  # its weights were trained
    assert Path(f"{stem}_trained_trained.onnx").is_file()  # the resumed run went on


# ---- item 14: run names a bad --inputs file, a bad count, a negative declared dimension ------

def pickled_npz(path: Path) -> Path:
    np.savez(path, input=np.array([{"a": 1}], dtype=object))
    return path


def raw_pickle(path: Path) -> Path:
    path.write_bytes(pickle.dumps({"input": np.zeros((1, 64), np.float32)}))
    return path


def npy_file(path: Path) -> Path:
    path = path.with_suffix(".npy")
    np.save(path, np.zeros((1, 64), np.float32))
    return path


@pytest.mark.parametrize("make, reason", [
    pytest.param(lambda p: p, "no such file", id="missing"),
    pytest.param(pickled_npz, "allow_pickle", id="npz-with-an-object-array"),
    pytest.param(raw_pickle, "allow_pickle", id="a-pickle"),
    pytest.param(npy_file, "not an .npz", id="an-npy"),
])
def test_run_names_an_inputs_file_it_cannot_load(tmp_path, capsys, make, reason):
    path = make(tmp_path / "x.npz")
    assert main(["run", MLP, "--inputs", str(path)]) == 2
    err = one_error_line(capsys)
    assert err.startswith("tr-onnx: error: --inputs ") and str(path) in err and reason in err


@pytest.mark.parametrize("command, option, value", [
    pytest.param("run", "--channel-align", "-8", id="run-channel-align"),
    pytest.param("run", "--batch", "-1", id="run-batch"),
    pytest.param("run", "--repeat", "0", id="run-repeat"),
    pytest.param("inspect", "--channel-align", "-8", id="inspect-channel-align"),
    pytest.param("inspect", "--batch", "0", id="inspect-batch"),
    pytest.param("train", "--val-split", "-0.2", id="train-val-split"),
])
def test_a_bad_count_is_a_one_line_usage_error(tmp_path, monkeypatch, capsys, command, option,
                                               value):
    monkeypatch.chdir(tmp_path)  # today's train wrote ./mlp_trained.onnx
    extra = ["--data", "digits"] if command == "train" else []
    assert main([command, MLP, *extra, option, value]) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"tr-onnx {command}: error: ") and option in err and value in err


def negative_dim_model(tmp_path: Path) -> str:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4])])
    path = tmp_path / "negative.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.mark.parametrize("command, extra", [
    pytest.param("run", [], id="run"),
    pytest.param("run", ["--shape", "x=2,4"], id="run-with-shape"),
    pytest.param("inspect", [], id="inspect"),
])
def test_a_negative_declared_dimension_is_named(tmp_path, capsys, command, extra):
    model = negative_dim_model(tmp_path)
    declared = [d.dim_value for d in onnx.load(model).graph.input[0].type.tensor_type.shape.dim]
    assert main([command, model, *extra]) == 2
    err = one_error_line(capsys)
    assert "negative.onnx" in err and "input 'x'" in err and str(declared) in err


# ---- item 15: inspect --shape says what is wrong with it -------------------------------------

def mlp_input() -> tuple[str, list]:
    (vi,) = onnx.load(MLP).graph.input
    return vi.name, [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_shape_of_the_wrong_rank_names_the_input_and_its_rank(capsys, command):
    name, dims = mlp_input()
    given = ",".join(["2"] * (len(dims) + 1))
    assert main([command, MLP, "--shape", f"{name}={given}"]) == 2
    err = one_error_line(capsys)
    assert f"--shape {name}={given}" in err and f"rank {len(dims)}" in err and str(dims) in err
    assert "data-dependent" not in err


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_shape_for_a_name_that_is_not_an_input_lists_the_inputs(capsys, command):
    name, _ = mlp_input()
    assert main([command, MLP, "--shape", "nope=2,64"]) == 2
    err = one_error_line(capsys)
    assert "--shape nope=2,64" in err and "not an input" in err and repr(name) in err


@pytest.mark.parametrize("given", ["input=a,64", "input=2,-64", "input="])
def test_shape_that_is_not_a_list_of_sizes_is_named(capsys, given):
    assert main(["inspect", MLP, "--shape", given]) == 2
    err = one_error_line(capsys)
    assert f"--shape {given}" in err


# ---- the command line as people expect it ----------------------------------------------------

def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_through_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "tr_onnx", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"tr-onnx {pyproject_version()}\n"


def test_version_from_main(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tr-onnx {pyproject_version()}\n"


def parsers():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and a.dest == "command"]
    return {"tr-onnx": parser, **sub.choices}


def test_every_option_has_help_without_markup():
    for name, parser in parsers().items():
        assert "``" not in (parser.description or "") + (parser.epilog or ""), name
        for action in parser._actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings}"
            assert "``" not in action.help, f"{name} {action.option_strings}: {action.help}"


@pytest.mark.parametrize("option, names", [
    pytest.param("--loss", list(LOSSES), id="loss"),
    pytest.param("--optimizer", list(OPTIMIZERS), id="optimizer"),
    pytest.param("--lr-schedule", list(SCHEDULES), id="lr-schedule"),
])
def test_train_help_lists_the_valid_names(option, names):
    (action,) = [a for a in parsers()["train"]._actions if option in a.option_strings]
    assert all(name in action.help for name in names), action.help


@pytest.mark.parametrize("command", [None, "inspect", "run", "ops", "plugins", "train"])
def test_help_text_has_no_restructuredtext_markup(capsys, command):
    assert main([*([command] if command else []), "--help"]) == 0
    assert "``" not in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly():
    """``tr-onnx ops --json | head -1``: the reader goes away before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "tr_onnx.cli", "ops", "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err and not err, err
    assert proc.returncode == 1


def test_a_skipped_step_is_one_warning_line_with_its_own_batch_and_step(tmp_path):
    """As people see it: a process of its own (in-process, pytest records the warnings)."""
    n, bs, bad = 64, 8, 21
    data = mlp_data(tmp_path, n=n, nan_at=bad)
    result = subprocess.run([sys.executable, "-m", "tr_onnx", "train", MLP, "--data", data,
                             "--epochs", "1", "--batch-size", str(bs), "--val-split", "0",
                             "--seed", "3", "--no-progress", "--out", str(tmp_path / "m.onnx")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.splitlines()
    # the Trainer's documented order: epoch e visits default_rng(seed + e).permutation(n)
    batch = int(np.flatnonzero(np.random.default_rng(3).permutation(n) == bad)[0]) // bs
    assert len(warnings) == 1, warnings  # one line: no source line under it
    assert warnings[0].startswith(f"tr-onnx: warning: epoch 1/1, batch {batch + 1}/{n // bs}: "
                                  f"step {batch + 1}: non-finite loss"), warnings
    assert ".py" not in warnings[0]  # no source path
