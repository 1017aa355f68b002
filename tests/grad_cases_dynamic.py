"""Gradient cases for the data-dependent ops (tr_onnx.ops.dynamic): float64 finite
differences, see tests/gradcheck.py. Compress's condition is a constant here (its output size
is then planned); a condition computed at run time is a DynamicRegion's, checked in
tests/test_dynamic_shapes.py."""

import numpy as np
from gradcheck import Const, GradCase
from onnx import TensorProto, helper

RNG = np.random.default_rng(13)


def r(*shape):
    return RNG.standard_normal(shape)


def cond(*values):
    return Const(np.array(values, np.bool_))


def branch(name, nodes, out, shape):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(
        out, TensorProto.DOUBLE, shape)])


# If with a condition fed at run time: then o0 * o1, else tanh(o0) (o1 unread: zero gradient)
IF_BRANCHES = {
    "then_branch": branch("then", [helper.make_node("Mul", ["o0", "o1"], ["t"])], "t", [2, 3]),
    "else_branch": branch("else", [helper.make_node("Tanh", ["o0"], ["e"])], "e", [2, 3])}

CASES = [
    GradCase("compress_axis0", "Compress", [r(4, 3), cond(1, 0, 1, 1)], {"axis": 0}, opset=11),
    GradCase("compress_axis_neg_short", "Compress", [r(2, 3, 5), cond(0, 1, 1)], {"axis": -1},
             opset=11),
    GradCase("compress_flattened", "Compress", [r(2, 3), cond(1, 0, 0, 1, 1)], opset=11),
    GradCase("compress_4d_channels", "Compress", [r(2, 4, 3, 3), cond(1, 0, 1, 1)],
             {"axis": 1}, opset=11),
    GradCase("if_runtime_then", "If", [np.array(True)], IF_BRANCHES, outer=[r(2, 3), r(2, 3)]),
    GradCase("if_runtime_else", "If", [np.array(False)], IF_BRANCHES, outer=[r(2, 3), r(2, 3)]),
]
