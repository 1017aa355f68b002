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

* Reduce* and GlobalLpPool (a thread per output, a block of lanes per output from 256
  elements, or the run-of-axes kernel): fp64 accumulation and fp64 math, one rounding at the
  store, so the result is within 1 ulp of the storage type of the numpy
  backend's float64 result on the same (exactly representable) inputs -- the oracle. Against
  the numpy backend in the storage dtype itself: NumPy sums float32 pairwise or sequentially
  and float16 / bfloat16 in their own precision, whose error is at most ``n`` roundings of
  the running sum for ``n`` reduced elements, so |cuda - numpy| <= (n + 1) eps * S with S the
  sum of the magnitudes of the terms (Sum, Mean: of |x|; L1, L2, SumSquare, LogSumExp, Prod:
  the result's own scale). GlobalLpPool against float64 within 1 ulp, against NumPy's
  float32 within 2 (NumPy's own rounding).
* ReduceMax / ReduceMin / ArgMax / ArgMin / Hardmax / GlobalMaxPool / GlobalMaxPoolGrad:
  selections, bit-exact against the numpy backend in every dtype, NaN and ties included.
* ReduceSum as column sums (the bias-gradient kernel, fp32 like NumPy's einsum): within
  n eps of the magnitude sum, as above.
* LpPool / LpPoolGrad: fp32 in NumPy's order. float32 with p = 1, 2 bit-exact (on the host
  LpPoolGrad's y^(1-p) is libm's powf on both sides; a device powf is within 2 ulp of it);
  LpPool with other p within 4 ulp (powf twice); float16 / bfloat16 within 1 ulp of the
  storage type (NumPy rounds |x|^p to the storage type first). LpPoolGrad otherwise: the
  windows' shares cancel, so within (taps + 4) eps of the gradient of |gy| at |x| (the sum
  of the shares' magnitudes) plus 1 ulp.
* training (a Conv, then a pooling head: the dynamo global average pool with keepdims 1 and
  0, GlobalMaxPool, LpPool + GlobalLpPool, and chains of the other Reduce* ops, whose
  gradient rules emit ReduceSum, Expand, Equal, Cast, Div, Sign, Exp, Pow...): losses rtol
  1e-5, parameters rtol 2e-4 / atol 1e-6, as the other families' training tests (the
  convolutions' backward runs the numpy kernels in the emulator, but the numpy plan folds
  gradient accumulators and the cuda plan does not: sums of contributions round
  differently).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16, onnx_elem_type
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.ops.conv_window import Window
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

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


def run_cuda(model, x, device, signatures):
    """(the cuda session's y, its plan), launches checked against the kernels' signatures
    and y's padded lanes zero."""
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), channel_align=8)
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


@pytest.mark.parametrize(("op", "opset"), [(op, opset) for op in REDUCE for opset in (1, 11, 13)
                                           if not axes_inputs(op, opset)])
def test_axes_as_attribute_before_opset_18(op, opset, device, signatures):
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


LONG = (2, 5, 16, 80)  # 1280 elements per (n, c): tr_reduce_blocks


LONG_CASES = [pytest.param(op, axes, conv, id=f"{op}-{name}-{layout}")
              for op in REDUCE for name, axes in (("hw", [2, 3]), ("all", None),
                                                  ("all-but-channels", [0, 2, 3]))
              for layout, conv in (("compact", False), ("channels-last", True))
              # the bias-gradient form: column sums (test_bias_gradient_sums_...)
              if not (op == "ReduceSum" and conv and axes == [0, 2, 3])]


@pytest.mark.parametrize(("op", "axes", "conv"), LONG_CASES)
def test_long_reductions_take_a_block_per_output(op, axes, conv, device, signatures):
    """From BLOCK_REDUCE_MIN elements per output: lanes and a tree, the same 1-ulp bound."""
    plan = check_reduce(op, axes, 1, "f32", conv, device, signatures, shape=LONG)
    assert "tr_reduce_blocks_f32" in kernel_names(plan)


@pytest.mark.parametrize("op", REDUCE)
def test_long_reductions_of_short_runs_give_each_lane_whole_runs(op, device, signatures):
    """Axes [0, 2] of [40, 5, 8]: 320 elements per output in 40 runs of 8 (lanes take runs
    rather than split them)."""
    plan = check_reduce(op, [0, 2], 0, "f32", False, device, signatures, shape=(40, 5, 8))
    assert kernel_names(plan) == ["tr_reduce_blocks_f32"]


@pytest.mark.parametrize("op", REDUCE)
def test_long_reductions_keep_numpys_special_values(op, device, signatures):
    """NaN and infinities through the lanes and the tree (values near 1: a product of 2048
    normals underflows in NumPy's float32 but not in fp64, and 0 * inf is NaN)."""
    x = (1 + 0.01 * np.random.default_rng(0).standard_normal((4, 2048))).astype(np.float32)
    x[0, 700] = np.nan
    x[1, 1500] = np.inf
    x[2, 3] = -np.inf
    x[3, :] = -np.inf
    model = reduce_model(op, [1], {"keepdims": 0}, np.float32, False, shape=(4, 2048))
    got, plan = run_cuda(model, x, device, signatures)
    assert_same_specials(got, run_numpy(model, x))
    assert kernel_names(plan) == ["tr_reduce_blocks_f32"]


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
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), channel_align=8)
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


# ---- pools: LpPool, the global pools, their backward ops -------------------------------------

def pool_model(op: str, attrs: dict, dtype, out_shape, domain: str = "", inputs=("x",),
               shapes=None) -> onnx.ModelProto:
    """One pool node (planned NHWC: the pools' layout rule) with output y of ``out_shape``."""
    elem = onnx_elem_type(dtype)
    shapes = shapes or {"x": SHAPE}
    node = helper.make_node(op, list(inputs), ["y"], domain=domain, **attrs)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(k, elem, shapes[k])
                                           for k in inputs],
                              [helper.make_tensor_value_info("y", elem, out_shape)])
    imports = [helper.make_opsetid("", 18)] + \
        ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=imports)


def run_pool(model, feeds, device, signatures):
    """(cuda's y, numpy's y, the cuda plan), y's padded lanes checked zero."""
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), channel_align=8)
    (got,) = sess.run(None, feeds)
    plan = sess.plan_for(feeds)
    check_launch_arguments(launches_of(plan), plan, signatures)
    y = plan.memory.tensors["y"]
    assert y.layout.kind == "channels_last"
    assert pad_lanes_are_zero(plan.executor.device.arena, y)
    want = tr_onnx.InferenceSession(model, backend="numpy", channel_align=8).run(None, feeds)[0]
    return got, want, plan


def assert_within_ulps(got, want, dt: str, ulps: float):
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert_same_specials(got, want)
    ok = np.isfinite(w)
    err = np.abs(g - w)[ok]
    assert np.all(err <= ulps * ulp(w, dt)[ok]), f"max {np.max(err / ulp(w, dt)[ok])} ulp"


@pytest.mark.parametrize("dt", list(FLOATS))
def test_global_max_pool_equals_numpy_bit_for_bit(dt, device, signatures):
    x = tied(SHAPE, dt, True)
    got, want, plan = run_pool(pool_model("GlobalMaxPool", {}, FLOATS[dt], [2, 5, 1, 1]),
                               {"x": x}, device, signatures)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert kernel_names(plan) == [f"tr_reduce_{dt}", "tr_zero_lanes_b" + str(FLOATS[dt].itemsize)]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool_is_within_one_ulp_of_float64(p, dt, device, signatures):
    x = data(SHAPE, dt, "GlobalLpPool")
    model = pool_model("GlobalLpPool", {"p": p}, FLOATS[dt], [2, 5, 1, 1])
    got, want, _ = run_pool(model, {"x": x}, device, signatures)
    x64 = x.astype(np.float64)
    ref64 = np.sum(np.abs(x64) ** p, axis=(2, 3), keepdims=True) ** (1.0 / p)
    assert_within_ulps(got, ref64, dt, 1)
    assert_within_ulps(got, want, dt, 2 if dt == "f32" else 1)  # NumPy's own fp32 rounding


def global_max_pool_grad_inputs(dt: str):
    x = tied(SHAPE, dt, True)  # ties and a NaN: the first maximum takes gy (np.argmax)
    gy = data((2, 5, 1, 1), dt, "GlobalMaxPoolGrad", seed=4)
    return {"gy": gy, "x": x}


@pytest.mark.parametrize("dt", list(FLOATS))
def test_global_max_pool_grad_routes_gy_to_the_first_maximum(dt, device, signatures):
    feeds = global_max_pool_grad_inputs(dt)
    model = pool_model("GlobalMaxPoolGrad", {}, FLOATS[dt], SHAPE, domain="ai.tr_onnx",
                       inputs=("gy", "x"), shapes={"gy": (2, 5, 1, 1), "x": SHAPE})
    got, want, _ = run_pool(model, feeds, device, signatures)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert np.count_nonzero(got) == 10


LP_WINDOWS = [
    pytest.param({"kernel_shape": [2, 2], "strides": [2, 2]}, id="2x2-stride2"),
    pytest.param({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, id="3x3-pads1"),
    pytest.param({"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1}, id="ceil-mode"),
    pytest.param({"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "dilations": [1, 2]},
                 id="same-upper-dilated"),
]


def lp_window(attrs: dict) -> Window:
    return Window.resolve({"auto_pad": "NOTSET", **attrs}, SHAPE[2:], attrs["kernel_shape"],
                          bool(attrs.get("ceil_mode", 0)))


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", LP_WINDOWS)
def test_lp_pool_equals_numpy(attrs, p, dt, device, signatures):
    x = data(SHAPE, dt, "LpPool")
    out = [*SHAPE[:2], *lp_window(attrs).out_shape]
    got, want, plan = run_pool(pool_model("LpPool", {**attrs, "p": p}, FLOATS[dt], out),
                               {"x": x}, device, signatures)
    if dt == "f32" and p in (1, 2):
        np.testing.assert_array_equal(bits(got), bits(want))
    else:
        assert_within_ulps(got, want, dt, 4 if dt == "f32" else 1)
    assert kernel_names(plan) == [f"tr_lppool_fwd_{dt}"]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("attrs", LP_WINDOWS)
def test_lp_pool_grad_equals_numpy(attrs, p, dt, device, signatures):
    """LpPoolGrad(gy, h, LpPool(h)) as the gradient rule emits it (the window's pads explicit),
    h = an identity 1x1 Conv of x: every operand channels-last, as in training."""
    x = data(SHAPE, dt, "LpPool")
    win = lp_window(attrs)
    out = [*SHAPE[:2], *win.out_shape]
    gy = data(out, dt, "LpPoolGrad", seed=5)
    grad_attrs = {**win.attrs(), "ceil_mode": int(attrs.get("ceil_mode", 0)), "p": float(p)}
    model = pool_model("LpPoolGrad", grad_attrs, FLOATS[dt], SHAPE, domain="ai.tr_onnx",
                       inputs=("gy", "h", "yf"), shapes={"gy": out, "h": SHAPE, "yf": out})
    c = SHAPE[1]
    model.graph.initializer.append(numpy_helper.from_array(
        np.eye(c).reshape(c, c, 1, 1).astype(FLOATS[dt]), "w"))
    model.graph.node.insert(0, helper.make_node("LpPool", ["h"], ["yf"], p=p, **attrs))
    model.graph.node.insert(0, helper.make_node("Conv", ["x", "w"], ["h"]))
    del model.graph.input[1:]
    model.graph.input.append(helper.make_tensor_value_info("x", onnx_elem_type(FLOATS[dt]),
                                                           SHAPE))
    got, want, plan = run_pool(model, {"gy": gy, "x": x}, device, signatures)
    if dt == "f32" and p in (1, 2):
        np.testing.assert_array_equal(bits(got), bits(want))
    else:
        # the windows' shares cancel: the error is relative to the sum of their magnitudes
        magnitude = tr_onnx.InferenceSession(model, backend="numpy").run(
            None, {"gy": np.abs(gy), "x": np.abs(x)})[0].astype(np.float64)
        taps = math.prod(attrs["kernel_shape"])
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert np.all(err <= (taps + 4) * eps(dt) * magnitude + ulp(magnitude, dt))
    assert kernel_names(plan)[-1] == f"tr_lppool_bwd_{dt}"


# ---- training: three SGD steps on cuda (emulated) against numpy --------------------------------

CLASSES = 4


def head_nodes(head: str) -> tuple[list, int]:
    """The pooling head over the Conv's [2, 6, 6, 6] map "a": nodes ending in "f", and the
    features per sample."""
    node = helper.make_node
    if head == "gap-keepdims":  # torch.export's adaptive_avg_pool2d((1, 1))
        return [node("ReduceMean", ["a", "hw"], ["p"], keepdims=1),
                node("Flatten", ["p"], ["f"])], 6
    if head == "gap-dropdims":
        return [node("ReduceMean", ["a", "hw"], ["f"], keepdims=0)], 6
    if head == "global-max-pool":
        return [node("GlobalMaxPool", ["a"], ["p"]), node("Flatten", ["p"], ["f"])], 6
    if head == "lp-pools":
        return [node("LpPool", ["a"], ["l"], kernel_shape=[2, 2], strides=[2, 2], p=2),
                node("GlobalLpPool", ["l"], ["p"], p=3), node("Flatten", ["p"], ["f"])], 6
    if head == "max-then-l2":
        return [node("ReduceMax", ["a", "w_axis"], ["m"], keepdims=1),
                node("ReduceL2", ["m", "hw"], ["f"], keepdims=0)], 6
    if head == "min-then-l1":
        return [node("ReduceMin", ["a", "w_axis"], ["m"], keepdims=1),
                node("ReduceL1", ["m", "hw"], ["f"], keepdims=0)], 6
    if head == "sum-square-then-log-sum":
        return [node("ReduceSumSquare", ["a", "w_axis"], ["m"], keepdims=1),
                node("ReduceLogSum", ["m", "hw"], ["f"], keepdims=0)], 6
    if head == "log-sum-exp":
        return [node("ReduceLogSumExp", ["a", "hw"], ["f"], keepdims=0)], 6
    raise ValueError(head)


def cnn(head: str) -> onnx.ModelProto:
    """input [2, 3, 6, 6] -> Conv(3x3, pads 1, 6 channels: padded to 8) -> Relu -> ``head``
    -> Gemm -> scores [2, CLASSES]."""
    rng = np.random.default_rng(0)

    def w(name, shape):
        return numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    nodes, features = head_nodes(head)
    inits = [w("w1", (6, 3, 3, 3)), w("w2", (CLASSES, features)),
             numpy_helper.from_array(np.array([2, 3], np.int64), "hw"),
             numpy_helper.from_array(np.array([3], np.int64), "w_axis")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w1"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["a"])] + nodes
        + [helper.make_node("Gemm", ["f", "w2"], ["scores"], transB=1)],
        head, [helper.make_tensor_value_info("input", TensorProto.FLOAT, [2, 3, 6, 6])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.filterwarnings("ignore::tr_onnx.errors.ExportAdviceWarning")
@pytest.mark.parametrize("head", ["gap-keepdims", "gap-dropdims", "global-max-pool",
                                  "lp-pools", "max-then-l2", "min-then-l1",
                                  "sum-square-then-log-sum", "log-sum-exp"])
def test_a_cnn_trains_on_cuda_as_on_numpy(head, device, signatures):
    kw = dict(optimizer=SGD(lr=0.05), channel_align=8)
    cuda = tr_onnx.TrainingSession(cnn(head), backend=CudaBackend(device=device), **kw)
    ref = tr_onnx.TrainingSession(cnn(head), backend="numpy", **kw)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
        y = rng.integers(0, CLASSES, 2)
        np.testing.assert_allclose(cuda.train_step({"input": x}, y),
                                   ref.train_step({"input": x}, y), rtol=1e-5)
    a, b = cuda.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=1e-6, err_msg=name)
    plan = cuda._state.active
    ls = launches_of(plan)
    check_launch_arguments(ls, plan, signatures)
    names = {c.kernel.name for c in ls}
    assert TRAINING_KERNELS[head] <= names, names


TRAINING_KERNELS = {  # what each head's forward and backward launch at least
    "gap-keepdims": {"tr_reduce_f32"}, "gap-dropdims": {"tr_reduce_f32"},
    "global-max-pool": {"tr_reduce_f32", "tr_global_max_pool_grad_f32"},
    "lp-pools": {"tr_lppool_fwd_f32", "tr_lppool_bwd_f32", "tr_reduce_f32"},
    "max-then-l2": {"tr_reduce_f32"}, "min-then-l1": {"tr_reduce_f32"},
    "sum-square-then-log-sum": {"tr_reduce_f32"}, "log-sum-exp": {"tr_reduce_f32"}}
