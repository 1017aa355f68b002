"""The cuda bindings of the indexing family (backends/cuda/ops/indexing.py, kernels/indexing.cu)
and of NegativeLogLikelihoodLoss (backends/cuda/ops/losses.py, kernels/losses.cu), checked
without a GPU: single-node models run on ``backend="cuda"`` through the host emulator (the
kernels' g++ build) against ``backend="numpy"``, and small models trained three SGD steps on
both.

Tolerances, per kernel:

* gathers, scatters without reduction, TopK, OneHot, ReverseSequence: data movement, so
  bit-exact (compared as bit patterns).
* scatter reductions (ScatterElements / ScatterND add, mul, max, min; GatherNDGrad): every
  output element is one thread applying its updates in NumPy's order, rounding to the storage
  type after each step as ``np.add.at`` on that dtype does: bit-exact, duplicates included.
* NegativeLogLikelihoodLoss: per-row losses (reduction none) and every gradient of none / sum
  are NumPy's arithmetic, bit-exact; the sum and mean add the rows in double where NumPy adds
  float32 pairwise, so the reduced loss is within 2 ulp of float32 (rtol 3e-7 on these sizes;
  in float16 / bfloat16 storage one step of the storage type). A mean's gradient divides by
  that sum: exact here (integer weights), rtol 3e-7 with fractional ones.
* training: losses and parameters after three SGD steps rtol 1e-5 / atol 1e-7 (the model's
  Gemm/MatMul run as their numpy kernels in the emulator; the indexing kernels add no error,
  the loss sums at most 2 ulp).
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
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.int32): TensorProto.INT32, np.dtype(np.float64): TensorProto.DOUBLE}
FLOATS = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("indexing_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def single_node(op: str, feeds: dict, consts: dict, attrs: dict, outputs: list[str],
                opset: int = 18, order: list[str] | None = None) -> onnx.ModelProto:
    """A model of one ``op`` node over graph inputs ``feeds`` and initializers ``consts``
    (inputs in ``order``, default feeds then consts; '' for an absent one), outputs typed by
    ONNX shape inference."""
    inputs = [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
              for k, v in feeds.items()]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    node = helper.make_node(op, order or [*feeds, *consts], outputs, **attrs)
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return typed_outputs(model, outputs)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def run_both(model, feeds, device, signatures):
    """(numpy's outputs, cuda's outputs, the cuda plan's kernel names); the launches' arguments
    checked against the kernels' C signatures."""
    return (tr_onnx.InferenceSession(model).run(None, feeds),
            *run_cuda(model, feeds, device, signatures))


def run_cuda(model, feeds, device, signatures):
    """(the cuda session's outputs, its plan's kernel names), the launches checked."""
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, feeds)
    plan = sess.plan_for(feeds)
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    return got, [c.kernel.name for c in launches]


def assert_bits_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(bits(g), bits(w))


def data(shape, dt, seed=0, integers=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, shape) if integers else rng.standard_normal(shape)
    return x.astype(FLOATS[dt] if dt in FLOATS else dt)


# ---- GatherElements ----------------------------------------------------------------------------

GATHER_ELEMENTS = [  # data shape, indices shape, axis, index dtype
    ((3, 4, 5), (3, 2, 5), 1, np.int64),
    ((3, 4, 5), (2, 4, 3), 0, np.int32),
    ((3, 4, 5), (3, 4, 7), -1, np.int64),
    ((6,), (9,), 0, np.int64),
    ((2, 3, 2, 2, 2, 3), (2, 3, 2, 1, 2, 3), 3, np.int64),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("shape, ishape, axis, itype", GATHER_ELEMENTS,
                         ids=["axis1", "axis0-i32", "last-axis-longer", "1d", "rank6"])
def test_gather_elements_equals_numpy_bit_for_bit(device, signatures, shape, ishape, axis,
                                                   itype, dt):
    x = data(shape, dt)
    dim = shape[axis]
    idx = np.random.default_rng(1).integers(-dim, dim, ishape).astype(itype)  # negatives too
    model = single_node("GatherElements", {"x": x, "i": idx}, {}, {"axis": axis}, ["y"])
    want, got, names = run_both(model, {"x": x, "i": idx}, device, signatures)
    assert_bits_equal(got, want)
    size = np.dtype(x.dtype).itemsize
    assert names == [f"tr_gather_elements_b{size}_{'i64' if itype == np.int64 else 'i32'}"]


# ---- ScatterElements / Scatter -----------------------------------------------------------------

SCATTER_ELEMENTS = [  # data shape, indices shape, axis
    ((3, 4, 5), (3, 6, 2), 1),
    ((4, 3), (7, 3), 0),
    ((2, 3, 4), (2, 3, 9), -1),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("shape, ishape, axis", SCATTER_ELEMENTS,
                         ids=["axis1-duplicates", "axis0", "last-axis"])
def test_scatter_elements_equals_numpy_bit_for_bit_with_repeated_indices(
        device, signatures, shape, ishape, axis, reduction, dt):
    x = data(shape, dt)
    dim = shape[axis]
    idx = np.random.default_rng(2).integers(-dim, dim, ishape)  # more updates than slots
    u = data(ishape, dt, seed=3)
    model = single_node("ScatterElements", {"x": x, "i": idx, "u": u}, {},
                        {"axis": axis, "reduction": reduction}, ["y"])
    want, got, names = run_both(model, {"x": x, "i": idx, "u": u}, device, signatures)
    assert_bits_equal(got, want)
    kind = f"b{np.dtype(x.dtype).itemsize}" if reduction == "none" else dt
    assert names == [f"tr_scatter_elements_{kind}_i64"]


def test_opset_9_scatter_runs_the_scatter_elements_kernel(device, signatures):
    x, u = data((4, 5), "f32"), data((4, 2), "f32", seed=1)
    idx = np.array([[0, 4], [1, 3], [2, 2], [-1, 0]], np.int32)
    model = single_node("Scatter", {"x": x, "i": idx, "u": u}, {}, {"axis": 1}, ["y"], opset=9)
    want, got, names = run_both(model, {"x": x, "i": idx, "u": u}, device, signatures)
    assert_bits_equal(got, want)
    assert names == ["tr_scatter_elements_b4_i32"]


# ---- GatherND / ScatterND ----------------------------------------------------------------------

GATHER_ND = [  # data shape, indices shape, batch_dims
    ((2, 3, 4, 5), (2, 6, 1), 1),
    ((2, 3, 4, 5), (7, 2), 0),
    ((2, 3, 4), (2, 3, 1), 2),
    ((4, 6), (3, 5, 2), 0),
    ((5, 7, 3), (5, 1), 1),  # Hugging Face's last-token pooling: one position per batch row
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("shape, ishape, batch_dims", GATHER_ND,
                         ids=["batch1-k1", "k2", "batch2", "element-tuples", "last-token"])
def test_gather_nd_equals_numpy_bit_for_bit(device, signatures, shape, ishape, batch_dims, dt):
    x = data(shape, dt)
    k = ishape[-1]
    dims = np.array(shape[batch_dims:batch_dims + k])
    rng = np.random.default_rng(4)
    idx = (rng.integers(0, 1 << 20, ishape) % (2 * dims) - dims).astype(np.int64)
    model = single_node("GatherND", {"x": x, "i": idx}, {}, {"batch_dims": batch_dims}, ["y"])
    want, got, names = run_both(model, {"x": x, "i": idx}, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_gather_nd_b{np.dtype(x.dtype).itemsize}_i64"]


SCATTER_ND = [  # data shape, indices shape (repeated tuples), opset
    ((4, 3, 2), (5, 1)),
    ((4, 3, 2), (2, 3, 2)),
    ((4, 3), (6, 2)),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("shape, ishape", SCATTER_ND, ids=["rows", "k2-batched", "elements"])
def test_scatter_nd_equals_numpy_bit_for_bit_with_repeated_tuples(device, signatures, shape,
                                                                   ishape, reduction, dt):
    x = data(shape, dt)
    k = ishape[-1]
    dims = np.array(shape[:k])
    idx = (np.random.default_rng(5).integers(0, 1 << 20, ishape) % (2 * dims) - dims)
    u = data(ishape[:-1] + shape[k:], dt, seed=6)
    model = single_node("ScatterND", {"x": x, "i": idx, "u": u}, {}, {"reduction": reduction},
                        ["y"])
    want, got, names = run_both(model, {"x": x, "i": idx, "u": u}, device, signatures)
    assert_bits_equal(got, want)
    kind = f"b{np.dtype(x.dtype).itemsize}" if reduction == "none" else dt
    assert names == [f"tr_scatter_nd_{kind}_i64"]


# ---- TopK --------------------------------------------------------------------------------------

TOP_K = [  # shape, axis, k, integer-valued data (ties)
    ((3, 8), -1, 3, False),
    ((3, 8, 2), 1, 5, True),
    ((6, 4), 0, 6, True),
    ((2, 5), 1, 5, False),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("largest", [1, 0], ids=["largest", "smallest"])
@pytest.mark.parametrize("shape, axis, k, ties", TOP_K,
                         ids=["last-axis", "middle-axis-ties", "axis0-all-ties", "k-equals-n"])
def test_top_k_values_and_indices_equal_numpy_ties_included(device, signatures, shape, axis,
                                                             k, ties, largest, dt):
    x = data(shape, dt, integers=ties)
    model = single_node("TopK", {"x": x}, {"k": np.array([k])},
                        {"axis": axis, "largest": largest}, ["v", "i"])
    want, got, names = run_both(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_top_k_{dt}"]


def test_top_k_puts_nan_above_every_number_as_numpy_sorts(device, signatures):
    x = np.array([[1.0, np.nan, 3.0, -np.inf, np.nan, 3.0]], np.float32)
    for largest in (1, 0):
        model = single_node("TopK", {"x": x}, {"k": np.array([4])}, {"largest": largest},
                            ["v", "i"])
        want, got, _ = run_both(model, {"x": x}, device, signatures)
        assert_bits_equal(got, want)


# ---- OneHot, ReverseSequence -------------------------------------------------------------------

@pytest.mark.parametrize("ishape, axis, itype, vtype", [
    ((4, 2), 1, np.int64, np.float32), ((5,), -1, np.int32, np.float16),
    ((2, 3), 0, np.int64, np.int64)], ids=["axis1", "last-i32-f16", "axis0-int64-values"])
def test_one_hot_equals_numpy(device, signatures, ishape, axis, itype, vtype):
    depth = 4
    idx = np.random.default_rng(7).integers(-depth - 1, depth + 1, ishape).astype(itype)
    vals = np.array([-2, 5], vtype)
    model = single_node("OneHot", {"i": idx}, {"d": np.array(depth), "v": vals}, {"axis": axis},
                        ["y"])
    want, got, names = run_both(model, {"i": idx}, device, signatures)
    assert_bits_equal(got, want)
    suffix = "i64" if itype == np.int64 else "i32"
    assert names == [f"tr_one_hot_b{np.dtype(vtype).itemsize}_{suffix}"]


@pytest.mark.parametrize("shape, time_axis, batch_axis, lens", [
    ((5, 3, 2), 0, 1, [5, 2, 0]), ((3, 6), 1, 0, [1, 6, 4]), ((4, 2, 3, 2), 0, 1, [3, 4])],
    ids=["time-major", "batch-major", "rank4"])
def test_reverse_sequence_equals_numpy(device, signatures, shape, time_axis, batch_axis, lens):
    x = data(shape, "f16")
    feeds = {"x": x, "l": np.array(lens, np.int64)}
    model = single_node("ReverseSequence", feeds, {},
                        {"time_axis": time_axis, "batch_axis": batch_axis}, ["y"])
    want, got, names = run_both(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    assert names == ["tr_reverse_sequence_b2_i64"]


# ---- NegativeLogLikelihoodLoss (inference) -----------------------------------------------------

NLL = [  # scores shape, weighted, ignore_index
    ((6, 5), False, None),
    ((6, 5), True, 2),
    ((3, 4, 2, 3), True, None),
    ((3, 4, 5), False, 1),
]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape, weighted, ignore", NLL,
                         ids=["nc", "nc-weights-ignore", "ncd1d2-weights", "ncd-ignore"])
def test_negative_log_likelihood_equals_numpy(device, signatures, shape, weighted, ignore,
                                              reduction, dt):
    x = data(shape, dt)
    labels = np.random.default_rng(8).integers(0, shape[1], (shape[0], *shape[2:]))
    if ignore is not None:
        labels.reshape(-1)[::3] = ignore
    consts = {"w": np.arange(1, shape[1] + 1).astype(x.dtype)} if weighted else {}
    attrs = {"reduction": reduction} | ({"ignore_index": ignore} if ignore is not None else {})
    model = single_node("NegativeLogLikelihoodLoss", {"x": x, "t": labels}, consts, attrs,
                        ["loss"])
    got, names = run_cuda(model, {"x": x, "t": labels}, device, signatures)
    want = tr_onnx.InferenceSession(model).run(None, {"x": x, "t": labels}) \
        if dt == "f32" else None
    if dt != "f32":
        # the NumPy kernel computes in float32 but cannot store float16 / bfloat16 losses
        # (a refused cast): the reference is the float32 model, rounded to the storage type
        x32 = x.astype(np.float32)
        model32 = single_node("NegativeLogLikelihoodLoss", {"x": x32, "t": labels},
                              {k: v.astype(np.float32) for k, v in consts.items()}, attrs,
                              ["loss"])
        want = [w.astype(x.dtype) for w in
                tr_onnx.InferenceSession(model32).run(None, {"x": x32, "t": labels})]
    if reduction == "none":
        assert_bits_equal(got, want)
    else:  # double sums against NumPy's pairwise float32 ones: 2 ulp of float32, then storage
        rtol = {"f32": 3e-7, "f16": 2 ** -10, "bf16": 2 ** -7}[dt]
        np.testing.assert_allclose(got[0].astype(np.float64), want[0].astype(np.float64),
                                   rtol=rtol)
    # (a bfloat16 initializer is a float32 one and a Cast: tr_convert_f32_bf16 runs first)
    reduce = [f"tr_nll_reduce_{dt}"] if reduction != "none" else []
    assert [n for n in names if not n.startswith("tr_convert")] == [f"tr_nll_fwd_{dt}_i64",
                                                                    *reduce]


# ---- training: three SGD steps on cuda (emulated) against numpy --------------------------------

N, F, C = 4, 6, 5


def gemm_model(nodes: list, inits: dict, out_shape, hidden=C) -> onnx.ModelProto:
    """input [N, F] -> Gemm(w: [F, hidden]) -> h, then ``nodes`` -> scores ``out_shape``."""
    w = (0.5 * np.random.default_rng(9).standard_normal((F, hidden))).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["input", "w"], ["h"]), *nodes], "m",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(v, k) for k, v in {"w": w, **inits}.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def nll_loss_model(scores_shape, labels_shape, attrs, log_softmax=True, weights=None):
    """An ONNX loss model: (scores, labels) -> [LogSoftmax ->] NegativeLogLikelihoodLoss."""
    nodes, inits, src = [], [], "scores"
    if log_softmax:
        nodes.append(helper.make_node("LogSoftmax", ["scores"], ["logp"], axis=1))
        src = "logp"
    ins = [src, "labels"]
    if weights is not None:
        inits.append(numpy_helper.from_array(weights, "class_w"))
        ins.append("class_w")
    nodes.append(helper.make_node("NegativeLogLikelihoodLoss", ins, ["loss"], **attrs))
    graph = helper.make_graph(
        nodes, "loss",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, scores_shape),
         helper.make_tensor_value_info("labels", TensorProto.INT64, labels_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _batches(label_shape, classes, steps=3):
    rng = np.random.default_rng(10)
    return [({"input": rng.standard_normal((N, F)).astype(np.float32)},
             rng.integers(0, classes, label_shape)) for _ in range(steps)]


GATHER_IDX = np.array([[0, 0, 3], [1, 4, 4], [2, 2, 2], [-1, 0, 1]], np.int64)
TRAIN = {
    # GatherElements with repeated indices: its gradient scatter-adds them (ScatterElements add)
    "gather-elements": (lambda: gemm_model(
        [helper.make_node("GatherElements", ["h", "idx"], ["scores"], axis=1)],
        {"idx": GATHER_IDX}, [N, 3]), "cross_entropy", (N,), 3,
        {"tr_gather_elements_b4_i64", "tr_scatter_elements_f32_i64"}),
    # Hugging Face's pooling of the last token: GatherND with batch_dims 1 picks one row of
    # [N, T, H] per batch entry; its gradient is GatherNDGrad
    "gather-nd-last-token": (lambda: gemm_model(
        [helper.make_node("Reshape", ["h", "thw"], ["h3"]),
         helper.make_node("GatherND", ["h3", "last"], ["scores"], batch_dims=1)],
        {"thw": np.array([N, 3, 4]), "last": np.array([[2], [0], [1], [-1]])}, [N, 4],
        hidden=12), "cross_entropy", (N,), 4,
        {"tr_gather_nd_b4_i64", "tr_zero_lanes_b4", "tr_scatter_nd_f32_i64"}),
    # ScatterND of a second projection's rows into the first's: gradients through both
    # inputs (ScatterND of zeros for the data, GatherND for the updates)
    "scatter-nd": (lambda: gemm_model(
        [helper.make_node("Gather", ["h", "rows_of"], ["rows"], axis=0),
         helper.make_node("Mul", ["rows", "two"], ["upd"]),
         helper.make_node("ScatterND", ["h", "rows_at", "upd"], ["scores"])],
        {"rows_of": np.array([1, 2]), "two": np.array(2.0, np.float32),
         "rows_at": np.array([[3], [0]])}, [N, C]),
        "cross_entropy", (N,), C, {"tr_scatter_nd_b4_i64", "tr_gather_nd_b4_i64"}),
    # TopK of the scores: its gradient scatters the values' gradient back (ScatterElements)
    "top-k": (lambda: gemm_model(
        [helper.make_node("TopK", ["h", "k"], ["scores", "where"], axis=1)],
        {"k": np.array([3])}, [N, 3]), "cross_entropy", (N,), 3,
        {"tr_top_k_f32", "tr_scatter_elements_b4_i64"}),
    # a custom loss: LogSoftmax + NegativeLogLikelihoodLoss, mean, class weights, ignore_index
    "nll-mean-weights-ignore": (lambda: gemm_model([helper.make_node("Identity", ["h"],
                                                                     ["scores"])], {}, [N, C]),
                                nll_loss_model([N, C], [N], {"reduction": "mean",
                                                             "ignore_index": 1},
                                               weights=np.arange(1, C + 1, dtype=np.float32)),
                                (N,), C, {"tr_nll_fwd_f32_i64", "tr_nll_bwd_f32_i64"}),
    "nll-sum": (lambda: gemm_model([helper.make_node("Identity", ["h"], ["scores"])], {},
                                   [N, C]),
                nll_loss_model([N, C], [N], {"reduction": "sum"}), (N,), C,
                {"tr_nll_fwd_f32_i64", "tr_nll_reduce_f32", "tr_nll_bwd_f32_i64"}),
    # PyTorch's [N, C, L] sequence scores into the builtin cross-entropy: compact rows whose
    # classes are L apart (softmax cross-entropy and its gradient read them strided)
    "sce-ncd": (lambda: gemm_model([helper.make_node("Reshape", ["h", "ncd"], ["scores"])],
                                   {"ncd": np.array([N, 3, 2])}, [N, 3, 2], hidden=6),
                "cross_entropy", (N, 2), 3, {"tr_sce_fwd_f32", "tr_sce_bwd_f32"}),
    # [N, C, D] scores straight into the loss (no LogSoftmax: the rows are class-strided)
    "nll-ncd": (lambda: gemm_model([helper.make_node("Reshape", ["h", "ncd"], ["scores"])],
                                   {"ncd": np.array([N, 3, 2])}, [N, 3, 2], hidden=6),
                nll_loss_model([N, 3, 2], [N, 2], {"reduction": "mean"}, log_softmax=False),
                (N, 2), 3, {"tr_nll_fwd_f32_i64", "tr_nll_bwd_f32_i64"}),
}


def train(case, backend, **kw):
    make, loss, label_shape, classes, _ = TRAIN[case]
    sess = tr_onnx.TrainingSession(make(), loss=loss, optimizer=SGD(lr=0.1), backend=backend,
                                   **kw)
    return sess, [sess.train_step(*b) for b in _batches(label_shape, classes)]


@pytest.mark.parametrize("case", list(TRAIN))
def test_three_sgd_steps_on_cuda_equal_numpy(device, signatures, case):
    ref, want = train(case, "numpy")
    sess, got = train(case, CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() and "w" in b
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    assert TRAIN[case][-1] <= {c.kernel.name for c in launches}
