"""``InferenceSession.run`` prepares what a run does on a plan once (the input writers, the
output readers) and takes a feed with the names, order, shapes and dtypes of one it checked
before without checking it again. Nothing a user sees may change: outputs follow the feed's
values, are the user's own copies, every other feed is checked in full, and the plans kept
(and their arenas) are the same ones as without the prepared path."""

import gc
import weakref
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

import tr_onnx

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def _images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 1, 8, 8)).astype(np.float32)


def _fresh(x) -> np.ndarray:
    """The output of a session that never ran before (the full path)."""
    return tr_onnx.InferenceSession(ZOO / "lenet.onnx").run(None, {"input": x})[0]


def test_outputs_follow_the_values_of_a_feed_with_the_same_shape():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    x = _images(4)
    first = session.run(None, {"input": x})[0]
    x *= 2  # the same array object, new values
    second = session.run(None, {"input": x})[0]
    np.testing.assert_array_equal(second, _fresh(x))
    assert not np.array_equal(first, second)


def test_outputs_are_copies_a_later_run_leaves_alone():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    first = session.run(None, {"input": _images(4)})[0]
    kept = first.copy()
    session.run(None, {"input": _images(4, seed=1)})
    np.testing.assert_array_equal(first, kept)
    first[...] = 7  # and writing into one changes nothing the session reads
    np.testing.assert_array_equal(session.run(None, {"input": _images(4)})[0], kept)


class _Subclass(np.ndarray):
    """An ndarray subclass: not a plain array, so always the full path."""


@pytest.mark.parametrize("feed", [
    lambda x: {"input": np.asfortranarray(x)},
    lambda x: {"input": np.concatenate([x, x], axis=3)[..., :8]},
    lambda x: {"input": x.view(_Subclass)},
    lambda x: MappingProxyType({"input": x}),
], ids=["fortran_order", "strided_view", "subclass", "mapping_not_a_dict"])
def test_any_form_of_the_same_values_gives_the_same_outputs(feed):
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    x = _images(4)
    expected = _fresh(x)
    for each in ({"input": x}, feed(x), {"input": x}, feed(x)):  # prepared and full paths
        np.testing.assert_array_equal(session.run(None, each)[0], expected)


def test_batch_sizes_in_turn_each_give_their_own_outputs():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    x = {b: _images(b, seed=b) for b in (2, 3)}
    expected = {b: _fresh(x[b]) for b in (2, 3)}
    for batch in (2, 3, 2, 3, 2):
        np.testing.assert_array_equal(session.run(None, {"input": x[batch]})[0], expected[batch])


def test_a_feed_that_passed_then_changes_is_checked_again():
    session = tr_onnx.InferenceSession(ZOO / "mlp.onnx")
    good = np.zeros((4, 64), np.float32)
    session.run(None, {"input": good})
    with pytest.raises(tr_onnx.InputError, match="expected dtype float32, got float64"):
        session.run(None, {"input": good.astype(np.float64)})
    with pytest.raises(tr_onnx.InputError, match=r"expected shape \['batch', 64\], got \[4, 63\]"):
        session.run(None, {"input": good[:, :63]})
    with pytest.raises(tr_onnx.InputError, match=r"unknown input\(s\) \['extra'\]"):
        session.run(None, {"input": good, "extra": good})
    with pytest.raises(tr_onnx.InputError, match=r"unknown output\(s\) \['nope'\]"):
        session.run(["nope"], {"input": good})


def test_a_run_on_the_prepared_path_keeps_its_plan_the_most_recently_used():
    """max_plans=2: runs of batch 2, 3, 2 then 4 drop batch 3's plan, as lookups would."""
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx", max_plans=2)
    for batch in (2, 3, 2, 4):
        session.run(None, {"input": _images(batch)})
    assert [key[0][1][0] for key in session._plans] == [2, 4]


def test_an_evicted_plan_takes_its_prepared_run_and_arena_with_it():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx", max_plans=1)
    session.run(None, {"input": _images(2)})
    executor = weakref.ref(session.plan_for({"input": _images(2)}).executor)
    session.run(None, {"input": _images(3)})
    gc.collect()
    assert executor() is None
    assert len(session._runs) == len(session._bound) == 1


def _dividing_model():
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["y"])], "div",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_run_follows_ieee_silently_and_leaves_the_callers_error_state_alone():
    """1/0, 0/0 and overflow give inf and NaN without a warning or an exception, whatever the
    caller's np.errstate; after the run, and after a feed that failed its check, the caller's
    state is back in force (the executor sets NumPy's error state itself, not through
    np.errstate)."""
    session = tr_onnx.InferenceSession(_dividing_model())
    feed = {"a": np.array([1, 0, 3e38], np.float32), "b": np.array([0, 0, 1e-38], np.float32)}
    with np.errstate(all="raise"):
        (y,) = session.run(None, feed)
        np.testing.assert_array_equal(y, [np.inf, np.nan, np.inf])
        assert np.geterr() == {k: "raise" for k in ("divide", "over", "under", "invalid")}
        with pytest.raises(tr_onnx.errors.TrOnnxError):
            session.run(None, {"a": feed["a"], "b": np.zeros(4, np.float32)})
        assert np.geterr()["divide"] == "raise"
        with pytest.raises(FloatingPointError):
            np.divide(np.float32(1), np.float32(0))
