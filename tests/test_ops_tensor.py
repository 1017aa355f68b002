"""Tensor ops (tr_onnx.ops.tensor) on single-node models against onnxruntime and onnx.reference.

Layout cases put a channels-last, channel-padded feature map in front of the op with a test
plugin op (``ToChannelsLast``, a SPATIAL copy in domain ``test.layout``): the op then reads a
strided view over a padded NHWC buffer, which is what it meets after a convolution. The
oracles run the same model without that node (it is an identity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onednn_kernels import require_onednn, spy_kernels
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.hookspecs import hookimpl
from tr_onnx.memory import pad_lanes_are_zero
from tr_onnx.opdef import SPATIAL, OpDef

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

RNG = np.random.default_rng(0)
TEST_DOMAIN = "test.layout"


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def i64(*values):
    return np.array(values, np.int64)


@dataclass
class Case:
    """One node: inputs are ``(name, array, is_feed)``; ``(None, None, False)`` = absent."""

    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    opset: int = 21
    outputs: int = 1
    channels_last: tuple = ()  # feeds routed through ToChannelsLast in the tr_onnx model
    oracles: tuple = ("ort", "reference")


def feed_(name, array):
    return (name, array, True)


def const(name, array):
    return (name, array, False)


ABSENT = (None, None, False)


def build(case: Case, channels_last: bool) -> tuple[onnx.ModelProto, dict]:
    nodes, graph_inputs, inits, feed, node_inputs = [], [], [], {}, []
    for name, array, is_feed in case.inputs:
        if name is None:
            node_inputs.append("")
            continue
        if is_feed:
            graph_inputs.append(helper.make_tensor_value_info(
                name, onnx_elem_type(array.dtype), list(array.shape)))
            feed[name] = array
            if channels_last and name in case.channels_last:
                nodes.append(helper.make_node("ToChannelsLast", [name], [name + "_cl"],
                                              domain=TEST_DOMAIN))
                name += "_cl"
        else:
            inits.append(numpy_helper.from_array(array, name))
        node_inputs.append(name)
    outs = [f"y{i}" for i in range(case.outputs)]
    nodes.append(helper.make_node(case.op, node_inputs, outs, **case.attrs))
    graph = helper.make_graph(nodes, case.op.lower(), graph_inputs,
                              [helper.make_tensor_value_info(o, 0, None) for o in outs], inits)
    opsets = [helper.make_opsetid("", case.opset)]
    if channels_last and case.channels_last:
        opsets.append(helper.make_opsetid(TEST_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets), feed


def build_pair(case: Case) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """(model for the oracles, model for tr_onnx, feed); outputs typed by ONNX inference."""
    reference, feed = build(case, channels_last=False)
    reference = onnx.shape_inference.infer_shapes(reference)
    model, _ = build(case, channels_last=True)
    del model.graph.output[:]
    model.graph.output.extend(reference.graph.output)
    return reference, model, feed


class ChannelsLastPlugin:
    """A SPATIAL identity: its output is a channels-last feature map with padded channels."""

    @staticmethod
    def _copy(ctx):
        def run(ins, outs, ws):
            np.copyto(outs[0], ins[0])

        return run

    @hookimpl
    def tr_onnx_op_definitions(self):
        return [OpDef("ToChannelsLast", (1,), {"numpy": self._copy}, domain=TEST_DOMAIN,
                      layout=SPATIAL, shape=lambda node, shapes, dtypes: [(shapes[0], dtypes[0])])]


def check(case: Case, align: int = 1, rtol=1e-5, atol=1e-6):
    reference, model, feed = build_pair(case)
    expected_ort = ort_run(reference, feed)
    expected_ref = ReferenceEvaluator(reference).run(None, feed) \
        if "reference" in case.oracles else expected_ort
    plugins = [ChannelsLastPlugin()] if case.channels_last else ()
    sess = tr_onnx.InferenceSession(model, channel_align=align, plugins=plugins)
    got = sess.run(None, feed)
    for y, e_ort, e_ref in zip(got, expected_ort, expected_ref):
        assert y.dtype == e_ort.dtype and y.shape == e_ort.shape, (y.dtype, y.shape, e_ort.shape)
        np.testing.assert_allclose(y, e_ort, rtol=rtol, atol=atol)
        np.testing.assert_allclose(y, np.asarray(e_ref).astype(y.dtype), rtol=rtol, atol=atol)
    plan = sess.plan_for(feed)
    if case.channels_last:
        assert plan.layout.channels_last > 0
    arena = plan.executor.arena
    assert all(pad_lanes_are_zero(arena, t) for t in plan.memory.tensors.values())
    return sess, plan


# ---- ops whose output is the input regrouped (views when the layouts allow) -----------------

X4 = rand(2, 3, 4, 5)
REGROUP = [
    pytest.param(Case("Reshape", [feed_("x", X4), const("s", i64(2, -1))]), id="reshape-neg"),
    pytest.param(Case("Reshape", [feed_("x", X4), const("s", i64(0, 3, 20))]), id="reshape-zero"),
    pytest.param(Case("Reshape", [feed_("x", rand(0, 3)), const("s", i64(3, 0))],
                      {"allowzero": 1}), id="reshape-allowzero"),
    pytest.param(Case("Reshape", [feed_("x", X4), feed_("s", i64(6, 20))]),
                 id="reshape-shape-fed"),
    pytest.param(Case("Reshape", [feed_("x", X4), const("s", i64(4, 30))], opset=5),
                 id="reshape-v5"),
    pytest.param(Case("Flatten", [feed_("x", X4)]), id="flatten-default"),
    pytest.param(Case("Flatten", [feed_("x", X4)], {"axis": 0}), id="flatten-0"),
    pytest.param(Case("Flatten", [feed_("x", X4)], {"axis": -1}), id="flatten-neg"),
    pytest.param(Case("Flatten", [feed_("x", X4)], {"axis": 2}, opset=9), id="flatten-v9"),
    pytest.param(Case("Squeeze", [feed_("x", rand(1, 3, 1, 5)), const("a", i64(0, -2))]),
                 id="squeeze"),
    pytest.param(Case("Squeeze", [feed_("x", rand(1, 3, 1, 5))]), id="squeeze-all"),
    pytest.param(Case("Squeeze", [feed_("x", rand(1, 3, 1, 5))], {"axes": [2]}, opset=11),
                 id="squeeze-attr-v11"),
    pytest.param(Case("Unsqueeze", [feed_("x", rand(3, 5)), const("a", i64(0, -1))]),
                 id="unsqueeze"),
    pytest.param(Case("Unsqueeze", [feed_("x", rand(3, 5))], {"axes": [1]}, opset=11),
                 id="unsqueeze-attr-v11"),
    pytest.param(Case("Reshape", [feed_("x", X4), const("s", i64(2, 3, 20))],
                      channels_last=("x",)), id="reshape-channels-last"),
    pytest.param(Case("Flatten", [feed_("x", X4)], channels_last=("x",)),
                 id="flatten-channels-last"),
]


@pytest.mark.parametrize("case", REGROUP)
@pytest.mark.parametrize("align", [1, 8])
def test_regroup(case, align):
    check(case, align)


def test_plain_reshape_is_a_view():
    _, plan = check(Case("Reshape", [feed_("x", X4), const("s", i64(6, 20))]))
    assert plan.layout.aliases and not plan.kernels


# ---- transposes, joins, splits --------------------------------------------------------------

MOVES = [
    pytest.param(Case("Transpose", [feed_("x", X4)]), id="transpose-default"),
    pytest.param(Case("Transpose", [feed_("x", X4)], {"perm": [0, 2, 3, 1]}), id="transpose-nhwc"),
    pytest.param(Case("Transpose", [feed_("x", X4)], {"perm": [1, 0, 3, 2]},
                      channels_last=("x",)), id="transpose-channels-last"),
    pytest.param(Case("Transpose", [feed_("x", rand(4, 5).astype(np.float16))],
                      opset=1), id="transpose-f16-v1"),
    # float32 from 4096 elements: one oneDNN reorder (test_transpose_through_onednn_*)
    pytest.param(Case("Transpose", [feed_("x", rand(8, 16, 4, 16))], {"perm": [0, 2, 1, 3]}),
                 id="transpose-heads"),
    pytest.param(Case("Transpose", [feed_("x", rand(2, 16, 12, 12))], {"perm": [0, 2, 3, 1]},
                      channels_last=("x",)), id="transpose-big-channels-last"),
    pytest.param(Case("Transpose", [feed_("x", rand(96, 80))]), id="transpose-matrix"),
    pytest.param(Case("Concat", [feed_("a", rand(2, 3, 4, 5)), feed_("b", rand(2, 2, 4, 5))],
                      {"axis": 1}, channels_last=("a", "b")), id="concat-channels"),
    pytest.param(Case("Concat", [feed_("a", rand(2, 3, 4, 5)), const("b", rand(2, 3, 1, 5))],
                      {"axis": -2}, channels_last=("a",)), id="concat-neg-axis"),
    pytest.param(Case("Concat", [feed_("a", i64(1, 2)), feed_("b", i64(3)),
                                 feed_("c", np.zeros(0, np.int64))], {"axis": 0}, opset=4),
                 id="concat-int-empty-v4"),
    pytest.param(Case("Split", [feed_("x", rand(2, 7, 3, 3)), const("s", i64(2, 5))],
                      {"axis": 1}, outputs=2, channels_last=("x",)), id="split-input"),
    pytest.param(Case("Split", [feed_("x", rand(6, 4))], {"axis": 0}, opset=13, outputs=3),
                 id="split-equal"),
    pytest.param(Case("Split", [feed_("x", rand(3, 7))], {"axis": -1, "num_outputs": 3},
                      opset=18, outputs=3), id="split-num-outputs-uneven"),
    pytest.param(Case("Split", [feed_("x", rand(5, 4))], {"split": [1, 4]}, opset=11, outputs=2),
                 id="split-attr-v11"),
    pytest.param(Case("Split", [feed_("x", rand(4, 5))], {"axis": 1, "split": [2, 3]}, opset=2,
                      outputs=2), id="split-attr-v2"),
]


@pytest.mark.parametrize("case", MOVES)
@pytest.mark.parametrize("align", [1, 8])
def test_moves(case, align):
    check(case, align)


# ---- slicing and gathering ------------------------------------------------------------------

X3 = rand(5, 6, 7)
BIG = np.iinfo(np.int64).max
ND_FULL = i64(1, -2, 3, 0, 0, 0, -5, 5, 6).reshape(3, 3)  # k == rank: one element each
ND_ROWS = i64(-1, 2).reshape(2, 1)  # k == 1: whole [6, 7] slices
ND_BATCH = i64(0, 1, -1, -6, 2, 3, 4, 2, 1, 5, -3, -1).reshape(2, 3, 2)  # [2, 3, k]: rows
ND_REPEATED = i64(1, 1, -4, 0, 4, -1).reshape(2, 3, 1)  # (1 three times, 4 twice)
ND_BATCH_REPEATED = i64(0, 1, 0, 1, -5, -5, 3, 2, 3, 2, 0, 1).reshape(2, 3, 2)
SELECT = [
    pytest.param(Case("Slice", [feed_("x", X3), const("s", i64(1, 0)), const("e", i64(4, -1))]),
                 id="slice-basic"),
    pytest.param(Case("Slice", [feed_("x", X3), const("s", i64(-1)), const("e", i64(-BIG)),
                                const("a", i64(1)), const("t", i64(-2))]), id="slice-neg-step"),
    pytest.param(Case("Slice", [feed_("x", X3), const("s", i64(10, -100)),
                                const("e", i64(-100, BIG)), const("a", i64(-1, 0)),
                                const("t", i64(-1, 3))]), id="slice-clamp"),
    pytest.param(Case("Slice", [feed_("x", X3), const("s", i64(2)), const("e", i64(2)),
                                const("a", i64(2))]), id="slice-empty"),
    pytest.param(Case("Slice", [feed_("x", X3)], {"starts": [1, -3], "ends": [3, 1000],
                                                  "axes": [0, 2]}, opset=1), id="slice-attr-v1"),
    pytest.param(Case("Slice", [feed_("x", X4), const("s", i64(1, 1)), const("e", i64(3, 4)),
                                const("a", i64(1, 3))], channels_last=("x",)),
                 id="slice-channels-last"),
    pytest.param(Case("Slice", [feed_("x", X3), feed_("s", i64(1)), feed_("e", i64(3))]),
                 id="slice-starts-fed"),
    pytest.param(Case("Gather", [feed_("x", X4), feed_("i", i64(2, 0, -1))], {"axis": 1},
                      channels_last=("x",)), id="gather-channels"),
    pytest.param(Case("Gather", [feed_("x", X3), const("i", np.array([[0, 4], [-2, 1]],
                                                                      np.int32))]),
                 id="gather-2d-int32"),
    pytest.param(Case("Gather", [feed_("x", X3), feed_("i", i64(3))], {"axis": -1}, opset=1),
                 id="gather-v1"),
    pytest.param(Case("Gather", [feed_("x", X3), feed_("i", np.array(2, np.int64))],
                      {"axis": 2}), id="gather-scalar-index"),
    pytest.param(Case("GatherElements", [feed_("x", X3),
                                         feed_("i", RNG.integers(-6, 6, (5, 3, 7)))],
                      {"axis": 1}), id="gather-elements"),
    pytest.param(Case("GatherElements", [feed_("x", rand(3, 3)),
                                         feed_("i", np.array([[1, 0, 2], [-1, 2, 0]], np.int32))],
                      opset=11),
                 id="gather-elements-v11"),
    pytest.param(Case("GatherND", [feed_("x", X3), feed_("i", i64(1, -2, 3).reshape(1, 3))]),
                 id="gathernd-full"),
    pytest.param(Case("GatherND", [feed_("x", X3),
                                   feed_("i", RNG.integers(0, 5, (2, 2, 1)))]),
                 id="gathernd-slices"),
    pytest.param(Case("GatherND", [feed_("x", X3), feed_("i", RNG.integers(0, 6, (5, 2, 1)))],
                      {"batch_dims": 1}), id="gathernd-batch"),
    pytest.param(Case("ScatterElements", [feed_("x", X3),
                                          feed_("i", RNG.integers(-7, 7, (5, 6, 2))),
                                          feed_("u", rand(5, 6, 2))], {"axis": -1}),
                 id="scatter-elements"),
    pytest.param(Case("ScatterElements", [feed_("x", rand(4, 3)),
                                          feed_("i", i64(1, 1, 3, 0).reshape(4, 1)),
                                          feed_("u", rand(4, 1))],
                      {"axis": 0, "reduction": "add"}, opset=16), id="scatter-elements-add"),
    pytest.param(Case("ScatterElements", [feed_("x", rand(4, 3)),
                                          feed_("i", i64(1, 1, 3, 0).reshape(4, 1)),
                                          feed_("u", rand(4, 1))],
                      {"axis": 0, "reduction": "max"}, opset=18), id="scatter-elements-max"),
    # ScatterND: distinct index tuples for reduction none (ONNX leaves repeats undefined),
    # repeated ones for the reductions; negative indices; k == rank and k < rank (slices).
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_FULL), feed_("u", rand(3))]),
                 id="scatternd-full-index"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_ROWS),
                                    feed_("u", rand(2, 6, 7))], opset=11),
                 id="scatternd-rows-v11"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_BATCH),
                                    feed_("u", rand(2, 3, 7))], opset=13),
                 id="scatternd-batch-v13"),
    pytest.param(Case("ScatterND", [feed_("x", X3), const("i", ND_BATCH),
                                    feed_("u", rand(2, 3, 7))], {"reduction": "none"}, opset=18),
                 id="scatternd-const-indices"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_REPEATED),
                                    feed_("u", rand(2, 3, 6, 7))], {"reduction": "add"}, opset=16),
                 id="scatternd-add-repeated"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_REPEATED),
                                    feed_("u", rand(2, 3, 6, 7))], {"reduction": "mul"}, opset=16),
                 id="scatternd-mul-repeated"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_BATCH_REPEATED),
                                    feed_("u", rand(2, 3, 7))], {"reduction": "max"}, opset=18),
                 id="scatternd-max-repeated"),
    pytest.param(Case("ScatterND", [feed_("x", X3), feed_("i", ND_BATCH_REPEATED),
                                    feed_("u", rand(2, 3, 7))], {"reduction": "min"}, opset=18),
                 id="scatternd-min-repeated"),
    pytest.param(Case("ScatterND", [feed_("x", X4), feed_("i", i64(1, -1, 0, 0).reshape(2, 2)),
                                    feed_("u", rand(2, 4, 5))], channels_last=("x",)),
                 id="scatternd-channels-last"),
]


@pytest.mark.parametrize("case", SELECT)
@pytest.mark.parametrize("align", [1, 8])
def test_select(case, align):
    check(case, align)


# ---- padding, tiling, broadcasting ----------------------------------------------------------

PADS = [
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, 1, 2, 0, 0, 2, 1, 3))],
                      channels_last=("x",)), id="pad-constant-channels"),
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, 0, 1, 2, 0, 0, 2, 1)),
                              const("v", np.array(1.5, np.float32))]), id="pad-constant-value"),
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, 0, 3, 4, 0, 0, 3, 4))],
                      {"mode": "reflect"}, channels_last=("x",)), id="pad-reflect"),
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, 0, 2, 6, 0, 0, 5, 1))],
                      {"mode": "edge"}, channels_last=("x",)), id="pad-edge"),
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, 1, 2, 7, 0, 2, 5, 1))],
                      {"mode": "wrap"}, opset=19, channels_last=("x",)), id="pad-wrap"),
    # onnx.reference pads with np.pad, which cannot crop: onnxruntime only.
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(0, -1, 2, 0, 0, 1, -1, 3))],
                      oracles=("ort",)), id="pad-negative"),
    pytest.param(Case("Pad", [feed_("x", X4), const("p", i64(2, 1, 1, 2)), ABSENT,
                              const("a", i64(-1, 1))], opset=18), id="pad-axes"),
    pytest.param(Case("Pad", [feed_("x", X3)], {"pads": [1, 0, 2, 0, 3, 1], "value": 2.0},
                      opset=2), id="pad-attr-v2"),
    pytest.param(Case("Pad", [feed_("x", X3)], {"pads": [1, 0, 2, 0, 3, 1], "mode": "reflect"},
                      opset=2), id="pad-attr-reflect-v2"),
    pytest.param(Case("Pad", [feed_("x", RNG.integers(0, 9, (3, 4)).astype(np.int32)),
                              const("p", i64(1, 2, 0, 1)), feed_("v", np.array(7, np.int32))],
                      opset=11), id="pad-int-fed-value-v11"),
    pytest.param(Case("Tile", [feed_("x", X4), const("r", i64(1, 2, 1, 3))], channels_last=("x",)),
                 id="tile-channels"),
    pytest.param(Case("Tile", [feed_("x", np.arange(6).reshape(2, 3)), const("r", i64(3, 1))],
                      opset=6), id="tile-int-v6"),
    pytest.param(Case("Expand", [feed_("x", rand(3, 1)), const("s", i64(2, 1, 4))]),
                 id="expand"),
    pytest.param(Case("Expand", [feed_("x", rand(2, 3, 1, 5)), const("s", i64(1, 1, 4, 1))],
                      opset=8, channels_last=("x",)), id="expand-channels-v8"),
]


@pytest.mark.parametrize("case", PADS)
@pytest.mark.parametrize("align", [1, 8])
def test_pad_tile_expand(case, align):
    check(case, align)


# ---- generators -----------------------------------------------------------------------------

GENERATE = [
    pytest.param(Case("Constant", [], {"value": numpy_helper.from_array(rand(2, 3), "v")}),
                 id="constant-tensor"),
    pytest.param(Case("Constant", [], {"value_floats": [1.0, 2.5]}, opset=12),
                 id="constant-floats"),
    pytest.param(Case("Constant", [], {"value_int": 7}, opset=13), id="constant-int"),
    pytest.param(Case("Constant", [], {"value_ints": [1, -2, 3]}), id="constant-ints"),
    pytest.param(Case("ConstantOfShape", [const("s", i64(2, 3))]), id="constant-of-shape-zero"),
    pytest.param(Case("ConstantOfShape", [feed_("s", i64(3, 1, 2))],
                      {"value": numpy_helper.from_array(np.array([5], np.int32), "v")}),
                 id="constant-of-shape-int-fed"),
    pytest.param(Case("Shape", [feed_("x", X4)]), id="shape"),
    pytest.param(Case("Shape", [feed_("x", X4)], {"start": 1, "end": -1}), id="shape-start-end"),
    pytest.param(Case("Shape", [feed_("x", X4)], channels_last=("x",)),
                 id="shape-channels-last"),
    pytest.param(Case("Size", [feed_("x", X3)]), id="size"),
    pytest.param(Case("Range", [const("a", np.array(1.0, np.float32)),
                                const("b", np.array(4.2, np.float32)),
                                const("d", np.array(0.7, np.float32))]), id="range-float"),
    pytest.param(Case("Range", [feed_("a", np.array(10, np.int32)),
                                feed_("b", np.array(-3, np.int32)),
                                feed_("d", np.array(-4, np.int32))]), id="range-int-fed"),
    pytest.param(Case("EyeLike", [feed_("x", rand(3, 5))]), id="eyelike"),
    pytest.param(Case("EyeLike", [feed_("x", rand(5, 3))],
                      {"k": -1, "dtype": TensorProto.INT32}), id="eyelike-k-dtype"),
    pytest.param(Case("OneHot", [feed_("i", i64(0, 3, -1, 7, -5).reshape(5, 1)),
                                 const("d", np.array(5, np.int64)),
                                 feed_("v", np.array([-1.0, 2.0], np.float32))]),
                 id="onehot"),
    pytest.param(Case("OneHot", [feed_("i", np.array([[1.0, 2.0], [0.0, -3.0]], np.float32)),
                                 const("d", np.array(4.0, np.float32)),
                                 feed_("v", np.array([0.0, 1.0], np.float32))], {"axis": 1},
                      opset=9),
                 id="onehot-axis-float-v9"),
]


def test_constant_sparse_value_is_densified():
    # Both oracles return a sparse tensor here; the expected dense value is written out.
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "values"),
        numpy_helper.from_array(i64(1, 5), "indices"), [2, 3])
    graph = helper.make_graph([helper.make_node("Constant", [], ["y"], sparse_value=sparse)],
                              "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                      [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    (y,) = tr_onnx.InferenceSession(model).run(None, {})
    np.testing.assert_array_equal(y, [[0, 1, 0], [0, 0, 2]])


@pytest.mark.parametrize("case", GENERATE)
def test_generate(case):
    check(case)


# ---- block rearrangements, triangles, scans, selection, einsum ------------------------------

REARRANGE = [
    pytest.param(Case("DepthToSpace", [feed_("x", rand(2, 8, 3, 5))], {"blocksize": 2},
                      channels_last=("x",)), id="depth-to-space-dcr"),
    pytest.param(Case("DepthToSpace", [feed_("x", rand(1, 18, 2, 3))],
                      {"blocksize": 3, "mode": "CRD"}, channels_last=("x",)),
                 id="depth-to-space-crd"),
    pytest.param(Case("DepthToSpace", [feed_("x", rand(1, 12, 2, 3))], {"blocksize": 2},
                      opset=1), id="depth-to-space-v1"),
    pytest.param(Case("SpaceToDepth", [feed_("x", rand(2, 3, 4, 6))], {"blocksize": 2},
                      channels_last=("x",)), id="space-to-depth"),
    pytest.param(Case("Trilu", [feed_("x", rand(2, 4, 5))], opset=14), id="trilu-upper"),
    pytest.param(Case("Trilu", [feed_("x", rand(4, 5)), const("k", np.array(-1, np.int64))],
                      {"upper": 0}, opset=14), id="trilu-lower-k"),
    pytest.param(Case("Trilu", [feed_("x", np.array([[np.inf, 1], [2, -np.inf]], np.float32)),
                                const("k", np.array(1, np.int64))], opset=14),
                 id="trilu-inf"),
    pytest.param(Case("CumSum", [feed_("x", X3), const("a", np.array(1, np.int64))]),
                 id="cumsum"),
    pytest.param(Case("CumSum", [feed_("x", X3), const("a", np.array(-1, np.int32))],
                      {"reverse": 1, "exclusive": 1}), id="cumsum-reverse-exclusive"),
    pytest.param(Case("CumSum", [feed_("x", np.arange(6, dtype=np.int32)),
                                 const("a", np.array(0, np.int64))], {"exclusive": 1}, opset=11),
                 id="cumsum-int-v11"),
    pytest.param(Case("CumSum", [feed_("x", X4), const("a", np.array(1, np.int64))],
                      {"reverse": 1}, channels_last=("x",)), id="cumsum-channels"),
    pytest.param(Case("TopK", [feed_("x", rand(3, 9)), const("k", i64(4))], outputs=2),
                 id="topk-largest"),
    pytest.param(Case("TopK", [feed_("x", np.array([[3, 1, 3, 2, 1, 3]], np.int32)),
                               const("k", i64(4))], {"largest": 0, "axis": 1}, outputs=2),
                 id="topk-smallest-ties"),
    pytest.param(Case("TopK", [feed_("x", np.array([[3, 1, 3, 2, 1, 3]], np.float32)),
                               const("k", i64(3))], outputs=2), id="topk-largest-ties"),
    pytest.param(Case("TopK", [feed_("x", rand(5, 4))], {"k": 2, "axis": 0}, opset=1, outputs=2),
                 id="topk-v1"),
    pytest.param(Case("Einsum", [feed_("a", rand(2, 3, 4)), feed_("b", rand(2, 4, 5))],
                      {"equation": "bij, bjk -> bik"}, opset=12), id="einsum-bmm"),
    pytest.param(Case("Einsum", [feed_("a", rand(3, 3))], {"equation": "ii"}, opset=12),
                 id="einsum-trace"),
]


@pytest.mark.parametrize("case", REARRANGE)
@pytest.mark.parametrize("align", [1, 8])
def test_rearrange(case, align):
    check(case, align)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.bool_])
def test_dtypes_pass_through(dtype):
    x = (RNG.standard_normal((2, 3, 4)) * 4).astype(dtype)
    check(Case("Concat", [feed_("a", x), feed_("b", x)], {"axis": 1}))
    check(Case("Pad", [feed_("x", x), const("p", i64(0, 1, 1, 0, 2, 0))], {"mode": "edge"}))
    check(Case("Slice", [feed_("x", x), const("s", i64(2)), const("e", i64(0)),
                         const("a", i64(2)), const("t", i64(-1))]))


def test_transpose_through_onednn_moves_bits(monkeypatch):
    """A float32 Transpose of at least 4096 elements is one oneDNN reorder, which copies bits:
    NaN payloads, -0, infinities and denormals arrive as they were; a small one stays NumPy."""
    from tr_onnx.ops import tensor

    require_onednn()
    x = rand(4, 8, 16, 12)
    bits = x.view(np.uint32)
    bits[0, 0, 0, :6] = [0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001]
    for perm, shape in (((0, 2, 3, 1), x.shape), ((1, 0, 2, 3), (2, 3, 4, 5))):
        built = spy_kernels(monkeypatch, tensor, ["onednn_transpose"])
        value = x if shape == x.shape else rand(*shape)
        model = onnx.shape_inference.infer_shapes(helper.make_model(helper.make_graph(
            [helper.make_node("Transpose", ["x"], ["y"], perm=list(perm))], "t",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]),
            opset_imports=[helper.make_opsetid("", 21)]))
        (y,) = tr_onnx.InferenceSession(model).run(None, {"x": value})
        np.testing.assert_array_equal(y.view(np.uint32), value.transpose(perm).view(np.uint32))
        assert built == ["onednn_transpose"] * (value.size >= 4096)


# ---- GatherGrad: one-hot GEMM for small tables -------------------------------------------------

def _gather_grad_model(gy_shape, idx_shape, out_shape, axis, elem=TensorProto.FLOAT):
    graph = helper.make_graph(
        [helper.make_node("GatherGrad", ["gy", "idx"], ["gx"], domain="ai.tr_onnx", axis=axis)],
        "gather_grad", [helper.make_tensor_value_info("gy", elem, gy_shape),
                        helper.make_tensor_value_info("idx", TensorProto.INT64, idx_shape)],
        [helper.make_tensor_value_info("gx", elem, out_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.tr_onnx", 1)])


@pytest.mark.parametrize("gy_shape,idx,out_shape,axis", [
    ((8, 3, 16), np.array([[0, 1, 1], [1, 0, -2]] * 4).reshape(8, 3), (2, 16), 0),  # token types
    ((2, 20, 3), np.array([0, -1, 3, 3, 1] * 4), (2, 4, 3), 1),
    ((64, 4), np.arange(64) % 50, (50, 4), 0),
], ids=["repeated_2d_index", "negative_axis1", "positions"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gather_grad_small_table_is_a_one_hot_product(monkeypatch, gy_shape, idx, out_shape,
                                                      axis, dtype):
    """``gx = 0; gx[..., idx, ...] += gy`` as np.add.at computes it (repeated and negative
    indices), through ``onehot(idx) @ gy``; a NaN or inf in gy takes np.add.at, so rows no
    index names stay 0."""
    elem = onnx_elem_type(dtype)
    sess = tr_onnx.InferenceSession(_gather_grad_model(list(gy_shape), list(idx.shape),
                                                       list(out_shape), axis, elem))
    products = []
    real = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **k: products.append(1) or real(*a, **k))
    gy = np.random.default_rng(3).standard_normal(gy_shape).astype(dtype)
    head = (slice(None),) * axis
    for case in ("finite", "nan"):
        if case == "nan":
            gy[(0,) * gy.ndim] = np.nan
        want = np.zeros(out_shape, dtype)
        np.add.at(want, head + (idx,), gy)
        got = sess.run(None, {"gy": gy, "idx": idx.astype(np.int64)})[0]
        np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-14,
                                   atol=1e-6 if dtype == np.float32 else 1e-14)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        if case == "finite":
            assert products, "the one-hot GEMM did not run"


@pytest.mark.parametrize("gy_shape,idx,out_shape,axis", [
    ((8, 32, 32), np.array(1), (3, 8, 32, 32), 0),  # an exporter's split of a fused QKV
    ((4, 6), np.array(-2), (4, 9, 6), 1),
    ((2, 3, 16), np.array([[0, 1, 1], [1, 0, -2]]), (2, 16), 0),
    ((2, 5, 3), np.array([0, -1, 3, 3, 1]), (2, 4, 3), 1),
], ids=["qkv_scalar", "negative_scalar_axis1", "repeated_2d_index", "negative_axis1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_gather_grad_of_few_indices_adds_slices_as_np_add_at(gy_shape, idx, out_shape, axis,
                                                           dtype):
    """Up to 16 indices: one slice add per index, in index order, bit-equal to np.add.at
    (repeated and negative indices, any dtype, NaN kept where an index puts it); an index out
    of range is an error naming the node, as np.add.at's."""
    elem = onnx_elem_type(dtype)
    sess = tr_onnx.InferenceSession(_gather_grad_model(list(gy_shape), list(idx.shape),
                                                       list(out_shape), axis, elem))
    gy = (np.random.default_rng(4).standard_normal(gy_shape) * 100).astype(dtype)
    head = (slice(None),) * axis
    for case in ("finite", "nan", "other_indices"):
        if case == "nan" and dtype != np.int32:
            gy[(0,) * gy.ndim] = np.nan
        if case == "other_indices":  # the indices are read each run, not at plan time
            idx = (idx + 1) % out_shape[axis]
        want = np.zeros(out_shape, dtype)
        np.add.at(want, head + (idx,), gy)
        got = sess.run(None, {"gy": gy, "idx": idx.astype(np.int64)})[0]
        np.testing.assert_array_equal(got, want)
    bad = np.full(idx.shape, out_shape[axis], np.int64)
    with pytest.raises(Exception, match="GatherGrad.*out of bounds"):
        sess.run(None, {"gy": gy, "idx": bad})
