"""The cuda bindings of the reductions (backends/cuda/ops/reduce.py, kernels/reduce.cu: every
Reduce* op, ArgMax / ArgMin, Hardmax) and of the pools that were missing (backends/cuda/ops/
pool.py, kernels/pool.cu: LpPool, LpPoolGrad; GlobalMaxPool, GlobalLpPool, GlobalMaxPoolGrad
as strided reductions), checked without a GPU: single-node models on ``backend="cuda"``
through the host emulator (the kernels' g++ build) against ``backend="numpy"``, and small CNNs
trained three SGD steps on both.

A channels-last input comes from an identity 1x1 Conv (5 channels padded to 8 by
``channel_align=8``): the reduction then reads exactly the fed values through the padded NHWC
strides, and with keepdims=1 writes a channels-last output (its padded lanes checked zero).

Tolerances, per kernel:

* Reduce* (strided kernel and the run-of-axes kernel): fp64 accumulation and fp64 math, one
  rounding at the store, so the result is within 1 ulp of the storage type of the numpy
  backend's float64 result on the same (exactly representable) inputs -- the oracle. Against
  the numpy backend in the storage dtype itself: NumPy sums float32 pairwise or sequentially
  and float16 / bfloat16 in their own precision, whose error is at most ``n`` roundings of
  the running sum for ``n`` reduced elements, so |cuda - numpy| <= (n + 1) eps * S with S the
  sum of the magnitudes of the terms (Sum, Mean: of |x|; L1, L2, SumSquare, LogSumExp, Prod:
  the result's own scale).
* ReduceMax / ReduceMin / ArgMax / ArgMin / Hardmax / GlobalMaxPool / GlobalMaxPoolGrad:
  selections, bit-exact against the numpy backend in every dtype, NaN and ties included.
* ReduceSum as column sums (the bias-gradient kernel, fp32 like NumPy's einsum): within
  n eps of the magnitude sum, as above.
* LpPool / LpPoolGrad: fp32 in NumPy's order; float32 storage with p = 1, 2 bit-exact (no pow),
  other p within 4 ulp (device powf: 2 ulp, NumPy's powf up to 1 each side); float16 /
  bfloat16 within 1 ulp of the storage type (NumPy rounds |x|^p to the storage type first).
* training: losses rtol 1e-5, parameters rtol 2e-4 / atol 1e-6 (the convolutions' backward
  runs the numpy kernels in the emulator, but the numpy plan folds gradient accumulators and
  the cuda plan does not: sums of contributions round differently; seen ~1e-7).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.dtypes import BFLOAT16, onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

FLOATS = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BFLOAT16}
MANTISSA = {"f32": (23, -126), "f16": (10, -14), "bf16": (7, -126)}  # (bits, min exponent)
SHAPE = (2, 5, 3, 4)  # C = 5: padded to 8 channels-last
REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
SELECTIONS = {"ReduceMax", "ReduceMin"}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("reduce_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def ulp(v: np.ndarray, dt: str) -> np.ndarray:
    """One unit in the last place of storage type ``dt`` at the magnitudes of float64 ``v``."""
    bits, emin = MANTISSA[dt]
    a = np.abs(np.where(np.isfinite(v), v, 0.0))
    e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), emin)
    return np.exp2(e - bits)


def eps(dt: str) -> float:
    return 2.0 ** -MANTISSA[dt][0]


def axes_inputs(op: str, opset: int) -> bool:
    return opset >= 18 or (op == "ReduceSum" and opset >= 13)


def reduce_model(op: str, axes, attrs: dict, dtype, conv: bool, opset: int = 18,
                 shape=SHAPE, out_dtype=None) -> onnx.ModelProto:
    """x -> [identity 1x1 Conv ->] ``op`` -> y; ``axes`` (None: absent) as the version takes
    them. The Conv's output equals x exactly, laid out channels-last."""
    elem = onnx_elem_type(dtype)
    nodes, inits, src = [], [], "x"
    if conv:
        c = shape[1]
        inits.append(numpy_helper.from_array(np.eye(c).reshape(c, c, 1, 1).astype(dtype), "w"))
        nodes.append(helper.make_node("Conv", ["x", "w"], ["h"]))
        src = "h"
    inputs = [src]
    if axes is not None and op.startswith("Reduce") and axes_inputs(op, opset):
        inits.append(numpy_helper.from_array(np.asarray(axes, np.int64), "axes"))
        inputs.append("axes")
    elif axes is not None:
        attrs = {**attrs, "axes": list(axes)}
    nodes.append(helper.make_node(op, inputs, ["y"], **attrs))
    graph = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_empty_tensor_value_info("y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    (y,) = [vi for vi in inferred.graph.value_info if vi.name == "y"] or \
        [o for o in inferred.graph.output]
    if not y.type.tensor_type.elem_type:
        y.type.tensor_type.elem_type = onnx_elem_type(out_dtype or dtype)
    del model.graph.output[:]
    model.graph.output.append(y)
    return model


def launches_of(plan) -> list[Launch]:
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


def run_cuda(model, x, device, signatures):
    """(the cuda session's y, its plan), launches checked against the kernels' signatures
    and y's padded lanes zero."""
    sess = tr_onnx.InferenceSession(model, backend="cuda", device=device, channel_align=8)
    (y,) = sess.run(None, {"x": x})
    plan = sess.plan_for({"x": x})
    check_launch_arguments(launches_of(plan), plan, signatures)
    assert pad_lanes_are_zero(plan.executor.device.arena, plan.memory.tensors["y"])
    return y, plan


def run_numpy(model, x):
    return tr_onnx.InferenceSession(model, backend="numpy", channel_align=8).run(
        None, {"x": x})[0]


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def assert_same_specials(got, want):
    """NaN where ``want`` is NaN, the same infinities."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(np.where(np.isinf(w), g, 0), np.where(np.isinf(w), w, 0))


def data(shape, dt: str, op: str, seed: int = 0) -> np.ndarray:
    """Standard normal values in the storage type; positive for ReduceLogSum (a log of a
    cancelling sum says nothing about the kernel)."""
    x = np.random.default_rng(seed).standard_normal(shape)
    if op == "ReduceLogSum":
        x = np.abs(x) + 0.1
    return x.astype(FLOATS[dt])


def magnitude(op: str, x64: np.ndarray, axes, keepdims, ref64) -> np.ndarray:
    """S of the module docstring: the scale NumPy's accumulation error is relative to."""
    if op in ("ReduceSum", "ReduceMean"):
        s = np.sum(np.abs(x64), axis=tuple(axes), keepdims=bool(keepdims))
        return s / max(1, math.prod(x64.shape[a] for a in axes)) if op == "ReduceMean" else s
    return np.abs(np.where(np.isfinite(ref64), ref64, 0.0))


def reduced_axes(axes, noop: int, rank: int) -> list[int]:
    if axes is None or len(axes) == 0:
        return [] if noop else list(range(rank))
    return sorted({a % rank for a in axes})


def check_reduce(op, axes, keepdims, dt, conv, device, signatures, opset=18, noop=0,
                 shape=SHAPE, x=None):
    """The checks of the module docstring for one Reduce* node; returns the cuda plan."""
    attrs = {"keepdims": keepdims}
    if noop:
        attrs["noop_with_empty_axes"] = noop
    x = data(shape, dt, op) if x is None else x
    model = reduce_model(op, axes, attrs, FLOATS[dt], conv, opset, shape)
    got, plan = run_cuda(model, x, device, signatures)
    want = run_numpy(model, x)
    x64 = x.astype(np.float64)
    ref64 = run_numpy(reduce_model(op, axes, attrs, np.float64, False, opset, shape), x64)
    assert got.dtype == want.dtype and got.shape == want.shape == ref64.shape
    if conv and keepdims and len(shape) == 4:
        assert plan.memory.tensors["y"].layout.kind == "channels_last"
    assert_same_specials(got, ref64.astype(got.dtype))
    g = got.astype(np.float64)
    finite = np.isfinite(ref64)
    err = np.abs(g - ref64)[finite]
    assert np.all(err <= ulp(ref64, dt)[finite]), f"max err {err.max()} vs exact"
    if op in SELECTIONS:
        np.testing.assert_array_equal(bits(got), bits(want))
    else:
        n = math.prod(shape[a] for a in reduced_axes(axes, noop, len(shape)))
        bound = (n + 1) * eps(dt) * magnitude(op, x64, reduced_axes(axes, noop, len(shape)),
                                              keepdims, ref64) + ulp(ref64, dt)
        w = want.astype(np.float64)
        ok = np.isfinite(w) & finite
        assert np.all(np.abs(g - w)[ok] <= bound[ok])
    return plan


def kernel_names(plan) -> list[str]:
    return [c.kernel.name for c in launches_of(plan)]


# ---- Reduce*: every op over every kind of axes set, both layouts ------------------------------

AXES = [pytest.param([2, 3], id="hw"), pytest.param([1], id="channels"),
        pytest.param([0, 2], id="non-consecutive"), pytest.param([1, 3], id="c-and-w"),
        pytest.param([-1], id="last-negative"), pytest.param(None, id="all")]


@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize("keepdims", [1, 0], ids=["keepdims", "dropdims"])
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("op", REDUCE)
def test_reduce_equals_numpy_within_one_ulp_of_float64(op, axes, keepdims, conv, device,
                                                       signatures):
    plan = check_reduce(op, axes, keepdims, "f32", conv, device, signatures)
    names = kernel_names(plan)
    assert any(n.startswith(("tr_reduce_", "tr_sum_rows_")) for n in names), names


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize("axes", [pytest.param([2, 3], id="hw"),
                                  pytest.param([0, 2], id="non-consecutive")])
@pytest.mark.parametrize("op", REDUCE)
def test_half_storage_reduces_in_fp64_and_rounds_once(op, axes, conv, dt, device, signatures):
    check_reduce(op, axes, 1, dt, conv, device, signatures)


@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize("op", REDUCE)
def test_noop_with_empty_axes_is_the_elementwise_form(op, conv, device, signatures):
    """opset 18 noop_with_empty_axes=1 with no axes: y = f(x) elementwise (|x|, sqrt(x^2),
    log x...); ReduceSum / ReduceMean are a copy."""
    check_reduce(op, [], 1, "f32", conv, device, signatures, noop=1)


@pytest.mark.parametrize("opset", [1, 11, 13])
@pytest.mark.parametrize("op", REDUCE)
def test_axes_as_attribute_before_opset_18(op, opset, device, signatures):
    if op == "ReduceSum" and opset == 13:
        pytest.skip("ReduceSum takes axes as an input from 13: the opset-18 cases cover it")
    check_reduce(op, [0, 2], 0, "f32", True, device, signatures, opset=opset)


def test_the_dynamo_global_average_pool_is_one_strided_launch(device, signatures):
    """ReduceMean over [2, 3] of an NHWC map (every torchvision CNN's dynamo export): one
    thread per (n, c), reading H*W elements Cp apart, into a channels-last [N, C, 1, 1]."""
    plan = check_reduce("ReduceMean", [2, 3], 1, "f32", True, device, signatures)
    node = next(b for b in plan.executor.bound if b.node.op_type == "ReduceMean")
    assert [c.kernel.name for c in node.calls] == ["tr_reduce_f32", "tr_zero_lanes_b4"]
    total, op, _, count = node.calls[0].args[2:6]
    assert (total, op, count) == (10, 1, 12)  # N * C outputs, ReduceMean's code, H * W each
    assert plan.memory.tensors["h"].layout.phys_shape == (2, 3, 4, 8)


def test_compact_runs_keep_the_run_kernel(device, signatures):
    plan = check_reduce("ReduceMean", [1, 2], 0, "f32", False, device, signatures)
    assert kernel_names(plan) == ["tr_reduce_mid_f32"]


# ---- NumPy's special values -------------------------------------------------------------------

def special_input(dt: str) -> np.ndarray:
    """Rows with a NaN, a +inf, a -inf, all -inf, and ties."""
    x = data((4, 6), dt, "ReduceSum")
    x[0, 2] = np.nan
    x[1, 3] = np.inf
    x[2, 1] = -np.inf
    x[3, :] = -np.inf
    return x


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("op", REDUCE)
def test_nan_and_infinities_follow_numpy(op, dt, device, signatures):
    x = special_input(dt)
    model = reduce_model(op, [1], {"keepdims": 0}, FLOATS[dt], False, shape=(4, 6))
    got, _ = run_cuda(model, x, device, signatures)
    want = run_numpy(model, x)
    assert_same_specials(got, want)
    if op in SELECTIONS:
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("op", REDUCE)
def test_empty_sets_reduce_to_numpy_identities(op, device, signatures):
    """Sum 0, Prod 1, Max -inf, Min +inf, Mean NaN, LogSum -inf, ... over an axis of size 0
    (a Slice of x that keeps none of axis 1)."""
    x = data((3, 4, 2), "f32", op)
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    nodes = [helper.make_node("Slice", ["x", "zero", "zero", "axes"], ["e"]),
             helper.make_node(op, ["e", "axes"], ["y"], keepdims=1)]
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, (3, 4, 2))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (3, 1, 2))], [axes, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got, _ = run_cuda(model, x, device, signatures)
    want = run_numpy(model, x)
    assert got.shape == (3, 1, 2)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
def test_bias_gradient_sums_keep_the_column_sum_kernel(conv, device, signatures):
    """ReduceSum over the leading axes of a compact tensor, or over all but the channels of a
    channels-last one: fp32 column sums, within n eps of the magnitude sum of the float64
    sum (NumPy's einsum adds in fp32 too)."""
    axes = [0, 2, 3] if conv else [0, 1]
    x = data(SHAPE, "f32", "ReduceSum")
    model = reduce_model("ReduceSum", axes, {"keepdims": 1}, np.float32, conv)
    got, plan = run_cuda(model, x, device, signatures)
    x64 = x.astype(np.float64)
    ref64 = np.sum(x64, axis=tuple(axes), keepdims=True)
    n = math.prod(SHAPE[a] for a in axes)
    bound = n * eps("f32") * np.sum(np.abs(x64), axis=tuple(axes), keepdims=True)
    assert np.all(np.abs(got - ref64) <= bound)
    assert np.all(np.abs(got - run_numpy(model, x)) <= 2 * bound)
    assert "tr_sum_rows_f32" in kernel_names(plan)


# ---- ArgMax / ArgMin / Hardmax ------------------------------------------------------------------

def tied(shape, dt: str, nan: bool) -> np.ndarray:
    """Small integers (many ties), a NaN in one row when ``nan``."""
    x = np.random.default_rng(3).integers(-2, 3, shape).astype(FLOATS[dt])
    if nan:
        x.reshape(-1)[[5, 17]] = np.nan
    return x


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("nan", [False, True], ids=["ties", "nan"])
@pytest.mark.parametrize("last", [0, 1], ids=["first", "last"])
@pytest.mark.parametrize("keepdims", [1, 0], ids=["keepdims", "dropdims"])
@pytest.mark.parametrize("axis", [1, 2, -1, 0])
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_extremes_equal_numpy(op, axis, keepdims, last, nan, dt, device, signatures):
    x = tied((3, 4, 5), dt, nan)
    model = reduce_model(op, None, {"axis": axis, "keepdims": keepdims,
                                    "select_last_index": last}, FLOATS[dt], False, 13,
                         (3, 4, 5), np.int64)
    got, plan = run_cuda(model, x, device, signatures)
    want = run_numpy(model, x)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    assert kernel_names(plan) == [f"tr_arg_extreme_{dt}"]


@pytest.mark.parametrize("keepdims", [1, 0], ids=["keepdims", "dropdims"])
@pytest.mark.parametrize("axis", [1, 2])
def test_arg_max_of_a_channels_last_map_equals_numpy(axis, keepdims, device, signatures):
    """keepdims: the int64 indices are planned channels-last too, their padded lanes zeroed
    as 4-byte lanes; a Cast hands them out as floats (channels-last int64 is neither
    downloaded nor transposed by the cuda backend yet)."""
    x = tied(SHAPE, "f32", True)
    model = reduce_model("ArgMax", None, {"axis": axis, "keepdims": keepdims}, np.float32,
                         True, 13, out_dtype=np.int64)
    model.graph.node.append(helper.make_node("Cast", ["y"], ["z"], to=TensorProto.FLOAT))
    out = model.graph.output[0]
    out.name = "z"
    out.type.tensor_type.elem_type = TensorProto.FLOAT
    sess = tr_onnx.InferenceSession(model, backend="cuda", device=device, channel_align=8)
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, run_numpy(model, x))
    plan = sess.plan_for({"x": x})
    check_launch_arguments(launches_of(plan), plan, signatures)
    y = plan.memory.tensors["y"]
    assert (y.layout.kind == "channels_last") == bool(keepdims)
    assert pad_lanes_are_zero(plan.executor.device.arena, y)


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("conv", [False, True], ids=["compact", "channels-last"])
@pytest.mark.parametrize(("opset", "axis"), [(13, 1), (13, -1), (13, 2), (11, 1), (11, 2),
                                             (1, 0)])
def test_hardmax_equals_numpy_bit_for_bit(opset, axis, conv, dt, device, signatures):
    x = tied(SHAPE, dt, True)
    model = reduce_model("Hardmax", None, {"axis": axis}, FLOATS[dt], conv, opset)
    got, plan = run_cuda(model, x, device, signatures)
    np.testing.assert_array_equal(bits(got), bits(run_numpy(model, x)))
    assert kernel_names(plan)[-1 - conv] == f"tr_hardmax_{dt}"  # then the lanes zeroed
