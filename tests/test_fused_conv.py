"""Inference plans fuse Conv -> [Add] -> [Relu | Clip] into one FusedConv whose oneDNN kernel
adds and clips in the convolution's registers (passes.inference_folds.finite_rewrites), only
where passes.value_bounds proves the values finite for inputs within the plan's limit; other
inputs run the unfused plan. Checked: the bounds hold on real intermediate values
(onnx.reference), fused outputs equal the unfused plan's bit for bit and match onnxruntime and
onnx.reference, NaN/inf/too-large inputs take the unfused plan and keep ONNX's NaN, the NumPy
FusedConv kernel (no oneDNN) equals the unfused nodes, and what must not fuse does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onednn_kernels import require_onednn
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
import tr_onnx.session as session_module
from tr_onnx.ops import conv_onednn
from tr_onnx.passes import value_bounds

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
RNG = np.random.default_rng(0)


@pytest.fixture
def onednn_required():
    require_onednn()


def _unfused(monkeypatch, model, feed, **kwargs) -> tuple[list[np.ndarray], list[str]]:
    """The outputs and the plan's ops of a session whose plans keep every Conv, Add, Relu and
    Clip node."""
    with monkeypatch.context() as m:
        m.setattr(session_module, "finite_rewrites", lambda *a, **k: None)
        sess = tr_onnx.InferenceSession(model, **kwargs)
        return sess.run(None, feed), _ops(sess.plan_for(feed))


def _ops(plan) -> list[str]:
    return [n.op_type for n in plan.graph.nodes]


def _block_model(activation: str = "Relu", clip=(0.0, 6.0), add: bool = True, channels=8):
    """x -> Conv(+BN) -> Relu -> Conv -> [Add x] -> activation -> MaxPool -> Conv -> Clip ->
    GlobalAveragePool -> Gemm: the chains a ResNet or MobileNet block makes."""
    c = channels
    inits = []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def weights(name, shape):
        return init(name, RNG.standard_normal(shape) * 0.3)

    nodes = [
        helper.make_node("Conv", ["x", weights("w0", (c, c, 3, 3)), weights("b0", (c,))],
                         ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c0", init("g", RNG.uniform(0.5, 2, c)),
                                                init("be", RNG.standard_normal(c)),
                                                init("mu", RNG.standard_normal(c)),
                                                init("var", RNG.uniform(0.5, 2, c))], ["n0"]),
        helper.make_node("Relu", ["n0"], ["r0"]),
        helper.make_node("Conv", ["r0", weights("w1", (c, c, 3, 3))], ["c1"], pads=[1, 1, 1, 1]),
    ]
    last = "c1"
    if add:
        nodes.append(helper.make_node("Add", [last, "x"], ["a1"]))
        last = "a1"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", [last], ["act1"]))
        last = "act1"
    elif activation == "Clip":
        limits = [init(f"lim{i}", v) if v is not None else "" for i, v in enumerate(clip)]
        nodes.append(helper.make_node("Clip", [last, *limits], ["act1"]))
        last = "act1"
    nodes += [
        helper.make_node("MaxPool", [last], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", weights("w2", (2 * c, 1, 3, 3))], ["c2"], group=c,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c2", init("lo", 0.0), init("hi", 6.0)], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gp"]),
        helper.make_node("Flatten", ["gp"], ["f"]),
        helper.make_node("Gemm", ["f", weights("wf", (5, 2 * c)), weights("bf", (5,))], ["y"],
                         transB=1),
    ]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _feed(model, scale=1.0):
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": (RNG.standard_normal(shape) * scale).astype(np.float32)}


# ---- the bounds ------------------------------------------------------------------------------

def _bounds_of(model, limit=10.0):
    from tr_onnx.compiler import dispatch
    from tr_onnx.passes import control_flow

    imported = tr_onnx.InferenceSession(model).imported
    shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
              for i in model.graph.input}
    graph = imported.specialize(shapes, {}, control_flow.resolve)
    dispatch(graph, imported.registry, "numpy")
    return value_bounds.magnitude_bounds(graph, limit)


def test_bounds_hold_on_every_intermediate_value():
    """For inputs at the limit (and random ones inside it), every value's magnitude, as
    onnx.reference computes it, is within the bound magnitude_bounds gives it."""
    model = _block_model()
    limit = 50.0
    bounds = _bounds_of(model, limit)
    names = [o for n in model.graph.node for o in n.output]
    assert set(names) <= set(bounds)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                              for n in names)
    ref = ReferenceEvaluator(probe)
    feeds = [{"x": np.clip(_feed(model, 20.0)["x"], -limit, limit)},
             {"x": np.full((2, 8, 8, 8), limit, np.float32)},
             {"x": np.where(RNG.random((2, 8, 8, 8)) < 0.5, limit, -limit).astype(np.float32)}]
    for feed in feeds:
        for name, value in zip(names, ref.run(None, feed)):
            assert np.max(np.abs(value)) <= bounds[name] * (1 + 1e-6), name


def _one_node(op, inputs, inits, attrs=None, x_shape=(2, 3)):
    graph = helper.make_graph(
        [helper.make_node(op, ["x", *inputs], ["y"], **(attrs or {}))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("op,inputs,inits", [
    ("Log", [], []),  # log of a negative value is NaN: no rule
    ("Div", ["d"], [("d", [1.0, 2.0, 3.0])]),  # no rule: a divisor may be 0
    ("MatMul", ["w"], [("w", [[np.inf], [1.0], [2.0]])]),  # a non-finite weight
    ("Clip", ["lo", "hi"], [("lo", np.nan), ("hi", 1.0)]),  # a NaN limit
], ids=["log", "div", "inf_weight", "nan_clip"])
def test_no_bound_without_a_proof(op, inputs, inits):
    assert "y" not in _bounds_of(_one_node(op, inputs, inits))


def test_clip_bounds_a_finite_input_by_its_limits():
    bounds = _bounds_of(_one_node("Clip", ["lo", "hi"], [("lo", -2.0), ("hi", 6.0)]), 1e6)
    assert bounds["y"] == 6.0


# ---- what fuses --------------------------------------------------------------------------------

@pytest.mark.usefixtures("onednn_required")
@pytest.mark.parametrize("stem,fused,gone", [
    ("resnet", 5, ("Relu", "Add")), ("mobilenet", 10, ("Clip",)), ("lenet", 2, ())])
def test_zoo_models_fuse_their_activations(stem, fused, gone):
    """Every Relu/Clip after a Conv and every residual Add, with the inputs' limit at 1e6;
    outputs as onnxruntime's."""
    path = str(ZOO / f"{stem}.onnx")
    shape = (4, 1, 8, 8) if stem == "lenet" else (4, 3, 16, 16)
    feed = {"input": RNG.standard_normal(shape).astype(np.float32)}
    sess = tr_onnx.InferenceSession(path)
    got = sess.run(None, feed)[0]
    plan = sess.plan_for(feed)
    assert _ops(plan).count("FusedConv") == fused and not set(gone) & set(_ops(plan))
    assert plan.info == 1e6
    np.testing.assert_allclose(got, ort_run(path, feed)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("onednn_required")
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("activation,clip,add", [
    ("Relu", None, True), ("Clip", (0.0, 6.0), True), ("Clip", (-1.0, None), False),
    ("Clip", (None, 0.5), True), ("", None, True), ("Relu", None, False)],
    ids=["add_relu", "add_relu6", "clip_low_only", "add_clip_high_only", "add_only", "relu"])
def test_fused_outputs_equal_the_unfused_plan(monkeypatch, align, activation, clip, add):
    """Bit for bit on finite inputs (oneDNN's post-ops compute what the Add and the
    activation's kernels compute), and as onnxruntime and onnx.reference."""
    model = _block_model(activation, clip, add)
    feed = _feed(model, 3.0)
    fused = tr_onnx.InferenceSession(model, channel_align=align)
    got = fused.run(None, feed)[0]
    assert "FusedConv" in _ops(fused.plan_for(feed))
    (want,), plain_ops = _unfused(monkeypatch, model, feed, channel_align=align)
    assert "FusedConv" not in plain_ops
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, ort_run(model, feed)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feed)[0], rtol=1e-5,
                               atol=1e-5)


def test_numpy_fused_conv_kernel_equals_the_unfused_nodes(monkeypatch):
    """Where oneDNN does not run the convolution, FusedConv is Conv's NumPy kernel then the
    Add and the activation in place: the unfused nodes' values, bit for bit."""
    monkeypatch.setattr(conv_onednn, "usable", lambda win, dtype: False)
    for activation, clip, add in (("Relu", None, True), ("Clip", (0.0, 6.0), False),
                                  ("Clip", (-1.0, None), True), ("", None, True)):
        model = _block_model(activation, clip, add)
        feed = _feed(model, 3.0)
        fused = tr_onnx.InferenceSession(model)
        got = fused.run(None, feed)[0]
        if tr_onnx.onednn.available():
            assert "FusedConv" in _ops(fused.plan_for(feed))
        np.testing.assert_array_equal(got, _unfused(monkeypatch, model, feed)[0][0])


@pytest.mark.usefixtures("onednn_required")
@pytest.mark.parametrize("bad", ["nan", "inf", "too_large"])
def test_inputs_outside_the_proof_run_the_unfused_plan(bad):
    """NaN stays NaN (as onnx.reference: oneDNN's clip would make it 0), an infinity and a
    value past the limit run the unfused plan too; a good input after them is fused again."""
    model = _block_model("Relu", None, True)
    sess = tr_onnx.InferenceSession(model)
    good = _feed(model)
    sess.run(None, good)
    limit = sess.plan_for(good).info
    assert limit == 1e6
    x = good["x"].copy()
    x[0, 0, 0, 0] = {"nan": np.nan, "inf": np.inf, "too_large": 2 * limit}[bad]
    got = sess.run(None, {"x": x})[0]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    if bad == "too_large":
        np.testing.assert_allclose(got, want, rtol=1e-4)
    assert len(sess._plans) == 2  # the fused plan and the unfused one
    unfused = [p for k, p in sess._plans.items() if k[-1] == "unfused"]
    assert len(unfused) == 1 and "FusedConv" not in _ops(unfused[0])
    np.testing.assert_allclose(sess.run(None, good)[0],
                               ReferenceEvaluator(model).run(None, good)[0], rtol=1e-5,
                               atol=1e-5)


def _two_consumer_model():
    """c is read by the Relu and is a graph output: nothing may fuse into its Conv."""
    c = 4
    w = numpy_helper.from_array(RNG.standard_normal((c, c, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _broadcast_add_model():
    """The Add broadcasts a per-channel tensor: not a residual, nothing to fuse but the Relu
    after it cannot move past the Add either."""
    c = 4
    inits = [numpy_helper.from_array(RNG.standard_normal((c, c, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.standard_normal((1, c, 1, 1)).astype(np.float32), "s")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["c", "s"], ["a"]), helper.make_node("Relu", ["a"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _unproven_model():
    """Log before the Conv: its output may be NaN for finite inputs, so the Relu stays a node
    of its own; the Add (which keeps NaN in oneDNN too) still fuses."""
    c = 4
    inits = [numpy_helper.from_array(RNG.standard_normal((c, c, 3, 3)).astype(np.float32), "w")]
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["l"]),
         helper.make_node("Conv", ["l", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.usefixtures("onednn_required")
@pytest.mark.parametrize("build", [_two_consumer_model, _broadcast_add_model, _unproven_model],
                         ids=["read_twice", "broadcast_add", "unproven"])
def test_what_must_not_fuse_stays(build):
    model = build()
    x = RNG.standard_normal((1, 4, 5, 5)).astype(np.float32)
    if build is _unproven_model:
        x[0, 0, 0, 0] = -1.0  # log(-1) = NaN: the Relu must keep it
    sess = tr_onnx.InferenceSession(model)
    got = sess.run(None, {"x": x})
    assert "FusedConv" not in _ops(sess.plan_for({"x": x}))
    for g, w in zip(got, ReferenceEvaluator(model).run(None, {"x": x})):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))


def test_training_plans_do_not_fuse():
    """A training step needs the Conv's output for the backward pass."""
    session = tr_onnx.TrainingSession(str(ZOO / "resnet.onnx"), loss="cross_entropy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.01))
    x = RNG.standard_normal((2, 3, 16, 16)).astype(np.float32)
    session.train_step({"input": x}, np.array([1, 2]))
    ops = [s.label.split("(")[1].split(",")[0] for s in session._state.active.executor.steps]
    assert "Conv" in ops and "Relu" in ops and "FusedConv" not in ops


# ---- MaxPool on proven-finite inputs -----------------------------------------------------------

@pytest.mark.usefixtures("onednn_required")
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "dilations": [2, 2]},
    {"kernel_shape": [3], "strides": [1], "pads": [1, 1]},
], ids=["2x2", "3x3_pad", "ceil", "dilated", "1d"])
@pytest.mark.parametrize("align", [1, 8])
def test_max_pool_of_a_proven_input_runs_onednn(monkeypatch, attrs, align):
    """A MaxPool reading the (checked) model input runs oneDNN's pooling: the same values as
    the NumPy kernel bit for bit, and as onnxruntime; a NaN input runs the NumPy kernel (the
    unfused plan's values, NaN kept)."""
    made = []
    real = tr_onnx.onednn.max_pooling
    monkeypatch.setattr(tr_onnx.onednn, "max_pooling",
                        lambda *a: made.append(a) or real(*a))
    shape = [2, 5, 9] if len(attrs["kernel_shape"]) == 1 else [2, 5, 9, 9]
    graph = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    x = RNG.standard_normal(shape).astype(np.float32)
    sess = tr_onnx.InferenceSession(model, channel_align=align)
    got = sess.run(None, {"x": x})[0]
    assert made and sess.plan_for({"x": x}).graph.nodes[0].proven_finite
    np.testing.assert_array_equal(got, ort_run(model, {"x": x})[0])
    np.testing.assert_array_equal(got, _unfused(monkeypatch, model, {"x": x},
                                                channel_align=align)[0][0])
    x[0, 0, 0] = np.nan
    got = sess.run(None, {"x": x})[0]
    want = _unfused(monkeypatch, model, {"x": x}, channel_align=align)[0][0]
    assert np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_input_check_at_the_limit(dtype):
    """The per-run check of a fused plan's inputs (a sum of squares first, then the max and
    the min): a value just past the limit fails wherever it sits, among many values whose
    squares add up past the limit too; values at the limit, and many values whose squares
    together exceed it, pass; NaN and infinities fail; strided and empty inputs are checked
    as well."""
    from tr_onnx.session import _within

    limit = 100.0
    just_past = np.nextafter(dtype(limit), dtype(np.inf))
    x = np.full(10_000, limit * 0.3, dtype)  # sum of squares 9e6 > limit^2: max/min decide
    assert _within({"x": x}, ("x",), limit)
    small = np.ones(64, dtype)  # sum of squares 64 <= (limit / 2)^2: the dot decides
    assert _within({"x": small}, ("x",), limit)
    for base in (x, small):
        for where in (0, len(base) // 2, -1):
            for value in (just_past, -just_past, np.nan, np.inf, -np.inf):
                bad = base.copy()
                bad[where] = value
                assert not _within({"x": bad}, ("x",), limit), (len(base), where, value)
    assert _within({"x": np.full(64, -limit, dtype)}, ("x",), limit)
    strided = np.zeros((8, 8), dtype)[:, ::2]
    strided[3, 1] = just_past
    assert not _within({"x": strided}, ("x",), limit)
    assert _within({"x": np.zeros((0, 3), dtype)}, ("x",), limit)
