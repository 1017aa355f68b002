"""The cuda bindings of the tensor family (backends/cuda/ops/tensor.py, kernels/tensor.cu) added
for issue 30, checked without a GPU: single-node models on ``backend="cuda"`` through the host
emulator (the kernels' g++ build) against ``backend="numpy"``, compact and channels-last (a Conv
with 5 output channels before the node and ``channel_align=8``: the node reads and writes
``[N, H, W, 8]`` maps whose padded lanes must stay zero), every launch's arguments checked
against its kernel's C signature, the launched kernels named; the forms still refused
(``CudaUnsupported`` with the reason); then models trained three SGD steps on both backends:
one per differentiable op of the family (its gradient rule's ops run on cuda: Split's
zeros and Concat, Concat's Split, Slice's Pad and SliceGrad, Pad's PadGrad, CumProdGrad...)
and a CNN whose channel Concat and reflect Pad backprop through padded NHWC maps.

Tolerances, per kernel:

* Split, Slice, SliceGrad, Pad, Expand, Tile, Transpose, DepthToSpace, SpaceToDepth, Trilu,
  and the plan-time values (Constant, ConstantOfShape, Shape, Size, Range, EyeLike): data
  movement or NumPy's own values, so bit-exact (compared as bit patterns). Range computes
  float32 values in double, as NumPy's float64 then cast.
* CumSum / CumProd: float32 and the integers bit-exact (one sequential fp32 / long long pass
  per line, as NumPy's ``cumsum``/``cumprod`` in float32); float16 / bfloat16 keep the running
  value in fp32 where NumPy rounds it to the storage type at every step, so both are compared
  with the float64 scan of the same inputs: within one step of the storage type (2 ** -10 /
  2 ** -7) relative, plus that step times the largest magnitude of the scan absolute.
* PadGrad adds each element's terms (at most prod(1 + pads) of them) in fp32, NumPy axis by
  axis in the storage type: rtol 5e-7 (float32) or one step of the storage type
  (float16 2 ** -10, bfloat16 2 ** -7), plus an atol of that step times the largest term times
  the number of terms (NumPy rounds each partial sum).
* CumProdGrad: NumPy's formula in fp32 with sequential sums; NumPy's 1-D sums are sequential
  below 8 terms, so float32 lines of up to 7 are bit-exact; longer lines rtol 1e-5, float16 /
  bfloat16 one storage step, each plus 4 such steps of the largest gradient absolute
  (cancellation in the sums).
* training: losses and parameters after three SGD steps rtol 1e-5 / atol 1e-7 (the models'
  Gemm / Conv run as their numpy kernels in the emulator; the tensor kernels add at most the
  rounding differences above).
"""

from __future__ import annotations

import numpy as np
import pytest
from emulated_cuda import launches_of, typed_outputs
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures
from test_cuda_indexing_ops_cpu import (
    ELEM,
    FLOATS,
    assert_bits_equal,
    data,
    run_both,
    single_node,
)

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

DTYPES = [*FLOATS, "int64"]
CONV_OUT = 5  # Conv's output channels, padded to 8 by channel_align=8


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("tensor_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def arr(shape, dt, seed=0):
    """Random data of ``shape``: normal floats, or small integers for int64."""
    return data(shape, np.int64 if dt == "int64" else dt, seed=seed, integers=dt == "int64")


def check(model, feeds, device, signatures, kernels=None):
    """The cuda outputs equal numpy's bit for bit; ``kernels``: the launches' names."""
    want, got, names = run_both(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    if kernels is not None:  # a bfloat16 initializer is a float32 one and a Cast
        assert [n for n in names if not n.startswith("tr_convert")] == kernels
    return got


def after_conv(op, consts, attrs, outputs, opset=18, shape=(2, 3, 6, 5), kernel=(3, 3),
               channels=CONV_OUT, dtype=np.float32):
    """x -> Conv(``channels``, ``kernel``, same-size pads for 3x3) -> h -> ``op``
    (inputs h then ``consts``) -> ``outputs``."""
    rng = np.random.default_rng(1)
    w = (0.3 * rng.standard_normal((channels, shape[1], *kernel))).astype(dtype)
    pads = [k // 2 for k in kernel] * 2 if kernel == (3, 3) else [0, 0, 0, 0]
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], pads=pads),
             helper.make_node(op, ["h", *consts], outputs, **attrs)]
    elem = ELEM[np.dtype(dtype)]
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(w, "w")]
        + [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return typed_outputs(model, outputs)


def check_channels_last(model, device, signatures, outputs, shape=(2, 3, 6, 5),
                        dtype=np.float32):
    """``after_conv``'s model on both backends with channel_align=8: bit-exact, the outputs
    channels-last with zero padded lanes; returns the cuda plan's kernel names."""
    x = np.random.default_rng(2).standard_normal(shape).astype(dtype)
    want = tr_onnx.InferenceSession(model, channel_align=8).run(None, {"x": x})
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device), channel_align=8)
    got = sess.run(None, {"x": x})
    assert_bits_equal(got, want)
    plan = sess.plan_for({"x": x})
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    for o in outputs:
        t = plan.memory.tensors[o]
        assert t.layout.kind == "channels_last" and t.layout.is_padded
        assert pad_lanes_are_zero(plan.executor.device.arena, t), o
    return [c.kernel.name for c in launches]


# ---- Split -------------------------------------------------------------------------------------

SPLIT = {  # id: (shape, opset, attrs, split input or None, outputs)
    "attr-sizes-v11": ((2, 6, 3), 11, {"axis": 1, "split": [1, 4, 1]}, None, 3),
    "input-sizes-v13": ((4, 5), 13, {"axis": -1}, [2, 0, 3], 3),
    "equal-v2": ((6, 2, 2), 7, {}, None, 3),
    "num-outputs-uneven-v18": ((2, 7), 18, {"axis": 1, "num_outputs": 3}, None, 3),
    "one-output-v18": ((3, 4), 18, {"axis": 0, "num_outputs": 1}, None, 1),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", list(SPLIT))
def test_split_equals_numpy_bit_for_bit(device, signatures, case, dt):
    shape, opset, attrs, sizes, k = SPLIT[case]
    x = arr(shape, dt)
    consts = {"s": np.array(sizes, np.int64)} if sizes is not None else {}
    outs = [f"y{i}" for i in range(k)]
    got = check(single_node("Split", {"x": x}, consts, attrs, outs, opset=opset), {"x": x},
                device, signatures)
    assert sum(g.shape[attrs.get("axis", 0)] for g in got) == shape[attrs.get("axis", 0)]


def test_split_along_the_padded_channels_of_a_feature_map(device, signatures):
    model = after_conv("Split", {"s": np.array([2, 3])}, {"axis": 1}, ["a", "b"])
    names = check_channels_last(model, device, signatures, ["a", "b"])
    assert names.count("tr_strided_copy_b4") == 2 and names.count("tr_zero_lanes_b4") == 2


# ---- Slice and SliceGrad ------------------------------------------------------------------------

def test_slice_of_a_feature_map_with_steps_stays_exact(device, signatures):
    consts = {"st": np.array([1, 5, 1]), "en": np.array([5, -9, 4]), "ax": np.array([1, 2, 3]),
              "sp": np.array([2, -2, 1])}
    model = after_conv("Slice", consts, {}, ["y"])
    assert check_channels_last(model, device, signatures, ["y"]) [-2:] == [
        "tr_strided_copy_b4", "tr_zero_lanes_b4"]


SLICE_GRAD = {  # id: (gx shape, starts, ends, axes, steps)
    "unit": ((4, 6), [1, 2], [3, 6], [0, 1], [1, 1]),
    "negative-step": ((5, 7), [4, -1], [-9, 0], [0, 1], [-2, -3]),
    "stride-3-clamped": ((2, 9, 3), [1], [100], [1], [3]),
}


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("case", list(SLICE_GRAD))
def test_slice_grad_writes_gy_into_zeros_bit_for_bit(device, signatures, case, dt):
    shape, starts, ends, axes, steps = SLICE_GRAD[case]
    from tr_onnx.ops.tensor import slice_index

    index = slice_index(shape, starts, ends, axes, steps)
    gy = arr(np.zeros(shape)[index].shape, dt)
    node = helper.make_node("SliceGrad", ["gy"], ["gx"], domain="ai.tr_onnx", starts=starts,
                            ends=ends, axes=axes, steps=steps)
    model = internal_model(node, {"gy": gy}, {"gx": (gy.dtype, shape)})
    want, got, names = run_both(model, {"gy": gy}, device, signatures)
    assert_bits_equal(got, want)
    assert names[0].startswith("tr_zero_lanes_b") and names[1:] == [
        f"tr_strided_copy_b{gy.dtype.itemsize}"]
    outside = np.ones(shape, bool)
    outside[index] = False
    assert outside.any() and not got[0][outside].astype(np.float32).any()


def internal_model(node, feeds: dict, outs: dict, consts: dict | None = None):
    """A model of one ``ai.tr_onnx`` node over ``feeds`` (and initializers ``consts``);
    ``outs``: name -> (dtype, shape)."""
    graph = helper.make_graph(
        [node], node.op_type,
        [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
         for k, v in feeds.items()],
        [helper.make_tensor_value_info(k, ELEM[np.dtype(d)], s) for k, (d, s) in outs.items()],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (consts or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("ai.tr_onnx", 1)])


# ---- Pad and PadGrad ----------------------------------------------------------------------------

PAD = {  # id: (shape, opset, pads, attrs, axes, constant value)
    "constant-attr-v2": ((2, 3, 4), 7, [0, 1, 2, 1, 0, 3], {"value": 1.5}, None, None),
    "constant-value-input-v13": ((3, 4), 13, [1, 2, 2, 1], {}, None, 2.0),
    "constant-default-zero-v11": ((3, 4), 11, [0, 3, 1, 0], {}, None, None),
    "negative-crops-v13": ((4, 6), 13, [-1, 2, 1, -3], {}, None, None),
    "reflect": ((2, 4, 5), 13, [0, 2, 3, 0, 3, 4], {"mode": "reflect"}, None, None),
    "reflect-long": ((3, 2), 13, [4, 5, 3, 3], {"mode": "reflect"}, None, None),
    "edge": ((3, 4), 13, [2, 1, 3, 4], {"mode": "edge"}, None, None),
    "edge-crop": ((3, 5), 13, [2, -1, 1, -2], {"mode": "edge"}, None, None),
    "wrap-v19": ((3, 4), 19, [5, 2, 4, 6], {"mode": "wrap"}, None, None),
    "axes-input-v18": ((2, 3, 4), 18, [1, -1, 2, 3], {"mode": "reflect"}, [-1, 1], None),
}


@pytest.mark.parametrize("case, dt", [
    pytest.param(c, dt, id=f"{c}-{dt}") for c in PAD for dt in DTYPES
    if PAD[c][1] >= 11 or dt != "int64"])  # Pad-2 takes float tensors only
def test_pad_equals_numpy_bit_for_bit(device, signatures, case, dt):
    shape, opset, pads, attrs, axes, value = PAD[case]
    x = arr(shape, dt)
    attrs = dict(attrs)
    if opset < 11:
        attrs["pads"] = pads
        consts, order = {}, None
    else:
        consts = {"p": np.array(pads, np.int64)}
        if value is not None:
            consts["v"] = np.array(value, x.dtype)
        if axes is not None:
            consts["a"] = np.array(axes, np.int64)
        order = ["x", "p", "v" if value is not None else "", *(["a"] if axes else [])]
        while order[-1] == "":
            order.pop()
    model = single_node("Pad", {"x": x}, consts, attrs, ["y"], opset=opset, order=order)
    check(model, {"x": x}, device, signatures, [f"tr_pad_b{x.dtype.itemsize}"])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[0, 0, 1, 2, 0, 0, 2, 1], [0, 1, 0, -1, 0, 1, 1, 0]],
                         ids=["height-width", "channels-and-crop"])
def test_pad_of_a_feature_map(device, signatures, mode, pads):
    model = after_conv("Pad", {"p": np.array(pads)}, {"mode": mode}, ["y"])
    assert check_channels_last(model, device, signatures, ["y"])[-2:] == ["tr_pad_b4",
                                                                         "tr_zero_lanes_b4"]


PAD_GRAD = {  # id: (x shape, mode, pads)
    "reflect": ((2, 4, 5), "reflect", [0, 2, 3, 0, 3, 4]),
    "reflect-long": ((3, 2), "reflect", [4, 5, 3, 3]),
    "edge": ((3, 4), "edge", [2, 1, 3, 4]),
    "edge-crop": ((3, 5), "edge", [2, -1, 1, -2]),
    "wrap": ((3, 4), "wrap", [5, 2, 4, 6]),
    "constant-crop": ((4, 6), "constant", [-1, 2, 1, -3]),
}


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("case", list(PAD_GRAD))
def test_pad_grad_adds_the_borders_back_as_numpy(device, signatures, case, dt):
    shape, mode, pads = PAD_GRAD[case]
    rank = len(shape)
    out = [n + p + q for n, p, q in zip(shape, pads[:rank], pads[rank:])]
    gy = arr(out, dt)
    node = helper.make_node("PadGrad", ["gy"], ["gx"], domain="ai.tr_onnx", mode=mode,
                            pads=pads)
    model = internal_model(node, {"gy": gy}, {"gx": (gy.dtype, shape)})
    want, got, names = run_both(model, {"gy": gy}, device, signatures)
    assert names == [f"tr_pad_grad_{dt}"]
    big = np.abs(gy.astype(np.float64)).max()
    terms = np.prod([1 + max(p, 0) + max(q, 0) for p, q in zip(pads[:rank], pads[rank:])])
    step = {"f32": 5e-7, "f16": 2 ** -10, "bf16": 2 ** -7}[dt]
    np.testing.assert_allclose(got[0].astype(np.float64), want[0].astype(np.float64),
                               rtol=step, atol=step * big * terms)


@pytest.mark.parametrize("case", list(PAD_GRAD))
def test_pad_grad_is_the_transpose_of_pad(device, case):
    """<Pad(x), gy> = <x, PadGrad(gy)>: the cuda PadGrad against the numpy backend's Pad (an
    oracle independent of both PadGrad kernels), float32, sums in float64."""
    shape, mode, pads = PAD_GRAD[case]
    rank = len(shape)
    out = [n + p + q for n, p, q in zip(shape, pads[:rank], pads[rank:])]
    x, gy = arr(shape, "f32", seed=6), arr(out, "f32", seed=7)
    pad = single_node("Pad", {"x": x}, {"p": np.array(pads, np.int64)}, {"mode": mode}, ["y"])
    (y,) = tr_onnx.InferenceSession(pad).run(None, {"x": x})
    node = helper.make_node("PadGrad", ["gy"], ["gx"], domain="ai.tr_onnx", mode=mode,
                            pads=pads)
    grad = internal_model(node, {"gy": gy}, {"gx": (gy.dtype, shape)})
    (gx,) = tr_onnx.InferenceSession(grad, backend=CudaBackend(device=device)).run(None, {"gy": gy})
    np.testing.assert_allclose(np.vdot(y.astype(np.float64), gy),
                               np.vdot(x.astype(np.float64), gx), rtol=1e-5)


# ---- Expand, Tile ------------------------------------------------------------------------------

EXPAND = {  # id: (input shape, output shape)
    "n11c-two-runs": ((2, 1, 1, 3), (2, 4, 5, 3)),
    "nc11": ((2, 3, 1, 1), (2, 3, 4, 5)),
    "rank-grows": ((3, 1), (2, 3, 4)),
    "no-broadcast": ((2, 3), (2, 3)),
    "scalar": ((), (3, 2)),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", list(EXPAND))
def test_expand_broadcasts_any_pattern_bit_for_bit(device, signatures, case, dt):
    shape, out = EXPAND[case]
    x = arr(shape, dt)
    model = single_node("Expand", {"x": x}, {"s": np.array(out, np.int64)}, {}, ["y"])
    check(model, {"x": x}, device, signatures, [f"tr_strided_copy_b{x.dtype.itemsize}"])


def test_expand_of_a_pooled_map_into_a_channels_last_one(device, signatures):
    """[N, C, 1, 1] (a Conv over the whole 6x5 map) -> [N, C, 6, 5], both channels-last."""
    model = after_conv("Expand", {"s": np.array([2, CONV_OUT, 6, 5])}, {}, ["y"],
                       kernel=(6, 5))
    assert check_channels_last(model, device, signatures, ["y"])[-2:] == [
        "tr_strided_copy_b4", "tr_zero_lanes_b4"]


TILE = {  # id: (shape, repeats)
    "rows": ((2, 3), [3, 1]),
    "both": ((2, 3), [2, 3]),
    "rank4-spatial": ((1, 2, 3, 2), [2, 1, 2, 3]),
    "none": ((4,), [1]),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", list(TILE))
def test_tile_equals_numpy_bit_for_bit(device, signatures, case, dt):
    shape, reps = TILE[case]
    x = arr(shape, dt)
    model = single_node("Tile", {"x": x}, {"r": np.array(reps, np.int64)}, {}, ["y"], opset=13)
    check(model, {"x": x}, device, signatures, [f"tr_strided_copy_b{x.dtype.itemsize}"])


@pytest.mark.parametrize("reps, launches", [([1, 1, 2, 3], 1), ([2, 2, 2, 2], 4)],
                         ids=["height-width", "every-axis-split-launches"])
def test_tile_of_a_feature_map(device, signatures, reps, launches):
    """Tiling all four axes of a padded map leaves eight axes that do not collapse: the copy
    is split over the leading ones."""
    model = after_conv("Tile", {"r": np.array(reps)}, {}, ["y"])
    names = check_channels_last(model, device, signatures, ["y"])
    assert names.count("tr_strided_copy_b4") == launches


def test_transpose_of_rank_7_splits_into_launches(device, signatures):
    x = arr((2, 3, 2, 2, 3, 2, 2), "f16")
    model = single_node("Transpose", {"x": x}, {}, {"perm": [6, 0, 5, 3, 1, 4, 2]}, ["y"])
    check(model, {"x": x}, device, signatures, ["tr_strided_copy_b2"] * 2)


@pytest.mark.parametrize("op, feeds, consts, attrs, why", [
    ("Pad", {"x": np.zeros((1,) * 7, np.float32)}, {"p": np.ones(14, np.int64)}, {},
     "rank 7; the element-indexed kernels take 6 axes"),
    ("Tile", {"x": np.zeros((1, 2, 1, 2, 1, 2, 1, 2), np.float32)},
     {"r": np.array([65, 1, 2, 1, 2, 1, 2, 1])}, {},
     "8 axes after collapsing; the strided kernels take 6"),
], ids=["pad-rank-7", "tile-past-the-launch-limit"])
def test_forms_without_a_kernel_are_refused_with_the_reason(device, op, feeds, consts, attrs,
                                                            why):
    from tr_onnx.backends.cuda.bind import CudaUnsupported

    model = single_node(op, feeds, consts, attrs, ["y"])
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    with pytest.raises(CudaUnsupported) as info:
        sess.run(None, feeds)
    assert why in str(info.value), str(info.value)


# ---- DepthToSpace, SpaceToDepth ------------------------------------------------------------------

@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("op, attrs, shape", [
    ("DepthToSpace", {"blocksize": 2, "mode": "DCR"}, (2, 8, 3, 2)),
    ("DepthToSpace", {"blocksize": 2, "mode": "CRD"}, (1, 12, 2, 3)),
    ("SpaceToDepth", {"blocksize": 2}, (2, 3, 4, 6)),
    ("SpaceToDepth", {"blocksize": 3}, (1, 2, 3, 6)),
], ids=["d2s-dcr", "d2s-crd", "s2d-2", "s2d-3"])
def test_block_rearrangements_equal_numpy(device, signatures, op, attrs, shape, dt):
    x = arr(shape, dt)
    check(single_node(op, {"x": x}, {}, attrs, ["y"], opset=13), {"x": x}, device, signatures,
          [f"tr_strided_copy_b{x.dtype.itemsize}"])


@pytest.mark.parametrize("op, attrs, channels", [
    ("SpaceToDepth", {"blocksize": 2}, 5), ("DepthToSpace", {"blocksize": 2, "mode": "CRD"}, 12),
    ("DepthToSpace", {"blocksize": 2, "mode": "DCR"}, 12)], ids=["s2d", "d2s-crd", "d2s-dcr"])
def test_block_rearrangements_of_feature_maps(device, signatures, op, attrs, channels):
    model = after_conv(op, {}, attrs, ["y"], shape=(2, 3, 6, 4), channels=channels)
    check_channels_last(model, device, signatures, ["y"], shape=(2, 3, 6, 4))


# ---- Trilu ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape, upper, k", [
    ((4, 5), 1, 0), ((4, 5), 0, 0), ((2, 3, 5, 4), 1, -2), ((3, 1, 6), 0, 2), ((2, 6, 3), 1, 4)],
    ids=["upper", "lower", "batched-upper-k-2", "one-row-lower-k2", "upper-k-past-cols"])
def test_trilu_keeps_the_triangle_bit_for_bit(device, signatures, shape, upper, k, dt):
    x = arr(shape, dt)
    model = single_node("Trilu", {"x": x}, {"k": np.array(k, np.int64)}, {"upper": upper},
                        ["y"], opset=14)
    check(model, {"x": x}, device, signatures, [f"tr_trilu_b{x.dtype.itemsize}"])


def test_trilu_of_a_feature_map(device, signatures):
    model = after_conv("Trilu", {}, {"upper": 0}, ["y"])
    check_channels_last(model, device, signatures, ["y"])


# ---- CumSum, CumProd, CumProdGrad ----------------------------------------------------------------

SCANS = {  # id: (shape, axis, exclusive, reverse)
    "last": ((3, 7), -1, 0, 0),
    "axis0-exclusive": ((5, 2, 3), 0, 1, 0),
    "middle-reverse": ((2, 6, 3), 1, 0, 1),
    "exclusive-reverse": ((4, 9), 1, 1, 1),
}


def float64_scan(op, x, axis, exclusive, reverse):
    a = np.moveaxis(x.astype(np.float64), axis, 0)
    a = a[::-1] if reverse else a
    f = np.cumsum if op == "CumSum" else np.cumprod
    y = f(a, axis=0)
    if exclusive:
        y = np.concatenate([np.full_like(y[:1], 0.0 if op == "CumSum" else 1.0), y[:-1]])
    return np.moveaxis(y[::-1] if reverse else y, 0, axis)


@pytest.mark.parametrize("dt", [*DTYPES, "int32"])
@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("case", list(SCANS))
def test_scans_equal_numpy(device, signatures, case, op, dt):
    shape, axis, exclusive, reverse = SCANS[case]
    if op == "CumProd":  # magnitudes near 1, so products neither vanish nor overflow
        rng = np.random.default_rng(3)
        x = (rng.integers(-2, 3, shape) if dt.startswith("int") else
             rng.uniform(0.6, 1.4, shape) * rng.choice([-1, 1], shape)).astype(
            BFLOAT16 if dt == "bf16" else FLOATS.get(dt, dt))
    else:
        x = arr(shape, dt).astype(np.int32) if dt == "int32" else arr(shape, dt)
    model = single_node(op, {"x": x}, {"a": np.array(axis, np.int64)},
                        {"exclusive": exclusive, "reverse": reverse}, ["y"],
                        opset=26 if op == "CumProd" else 14)
    want, got, names = run_both(model, {"x": x}, device, signatures)
    kind = {"int64": "i64", "int32": "i32"}.get(dt, dt)
    assert names == [f"tr_{op.lower()}_{kind}"]
    if dt in ("f32", "int64", "int32"):
        assert_bits_equal(got, want)
    else:
        ref = float64_scan(op, x, axis, exclusive, reverse)
        step = {"f16": 2 ** -10, "bf16": 2 ** -7}[dt]
        np.testing.assert_allclose(got[0].astype(np.float64), ref, rtol=step,
                                   atol=step * np.abs(ref).max())


@pytest.mark.parametrize("op, axis, opset", [("CumSum", 1, 14), ("CumProd", 1, 26),
                                             ("CumSum", -1, 14), ("CumProd", 2, 26)],
                         ids=["cumsum-channels", "cumprod-channels", "cumsum-width",
                              "cumprod-height"])
def test_scans_of_a_feature_map(device, signatures, op, axis, opset):
    model = after_conv(op, {"a": np.array(axis)}, {"reverse": 1}, ["y"], opset=opset)
    assert check_channels_last(model, device, signatures, ["y"])[-2:] == [
        f"tr_{op.lower()}_f32", "tr_zero_lanes_b4"]


CUMPROD_GRAD = {  # id: (shape, axis, exclusive, reverse, zeros in x)
    "plain": ((3, 5), 1, 0, 0, False),
    "exclusive-reverse": ((4, 3, 2), 1, 1, 1, False),
    "zeros": ((2, 6), -1, 0, 0, True),
    "axis0-exclusive-zeros": ((7, 3), 0, 1, 0, True),
    "long-reverse": ((2, 12), 1, 0, 1, False),
}


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("case", list(CUMPROD_GRAD))
def test_cumprod_grad_equals_numpy(device, signatures, case, dt):
    shape, axis, exclusive, reverse, zeros = CUMPROD_GRAD[case]
    rng = np.random.default_rng(4)
    x = rng.uniform(0.6, 1.4, shape) * rng.choice([-1, 1], shape)
    if zeros:
        x.reshape(-1)[::4] = 0.0
    x = x.astype(BFLOAT16 if dt == "bf16" else FLOATS[dt])
    gy = arr(shape, dt, seed=5)
    node = helper.make_node("CumProdGrad", ["gy", "x", "a"], ["gx"], domain="ai.tr_onnx",
                            exclusive=exclusive, reverse=reverse)
    model = internal_model(node, {"gy": gy, "x": x}, {"gx": (gy.dtype, shape)},
                           {"a": np.array(axis, np.int64)})
    want, got, names = run_both(model, {"gy": gy, "x": x}, device, signatures)
    assert names == [f"tr_cumprod_grad_{dt}"]
    if dt == "f32" and shape[axis] < 8:
        assert_bits_equal(got, want)
    else:
        step = {"f32": 1e-5, "f16": 2 ** -10, "bf16": 2 ** -7}[dt]
        scale = np.abs(want[0].astype(np.float64)).max()
        np.testing.assert_allclose(got[0].astype(np.float64), want[0].astype(np.float64),
                                   rtol=step, atol=4 * step * scale)


# ---- plan-time values ----------------------------------------------------------------------------

@pytest.mark.parametrize("op, attrs, want, kernel", [
    ("Shape", {}, [2, 6, 3, 4], "tr_put_b8"), ("Shape", {"start": 1, "end": -1}, [6, 3],
                                                "tr_put_b8"),
    ("Size", {}, 144, "tr_fill_b8")], ids=["shape", "shape-start-end", "size"])
def test_shape_and_size_of_a_graph_input_are_written_each_step(device, signatures, op, attrs,
                                                               want, kernel):
    x = arr((2, 6, 3, 4), "f32")
    got = check(single_node(op, {"x": x}, {}, attrs, ["y"], opset=19), {"x": x}, device,
                signatures, [kernel])
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("attr, value, kernels", [
    ("value", np.arange(20, dtype=np.float32).reshape(4, 5), ["tr_put_b4"] * 3),
    ("value", np.full((3, 2), 7, np.int64), ["tr_fill_b8"]),
    ("value", np.array([1.5, -2.0], np.float16), ["tr_put_b2"]),
    ("value_ints", np.array([3, -1, 4], np.int64), ["tr_put_b8"]),
    ("value_float", np.array(0.25, np.float32), ["tr_fill_b4"])],
    ids=["f32-put", "int64-fill", "f16-put", "value-ints", "value-float"])
def test_constant_graph_output_is_written_each_step(device, signatures, attr, value, kernels):
    given = numpy_helper.from_array(value) if attr == "value" else value.tolist()
    node = helper.make_node("Constant", [], ["y"], **{attr: given})
    graph = helper.make_graph([node], "c", [], [helper.make_tensor_value_info(
        "y", ELEM[value.dtype], value.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    got = check(model, {}, device, signatures, kernels)
    np.testing.assert_array_equal(got[0], value)


@pytest.mark.parametrize("dt, value", [("f32", 2.5), ("int64", -3), ("f16", 0.0)])
def test_constant_of_shape_fills(device, signatures, dt, value):
    dtype = np.int64 if dt == "int64" else FLOATS[dt]
    node = helper.make_node("ConstantOfShape", ["s"], ["y"],
                            value=numpy_helper.from_array(np.array([value], dtype)))
    graph = helper.make_graph([node], "c", [], [helper.make_tensor_value_info(
        "y", ELEM[np.dtype(dtype)], (3, 4))], [numpy_helper.from_array(np.array([3, 4]), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    got = check(model, {}, device, signatures, [f"tr_fill_b{np.dtype(dtype).itemsize}"])
    assert np.all(got[0] == value)


@pytest.mark.parametrize("start, limit, delta, dtype", [
    (0.1, 3.7, 0.3, np.float32), (-4, 50, 3, np.int64), (10, -7, -2, np.int32)],
    ids=["f32", "i64", "i32-down"])
def test_range_output_equals_numpy(device, signatures, start, limit, delta, dtype):
    ins = {k: np.array(v, dtype) for k, v in (("a", start), ("b", limit), ("c", delta))}
    n = max(int(np.ceil((limit - start) / delta)), 0)
    graph = helper.make_graph(
        [helper.make_node("Range", ["a", "b", "c"], ["y"])], "r", [],
        [helper.make_tensor_value_info("y", ELEM[np.dtype(dtype)], (n,))],
        [numpy_helper.from_array(v, k) for k, v in ins.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    check(model, {}, device, signatures,
          [f"tr_range_{ {np.float32: 'f32', np.int64: 'i64', np.int32: 'i32'}[dtype]}"])


@pytest.mark.parametrize("k, dtype", [(0, np.float32), (2, np.int64), (-1, np.float16)])
def test_eye_like_equals_numpy(device, signatures, k, dtype):
    x = np.zeros((4, 6), dtype)
    model = single_node("EyeLike", {"x": x}, {}, {"k": k}, ["y"], opset=9)
    check(model, {"x": x}, device, signatures, [f"tr_eye_b{np.dtype(dtype).itemsize}"])


# ---- training: three SGD steps on cuda (emulated) against numpy --------------------------------

N, F = 4, 6


def train_model(nodes, inits, out_shape, hidden, opset=18):
    """input [N, F] -> Gemm(w: [F, hidden]) -> h -> ``nodes`` -> scores ``out_shape``."""
    rng = np.random.default_rng(9)
    w = (0.5 * rng.standard_normal((F, hidden))).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["input", "w"], ["h"]), *nodes], "m",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(v, k) for k, v in {"w": w, **inits}.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def cnn_concat_pad():
    """[N, 3, 6, 6] -> two Convs (3 and 2 channels) -> Concat over channels -> reflect Pad of
    H and W -> Conv -> Flatten -> Gemm: with channel_align=8 the Concat's gradient (Split)
    and the PadGrad run on channels-last maps with padded lanes."""
    rng = np.random.default_rng(7)

    def w(name, shape):
        return numpy_helper.from_array((0.3 * rng.standard_normal(shape)).astype(np.float32),
                                       name)

    nodes = [helper.make_node("Conv", ["input", "wa"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["input", "wb"], ["b"]),
             helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
             helper.make_node("Pad", ["c", "pads"], ["p"], mode="reflect"),
             helper.make_node("Conv", ["p", "wd"], ["d"]),
             helper.make_node("Flatten", ["d"], ["f"]),
             helper.make_node("Gemm", ["f", "we"], ["scores"])]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, 3, 6, 6])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [N, 3])],
        [w("wa", (3, 3, 3, 3)), w("wb", (2, 3, 1, 1)), w("wd", (4, 5, 3, 3)),
         w("we", (4 * 7 * 7, 3)),
         numpy_helper.from_array(np.array([0, 0, 1, 2, 0, 0, 2, 1]), "pads")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


TRAIN = {  # id: (model, input shape, classes, kernels launched, {op planned: its layout})
    # Concat of two projections: its gradient splits gy (Split)
    "concat": (lambda: train_model(
        [helper.make_node("Gemm", ["input", "w2"], ["h2"]),
         helper.make_node("Concat", ["h", "h2"], ["scores"], axis=1)],
        {"w2": (0.4 * np.random.default_rng(8).standard_normal((F, 2))).astype(np.float32)},
        [N, 5], hidden=3), (N, F), 5, {"tr_strided_copy_b4"}, {"Split": "plain"}),
    # Slice (unit steps: its gradient is a Pad) then a reflect Pad (its gradient PadGrad) and
    # a strided Slice (SliceGrad)
    "slice-pad": (lambda: train_model(
        [helper.make_node("Slice", ["h", "s0", "e0", "a0"], ["t"]),
         helper.make_node("Pad", ["t", "pads"], ["p"], mode="reflect"),
         helper.make_node("Slice", ["p", "s1", "e1", "a1", "st1"], ["scores"])],
        {"s0": np.array([1]), "e0": np.array([6]), "a0": np.array([1]),
         "pads": np.array([0, 2, 0, 1]),
         "s1": np.array([7]), "e1": np.array([0]), "a1": np.array([1]), "st1": np.array([-2])},
        [N, 4], hidden=7), (N, F), 4, {"tr_pad_b4", "tr_pad_grad_f32", "tr_strided_copy_b4"},
        {"Pad": "plain", "PadGrad": "plain", "SliceGrad": "plain"}),
    "cnn-concat-pad": (cnn_concat_pad, (N, 3, 6, 6), 3,
                       {"tr_pad_b4", "tr_pad_grad_f32", "tr_strided_copy_b4"},
                       {"Split": "channels_last", "PadGrad": "channels_last"}),
}


def reshaped(op_nodes, inits, inner, width, hidden, opset=18):
    """Gemm h [N, hidden] -> Reshape [N, *inner] -> ``op_nodes`` (t -> u) -> Reshape to the
    scores [N, width]: a training model around one op (its gradient rule runs backward)."""
    nodes = [helper.make_node("Reshape", ["h", "inner"], ["t"]), *op_nodes,
             helper.make_node("Reshape", ["u", "flat"], ["scores"])]
    return lambda: train_model(nodes, {"inner": np.array([N, *inner]),
                                       "flat": np.array([N, width]), **inits},
                               [N, width], hidden, opset)


def one_op(op, inputs, attrs, inits, inner, width, hidden, kernels, planned, opset=18):
    node = helper.make_node(op, ["t", *inputs], ["u"], **attrs)
    return (reshaped([node], inits, inner, width, hidden, opset), (N, F), width, kernels,
            planned)


# every differentiable op of the family trained through its gradient rule on cuda
TRAIN.update({
    # only the first part is used: the second's gradient is zeros (ConstantOfShape)
    "split-unused-part": (reshaped([helper.make_node("Split", ["t", "parts"], ["u", "rest"],
                                                     axis=1)],
                                   {"parts": np.array([3, 4])}, [7], 3, 7), (N, F), 3,
                          {"tr_fill_b4", "tr_strided_copy_b4"},
                          {"ConstantOfShape": "plain", "Concat": "plain"}),
    "tile": one_op("Tile", ["reps"], {}, {"reps": np.array([1, 2, 1])}, [3, 2], 12, 6,
                   {"tr_strided_copy_b4"}, {"Tile": "plain"}),
    "expand": one_op("Expand", ["to"], {}, {"to": np.array([N, 3, 2])}, [3, 1], 6, 3,
                     {"tr_strided_copy_b4"}, {"Expand": "plain"}),
    "trilu": one_op("Trilu", [], {"upper": 0}, {}, [3, 3], 9, 9, {"tr_trilu_b4"},
                    {"Trilu": "plain"}),
    "cumsum": one_op("CumSum", ["ax"], {"exclusive": 1}, {"ax": np.array(1)}, [5], 5, 5,
                     {"tr_cumsum_f32"}, {"CumSum": "plain"}),
    "cumprod": one_op("CumProd", ["ax"], {"reverse": 1}, {"ax": np.array(-1)}, [5], 5, 5,
                      {"tr_cumprod_f32", "tr_cumprod_grad_f32"}, {"CumProdGrad": "plain"},
                      opset=26),
    "depth-to-space-crd": one_op("DepthToSpace", [], {"blocksize": 2, "mode": "CRD"}, {},
                                 [4, 2, 2], 16, 16, {"tr_strided_copy_b4"},
                                 {"DepthToSpace": "plain"}),
    "space-to-depth": one_op("SpaceToDepth", [], {"blocksize": 2}, {}, [1, 4, 4], 16, 16,
                             {"tr_strided_copy_b4"}, {"SpaceToDepth": "plain",
                                                      "DepthToSpace": "plain"}),
    "pad-edge": one_op("Pad", ["pads"], {"mode": "edge"}, {"pads": np.array([0, 1, 0, 2])},
                       [4], 7, 4, {"tr_pad_b4", "tr_pad_grad_f32"}, {"PadGrad": "plain"}),
    "pad-wrap": one_op("Pad", ["pads"], {"mode": "wrap"}, {"pads": np.array([0, 3, 0, 2])},
                       [3], 8, 3, {"tr_pad_b4", "tr_pad_grad_f32"}, {"PadGrad": "plain"}),
})


def train(case, backend, **kw):
    make, shape, classes, _, _ = TRAIN[case]
    sess = tr_onnx.TrainingSession(make(), loss="cross_entropy", optimizer=SGD(lr=0.1),
                                   backend=backend, channel_align=8, **kw)
    rng = np.random.default_rng(10)
    batches = [({"input": rng.standard_normal(shape).astype(np.float32)},
                rng.integers(0, classes, (N,))) for _ in range(3)]
    return sess, [sess.train_step(*b) for b in batches]


@pytest.mark.parametrize("case", list(TRAIN))
def test_three_sgd_steps_on_cuda_equal_numpy(device, signatures, case):
    ref, want = train(case, "numpy")
    sess, got = train(case, CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    assert TRAIN[case][3] <= {c.kernel.name for c in launches}
    layouts = {n.op_type: plan.memory.tensors[n.outputs[0].name].layout.kind
               for n in plan.graph.nodes if n.outputs and n.outputs[0] is not None}
    assert TRAIN[case][4].items() <= layouts.items()
