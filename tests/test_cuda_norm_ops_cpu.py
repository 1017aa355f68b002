"""The cuda bindings of Instance/GroupNormalization, GroupNormGrad, MeanVarianceNormalization,
LpNormalization (backends/cuda/ops/normalization.py, kernels/normalization.cu) and of LRN /
LRNGrad (backends/cuda/ops/lrn.py, kernels/lrn.cu), checked without a GPU: single-node models
run on ``backend="cuda"`` through the host emulator (the kernels' g++ build, this family's
outputs poisoned with 0xFF before their node runs, so an unwritten element or padded lane
shows) against ``backend="numpy"``, and small CNNs trained three SGD steps on both.

The inputs reach the nodes channels-last and padded (a graph input of a spatial op: C = 5 or 6
lanes pad to 8; a Conv's output), plain (rank-2 [N, C]; MVN and LpNormalization, which follow
their input's layout), and mixed (a backward GroupNormGrad reading a compact x beside a
channels-last gy, as the layout pass plans torch's GroupNorm export).

Bounds, with u = 2^-24 (float32's unit roundoff) and e the storage type's epsilon (2^-23,
2^-10, 2^-7): |cuda - numpy| <= e |numpy| + k u max|numpy| elementwise, k per op:

* Instance/Group normalization, MVN (k = 64): the kernels sum in fp64, so their mean and
  variance are the float32 roundings of the exact ones; NumPy's float32 mean is a pairwise sum
  (error <= log2(M) u relative) and its sum of M squares accumulates float32 roundings
  (<= M u relative in the variance, M/2 u in the deviation). With M <= 96 elements per unit
  here, and the few roundings of the final (x - mean) / sd * scale + bias, 64 u of the
  largest output bounds the float32 difference (seen: below 2 u). In float16 / bfloat16 both
  compute in float32 and round once, so the e |numpy| term (one storage rounding) covers them.
* LpNormalization (k = 16): NumPy sums |x| or x^2 in the storage type (pairwise, float32 here,
  log2(m) + 1 roundings), the kernel in fp64; in float16 NumPy also rounds the squares, the
  norm and its square root to float16 (k = 0, three storage roundings: 3 e |numpy|).
* LRN / LRNGrad (k = 16): the window sums and every product in NumPy's order in float32, so
  they differ by powf only (1 ulp per call; LRNGrad makes size + 1 calls, each product of a
  window term keeps its own error). NumPy squares float16 / bfloat16 inputs in the storage
  type (its ufunc loop follows the input), the kernel in float32: one more storage rounding
  (2 e |numpy|).
* training: losses and parameters after three SGD steps rtol 1e-5 / atol 1e-6 (the model's
  Conv / Gemm run as their numpy kernels in the emulator; the normalizations add the bounds
  above, about 1e-6 of the activations, which three steps at lr 0.1 keep at that size).
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import HostEmulator, build_host_library

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int64): TensorProto.INT64}
FLOATS = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16}
EPS = {"f32": 2.0 ** -23, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}
U32 = 2.0 ** -24
FAMILY_OPS = {"InstanceNormalization", "GroupNormalization", "GroupNormGrad",
              "MeanVarianceNormalization", "LpNormalization", "LRN", "LRNGrad"}


class PoisoningEmulator(HostEmulator):
    """The emulator, where the outputs of this family's nodes hold 0xFF bytes (NaN) before the
    node first runs: an element or padded lane the kernels leave unwritten shows. When the
    next node's call comes, the finished node's outputs' padded lanes are checked (later, a
    recycled slot may hold another tensor): ``unzeroed`` lists those not zero."""

    def __init__(self, plan, lib):
        super().__init__(plan, lib)
        self.poisoned: set[str] = set()
        self.unzeroed: list[str] = []
        self.last: str | None = None

    def family_outputs(self, label: str | None) -> list:
        node = self.nodes.get(label) if label is not None else None
        if node is None or node.op_type not in FAMILY_OPS:
            return []
        return [self.plan.tensors[v.name] for v in node.outputs if v is not None]

    def replay(self, call) -> None:
        if call.node != self.last:
            self.unzeroed += [t.name for t in self.family_outputs(self.last)
                              if not pad_lanes_are_zero(self.arena, t)]
        if call.node not in self.poisoned:
            self.poisoned.add(call.node)
            for t in self.family_outputs(call.node):
                self.arena[t.offset:t.offset + t.nbytes] = 0xFF
        super().replay(call)
        self.last = call.node


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("norm_host"))


@pytest.fixture(scope="module")
def device(lib):
    return lambda plan: PoisoningEmulator(plan, lib)


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def check_plan(plan, signatures) -> set[str]:
    """The launches match their kernels' C signatures and this family's outputs had zero
    padded lanes once their node ran (the graph outputs: still have); returns the plan's
    kernel names."""
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    emulator = plan.executor.device
    assert not emulator.unzeroed
    for v in plan.graph.outputs:
        assert pad_lanes_are_zero(emulator.arena, plan.memory.tensors[v.name]), v.name
    return {c.kernel.name for c in launches}


def layout_of(plan, op_type: str, index: int = 0) -> str:
    """The layout kind of input ``index`` of the plan's ``op_type`` node."""
    node = next(n for n in plan.graph.nodes if n.op_type == op_type)
    return plan.memory.tensors[node.inputs[index].name].layout.kind


def assert_close(got, want, dt: str, k: float, storage_roundings: float = 1.0):
    """|got - want| <= storage_roundings e |want| + k u max|want| (the module docstring)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert g.shape == w.shape and np.all(np.isfinite(g))
    bound = storage_roundings * EPS[dt] * np.abs(w) + k * U32 * np.abs(w).max()
    excess = np.abs(g - w) - bound
    assert excess.max() <= 0, f"max |diff| {np.abs(g - w).max():.3g}, bound {bound.max():.3g}"


def data(shape, dt, seed=0, scale=1.0, shift=0.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
    return x.astype(FLOATS[dt])


def make_model(nodes, x: np.ndarray, inits: dict, y_shape, opset=18) -> onnx.ModelProto:
    """``nodes`` from graph input ``x`` to output ``y`` (typed like x, shape ``y_shape``)."""
    elem = ELEM[np.dtype(x.dtype)]
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info("x", elem, x.shape)],
        [helper.make_tensor_value_info("y", elem, y_shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def with_source(op_node, x: np.ndarray, source: str, inits: dict):
    """The nodes that feed ``x`` to ``op_node`` (which reads "h"): straight from the graph
    input ("input") or through a 3x3 Conv of as many channels ("conv", channels-last)."""
    if source == "input":
        return [helper.make_node("Identity", ["x"], ["h"]), op_node]
    c = x.shape[1]
    inits["cw"] = (0.3 * np.random.default_rng(5).standard_normal((c, c, 3, 3))).astype(x.dtype)
    return [helper.make_node("Conv", ["x", "cw"], ["h"], pads=[1, 1, 1, 1]), op_node]


def run_both(model, x, device):
    """(numpy's y, cuda's y, the cuda plan); the cuda plan runs twice (eager, then captured)."""
    want = tr_onnx.InferenceSession(model).run(None, {"x": x})[0]
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    sess.run(None, {"x": x})
    got = sess.run(None, {"x": x})[0]
    return want, got, sess.plan_for({"x": x})


# ---- Instance / Group normalization ------------------------------------------------------------

GROUP_NORM = [  # op, shape, groups (None: instance), epsilon, source
    ("InstanceNormalization", (2, 5, 4, 3), None, 1e-5, "input"),
    ("InstanceNormalization", (3, 8, 2, 2), None, 1e-2, "conv"),
    ("InstanceNormalization", (2, 6, 7), None, 1e-5, "input"),
    ("InstanceNormalization", (4, 3), None, 1e-5, "input"),
    ("GroupNormalization", (2, 6, 4, 3), 3, 1e-5, "input"),
    ("GroupNormalization", (2, 12, 3, 2), 4, 1e-3, "conv"),
    ("GroupNormalization", (2, 6, 4, 4), 1, 1e-5, "input"),
    ("GroupNormalization", (3, 10), 5, 1e-4, "input"),
]
GROUP_NORM_IDS = ["instance-c5-pads", "instance-conv", "instance-rank3", "instance-rank2",
                  "group3-c6-pads", "group4-conv", "one-group", "group5-rank2"]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("op, shape, groups, eps, source", GROUP_NORM, ids=GROUP_NORM_IDS)
def test_instance_and_group_norm_equal_numpy(device, signatures, op, shape, groups, eps,
                                             source, dt):
    x = data(shape, dt, scale=2.0, shift=0.5)
    c = shape[1]
    inits = {"s": data((c,), dt, seed=1, shift=1.0), "b": data((c,), dt, seed=2)}
    attrs = {"epsilon": eps} | ({"num_groups": groups} if groups else {})
    node = helper.make_node(op, ["h", "s", "b"], ["y"], **attrs)
    model = make_model(with_source(node, x, source, inits), x, inits, shape,
                       opset=21 if groups else 18)
    want, got, plan = run_both(model, x, device)
    assert_close(got, want, dt, k=64)
    assert f"tr_groupnorm_fwd_{dt}" in check_plan(plan, signatures)
    assert layout_of(plan, op) == ("plain" if len(shape) == 2 else "channels_last")


# ---- the kernels on their own: every layout of each operand, per-group parameters ------------
# (The layout pass gives a forward Instance/GroupNormalization channels-last maps, and onnx's
# checker refuses GroupNormalization-18, so these forms are called here directly.)

CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.float32: ctypes.c_float}


def call(lib, name: str, *args) -> None:
    """Host kernel ``name`` on NumPy arrays (pointers) and NumPy scalars (its C types)."""
    conv = [ctypes.c_void_p(None) if a is None else ctypes.c_void_p(a.ctypes.data)
            if isinstance(a, np.ndarray) else CTYPES[type(a)](a) for a in args]
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [type(a) for a in conv], None
    fn(*conv)


CP = 8  # the channel lanes of the channels-last maps here


def to_map(x: np.ndarray, layout: str, fill=np.nan) -> tuple[np.ndarray, list]:
    """[N, C, S] ``x`` as a compact NCHW or a channels-last [N, S, CP] buffer (padded lanes
    ``fill``: NaN where the kernels must not read them), and its (sn, ss, sc) strides."""
    n, c, s = x.shape
    if layout == "nchw":
        return x.copy(), [np.int64(c * s), np.int64(1), np.int64(s)]
    buf = np.full((n, s, CP), fill, x.dtype)
    buf[..., :c] = x.transpose(0, 2, 1)
    return buf, [np.int64(s * CP), np.int64(CP), np.int64(1)]


def from_map(buf: np.ndarray, layout: str, c: int) -> np.ndarray:
    """The [N, C, S] values of a ``to_map`` buffer; a channels-last one's padded lanes must
    have been written 0."""
    if layout == "nchw":
        return buf
    np.testing.assert_array_equal(buf[..., c:], 0)
    return buf[..., :c].transpose(0, 2, 1)


def group_norm_f64(x, scale, bias, gy, groups: int, eps: float):
    """float64 y, gx, gscale, gbias of [N, C, S] x with per-channel scale / bias."""
    n, c, s = x.shape
    xg = x.reshape(n, groups, -1)
    mean = xg.mean(axis=2, keepdims=True)
    inv = 1 / np.sqrt(((xg - mean) ** 2).mean(axis=2, keepdims=True) + eps)
    xhat = ((xg - mean) * inv).reshape(n, c, s)
    y = xhat * scale[:, None] + bias[:, None]
    g = (gy * scale[:, None]).reshape(n, groups, -1)
    xh = xhat.reshape(n, groups, -1)
    gx = (inv * (g - g.mean(axis=2, keepdims=True)
                 - xh * (g * xh).mean(axis=2, keepdims=True))).reshape(n, c, s)
    return y, gx, (gy * xhat).sum(axis=(0, 2)), gy.sum(axis=(0, 2))


LAYOUTS = [("nchw", "nchw", "nchw"), ("nhwc", "nhwc", "nhwc"), ("nchw", "nhwc", "nhwc"),
           ("nhwc", "nchw", "nchw")]


@pytest.mark.parametrize("per_group", [False, True], ids=["per-channel", "per-group"])
@pytest.mark.parametrize("x_layout, gy_layout, out_layout", LAYOUTS,
                         ids=["compact", "channels-last", "compact-x", "compact-gy"])
def test_group_norm_kernels_read_each_operand_in_its_layout(lib, x_layout, gy_layout,
                                                            out_layout, per_group):
    """tr_groupnorm_fwd / bwd_dx / bwd_params on [2, 6, 5] maps in 3 groups, each operand
    compact or channels-last (input pads NaN: never read; output pads written 0), against
    float64; per_group: one scale / bias per group (GroupNormalization-18, GroupNormGrad's
    per_group_params), the gradients summed over the group's channels. Bounds: the kernels'
    fp64 sums round once to float32; y and gx take a few float32 roundings more (16 u of the
    largest value), gscale and gbias are single roundings of fp64 sums of float32 products."""
    n, c, s, groups, eps = 2, 6, 5, 3, 1e-3
    cg = c // groups
    x, gy = data((n, c, s), "f32", seed=1, scale=2.0, shift=1.0), data((n, c, s), "f32", seed=2)
    params = groups if per_group else c
    scale, bias = data((params,), "f32", seed=3, shift=1.0), data((params,), "f32", seed=4)
    per_param = np.int64(cg if per_group else 1)
    scale_c, bias_c = (np.repeat(v, cg) if per_group else v for v in (scale, bias))
    y64, gx64, gs64, gb64 = group_norm_f64(*(v.astype(np.float64) for v in (x, scale_c, bias_c,
                                                                              gy)), groups, eps)
    if per_group:
        gs64, gb64 = gs64.reshape(groups, cg).sum(1), gb64.reshape(groups, cg).sum(1)
    xb, xs = to_map(x, x_layout)
    gyb, gys = to_map(gy, gy_layout)
    yb, ys = to_map(np.zeros_like(x), out_layout)
    gxb, gxs = to_map(np.zeros_like(x), out_layout)
    cp = np.int64(CP if out_layout == "nhwc" else c)
    shape = [np.int64(v) for v in (n, s, c, cg)] + [per_param]
    call(lib, "tr_groupnorm_fwd_f32", xb, scale, bias, yb, *shape, np.float32(eps), *xs, *ys, cp)
    mean, inv = np.full(n * groups, np.nan, np.float32), np.full(n * groups, np.nan, np.float32)
    call(lib, "tr_groupnorm_bwd_dx_f32", gyb, xb, scale, gxb, mean, inv, *shape,
         np.float32(eps), *xs, *gys, *gxs, cp)
    gscale, gbias = np.full(params + 2, np.nan, np.float32), np.full(params + 2, np.nan,
                                                                      np.float32)
    call(lib, "tr_groupnorm_bwd_params_f32", gyb, xb, mean, inv, gscale, gbias, *shape,
         np.int64(params + 2), *xs, *gys)
    for got, want in ((from_map(yb, out_layout, c), y64), (from_map(gxb, out_layout, c), gx64)):
        np.testing.assert_allclose(got, want, rtol=0, atol=16 * U32 * np.abs(want).max())
    np.testing.assert_array_equal(np.r_[gscale[params:], gbias[params:]], 0)  # padded lanes
    for got, want in ((gscale[:params], gs64), (gbias[:params], gb64)):
        np.testing.assert_allclose(got, want, rtol=4 * U32, atol=4 * U32 * np.abs(want).max())


@pytest.mark.parametrize("size", [3, 4, 5])
def test_lrn_kernels_give_every_layout_the_same_bits(lib, size):
    """LRN's window sums run in channel order whatever the layouts: x, gy and the output each
    compact or channels-last (input pads NaN, never read; output pads written 0) give the
    same bits, forward and backward."""
    n, c, s = 2, 5, 6
    x, gy = data((n, c, s), "f32", seed=5, scale=2.0), data((n, c, s), "f32", seed=6)
    window = [np.int32((size - 1) // 2), np.int32(size - 1 - (size - 1) // 2),
              np.float32(0.2 / size), np.float32(1.5), np.float32(-0.75)]
    dims = [np.int64(v) for v in (n, s, c)]
    out = []
    for x_layout, gy_layout, out_layout in LAYOUTS:
        (xb, xs), (gyb, gys) = to_map(x, x_layout), to_map(gy, gy_layout)
        (yb, ys), (gxb, gxs) = (to_map(np.full_like(x, np.nan), out_layout) for _ in range(2))
        lanes = np.int64(CP if out_layout == "nhwc" else c)
        call(lib, "tr_lrn_fwd_f32", xb, yb, *dims, *xs, *ys, lanes, *window)
        call(lib, "tr_lrn_bwd_f32", gyb, xb, gxb, *dims, *gys, *xs, *gxs, lanes, *window,
             np.float32(-1.75), np.float32(-2.0 * 0.75 * 0.2 / size))
        out.append(np.stack([from_map(yb, out_layout, c), from_map(gxb, out_layout, c)]))
    assert np.all(np.isfinite(out[0]))
    for o in out[1:]:
        np.testing.assert_array_equal(o, out[0])


# ---- MeanVarianceNormalization, LpNormalization ------------------------------------------------

MVN = [  # shape, axes, source
    ((2, 5, 4, 3), [0, 2, 3], "input"),
    ((2, 5, 4, 3), [1], "input"),
    ((3, 4, 2, 5), [2, 3], "input"),
    ((2, 6, 3, 3), [0, 2, 3], "conv"),
    ((4, 7), [0], "input"),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("shape, axes, source", MVN,
                         ids=["default-axes", "channels", "spatial", "conv-channels-last",
                              "rank2"])
def test_mean_variance_normalization_equals_numpy(device, signatures, shape, axes, source,
                                                  dt):
    x = data(shape, dt, scale=3.0, shift=-1.0)
    inits: dict = {}
    node = helper.make_node("MeanVarianceNormalization", ["h"], ["y"], axes=axes)
    want, got, plan = run_both(make_model(with_source(node, x, source, inits), x, inits,
                                          shape), x, device)
    assert_close(got, want, dt, k=64)
    assert f"tr_mvn_{dt}" in check_plan(plan, signatures)
    expect = "channels_last" if source == "conv" else "plain"
    assert layout_of(plan, "MeanVarianceNormalization") == expect


LP_NORM = [  # shape, axis, p, source
    ((2, 5, 4, 3), 1, 2, "input"),
    ((2, 5, 4, 3), -1, 1, "input"),
    ((2, 6, 3, 3), 1, 2, "conv"),
    ((2, 6, 3, 3), 2, 1, "conv"),
    ((5, 9), 0, 2, "input"),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("shape, axis, p, source", LP_NORM,
                         ids=["l2-channels", "l1-last", "l2-conv-channels", "l1-conv-height",
                              "l2-rank2-axis0"])
def test_lp_normalization_equals_numpy(device, signatures, shape, axis, p, source, dt):
    x = data(shape, dt)
    x.reshape(-1)[::7] = 0  # zeros in the rows, and below a row of zeros: y = 0
    inits: dict = {}
    node = helper.make_node("LpNormalization", ["h"], ["y"], axis=axis, p=p)
    want, got, plan = run_both(make_model(with_source(node, x, source, inits), x, inits,
                                          shape), x, device)
    assert_close(got, want, dt, k=16, storage_roundings=1.0 if dt == "f32" else 3.0)
    assert f"tr_lp_norm_{dt}" in check_plan(plan, signatures)


def test_lp_normalization_of_a_zero_row_is_zero(device, signatures):
    x = data((3, 4), "f32")
    x[1] = 0
    node = helper.make_node("LpNormalization", ["h"], ["y"], axis=1, p=2)
    want, got, plan = run_both(make_model(with_source(node, x, "input", {}), x, {}, x.shape),
                               x, device)
    np.testing.assert_array_equal(got[1], np.zeros(4, np.float32))
    assert_close(got, want, "f32", k=16)


# ---- LRN -----------------------------------------------------------------------------------------

LRN = [  # shape, size, alpha, beta, bias, source
    ((2, 5, 4, 3), 3, 1e-2, 0.75, 1.0, "input"),
    ((2, 8, 3, 3), 5, 1e-1, 0.5, 2.0, "conv"),
    ((2, 6, 3, 2), 4, 2e-1, 0.75, 1.0, "input"),  # even size: the window leans up
    ((3, 2, 2, 2), 5, 1e-1, 1.0, 1.5, "input"),  # a window wider than the channels
]
LRN_IDS = ["size3-c5-pads", "size5-conv", "even-size", "window-wider-than-c"]


def _lrn_node(size, alpha, beta, bias):
    return helper.make_node("LRN", ["h"], ["y"], size=size, alpha=alpha, beta=beta, bias=bias)


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("shape, size, alpha, beta, bias, source", LRN, ids=LRN_IDS)
def test_lrn_equals_numpy(device, signatures, shape, size, alpha, beta, bias, source, dt):
    x = data(shape, dt, scale=2.0)
    inits: dict = {}
    model = make_model(with_source(_lrn_node(size, alpha, beta, bias), x, source, inits), x,
                       inits, shape)
    want, got, plan = run_both(model, x, device)
    assert_close(got, want, dt, k=16, storage_roundings=1.0 if dt == "f32" else 2.0)
    assert check_plan(plan, signatures) >= {f"tr_lrn_fwd_{dt}"}
    assert layout_of(plan, "LRN") == "channels_last"


# ---- training: three SGD steps on cuda (emulated) against numpy ---------------------------------

N, CI, C, H, W, G, K = 4, 3, 6, 5, 4, 3, 5  # C = 6 channels pad to 8 lanes


def cnn(norm: list, inits: dict, conv_bias=True, opset=18) -> onnx.ModelProto:
    """input [N, CI, H, W] -> Conv (C channels, channels-last) -> ``norm`` nodes (from "c" to
    "n") -> Relu -> Flatten -> Gemm -> scores [N, K]."""
    rng = np.random.default_rng(11)
    inits = {"cw": (0.4 * rng.standard_normal((C, CI, 3, 3))).astype(np.float32),
             "cb": (0.1 * rng.standard_normal(C)).astype(np.float32),
             "fw": (0.2 * rng.standard_normal((C * H * W, K))).astype(np.float32), **inits}
    if not conv_bias:
        del inits["cb"]
    nodes = [helper.make_node("Conv", ["input", "cw", "cb"][:3 if conv_bias else 2], ["c"],
                              pads=[1, 1, 1, 1]), *norm,
             helper.make_node("Relu", ["n"], ["a"]), helper.make_node("Flatten", ["a"], ["f"]),
             helper.make_node("Gemm", ["f", "fw"], ["scores"])]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, CI, H, W])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [N, K])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
        value_info=[helper.make_tensor_value_info("n", TensorProto.FLOAT, [N, C, H, W])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _vector(seed, shape, shift=0.0):
    return (shift + 0.1 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def torch_group_norm(affine_after: bool) -> onnx.ModelProto:
    """nn.GroupNorm(G, C) as torch.onnx.export(dynamo=False) writes it: Reshape to [N, G, -1],
    InstanceNormalization over the groups, Reshape back, then (``affine_after``) the affine
    Mul / Add with [C, 1, 1] weights. Without it, trained per-group scale and bias on the
    InstanceNormalization instead, and a Conv without bias (the model's only bias gradients
    are then GroupNormGrad's, which need no ReduceSum over the batch and spatial axes)."""
    inits = {"groups": np.array([0, G, -1])}
    if affine_after:
        inits |= {"ones": np.ones(G, np.float32), "zeros": np.zeros(G, np.float32),
                  "gw": _vector(12, (C, 1, 1), 1.0), "gb": _vector(13, (C, 1, 1))}
    else:
        inits |= {"ones": _vector(12, (G,), 1.0), "zeros": _vector(13, (G,))}
    nodes = [helper.make_node("Reshape", ["c", "groups"], ["r"]),
             helper.make_node("InstanceNormalization", ["r", "ones", "zeros"], ["i"],
                              epsilon=1e-5),
             helper.make_node("Shape", ["c"], ["cs"]),
             helper.make_node("Reshape", ["i", "cs"], ["n" if not affine_after else "r2"])]
    if affine_after:
        nodes += [helper.make_node("Mul", ["r2", "gw"], ["m"]),
                  helper.make_node("Add", ["m", "gb"], ["n"])]
    return cnn(nodes, inits, conv_bias=affine_after)


GN_GRAD = {"tr_groupnorm_fwd_f32", "tr_groupnorm_bwd_dx_f32", "tr_groupnorm_bwd_params_f32"}
TRAIN = {  # model, kernels it must launch
    "instance-norm": (lambda: cnn(
        [helper.make_node("InstanceNormalization", ["c", "s", "b"], ["n"], epsilon=1e-3)],
        {"s": _vector(12, (C,), 1.0), "b": _vector(13, (C,))}), GN_GRAD),
    "group-norm-21": (lambda: cnn(
        [helper.make_node("GroupNormalization", ["c", "s", "b"], ["n"], num_groups=G,
                          epsilon=1e-4)],
        {"s": _vector(12, (C,), 1.0), "b": _vector(13, (C,))}, opset=21), GN_GRAD),
    # GroupNormGrad reads the compact Reshape output x beside a channels-last gy
    "torch-group-norm-group-params": (lambda: torch_group_norm(False), GN_GRAD),
    "torch-group-norm": (lambda: torch_group_norm(True),
                         {"tr_groupnorm_fwd_f32", "tr_groupnorm_bwd_dx_f32"}),
    "lrn": (lambda: cnn([helper.make_node("LRN", ["c"], ["n"], size=3, alpha=0.1, beta=0.75,
                                          bias=1.0)], {}), {"tr_lrn_fwd_f32", "tr_lrn_bwd_f32"}),
    "mvn": (lambda: cnn([helper.make_node("MeanVarianceNormalization", ["c"], ["n"])], {}),
            {"tr_mvn_f32"}),
    "lp-norm": (lambda: cnn([helper.make_node("LpNormalization", ["c"], ["n"], axis=1, p=2)],
                            {}), {"tr_lp_norm_f32"}),
}


def _batches(steps=3):
    rng = np.random.default_rng(10)
    return [({"input": rng.standard_normal((N, CI, H, W)).astype(np.float32)},
             rng.integers(0, K, N)) for _ in range(steps)]


def train(model, backend, **kw):
    sess = tr_onnx.TrainingSession(model, loss="cross_entropy", optimizer=SGD(lr=0.1),
                                   backend=backend, **kw)
    return sess, [sess.train_step(*b) for b in _batches()]


@pytest.mark.parametrize("case", list(TRAIN))
def test_three_sgd_steps_on_cuda_equal_numpy(device, signatures, case):
    make, kernels = TRAIN[case]
    ref, want = train(make(), "numpy")
    sess, got = train(make(), CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert kernels <= check_plan(sess._state.active, signatures)
