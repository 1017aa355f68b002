"""Class-index labels out of range (issue 12, item 5): -1 trained as the last class (NumPy's
negative indexing), and class C of C was an IndexError from the validation loss after an epoch
had trained. A label outside [0, C) -- C from the model output's class axis -- other than the
loss's ``ignore_index`` is an ``InputError`` naming the value, its position and the valid range,
raised before any step (``TrainingSession.train_step``, ``Trainer.fit``, ``tr-onnx train``) and
never an IndexError from the validation loss. Targets of mse and the other dense losses are not
class indices and are not checked.

Oracles: the number of classes is read off the model's output as onnxruntime computes it, and
PyTorch's ``F.cross_entropy`` / ``F.nll_loss`` (with the same ignore_index) must reject exactly
the labels we reject and give the loss we give for the ones we accept.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tests.oracles import ort_run
from tr_onnx.cli import main
from tr_onnx.data import split
from tr_onnx.optim import SGD
from tr_onnx.training.losses import LossSpec
from tr_onnx.training.trainer import Trainer

N, T, D, C = 4, 3, 5, 7
NO_IGNORE = -12345  # what torch is given for "no ignore_index" (its default -100 ignores)


def scores_model(layout: str) -> onnx.ModelProto:
    """A linear layer whose scores are [N, C] ("nc"), [N, T, C] ("ntc", token logits) or
    [N, C, T] ("nct": classes on axis 1 of a rank-3 output)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((D, C)).astype(np.float32), "w")
    x_shape = ["n", D] if layout == "nc" else ["n", T, D]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm" if layout == "nct" else "y"])]
    if layout == "nct":
        nodes.append(helper.make_node("Transpose", ["mm"], ["y"], perm=[0, 2, 1]))
    y_shape = {"nc": ["n", C], "ntc": ["n", T, C], "nct": ["n", C, T]}[layout]
    graph = helper.make_graph(nodes, layout, [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def nll_loss_model(ignore_index: int | None) -> onnx.ModelProto:
    """A user's ONNX loss: LogSoftmax over the classes, then NegativeLogLikelihoodLoss."""
    attrs = {} if ignore_index is None else {"ignore_index": ignore_index}
    nodes = [helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1),
             helper.make_node("NegativeLogLikelihoodLoss", ["logp", "target"], ["loss"],
                              reduction="mean", **attrs)]
    graph = helper.make_graph(nodes, "nll", [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", C]),
        helper.make_tensor_value_info("target", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def inputs(layout: str) -> np.ndarray:
    shape = (N, D) if layout == "nc" else (N, T, D)
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


def torch_loss(kind: str, scores: np.ndarray, labels: np.ndarray, class_axis: int,
               ignore_index: int | None) -> float:
    """PyTorch's loss of these scores and labels (raises IndexError for a label it rejects)."""
    x = torch.from_numpy(np.moveaxis(scores, class_axis, 1))
    y = torch.from_numpy(labels)
    ignore = NO_IGNORE if ignore_index is None else ignore_index
    if kind == "nll":
        return float(torch.nn.functional.nll_loss(torch.log_softmax(x, 1), y,
                                                  ignore_index=ignore))
    return float(torch.nn.functional.cross_entropy(x, y, ignore_index=ignore))


# (id, model layout, loss kind, class_axis): every way a loss reads class indices
LOSSES = [
    pytest.param("nc", "cross_entropy", 1, id="cross_entropy-axis1"),
    pytest.param("nct", "cross_entropy", 1, id="cross_entropy-axis1-rank3"),
    pytest.param("ntc", "cross_entropy", -1, id="cross_entropy-axis-1-tokens"),
    pytest.param("nc", "nll", 1, id="onnx-loss-model-nll"),
]


def session_for(layout, kind, class_axis, ignore_index):
    loss = nll_loss_model(ignore_index) if kind == "nll" else \
        LossSpec("cross_entropy", class_axis=class_axis, ignore_index=ignore_index)
    return tr_onnx.TrainingSession(scores_model(layout), loss=loss, optimizer=SGD(lr=0.1),
                                   backend="numpy")


def labels_with(layout: str, position: tuple[int, ...], value: int) -> np.ndarray:
    shape = (N,) if layout == "nc" else (N, T)
    y = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) % C
    y[position] = value
    return y


# (bad value, ignore_index): -1 and C are out of range; so is -100 without an ignore_index
OUT_OF_RANGE = [
    pytest.param(-1, None, id="minus-one"),
    pytest.param(C, None, id="C-of-C"),
    pytest.param(C + 5, -100, id="above-with-ignore"),
    pytest.param(-100, None, id="minus-100-without-ignore"),
    pytest.param(-1, -100, id="minus-one-with-ignore"),
]


@pytest.mark.parametrize("layout, kind, class_axis", LOSSES)
@pytest.mark.parametrize("value, ignore_index", OUT_OF_RANGE)
def test_out_of_range_label_is_an_error_before_the_step(layout, kind, class_axis, value,
                                                        ignore_index):
    session = session_for(layout, kind, class_axis, ignore_index)
    x = inputs(layout)
    (scores,) = ort_run(scores_model(layout), {"x": x})
    classes = scores.shape[class_axis]
    position = (2,) if layout == "nc" else (2, 1)
    y = labels_with(layout, position, value)
    with pytest.raises(IndexError):  # PyTorch rejects it too
        torch_loss(kind, scores, y, class_axis, ignore_index)
    before = session.parameters()
    with pytest.raises(tr_onnx.InputError) as info:
        session.train_step({"x": x}, y)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"label {value} at position {list(position)}" in msg
    assert f"0..{classes - 1}" in msg and f"{classes} classes" in msg
    if ignore_index is not None:
        assert f"ignore_index {ignore_index}" in msg
    assert session.step == 0
    after = session.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("layout, kind, class_axis", LOSSES)
@pytest.mark.parametrize("ignore_index", [None, -100, 3], ids=["no-ignore", "ignore-100",
                                                                "ignore-3"])
def test_labels_in_range_and_ignored_ones_train_as_pytorch(layout, kind, class_axis,
                                                           ignore_index):
    session = session_for(layout, kind, class_axis, ignore_index)
    x = inputs(layout)
    (scores,) = ort_run(scores_model(layout), {"x": x})
    classes = scores.shape[class_axis]
    y = labels_with(layout, (0,), classes - 1)
    if ignore_index is not None:
        y[(1,)] = ignore_index
    want = torch_loss(kind, scores, y, class_axis, ignore_index)
    got = session.train_step({"x": x}, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert session.step == 1


@pytest.mark.parametrize("value", [-1, C], ids=["minus-one", "C-of-C"])
def test_validation_loss_names_the_label_instead_of_an_index_error(value):
    (scores,) = ort_run(scores_model("nc"), {"x": inputs("nc")})
    y = labels_with("nc", (3,), value)
    with pytest.raises(IndexError):
        torch_loss("cross_entropy", scores, y, 1, None)
    with pytest.raises(tr_onnx.InputError, match=rf"label {value} at position \[3\].* 0\.\.6"):
        tr_onnx.TrainingSession(scores_model("nc"), backend="numpy").run_loss(
            {"x": inputs("nc")}, y)


def counting_steps(session) -> list:
    calls, step = [], session.train_step

    def train_step(*args, **kw):
        calls.append(1)
        return step(*args, **kw)

    session.train_step = train_step
    return calls


def data_set(n: int, bad_at: int | None, value: int):
    x = np.random.default_rng(2).standard_normal((n, D)).astype(np.float32)
    y = np.arange(n, dtype=np.int64) % C
    if bad_at is not None:
        y[bad_at] = value
    return {"x": x}, y


@pytest.mark.parametrize("kind", ["cross_entropy", "nll"])
@pytest.mark.parametrize("split_name", ["train_data", "val_data"])
def test_trainer_checks_every_label_before_the_first_step(kind, split_name):
    session = session_for("nc", kind, 1, None)
    calls = counting_steps(session)
    good = data_set(40, None, 0)
    bad = data_set(40, 33, C)  # in the last batch of the epoch
    train, val = (bad, good) if split_name == "train_data" else (good, bad)
    trainer = Trainer(session, train, val, batch_size=8, epochs=1, log=None)
    with pytest.raises(tr_onnx.InputError) as info:
        trainer.fit()
    msg = str(info.value)
    assert msg.startswith(f"{split_name}: ") and "\n" not in msg
    assert f"label {C} at position [33]" in msg and f"0..{C - 1}" in msg
    assert not calls and session.step == 0


def test_dense_targets_are_not_class_indices():
    """mse targets may be any number: -1 and C train (the loss is PyTorch's mse_loss)."""
    session = tr_onnx.TrainingSession(scores_model("nc"), loss="mse", optimizer=SGD(lr=0.1),
                                      backend="numpy")
    x = inputs("nc")
    (scores,) = ort_run(scores_model("nc"), {"x": x})
    y = np.full(scores.shape, -1, np.float32)
    y[:, 0] = C
    want = float(torch.nn.functional.mse_loss(torch.from_numpy(scores), torch.from_numpy(y)))
    np.testing.assert_allclose(session.train_step({"x": x}, y), want, rtol=1e-5)


@pytest.mark.parametrize("value, where", [(-1, "train"), (C, "train"), (C, "val")])
def test_cli_train_rejects_out_of_range_labels_before_the_first_step(tmp_path, monkeypatch,
                                                                     capsys, value, where):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "linear.onnx"
    onnx.save(scores_model("nc"), model)
    arrays, y = data_set(50, None, 0)
    (_, train_y), (_, val_y) = split(arrays, np.arange(50), 0.2, seed=0)
    bad_at = int((train_y if where == "train" else val_y)[-1])  # the sample's index in the file
    y[bad_at] = value
    np.savez(tmp_path / "data.npz", x=arrays["x"], labels=y)
    steps = []

    def train_step(*args, **kw):
        steps.append(1)
        raise AssertionError("a training step ran")

    monkeypatch.setattr(tr_onnx.TrainingSession, "train_step", train_step)
    rc = main(["train", str(model), "--data", str(tmp_path / "data.npz"), "--epochs", "1",
               "--batch-size", "8", "--backend", "numpy", "--out", "out.onnx",
               "--checkpoint-dir", "ckpt", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert f"data.npz: 'labels': label {value} at position [{bad_at}]" in err
    assert f"0..{C - 1}" in err
    assert not steps
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "ckpt").exists()
