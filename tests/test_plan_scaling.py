"""Planning grows as n log n in nodes (issue 12, item 8: 20,000 Relus planned in 108 s; the
MemoryPlan compared every pair of tensors sharing a slot, the layout pass searched the whole
schedule for every LayoutTranspose it inserted). Checked without a clock: the work of planning
a chain 4x as long is counted as the Python and builtin calls made plus the comparisons of
nodes and values (what a search of a node or value list costs); it must grow about 4x, not
16x. ``benchmarks/plan_scaling.py`` has the seconds."""

import sys
from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from benchmarks.plan_scaling import mixed_chain, relu_chain
from tr_onnx import ir
from tr_onnx.plugin import ELEMENTWISE, OpDef, hookimpl


class _Halve:
    """A plugin op ONNX cannot type: its shape rule types it, then ONNX the ops after it."""

    @staticmethod
    def kernel(ctx):
        def run(ins, outs, ws):
            np.multiply(ins[0], 0.5, out=outs[0])

        return run

    @hookimpl
    def tr_onnx_op_definitions(self):
        return [OpDef("Halve", (1,), {"numpy": self.kernel}, domain="com.test.scaling",
                      layout=ELEMENTWISE, shape=lambda node, shapes, dtypes: [
                          (shapes[0], dtypes[0])])]


def plugin_chain(n: int):
    """x -> (Halve -> Reshape(-1, 8)) * n/2: every Halve waits for the Reshape before it to be
    typed, which takes the value of its shape."""
    names = ["x"] + [f"v{i}" for i in range(1, n)] + ["y"]
    nodes = [helper.make_node("Halve", [a], [b], domain="com.test.scaling") if i % 2 == 0
             else helper.make_node("Reshape", [a, "rows"], [b])
             for i, (a, b) in enumerate(zip(names, names[1:]))]
    graph = helper.make_graph(
        nodes, "plugin_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                              ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.array([-1, 8], np.int64), "rows")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.test.scaling", 1)])


def _planning_work(monkeypatch, model, feed, align) -> int:
    session = tr_onnx.InferenceSession(model, channel_align=align, plugins=[_Halve()])
    counts = Counter()

    def counted_eq(self, other):
        counts["comparisons"] += 1
        return self is other

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counts["calls"] += 1

    with monkeypatch.context() as patch:
        patch.setattr(ir.Node, "__eq__", counted_eq)
        patch.setattr(ir.Value, "__eq__", counted_eq)
        sys.setprofile(profile)
        try:
            session.plan_for(feed)
        finally:
            sys.setprofile(None)
    return counts["calls"] + counts["comparisons"]


@pytest.mark.parametrize("name, make, feed, align", [
    ("relu", relu_chain, {"x": np.zeros((4, 8), np.float32)}, 1),
    # Conv/Relu/Add/Reshape blocks on padded NHWC: LayoutTransposes, padded tensors in shared
    # slots, best-fit reuse
    ("mixed", mixed_chain, {"x": np.zeros((2, 3, 4, 4), np.float32)}, 8),
    ("plugin", plugin_chain, {"x": np.zeros((4, 8), np.float32)}, 1),
], ids=["relu", "mixed", "plugin"])
def test_planning_work_grows_linearly_with_the_chain(monkeypatch, name, make, feed, align):
    _planning_work(monkeypatch, make(60), feed, align)  # caches (schemas, registry) filled
    small = _planning_work(monkeypatch, make(600), feed, align)
    large = _planning_work(monkeypatch, make(2400), feed, align)
    assert large / small < 5.5, (small, large)  # linear: 4; quadratic: 16


@pytest.mark.parametrize("n, backward_start, anchors", [
    (5, None, [2, 2, 0]),
    (5, 3, [3]),  # before the first backward node: part of the backward pass
    (5, 3, [1, 4, 3]),
    (5, 5, [2, 4]),  # no backward node yet
    (5, 0, [0, 1]),
], ids=["forward", "at_backward_start", "around_backward_start", "empty_backward", "all_backward"])
def test_insert_before_each_is_insert_before_one_at_a_time(n, backward_start, anchors):
    """The layout pass puts its LayoutTransposes in with one pass over the schedule."""
    def graph():
        nodes = [ir.Node(f"n{i}", "Relu", "", 14, [], []) for i in range(n)]
        return ir.Graph("g", nodes, {}, [], [], {}, backward_start)

    one_at_a_time, at_once = graph(), graph()
    inserts = {}
    for k, i in enumerate(anchors):
        new = ir.Node(f"t{k}", "LayoutTranspose", "ai.tr_onnx", 1, [], [])
        one_at_a_time.insert_before(next(a for a in one_at_a_time.nodes if a.name == f"n{i}"),
                                    new)
        inserts.setdefault(at_once.nodes[i], []).append(new)
    at_once.insert_before_each(inserts)
    assert [m.name for m in at_once.nodes] == [m.name for m in one_at_a_time.nodes]
    assert at_once.backward_start == one_at_a_time.backward_start
