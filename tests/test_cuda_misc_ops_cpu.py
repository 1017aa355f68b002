"""The cuda bindings of the ONNX training ops (``ai.onnx.preview.training`` Adam, Momentum,
Adagrad: backends/cuda/ops/optimizers.py), the random draws (backends/cuda/ops/random.py,
kernels/random.cu) and the quantization family (backends/cuda/ops/quantize.py,
kernels/quantize.cu), checked without a GPU: single-node models run on ``backend="cuda"``
through the host emulator (the kernels' g++ build) against ``backend="numpy"``, launch
arguments checked against the kernels' C signatures; then a QAT model trained three SGD steps
on both backends.

Tolerances, per kernel:

* Adam / Momentum / Adagrad: the numpy kernel's float32 sequence operation by operation (the
  Python scalars rounded to float32 as NumPy's weak scalars are; no FMA), so bit-exact; also
  equal to onnx.reference's ops (rtol 1e-6: it evaluates some steps in float64).
* RandomDraw uniforms (any low/high, float32/float16/float64 out) and Bernoulli draws (any p
  type, bool/int/float out): NumPy's Philox stream and NumPy's double arithmetic, bit-exact.
* RandomDraw normals: NumPy's ziggurat cannot be placed in parallel (a variable number of
  draws per value), so the device uses Box-Muller on the same stream: a different sample of
  the same distribution, tested statistically on 2^16 draws: |mean - mu| < 5 scale/sqrt(n),
  |std/scale - 1| < 5/sqrt(2n), Kolmogorov-Smirnov distance to the normal CDF below 2/sqrt(n)
  (each a 5-sigma bound, or p < 1e-3 for KS), and each step's draws differ.
* QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and the gradients' gx: NumPy's
  float32 (or x's half type for x / scale) sequence, so bit-exact. The scale gradients sum in
  double where NumPy sums float32 pairwise: within (log2(n) + 1) eps of sum |term|.
* MatMulInteger, ConvInteger: exact integer sums (int64 on the device, float64 in NumPy), so
  bit-exact; QLinearMatMul, QLinearConv requantize those in NumPy's order (float32 multiplier,
  double product), bit-exact.
* training (QAT model): losses and parameters after three SGD steps rtol 1e-5 / atol 1e-7
  (the Conv and Gemm run as their numpy kernels in the emulator, the quantization kernels add
  no error).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of, typed_outputs
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

PREVIEW = "ai.onnx.preview.training"
ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
        np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
        np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.bool_): TensorProto.BOOL}
SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.float64): "f64"}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("misc_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def single_node(op: str, feeds: dict, consts: dict, attrs: dict, outputs, opset: int = 21,
                domain: str = "", order: list[str] | None = None,
                out_types: dict | None = None) -> onnx.ModelProto:
    """A model of one ``op`` node over graph inputs ``feeds`` and initializers ``consts``
    (inputs in ``order``, default feeds then consts; '' for an absent one); outputs typed by
    ``out_types`` ({name: (elem type, shape)}) or else by ONNX shape inference."""
    inputs = [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
              for k, v in feeds.items()]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    node = helper.make_node(op, order or [*feeds, *consts], outputs, domain=domain, **attrs)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain
                                                 else [])
    if out_types is not None:
        outs = [helper.make_tensor_value_info(o, *out_types[o]) for o in outputs]
        graph = helper.make_graph([node], op, inputs, outs, inits)
        return helper.make_model(graph, opset_imports=opsets)
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=opsets)
    return typed_outputs(model, outputs)


def run_cuda(model, feeds, device, signatures, runs: int = 1):
    """(the cuda session's outputs of its last run, its plan's kernel names), the launches
    checked against the kernels' C signatures."""
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    for _ in range(runs):
        got = sess.run(None, feeds)
    plan = sess.plan_for(feeds)
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    return got, [c.kernel.name for c in launches]


def run_numpy(model, feeds, runs: int = 1):
    sess = tr_onnx.InferenceSession(model)
    for _ in range(runs):
        got = sess.run(None, feeds)
    return got


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def assert_bits_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(bits(g), bits(w))


# ---- ai.onnx.preview.training Adam / Momentum / Adagrad ------------------------------------

PREVIEW_OPS = [  # op, attributes, tensors per tuple (X, G, V[, H]), tuples, step T
    ("Adam", {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-7, "norm_coefficient": 0.01,
              "norm_coefficient_post": 0.02}, 4, 2, 3),
    ("Adam", {}, 4, 1, 0),
    ("Momentum", {"alpha": 0.9, "beta": 0.1, "norm_coefficient": 0.001, "mode": "standard"},
     3, 2, 2),
    ("Momentum", {"alpha": 0.95, "beta": 1.0, "norm_coefficient": 0.0, "mode": "nesterov"},
     3, 1, 5),
    ("Momentum", {"alpha": 0.5, "beta": 0.3, "norm_coefficient": 0.1, "mode": "standard"},
     3, 1, 0),
    ("Adagrad", {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.001}, 3, 3, 4),
    ("Adagrad", {}, 3, 1, 0),
]
PREVIEW_IDS = ["adam-2-tuples", "adam-defaults-t0", "momentum-2", "momentum-nesterov",
               "momentum-t0", "adagrad-3-tuples", "adagrad-defaults"]
SHAPES = [(5, 7), (33,), (2, 3, 4)]


def preview_case(op, attrs, per, count, step):
    rng = np.random.default_rng(7)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(step, np.int64)}
    names = "XGVH"[:per]
    for name in names:
        for i in range(count):
            x = rng.standard_normal(SHAPES[i]).astype(np.float32)
            feeds[f"{name}{i}"] = np.abs(x) if name == "H" or (name == "V" and op == "Adagrad") \
                else x
    outs = [f"{name}{i}_new" for name in names if name != "G" for i in range(count)]
    types = {o: (TensorProto.FLOAT, feeds[o[:-4]].shape) for o in outs}
    model = single_node(op, feeds, {}, attrs, outs, domain=PREVIEW, out_types=types)
    return model, feeds


@pytest.mark.parametrize("op, attrs, per, count, step", PREVIEW_OPS, ids=PREVIEW_IDS)
def test_preview_training_op_equals_numpy_bit_for_bit(device, signatures, op, attrs, per,
                                                      count, step):
    model, feeds = preview_case(op, attrs, per, count, step)
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_preview_{op.lower()}_f32"] * count


@pytest.mark.parametrize("op, attrs, per, count, step",
                         [PREVIEW_OPS[0], PREVIEW_OPS[3], PREVIEW_OPS[5]],
                         ids=["adam", "momentum-nesterov", "adagrad"])
def test_preview_training_op_equals_onnx_reference(device, signatures, op, attrs, per, count,
                                                   step):
    from onnx.reference import ReferenceEvaluator

    model, feeds = preview_case(op, attrs, per, count, step)
    want = ReferenceEvaluator(model).run(None, feeds)
    got, _ = run_cuda(model, feeds, device, signatures)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


# ---- RandomDraw ----------------------------------------------------------------------------

def random_draw(op: str, shape, out_type, attrs: dict, p_dtype=None):
    """(p?, step) -> RandomDraw(op) -> y, the training form of a random op."""
    inputs = [helper.make_tensor_value_info("step", TensorProto.INT64, [])]
    if p_dtype is not None:
        inputs.insert(0, helper.make_tensor_value_info("p", ELEM[np.dtype(p_dtype)], shape))
    node = helper.make_node("RandomDraw", [i.name for i in inputs], ["y"], domain="ai.tr_onnx",
                            op=op, **attrs)
    graph = helper.make_graph([node], "draw", inputs,
                              [helper.make_tensor_value_info("y", ELEM[np.dtype(out_type)],
                                                             shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("ai.tr_onnx", 1)])


UNIFORMS = [  # op, shape, output type, attributes, step
    ("RandomUniform", (4, 33), np.float32, {"key": 11, "low": -2.0, "high": 3.5}, 0),
    ("RandomUniformLike", (257,), np.float64, {"key": -5}, 9),
    ("RandomUniform", (3, 5, 7), np.float16, {"key": 3, "low": 0.25, "high": 0.5}, 2**40),
]


@pytest.mark.parametrize("op, shape, out_type, attrs, step", UNIFORMS,
                         ids=["f32-low-high", "f64-key-above-2^63", "f16"])
def test_random_draw_uniforms_equal_numpy_bit_for_bit(device, signatures, op, shape, out_type,
                                                       attrs, step):
    model = random_draw(op, shape, out_type, attrs)
    feeds = {"step": np.array(step, np.int64)}
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_random_uniform_{SUFFIX[np.dtype(out_type)]}"]


BERNOULLI = [  # shape, p type, output type
    ((5, 13), np.float32, np.float32),
    ((66,), np.float64, np.bool_),
    ((2, 3, 11), np.float16, np.int64),
    ((7, 9), np.float32, np.int32),
    ((31,), np.float32, np.uint8),
]


@pytest.mark.parametrize("shape, p_type, out_type", BERNOULLI,
                         ids=["f32-f32", "f64-bool", "f16-i64", "f32-i32", "f32-u8"])
def test_random_draw_bernoulli_equals_numpy_bit_for_bit(device, signatures, shape, p_type,
                                                        out_type):
    p = np.random.default_rng(3).random(shape).astype(p_type)
    p.reshape(-1)[:3] = [0.0, 1.0, 0.5]
    model = random_draw("Bernoulli", shape, out_type, {"key": 77}, p_dtype=p_type)
    for step in (0, 5):
        feeds = {"p": p, "step": np.array(step, np.int64)}
        want = run_numpy(model, feeds)
        got, names = run_cuda(model, feeds, device, signatures)
        assert_bits_equal(got, want)
        assert len(np.unique(want[0])) == 2  # ones and zeros both drawn
    width = np.dtype(out_type).itemsize
    assert names == [f"tr_random_bernoulli_{SUFFIX[np.dtype(p_type)]}_b{width}"]


@pytest.mark.parametrize("mean, scale, out_type",
                         [(0.0, 1.0, np.float64), (1.5, 0.25, np.float32)],
                         ids=["standard-f64", "shifted-f32"])
def test_random_draw_normals_have_the_normal_distribution(device, signatures, mean, scale,
                                                          out_type):
    from scipy.stats import kstest

    n = 1 << 16
    model = random_draw("RandomNormalLike", (n,), out_type, {"key": 5, "mean": mean,
                                                              "scale": scale})
    draws = []
    for step in (0, 1):
        got, names = run_cuda(model, {"step": np.array(step, np.int64)}, device, signatures)
        draws.append(got[0].astype(np.float64))
    assert names == [f"tr_random_normal_{SUFFIX[np.dtype(out_type)]}"]
    z = (draws[0] - mean) / scale
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.std() - 1) < 5 / np.sqrt(2 * n)
    assert kstest(z, "norm").statistic < 2 / np.sqrt(n)
    assert not np.array_equal(draws[0], draws[1])


# ---- QuantizeLinear / DequantizeLinear -----------------------------------------------------

Q_SUFFIX = {np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8", np.dtype(np.int16): "i16",
            np.dtype(np.uint16): "u16", np.dtype(np.int32): "i32"}
ELEM.update({np.dtype(np.int16): TensorProto.INT16, np.dtype(np.uint16): TensorProto.UINT16})


def quant_params(shape, axis, block, qtype, zp: bool, seed: int = 0):
    """(scale, zero point or None) per tensor (axis None), per axis or blocked."""
    rng = np.random.default_rng(seed)
    if axis is None:
        pshape = ()
    elif block:
        axis %= len(shape)
        pshape = tuple(-(-d // block) if k == axis else d for k, d in enumerate(shape))
    else:
        pshape = (shape[axis],)
    scale = (rng.random(pshape) * 0.05 + 0.01).astype(np.float32)
    if not zp:
        return scale, None
    info = np.iinfo(qtype)
    lo, hi = max(info.min, -20), min(info.max, 20)
    return scale, rng.integers(lo, hi + 1, pshape).astype(qtype)


def qdq_attrs(axis, block) -> dict:
    attrs = {} if axis is None else {"axis": axis}
    return {**attrs, "block_size": block} if block else attrs


QUANTIZE = [  # x shape, axis (None: per tensor), block_size, quantized type, zero point, x type
    ((2, 3, 4, 5), None, 0, np.int8, True, np.float32),
    ((2, 3, 4, 5), 1, 0, np.uint8, True, np.float32),
    ((6, 3, 3, 3), 0, 0, np.int8, False, np.float32),
    ((2, 5, 4), 1, 2, np.int8, True, np.float32),
    ((3, 7), -1, 3, np.uint8, False, np.float32),
    ((4, 9), 1, 0, np.int16, True, np.float32),
    ((4, 9), None, 0, np.uint16, True, np.float16),
    ((33,), 0, 0, np.int8, True, np.float16),
]
QUANTIZE_IDS = ["tensor-i8", "axis1-u8", "axis0-i8-no-zp", "blocked-i8", "blocked-last-u8",
                "axis-i16", "tensor-u16-f16-x", "1d-i8-f16-x"]


def quantize_input(shape, x_type, seed=1):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    x.reshape(-1)[:4] = [0.0, -0.0, 6e4, -6e4]  # saturating both ways
    return x.astype(x_type)


@pytest.mark.parametrize("shape, axis, block, qtype, zp, x_type", QUANTIZE, ids=QUANTIZE_IDS)
def test_quantize_linear_equals_numpy_bit_for_bit(device, signatures, shape, axis, block, qtype,
                                                  zp, x_type):
    x = quantize_input(shape, x_type)
    scale, zero = quant_params(shape, axis, block, qtype, zp)
    scale = scale.astype(x_type)  # x / scale in x's type
    if zero is not None:
        # put values exactly on half steps: rounding half to even decides them
        halves = np.array([0.5, 1.5, 2.5, -2.5]) * scale.reshape(-1)[0]
        x.reshape(-1)[4:8] = halves.astype(x_type)
    consts = {"scale": scale, **({"zp": zero} if zero is not None else {})}
    out = {} if zero is not None else {"output_dtype": ELEM[np.dtype(qtype)]}
    model = single_node("QuantizeLinear", {"x": x}, consts, {**qdq_attrs(axis, block), **out},
                        ["y"], opset=21)
    want = run_numpy(model, {"x": x})
    got, names = run_cuda(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_quantize_{SUFFIX[np.dtype(x_type)]}_{Q_SUFFIX[np.dtype(qtype)]}"]
    info = np.iinfo(qtype)
    assert want[0].min() == info.min and want[0].max() == info.max


DEQUANTIZE = [  # x shape, axis, block_size, quantized type, zero point, scale/output type
    ((2, 3, 4, 5), None, 0, np.int8, True, np.float32),
    ((2, 3, 4, 5), 1, 0, np.uint8, True, np.float32),
    ((6, 3, 3, 3), 0, 0, np.int8, False, np.float32),
    ((2, 5, 4), 1, 2, np.int8, True, np.float32),
    ((4, 9), 1, 0, np.uint16, True, np.float16),
    ((17,), None, 0, np.int32, False, np.float32),
]
DEQUANTIZE_IDS = ["tensor-i8", "axis1-u8", "axis0-i8-no-zp", "blocked-i8", "axis-u16-f16",
                  "i32"]


@pytest.mark.parametrize("shape, axis, block, qtype, zp, s_type", DEQUANTIZE, ids=DEQUANTIZE_IDS)
def test_dequantize_linear_equals_numpy_bit_for_bit(device, signatures, shape, axis, block,
                                                    qtype, zp, s_type):
    info = np.iinfo(qtype)
    x = np.random.default_rng(2).integers(info.min, info.max, shape, endpoint=True).astype(qtype)
    scale, zero = quant_params(shape, axis, block, qtype, zp)
    consts = {"scale": scale.astype(s_type), **({"zp": zero} if zero is not None else {})}
    model = single_node("DequantizeLinear", {"x": x}, consts, qdq_attrs(axis, block), ["y"],
                        opset=21)
    want = run_numpy(model, {"x": x})
    got, names = run_cuda(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_dequantize_{Q_SUFFIX[np.dtype(qtype)]}_{SUFFIX[np.dtype(s_type)]}"]


DYNAMIC = {"mixed": lambda x: x, "positive": np.abs, "negative": lambda x: -np.abs(x) - 1,
           "zeros": np.zeros_like}


@pytest.mark.parametrize("shape", [(5, 7), (1000,)], ids=["2d", "1000"])
@pytest.mark.parametrize("values", list(DYNAMIC))
def test_dynamic_quantize_linear_equals_numpy_bit_for_bit(device, signatures, shape, values):
    x = DYNAMIC[values](np.random.default_rng(4).standard_normal(shape).astype(np.float32) * 2)
    model = single_node("DynamicQuantizeLinear", {"x": x}, {}, {}, ["y", "scale", "zp"])
    want = run_numpy(model, {"x": x})
    got, names = run_cuda(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert names == ["tr_dynamic_quantize_range", "tr_dynamic_quantize"]


# ---- QuantizeLinearGrad / DequantizeLinearGrad ---------------------------------------------

def grad_node(op: str, gy, x, scale, zero, attrs: dict, with_scale: bool):
    """(gy, x, scale, zp?) -> op -> (gx, gscale?), a backward op of the quantize family."""
    feeds = {"gy": gy, "x": x, "scale": scale, **({"zp": zero} if zero is not None else {})}
    inputs = [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
              for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info("gx", ELEM[np.dtype(gy.dtype)], x.shape)]
    if with_scale:
        outs.append(helper.make_tensor_value_info("gscale", TensorProto.FLOAT, scale.shape))
    node = helper.make_node(op, list(feeds), [o.name for o in outs], domain="ai.tr_onnx",
                            **attrs)
    graph = helper.make_graph([node], op, inputs, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("ai.tr_onnx", 1)])
    return model, feeds


def assert_scale_grad_close(got, want, terms):
    """NumPy sums the float32 terms pairwise, the kernel in double then rounds once: within
    (log2(n) + 1) eps of sum |term| (pairwise summation's bound plus the final rounding;
    ``terms`` bounds the terms of every scale)."""
    eps = float(np.finfo(np.float32).eps)
    bound = eps * (np.log2(max(terms.size, 2)) + 1) * np.abs(terms).sum()
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), bound)


GRADS = [  # x shape, axis, block_size, quantized type, zero point, float type, scale gradient
    ((2, 3, 4, 5), None, 0, np.int8, True, np.float32, True),
    ((2, 3, 4, 5), 1, 0, np.uint8, True, np.float32, True),
    ((6, 3, 3, 3), 0, 0, np.int8, False, np.float32, True),
    ((2, 5, 4), 1, 2, np.int8, True, np.float32, True),
    ((4, 9), 1, 0, np.int16, True, np.float16, False),
    ((300,), None, 0, np.uint8, True, np.float32, False),
]
GRAD_IDS = ["tensor-i8", "axis1-u8", "axis0-no-zp", "blocked", "axis-i16-f16", "1d-no-gscale"]


@pytest.mark.parametrize("shape, axis, block, qtype, zp, ftype, with_scale", GRADS, ids=GRAD_IDS)
def test_quantize_linear_grad_equals_numpy(device, signatures, shape, axis, block, qtype, zp,
                                           ftype, with_scale):
    """gx bit-exact; gscale within the float32 rounding of NumPy's pairwise sum."""
    x = quantize_input(shape, ftype)
    scale, zero = quant_params(shape, axis, block, qtype, zp)
    gy = np.random.default_rng(5).standard_normal(shape).astype(ftype)
    attrs = {"axis": (axis or 0) % len(shape), "block_size": block,
             "to": ELEM[np.dtype(qtype)]}
    model, feeds = grad_node("QuantizeLinearGrad", gy, x, scale.astype(ftype), zero, attrs,
                             with_scale)
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got[:1], want[:1])
    assert 0 < np.count_nonzero(want[0]) < want[0].size  # clipped and passed elements both
    assert names == [f"tr_quantize_grad_{SUFFIX[np.dtype(ftype)]}_{Q_SUFFIX[np.dtype(qtype)]}"
                     ] + (["tr_quantize_grad_scale"] if with_scale else [])
    if with_scale:
        terms = want[0].astype(np.float64) * x / scale.min()  # each term's bound
        assert_scale_grad_close(got[1], want[1], terms)


@pytest.mark.parametrize("shape, axis, block, qtype, zp, ftype, with_scale", GRADS, ids=GRAD_IDS)
def test_dequantize_linear_grad_equals_numpy(device, signatures, shape, axis, block, qtype, zp,
                                             ftype, with_scale):
    """gx bit-exact; gscale within the float32 rounding of NumPy's pairwise sum."""
    info = np.iinfo(qtype)
    x = np.random.default_rng(2).integers(info.min, info.max, shape, endpoint=True).astype(qtype)
    scale, zero = quant_params(shape, axis, block, qtype, zp)
    gy = np.random.default_rng(5).standard_normal(shape).astype(ftype)
    attrs = {"axis": (axis or 0) % len(shape), "block_size": block}
    model, feeds = grad_node("DequantizeLinearGrad", gy, x, scale.astype(ftype), zero, attrs,
                             with_scale)
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got[:1], want[:1])
    assert names == [f"tr_dequantize_grad_{SUFFIX[np.dtype(ftype)]}"] + (
        [f"tr_dequantize_grad_scale_{Q_SUFFIX[np.dtype(qtype)]}"] if with_scale else [])
    if with_scale:
        assert_scale_grad_close(got[1], want[1], gy.astype(np.float64) * x)


# ---- training: a QAT model, three SGD steps on cuda (emulated) against numpy -------------------

B, CIN, HW, COUT, CLASSES = 4, 3, 6, 6, 5


def qat_model(per_channel: bool = False) -> onnx.ModelProto:
    """A torch QAT export's shape: x -> fake-quant (uint8, per tensor) -> Conv whose weight is
    fake-quantized per output channel (int8, symmetric) -> Relu -> fake-quant (per tensor, or
    ``per_channel``: axis 1 of the channels-last activations, COUT padded to 8 lanes) -> global
    pool -> Gemm."""
    rng = np.random.default_rng(11)
    w = (0.3 * rng.standard_normal((COUT, CIN, 3, 3))).astype(np.float32)
    w_scale = (np.abs(w).reshape(COUT, -1).max(axis=1) / 127).astype(np.float32)
    inits = {
        "w": w, "b": np.zeros(COUT, np.float32), "w_scale": w_scale,
        "w_zp": np.zeros(COUT, np.int8),
        "x_scale": np.array(0.02, np.float32), "x_zp": np.array(128, np.uint8),
        "a_scale": (np.linspace(0.005, 0.02, COUT) if per_channel else np.array(0.01)).astype(
            np.float32),
        "a_zp": (np.arange(COUT) % 3 if per_channel else np.array(0)).astype(np.uint8),
        "fc": (0.3 * rng.standard_normal((COUT, CLASSES))).astype(np.float32),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["input", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xf"]),
        helper.make_node("QuantizeLinear", ["w", "w_scale", "w_zp"], ["wq"], axis=0),
        helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wf"], axis=0),
        helper.make_node("Conv", ["xf", "wf", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "a_scale", "a_zp"], ["rq"], axis=1),
        helper.make_node("DequantizeLinear", ["rq", "a_scale", "a_zp"], ["rf"], axis=1),
        helper.make_node("GlobalAveragePool", ["rf"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes, "qat", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                     [B, CIN, HW, HW])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [B, CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def train_qat(backend, per_channel, **kw):
    sess = tr_onnx.TrainingSession(qat_model(per_channel), loss="cross_entropy",
                                   optimizer=SGD(lr=0.1), backend=backend, **kw)
    rng = np.random.default_rng(12)
    losses = [sess.train_step({"input": rng.random((B, CIN, HW, HW), np.float32) * 4 - 2},
                              rng.integers(0, CLASSES, (B,))) for _ in range(3)]
    return sess, losses


@pytest.mark.parametrize("per_channel", [False, True],
                         ids=["per-tensor-activations", "per-channel-padded-activations"])
def test_a_qat_model_trains_three_sgd_steps_on_cuda_as_on_numpy(device, signatures,
                                                                per_channel):
    ref, want = train_qat("numpy", per_channel)
    sess, got = train_qat(CudaBackend(device=device), per_channel)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() and {"w", "fc"} <= b.keys()
    assert not np.array_equal(b["w"], numpy_helper.to_array(qat_model().graph.initializer[0]))
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    names = {c.kernel.name for c in launches}
    assert {"tr_quantize_f32_i8", "tr_quantize_f32_u8", "tr_dequantize_i8_f32",
            "tr_dequantize_u8_f32", "tr_quantize_grad_f32_i8", "tr_quantize_grad_f32_u8",
            "tr_dequantize_grad_f32"} <= names
    # the activations' fake quantization reads channels-last [B, H, W, 8] with 6 channels
    (act,) = [c for c in launches if c.kernel.name == "tr_quantize_f32_u8" and c.args[10] == 8]
    assert (int(act.args[5]), int(act.args[11])) == (int(per_channel), COUT)


# ---- integer contractions ------------------------------------------------------------------

def int8(shape, qtype, seed):
    info = np.iinfo(qtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape,
                                                endpoint=True).astype(qtype)


MATMUL_INTEGER = [  # a shape, b shape, a type, b type, a zero point shape, b zero point shape
    ((5, 7), (7, 3), np.uint8, np.int8, (), ()),
    ((2, 4, 6), (6, 5), np.int8, np.int8, (4,), (5,)),
    ((3, 2, 4), (3, 4, 2), np.uint8, np.uint8, None, None),
]


@pytest.mark.parametrize("a_shape, b_shape, a_type, b_type, a_zp, b_zp", MATMUL_INTEGER,
                         ids=["2d-scalar-zps", "batched-row-column-zps", "batched-both-no-zp"])
def test_matmul_integer_equals_numpy(device, signatures, a_shape, b_shape, a_type, b_type,
                                     a_zp, b_zp):
    feeds = {"a": int8(a_shape, a_type, 1), "b": int8(b_shape, b_type, 2)}
    consts = {}
    if a_zp is not None:
        consts = {"a_zp": int8(a_zp, a_type, 3), "b_zp": int8(b_zp, b_type, 4)}
    model = single_node("MatMulInteger", feeds, consts, {}, ["y"], opset=10)
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_matmul_integer_{Q_SUFFIX[np.dtype(a_type)]}_"
                     f"{Q_SUFFIX[np.dtype(b_type)]}"]


@pytest.mark.parametrize("b_per_column", [False, True], ids=["per-tensor", "b-per-column"])
@pytest.mark.parametrize("y_type", [np.uint8, np.int8])
def test_qlinear_matmul_equals_numpy(device, signatures, b_per_column, y_type):
    a, b = int8((2, 5, 9), np.uint8, 1), int8((9, 4), np.int8, 2)
    b_params = (4,) if b_per_column else ()
    consts = {"a_scale": np.array(0.05, np.float32), "a_zp": np.array(128, np.uint8),
              "b_scale": (np.random.default_rng(5).random(b_params) * 0.02 + 0.01).astype(
                  np.float32),
              "b_zp": int8(b_params, np.int8, 6) // 8,
              "y_scale": np.array(0.05, np.float32), "y_zp": np.array(3, y_type)}
    order = ["a", "a_scale", "a_zp", "b", "b_scale", "b_zp", "y_scale", "y_zp"]
    model = single_node("QLinearMatMul", {"a": a, "b": b}, consts, {}, ["y"], opset=10,
                        order=order)
    want = run_numpy(model, {"a": a, "b": b})
    got, names = run_cuda(model, {"a": a, "b": b}, device, signatures)
    assert_bits_equal(got, want)
    info = np.iinfo(y_type)
    assert want[0].min() == info.min and want[0].max() == info.max  # saturated both ways
    assert names == [f"tr_qlinear_matmul_u8_i8_{Q_SUFFIX[np.dtype(y_type)]}"]


CONV_INTEGER = [  # x shape, w shape, attributes, w zero point per channel
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, False),
    ((1, 4, 9, 9), (6, 2, 3, 2), {"strides": [2, 1], "dilations": [1, 2], "group": 2}, True),
    ((2, 2, 11), (3, 2, 4), {"auto_pad": "SAME_UPPER", "strides": [3]}, True),
    ((1, 2, 4, 5, 3), (2, 2, 2, 2, 2), {"pads": [0, 1, 0, 1, 0, 1]}, False),
]
CONV_IDS = ["2d-pads", "2d-strides-dilations-groups", "1d-same-upper", "3d"]


@pytest.mark.parametrize("x_shape, w_shape, attrs, per_channel", CONV_INTEGER, ids=CONV_IDS)
def test_conv_integer_equals_numpy(device, signatures, x_shape, w_shape, attrs, per_channel):
    x, w = int8(x_shape, np.uint8, 1), int8(w_shape, np.int8, 2)
    consts = {"w": w, "x_zp": np.array(100, np.uint8),
              "w_zp": int8((w_shape[0],) if per_channel else (), np.int8, 3) // 16}
    model = single_node("ConvInteger", {"x": x}, consts, attrs, ["y"], opset=10,
                        order=["x", "w", "x_zp", "w_zp"])
    want = run_numpy(model, {"x": x})
    got, names = run_cuda(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert names == ["tr_conv_integer_u8_i8"]


@pytest.mark.parametrize("x_shape, w_shape, attrs, per_channel", CONV_INTEGER, ids=CONV_IDS)
def test_qlinear_conv_equals_numpy(device, signatures, x_shape, w_shape, attrs, per_channel):
    x, w = int8(x_shape, np.int8, 1), int8(w_shape, np.int8, 2)
    o = w_shape[0]
    params = (o,) if per_channel else ()
    consts = {"x_scale": np.array(0.05, np.float32), "x_zp": np.array(-3, np.int8), "w": w,
              "w_scale": (np.random.default_rng(5).random(params) * 0.02 + 0.01).astype(
                  np.float32),
              "w_zp": np.zeros(params, np.int8), "y_scale": np.array(0.2, np.float32),
              "y_zp": np.array(10, np.uint8),
              "bias": np.random.default_rng(6).integers(-3000, 3000, o).astype(np.int32)}
    model = single_node("QLinearConv", {"x": x}, consts, attrs, ["y"], opset=10,
                        order=["x", "x_scale", "x_zp", "w", "w_scale", "w_zp", "y_scale",
                               "y_zp", "bias"])
    want = run_numpy(model, {"x": x})
    got, names = run_cuda(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert 0 < np.count_nonzero((want[0] > 0) & (want[0] < 255)) < want[0].size
    assert names == ["tr_qlinear_conv_i8_i8_u8"]


# ---- training: random draws in a model, three SGD steps on cuda (emulated) against numpy ------

def noisy_model() -> onnx.ModelProto:
    """input -> Gemm -> h; scores = h * RandomUniformLike(h) * Bernoulli(p): the train pass
    makes both draws RandomDraw nodes counted by the step."""
    rng = np.random.default_rng(13)
    inits = {"w": (0.5 * rng.standard_normal((6, CLASSES))).astype(np.float32),
             "p": np.full((B, CLASSES), 0.7, np.float32)}
    nodes = [helper.make_node("Gemm", ["input", "w"], ["h"]),
             helper.make_node("RandomUniformLike", ["h"], ["u"], low=0.5, high=1.5),
             helper.make_node("Mul", ["h", "u"], ["hu"]),
             helper.make_node("Bernoulli", ["p"], ["keep"], dtype=TensorProto.FLOAT, seed=3.0),
             helper.make_node("Mul", ["hu", "keep"], ["scores"])]
    graph = helper.make_graph(
        nodes, "noisy", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [B, 6])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [B, CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def train_noisy(backend, **kw):
    sess = tr_onnx.TrainingSession(noisy_model(), loss="cross_entropy", optimizer=SGD(lr=0.1),
                                   backend=backend, **kw)
    rng = np.random.default_rng(14)
    losses = [sess.train_step({"input": rng.standard_normal((B, 6)).astype(np.float32)},
                              rng.integers(0, CLASSES, (B,))) for _ in range(3)]
    return sess, losses


def test_a_model_with_random_draws_trains_on_cuda_as_on_numpy(device, signatures):
    """The draws are NumPy's bit for bit, so the steps agree as a model without them would."""
    ref, want = train_noisy("numpy")
    sess, got = train_noisy(CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(sess.parameters()["w"], ref.parameters()["w"], rtol=1e-5,
                               atol=1e-7)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    assert {"tr_random_uniform_f32", "tr_random_bernoulli_f32_b4"} <= {
        c.kernel.name for c in launches}


def test_the_public_random_ops_refuse_inference_on_cuda_naming_why(device):
    """Outside training a random op counts its calls on the host: the cuda plan refuses it
    rather than draw the same numbers at every run."""
    x = np.zeros((2, 3), np.float32)
    model = single_node("RandomUniformLike", {"x": x}, {}, {"seed": 1.0}, ["y"])
    with pytest.raises(UnsupportedModelError, match="host state"):
        tr_onnx.InferenceSession(model, backend=CudaBackend(device=device)).run(None, {"x": x})


@pytest.mark.parametrize("op", ["QuantizeLinearGrad", "DequantizeLinearGrad"])
def test_a_scale_gradient_from_half_gradients_is_refused_naming_why(device, op):
    """NumPy rounds each step of the scale's gradient terms to half: not bound (gx alone is)."""
    shape = (4, 9)
    x = quantize_input(shape, np.float16) if op == "QuantizeLinearGrad" else int8(
        shape, np.int8, 2)
    gy = np.ones(shape, np.float16)
    attrs = {"axis": 1, "block_size": 0}
    if op == "QuantizeLinearGrad":
        attrs["to"] = TensorProto.INT8
    model, feeds = grad_node(op, gy, x, np.full((9,), 0.1, np.float16), None, attrs, True)
    with pytest.raises(UnsupportedModelError, match="half-precision gradients"):
        tr_onnx.InferenceSession(model, backend=CudaBackend(device=device)).run(None, feeds)
