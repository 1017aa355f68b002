"""One feed check (``tr_onnx.feeds``) for both sessions: the same bad feed is the same
``InputError`` from ``InferenceSession.run``, ``TrainingSession.train_step`` and
``TrainingSession.run``, naming the input, what the model expects and what was given."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.feeds import check_feed, check_labels, check_output_names
from tr_onnx.importer import InputSpec
from tr_onnx.optim import SGD

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
GOOD = np.zeros((4, 64), np.float32)
LABELS = np.zeros(4, np.int64)


def _inference_run(feed):
    return tr_onnx.InferenceSession(ZOO / "mlp.onnx").run(None, feed)


def _train_step(feed):
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy")
    return session.train_step(feed, LABELS)


def _training_run(feed):
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy")
    return session.run(None, feed)


CALLS = [_inference_run, _train_step, _training_run]
CALL_IDS = ["InferenceSession.run", "TrainingSession.train_step", "TrainingSession.run"]


@pytest.mark.parametrize("call", CALLS, ids=CALL_IDS)
@pytest.mark.parametrize("feed, message", [
    ({"image": GOOD}, r"unknown input\(s\) \['image'\] and missing input\(s\) \['input'\]: "
                      r"expected the model's inputs \['input'\], given \['image'\]"),
    ({"input": GOOD, "extra": GOOD}, r"unknown input\(s\) \['extra'\]: expected the model's "
                                     r"inputs \['input'\], given \['input', 'extra'\]$"),
    ({}, r"missing input\(s\) \['input'\]: expected the model's inputs \['input'\], given \[\]$"),
    ([GOOD], r"the feed must be a dict of input name -> array, got list; the model's inputs "
             r"are \['input'\]"),
    ({"input": [[0.0] * 64, [0.0] * 63]}, r"input 'input': expected an array of float32, got a "
                                          r"list numpy cannot convert"),
    ({"input": GOOD.astype(np.float64)}, "input 'input': expected dtype float32, got float64"),
    ({"input": GOOD[:, :63]}, r"input 'input': expected shape \['batch', 64\], got \[4, 63\]"),
    ({"input": GOOD[None]}, r"input 'input': expected shape \['batch', 64\], got \[1, 4, 64\]"),
], ids=["renamed", "unknown", "missing", "not_a_dict", "ragged", "dtype", "shape", "rank"])
def test_every_session_names_a_bad_feed_alike(call, feed, message):
    with pytest.raises(tr_onnx.InputError, match=message):
        call(feed)


@pytest.mark.parametrize("session", ["inference", "training"])
@pytest.mark.parametrize("names, message", [
    (["probs"], r"unknown output\(s\) \['probs'\]: expected some of the model's outputs "
                r"\['logits'\]"),
    ("logits", r"output names must be a list of names \(or None\), got the string 'logits'"),
], ids=["unknown", "string"])
def test_every_session_names_a_bad_output_name_before_running(session, names, message):
    if session == "inference":
        sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx")
    else:
        sess = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy")
    with pytest.raises(tr_onnx.InputError, match=message):
        sess.run(names, {"input": GOOD})
    if session == "inference":
        assert sess._plans == {}  # checked before a plan was made for the feed
    else:
        assert sess._eval_plans == {}


def test_training_run_reads_model_outputs_only():
    """An intermediate value's name is not an output: its arena slot may hold a later value."""
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy")
    hidden = next(n.output[0] for n in session.imported.proto.graph.node
                  if n.output[0] != "logits")
    with pytest.raises(tr_onnx.InputError, match=rf"unknown output\(s\) \['{hidden}'\]"):
        session.run([hidden], {"input": GOOD})
    (logits,) = session.run(["logits"], {"input": GOOD})
    assert logits.shape == (4, 10)


@pytest.mark.parametrize("labels, message", [
    (np.zeros(5, np.int64), r"labels 'labels': expected shape \[4\], got \[5\]"),
    (np.zeros(4, np.float32), "labels 'labels': expected dtype int64, got float32"),
    ([[0, 1], [2]], "labels 'labels': expected an array of int64, got a list numpy cannot"),
], ids=["shape", "dtype", "ragged"])
def test_bad_labels_name_the_label_input(labels, message):
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy")
    with pytest.raises(tr_onnx.InputError, match=message):
        session.train_step({"input": GOOD}, labels)


@pytest.mark.parametrize("labels", [np.arange(4, dtype=np.int32), np.arange(4, dtype=np.uint8),
                                    [0, 1, 2, 3]], ids=["int32", "uint8", "list"])
def test_integer_class_indices_of_any_width_are_taken_as_int64(labels):
    y = check_labels(labels, "labels", (4,), np.int64)
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2, 3]


def test_an_input_of_unknown_rank_takes_any_shape():
    spec = InputSpec("x", None, np.dtype(np.float32))
    for shape in [(), (3,), (2, 3, 4)]:
        assert check_feed({"x": np.zeros(shape, np.float32)}, [spec])["x"].shape == shape
    with pytest.raises(tr_onnx.InputError, match="input 'x': expected dtype float32, got int64"):
        check_feed({"x": np.zeros(3, np.int64)}, [spec])


def test_symbolic_dims_take_any_size_and_the_feed_comes_back_in_model_order():
    specs = [InputSpec("a", ("n", 2), np.dtype(np.float32)),
             InputSpec("b", ("?",), np.dtype(np.int64))]
    got = check_feed({"b": [1, 2, 3], "a": np.zeros((7, 2), np.float32)}, specs)
    assert list(got) == ["a", "b"] and got["b"].dtype == np.int64


def test_no_output_names_means_every_output():
    outputs = [InputSpec("y", (1,), np.dtype(np.float32)),
               InputSpec("z", (1,), np.dtype(np.float32))]
    assert check_output_names(None, outputs) == check_output_names([], outputs) == ["y", "z"]
    assert check_output_names(("z",), outputs) == ["z"]


def _two_inputs_sharing_n() -> onnx.ModelProto:
    """x ['N', 4] + y ['N', 4] -> MatMul with a weight -> logits ['N', 3]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("MatMul", ["s", "w"],
                                                                       ["logits"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(np.ones((4, 3), np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("session", ["InferenceSession.run", "TrainingSession.train_step"])
def test_one_symbolic_dimension_given_two_sizes_names_both_inputs(session):
    feed = {"x": np.ones((2, 4), np.float32), "y": np.ones((3, 4), np.float32)}
    message = (r"inputs 'x' and 'y' disagree on dimension 'N': 2 \('x' axis 0\) and 3 \('y' "
               r"axis 0\); every input declaring 'N' must be given the same size")
    model = _two_inputs_sharing_n()
    if session == "InferenceSession.run":
        sess = tr_onnx.InferenceSession(model)
        with pytest.raises(tr_onnx.InputError, match=message):
            sess.run(None, feed)
        assert sess._plans == {}  # refused before a plan was made
        agreeing = {"x": feed["x"], "y": feed["x"] * 2}
        (logits,) = sess.run(None, agreeing)
        np.testing.assert_allclose(logits, (agreeing["x"] + agreeing["y"]) @ np.ones((4, 3)))
    else:
        sess = tr_onnx.TrainingSession(model, optimizer=SGD(lr=0.1), backend="numpy")
        with pytest.raises(tr_onnx.InputError, match=message):
            sess.train_step(feed, np.zeros(2, np.int64))
        assert sess.step == 0 and sess._plans == {}
        assert np.isfinite(sess.train_step({"x": feed["x"], "y": feed["x"]},
                                           np.zeros(2, np.int64)))


def test_unnamed_dimensions_are_free_and_one_input_agrees_with_itself():
    specs = [InputSpec("a", ("?", "n", "n"), np.dtype(np.float32)),
             InputSpec("b", ("?",), np.dtype(np.float32))]
    check_feed({"a": np.zeros((2, 3, 3), np.float32), "b": np.zeros(5, np.float32)}, specs)
    with pytest.raises(tr_onnx.InputError, match=r"inputs 'a' and 'a' disagree on dimension "
                                                 r"'n': 3 \('a' axis 1\) and 4 \('a' axis 2\)"):
        check_feed({"a": np.zeros((2, 3, 4), np.float32), "b": np.zeros(5, np.float32)}, specs)
