"""Security: a model (or a checkpoint) reads external data only from a folder the caller named.

A model given as bytes or as a ModelProto has no folder: its external data is refused unless
``external_data_dir=`` names one (it was read relative to the working folder, so a crafted
model pulled in any file it could name there). Wherever external data is read, a ``location``
that leaves the folder (absolute, ``..``, a symbolic link to a file or a folder outside) is a
``ModelLoadError``. A checkpoint's model, which ``save_checkpoint`` writes inline, may not
reference external data at all: ``export`` would copy the named file into the trained model.

Oracles: ``x @ w`` in NumPy for a one-MatMul model whose weights live in a file; onnxruntime
for the model-zoo MLP.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.optim import SGD

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


def weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)


def external(tensor: onnx.TensorProto, location: str) -> onnx.TensorProto:
    """``tensor`` with its data moved to ``location`` (the bytes are not written anywhere)."""
    onnx.external_data_helper.set_external_data(tensor, location)
    tensor.ClearField("raw_data")
    return tensor


def matmul_model(location: str) -> onnx.ModelProto:
    """y = x @ w, with w (4x3 float32) kept in the external file ``location``."""
    w = external(numpy_helper.from_array(np.zeros((4, 3), np.float32), "w"), location)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def constant_model(location: str) -> onnx.ModelProto:
    """y = x @ c, with c a Constant node's tensor kept in the external file ``location`` (no
    initializer is external)."""
    c = external(numpy_helper.from_array(np.zeros((4, 3), np.float32), "c"), location)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=c),
         helper.make_node("MatMul", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model, **kwargs) -> np.ndarray:
    return tr_onnx.InferenceSession(model, **kwargs).run(None, {"x": X})[0]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working folder holds a file a crafted model names (``secret.bin``: its values)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "secret.bin").write_bytes(weights(1).tobytes())
    monkeypatch.chdir(cwd)
    return cwd


# ---- a model without a path ------------------------------------------------------------------

SOURCES = {
    "bytes": lambda m: m.SerializeToString(),
    "ModelProto": lambda m: m,
}
SESSIONS = {
    "inference": lambda src, **kw: tr_onnx.InferenceSession(src, **kw),
    "training": lambda src, **kw: tr_onnx.TrainingSession(src, loss="mse", backend="numpy",
                                                          **kw),
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("session", SESSIONS)
@pytest.mark.parametrize("build", [matmul_model, constant_model], ids=["initializer", "Constant"])
def test_model_without_a_path_may_not_read_the_working_folder(workdir, source, session, build):
    with pytest.raises(tr_onnx.ModelLoadError) as err:
        SESSIONS[session](SOURCES[source](build("secret.bin")))
    message = str(err.value)
    assert "\n" not in message
    assert f"<{source}>" in message and "'secret.bin'" in message
    assert "external_data_dir=" in message


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("location", ["w.bin", "sub/w.bin", "./sub/w.bin"])
def test_external_data_dir_is_where_a_model_without_a_path_reads(workdir, tmp_path, source,
                                                                  location):
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (base / location).write_bytes(weights(2).tobytes())
    model = matmul_model(location)
    got = run(SOURCES[source](model), external_data_dir=base)
    np.testing.assert_allclose(got, X @ weights(2), rtol=1e-6)
    assert not np.allclose(got, X @ weights(1))  # never the working folder's file
    assert model.graph.initializer[0].data_location == TensorProto.EXTERNAL  # caller's proto


def test_training_session_passes_external_data_dir_to_model_and_loss(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "w.bin").write_bytes(weights(3).tobytes())
    (base / "scale.bin").write_bytes(np.float32(0.5).tobytes())
    scale = external(numpy_helper.from_array(np.float32(0), "scale"), "scale.bin")
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    lbl = helper.make_tensor_value_info("labels", TensorProto.FLOAT, [2, 3])
    loss = helper.make_model(helper.make_graph(
        [helper.make_node("Sub", ["y", "labels"], ["d"]),
         helper.make_node("Mul", ["d", "d"], ["sq"]),
         helper.make_node("ReduceSum", ["sq"], ["s"], keepdims=0),
         helper.make_node("Mul", ["s", "scale"], ["loss"])], "loss", [out, lbl],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [scale]),
        opset_imports=[helper.make_opsetid("", 17)])
    session = tr_onnx.TrainingSession(matmul_model("w.bin").SerializeToString(), loss=loss,
                                      optimizer=SGD(lr=0.1), backend="numpy",
                                      external_data_dir=base)
    labels = np.ones((2, 3), np.float32)
    got = session.train_step({"x": X}, labels)
    want = 0.5 * np.sum((X @ weights(3) - labels) ** 2)
    assert got == pytest.approx(float(want), rel=1e-5)


# ---- containment: the location stays inside the folder ---------------------------------------

def _escape(kind: str, base: Path, outside: Path) -> str:
    """A location, relative to ``base``, that reaches ``outside/secret.bin``."""
    if kind == "absolute":
        return str(outside / "secret.bin")
    if kind == "dotdot":
        return "../outside/secret.bin"
    if kind == "dotdot-inside":
        return "sub/../../outside/secret.bin"
    if kind == "symlink-file":
        (base / "link.bin").symlink_to(outside / "secret.bin")
        return "link.bin"
    if kind == "symlink-folder":
        (base / "linked").symlink_to(outside, target_is_directory=True)
        return "linked/secret.bin"
    raise AssertionError(kind)


ESCAPES = ["absolute", "dotdot", "dotdot-inside", "symlink-file", "symlink-folder"]


@pytest.fixture
def folders(tmp_path):
    base, outside = tmp_path / "base", tmp_path / "outside"
    (base / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.bin").write_bytes(weights(4).tobytes())
    return base, outside


@pytest.mark.parametrize("how", ["path", "bytes+external_data_dir", "ModelProto+external_data_dir"])
@pytest.mark.parametrize("kind", ESCAPES)
def test_external_location_may_not_leave_the_folder(folders, kind, how):
    base, outside = folders
    location = _escape(kind, base, outside)
    model = matmul_model(location)
    if how == "path":
        onnx.save_model(model, base / "m.onnx")
        src, kwargs, name = base / "m.onnx", {}, "m.onnx"
    else:
        src = model.SerializeToString() if how.startswith("bytes") else model
        kwargs, name = {"external_data_dir": base}, "<" + how.split("+")[0] + ">"
    with pytest.raises(tr_onnx.ModelLoadError) as err:
        run(src, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    assert name in message and "tensor 'w'" in message and repr(location) in message


def test_symlink_inside_the_folder_to_a_file_inside_is_refused_too(folders):
    # onnx's rule: the data file itself may not be a symbolic link
    base, _ = folders
    (base / "real.bin").write_bytes(weights(5).tobytes())
    (base / "alias.bin").symlink_to(base / "real.bin")
    with pytest.raises(tr_onnx.ModelLoadError, match="symbolic link"):
        run(matmul_model("alias.bin").SerializeToString(), external_data_dir=base)
    np.testing.assert_allclose(run(matmul_model("real.bin"), external_data_dir=base),
                               X @ weights(5), rtol=1e-6)


def test_path_model_reads_every_external_tensor_from_its_own_folder(workdir, tmp_path):
    # a Constant node's tensor (no initializer external) was read from the working folder
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "secret.bin").write_bytes(weights(6).tobytes())
    onnx.save_model(constant_model("secret.bin"), folder / "m.onnx")
    np.testing.assert_allclose(run(folder / "m.onnx"), X @ weights(6), rtol=1e-6)


def test_external_data_dir_reads_a_real_export_as_onnxruntime_does(tmp_path):
    proto = onnx.load(ZOO / "mlp.onnx")
    onnx.save_model(proto, tmp_path / "mlp.onnx", save_as_external_data=True,
                    location="mlp.onnx.data", size_threshold=0)
    unloaded = onnx.load(tmp_path / "mlp.onnx", load_external_data=False)
    feed = {"input": np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)}
    got = tr_onnx.InferenceSession(unloaded, external_data_dir=tmp_path).run(None, feed)[0]
    assert_close_relative(got, ort_run(str(tmp_path / "mlp.onnx"), feed)[0])


# ---- checkpoints carry every tensor inline -----------------------------------------------------

def _train(session) -> None:
    rng = np.random.default_rng(0)
    session.train_step({"input": rng.standard_normal((4, 64)).astype(np.float32)},
                       rng.integers(0, 10, 4))


def _rewrite(path: Path, **replace: np.ndarray) -> None:
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update(replace)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())


def _as_bytes(value) -> np.ndarray:
    return np.frombuffer(value if isinstance(value, bytes) else value.encode(), np.uint8)


def test_checkpoint_is_written_with_every_tensor_inline(tmp_path):
    proto = onnx.load(ZOO / "mlp.onnx")
    onnx.save_model(proto, tmp_path / "mlp.onnx", save_as_external_data=True,
                    location="mlp.onnx.data", size_threshold=0)
    session = tr_onnx.TrainingSession(tmp_path / "mlp.onnx", optimizer=SGD(lr=0.1),
                                      backend="numpy")
    _train(session)
    path = session.save_checkpoint(tmp_path / "ck.npz")
    (tmp_path / "mlp.onnx.data").unlink()
    with np.load(path) as data:
        model = onnx.load_model_from_string(data["__model__"].tobytes())
    assert not any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    resumed = tr_onnx.TrainingSession.from_checkpoint(path)
    for name, value in session.parameters().items():
        np.testing.assert_array_equal(resumed.parameters()[name], value)


@pytest.mark.parametrize("where", ["model", "loss model"])
def test_checkpoint_referencing_external_data_is_refused(workdir, tmp_path, where):
    """The crafted checkpoint's 0.weight names the working folder's file; resuming and
    exporting copied that file's bytes into the trained model."""
    (workdir / "secret.bin").write_bytes(np.full((128, 64), 7, np.float32).tobytes())
    if where == "model":
        session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1),
                                          backend="numpy")
    else:
        session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", loss=_mse_loss_model(),
                                          optimizer=SGD(lr=0.1), backend="numpy")
    path = session.save_checkpoint(tmp_path / "ck.npz")
    with np.load(path) as data:
        model = onnx.load_model_from_string(data["__model__"].tobytes())
        meta = json.loads(data["__meta__"].tobytes())
    if where == "model":
        weight = next(i for i in model.graph.initializer if i.name == "0.weight")
        external(weight, "secret.bin")
        _rewrite(path, __model__=_as_bytes(model.SerializeToString()))
    else:
        loss = onnx.load_model_from_string(bytes.fromhex(meta["config"]["loss"]["onnx"]))
        loss.graph.initializer.append(external(
            numpy_helper.from_array(np.float32(0), "unused"), "secret.bin"))
        meta["config"]["loss"]["onnx"] = loss.SerializeToString().hex()
        _rewrite(path, __meta__=_as_bytes(json.dumps(meta)))
    with pytest.raises(tr_onnx.CheckpointError) as err:
        resumed = tr_onnx.TrainingSession.from_checkpoint(path)
        resumed.export(tmp_path / "out.onnx")  # what a crafted checkpoint got out of it
    message = str(err.value)
    assert "\n" not in message
    assert "ck.npz" in message and "external data" in message and "'secret.bin'" in message
    assert not (tmp_path / "out.onnx").exists()


def _mse_loss_model() -> onnx.ModelProto:
    """mean((logits - onehot)^2) as an ONNX loss model (labels are class indices)."""
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])
    lbl = helper.make_tensor_value_info("labels", TensorProto.INT64, ["n"])
    depth = numpy_helper.from_array(np.array(10, np.int64), "depth")
    values = numpy_helper.from_array(np.array([0, 1], np.float32), "values")
    return helper.make_model(helper.make_graph(
        [helper.make_node("OneHot", ["labels", "depth", "values"], ["t"]),
         helper.make_node("Sub", ["logits", "t"], ["d"]),
         helper.make_node("Mul", ["d", "d"], ["sq"]),
         helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)], "loss", [out, lbl],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [depth, values]),
        opset_imports=[helper.make_opsetid("", 17)])

