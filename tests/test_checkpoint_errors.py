"""Checkpoint, export and metrics files when things go wrong.

Writing: a full disk (ENOSPC, simulated by making ``os.write`` write half and fail, or
``os.fsync`` fail, for files in the test's folder; and for real on ``/dev/full``) or an
unwritable folder is a one-line ``WriteError`` naming the file and the OS's reason; the
previous file is unchanged and no temporary is left. Temporaries that a writer killed with
``kill -9`` left behind are removed by the next write of the same file once they are stale.

Reading: a corrupt checkpoint (built here from a real one of the model-zoo MLP) is a one-line
``CheckpointError`` naming the file and what is wrong, never a KeyError, ValueError or
BadZipFile traceback; pickled objects are never loaded.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from paths import unwritable_folder

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.cli import main
from tr_onnx.optim import AdamW
from tr_onnx.training.storage import STALE_TEMP_SECONDS
from tr_onnx.training.trainer import CHECKPOINT_NAME, Trainer

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "model_zoo" / "mlp.onnx"
NO_SPACE = os.strerror(errno.ENOSPC)
linux_fds = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                               reason="needs /proc/self/fd to tell which file a write is for")


def batch(seed: int):
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((8, 64)).astype(np.float32)}, rng.integers(0, 10, 8)


def trained_session(steps: int = 2) -> tr_onnx.TrainingSession:
    session = tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend="numpy")
    for i in range(steps):
        session.train_step(*batch(i))
    return session


def only_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def disk_full(monkeypatch, folder: Path, call: str) -> None:
    """``os.write`` (after writing half, as a filling disk does) or ``os.fsync`` fails with
    ENOSPC for files inside ``folder``; other files are written as usual."""
    real = {"write": os.write, "fsync": os.fsync}[call]

    def inside(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:
            return False

    def write(fd, data):
        if not inside(fd):
            return real(fd, data)
        real(fd, bytes(memoryview(data)[:len(data) // 2]))
        raise OSError(errno.ENOSPC, NO_SPACE)

    def fsync(fd):
        if inside(fd):
            raise OSError(errno.ENOSPC, NO_SPACE)
        return real(fd)

    monkeypatch.setattr(os, call, {"write": write, "fsync": fsync}[call])


def assert_one_line(err: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---- disk full, unwritable folder ------------------------------------------------------------

WRITERS = {
    "checkpoint": lambda session, path: session.save_checkpoint(path),
    "export": lambda session, path: session.export(path),
}


@linux_fds
@pytest.mark.parametrize("call", ["write", "fsync"])
@pytest.mark.parametrize("writer", WRITERS)
def test_disk_full_is_a_named_error_and_keeps_the_previous_file(tmp_path, monkeypatch, writer,
                                                                call):
    session = trained_session(1)
    path = tmp_path / f"{writer}.out"
    WRITERS[writer](session, path)
    previous = path.read_bytes()
    session.train_step(*batch(5))
    disk_full(monkeypatch, tmp_path, call)
    with pytest.raises(tr_onnx.WriteError) as err:
        WRITERS[writer](session, path)
    monkeypatch.undo()
    assert_one_line(err, str(path), NO_SPACE)
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
    assert path.read_bytes() == previous
    assert only_entries(tmp_path) == [path.name]  # no temporary left
    WRITERS[writer](session, path)  # space again: the write goes through
    assert path.read_bytes() != previous


def trainer(session, epochs: int, **kw) -> Trainer:
    rng = np.random.default_rng(0)
    data = ({"input": rng.standard_normal((40, 64)).astype(np.float32)},
            rng.integers(0, 10, 40))
    return Trainer(session, data, batch_size=10, epochs=epochs, progress=False,
                   log=lambda *_: None, **kw)


@linux_fds
def test_disk_full_while_writing_metrics_keeps_whole_lines_and_the_checkpoint(tmp_path,
                                                                             monkeypatch):
    metrics, ckpt = tmp_path / "metrics" / "m.jsonl", tmp_path / "ckpt"
    session = tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend="numpy")
    trainer(session, 1, metrics_path=metrics, checkpoint_dir=ckpt).fit()
    lines, saved = metrics.read_bytes(), (ckpt / CHECKPOINT_NAME).read_bytes()
    assert len(lines.splitlines()) == 1
    resumed = Trainer.resume(ckpt, trainer(session, 1).train_data, epochs=2,
                             metrics_path=metrics, progress=False, log=lambda *_: None)
    disk_full(monkeypatch, metrics.parent, "write")
    with pytest.raises(tr_onnx.WriteError) as err:
        resumed.fit()
    monkeypatch.undo()
    assert_one_line(err, str(metrics), NO_SPACE, "metrics line 2")
    assert metrics.read_bytes() == lines  # the half-written second line is cut off
    assert json.loads(lines)["epoch"] == 1
    assert (ckpt / CHECKPOINT_NAME).read_bytes() == saved
    assert only_entries(ckpt) == [CHECKPOINT_NAME]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_metrics_on_a_full_device_is_a_named_error():
    session = tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend="numpy")
    with pytest.raises(tr_onnx.WriteError) as err:
        trainer(session, 1, metrics_path="/dev/full").fit()
    assert_one_line(err, "/dev/full", NO_SPACE)


def _unwritable(kind: str, tmp_path: Path, monkeypatch) -> tuple[Path, str]:
    """A folder the checkpoint cannot be created in, and the reason the OS gives."""
    if kind == "refuses-files":
        return unwritable_folder(tmp_path)
    folder = tmp_path / "ro"  # a read-only mount, as the OS reports it
    folder.mkdir()

    def mkstemp(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / ".x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return folder, os.strerror(errno.EROFS)


@pytest.mark.parametrize("kind", ["refuses-files", "read-only-mount"])
def test_unwritable_checkpoint_folder_is_a_named_error(tmp_path, monkeypatch, kind):
    session = trained_session(1)
    folder, reason = _unwritable(kind, tmp_path, monkeypatch)
    before = only_entries(folder)
    with pytest.raises(tr_onnx.WriteError) as err:
        session.save_checkpoint(folder / "ck.npz")
    assert_one_line(err, str(folder / "ck.npz"), reason)
    assert only_entries(folder) == before


# ---- temporaries a killed writer left ------------------------------------------------------

KILLED_WRITER = """
import os, sys, time
from tr_onnx.training import storage as session

def hang(fd):
    print("ready", flush=True)
    time.sleep(120)

os.fsync = hang
session.atomic_write(sys.argv[1], b"x" * 4096)
"""


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_temporary_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "ck.npz"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], cwd=ROOT,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
    finally:
        proc.kill()  # kill -9 while the temporary is written, before the rename
        proc.wait()
        proc.stdout.close()
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".ck.npz.") and left.name.endswith(".tmp")
    session = trained_session(1)
    session.save_checkpoint(target)
    assert left.exists()  # recent: its writer may be one this machine cannot see
    age(left, STALE_TEMP_SECONDS + 1)
    session.save_checkpoint(target)
    assert only_entries(tmp_path) == ["ck.npz"]


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


@pytest.mark.parametrize("name, old, removed", [
    ("ck.npz/dead", True, True),
    ("ck.npz/dead", False, False),
    ("ck.npz/live", True, False),
    ("ck.npz/self", True, False),
    ("other.npz/dead", True, False),
    ("ck.npz.7/dead", True, False),
], ids=["dead-writer-old", "dead-writer-recent", "live-writer", "this-process",
        "other-target", "other-target-with-our-name-as-prefix"])
def test_only_stale_temporaries_of_the_same_file_are_removed(tmp_path, name, old, removed):
    target, writer = name.split("/")
    pid = {"dead": dead_pid(), "live": os.getppid(), "self": os.getpid()}[writer]
    temp = tmp_path / f".{target}.{pid}-abc_12xy.tmp"
    temp.write_bytes(b"half a checkpoint")
    if old:
        age(temp, STALE_TEMP_SECONDS + 1)
    trained_session(0).save_checkpoint(tmp_path / "ck.npz")
    assert temp.exists() != removed
    assert (tmp_path / "ck.npz").exists()


# ---- corrupt checkpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "ck.npz"
    trained_session(2).save_checkpoint(path)
    return path


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def savez(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def as_bytes(text) -> np.ndarray:
    return np.frombuffer(text if isinstance(text, bytes) else text.encode(), np.uint8)


def change_meta(edit):
    def corrupt(arrays, raw):
        meta = json.loads(arrays["__meta__"].tobytes())
        edit(meta)
        return savez({**arrays, "__meta__": as_bytes(json.dumps(meta))})
    return corrupt


def replace(**entries):
    return lambda arrays, raw: savez({**arrays, **entries})


def drop(key):
    return lambda arrays, raw: savez({k: v for k, v in arrays.items() if k != key})


UNPICKLED = []


def _unpickled(tag):
    UNPICKLED.append(tag)
    return tag


class Payload:
    """What a pickled object array could run when loaded."""

    def __reduce__(self):
        return _unpickled, ("ran",)


def npy_file(arrays, raw):
    buf = io.BytesIO()
    np.save(buf, arrays["state/0.weight"])
    return buf.getvalue()


CORRUPT = [  # (id, corrupt(arrays, raw bytes) -> file bytes, fragment of the message)
    ("truncated-half", lambda a, raw: raw[:len(raw) // 2], "not a readable tr_onnx checkpoint"),
    ("truncated-tail", lambda a, raw: raw[:-64], "not a readable tr_onnx checkpoint"),
    ("empty", lambda a, raw: b"", "not a readable tr_onnx checkpoint"),
    ("text", lambda a, raw: b"not a checkpoint\n", "not a readable tr_onnx checkpoint"),
    ("npy", npy_file, "one .npy array"),
    ("no-meta", drop("__meta__"), "no __meta__ entry"),
    ("no-model", drop("__model__"), "no __model__ entry"),
    ("meta-garbled", replace(__meta__=as_bytes(b'{"format": 1, "conf')), "not valid JSON"),
    ("meta-not-utf8", replace(__meta__=as_bytes(b"\xff\xfe\xfa")), "not valid JSON"),
    ("meta-list", replace(__meta__=as_bytes(b"[1, 2]")), "not a JSON object"),
    ("meta-floats", replace(__meta__=np.zeros(4, np.float32)), "__meta__ entry is float32"),
    ("no-config", change_meta(lambda m: m.pop("config")), "no 'config'"),
    ("config-number", change_meta(lambda m: m.update(config=3)), "no 'config'"),
    ("format-2", change_meta(lambda m: m.update(format=2)), "checkpoint format 2"),
    ("no-format", change_meta(lambda m: m.pop("format")), "checkpoint format None"),
    ("step-negative", change_meta(lambda m: m.update(step=-1)), "'step' is -1"),
    ("step-text", change_meta(lambda m: m.update(step="3")), "'step' is '3'"),
    ("no-loss", change_meta(lambda m: m["config"].pop("loss")), "configuration is not valid"),
    ("unknown-optimizer", change_meta(lambda m: m["config"]["optimizer"].update(name="nope")),
     "unknown optimizer 'nope'"),
    ("optimizer-list", change_meta(lambda m: m["config"].update(optimizer=[1])),
     "configuration is not valid"),
    ("unknown-option", change_meta(lambda m: m["config"].update(evil=1)),
     "unknown option(s) ['evil']"),
    ("bad-option-value", change_meta(lambda m: m["config"].update(grad_accumulation="x")),
     "cannot resume with its configuration"),
    ("model-truncated", lambda a, raw: savez({**a, "__model__": a["__model__"][:1000]}),
     "its model"),
    ("model-junk", replace(__model__=as_bytes(b"\xff" * 64)), "its model is not a valid ONNX"),
    ("object-array", replace(**{"state/0.weight": np.array([Payload()], dtype=object)}),
     "entry 'state/0.weight'"),
    ("param-shape", replace(**{"state/0.weight": np.zeros((64, 128), np.float32)}),
     "array '0.weight' is float32[64, 128], but the model's parameter '0.weight' is "
     "float32[128, 64]"),
    ("param-dtype", replace(**{"state/0.bias": np.zeros(128, np.float64)}),
     "array '0.bias' is float64[128]"),
    ("param-strings", replace(**{"state/0.bias": np.array(["a"] * 128)}),
     "array '0.bias' holds <U1, not numbers"),
]


@pytest.mark.parametrize("corrupt, fragment", [c[1:] for c in CORRUPT],
                         ids=[c[0] for c in CORRUPT])
def test_corrupt_checkpoint_is_a_named_error(good, tmp_path, corrupt, fragment):
    path = tmp_path / "ck.npz"
    path.write_bytes(corrupt(arrays_of(good), good.read_bytes()))
    with pytest.raises(tr_onnx.CheckpointError) as err:
        tr_onnx.TrainingSession.from_checkpoint(path)
    assert_one_line(err, str(path), fragment)
    assert UNPICKLED == []


@pytest.mark.parametrize("extra, fragment", [
    ({"epoch": "one"}, "position is not valid"),
    ({"totals": {"bogus": 1}}, "position is not valid"),
    ({"history": 5}, "position is not valid"),
], ids=["epoch-text", "totals-unknown-key", "history-number"])
def test_damaged_trainer_position_is_a_named_error(tmp_path, extra, fragment):
    session = tr_onnx.TrainingSession(MLP, optimizer=AdamW(lr=1e-2), backend="numpy")
    run = trainer(session, 1, checkpoint_dir=tmp_path)
    run.fit()
    path = tmp_path / CHECKPOINT_NAME
    path.write_bytes(change_meta(lambda m: m["extra"].update(extra))(arrays_of(path), None))
    with pytest.raises(tr_onnx.CheckpointError) as err:
        Trainer.resume(tmp_path, run.train_data, progress=False, log=lambda *_: None)
    assert_one_line(err, str(path), fragment)


def test_missing_checkpoint_is_a_named_error(tmp_path):
    with pytest.raises(tr_onnx.CheckpointError) as err:
        tr_onnx.TrainingSession.from_checkpoint(tmp_path / "nope.npz")
    assert_one_line(err, "nope.npz: no such checkpoint file")


def test_optimizer_state_that_does_not_fit_is_named_before_anything_changes(good, tmp_path):
    path = tmp_path / "ck.npz"
    path.write_bytes(replace(**{"state/0.weight.exp_avg": np.zeros(3, np.float32)})(
        arrays_of(good), None))
    session = tr_onnx.TrainingSession.from_checkpoint(path)  # the plan decides these arrays
    before, step = session.state_arrays(), session.step
    with pytest.raises(tr_onnx.CheckpointError) as err:
        session.train_step(*batch(9))
    assert_one_line(err, str(path), "array '0.weight.exp_avg' is float32[3]",
                    "float32[128, 64]")
    after = session.state_arrays()
    assert session.step == step and before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_bf16_gradients_in_a_checkpoint_resume_bitwise(tmp_path):
    """np.load gives bfloat16 arrays back as raw 2-byte values (``|V2``); the resumed plan reads
    them as bfloat16 again (writing them failed: "No cast function available")."""
    from tr_onnx.optim import SGD
    from tr_onnx.testing.host_emulator import build_host_library, host_emulator

    device = host_emulator(build_host_library(tmp_path / "kernels"))
    session = tr_onnx.TrainingSession(MLP, optimizer=SGD(lr=0.05, momentum=0.9),
                                      backend=CudaBackend(device=device), precision="bf16",
                                      grad_accumulation=2)
    for i in range(3):  # mid-accumulation: the half gradients hold one micro-batch
        session.train_step(*batch(i))
    path = session.save_checkpoint(tmp_path / "ck.npz")
    assert arrays_of(path)["state/0.weight.grad"].dtype.kind == "V"
    resumed = tr_onnx.TrainingSession.from_checkpoint(path, backend=CudaBackend(device=device))
    assert resumed.train_step(*batch(3)) == session.train_step(*batch(3))
    a, b = session.state_arrays(), resumed.state_arrays()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8), name)


def test_cli_resume_from_a_corrupt_checkpoint_is_one_line_and_exit_2(good, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    raw = good.read_bytes()
    (tmp_path / "ckpt" / CHECKPOINT_NAME).write_bytes(raw[:len(raw) // 3])
    assert main(["train", str(MLP), "--data", "digits", "--checkpoint-dir", "ckpt", "--resume",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert "last.ckpt.npz: not a readable tr_onnx checkpoint" in err
