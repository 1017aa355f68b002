"""The cuda bindings of the elementwise family (backends/cuda/ops/elementwise.py, unary.py),
run on the CPU through the kernels' host build (``host_emulator``) against the numpy backend.

Every case is a small ONNX model run by ``InferenceSession(backend=CudaBackend(
device=<emulator>))`` and by the numpy backend (``channel_align=8`` on both, so a Conv before
the op gives the padded channels-last layout the GPU plan has). The emulated arena is poisoned
where this family's nodes write (``PoisoningEmulator``: every byte 0xFF before the node first
runs), so a lane a kernel forgets to write, or a pad it fails to zero, shows. Each case
asserts that the kernels it is about were launched (a plan that took another path proves
nothing), that padded output lanes are zero, and that every launch's arguments match the
kernel's C signature (``check_launch_arguments``). Training cases (squeeze-excite, an
RMS-style norm through Pow, PRelu after a Conv, variadic Max/Min/Mean) run three SGD steps on
both backends. The unary ops' kernels are also checked element by element on a dense grid in
tests/test_cuda_kernels_cpu.py (its ``UNARY`` table), fp32, fp16 and bf16.

Tolerances, per op family (fp32 storage; kernels compiled with contraction off, so plain
arithmetic rounds as NumPy's):
* bit-exact: Add/Sub/Mul/Div/Sum, Max/Min, Mod (fmod and NumPy's floored remainder, both
  exact operations), PRelu, Mean (the sum, then one division, as NumPy), Reciprocal, Floor,
  Ceil, Round (half to even), Softsign, Shrink, ThresholdedRelu, Pow with exponent 2 (the
  product), every comparison, logic, bitwise, shift and integer op, IsNaN/IsInf, Not, and
  every Cast (C conversions as NumPy's ``astype``);
* libm functions (sin, cos, tan, asin, acos, atan, sinh, cosh, asinh, acosh, atanh, powf,
  expm1f, tanhf, log1pf): 4 ulp against NumPy's float32 (glibc on the host, CUDA's documented
  <= 2-4 ulp on the device; NumPy's SIMD float32 loops are themselves ~1-3 ulp);
  Celu/Selu/Mish 8 ulp: NumPy runs them through oneDNN's eltwise kernels for finite float32
  (ops/unary.py ``_ONEDNN_FINITE``), whose error against the exact formula is a few ulp of
  its own (seen: see the table);
* fp16 / bf16 storage (compute in fp32): within 1 ulp of the storage type from NumPy's fp32
  result on the same upcast inputs, rounded (the kernels' standard,
  tests/test_cuda_kernels_cpu.py).
Training: losses rtol 1e-5 and parameters rtol 2e-4 / atol 2e-6 after three steps, as
tests/test_cuda_wiring_cpu.py holds whole models (the libm ops and the cuDNN stand-ins'
summation order differ by ulps that three updates carry).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.backends.cuda.ops import elementwise as cuda_ew
from tr_onnx.backends.cuda.ops import unary as cuda_unary
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import HostEmulator, build_host_library

N, C, H, W = 2, 5, 4, 3  # C = 5 pads to 8 lanes


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("elementwise_kernels"))


FAMILY_OPS = {d.op_type for m in (cuda_ew, cuda_unary) for d in m.tr_onnx_op_definitions()}


class PoisoningEmulator(HostEmulator):
    """The emulator, where the outputs of this family's nodes hold 0xFF bytes (NaN, -1) before
    the node first runs: a lane the node's kernels leave unwritten (a pad not zeroed, an
    element skipped) shows. An output that shares bytes with an input (in place) is left."""

    def replay(self, call) -> None:
        node = self.nodes.get(call.node)
        if node is not None and node.op_type in FAMILY_OPS and call.node not in self.poisoned:
            self.poisoned.add(call.node)
            spans = [(t.offset, t.offset + t.nbytes) for t in
                     (self.plan.tensors[v.name] for v in node.inputs if v is not None)]
            for v in node.outputs:
                t = self.plan.tensors[v.name] if v is not None else None
                if t is not None and all(e <= t.offset or t.offset + t.nbytes <= s
                                         for s, e in spans):
                    self.arena[t.offset:t.offset + t.nbytes] = 0xFF
        super().replay(call)


@pytest.fixture(scope="module")
def device(lib):
    def factory(plan):
        emulator = PoisoningEmulator(plan, lib)
        emulator.poisoned = set()
        return emulator

    return factory


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


# ---- models -----------------------------------------------------------------------------------

ELEM = {np.dtype(np.float32): TP.FLOAT, np.dtype(np.float16): TP.FLOAT16, BFLOAT16: TP.BFLOAT16,
        np.dtype(np.int32): TP.INT32, np.dtype(np.int64): TP.INT64, np.dtype(np.bool_): TP.BOOL,
        np.dtype(np.uint8): TP.UINT8, np.dtype(np.uint32): TP.UINT32,
        np.dtype(np.uint64): TP.UINT64, np.dtype(np.int8): TP.INT8,
        np.dtype(np.float64): TP.DOUBLE}
RNG = np.random.default_rng(7)
CONV_W = RNG.standard_normal((C, 3, 3, 3)).astype(np.float32)


def make_model(nodes, inputs: dict, outputs: dict, inits: dict | None = None, opset=18):
    """``inputs`` / ``outputs``: name -> (dtype, shape); ``inits``: name -> array."""
    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, ELEM[np.dtype(dtype)], list(shape))

    graph = helper.make_graph(nodes, "case", [info(k, *v) for k, v in inputs.items()],
                              [info(k, *v) for k, v in outputs.items()],
                              [numpy_helper.from_array(np.asarray(v), k)
                               for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run_both(model, feed, device):
    """(cuda outputs, numpy outputs, the cuda plan); the cuda run twice (eager, captured)."""
    want = tr_onnx.InferenceSession(model, channel_align=8).run(None, feed)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    sess.run(None, feed)
    got = sess.run(None, feed)
    return got, want, sess.plan_for(feed)


def launched(plan) -> list:
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


def check_plan(plan, signatures, kernels: set[str]) -> None:
    """The named kernels ran, every launch matches its C signature, the padded outputs' pad
    lanes are zero."""
    calls = launched(plan)
    names = {c.kernel.name for c in calls}
    assert kernels <= names, (kernels - names, names)
    check_launch_arguments(calls, plan, signatures)
    arena = plan.executor.device.arena
    for v in plan.graph.outputs:
        t = plan.memory.tensors[v.name]
        assert pad_lanes_are_zero(arena, t), t.name


def ulp_dist(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """|a - b| in ulps of ``dtype`` (its bit patterns as ordered integers); NaN == NaN."""
    dtype = np.dtype(dtype)
    bits = {2: np.int16, 4: np.int32}[dtype.itemsize]
    wide = np.int64

    def ordered(x):
        x = np.ascontiguousarray(np.asarray(x, dtype)).view(bits).astype(wide)
        return np.where(x < 0, np.iinfo(bits).min - x, x)

    d = np.abs(ordered(a) - ordered(b))
    both_nan = np.isnan(np.asarray(a, np.float32)) & np.isnan(np.asarray(b, np.float32))
    return np.where(both_nan, 0, d)


def assert_ulps(got, want, dtype, ulps: int, what=""):
    d = ulp_dist(got, want, dtype)
    assert d.max(initial=0) <= ulps, (what, int(d.max()), ulps)


def rounded(x32: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x32, np.float32).astype(dtype)


# ---- broadcasting binary float ops ------------------------------------------------------------
# pattern -> (the second operand's shape, whether it is a constant, whether the first operand is
# a Conv's padded channels-last output, whether the operands are swapped)
PATTERNS = {
    "squeeze_excite": ("gap", False, True, False),  # x * [N,C,1,1] from a global pool
    "channel_c11": ((C, 1, 1), True, True, False),
    "channel_1c11": ((1, C, 1, 1), True, True, False),
    "channel_c11_first": ((C, 1, 1), True, True, True),
    "per_sample": ((N, 1, 1, 1), False, True, False),  # stochastic depth
    "compact_same_shape": ((N, C, H, W), False, True, False),
    "compact_inner": ((C, 1, W), False, False, False),
    "compact_outer": ((N, 1, 1, 1), False, False, True),
    "scalar": ((), True, True, False),
}
FLOAT_BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "PRelu")
EXACT_BINARY = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Mod", "PRelu"}


def _operand(op, shape, rng):
    v = rng.standard_normal(shape).astype(np.float32)
    if op == "Pow":  # exponents of real models: 2, 3, 0.5 and a general one, on |base|
        return np.asarray(rng.choice([2.0, 3.0, 0.5, 1.7], size=shape), np.float32)
    if op in ("Div", "Mod"):
        return np.where(np.abs(v) < 0.25, 0.7, v).astype(np.float32)
    return v


def _binary_case(op, pattern, attrs=None):
    shape_b, const, conv, swap = PATTERNS[pattern]
    rng = np.random.default_rng(abs(hash((op, pattern))) % 2**32)
    full = (N, C, H, W)
    nodes, inputs, inits, feed = [], {}, {}, {}
    if conv:
        inputs["x"] = (np.float32, (N, 3, H, W))
        feed["x"] = rng.standard_normal((N, 3, H, W)).astype(np.float32)
        inits["w"] = CONV_W
        nodes.append(helper.make_node("Conv", ["x", "w"], ["a0"], pads=[1, 1, 1, 1]))
        first = "a0"
        if op in ("Pow", "Log"):  # a positive base
            nodes.append(helper.make_node("Abs", ["a0"], ["a1"]))
            first = "a1"
    else:
        inputs["a"] = (np.float32, full)
        feed["a"] = rng.standard_normal(full).astype(np.float32)
        first = "a"
        if op == "Pow":
            feed["a"] = np.abs(feed["a"]) + 0.1
    if shape_b == "gap":  # a pool over the whole map (MaxPool: exact on both backends)
        nodes.append(helper.make_node("MaxPool", [first], ["p"], kernel_shape=[H, W]))
        nodes.append(helper.make_node("Add", ["p", "two"], ["bop"]))
        inits["two"] = np.float32(2.0)
    elif const:
        inits["bop"] = _operand(op, shape_b, rng)
    else:
        inputs["bop"] = (np.float32, shape_b)
        feed["bop"] = _operand(op, shape_b, rng)
    operands = ["bop", first] if swap else [first, "bop"]
    if op == "PRelu" and swap:
        operands = [first, "bop"]
    nodes.append(helper.make_node(op, operands, ["y"], **(attrs or {})))
    return make_model(nodes, inputs, {"y": (np.float32, full)}, inits), feed


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("op", FLOAT_BINARY)
def test_binary_op_broadcasts_over_every_layout_mix_as_numpy(op, pattern, device, signatures):
    model, feed = _binary_case(op, pattern)
    (got,), (want,), plan = run_both(model, feed, device)
    node_kernels = {c.kernel.name for b in plan.executor.bound if b.node.op_type == op
                    for c in b.calls if isinstance(c, Launch)}
    assert node_kernels, f"{op} launched nothing"
    if op not in cuda_ew.BINARY:  # Pow/Max/Min/Mod/PRelu: always the strided kernel
        assert "tr_bcast_binary_f32" in node_kernels
    check_plan(plan, signatures, set())
    assert_ulps(got, want, np.float32, 0 if op in EXACT_BINARY else 4, (op, pattern))


def test_squeeze_excite_gate_takes_the_strided_kernel_and_zeroes_the_pads(device, signatures):
    model, feed = _binary_case("Mul", "squeeze_excite")
    got, want, plan = run_both(model, feed, device)
    (mul,) = [b for b in plan.executor.bound if b.node.op_type == "Mul"]
    assert [c.kernel.name for c in mul.calls] == ["tr_bcast_binary_f32", "tr_zero_lanes_b4"]
    y = plan.memory.tensors[mul.node.outputs[0].name]
    assert y.layout.is_padded
    assert pad_lanes_are_zero(plan.executor.device.arena, y)
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("fmod", [0, 1])
def test_mod_follows_the_fmod_attribute_with_signs_as_numpy(fmod, device, signatures):
    a = np.array([5.5, -5.5, 5.5, -5.5, 0.0, -0.0, 3.0, 7.25], np.float32).reshape(2, 4)
    b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, -3.0, 1.5, -0.5], np.float32).reshape(2, 4)
    model = make_model([helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)],
                       {"a": (np.float32, a.shape), "b": (np.float32, b.shape)},
                       {"y": (np.float32, a.shape)})
    (got,), (want,), plan = run_both(model, {"a": a, "b": b}, device)
    check_plan(plan, signatures, {"tr_bcast_binary_f32"})
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros


LOW = {"f16": np.dtype(np.float16), "bf16": BFLOAT16}


@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("op", FLOAT_BINARY)
def test_binary_op_in_half_storage_is_the_rounded_fp32_result(op, dt, device, signatures):
    dtype = LOW[dt]
    rng = np.random.default_rng(3)
    a32 = rng.standard_normal((N, C, W)).astype(np.float32)
    b32 = _operand(op, (C, 1), rng)
    if op == "Pow":
        a32 = np.abs(a32) + 0.1
    a, b = a32.astype(dtype), b32.astype(dtype)
    shapes = {"a": (dtype, a.shape), "b": (dtype, b.shape)}
    model = make_model([helper.make_node(op, ["a", "b"], ["y"])], shapes,
                       {"y": (dtype, a.shape)})
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    (got,) = sess.run(None, {"a": a, "b": b})
    ref = make_model([helper.make_node(op, ["a", "b"], ["y"])],
                     {k: (np.float32, v[1]) for k, v in shapes.items()},
                     {"y": (np.float32, a.shape)})
    (want,) = tr_onnx.InferenceSession(ref).run(None, {"a": a.astype(np.float32),
                                                       "b": b.astype(np.float32)})
    plan = sess.plan_for({"a": a, "b": b})
    check_plan(plan, signatures, {f"tr_bcast_binary_{dt}"} if op not in cuda_ew.BINARY
               else set())
    assert_ulps(got.astype(np.float32).astype(dtype), rounded(want, dtype), dtype, 1, op)


# ---- variadic ops -----------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_op_folds_its_broadcast_inputs_as_numpy(op, count, device, signatures):
    shapes = [(N, C, H, W), (C, 1, 1), (N, 1, H, 1)][:count]
    rng = np.random.default_rng(count)
    feed = {f"x{k}": rng.standard_normal(s).astype(np.float32) for k, s in enumerate(shapes)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(op, ["c"] + list(feed)[1:], ["y"])]
    feed["x"] = rng.standard_normal((N, 3, H, W)).astype(np.float32)
    feed.pop("x0")
    inputs = {k: (np.float32, v.shape) for k, v in feed.items()}
    model = make_model(nodes, inputs, {"y": (np.float32, (N, C, H, W))}, {"w": CONV_W})
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {"tr_bcast_binary_f32"} if op != "Sum" or count != 2
               else set())
    np.testing.assert_array_equal(got, want)


# ---- comparisons, logic, bitwise, integer arithmetic ---------------------------------------------

INT_VALUES = {np.dtype(np.int64): (-9, 10), np.dtype(np.int32): (-9, 10),
              np.dtype(np.uint8): (0, 255), np.dtype(np.uint32): (0, 2**31),
              np.dtype(np.uint64): (0, 2**40), np.dtype(np.int8): (-100, 100)}


def _values(dtype, shape, rng):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        lo, hi = INT_VALUES[dtype]
        return rng.integers(lo, hi, shape).astype(dtype)
    return np.round(rng.standard_normal(shape) * 2).astype(dtype)  # ties for == / >= / <=


def _two_input_case(op, dtype, shape_a, shape_b, out_dtype, attrs=None, seed=0):
    rng = np.random.default_rng(seed)
    feed = {"a": _values(dtype, shape_a, rng), "b": _values(dtype, shape_b, rng)}
    out = np.broadcast_shapes(shape_a, shape_b)
    model = make_model([helper.make_node(op, ["a", "b"], ["y"], **(attrs or {}))],
                       {k: (dtype, v.shape) for k, v in feed.items()},
                       {"y": (out_dtype, out)})
    return model, feed


COMPARE_DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64,
                  "bool": np.bool_}
COMPARE_SHAPES = {"same": ((3, 4), (3, 4)), "mask": ((2, 1, 1, 6), ()),
                  "inner": ((2, 3, 4), (3, 1)), "outer": ((3, 1), (2, 3, 4))}


@pytest.mark.parametrize("shapes", list(COMPARE_SHAPES))
@pytest.mark.parametrize("op, dt", [(op, dt) for op in cuda_ew.COMPARE_CODES
                                    for dt in COMPARE_DTYPES
                                    if dt != "bool" or op == "Equal"])  # bools: Equal only
def test_comparison_of_floats_ints_and_bools_is_numpys(op, dt, shapes, device, signatures):
    dtype = np.dtype(COMPARE_DTYPES[dt])
    model, feed = _two_input_case(op, dtype, *COMPARE_SHAPES[shapes], np.bool_)
    (got,), (want,), plan = run_both(model, feed, device)
    kernels = {c.kernel.name for c in launched(plan)}
    assert kernels & {f"tr_bcast_compare_{cuda_ew.INT_DT.get(dtype.name, dt)}",
                      "tr_greater_f32", "tr_less_f32", "tr_equal_f32", "tr_greater_f16",
                      "tr_less_f16", "tr_equal_f16"}, kernels
    check_plan(plan, signatures, set())
    np.testing.assert_array_equal(got, want)


def test_comparison_reads_a_padded_feature_map_against_a_compact_one(device, signatures):
    rng = np.random.default_rng(5)
    feed = {"x": rng.standard_normal((N, 3, H, W)).astype(np.float32),
            "t": rng.standard_normal((N, 1, H, W)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("GreaterOrEqual", ["c", "t"], ["m"]),
             helper.make_node("Cast", ["m"], ["y"], to=TP.FLOAT)]
    model = make_model(nodes, {k: (np.float32, v.shape) for k, v in feed.items()},
                       {"y": (np.float32, (N, C, H, W))}, {"w": CONV_W})
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {"tr_bcast_compare_f32", "tr_convert_bool_f32"})
    np.testing.assert_array_equal(got, want)


INT_CASES = {  # id: (op, dtype, attrs)
    "and": ("And", np.bool_, {}), "or": ("Or", np.bool_, {}), "xor": ("Xor", np.bool_, {}),
    "bitwise_and_i32": ("BitwiseAnd", np.int32, {}), "bitwise_or_i64": ("BitwiseOr", np.int64, {}),
    "bitwise_xor_u8": ("BitwiseXor", np.uint8, {}),
    "shift_left_u8": ("BitShift", np.uint8, {"direction": "LEFT"}),
    "shift_right_u32": ("BitShift", np.uint32, {"direction": "RIGHT"}),
    "shift_left_u64": ("BitShift", np.uint64, {"direction": "LEFT"}),
    "add_i64": ("Add", np.int64, {}), "sub_i32": ("Sub", np.int32, {}),
    "mul_i64": ("Mul", np.int64, {}), "div_i32": ("Div", np.int32, {}),
    "div_i64": ("Div", np.int64, {}), "mod_i64": ("Mod", np.int64, {}),
    "fmod_i32": ("Mod", np.int32, {"fmod": 1}), "max_i64": ("Max", np.int64, {}),
    "min_i32": ("Min", np.int32, {}), "sum_i64": ("Sum", np.int64, {}),
}


@pytest.mark.parametrize("shapes", ["same", "inner", "outer"])
@pytest.mark.parametrize("case", list(INT_CASES))
def test_integer_and_bool_op_is_numpys(case, shapes, device, signatures):
    op, dtype, attrs = INT_CASES[case]
    dtype = np.dtype(dtype)
    shape_a, shape_b = COMPARE_SHAPES[shapes]
    model, feed = _two_input_case(op, dtype, shape_a, shape_b, dtype, attrs, seed=11)
    if op == "BitShift":
        feed["b"] = (feed["b"] % 9).astype(dtype)  # shifts up to 8 bits
    if op in ("Div", "Mod"):
        feed["b"] = np.where(feed["b"] == 0, 3, feed["b"]).astype(dtype)
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {f"tr_bcast_int_{cuda_ew.INT_DT[dtype.name]}"})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op, dtype", [("Not", np.bool_), ("BitwiseNot", np.int32),
                                       ("BitwiseNot", np.uint8), ("BitwiseNot", np.int64)])
def test_not_and_bitwise_not_are_numpys(op, dtype, device, signatures):
    rng = np.random.default_rng(2)
    x = _values(dtype, (3, 7), rng)
    model = make_model([helper.make_node(op, ["x"], ["y"])], {"x": (dtype, x.shape)},
                       {"y": (dtype, x.shape)})
    (got,), (want,), plan = run_both(model, {"x": x}, device)
    check_plan(plan, signatures, {f"tr_int_unary_{cuda_ew.INT_DT[np.dtype(dtype).name]}"})
    np.testing.assert_array_equal(got, want)


def test_attention_mask_chain_of_int64_ops_matches_numpy(device, signatures):
    """Hugging Face's extended mask: (1 - Cast(mask)) * min, from an int64 [B, S] mask compared
    and combined as integers, then cast to float."""
    rng = np.random.default_rng(4)
    mask = (rng.random((2, 6)) < 0.7).astype(np.int64)
    nodes = [helper.make_node("Unsqueeze", ["mask", "axes"], ["m4"]),
             helper.make_node("Sub", ["one", "m4"], ["inv"]),
             helper.make_node("Equal", ["inv", "one"], ["hit"]),
             helper.make_node("Not", ["hit"], ["keep"]),
             helper.make_node("Cast", ["keep"], ["kf"], to=TP.FLOAT),
             helper.make_node("Cast", ["inv"], ["invf"], to=TP.FLOAT),
             helper.make_node("Mul", ["invf", "big"], ["neg"]),
             helper.make_node("Add", ["neg", "kf"], ["y"])]
    model = make_model(nodes, {"mask": (np.int64, mask.shape)}, {"y": (np.float32, (2, 1, 1, 6))},
                       {"axes": np.array([1, 2], np.int64), "one": np.int64(1),
                        "big": np.float32(-3.4e38)})
    (got,), (want,), plan = run_both(model, {"mask": mask}, device)
    check_plan(plan, signatures, {"tr_bcast_int_i64", "tr_bcast_compare_i64", "tr_int_unary_bool",
                                  "tr_convert_bool_f32", "tr_convert_i64_f32"})
    np.testing.assert_array_equal(got, want)


# ---- Cast ---------------------------------------------------------------------------------------

CAST_NP = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16, "i32": np.int32,
           "i64": np.int64, "bool": np.bool_}


def _cast_inputs(src: str) -> np.ndarray:
    rng = np.random.default_rng(9)
    if src == "bool":
        return rng.random(40) < 0.5
    if src in ("i32", "i64"):
        v = np.concatenate([rng.integers(-3000, 3000, 36), [0, 1, -1, 2**24 + 1]])
        return v.astype(CAST_NP[src])
    v = np.concatenate([rng.standard_normal(34) * 100, [0.0, -0.0, 0.5, -0.5, 2.5, -1e-3]])
    return v.astype(np.float32).astype(CAST_NP[src])


@pytest.mark.parametrize("pair", cuda_ew.CAST_PAIRS, ids="_".join)
def test_cast_with_an_integer_or_bool_side_is_numpys(pair, device, signatures):
    src, dst = pair
    x = _cast_inputs(src).reshape(4, 10)
    model = make_model([helper.make_node("Cast", ["x"], ["y"], to=ELEM[np.dtype(CAST_NP[dst])])],
                       {"x": (CAST_NP[src], x.shape)}, {"y": (CAST_NP[dst], x.shape)})
    (got,), (want,), plan = run_both(model, {"x": x}, device)
    check_plan(plan, signatures, {f"tr_convert_{src}_{dst}"})
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_cast_like_takes_the_second_inputs_type(device, signatures):
    x = np.array([[0, 3, -2, 7]], np.int64)
    like = np.zeros((1,), np.float32)
    model = make_model([helper.make_node("CastLike", ["x", "like"], ["y"])],
                       {"x": (np.int64, x.shape), "like": (np.float32, like.shape)},
                       {"y": (np.float32, x.shape)})
    (got,), (want,), plan = run_both(model, {"x": x, "like": like}, device)
    check_plan(plan, signatures, {"tr_convert_i64_f32"})
    np.testing.assert_array_equal(got, want)


# ---- unary ops in a padded layout and in half storage ------------------------------------------

UNARY_CASES = {  # op: (attrs, ulps in fp32, the input's domain)
    "Sin": ({}, 4, "real"), "Cos": ({}, 4, "real"), "Tan": ({}, 4, "real"),
    "Asin": ({}, 4, "unit"), "Acos": ({}, 4, "unit"), "Atan": ({}, 4, "real"),
    "Sinh": ({}, 4, "real"), "Cosh": ({}, 4, "real"), "Asinh": ({}, 4, "real"),
    "Acosh": ({}, 4, "above_one"), "Atanh": ({}, 4, "unit"),
    "Reciprocal": ({}, 0, "real"), "Floor": ({}, 0, "real"), "Ceil": ({}, 0, "real"),
    "Round": ({}, 0, "halves"), "Celu": ({"alpha": 0.7}, 4, "real"),
    "Selu": ({}, 4, "real"), "Mish": ({}, 4, "real"), "Softsign": ({}, 0, "real"),
    "Shrink": ({"bias": 0.25, "lambd": 0.5}, 0, "real"),
    "ThresholdedRelu": ({"alpha": 0.3}, 0, "real"),
    "IsNaN": ({}, 0, "special"), "IsInf": ({}, 0, "special"),
    "IsInf_positive": ({"detect_negative": 0}, 0, "special"),
    "IsInf_negative": ({"detect_positive": 0}, 0, "special"),
}


def _unary_input(domain, shape, rng):
    x = rng.standard_normal(shape) * 2
    if domain == "unit":
        x = np.tanh(x)
    elif domain == "above_one":
        x = 1 + np.abs(x)
    elif domain == "halves":  # ties round to even
        x = np.round(x * 2) / 2
    elif domain == "special":
        x = np.where(rng.random(shape) < 0.3, rng.choice([np.inf, -np.inf, np.nan], shape), x)
    return x.astype(np.float32)


def _unary_model(case, dtype, conv: bool):
    op = case.split("_")[0]
    attrs = UNARY_CASES[case][0]
    out = np.bool_ if op in ("IsNaN", "IsInf") else dtype
    if conv:
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                 helper.make_node(op, ["c"], ["y"], **attrs)]
        return make_model(nodes, {"x": (dtype, (N, 3, H, W))}, {"y": (out, (N, C, H, W))},
                          {"w": CONV_W})
    return make_model([helper.make_node(op, ["c"], ["y"], **attrs)], {"c": (dtype, (N, C, W))},
                      {"y": (out, (N, C, W))})


@pytest.mark.parametrize("case", list(UNARY_CASES))
def test_unary_op_on_a_padded_feature_map_is_numpys(case, device, signatures):
    """After a Conv (channels-last, 5 channels padded to 8): the op reads and writes that
    layout, and its pads end zero (``zero_preserving`` or a ``tr_zero_lanes`` launch)."""
    _, ulps, domain = UNARY_CASES[case]
    rng = np.random.default_rng(len(case))
    feed = {"x": rng.standard_normal((N, 3, H, W)).astype(np.float32)}
    if domain != "real":  # the Conv's output is what the op reads: feed its domain directly
        model = _unary_model(case, np.float32, conv=False)
        feed = {"c": _unary_input(domain, (N, C, W), rng)}
    else:
        model = _unary_model(case, np.float32, conv=True)
    (got,), (want,), plan = run_both(model, feed, device)
    (node,) = [b for b in plan.executor.bound if b.node.op_type == case.split("_")[0]]
    assert node.calls and all(isinstance(c, Launch) for c in node.calls)
    check_plan(plan, signatures, set())
    if got.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
    else:
        assert_ulps(got, want, np.float32, ulps, case)


@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("case", [c for c in UNARY_CASES if not c.startswith("Is")])
def test_unary_op_in_half_storage_is_the_rounded_fp32_result(case, dt, device, signatures):
    dtype = LOW[dt]
    _, ulps, domain = UNARY_CASES[case]
    x = _unary_input(domain, (N, C, W), np.random.default_rng(1)).astype(dtype)
    sess = tr_onnx.InferenceSession(_unary_model(case, dtype, conv=False),
                                    backend=CudaBackend(device=device))
    (got,) = sess.run(None, {"c": x})
    (want,) = tr_onnx.InferenceSession(_unary_model(case, np.float32, conv=False)).run(
        None, {"c": x.astype(np.float32)})
    check_plan(sess.plan_for({"c": x}), signatures, {
        f"tr_{cuda_unary.ONNX_UNARY[case.split('_')[0]][0]}_fwd_{dt}"})
    assert_ulps(got, rounded(want, dtype), dtype, 1, case)


# ---- training: three SGD steps against numpy ----------------------------------------------------

def _param(rng, *shape, scale=0.5):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _se_block():
    """Squeeze (ReduceMean over the spatial axes) -> excite (a per-channel [1,C,1,1] scale,
    Sigmoid) -> the feature map times its [N,C,1,1] gate, on a compact map (``MatMul`` by a
    [W, W] weight in front). Its padded channels-last form after a Conv needs ReduceSum over
    the spatial axes of a padded map for the gate's gradient, which the reduce family's
    bindings do not take yet (``test_squeeze_excite_after_a_conv_trains_once_reduce_binds``)."""
    rng = np.random.default_rng(21)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["c"]),
             helper.make_node("ReduceMean", ["c", "spatial"], ["p"], keepdims=1),
             helper.make_node("Mul", ["p", "fc"], ["e"]),
             helper.make_node("Sigmoid", ["e"], ["g"]),
             helper.make_node("Mul", ["c", "g"], ["y"])]
    return nodes, {"w": _param(rng, W, W), "fc": _param(rng, 1, C, 1, 1),
                   "spatial": np.array([2, 3], np.int64)}, (N, C, H, W), (N, C, H, W)


def _se_block_after_conv():
    rng = np.random.default_rng(21)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"]),
             helper.make_node("Mul", ["p", "fc"], ["e"]),
             helper.make_node("Sigmoid", ["e"], ["g"]),
             helper.make_node("Mul", ["c", "g"], ["m"]),
             helper.make_node("Flatten", ["m"], ["f"]),
             helper.make_node("Gemm", ["f", "fc2"], ["y"])]
    return nodes, {"w": _param(rng, C, 3, 3, 3), "fc": _param(rng, 1, C, 1, 1),
                   "fc2": _param(rng, C * H * W, 4, scale=0.1)}, (N, 3, H, W), (N, 4)


def _rms_norm(exponent_form: bool):
    """x @ w -> h / sqrt(mean(h^2) + eps) * gamma, the mean of squares through Pow(h, 2) and
    the root through Sqrt or Pow(., 0.5) (T5, Llama exports)."""
    rng = np.random.default_rng(22)
    d = 6
    root = (helper.make_node("Pow", ["v", "half"], ["r"]) if exponent_form
            else helper.make_node("Sqrt", ["v"], ["r"]))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Pow", ["h", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["v"]), root,
             helper.make_node("Div", ["h", "r"], ["n"]),
             helper.make_node("Mul", ["n", "gamma"], ["y"])]
    inits = {"w": _param(rng, 5, d), "gamma": 1 + _param(rng, d, scale=0.1),
             "two": np.float32(2.0), "half": np.float32(0.5), "eps": np.float32(1e-6),
             "axes": np.array([-1], np.int64)}
    return nodes, inits, (3, 4, 5), (3, 4, d)


def _prelu_after_conv():
    """Conv -> PRelu with a per-channel [C,1,1] slope on the padded map -> Flatten -> Gemm:
    the slope's gradient is a column sum over every axis but the channels."""
    rng = np.random.default_rng(23)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("PRelu", ["c", "slope"], ["a"]),
             helper.make_node("Flatten", ["a"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"])]
    return nodes, {"w": _param(rng, C, 3, 3, 3), "slope": _param(rng, C, 1, 1, scale=0.2),
                   "fc": _param(rng, C * H * W, 4, scale=0.1)}, (N, 3, H, W), (N, 4)


def _variadic_extrema():
    """Max(conv, per-channel floor) then Min(that, a per-channel cap, a constant) and the Mean
    of it with the conv output and a constant shift, on the padded map: the extremum rules'
    Equal/And/Not/Or masks and Where of them, per-channel gradients (column sums; the shift
    stays constant: its gradient, a sum over the compact gradient's axes 0, 2, 3, is not one
    run of axes, which the reduce family's kernels take)."""
    rng = np.random.default_rng(24)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Max", ["c", "lo"], ["a"]),
             helper.make_node("Min", ["a", "hi", "cap"], ["b"]),
             helper.make_node("Mean", ["b", "c", "shift"], ["m"]),
             helper.make_node("Flatten", ["m"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"])]
    return nodes, {"w": _param(rng, C, 3, 3, 3), "lo": _param(rng, C, 1, 1),
                   "hi": 1 + _param(rng, 1, C, 1, 1), "cap": np.full((1, 1, 1, 1), 1.5,
                                                                      np.float32),
                   "shift": _param(rng, C, 1, 1), "fc": _param(rng, C * H * W, 4, scale=0.1)}, \
        (N, 3, H, W), (N, 4)


def _mod_and_sin():
    """Timestep-embedding style: Sin and Cos of a scaled input, and Mod of it."""
    rng = np.random.default_rng(25)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Sin", ["h"], ["s"]),
             helper.make_node("Cos", ["h"], ["co"]),
             helper.make_node("Mod", ["h", "period"], ["m"], fmod=1),
             helper.make_node("Sum", ["s", "co", "m"], ["y"])]
    return nodes, {"w": _param(rng, 5, 6), "period": np.float32(0.75)}, (3, 5), (3, 6)


TRAIN_CASES = {"squeeze_excite": _se_block, "rms_norm_sqrt": lambda: _rms_norm(False),
               "rms_norm_pow_half": lambda: _rms_norm(True), "prelu_after_conv": _prelu_after_conv,
               "variadic_extrema": _variadic_extrema, "sin_cos_mod": _mod_and_sin}
TRAIN_KERNELS = {"squeeze_excite": {"tr_bcast_binary_f32"},
                 "rms_norm_sqrt": {"tr_bcast_binary_f32"},
                 "rms_norm_pow_half": {"tr_bcast_binary_f32"},
                 "prelu_after_conv": {"tr_bcast_binary_f32", "tr_greater_f32"},
                 "variadic_extrema": {"tr_bcast_binary_f32", "tr_bcast_int_bool",
                                      "tr_int_unary_bool"},
                 "sin_cos_mod": {"tr_sin_fwd_f32", "tr_cos_fwd_f32"}}


def _train(case, steps=3, **kw):
    nodes, inits, x_shape, y_shape = (TRAIN_CASES.get(case) or _se_block_after_conv)()
    model = make_model(nodes, {"x": (np.float32, x_shape)}, {"y": (np.float32, y_shape)}, inits)
    # Max/Min/Mean operands are not parameters by default (only Add's, Mul's, PRelu's ports
    # are): train the per-channel bounds too, so the extremum rules' masks are built
    trainable = [k for k, v in inits.items() if np.ndim(v) and k not in ("cap", "shift", "axes",
                                                                         "spatial")]
    sess = tr_onnx.TrainingSession(model, loss="mse", optimizer=SGD(lr=0.05, momentum=0.9),
                                   channel_align=8, trainable=trainable, **kw)
    rng = np.random.default_rng(0)
    losses = [sess.train_step({"x": rng.standard_normal(x_shape).astype(np.float32)},
                              rng.standard_normal(y_shape).astype(np.float32))
              for _ in range(steps)]
    return sess, losses


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_three_sgd_steps_on_cuda_equal_numpys(case, device, signatures):
    ref, want = _train(case, backend="numpy")
    sess, got = _train(case, backend=CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.state_arrays(), ref.state_arrays()
    assert a.keys() == b.keys()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=2e-6, err_msg=name)
    check_plan(sess._state.active, signatures, TRAIN_KERNELS[case])


def test_squeeze_excite_after_a_conv_trains(device, signatures):
    ref, want = _train("squeeze_excite_after_conv", backend="numpy")
    sess, got = _train("squeeze_excite_after_conv", backend=CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    check_plan(sess._state.active, signatures, {"tr_bcast_binary_f32"})


# ---- Where ---------------------------------------------------------------------------------------

WHERE_CASES = {  # id: (cond shape, a shape, b shape, dtype)
    "attention_mask": ((N, 1, 1, 6), (N, 3, 6, 6), (), np.float32),
    "mask_first_axis": ((N, 1, 1), (N, 4, 5), (1, 4, 1), np.float16),
    "int64_select": ((3, 1), (3, 4), (1, 4), np.int64),
    "bool_values": ((2, 3, 1), (3, 4), (2, 1, 4), np.bool_),
}


@pytest.mark.parametrize("case", list(WHERE_CASES))
def test_where_of_broadcast_masks_copies_bit_patterns(case, device, signatures):
    shape_c, shape_a, shape_b, dtype = WHERE_CASES[case]
    rng = np.random.default_rng(6)
    feed = {"cond": rng.random(shape_c) < 0.5, "a": _values(dtype, shape_a, rng),
            "b": _values(dtype, shape_b, rng)}
    out = np.broadcast_shapes(shape_c, shape_a, shape_b)
    model = make_model([helper.make_node("Where", ["cond", "a", "b"], ["y"])],
                       {k: (v.dtype, v.shape) for k, v in feed.items()}, {"y": (dtype, out)})
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {f"tr_bcast_where_b{np.dtype(dtype).itemsize}"})
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_where_over_a_padded_map_and_a_compact_mask(device, signatures):
    rng = np.random.default_rng(8)
    feed = {"x": rng.standard_normal((N, 3, H, W)).astype(np.float32),
            "keep": rng.random((N, 1, H, 1)) < 0.5}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Where", ["keep", "c", "fill"], ["y"])]
    model = make_model(nodes, {k: (v.dtype, v.shape) for k, v in feed.items()},
                       {"y": (np.float32, (N, C, H, W))}, {"w": CONV_W,
                                                           "fill": np.float32(-2.5)})
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {"tr_bcast_where_b4", "tr_zero_lanes_b4"})
    np.testing.assert_array_equal(got, want)


# ---- legacy broadcasting, refusals ---------------------------------------------------------

@pytest.mark.parametrize("op, attrs, shape", [("PRelu", {}, (C,)),
                                              ("Add", {"broadcast": 1, "axis": 1}, (C,)),
                                              ("Mul", {"broadcast": 1, "axis": 1}, (C, H))])
def test_opset_6_axis_broadcast_is_converted_and_bound(op, attrs, shape, device, signatures):
    rng = np.random.default_rng(12)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(op, ["c", "s"], ["y"], **attrs)]
    model = make_model(nodes, {"x": (np.float32, (N, 3, H, W))},
                       {"y": (np.float32, (N, C, H, W))},
                       {"w": CONV_W, "s": rng.standard_normal(shape).astype(np.float32)},
                       opset=6)
    feed = {"x": rng.standard_normal((N, 3, H, W)).astype(np.float32)}
    (got,), (want,), plan = run_both(model, feed, device)
    check_plan(plan, signatures, {"tr_bcast_binary_f32"})
    np.testing.assert_array_equal(got, want)


REFUSED = {  # id: (op, input dtypes, output dtype, attrs, the reason's words)
    "cast_f16_to_bf16": ("Cast", (np.float16,), BFLOAT16, {"to": TP.BFLOAT16},
                         "Cast float16 -> bfloat16"),
    "pow_int_exponent": ("Pow", (np.float32, np.int64), np.float32, {}, "mixed dtypes"),
    "mean_of_ints": ("Mean", (np.int64, np.int64), np.int64, {}, "Mean of int64 operands"),
    "and_of_ints": ("And", (np.int32, np.int32), np.int32, {}, "And of int32 operands"),
    "float64_add": ("Add", (np.float64, np.float64), np.float64, {}, "dtype float64"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_forms_without_a_kernel_are_refused_with_the_reason(case, device):
    op, dtypes, out, attrs, words = REFUSED[case]
    names = [f"x{k}" for k in range(len(dtypes))]
    model = make_model([helper.make_node(op, names, ["y"], **attrs)],
                       {n: (d, (2, 3)) for n, d in zip(names, dtypes)}, {"y": (out, (2, 3))})
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    feed = {n: np.ones((2, 3), d) for n, d in zip(names, dtypes)}
    with pytest.raises(tr_onnx.backends.cuda.bind.CudaUnsupported) as info:
        sess.run(None, feed)
    assert words in str(info.value), str(info.value)
