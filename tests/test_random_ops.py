"""Random ops (ops/random.py): their distributions (Kolmogorov-Smirnov against the exact CDF,
Bernoulli rates against p), dtypes and named errors; in training, the step counter drives
them: two sessions with one seed draw alike, steps draw differently, and a run resumed from a
checkpoint draws what the uninterrupted run drew.

The node suite's Bernoulli cases compare with NumPy's global generator, whose draws no other
implementation reproduces (the suite's own comment says so): node_suite.EXCLUDED names them,
and these tests stand for them."""

import math

import numpy as np
import pytest
from onnx import TensorProto, helper

import tr_onnx
from tr_onnx.errors import TrOnnxError

N = 20000
# KS critical value at significance 1e-4 is about 2.0 / sqrt(n): a correct draw fails once in
# 10^4 runs; the keys are fixed, so a run is reproducible and this one passes.
KS_LIMIT = 2.0 / math.sqrt(N)


def _model(node, inputs, out_type=TensorProto.FLOAT, out_shape=(N,), opset=22):
    graph = helper.make_graph([node], "random", inputs,
                              [helper.make_tensor_value_info("y", out_type, list(out_shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feed=None):
    session = tr_onnx.TrainingSession(model, loss="mse", backend="numpy")
    return session.run(["y"], feed or {})[0]


def _ks(sample, cdf) -> float:
    x = np.sort(sample.astype(np.float64))
    f = cdf(x)
    n = len(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))


def _normal_cdf(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("opset", [1, 22])
def test_random_uniform_is_uniform_on_low_high(opset):
    node = helper.make_node("RandomUniform", [], ["y"], shape=[N], low=-2.0, high=3.0, seed=4.0)
    y = _run(_model(node, [], opset=opset))
    assert y.dtype == np.float32 and y.shape == (N,)
    assert -2.0 <= y.min() and y.max() < 3.0
    assert _ks(y, lambda x: (x + 2.0) / 5.0) < KS_LIMIT


def test_random_normal_like_has_the_mean_scale_and_the_inputs_shape():
    node = helper.make_node("RandomNormalLike", ["x"], ["y"], mean=1.5, scale=0.5,
                            dtype=TensorProto.DOUBLE)
    x = np.zeros((100, 200), np.float32)
    y = _run(_model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [100, 200])],
                    TensorProto.DOUBLE, (100, 200)), {"x": x})
    assert y.dtype == np.float64 and y.shape == (100, 200)
    assert _ks(y.reshape(-1), lambda v: _normal_cdf((v - 1.5) / 0.5)) < KS_LIMIT


@pytest.mark.parametrize("dtype,np_dtype", [(None, np.float32), (TensorProto.INT64, np.int64),
                                            (TensorProto.BOOL, np.bool_)])
def test_bernoulli_draws_ones_at_rate_p(dtype, np_dtype):
    p = np.repeat(np.array([0.0, 0.1, 0.5, 0.9, 1.0], np.float32), N // 5).reshape(5, -1)
    attrs = {} if dtype is None else {"dtype": dtype}
    node = helper.make_node("Bernoulli", ["p"], ["y"], **attrs)
    y = _run(_model(node, [helper.make_tensor_value_info("p", TensorProto.FLOAT, list(p.shape))],
                    dtype or TensorProto.FLOAT, p.shape, opset=15), {"p": p})
    assert y.dtype == np_dtype
    rates = y.astype(np.float64).mean(axis=1)
    assert rates[0] == 0.0 and rates[4] == 1.0
    # binomial standard error at n = 4000 is <= 0.008: 5 of them
    np.testing.assert_allclose(rates[1:4], [0.1, 0.5, 0.9], atol=0.04)


def test_bernoulli_names_the_node_for_probabilities_outside_0_1():
    node = helper.make_node("Bernoulli", ["p"], ["y"], name="coin")
    model = _model(node, [helper.make_tensor_value_info("p", TensorProto.FLOAT, [3])],
                   out_shape=(3,), opset=15)
    with pytest.raises(TrOnnxError, match="coin.*outside \\[0, 1\\]"):
        _run(model, {"p": np.array([0.5, 1.5, 0.1], np.float32)})


def test_a_seed_repeats_and_calls_draw_anew():
    node = helper.make_node("RandomNormal", [], ["y"], shape=[8], seed=7.0)
    model = _model(node, [], out_shape=(8,))
    a = tr_onnx.TrainingSession(model, loss="mse", backend="numpy")
    b = tr_onnx.TrainingSession(model, loss="mse", backend="numpy")
    first, second = a.run(["y"], {})[0], a.run(["y"], {})[0]
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(b.run(["y"], {})[0], first)


def _noisy_regression():
    """y = (x + 0.3 * RandomNormalLike(x)) @ W, with a Bernoulli mask on the features: noise
    injection as a regulariser; training draws fresh noise each step."""
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["eps"], scale=0.3),
             helper.make_node("Add", ["x", "eps"], ["xn"]),
             helper.make_node("Bernoulli", ["keep_p"], ["keep"]),
             helper.make_node("Mul", ["xn", "keep"], ["xm"]),
             helper.make_node("MatMul", ["xm", "W"], ["out"])]
    rng = np.random.default_rng(3)
    inits = [helper.make_tensor("W", TensorProto.FLOAT, [6, 2],
                                rng.standard_normal(12).astype(np.float32)),
             helper.make_tensor("keep_p", TensorProto.FLOAT, [6], [0.8] * 6)]
    graph = helper.make_graph(nodes, "noisy",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 2])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def _batches():
    rng = np.random.default_rng(5)
    return [({"x": rng.standard_normal((4, 6)).astype(np.float32)},
             rng.standard_normal((4, 2)).astype(np.float32)) for _ in range(4)]


def _session(seed=1):
    return tr_onnx.TrainingSession(_noisy_regression(), loss="mse", backend="numpy",
                                   optimizer=tr_onnx.optim.SGD(lr=0.05), seed=seed)


def test_training_draws_from_the_step_counter_and_resumes_alike(tmp_path):
    batches = _batches()
    whole = _session()
    losses = [float(whole.train_step(*b)) for b in batches]
    again = [float(_session().train_step(*b)) for b in batches[:1]]
    assert again[0] == losses[0]  # one seed, one draw
    other = float(_session(seed=2).train_step(*batches[0]))
    assert other != losses[0]  # the session seed keys the draws

    first = _session()
    for b in batches[:2]:
        first.train_step(*b)
    path = first.save_checkpoint(tmp_path / "ckpt.npz")
    resumed = tr_onnx.TrainingSession.from_checkpoint(path)
    rest = [float(resumed.train_step(*b)) for b in batches[2:]]
    assert rest == losses[2:]  # bitwise: the same numbers at the same steps
    np.testing.assert_array_equal(resumed.parameters()["W"], whole.parameters()["W"])
    assert whole._state.active.info.converted == {"BatchNormalization": 0, "Dropout": 0,
                                            "RandomNormalLike": 1, "Bernoulli": 1}


def test_each_step_draws_new_noise():
    session = _session()
    feed, target = _batches()[0]
    start = {k: v.copy() for k, v in session.parameters().items()}
    session.train_step(feed, target)
    first = session.last_outputs()["out"].copy()
    session.load_parameters(start)  # the same weights and batch: only the draws differ
    session.train_step(feed, target)
    assert not np.allclose(session.last_outputs()["out"], first)
