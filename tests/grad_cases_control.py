"""Gradient cases for static control flow (tr_onnx.passes.control_flow): an If inlined and Scans
unrolled at specialisation, then differentiated through their bodies' own rules.
float64 finite differences of onnx.reference (which runs the control flow as written), see
tests/gradcheck.py."""

import numpy as np
from gradcheck import Const, GradCase
from onnx import TensorProto, helper

RNG = np.random.default_rng(13)
D = TensorProto.DOUBLE


def r(*shape):
    return RNG.standard_normal(shape)


def _vi(name, shape, elem=D):
    return helper.make_tensor_value_info(name, elem, shape)


def if_branches():
    """A single-node If has no input but its condition to differentiate (the branches of
    test_control_flow.py read outer values and are checked there): constant branches here."""
    then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=helper.make_tensor(
        "t", D, [2], [1.0, 2.0]))], "then", [], [_vi("t", [2])])
    other = helper.make_graph([helper.make_node("Constant", [], ["e"], value=helper.make_tensor(
        "e", D, [2], [3.0, 4.0]))], "else", [], [_vi("e", [2])])
    return {"then_branch": then, "else_branch": other}


def cumsum_body():
    nodes = [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
             helper.make_node("Identity", ["s_out"], ["scan"])]
    return helper.make_graph(nodes, "cumsum", [_vi("s_in", [3]), _vi("x_t", [3])],
                             [_vi("s_out", [3]), _vi("scan", [3])])


def rnn_body():
    """h = tanh(x_t W + h U); W and U ride along as states, so they are differentiated too."""
    nodes = [helper.make_node("MatMul", ["x_t", "w_in"], ["a"]),
             helper.make_node("MatMul", ["h_in", "u_in"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["c"]),
             helper.make_node("Tanh", ["c"], ["h_out"]),
             helper.make_node("Identity", ["w_in"], ["w_out"]),
             helper.make_node("Identity", ["u_in"], ["u_out"]),
             helper.make_node("Identity", ["h_out"], ["y"])]
    return helper.make_graph(nodes, "rnn", [_vi("h_in", [2, 4]), _vi("w_in", [3, 4]),
                                            _vi("u_in", [4, 4]), _vi("x_t", [2, 3])],
                             [_vi("h_out", [2, 4]), _vi("w_out", [3, 4]), _vi("u_out", [4, 4]),
                              _vi("y", [2, 4])])


CASES = [
    GradCase("if_constant_branches", "If", [Const(np.array(True))], if_branches(), wrt=()),
    GradCase("scan_cumsum", "Scan", [r(3), r(4, 3)], {"body": cumsum_body(),
                                                      "num_scan_inputs": 1}, n_outputs=2,
             output=1),
    GradCase("scan_cumsum_reverse_axis1", "Scan", [r(3), r(3, 4)],
             {"body": cumsum_body(), "num_scan_inputs": 1, "scan_input_axes": [1],
              "scan_input_directions": [1], "scan_output_axes": [-1],
              "scan_output_directions": [1]}, n_outputs=2, output=1,
             # onnx.reference's Scan runs forward directions only ("not implemented for other
             # ... input_direction than 0"): the finite differences use our forward, which
             # test_control_flow.py holds to onnxruntime for these attributes
             fd_oracle="ours"),
    GradCase("scan_rnn_cell_final_state", "Scan", [r(2, 4), r(3, 4), r(4, 4), r(5, 2, 3)],
             {"body": rnn_body(), "num_scan_inputs": 1}, n_outputs=4, output=0),
    GradCase("scan_rnn_cell_outputs", "Scan", [r(2, 4), r(3, 4), r(4, 4), r(5, 2, 3)],
             {"body": rnn_body(), "num_scan_inputs": 1}, n_outputs=4, output=3),
]
