"""A folder of .npy files trains like the same data in an .npz, read from the files per batch
(memory-mapped) rather than loaded whole."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from data_models import export_mlp, initializers

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.data import load, split
from tr_onnx.data.npy_folder import MappedRows
from tr_onnx.errors import InputError
from tr_onnx.training.trainer import Trainer, label_kind

FEATURES, CLASSES = 12, 3


def write_data(folder, n=200, features=FEATURES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features))  # float64, as files often are
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "labels.npy", y)
    return x, y


def train(model, data, out, *extra):
    assert main(["train", str(model), "--data", str(data), "--epochs", "2", "--batch-size",
                 "16", "--no-progress", "--backend", "numpy", "--optimizer", "sgd", "--out",
                 str(out), *extra]) == 0


def test_an_npy_folder_trains_bit_for_bit_as_the_same_data_in_an_npz(tmp_path):
    model = export_mlp(tmp_path / "mlp.onnx", FEATURES, CLASSES)
    x, y = write_data(tmp_path / "folder")
    np.savez(tmp_path / "data.npz", x=x, labels=y)
    train(model, tmp_path / "folder", tmp_path / "from_folder.onnx")
    train(model, tmp_path / "data.npz", tmp_path / "from_npz.onnx")
    before, folder, npz = (initializers(p) for p in (
        model, tmp_path / "from_folder.onnx", tmp_path / "from_npz.onnx"))
    assert folder.keys() == npz.keys() == before.keys()
    for name in npz:
        assert not np.array_equal(npz[name], before[name]), name  # it trained
        assert folder[name].tobytes() == npz[name].tobytes(), name


def test_the_arrays_stay_memory_mapped_through_the_split_and_training_reads_batches(tmp_path):
    n, features = 4096, 512  # 16 MiB of float64 inputs
    model = export_mlp(tmp_path / "mlp.onnx", features, CLASSES)
    write_data(tmp_path / "folder", n, features)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    kind, dtype = label_kind(session)
    tracemalloc.start()  # from the load on: nothing may hold the file's 16 MiB
    try:
        loaded = load(tmp_path / "folder", session.imported.inputs, kind, dtype)
        assert loaded.source == "npy_folder"
        (train_data, val_data) = split(*loaded.data, 0.25)
        for arrays in (loaded.data[0], train_data[0], val_data[0]):
            assert isinstance(arrays["x"], MappedRows)
            assert isinstance(arrays["x"].array, np.memmap)
            assert arrays["x"].dtype == np.float32
        assert len(train_data[0]["x"]) == 3072
        trainer = Trainer(session, train_data, val_data, batch_size=64, epochs=2, log=None,
                          progress=False)
        trainer.fit()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(val_data[0]["x"][:5],
                                  np.load(tmp_path / "folder" / "x.npy")[
                                      np.sort(np.random.default_rng(0).permutation(n)[:1024])[
                                          :5]].astype(np.float32))
    assert peak < n * features * 8 / 4, peak  # batches, not the file
    assert len(trainer.history) == 2


def test_a_float64_file_is_cast_per_batch(tmp_path):
    write_data(tmp_path / "folder")
    model = export_mlp(tmp_path / "mlp.onnx", FEATURES, CLASSES)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    arrays, _ = load(tmp_path / "folder", session.imported.inputs).data
    x = arrays["x"]
    assert x.array.dtype == np.float64 and x.dtype == np.float32
    batch = x[np.array([3, 1])]
    assert batch.dtype == np.float32 and type(batch) is np.ndarray
    np.testing.assert_array_equal(batch, np.load(tmp_path / "folder" / "x.npy")[[3, 1]]
                                  .astype(np.float32))


@pytest.mark.parametrize(("files", "message"), [
    pytest.param({"x": np.zeros((10, 5)), "labels": np.zeros(10, np.int64)},
                 r"array 'x' has shape \[10, 5\]; model input 'x' needs \[10, 12\]",
                 id="wrong-shape"),
    pytest.param({"x": np.zeros((10, 12)), "labels": np.zeros(10, np.int64),
                  "z": np.zeros(10)}, r"missing \[\], extra \['z'\]", id="extra-array"),
    pytest.param({"x": np.zeros((10, 12), np.int32), "labels": np.zeros(10, np.int64)},
                 r"array 'x' is int32; expected float32", id="integer-input"),
    pytest.param({"x": np.zeros((10, 12)), "labels": np.zeros(10)},
                 r"'labels' is float64; this loss needs integer class indices",
                 id="float-labels"),
    pytest.param({"x": np.array([[None] * 12] * 10), "labels": np.zeros(10, np.int64)},
                 r"x.npy: not a readable .npy", id="pickled-objects"),
])
def test_a_bad_folder_is_an_input_error_naming_it(tmp_path, files, message):
    model = export_mlp(tmp_path / "mlp.onnx", FEATURES, CLASSES)
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, array in files.items():
        np.save(folder / f"{name}.npy", array, allow_pickle=True)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    with pytest.raises(InputError, match=message) as info:
        load(folder, session.imported.inputs)
    assert str(folder) in str(info.value)
