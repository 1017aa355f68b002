"""CSV and Parquet tables train a real PyTorch export end to end through the command line: text
labels become classes in sorted order (the mapping written beside the trained model), numeric
targets train a regression; bad tables are errors that name the file, the column and the row."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest
from data_models import export_mlp
from oracles import assert_close_relative, ort_run

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.data import load
from tr_onnx.errors import InputError
from tr_onnx.training import trainer as trainer_module

SPECIES = ["setosa", "versicolor", "virginica"]  # sorted: their class indices 0, 1, 2


def iris_like(n: int = 150, seed: int = 0) -> pa.Table:
    """Four features around a centre per species (separable), the species as text, last."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.array([[5.0, 3.4, 1.5, 0.2], [5.9, 2.8, 4.3, 1.3], [6.6, 3.0, 5.6, 2.0]])
    x = centres[y] + rng.normal(scale=0.15, size=(n, 4))
    names = ["sepal_length", "sepal_width", "petal_length", "petal_width"]
    return pa.table({**{c: x[:, j] for j, c in enumerate(names)},
                     "species": [SPECIES[i] for i in y]})


def write(table: pa.Table, path):
    if path.suffix == ".csv":
        pyarrow.csv.write_csv(table, path)
    else:
        pyarrow.parquet.write_table(table, path)
    return path


@pytest.fixture
def trainers(monkeypatch):
    """The Trainer of each run of the command line (its session holds the trained weights)."""
    made = []
    fit = trainer_module.Trainer.fit

    def recording_fit(self):
        made.append(self)
        return fit(self)

    monkeypatch.setattr(trainer_module.Trainer, "fit", recording_fit)
    return made


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_table_with_text_labels_trains_and_its_export_predicts_the_classes(
        tmp_path, suffix, trainers, capsys):
    table = iris_like()
    data = write(table, tmp_path / f"iris{suffix}")
    model = export_mlp(tmp_path / "mlp.onnx", 4, 3)
    out = tmp_path / "trained.onnx"
    assert main(["train", str(model), "--data", str(data), "--epochs", "40", "--batch-size",
                 "16", "--lr", "0.02", "--no-progress", "--backend", "numpy", "--out",
                 str(out)]) == 0
    said = capsys.readouterr().out
    assert "labels from column 'species' (the last column" in said
    meta = json.loads(out.with_suffix(".data.json").read_text())
    assert meta == {"source": "table", "label": "species", "classes": SPECIES,
                    "features": table.column_names[:4]}
    x = np.stack([table.column(c).to_numpy() for c in meta["features"]], 1).astype(np.float32)
    (ours,) = trainers[-1].session.run(["logits"], {"x": x})
    (theirs,) = ort_run(str(out), {"x": x})
    assert_close_relative(theirs, ours, 1e-5)
    predicted = [meta["classes"][i] for i in theirs.argmax(1)]
    accuracy = np.mean(np.array(predicted) == np.array(table.column("species").to_pylist()))
    assert accuracy > 0.95, accuracy


def test_a_regression_table_trains_with_mse_on_the_columns_the_spec_names(tmp_path, trainers):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 3))
    target = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    table = pa.table({"id": [f"s{i}" for i in range(200)], "a": x[:, 0], "b": x[:, 1],
                      "unused": rng.normal(size=200), "c": x[:, 2], "target": target})
    data = write(table, tmp_path / "houses.csv")
    spec = tmp_path / "spec.toml"
    spec.write_text('kind = "table"\n[table]\nlabel = "target"\nfeatures = ["a", "b", "c"]\n')
    model = export_mlp(tmp_path / "reg.onnx", 3, 1, hidden=32)
    out = tmp_path / "trained.onnx"
    feed = {"x": x.astype(np.float32)}
    (before,) = ort_run(str(model), feed)
    assert main(["train", str(model), "--data", str(data), "--data-spec", str(spec), "--loss",
                 "mse", "--epochs", "30", "--batch-size", "16", "--lr", "0.01",
                 "--no-progress", "--backend", "numpy", "--out", str(out)]) == 0
    (after,) = ort_run(str(out), feed)
    (ours,) = trainers[-1].session.run(["logits"], feed)
    assert_close_relative(after, ours, 1e-5)
    mse_before = np.mean((before[:, 0] - target) ** 2)
    mse_after = np.mean((after[:, 0] - target) ** 2)
    assert mse_after < mse_before / 20, (mse_before, mse_after)
    meta = json.loads(out.with_suffix(".data.json").read_text())
    assert meta["features"] == ["a", "b", "c"] and meta["label"] == "target"


def test_default_features_leave_text_columns_out_and_say_so(tmp_path):
    table = pa.table({"name": ["a", "b", "c"], "f1": [1.0, 2.0, 3.0], "f2": [3, 4, 5],
                      "label": [0, 1, 0]})
    data = write(table, tmp_path / "t.csv")
    model = export_mlp(tmp_path / "mlp.onnx", 2, 2)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    loaded = load(data, session.imported.inputs)
    (x,), labels = loaded.data[0].values(), loaded.data[1]
    np.testing.assert_array_equal(x, np.array([[1, 3], [2, 4], [3, 5]], np.float32))
    np.testing.assert_array_equal(labels, [0, 1, 0])
    assert loaded.meta == {"label": "label", "features": ["f1", "f2"]}
    assert any("text columns ['name'] left out" in note for note in loaded.notes)
    assert any("labels from column 'label' (the column named 'label'" in note
               for note in loaded.notes)


CSV_ERRORS = [
    pytest.param("a,b,label\n1,2,x\n3,,y\n", {}, r"column 'b', row 3 \(the header is row 1\): "
                 "missing value", id="missing-feature"),
    pytest.param("a,b,label\n1,2,x\n3,4,\n", {}, r"column 'label', row 3 .*missing label",
                 id="missing-label"),
    pytest.param("a,b,label\n1,2,x\n3,4.5e1,y\n5,oops,z\n", {},
                 r"column 'b', row 4 .*'oops' is not a number", id="text-in-a-number-column"),
    pytest.param("a,name,label\n1,ann,x\n3,bob,y\n", {"features": ["a", "name"]},
                 r"column 'name', row 2 .*'ann' is not a number", id="text-feature-named"),
    pytest.param("a,b,label\n1,2,x\n", {"label": "species"},
                 r"no column 'species'; the columns are \['a', 'b', 'label'\]",
                 id="label-column-absent"),
    pytest.param("a,b,label\n1,2,x\n", {"features": ["a", "c"]}, r"no column 'c'",
                 id="feature-column-absent"),
    pytest.param("a,b,c,label\n1,2,3,x\n", {}, r"3 feature columns make \[N, 3\] values; "
                 r"model input 'x' is float32 \['batch', 2\]", id="too-many-features"),
    pytest.param("a,b,label\n1,2,0\n3,4,1.5\n", {}, r"column 'label', row 3 .*label 1.5 is "
                 "not a class index", id="fractional-class"),
    pytest.param("a,b,label\n1,2,0\n3,4\n", {}, r"not a readable CSV file", id="short-row"),
]


@pytest.mark.parametrize(("text", "section", "message"), CSV_ERRORS)
def test_a_bad_csv_is_an_input_error_naming_file_column_and_row(tmp_path, text, section,
                                                                 message):
    data = tmp_path / "bad.csv"
    data.write_text(text)
    model = export_mlp(tmp_path / "mlp.onnx", 2, 3)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    with pytest.raises(InputError, match=message) as info:
        load(data, session.imported.inputs, options={"table": section})
    assert str(info.value).startswith(str(data))


def test_a_missing_value_in_parquet_is_counted_from_row_1(tmp_path):
    data = write(pa.table({"a": [1.0, 2.0, float("nan")], "b": [1.0, None, 2.0],
                           "label": ["x", "y", "x"]}), tmp_path / "t.parquet")
    model = export_mlp(tmp_path / "mlp.onnx", 2, 2)
    session = tr_onnx.TrainingSession(str(model), backend="numpy")
    with pytest.raises(InputError, match=r"t.parquet: column 'a', row 3: missing value"):
        load(data, session.imported.inputs)


def test_text_labels_with_a_regression_loss_are_an_input_error(tmp_path):
    data = write(iris_like(10), tmp_path / "iris.csv")
    model = export_mlp(tmp_path / "mlp.onnx", 4, 1)
    session = tr_onnx.TrainingSession(str(model), backend="numpy", loss="mse")
    with pytest.raises(InputError, match=r"column 'species' holds text labels"):
        load(data, session.imported.inputs, "dense", np.float32)
