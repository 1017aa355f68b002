"""A session keeps at most ``max_plans`` compiled plans (issue 12, item 10: every batch size
kept its plan and arena forever; 64 sizes held 0.9 GB). The least recently used is dropped and
compiled again when its shapes come back; a training session's state moves with its active
plan, so training across evictions ends exactly where training with every plan kept ends.
Issue 31, item 11: the plans kept are bounded by bytes too (``max_plan_bytes``), measured with
tracemalloc."""

import gc
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest

import tr_onnx
from tr_onnx.compiler import DEFAULT_MAX_PLAN_BYTES
from tr_onnx.optim import SGD, AdamW

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def _images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 1, 8, 8)).astype(np.float32)


def _alive(refs) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_forty_batch_sizes_keep_eight_plans_and_memory_stays_flat():
    """Batch sizes 40 down to 1: once the 8 largest plans are made, 32 more (smaller) ones
    must not add memory."""
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx")
    tracemalloc.start()
    try:
        refs = []
        for batch in range(40, 0, -1):
            refs.append(weakref.ref(session.plan_for({"input": _images(batch)})))
            gc.collect()
            if batch == 40:
                one_plan = tracemalloc.get_traced_memory()[0]
            if batch == 33:
                eight_plans = tracemalloc.get_traced_memory()[0]
        forty_sizes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert [ref() is not None for ref in refs] == [False] * 32 + [True] * 8
    assert forty_sizes - eight_plans < one_plan, (one_plan, eight_plans, forty_sizes)


def test_an_evicted_plan_is_made_again_and_runs_the_same():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx", max_plans=2)
    x = {b: _images(b, seed=b) for b in (2, 3, 4)}
    first = {b: session.run(None, {"input": x[b]})[0] for b in (2, 3, 4)}  # 2 is evicted
    refs = [weakref.ref(session.plan_for({"input": x[b]})) for b in (3, 4)]
    assert _alive(refs) == 2
    np.testing.assert_array_equal(session.run(None, {"input": x[2]})[0], first[2])
    assert _alive(refs) == 1  # 2 came back, 3 was the least recently used


def test_the_most_recently_used_plan_stays():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx", max_plans=2)
    kept = session.plan_for({"input": _images(2)})
    for batch in (3, 2, 4, 2, 5):
        session.plan_for({"input": _images(batch)})
    assert session.plan_for({"input": _images(2)}) is kept


def _train(max_plans: int):
    """AdamW on the zoo LeNet over mixed batch sizes, with evaluations in between."""
    session = tr_onnx.TrainingSession(ZOO / "lenet.onnx", optimizer=AdamW(lr=1e-2),
                                      backend="numpy", max_plans=max_plans)
    rng = np.random.default_rng(7)
    losses, evals, refs = [], [], []
    for step, batch in enumerate([4, 8, 4, 16, 8, 2, 4, 16, 2, 8, 4]):
        x = rng.standard_normal((batch, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, batch)
        losses.append(session.train_step({"input": x}, y))
        refs.append(weakref.ref(session._state.active))
        if step % 3 == 2:
            evals.append(session.run(None, {"input": _images(step + 1, seed=step)})[0])
    return session, losses, evals, refs


def test_training_across_evictions_ends_where_training_with_every_plan_kept_ends():
    evicting, losses, evals, refs = _train(max_plans=2)
    keeping, want_losses, want_evals, _ = _train(max_plans=64)
    assert _alive(refs) <= 2 and len(evicting._eval_plans) <= 2
    assert losses == want_losses
    for got, want in zip(evals, want_evals):
        np.testing.assert_array_equal(got, want)
    state, want_state = evicting.state_arrays(), keeping.state_arrays()
    assert state.keys() == want_state.keys()
    for name in want_state:  # weights, running statistics, Adam's moments
        np.testing.assert_array_equal(state[name], want_state[name], err_msg=name)
    assert evicting.step == keeping.step == 11


def _array_bytes() -> int:
    """The bytes of every live NumPy array's data, as tracemalloc traced their allocation."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(trace.size for trace in snapshot.traces)


def test_forty_batch_sizes_hold_no_more_plan_bytes_than_the_budget_and_reuse_hits():
    """The zoo MLP's training step at 100..4000 rows: 8 plans of the largest sizes held 99 MB
    before the byte bound. With a 32 MiB budget the arrays held (tracemalloc's count of NumPy's
    allocations, the session's own included) stay under it after every step, the cache's own
    count (``plan_bytes``) agrees with tracemalloc's within 5 %, and the size used just before
    is a hit."""
    budget = 32 << 20
    # the constant-fill buffers every plan of the process shares (elementwise.shared_fills),
    # grown to the largest size first: an earlier test may have grown them already, and they
    # are the process's, which neither count below includes
    tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy").train_step(
        {"input": np.zeros((4000, 64), np.float32)}, np.zeros(4000, np.int64))
    session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=SGD(lr=0.1), backend="numpy",
                                      max_plan_bytes=budget)
    tracemalloc.start()
    try:
        start = _array_bytes()
        for batch in range(100, 4001, 100):
            session.train_step({"input": np.zeros((batch, 64), np.float32)},
                               np.zeros(batch, np.int64))
            held = _array_bytes() - start
            assert held < budget, (batch, held, len(session._plans))
    finally:
        tracemalloc.stop()
    assert abs(session._plans.nbytes - held) < 0.05 * held, (session._plans.nbytes, held)
    assert 1 < len(session._plans) < 8
    previous = list(session._plans.values())[-2]
    session.train_step({"input": np.zeros((3900, 64), np.float32)}, np.zeros(3900, np.int64))
    assert session._state.active is previous


def test_the_current_plan_stays_when_it_alone_is_over_the_budget():
    session = tr_onnx.InferenceSession(ZOO / "lenet.onnx", max_plan_bytes=0)
    for batch in (2, 3):
        plan = session.plan_for({"input": _images(batch)})
        assert list(session._plans.values()) == [plan]
    assert session.plan_for({"input": _images(3)}) is plan
    assert tr_onnx.InferenceSession(ZOO / "lenet.onnx")._plans.max_bytes == DEFAULT_MAX_PLAN_BYTES


@pytest.mark.parametrize("bad", [-1, 2.0, True], ids=["negative", "float", "bool"])
def test_a_bad_max_plan_bytes_is_an_error_naming_it(bad):
    with pytest.raises(tr_onnx.InputError, match=f"max_plan_bytes={bad!r}"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", max_plan_bytes=bad)
    with pytest.raises(tr_onnx.InputError, match=f"max_plan_bytes={bad!r}"):
        tr_onnx.TrainingSession(ZOO / "mlp.onnx", backend="numpy", max_plan_bytes=bad)


@pytest.mark.parametrize("bad", [0, -3, 2.0, None], ids=["zero", "negative", "float", "none"])
def test_a_bad_max_plans_is_an_error_naming_it(bad):
    with pytest.raises(tr_onnx.InputError, match=f"max_plans={bad!r}"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", max_plans=bad)
    with pytest.raises(tr_onnx.InputError, match=f"max_plans={bad!r}"):
        tr_onnx.TrainingSession(ZOO / "mlp.onnx", backend="numpy", max_plans=bad)
