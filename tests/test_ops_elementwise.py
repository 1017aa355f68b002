"""Elementwise ops (tr_onnx/ops/elementwise.py) against onnxruntime and onnx.reference.

Single-node models; channels-last padded inputs come from a 1x1 MaxPool in front of the op
(parametrized only when MaxPool is registered).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, shape_inference
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.registry import default_registry

RNG = np.random.default_rng(0)
F32 = {"rtol": 1e-5, "atol": 1e-6}
# float16 keeps 11 significant bits; onnxruntime computes in float32 and rounds, numpy's half
# loops do the same, so results agree to an ulp or two of float16.
F16 = {"rtol": 2e-3, "atol": 2e-3}


def randn(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def uniform(lo, hi, *shape, dtype=np.float32):
    return RNG.uniform(lo, hi, shape).astype(dtype)


def ints(lo, hi, *shape, dtype=np.int32):
    return RNG.integers(lo, hi, shape).astype(dtype)


def nonzero_ints(hi, n, dtype=np.int32):
    """Divisors: 1..hi-1 with random signs."""
    return (ints(1, hi, n, dtype=dtype) * np.where(bools(n), 1, -1)).astype(dtype)


def bools(*shape):
    return RNG.random(shape) < 0.5


def make_model(op, inputs, attrs=None, opset=17, consts=(), n_outputs=1, pre_pool=False):
    """One ``op`` node over ``inputs`` (arrays; None = absent optional input). Indices in
    ``consts`` become initializers. ``pre_pool``: input 0 passes through a 1x1 MaxPool first,
    so the op reads a channels-last (padded) feature map."""
    names = [None if x is None else f"x{i}" for i, x in enumerate(inputs)]
    node_inputs = ["" if n is None else n for n in names]
    nodes, graph_inputs, inits, types = [], [], [], {}
    for i, (name, x) in enumerate(zip(names, inputs)):
        if name is None:
            continue
        if i in consts:
            inits.append(onnx.numpy_helper.from_array(x, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, onnx_elem_type(x.dtype),
                                                              list(x.shape)))
        types[name] = helper.make_tensor_type_proto(onnx_elem_type(x.dtype), list(x.shape))
    if pre_pool:
        nodes.append(helper.make_node("MaxPool", ["x0"], ["p0"], kernel_shape=[1, 1]))
        node_inputs[0] = "p0"
        types["p0"] = types["x0"]
    outputs = [f"y{j}" for j in range(n_outputs)]
    node = helper.make_node(op, node_inputs, outputs, **(attrs or {}))
    nodes.append(node)
    schema = onnx.defs.get_schema(op, max_inclusive_version=opset)
    out_types = shape_inference.infer_node_outputs(
        schema, node, {n: t for n, t in types.items() if n in node_inputs})
    for o in outputs:  # some old schemas infer no shape (Dropout-7's mask): input 0's
        if not out_types[o].tensor_type.HasField("shape"):
            out_types[o].tensor_type.shape.CopyFrom(types[node_inputs[0]].tensor_type.shape)
    graph = helper.make_graph(nodes, op, graph_inputs,
                              [helper.make_value_info(o, out_types[o]) for o in outputs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feed_of(model, inputs):
    return {f"x{i}": x for i, x in enumerate(inputs) if x is not None
            and f"x{i}" in {i.name for i in model.graph.input}}


def assert_same(actual, expected, tol, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    if actual.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected, err_msg=what)
    else:
        np.testing.assert_allclose(actual, expected, err_msg=what, equal_nan=True, **tol)


# Cases onnxruntime has no kernel for: compared with onnx.reference only.
NO_ORT = {"gelu_f64": "no double Gelu", "mean_f64": "no double Mean"}


def check(model, inputs, tol=F32, channel_align=None, reference=True, ort_check=True):
    feed = feed_of(model, inputs)
    sess = tr_onnx.InferenceSession(model, channel_align=channel_align)
    ours = sess.run(None, feed)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    expected = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"]).run(None, feed) \
        if ort_check else ours
    for k, (a, e) in enumerate(zip(ours, expected)):
        assert_same(a, e, tol, f"output {k} vs onnxruntime")
    if reference:
        for k, (a, e) in enumerate(zip(ours, ReferenceEvaluator(model).run(None, feed))):
            assert_same(a, e, tol, f"output {k} vs onnx.reference")
    return sess, feed


X = randn(2, 3, 5)
POS = uniform(0.1, 4.0, 2, 3, 5)
UNIT = uniform(-0.95, 0.95, 2, 3, 5)
BIG = np.array([-1000, -100, -20, -1, 0, 1, 20, 100, 1000], np.float32)
# NaN propagates through Relu and Clip (their bounds are arrays, ops/elementwise.filled_like)
SPECIAL = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 3, -3, 7], np.float32)

# (id, op, inputs, attrs, opset, tolerance)
UNARY_CASES = [
    ("relu", "Relu", [X], {}, 17, F32),
    ("relu_int32", "Relu", [ints(-9, 9, 4, 5)], {}, 17, F32),
    ("relu_f16", "Relu", [randn(3, 5, dtype=np.float16)], {}, 17, F16),
    ("relu_special", "Relu", [SPECIAL], {}, 17, F32),
    ("leakyrelu", "LeakyRelu", [X], {}, 17, F32),
    ("leakyrelu_alpha", "LeakyRelu", [X], {"alpha": 0.3}, 17, F32),
    ("leakyrelu_f64", "LeakyRelu", [randn(4, 3, dtype=np.float64)], {"alpha": 0.2}, 17, F32),
    # the kernel's three forms (max for slopes in [0, 1], min above, two halves for negative
    # ones) on NaN, infinities, signed zeros, subnormals; 0 * -inf is NaN as in the reference
    *[(f"leakyrelu_special_{alpha}", "LeakyRelu", [SPECIAL], {"alpha": alpha}, 17, F32)
      for alpha in (0.01, 0.0, 1.0, 2.5, -0.5)],
    ("leakyrelu_chunked", "LeakyRelu", [randn(4, 8, 32, 32, scale=3)], {"alpha": 0.1}, 17, F32),
    ("leakyrelu_chunked_steep", "LeakyRelu", [randn(4, 8, 32, 32)], {"alpha": 3.0}, 17, F32),
    ("elu", "Elu", [X], {"alpha": 0.5}, 17, F32),
    ("selu", "Selu", [X], {}, 17, F32),
    ("selu_attrs", "Selu", [X], {"alpha": 2.0, "gamma": 3.0}, 17, F32),
    ("celu", "Celu", [X], {"alpha": 2.0}, 17, F32),
    ("thresholdedrelu", "ThresholdedRelu", [X], {"alpha": 0.2}, 17, F32),
    ("sigmoid", "Sigmoid", [X], {}, 17, F32),
    ("sigmoid_big", "Sigmoid", [BIG], {}, 17, F32),
    ("sigmoid_f64", "Sigmoid", [randn(13, dtype=np.float64, scale=10)], {}, 17, F32),
    ("sigmoid_f16", "Sigmoid", [randn(13, dtype=np.float16, scale=4)], {}, 17, F16),
    ("hardsigmoid", "HardSigmoid", [randn(2, 13, scale=4)], {"alpha": 0.3, "beta": 0.4}, 17, F32),
    ("hardswish", "HardSwish", [randn(2, 13, scale=4)], {}, 17, F32),
    ("tanh", "Tanh", [X], {}, 17, F32),
    ("erf", "Erf", [randn(5, 13, scale=2)], {}, 17, F32),
    ("erf_f16", "Erf", [randn(13, dtype=np.float16)], {}, 17, F16),
    ("gelu", "Gelu", [randn(3, 13, scale=3)], {}, 20, F32),
    ("gelu_tanh", "Gelu", [randn(3, 13, scale=3)], {"approximate": "tanh"}, 20, F32),
    ("gelu_f64", "Gelu", [randn(3, 13, dtype=np.float64, scale=3)], {}, 20, F32),
    ("softplus", "Softplus", [X], {}, 17, F32),
    ("softplus_big", "Softplus", [BIG], {}, 17, F32),
    ("softsign", "Softsign", [X], {}, 17, F32),
    ("mish", "Mish", [randn(3, 13, scale=3)], {}, 18, F32),
    ("mish_big", "Mish", [BIG], {}, 18, F32),
    ("exp", "Exp", [X], {}, 17, F32),
    ("exp_f16", "Exp", [randn(13, dtype=np.float16)], {}, 17, F16),
    ("log", "Log", [POS], {}, 17, F32),
    ("sqrt", "Sqrt", [POS], {}, 17, F32),
    ("reciprocal", "Reciprocal", [POS], {}, 17, F32),
    ("neg", "Neg", [X], {}, 17, F32),
    ("neg_int64", "Neg", [ints(-9, 9, 7, dtype=np.int64)], {}, 17, F32),
    ("abs", "Abs", [X], {}, 17, F32),
    ("abs_int8", "Abs", [ints(-9, 9, 7, dtype=np.int8)], {}, 17, F32),
    ("sign", "Sign", [np.array([-2.5, 0, 3, -0.0], np.float32)], {}, 17, F32),
    ("sign_int32", "Sign", [ints(-3, 3, 9)], {}, 17, F32),
    ("floor", "Floor", [randn(13, scale=3)], {}, 17, F32),
    ("ceil", "Ceil", [randn(13, scale=3)], {}, 17, F32),
    ("round", "Round", [np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.2, -2.7], np.float32)], {}, 17,
     F32),
    ("sin", "Sin", [X], {}, 17, F32),
    ("cos", "Cos", [X], {}, 17, F32),
    ("tan", "Tan", [UNIT], {}, 17, F32),
    ("asin", "Asin", [UNIT], {}, 17, F32),
    ("acos", "Acos", [UNIT], {}, 17, F32),
    ("atan", "Atan", [X], {}, 17, F32),
    ("sinh", "Sinh", [X], {}, 17, F32),
    ("cosh", "Cosh", [X], {}, 17, F32),
    ("asinh", "Asinh", [X], {}, 17, F32),
    ("acosh", "Acosh", [POS + 1], {}, 17, F32),
    ("atanh", "Atanh", [UNIT], {}, 17, F32),
    ("isnan", "IsNaN", [np.array([1, np.nan, np.inf, -np.nan], np.float32)], {}, 17, F32),
    ("isinf", "IsInf", [np.array([1, np.nan, np.inf, -np.inf], np.float32)], {}, 17, F32),
    ("isinf_pos", "IsInf", [np.array([1, np.nan, np.inf, -np.inf], np.float32)],
     {"detect_negative": 0}, 17, F32),
    ("isinf_neg", "IsInf", [np.array([1, np.nan, np.inf, -np.inf], np.float32)],
     {"detect_positive": 0}, 17, F32),
    ("not", "Not", [bools(3, 5)], {}, 17, F32),
    ("bitwisenot", "BitwiseNot", [ints(-99, 99, 3, 5)], {}, 18, F32),
    ("bitwisenot_uint8", "BitwiseNot", [ints(0, 255, 13, dtype=np.uint8)], {}, 18, F32),
    ("shrink", "Shrink", [randn(3, 13)], {"lambd": 0.6, "bias": 0.2}, 17, F32),
    ("shrink_default", "Shrink", [randn(3, 13)], {}, 17, F32),
]


@pytest.mark.parametrize("op,inputs,attrs,opset,tol",
                         [pytest.param(*c[1:], id=c[0]) for c in UNARY_CASES])
def test_unary(op, inputs, attrs, opset, tol, request):
    check(make_model(op, inputs, attrs, opset), inputs, tol,
          ort_check=request.node.callspec.id not in NO_ORT)


def test_erf_float64_precision():
    """onnxruntime has no double Erf: check against math.erf (the C library's) directly."""
    import math

    x = np.concatenate([np.linspace(-7, 7, 2801), [0.0, -0.0, 1e-300, np.inf, -np.inf, np.nan]])
    model = make_model("Erf", [x])
    ours = tr_onnx.InferenceSession(model).run(None, {"x0": x})[0]
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(ours, expected, rtol=4e-16 * 8, atol=1e-300, equal_nan=True)
    assert np.signbit(ours[2802])  # erf(-0) = -0


def test_erf_pieces_precision():
    """The erf of float32 and float16 results (ops/erf.py ``_ERF_PIECES``) against
    math.erf: 5e-11 relative where |x| <= 3.9; beyond, a value that rounds to +-1 in float32
    as erf does; the sign of zero, inf and NaN kept."""
    import math

    from tr_onnx.ops.erf import ERF_SCRATCH, erf_float64

    x = np.concatenate([np.linspace(-7, 7, 140001), np.geomspace(1e-30, 1, 301),
                        -np.geomspace(1e-30, 1, 301), [0.0, -0.0, np.inf, -np.inf, np.nan]])
    dtypes = {"f8": np.float64, "?": np.bool_, "i8": np.intp}
    t = [np.empty(x.shape, dtypes[c]) for c in ERF_SCRATCH]
    erf_float64(x, t, exact=False)
    ours = t[1]
    expected = np.array([math.erf(v) for v in x])
    inside = np.abs(x) <= 3.9
    np.testing.assert_allclose(ours[inside], expected[inside], rtol=5e-11, atol=0)
    np.testing.assert_array_equal(ours[~inside].astype(np.float32),
                                  expected[~inside].astype(np.float32))
    np.testing.assert_array_equal(np.signbit(ours), np.signbit(expected))


A4 = randn(2, 3, 4, 5)
BINARY_CASES = [
    ("add", "Add", [A4, randn(2, 3, 4, 5)], {}, 17),
    ("add_rank1", "Add", [A4, randn(5)], {}, 17),
    ("add_rank3", "Add", [A4, randn(3, 1, 5)], {}, 17),
    ("add_rank1_first", "Add", [randn(5), A4], {}, 17),
    ("add_scalar", "Add", [A4, np.array(2.5, np.float32)], {}, 17),
    ("add_int64", "Add", [ints(-99, 99, 3, 4, dtype=np.int64), ints(-9, 9, 4, dtype=np.int64)],
     {}, 17),
    ("add_f16", "Add", [randn(3, 4, dtype=np.float16), randn(3, 1, dtype=np.float16)], {}, 17),
    ("sub", "Sub", [A4, randn(4, 1)], {}, 17),
    ("sub_uint8", "Sub", [ints(0, 255, 9, dtype=np.uint8), ints(0, 255, 9, dtype=np.uint8)], {},
     17),
    ("mul", "Mul", [A4, randn(1, 3, 1, 1)], {}, 17),
    ("mul_f64", "Mul", [randn(3, 4, dtype=np.float64), randn(4, dtype=np.float64)], {}, 17),
    ("div", "Div", [A4, uniform(0.5, 2, 5)], {}, 17),
    ("div_int32", "Div", [ints(-50, 50, 4, 6), nonzero_ints(7, 6)], {}, 17),
    ("div_int64_bcast", "Div", [np.array([-7, 7, -8, 8, -1, 0], np.int64)[:, None],
                                np.array([2, -2, 3], np.int64)], {}, 17),
    ("div_uint8", "Div", [ints(0, 255, 9, dtype=np.uint8), ints(1, 9, 9, dtype=np.uint8)], {}, 17),
    ("pow", "Pow", [POS, randn(5)], {}, 15),
    ("pow_f32_int64", "Pow", [randn(3, 4), ints(0, 4, 4, dtype=np.int64)], {}, 15),
    ("pow_int32_f32", "Pow", [ints(1, 5, 3, 4), uniform(0, 3, 4).round()], {}, 15),
    ("pow_int64", "Pow", [ints(-5, 5, 3, 4, dtype=np.int64), ints(0, 4, 4, dtype=np.int64)], {},
     15),
    ("mod_int", "Mod", [ints(-20, 20, 4, 5), nonzero_ints(6, 5)], {}, 17),
    ("mod_fmod_int", "Mod", [ints(-20, 20, 4, 5), nonzero_ints(6, 5)], {"fmod": 1}, 17),
    ("mod_fmod_float", "Mod", [randn(4, 5, scale=9), uniform(1, 3, 5)], {"fmod": 1}, 17),
    ("bitshift_left", "BitShift", [ints(0, 16, 9, dtype=np.uint8), ints(0, 4, 9, dtype=np.uint8)],
     {"direction": "LEFT"}, 17),
    ("bitshift_right", "BitShift", [ints(0, 9999, 3, 4, dtype=np.uint32),
                                    ints(0, 8, 4, dtype=np.uint32)], {"direction": "RIGHT"}, 17),
    ("prelu_channel", "PRelu", [A4, randn(3, 1, 1)], {}, 17),
    ("prelu_scalar", "PRelu", [A4, np.array([0.2], np.float32)], {}, 17),
    ("prelu_last", "PRelu", [A4, randn(5)], {}, 17),
    ("prelu_int32", "PRelu", [ints(-9, 9, 3, 4), ints(-3, 3, 4)], {}, 17),
    ("equal", "Equal", [ints(0, 3, 4, 5), ints(0, 3, 5)], {}, 17),
    ("equal_float", "Equal", [np.array([1, 2, np.nan], np.float32), np.array([1, 3, np.nan],
                                                                             np.float32)], {}, 19),
    ("less", "Less", [A4, randn(5)], {}, 17),
    ("lessorequal", "LessOrEqual", [ints(0, 3, 4, 5), ints(0, 3, 5)], {}, 17),
    ("greater", "Greater", [A4, randn(3, 1, 5)], {}, 17),
    ("greaterorequal", "GreaterOrEqual", [ints(0, 3, 4, 5), ints(0, 3, 5)], {}, 17),
    ("and", "And", [bools(3, 4), bools(4)], {}, 17),
    ("or", "Or", [bools(3, 4), bools(3, 1)], {}, 17),
    ("xor", "Xor", [bools(2, 3, 4), bools(3, 4)], {}, 17),
    ("bitwiseand", "BitwiseAnd", [ints(-99, 99, 3, 4), ints(-99, 99, 4)], {}, 18),
    ("bitwiseor", "BitwiseOr", [ints(0, 255, 3, 4, dtype=np.uint8),
                                ints(0, 255, 4, dtype=np.uint8)], {}, 18),
    ("bitwisexor", "BitwiseXor", [ints(-99, 99, 3, 4, dtype=np.int64),
                                  ints(-99, 99, 3, 4, dtype=np.int64)], {}, 18),
]


@pytest.mark.parametrize("op,inputs,attrs,opset",
                         [pytest.param(*c[1:], id=c[0]) for c in BINARY_CASES])
def test_binary(op, inputs, attrs, opset):
    check(make_model(op, inputs, attrs, opset), inputs)


@pytest.mark.parametrize("op,inputs,opset", [
    pytest.param("Sum", [A4, randn(5), randn(3, 1, 1)], 13, id="sum_bcast"),
    pytest.param("Sum", [A4], 13, id="sum_one"),
    pytest.param("Sum", [X, randn(2, 3, 5)], 6, id="sum_opset6"),
    pytest.param("Mean", [A4, randn(5), randn(3, 1, 1), randn(4, 5)], 13, id="mean_bcast"),
    pytest.param("Mean", [randn(3, 5, dtype=np.float64), randn(5, dtype=np.float64)], 13,
                 id="mean_f64"),
    pytest.param("Max", [A4, randn(5), randn(3, 1, 1)], 13, id="max_bcast"),
    pytest.param("Max", [ints(-9, 9, 3, 4), ints(-9, 9, 4)], 13, id="max_int32"),
    pytest.param("Min", [A4, randn(4, 5)], 13, id="min_bcast"),
    pytest.param("Min", [ints(0, 9, 3, 4, dtype=np.uint8), ints(0, 9, 4, dtype=np.uint8)], 13,
                 id="min_uint8"),
    pytest.param("Min", [X, randn(2, 3, 5), randn(2, 3, 5)], 6, id="min_opset6"),
])
def test_variadic(op, inputs, opset, request):
    check(make_model(op, inputs, opset=opset), inputs,
          ort_check=request.node.callspec.id not in NO_ORT)


SCALAR_LO, SCALAR_HI = np.array(-0.5, np.float32), np.array(0.8, np.float32)


@pytest.mark.parametrize("inputs,attrs,opset,consts", [
    pytest.param([X], {"min": -0.5, "max": 0.8}, 6, (), id="v6_attrs"),
    pytest.param([X], {"max": 0.3}, 6, (), id="v6_max_only"),
    pytest.param([X], {}, 6, (), id="v6_default"),
    pytest.param([X, SCALAR_LO, SCALAR_HI], {}, 13, (1, 2), id="const_bounds"),
    pytest.param([X, SCALAR_LO, SCALAR_HI], {}, 13, (), id="runtime_bounds"),
    pytest.param([X, SCALAR_LO, SCALAR_HI], {}, 13, (1,), id="mixed_bounds"),
    pytest.param([X, None, SCALAR_HI], {}, 13, (2,), id="max_only"),
    pytest.param([X, SCALAR_LO], {}, 13, (), id="min_only_runtime"),
    pytest.param([X], {}, 13, (), id="no_bounds"),
    pytest.param([SPECIAL, np.array(0, np.float32), np.array(6, np.float32)], {}, 13, (1, 2),
                 id="relu6_special"),
    pytest.param([X, SCALAR_HI, SCALAR_LO], {}, 13, (1, 2), id="min_above_max"),
    pytest.param([ints(-9, 9, 4, 5), np.array(-2, np.int32), np.array(3, np.int32)], {}, 13, (1,),
                 id="int32"),
    pytest.param([ints(-99, 99, 13, dtype=np.int8), None, np.array(5, np.int8)], {}, 12, (),
                 id="int8_runtime_max"),
    pytest.param([randn(13, dtype=np.float16), np.array(-0.5, np.float16)], {}, 13, (1,),
                 id="f16"),
])
def test_clip(inputs, attrs, opset, consts):
    tol = F16 if inputs[0].dtype == np.float16 else F32
    check(make_model("Clip", inputs, attrs, opset, consts=consts), inputs, tol)


@pytest.mark.parametrize("inputs,opset", [
    pytest.param([bools(2, 3, 4, 5), A4, randn(2, 3, 4, 5)], 16, id="same_shape"),
    pytest.param([bools(5), A4, randn(3, 1, 5)], 16, id="bcast_rank1_cond"),
    pytest.param([bools(4, 1), ints(0, 9, 3, 4, 5), ints(0, 9, 5)], 9, id="int32_v9"),
])
def test_where(inputs, opset):
    check(make_model("Where", inputs, opset=opset), inputs)


@pytest.mark.parametrize("x,to,opset", [
    pytest.param(randn(3, 5, scale=9), onnx.TensorProto.INT32, 19, id="float_to_int32"),
    pytest.param(uniform(0, 200, 13), onnx.TensorProto.UINT8, 13, id="float_to_uint8"),
    pytest.param(np.array([0, 0.5, -1, 2], np.float32), onnx.TensorProto.BOOL, 13,
                 id="float_to_bool"),
    pytest.param(bools(3, 5), onnx.TensorProto.FLOAT, 13, id="bool_to_float"),
    pytest.param(ints(-999, 999, 13, dtype=np.int64), onnx.TensorProto.FLOAT16, 13,
                 id="int64_to_f16"),
    pytest.param(randn(13, dtype=np.float64), onnx.TensorProto.FLOAT, 21, id="f64_to_float"),
    pytest.param(randn(13), onnx.TensorProto.FLOAT16, 9, id="float_to_f16_v9"),
    pytest.param(ints(-99, 99, 13), onnx.TensorProto.INT8, 6, id="int32_to_int8_v6"),
])
def test_cast(x, to, opset):
    check(make_model("Cast", [x], {"to": to}, opset), [x])


@pytest.mark.parametrize("x,like", [
    pytest.param(randn(3, 5, scale=9), np.zeros(1, np.int64), id="float_like_int64"),
    pytest.param(ints(-9, 9, 13), np.zeros(2, np.float64), id="int_like_double"),
])
def test_cast_like(x, like):
    check(make_model("CastLike", [x, like], opset=19), [x, like])


def test_identity_of_input():
    check(make_model("Identity", [X]), [X])


def test_identity_of_activation():
    """Identity behind another op: the alias (no kernel) or the copy, whichever the plan takes."""
    x = randn(2, 3, 5)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x0"], ["r"]), helper.make_node("Identity", ["r"], ["y0"])],
        "g", [helper.make_tensor_value_info("x0", onnx.TensorProto.FLOAT, [2, 3, 5])],
        [helper.make_tensor_value_info("y0", onnx.TensorProto.FLOAT, [2, 3, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    check(model, [x])


@pytest.mark.parametrize("inputs,attrs,opset,consts,n_outputs", [
    pytest.param([X], {}, 7, (), 1, id="v7"),
    pytest.param([X], {"ratio": 0.3}, 7, (), 2, id="v7_mask"),
    pytest.param([X], {}, 10, (), 2, id="v10_mask"),
    pytest.param([X, np.array(0.3, np.float32)], {}, 13, (1,), 2, id="v13_ratio"),
    pytest.param([X, np.array(0.3, np.float32), np.array(False)], {}, 13, (1, 2), 2,
                 id="v13_training_false"),
    pytest.param([X, np.array(0.3, np.float32), np.array(False)], {}, 22, (), 2,
                 id="v22_runtime_flags"),
    pytest.param([X, np.array(0.0, np.float32), np.array(True)], {}, 22, (1, 2), 2,
                 id="v22_training_ratio0"),
])
def test_dropout(inputs, attrs, opset, consts, n_outputs):
    """y = x exactly and the mask all ones. Checked directly: for opset < 12 onnxruntime writes
    an all-False mask and onnx.reference an all-True one (of dtype bool even where ONNX says
    T); from opset 12 both give all True, which is what we give for every version."""
    model = make_model("Dropout", inputs, attrs, opset, consts=consts, n_outputs=n_outputs)
    outs = tr_onnx.InferenceSession(model).run(None, feed_of(model, inputs))
    np.testing.assert_array_equal(outs[0], inputs[0])
    if n_outputs == 2:
        assert outs[1].dtype == (np.float32 if opset < 10 else np.bool_)
        assert outs[1].shape == inputs[0].shape and np.all(outs[1] == 1)


def test_dropout_training_mode_is_refused():
    inputs = [X, np.array(0.3, np.float32), np.array(True)]
    model = make_model("Dropout", inputs, {}, 13, consts=(1, 2))
    with pytest.raises(tr_onnx.UnsupportedModelError, match="training-mode Dropout"):
        tr_onnx.InferenceSession(model).run(None, feed_of(model, inputs))


@pytest.mark.parametrize("pre_pool", [False, True], ids=["plain", "padded_nhwc"])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_seeded_training_dropout_draws_onnx_references_mask(dtype, ratio, pre_pool):
    """A training-mode Dropout with a seed, outside the training session: onnx.reference's
    mask (NumPy's RandomState(seed) uniforms in x's logical order) and scale, on every run;
    through a padded channels-last input too. (onnx.reference computes the scale in the
    ratio's type, float32 here; ours in float64: hence the tolerances, not equality. Its
    float16 result comes out float32, promoted by that scale: compared in x's type.)"""
    x = randn(2, 5, 4, 3, dtype=dtype)
    inputs = [x, np.array(ratio, np.float32), np.array(True)]
    model = make_model("Dropout", inputs, {"seed": 7}, 22, consts=(1, 2), n_outputs=2,
                       pre_pool=pre_pool)
    sess = tr_onnx.InferenceSession(model, channel_align=8)
    expected = ReferenceEvaluator(model).run(None, feed_of(model, inputs))
    expected[0] = expected[0].astype(dtype)
    for _ in range(2):
        ours = sess.run(None, feed_of(model, inputs))
        assert_same(ours[0], expected[0], F16 if dtype == np.float16 else F32, "y")
        assert_same(ours[1], expected[1], {}, "mask")
    assert 0 < expected[1].mean() < 1


def test_dropout_runtime_training_flag_specialises():
    """A graph-input training_mode is a plan-time constant: False runs, True is refused."""
    inputs = [X, np.array(0.3, np.float32), np.array(False)]
    model = make_model("Dropout", inputs, {}, 13)
    sess = tr_onnx.InferenceSession(model)
    np.testing.assert_array_equal(sess.run(None, feed_of(model, inputs))[0], X)
    with pytest.raises(tr_onnx.UnsupportedModelError, match="training-mode Dropout"):
        sess.run(None, feed_of(model, [X, inputs[1], np.array(True)]))


# ---- channels-last, padded inputs (through a 1x1 MaxPool) --------------------------------------

HAS_MAXPOOL = default_registry().lookup("", "MaxPool", 12, "numpy") is not None
FM = randn(2, 5, 4, 3)  # C=5: padded to 8
FM13 = randn(1, 13, 3, 2)
FM_CHUNKED = randn(2, 13, 30, 30)  # more elements than a chunk (ops/elementwise.py CHUNK)
PADDED_CASES = [
    ("erf_chunked", "Erf", [FM_CHUNKED], {}, 17),
    ("gelu_chunked", "Gelu", [FM_CHUNKED], {}, 20),
    ("sigmoid_chunked", "Sigmoid", [FM_CHUNKED], {}, 17),
    ("mish_chunked", "Mish", [FM_CHUNKED], {}, 18),
    ("relu", "Relu", [FM], {}, 17),
    ("sigmoid", "Sigmoid", [FM13], {}, 17),
    ("gelu", "Gelu", [FM], {}, 20),
    ("softplus", "Softplus", [FM], {}, 17),
    ("mish", "Mish", [FM13], {}, 18),
    ("hardswish", "HardSwish", [FM], {}, 17),
    ("selu", "Selu", [FM], {}, 17),
    ("erf", "Erf", [FM13], {}, 17),
    ("clip", "Clip", [FM, SCALAR_LO, SCALAR_HI], {}, 13),
    ("add_rank1", "Add", [FM, randn(3)], {}, 17),
    ("mul_channel", "Mul", [FM, randn(5, 1, 1)], {}, 17),
    ("sub_rank3", "Sub", [FM, randn(5, 4, 1)], {}, 17),
    ("prelu_channel", "PRelu", [FM, randn(5, 1, 1)], {}, 17),
    ("div_same", "Div", [FM, uniform(1, 2, 2, 5, 4, 3)], {}, 17),
    ("greater", "Greater", [FM, randn(3)], {}, 17),
    ("sum", "Sum", [FM, randn(5, 1, 1), randn(2, 5, 4, 3)], {}, 13),
    ("max", "Max", [FM, randn(3)], {}, 13),
    ("where", "Where", [FM > 0, FM, randn(5, 1, 1)], {}, 16),
    ("cast", "Cast", [FM], {"to": onnx.TensorProto.FLOAT16}, 13),
    ("identity", "Identity", [FM], {}, 17),
    ("dropout", "Dropout", [FM], {}, 13),
]


def channels_last_padded(op, inputs, attrs, opset):
    """The op reads a channels-last feature map with C padded to 8: same results, and no
    padded lane of any tensor is written."""
    if op == "Where":  # the feature map is input 1 there: pool it
        inputs = [inputs[1], inputs[0], inputs[2]]
        model = _where_after_pool(inputs)
    else:
        model = make_model(op, inputs, attrs, opset, consts=tuple(range(1, len(inputs))),
                           pre_pool=True)
    tol = F16 if op == "Cast" else F32
    sess, feed = check(model, inputs, tol, channel_align=8)
    plan = sess.plan_for(feed)
    assert plan.layout.channels_last > 0
    for t in plan.memory.tensors.values():
        assert pad_lanes_are_zero(plan.executor.arena, t), t.name


# Without MaxPool there is no channels-last input to give: the cases are not generated at all
# (rather than skipped), so the report shows no skip that is not real.
if HAS_MAXPOOL:
    test_channels_last_padded = pytest.mark.parametrize(
        "op,inputs,attrs,opset", [pytest.param(*c[1:], id=c[0]) for c in PADDED_CASES])(
        channels_last_padded)


def _where_after_pool(inputs):
    x, cond, other = inputs
    graph = helper.make_graph(
        [helper.make_node("MaxPool", ["x0"], ["p0"], kernel_shape=[1, 1]),
         helper.make_node("Where", ["x1", "p0", "x2"], ["y0"])],
        "g", [helper.make_tensor_value_info("x0", onnx.TensorProto.FLOAT, list(x.shape)),
              helper.make_tensor_value_info("x1", onnx.TensorProto.BOOL, list(cond.shape))],
        [helper.make_tensor_value_info("y0", onnx.TensorProto.FLOAT, list(x.shape))],
        initializer=[onnx.numpy_helper.from_array(other, "x2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


# ---- registration -----------------------------------------------------------------------------

def _schema_versions(op):
    return sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                   if s.name == op and s.domain == ""})


ALL_OPS = sorted(
    "Relu LeakyRelu Elu Selu Celu PRelu ThresholdedRelu Sigmoid HardSigmoid HardSwish Tanh Erf "
    "Gelu Softplus Softsign Mish Exp Log Sqrt Reciprocal Neg Abs Sign Floor Ceil Round Sin Cos "
    "Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh IsNaN IsInf Not Add Sub Mul Div Pow Mod "
    "BitShift Equal Less LessOrEqual Greater GreaterOrEqual And Or Xor BitwiseAnd BitwiseOr "
    "BitwiseXor BitwiseNot Sum Mean Max Min Clip Where Cast CastLike Identity Dropout "
    "Shrink".split())


@pytest.mark.parametrize("op", ALL_OPS)
def test_every_schema_version_registered(op):
    registry = default_registry()
    assert registry.registered_versions("", op, "numpy") == _schema_versions(op)


BIG_X = randn(100, 1000)


@pytest.mark.parametrize("op,inputs,opset", [
    pytest.param("Gelu", [BIG_X], 20, id="gelu"),
    pytest.param("Erf", [BIG_X], 17, id="erf"),
    pytest.param("Sigmoid", [BIG_X], 17, id="sigmoid"),
    pytest.param("Mish", [BIG_X], 18, id="mish"),
    pytest.param("Selu", [BIG_X], 17, id="selu"),
    pytest.param("Shrink", [BIG_X], 17, id="shrink"),
    pytest.param("PRelu", [BIG_X, randn(1000)], 17, id="prelu"),
    pytest.param("Div", [ints(-99, 99, 100, 1000), nonzero_ints(9, 1000)], 17, id="div_int32"),
    pytest.param("Clip", [BIG_X, SCALAR_LO, SCALAR_HI], 13, id="clip_runtime"),
    pytest.param("Mean", [BIG_X, randn(1000), randn(100, 1)], 13, id="mean"),
])
def test_run_allocates_no_output_sized_arrays(op, inputs, opset):
    """Intermediates live in plan-time workspace: a step makes no array anywhere near the
    output's size (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    model = make_model(op, inputs, opset=opset)
    sess = tr_onnx.InferenceSession(model)
    feed = feed_of(model, inputs)
    sess.run(None, feed)
    executor = sess.plan_for(feed).executor
    tracemalloc.start()
    executor.run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # numpy's own casting buffer (8192 elements of float64: 64 kB, for float32 -> float64
    # loops) is the one transient left; the output is 400 kB
    assert peak < inputs[0].nbytes // 4
