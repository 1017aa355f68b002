"""MemoryPlan invariants: 256-byte alignment, region order, live tensors never overlap, reuse
shrinks the arena, host <-> arena transfer through padded NHWC."""

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import tr_onnx
from tr_onnx.errors import InternalError, PlanError
from tr_onnx.layouts import GatherRowsLayout, StridedLayout
from tr_onnx.memory import ALIGN, DTensor, Region, read_host, write_host

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def _chain_model(depth: int, width: int = 100):
    """x -> Relu -> Add(x) -> Relu -> Add ... : every value dies two nodes after birth."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])
    nodes, prev = [], "x"
    for i in range(depth):
        nodes.append(helper.make_node("Relu", [prev], [f"r{i}"]))
        nodes.append(helper.make_node("Add", [f"r{i}", prev], [f"a{i}"]))
        prev = f"a{i}"
    y = helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, width])
    return helper.make_model(helper.make_graph(nodes, "chain", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)])


def _plan(model, feed, **kw):
    sess = tr_onnx.InferenceSession(model, **kw)
    return sess, sess.plan_for(feed)


def _assert_invariants(plan):
    mem = plan.memory
    starts = [mem.regions[r][0] for r in Region]
    assert starts == sorted(starts) and starts[0] == 0
    for t in mem.all_tensors():
        assert t.offset % ALIGN == 0 and t.slot_bytes % ALIGN == 0, t.name
        assert t.slot_bytes >= t.nbytes or t.alias_of is not None
    owned = [t for t in mem.tensors.values() if t.alias_of is None and t.slot_bytes]
    for i, a in enumerate(owned):
        for b in owned[i + 1:]:
            live_together = a.first_use <= b.last_use and b.first_use <= a.last_use
            disjoint = a.offset + a.slot_bytes <= b.offset or b.offset + b.slot_bytes <= a.offset
            assert disjoint or not live_together, (a.name, b.name)


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_chain_invariants_and_reuse(reuse):
    feed = {"x": np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32)}
    sess, plan = _plan(_chain_model(12), feed, reuse_memory=reuse)
    _assert_invariants(plan)
    slot = 4 * 100 * 4 + (-4 * 100 * 4) % ALIGN
    act = plan.memory.region_bytes(Region.ACTIVATION)
    if reuse:
        assert act <= 3 * slot  # at most three chain values are ever live at once
    else:
        assert act == 24 * slot
    expected = feed["x"]
    for _ in range(12):
        expected = np.maximum(expected, 0) + expected
    np.testing.assert_allclose(sess.run(None, feed)[0], expected, rtol=1e-6)


def test_finalize_rejects_overlapping_live_tensors():
    feed = {"x": np.zeros((4, 100), np.float32)}
    _, plan = _plan(_chain_model(3), feed)
    mem = plan.memory
    r0, a0 = mem.tensors["r0"], mem.tensors["a0"]  # a0 = r0 + x: both live at node 1
    a0.offset = r0.offset
    with pytest.raises(PlanError, match="live at the same time"):
        mem.finalize()


def test_finalize_rejects_misalignment():
    feed = {"x": np.zeros((4, 100), np.float32)}
    _, plan = _plan(_chain_model(2), feed)
    plan.memory.tensors["r0"].offset += 64
    with pytest.raises(PlanError):
        plan.memory.finalize()


def test_a_rejected_plan_is_reported_as_a_bug_in_tr_onnx():
    feed = {"x": np.zeros((4, 100), np.float32)}
    _, plan = _plan(_chain_model(2), feed)
    plan.memory.tensors["r0"].offset += 64
    with pytest.raises(InternalError, match="not a multiple of 256 .*bug in tr_onnx.*report"):
        plan.memory.finalize()


@pytest.mark.parametrize("stem", ["resnet", "mobilenet", "lenet", "transformer"])
@pytest.mark.parametrize("align", [1, 8])
def test_zoo_plans_hold_invariants_and_beat_the_naive_sum(stem, align):
    shape = {"transformer": (2, 8, 32), "lenet": (2, 1, 8, 8)}.get(stem, (2, 3, 16, 16))
    _, plan = _plan(ZOO / f"{stem}.onnx", {"input": np.zeros(shape, np.float32)},
                    channel_align=align)
    _assert_invariants(plan)
    assert plan.memory.total_bytes < plan.memory.naive_bytes


def _dtensor(layout, dtype=np.float32, offset=0):
    t = DTensor(0, "t", layout.shape, np.dtype(dtype), Region.INPUT, layout, offset=offset)
    t.slot_bytes = layout.nbytes(t.dtype.itemsize)
    return t


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 13, 3), (2, 5, 2, 3, 4)], ids=str)
@pytest.mark.parametrize("align", [1, 8])
def test_channels_last_transfer_roundtrip(shape, align):
    layout = StridedLayout.channels_last(shape, align)
    t = _dtensor(layout, offset=256)
    arena = np.zeros(256 + t.nbytes, np.uint8)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    write_host(arena, t, x)
    phys = t.physical_view(arena)
    np.testing.assert_array_equal(phys[..., : shape[1]], np.moveaxis(x, 1, -1))
    assert not np.any(phys[..., shape[1]:])  # padded lanes stay zero
    np.testing.assert_array_equal(read_host(arena, t), x)
    x_nhwc = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    write_host(arena, t, x_nhwc * 2, host_layout="nhwc")
    np.testing.assert_array_equal(read_host(arena, t, host_layout="nhwc"), x_nhwc * 2)
    assert t.device_strides[1] == 4 and t.host_strides[-1] == 4


def test_gather_rows_layout_roundtrip_matches_flatten_of_nhwc():
    src = StridedLayout.channels_last((2, 3, 2, 2), 8)
    flat = GatherRowsLayout.flattened_channels_last(src)
    x = np.random.default_rng(2).standard_normal((2, 3, 2, 2)).astype(np.float32)
    phys = np.zeros(src.phys_shape, np.float32)
    phys[..., :3] = np.moveaxis(x, 1, -1)
    as_flat = phys.reshape(2, -1)  # the bytes a Flatten of the NHWC buffer sees
    np.testing.assert_array_equal(flat.to_logical(as_flat), x.reshape(2, -1))
    np.testing.assert_array_equal(flat.to_physical(x.reshape(2, -1)), as_flat)
    w = np.random.default_rng(3).standard_normal((12, 5)).astype(np.float32)
    w_phys = flat.for_matrix(w.shape, 0).to_physical(w)
    np.testing.assert_allclose(as_flat @ w_phys, x.reshape(2, -1) @ w, rtol=1e-6)
