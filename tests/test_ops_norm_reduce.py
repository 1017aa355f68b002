"""Normalisation, reduction and softmax-family kernels (numpy backend) against onnxruntime and
onnx.reference, with plain and channel-padded (channel_align=8) layouts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero

F16, F32, F64 = np.float16, np.float32, np.float64
# float16: the oracles round intermediates differently (float32 statistics vs float16 steps);
# two float16 ulps of the output's scale.
TOL = {F32: (1e-5, 1e-6), F64: (1e-10, 1e-12), F16: (2e-3, 2e-3)}
# y == x exactly in float16/32/64 (onnxruntime insists on alpha > 0)
_IDENTITY_LRN = {"size": 1, "alpha": 1e-30, "beta": 0.75, "bias": 1.0}


def _rand(shape, dtype=F32, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _model(op, inputs, n_outputs=1, attrs=None, opset=18, inits=(), channels_last=False,
           out_names=None, out_shapes=None):
    """One ``op`` node over ``inputs`` ({name: array}); ``inits`` names those that are
    initializers. ``channels_last``: input 0 first passes an identity LRN (a spatial op), so
    the op under test reads a channels-last (padded) feature map."""
    nodes, x0 = [], list(inputs)[0]
    node_inputs = list(inputs)
    if channels_last:
        nodes.append(helper.make_node("LRN", [x0], ["x_cl"], **_IDENTITY_LRN))
        node_inputs[0] = "x_cl"
    outs = out_names or [f"y{i}" for i in range(n_outputs)]
    nodes.append(helper.make_node(op, node_inputs, outs, **(attrs or {})))
    graph_inputs = [helper.make_tensor_value_info(k, onnx_elem_type(v.dtype), v.shape)
                    for k, v in inputs.items() if k not in inits and k]
    initializers = [numpy_helper.from_array(inputs[k], k) for k in inits]
    elem = onnx_elem_type(inputs[x0].dtype)
    if out_shapes is None:  # shape inference fills them in
        graph_outputs = [helper.make_tensor_value_info(o, 0, None) for o in outs if o]
    else:
        graph_outputs = [helper.make_tensor_value_info(o, elem, s)
                         for o, s in zip(outs, out_shapes)]
    graph = helper.make_graph(nodes, "g", graph_inputs, graph_outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 18 else 10
    if out_shapes is None:
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(o for o in inferred.graph.output)
    return model


def _feed(model, inputs):
    names = {i.name for i in model.graph.input}
    return {k: v for k, v in inputs.items() if k in names}


def _check(model, inputs, dtype=F32, ort=True, ref=True, aligns=(1, 8), expected=None):
    """tr_onnx (each channel_align) == onnxruntime == onnx.reference; padded lanes stay zero."""
    feed = _feed(model, inputs)
    rtol, atol = TOL[np.dtype(dtype).type]
    oracles = []
    if ort:
        oracles.append(("onnxruntime", ort_run(model, feed)))
    if ref:
        oracles.append(("onnx.reference", ReferenceEvaluator(model).run(None, feed)))
    if expected is not None:
        oracles.append(("expected", expected))
    assert oracles
    for align in aligns:
        sess = tr_onnx.InferenceSession(model, channel_align=align)
        got = sess.run(None, feed)
        for name, want in oracles:
            assert len(got) == len(want)
            for g, w in zip(got, want):
                w = np.asarray(w)
                assert g.shape == w.shape, (name, align, g.shape, w.shape)
                assert g.dtype == w.dtype, (name, align, g.dtype, w.dtype)
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                           err_msg=f"vs {name}, channel_align={align}")
        plan = sess.plan_for(feed)
        for t in plan.memory.tensors.values():
            assert pad_lanes_are_zero(plan.executor.arena, t), (align, t)


# ------------------------------------------------------------------------ BatchNormalization

def _bn_inputs(shape, dtype=F32, seed=0):
    c = shape[1]
    rng = np.random.default_rng(seed + 100)
    return {"x": _rand(shape, dtype, seed, scale=2.0),
            "scale": rng.uniform(0.5, 1.5, c).astype(dtype),
            "bias": rng.standard_normal(c).astype(dtype),
            "mean": rng.standard_normal(c).astype(dtype),
            "var": rng.uniform(0.5, 2.0, c).astype(dtype)}


BN_INFERENCE = [
    pytest.param((2, 3, 4, 5), F32, 15, {}, id="c3-v15"),
    pytest.param((2, 5, 3, 3), F32, 14, {"epsilon": 1e-2}, id="c5-v14-eps"),
    pytest.param((1, 13, 4, 4), F32, 9, {}, id="c13-v9"),
    pytest.param((2, 13, 7), F32, 7, {}, id="rank3-c13-v7"),
    pytest.param((2, 5, 2, 3, 3), F32, 15, {}, id="rank5-c5"),
    pytest.param((4, 5), F32, 15, {}, id="rank2-nc"),
    pytest.param((2, 5, 4, 4), F64, 15, {}, id="c5-f64"),
    pytest.param((2, 3, 4, 4), F16, 15, {}, id="c3-f16"),
    pytest.param((2, 3, 4, 4), F32, 6, {"is_test": 1}, id="c3-v6-is_test"),
]


@pytest.mark.parametrize("shape, dtype, opset, attrs", BN_INFERENCE)
@pytest.mark.parametrize("params", ["initializers", "graph_inputs"])
def test_batch_norm_inference(shape, dtype, opset, attrs, params):
    inputs = _bn_inputs(shape, dtype)
    inits = ("scale", "bias", "mean", "var") if params == "initializers" else ()
    model = _model("BatchNormalization", inputs, attrs=attrs, opset=opset, inits=inits)
    # onnxruntime has no float16 BatchNormalization CPU kernel; onnx.reference's v7/v9 always
    # takes the training branch (it tests ``momentum is None``, which the schema default fills)
    # (and opset 6 models at all)
    _check(model, inputs, dtype, ort=dtype != F16 and opset >= 7, ref=not 7 <= opset < 14)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 13, 2, 3), (5, 7)], ids=["c3", "c13", "nc"])
def test_batch_norm_inference_matches_torch_float64(shape):
    p = _bn_inputs(shape, F64, seed=3)
    model = _model("BatchNormalization", p, opset=15, inits=("scale", "bias", "mean", "var"))
    want = torch.nn.functional.batch_norm(
        torch.from_numpy(p["x"]), torch.from_numpy(p["mean"]), torch.from_numpy(p["var"]),
        torch.from_numpy(p["scale"]), torch.from_numpy(p["bias"]), training=False,
        eps=1e-5).numpy()
    _check(model, p, F64, ort=False, ref=False, expected=[want])


def _bn_training_expected(p, momentum=0.9, eps=1e-5):
    x = p["x"].astype(F64)
    axes = tuple(a for a in range(x.ndim) if a != 1)
    shape = [1] * x.ndim
    shape[1] = -1
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * \
        p["scale"].reshape(shape) + p["bias"].reshape(shape)
    run_mean = p["mean"] * momentum + mean * (1 - momentum)
    run_var = p["var"] * momentum + var * (1 - momentum)
    dtype = p["x"].dtype
    return [a.astype(dtype) for a in (y, run_mean, run_var, mean, var)]


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 13, 3, 3), (6, 5), (2, 5, 7)],
                         ids=["c3", "c13", "nc", "rank3"])
@pytest.mark.parametrize("momentum", [0.9, 0.3])
@pytest.mark.parametrize("opset", [14, 15])
def test_batch_norm_training_mode(shape, momentum, opset):
    p = _bn_inputs(shape, seed=5)
    model = _model("BatchNormalization", p, n_outputs=3, opset=opset,
                   attrs={"training_mode": 1, "momentum": momentum},
                   inits=("scale", "bias", "mean", "var"))
    # onnxruntime's CPU kernel leaves training mode to its training build; the formula is the
    # spec's (biased batch variance)
    _check(model, p, ref=True, ort=False, expected=_bn_training_expected(p, momentum)[:3])


@pytest.mark.parametrize("opset, n_outputs", [(9, 5), (7, 5)], ids=["v9", "v7"])
def test_batch_norm_training_legacy_outputs(opset, n_outputs):
    """Before v14 the training outputs are running mean/var and the batch (saved) mean/var;
    onnx.reference's v9 normalises with the updated running stats, not the spec's batch ones."""
    p = _bn_inputs((3, 5, 2, 3), seed=7)
    model = _model("BatchNormalization", p, n_outputs=n_outputs, opset=opset,
                   inits=("scale", "bias", "mean", "var"),
                   out_shapes=[p["x"].shape] + [(5,)] * (n_outputs - 1))
    _check(model, p, ort=False, ref=False, expected=_bn_training_expected(p)[:n_outputs])
    # onnxruntime agrees except on saved_var, where it stores 1/sqrt(var + eps) (the cuDNN
    # convention); the spec names it the saved variance, as onnx.reference computes it
    got = tr_onnx.InferenceSession(model).run(None, _feed(model, p))
    for g, w in zip(got[:4], ort_run(model, _feed(model, p))[:4]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_batch_norm_spatial_0_is_refused():
    p = _bn_inputs((2, 3, 2, 2))
    for k in ("scale", "bias", "mean", "var"):
        p[k] = np.ones((3, 2, 2), F32)
    model = _model("BatchNormalization", p, opset=7, attrs={"spatial": 0},
                   inits=("scale", "bias", "mean", "var"))
    with pytest.raises(tr_onnx.TrOnnxError, match="spatial=0"):
        tr_onnx.InferenceSession(model).run(None, _feed(model, p))


# --------------------------------------------------------------------------------- LRN

@pytest.mark.parametrize("c", [3, 5, 13])
@pytest.mark.parametrize("attrs", [{"size": 3},
                                   {"size": 5, "alpha": 1e-2, "beta": 0.5, "bias": 2.0},
                                   {"size": 2}, {"size": 1}, {"size": 21}],
                         ids=["size3", "size5-attrs", "size2-even", "size1", "size-gt-c"])
def test_lrn(c, attrs):
    # batch = c: onnx.reference's LRN loops its channel index over x.shape[0] (a bug), so it
    # is right only for the first N channels
    inputs = {"x": _rand((c, c, 3, 4), scale=3.0)}
    # onnxruntime's LRN requires an odd size
    _check(_model("LRN", inputs, attrs=attrs, opset=13), inputs, ort=attrs["size"] % 2 == 1)


@pytest.mark.parametrize("dtype, opset", [(F16, 13), (F32, 1)], ids=["f16", "v1"])
def test_lrn_f16_and_v1(dtype, opset):
    inputs = {"x": _rand((5, 5, 3, 3), dtype, scale=2.0)}  # batch >= C: see test_lrn
    model = _model("LRN", inputs, attrs={"size": 3, "alpha": 0.1}, opset=max(opset, 7))
    # onnxruntime's LRN CPU kernel is float32 only
    _check(model, inputs, dtype, ort=dtype == F32)


def test_lrn_f64():
    """Against the formula in float64 (onnx.reference forms alpha / size in float32)."""
    x = _rand((2, 5, 3, 3), F64, scale=2.0)
    alpha, size, beta, bias = float(np.float32(0.1)), 3, 0.75, 1.0
    sq = np.pad(x ** 2, ((0, 0), (1, 1), (0, 0), (0, 0)))
    window = sq[:, :-2] + sq[:, 1:-1] + sq[:, 2:]
    want = x / (bias + alpha / size * window) ** beta
    model = _model("LRN", {"x": x}, attrs={"size": size, "alpha": 0.1}, opset=13)
    _check(model, {"x": x}, F64, ort=False, ref=False, expected=[want])


# ------------------------------------------------------------- Instance / Group normalization

@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 5, 3), (1, 13, 2, 3, 2)],
                         ids=["c3", "rank3-c5", "rank5-c13"])
@pytest.mark.parametrize("opset", [22, 6])
def test_instance_norm(shape, opset):
    c = shape[1]
    inputs = {"x": _rand(shape, scale=2.0) + 1.0, "s": _rand((c,), seed=1),
              "b": _rand((c,), seed=2)}
    model = _model("InstanceNormalization", inputs, attrs={"epsilon": 1e-3}, opset=opset,
                   inits=("s", "b"))
    _check(model, inputs)


@pytest.mark.parametrize("dtype", [F64, F16], ids=["f64", "f16"])
def test_instance_norm_dtypes(dtype):
    inputs = {"x": _rand((2, 5, 3, 3), dtype), "s": _rand((5,), dtype, 1),
              "b": _rand((5,), dtype, 2)}
    model = _model("InstanceNormalization", inputs, opset=22, inits=("s", "b"))
    _check(model, inputs, dtype, ort=dtype == F16)  # onnxruntime: no float64 InstanceNorm


# GroupNormalization-18 (per-group scale) is deprecated: onnx.checker rejects models using it,
# so only v21 can be imported.
@pytest.mark.parametrize("c, groups", [(6, 3), (5, 5), (13, 1), (8, 2)],
                         ids=["c6-g3", "c5-g5", "c13-g1", "c8-g2"])
def test_group_norm(c, groups):
    opset, n_params = 21, c
    inputs = {"x": _rand((2, c, 3, 4), scale=2.0), "s": _rand((n_params,), seed=1),
              "b": _rand((n_params,), seed=2)}
    model = _model("GroupNormalization", inputs, attrs={"num_groups": groups, "epsilon": 1e-4},
                   opset=opset, inits=("s", "b"), out_shapes=[inputs["x"].shape])
    _check(model, inputs)


# ------------------------------------------------------------------- LayerNormalization

@pytest.mark.parametrize("shape, axis", [((2, 3, 4, 5), -1), ((2, 3, 4, 5), 1), ((2, 3, 4, 5), -3),
                                         ((2, 3, 4, 5), 0), ((5, 7), 1)],
                         ids=["4d-last", "4d-axis1", "4d-neg3", "4d-axis0", "2d"])
@pytest.mark.parametrize("outputs", [1, 3, "mean-only"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm(shape, axis, outputs, bias):
    norm_shape = shape[axis % len(shape):]
    inputs = {"x": _rand(shape, scale=2.0) + 0.5, "w": _rand(norm_shape, seed=1)}
    if bias:
        inputs["b"] = _rand(norm_shape, seed=2)
    names = ["y", "mean"] if outputs == "mean-only" else None
    model = _model("LayerNormalization", inputs, n_outputs=outputs if names is None else 2,
                   attrs={"axis": axis}, opset=17, inits=tuple(k for k in inputs if k != "x"),
                   out_names=names)
    _check(model, inputs)


@pytest.mark.parametrize("dtype", [F64, F16], ids=["f64", "f16"])
def test_layer_norm_dtypes(dtype):
    inputs = {"x": _rand((3, 4, 6), dtype), "w": _rand((6,), dtype, 1), "b": _rand((6,), dtype, 2)}
    model = _model("LayerNormalization", inputs, opset=17, inits=("w", "b"))
    _check(model, inputs, dtype)


def test_layer_norm_on_channels_last_input():
    inputs = {"x": _rand((2, 5, 3, 4)), "w": _rand((4,), seed=1), "b": _rand((4,), seed=2)}
    model = _model("LayerNormalization", inputs, opset=17, inits=("w", "b"), channels_last=True)
    _check(model, inputs)


# ------------------------------------------------------------------ MVN / LpNormalization

@pytest.mark.parametrize("axes", [None, [0, 2, 3], [1], [-1, -2]],
                         ids=["default", "023", "1", "neg"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["plain", "nhwc"])
def test_mean_variance_normalization(axes, channels_last):
    inputs = {"x": _rand((2, 5, 3, 4), scale=3.0)}
    attrs = {} if axes is None else {"axes": axes}
    _check(_model("MeanVarianceNormalization", inputs, attrs=attrs, opset=13,
                  channels_last=channels_last, out_shapes=[inputs["x"].shape]), inputs)


@pytest.mark.parametrize("p, axis", [(2, -1), (1, 1), (2, 0), (1, -3)],
                         ids=["p2-last", "p1-axis1", "p2-axis0", "p1-neg3"])
@pytest.mark.parametrize("opset", [22, 13])
def test_lp_normalization(p, axis, opset):
    x = _rand((2, 5, 3, 3))
    x[0, :, 1, 1] = 0  # a zero-norm slice along axis 1
    inputs = {"x": x}
    # onnx.reference's LpNormalization takes x ** p (signed for p=1); ORT's |x| is the spec's
    _check(_model("LpNormalization", inputs, attrs={"p": p, "axis": axis}, opset=opset),
           inputs, ref=p == 2)


# ------------------------------------------------------------------------------- Reduce*

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]
AXES_CASES = [
    pytest.param([1], 1, id="axis1-keep"),
    pytest.param([1], 0, id="axis1-drop"),
    pytest.param([-1, 0], 0, id="neg-and-0-drop"),
    pytest.param([2, -1], 1, id="spatial-keep"),
    pytest.param(None, 1, id="all-keep"),
    pytest.param(None, 0, id="all-drop"),
]


def _reduce_input(op, shape=(2, 5, 3, 4), dtype=F32):
    x = _rand(shape, dtype)
    if op in ("ReduceLogSum", "ReduceProd"):
        x = np.abs(x) + 0.5  # log of a positive sum; products near 1
    return x


def _reduce_model(op, x, axes, keepdims, opset, channels_last=False, noop=None):
    inputs = {"x": x}
    attrs = {"keepdims": keepdims}
    axes_in_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is not None:
        if axes_in_input:
            inputs["axes"] = np.array(axes, np.int64)
        else:
            attrs["axes"] = axes
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    return _model(op, inputs, attrs=attrs, opset=opset, channels_last=channels_last,
                  inits=("axes",) if "axes" in inputs else ()), inputs


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes, keepdims", AXES_CASES)
@pytest.mark.parametrize("opset", [11, 18])
def test_reduce(op, axes, keepdims, opset):
    model, inputs = _reduce_model(op, _reduce_input(op), axes, keepdims, opset)
    _check(model, inputs, aligns=(1,))


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([1], 0), ([0, 2, 3], 1), (None, 0)],
                         ids=["c-keep", "c-drop", "nhw-keep", "all-drop"])
def test_reduce_channels_last_input(op, axes, keepdims):
    """The reduced input is a padded channels-last feature map (after a spatial op)."""
    x = _reduce_input(op, (2, 5, 3, 3))
    model, inputs = _reduce_model(op, x, axes, keepdims, 18, channels_last=True)
    _check(model, inputs)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2",
                                "ReduceLogSumExp"])
@pytest.mark.parametrize("dtype", [F64, F16], ids=["f64", "f16"])
def test_reduce_dtypes(op, dtype):
    model, inputs = _reduce_model(op, _reduce_input(op, (3, 4, 5), dtype), [-1], 0, 18)
    _check(model, inputs, dtype, aligns=(1,))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
                                "ReduceSumSquare", "ReduceL1"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["i32", "i64"])
def test_reduce_integers(op, dtype):
    x = np.random.default_rng(0).integers(-5, 6, (3, 4, 5)).astype(dtype)
    model, inputs = _reduce_model(op, x, [1], 1, 18)
    # onnx.reference's ReduceSumSquare widens int32 to int64 (np.sum's default); ONNX keeps T
    _check(model, inputs, F32, aligns=(1,), ref=not (op == "ReduceSumSquare" and dtype == np.int32))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceL2", "ReduceSumSquare", "ReduceMax"])
@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_empty_axes(op, noop):
    """An empty axes input reduces everything, or nothing with noop_with_empty_axes=1."""
    x = _reduce_input(op, (2, 3, 4))
    model, inputs = _reduce_model(op, x, [], 1, 18, noop=noop)
    _check(model, inputs, aligns=(1,))


def test_reduce_logsumexp_large_and_inf():
    x = np.array([[1000.0, 1000.0, -np.inf], [-np.inf, -np.inf, -np.inf], [1.0, 2.0, 3.0]], F32)
    model, inputs = _reduce_model("ReduceLogSumExp", x, [1], 0, 18)
    _check(model, inputs, ort=True, ref=False, aligns=(1,))


# ---------------------------------------------------------------- Softmax family / ArgMax

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_family(op, axis, opset):
    x = _rand((2, 5, 3, 4), scale=3.0)
    if op == "Hardmax":
        x = np.round(x)  # ties: the first maximum wins
    inputs = {"x": x}
    # onnx.reference ignores the v1/v11 coercion to 2-D (it reduces over ``axis`` alone)
    _check(_model(op, inputs, attrs={"axis": axis}, opset=opset), inputs, aligns=(1,),
           ref=opset >= 13 or axis % 4 == 3)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [1, -1, 2])
@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_family_channels_last(op, axis, opset):
    x = _rand((2, 5, 3, 3), scale=3.0)
    inputs = {"x": x}
    _check(_model(op, inputs, attrs={"axis": axis}, opset=opset, channels_last=True), inputs,
           ref=opset >= 13 or axis % 4 == 3)  # see test_softmax_family


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("dtype", [F64, F16], ids=["f64", "f16"])
def test_softmax_dtypes_and_large_values(op, dtype):
    x = _rand((3, 7), dtype, scale=2.0)
    x[0] += dtype(1000 if dtype != F16 else 100)
    inputs = {"x": x}
    _check(_model(op, inputs, opset=13), inputs, dtype)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis, keepdims", [(0, 1), (1, 0), (-1, 1), (-2, 0)],
                         ids=["0-keep", "1-drop", "neg1-keep", "neg2-drop"])
@pytest.mark.parametrize("last", [0, 1], ids=["first", "last"])
def test_argmax(op, axis, keepdims, last):
    x = np.round(_rand((3, 4, 5), scale=1.5))  # many ties
    inputs = {"x": x}
    model = _model(op, inputs, attrs={"axis": axis, "keepdims": keepdims,
                                      "select_last_index": last}, opset=13)
    _check(model, inputs, aligns=(1,))


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_argmax_channels_last_v11(op):
    inputs = {"x": np.round(_rand((2, 5, 3, 3), scale=2.0))}
    model = _model(op, inputs, attrs={"axis": 1, "keepdims": 1}, opset=11, channels_last=True)
    _check(model, inputs)
