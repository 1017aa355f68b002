"""Metrics against scikit-learn on random data, accumulated batch by batch: top-k accuracy,
macro and per-class F1, mIoU (Jaccard), perplexity, MSE and MAE, and which metrics a task gets
by default."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn import metrics as skm

from tr_onnx.training.metrics import default_metrics, make_metrics, metric_values


def accumulated(names, batches, class_axis=1, ignore_index=None) -> dict:
    """The metrics ``names`` over ``batches`` ((x, y) pairs), sums added batch by batch."""
    metrics = make_metrics(names, class_axis=class_axis, ignore_index=ignore_index)
    totals = [np.zeros(m.size(batches[0][0].shape)) for m in metrics]
    for x, y in batches:
        for t, m in zip(totals, metrics):
            t += m.sums(x, y)
    return metric_values(metrics, totals, "val_")


def split_batches(x, y, sizes):
    edges = np.cumsum([0, *sizes])
    return [(x[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:])]


RNG = np.random.default_rng(0)
SCORES = RNG.standard_normal((97, 7)).astype(np.float32)
LABELS = RNG.integers(0, 7, 97)
BATCHES = split_batches(SCORES, LABELS, [32, 32, 32, 1])  # uneven: a mean of means would differ


@pytest.mark.parametrize("k", [1, 3, 5], ids=lambda k: f"top{k}")
def test_top_k_accuracy_equals_sklearn(k):
    want = skm.top_k_accuracy_score(LABELS, SCORES, k=k, labels=np.arange(7))
    assert accumulated([f"top{k}"], BATCHES)[f"val_top{k}"] == pytest.approx(want, abs=1e-12)


def test_macro_and_per_class_f1_equal_sklearn():
    pred = SCORES.argmax(1)
    got = accumulated(["f1"], BATCHES)
    assert got["val_f1"] == pytest.approx(skm.f1_score(LABELS, pred, average="macro"),
                                          abs=1e-12)
    np.testing.assert_allclose(got["val_f1_per_class"],
                               skm.f1_score(LABELS, pred, average=None), atol=1e-12)


def test_f1_leaves_out_classes_neither_labelled_nor_predicted_as_sklearn_does():
    x = np.eye(5, dtype=np.float32)[[0, 1, 1, 3, 0, 3]]  # predictions 0, 1, 3 only
    y = np.array([0, 1, 3, 3, 1, 0])  # class 2 and 4 absent from both
    got = accumulated(["f1"], [(x, y)])
    assert got["val_f1"] == pytest.approx(skm.f1_score(y, x.argmax(1), average="macro"))
    assert got["val_f1_per_class"][2] is None and got["val_f1_per_class"][4] is None


def test_f1_skips_ignore_index_labels():
    y = LABELS.copy()
    y[::5] = -100
    keep = y != -100
    got = accumulated(["f1"], split_batches(SCORES, y, [50, 47]), ignore_index=-100)
    want = skm.f1_score(y[keep], SCORES.argmax(1)[keep], average="macro")
    assert got["val_f1"] == pytest.approx(want, abs=1e-12)


def test_miou_of_segmentation_scores_equals_sklearn_jaccard():
    x = RNG.standard_normal((5, 4, 6, 7)).astype(np.float32)  # [N, C, H, W]
    y = RNG.integers(0, 4, (5, 6, 7))
    got = accumulated(["miou"], split_batches(x, y, [2, 2, 1]))
    want = skm.jaccard_score(y.reshape(-1), x.argmax(1).reshape(-1), average="macro")
    assert got["val_miou"] == pytest.approx(want, abs=1e-12)


def test_perplexity_is_exp_of_the_mean_token_loss_over_all_tokens():
    torch = pytest.importorskip("torch")
    x = RNG.standard_normal((6, 5, 11)).astype(np.float32)  # [N, T, V]
    y = RNG.integers(0, 11, (6, 5))
    y[0, 3:] = -100  # padding
    got = accumulated(["perplexity"], split_batches(x, y, [4, 2]), class_axis=-1,
                      ignore_index=-100)
    mean = torch.nn.functional.cross_entropy(torch.from_numpy(x.reshape(-1, 11)).double(),
                                             torch.from_numpy(y.reshape(-1)),
                                             ignore_index=-100)
    assert got["val_perplexity"] == pytest.approx(math.exp(mean.item()), rel=1e-12)


@pytest.mark.parametrize("name, sk", [("mse", skm.mean_squared_error),
                                      ("mae", skm.mean_absolute_error)], ids=["mse", "mae"])
def test_regression_metrics_equal_sklearn(name, sk):
    x = RNG.standard_normal((33, 3)).astype(np.float32)
    y = RNG.standard_normal((33, 3)).astype(np.float32)
    got = accumulated([name], split_batches(x, y, [16, 16, 1]))[f"val_{name}"]
    assert got == pytest.approx(sk(y.astype(np.float64), x.astype(np.float64)), rel=1e-12)


@pytest.mark.parametrize("task, rank, axis, classes, want", [
    ("classes", 2, 1, 10, ["top5", "f1"]),
    ("classes", 2, 1, 3, ["f1"]),
    ("classes", 3, -1, 50, ["perplexity"]),
    ("classes", 4, 1, 21, ["miou"]),
    ("regression", 2, 1, None, ["mse", "mae"]),
    ("other", 2, 1, None, []),
], ids=["classifier", "three-classes", "language-model", "segmentation", "regression",
        "bce-or-a-loss-model"])
def test_default_metrics_follow_the_task(task, rank, axis, classes, want):
    assert default_metrics(task, rank, axis, classes) == want


def test_an_unknown_metric_names_the_known_ones():
    from tr_onnx.errors import InputError

    with pytest.raises(InputError, match="unknown metric 'f2'.*top5, f1, miou"):
        make_metrics(["f2"], class_axis=1, ignore_index=None)


# ---- in the Trainer's records and summaries --------------------------------------------------

MLP = str(__import__("pathlib").Path(__file__).parent.parent / "model_zoo" / "mlp.onnx")


def digits_trainer(loss, shift=0.0):
    import tr_onnx
    from tr_onnx.data import load_dataset, split
    from tr_onnx.training.trainer import Trainer, label_kind

    session = tr_onnx.TrainingSession(MLP, loss=loss, backend="numpy")
    arrays, labels = load_dataset("digits", session.imported.inputs, *label_kind(session))
    if shift:  # targets that are not one-hot rows: a regression
        labels = labels + np.float32(shift)
    train, val = split(arrays, labels, 0.2)
    lines = []
    trainer = Trainer(session, train, val, epochs=1, progress=False, log=lines.append,
                      val_batch_size=50)
    trainer.fit()
    (x,) = session.run(["logits"], val[0])
    return trainer.history[-1], lines[-1], x, val[1]


def test_a_classifier_epoch_records_and_prints_top5_and_f1_as_sklearn_computes_them():
    record, line, x, y = digits_trainer("cross_entropy")
    assert record["val_f1"] == pytest.approx(skm.f1_score(y, x.argmax(1), average="macro"),
                                             abs=1e-9)
    np.testing.assert_allclose(record["val_f1_per_class"],
                               skm.f1_score(y, x.argmax(1), average=None), atol=1e-9)
    assert record["val_top5"] == pytest.approx(skm.top_k_accuracy_score(y, x, k=5), abs=1e-9)
    assert 0 < record["train_f1"] <= 1 and 0 < record["train_top5"] <= 1
    assert f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} top5 " \
           f"{record['val_top5']:.4f} f1 {record['val_f1']:.4f}" in line


def test_a_regression_epoch_prints_mse_and_mae_and_no_accuracy():
    record, line, x, y = digits_trainer("mse", shift=0.5)
    assert " acc " not in line and "val loss" in line
    assert record["val_mse"] == pytest.approx(skm.mean_squared_error(y, x), rel=1e-6)
    assert record["val_mae"] == pytest.approx(skm.mean_absolute_error(y, x), rel=1e-6)
    assert f"mse {record['val_mse']:.4f} mae {record['val_mae']:.4f}" in line
    assert record["train_acc"] is None and record["train_mse"] == pytest.approx(
        record["train_loss"], rel=1e-6)  # every sample has as many targets: the same mean


def test_a_language_models_perplexity_is_over_all_tokens_of_the_epoch(tmp_path):
    """With lr 0 the training outputs are the model's: the epoch's perplexity is exp of the
    mean over every non-padding token (batches with different token counts), as torch."""
    import warnings

    import tr_onnx
    from tr_onnx.optim import SGD
    from tr_onnx.training.trainer import Trainer

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    emb = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(emb, (torch.zeros(2, 5, dtype=torch.int64),), str(tmp_path / "lm.onnx"),
                          dynamo=False, input_names=["ids"], output_names=["logits"],
                          dynamic_axes={"ids": {0: "n"}, "logits": {0: "n"}})
    ids = RNG.integers(0, 11, (12, 5))
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100
    labels[:5, 2:] = -100  # padding: the first batch has fewer tokens
    spec = tr_onnx.LossSpec("cross_entropy", ignore_index=-100, class_axis=-1)
    session = tr_onnx.TrainingSession(tmp_path / "lm.onnx", loss=spec, optimizer=SGD(lr=0.0),
                                      backend="numpy")
    trainer = Trainer(session, [(ids[:6], labels[:6]), (ids[6:], labels[6:])],
                      val_data=(ids, labels), epochs=1, log=None)
    assert [m.name for m in trainer.metrics] == ["perplexity"]
    record = trainer.fit()[-1]
    with torch.no_grad():
        mean = torch.nn.functional.cross_entropy(emb(torch.from_numpy(ids)).reshape(-1, 11),
                                                 torch.from_numpy(labels).reshape(-1))
    assert record["train_perplexity"] == pytest.approx(math.exp(mean.item()), rel=1e-5)
    assert record["val_perplexity"] == pytest.approx(math.exp(mean.item()), rel=1e-5)


def test_a_segmentation_epoch_records_miou_as_sklearn_jaccard(tmp_path):
    import warnings

    import tr_onnx
    from tr_onnx.training.trainer import Trainer

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    seg = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(seg, (torch.zeros(2, 3, 8, 8),), str(tmp_path / "seg.onnx"),
                          dynamo=False, input_names=["image"], output_names=["scores"],
                          dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})
    x = RNG.standard_normal((20, 3, 8, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0)  # 4 classes from the pixels
    session = tr_onnx.TrainingSession(tmp_path / "seg.onnx", backend="numpy")
    trainer = Trainer(session, (x[:16], y[:16]), (x[16:], y[16:]), epochs=2, batch_size=4,
                      log=None)
    record = trainer.fit()[-1]
    (scores,) = session.run(["scores"], {"image": x[16:]})
    want = skm.jaccard_score(y[16:].reshape(-1), scores.argmax(1).reshape(-1), average="macro")
    assert record["val_miou"] == pytest.approx(want, abs=1e-9)
    assert 0 < record["train_miou"] <= 1 and "train_f1" not in record
