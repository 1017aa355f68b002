"""Hugging Face data sets saved with ``save_to_disk`` (issue 32): columns named after the model's
inputs train a PyTorch MLP through ``tr-onnx train``; text and image columns go through the text
and image preprocessing, and give what those sources give for the same texts and files.

Oracles: the columns as ``datasets`` returns them; the text and image sources (themselves
checked against ``tokenizers`` and torchvision's operations); onnxruntime runs the trained
export.
"""

from __future__ import annotations

import json
import warnings

import datasets
import numpy as np
import onnx
import pytest
import torch

from tests.oracles import ort_run
from tests.test_data_images import CLASSES, S, write_folder
from tests.test_data_images import files as image_files
from tests.test_data_images import spec as image_spec
from tests.test_data_text import sentences, specs, write_tokenizer
from tr_onnx.cli import main
from tr_onnx.data import load
from tr_onnx.errors import InputError
from tr_onnx.importer import InputSpec

F = 4


def blobs(n: int = 90) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = np.arange(n) % 3
    centres = np.array([[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]], np.float64)
    return centres[y] + 0.5 * rng.standard_normal((n, F)), y


def export_mlp(path) -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(F, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(mlp, (torch.zeros(2, F),), str(path), dynamo=False,
                          input_names=["features"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"features": {0: "n"}, "logits": {0: "n"}})


def test_columns_named_after_the_inputs_train_a_torch_mlp_through_the_cli(tmp_path, capsys):
    x, y = blobs()
    names = ["low", "mid", "high"]
    ds = datasets.Dataset.from_dict(
        {"features": x.tolist(), "label": y.tolist()},
        features=datasets.Features({"features": datasets.Sequence(datasets.Value("float64"),
                                                                  length=F),
                                    "label": datasets.ClassLabel(names=names)}))
    ds.save_to_disk(str(tmp_path / "ds"))
    arrays, labels = load(tmp_path / "ds", [InputSpec("features", ("n", F),
                                                      np.dtype(np.float32))]).data
    np.testing.assert_array_equal(arrays["features"], x.astype(np.float32))
    np.testing.assert_array_equal(labels, y)
    model, out = tmp_path / "mlp.onnx", tmp_path / "trained.onnx"
    export_mlp(model)
    status = main(["train", str(model), "--data", str(tmp_path / "ds"), "--out", str(out),
                   "--epochs", "10", "--batch-size", "10", "--lr", "0.05", "--no-progress",
                   "--backend", "numpy"])
    assert status == 0, capsys.readouterr().err
    assert json.loads(out.with_suffix(".data.json").read_text())["classes"] == names
    feed = {"features": x.astype(np.float32)}
    before = ort_run(onnx.load(model), feed)[0].argmax(1)
    after = ort_run(onnx.load(out), feed)[0].argmax(1)
    assert (after == y).mean() >= 0.9 > (before == y).mean()


def test_a_dataset_dict_reads_train_and_its_validation_folder_reads_validation(tmp_path):
    rows = sentences()
    tok = write_tokenizer(tmp_path / "tokenizer.json", [t for t, _ in rows])
    split = {"train": rows[:40], "validation": rows[40:]}
    dd = datasets.DatasetDict({k: datasets.Dataset.from_dict(
        {"text": [t for t, _ in v], "label": [lab for _, lab in v]}) for k, v in split.items()})
    dd.save_to_disk(str(tmp_path / "dd"))
    options = {"text": {"tokenizer": str(tok)}}
    for folder, part in ((tmp_path / "dd", "train"),
                         (tmp_path / "dd" / "validation", "validation")):
        jsonl = tmp_path / f"{part}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n"
                                 for t, lab in split[part]))
        got, want = load(folder, specs(), options=options), load(jsonl, specs(), options=options)
        assert got.source == "hf_dataset" and got.meta["classes"] == want.meta["classes"]
        for name in ("input_ids", "attention_mask"):
            np.testing.assert_array_equal(got.data[0][name], want.data[0][name])
        np.testing.assert_array_equal(got.data[1], want.data[1])
    with pytest.raises(InputError, match=r"no split 'test'; its splits: \['train', 'valid"):
        load(tmp_path / "dd", specs(), options={**options, "hf_dataset": {"split": "test"}})


def test_an_image_column_is_preprocessed_as_the_image_folder_is(tmp_path):
    root = write_folder(tmp_path / "images", per_class=4)
    paths = image_files(root)
    labels = [CLASSES.index(p.parent.name) for p in paths]
    ds = datasets.Dataset.from_dict(
        {"image": [str(p) for p in paths], "label": labels},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=list(CLASSES))}))
    ds.save_to_disk(str(tmp_path / "ds"))
    got = load(tmp_path / "ds", [image_spec("NHWC")])
    want = load(root, [image_spec("NHWC")])
    x, w = got.data[0]["x"], want.data[0]["x"]
    assert x.shape == w.shape == (len(paths), S, S, 3)
    np.testing.assert_array_equal(x[:], w[:])
    np.testing.assert_array_equal(x.for_epoch(3, 1)[:], w.for_epoch(3, 1)[:])
    np.testing.assert_array_equal(got.data[1], want.data[1])
    assert got.meta["classes"] == list(CLASSES)


def test_columns_that_fit_no_input_are_an_error(tmp_path):
    datasets.Dataset.from_dict({"a": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(InputError, match=r"columns \['a', 'label'\]: none named after"):
        load(tmp_path / "d", [InputSpec("features", ("n", F), np.dtype(np.float32))])
    datasets.Dataset.from_dict({"features": [[1.0] * F] * 2}).save_to_disk(str(tmp_path / "e"))
    with pytest.raises(InputError, match="no label column"):
        load(tmp_path / "e", [InputSpec("features", ("n", F), np.dtype(np.float32))])


def test_columns_keep_their_values_token_labels_included(tmp_path):
    """float64 reaches a float64 input unrounded (datasets' numpy format gives float32), and
    a causal LM's [N, T] token columns arrive as they are."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, F))
    ids = rng.integers(0, 50, (6, 5))
    labels = np.where(rng.random((6, 5)) < 0.3, -100, rng.integers(0, 50, (6, 5)))
    datasets.Dataset.from_dict({"x": x.tolist(), "label": [0, 1] * 3}).save_to_disk(
        str(tmp_path / "f"))
    arrays, y = load(tmp_path / "f", [InputSpec("x", ("n", F), np.dtype(np.float64))]).data
    np.testing.assert_array_equal(arrays["x"], x)
    datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}
                               ).save_to_disk(str(tmp_path / "lm"))
    arrays, y = load(tmp_path / "lm", [InputSpec("input_ids", ("n", "t"), np.dtype(np.int64))]
                     ).data
    np.testing.assert_array_equal(arrays["input_ids"], ids)
    np.testing.assert_array_equal(y, labels)
    assert y.dtype == np.int64
