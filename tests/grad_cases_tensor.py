"""Gradient cases for tensor manipulation (tr_onnx.ops.tensor) and Gemm/MatMul
(tr_onnx.ops.matmul): float64 finite differences, see tests/gradcheck.py."""

import numpy as np
from gradcheck import Const, GradCase
from onnx.reference.ops.op_scatter_elements import ScatterElements

RNG = np.random.default_rng(7)


def r(*shape):
    return RNG.standard_normal(shape)


def i64(*values):
    return Const(np.array(values, np.int64))


def axis(value):
    return Const(np.array(value, np.int64))


def distinct(*shape):
    """Well-separated values (no ties for TopK)."""
    n = int(np.prod(shape))
    return (RNG.permutation(n).astype(np.float64) * 0.5 + 0.1 * RNG.random(n)).reshape(shape)


IDX = np.array([[2, 0, -1], [1, 1, -3]], np.int64)  # negative and repeated indices

class Scatter(ScatterElements):
    """onnx.reference has no opset 9-10 Scatter; ONNX defines it as ScatterElements."""

    op_domain = ""


def _with_zeros(x, at):
    """``x`` with exact zeros at ``at``: CumProd's gradient must not divide by them."""
    for index in at:
        x[index] = 0.0
    return x


CASES = [
    # ---- Gemm ----
    GradCase("gemm_plain", "Gemm", [r(3, 4), r(4, 5), r(3, 5)]),
    GradCase("gemm_transA_alpha", "Gemm", [r(4, 3), r(4, 5), r(5)],
             {"transA": 1, "alpha": 0.7, "beta": 1.5}),
    GradCase("gemm_transB_c_row", "Gemm", [r(3, 4), r(5, 4), r(1, 5)], {"transB": 1}),
    GradCase("gemm_transAB_c_col", "Gemm", [r(4, 3), r(5, 4), r(3, 1)],
             {"transA": 1, "transB": 1, "alpha": -1.3, "beta": 0.5}),
    GradCase("gemm_c_scalar", "Gemm", [r(3, 4), r(4, 5), r()], {"beta": 2.0}),
    GradCase("gemm_no_c", "Gemm", [r(2, 3), r(3, 4)], {"alpha": 2.0}),
    GradCase("gemm_const_weight", "Gemm", [r(2, 3), Const(r(4, 3)), Const(r(4))],
             {"transB": 1}),
    GradCase("gemm_opset9", "Gemm", [r(3, 4), r(4, 5), r(3, 5)], {"transA": 0}, opset=9),
    # ---- MatMul ----
    GradCase("matmul_2d", "MatMul", [r(3, 4), r(4, 5)]),
    GradCase("matmul_dot", "MatMul", [r(4), r(4)]),
    GradCase("matmul_vec_mat", "MatMul", [r(4), r(4, 5)]),
    GradCase("matmul_mat_vec", "MatMul", [r(3, 4), r(4)]),
    GradCase("matmul_batched_x_2d", "MatMul", [r(2, 3, 4), r(4, 5)]),
    GradCase("matmul_batched", "MatMul", [r(2, 3, 4), r(2, 4, 5)]),
    GradCase("matmul_broadcast_batch", "MatMul", [r(2, 1, 3, 4), r(3, 4, 5)]),
    GradCase("matmul_2d_x_batched", "MatMul", [r(3, 4), r(2, 4, 5)]),
    GradCase("matmul_vec_batched", "MatMul", [r(4), r(2, 4, 5)]),
    GradCase("matmul_batched_vec", "MatMul", [r(2, 3, 4), r(4)]),
    # ---- reshaping ----
    GradCase("reshape", "Reshape", [r(2, 3, 4), i64(3, -1, 0)]),
    GradCase("reshape_opset5_4d", "Reshape", [r(2, 3, 4, 5), i64(2, -1)], opset=5),
    GradCase("flatten_4d", "Flatten", [r(2, 3, 4, 5)], {"axis": 2}),
    GradCase("flatten_neg_axis", "Flatten", [r(2, 3, 4)], {"axis": -1}),
    GradCase("squeeze", "Squeeze", [r(2, 1, 3, 1), i64(1, -1)]),
    GradCase("squeeze_opset11_attr", "Squeeze", [r(2, 1, 3)], {"axes": [1]}, opset=11),
    GradCase("unsqueeze", "Unsqueeze", [r(2, 3), i64(0, -1)]),
    GradCase("unsqueeze_opset11_attr", "Unsqueeze", [r(2, 3)], {"axes": [1]}, opset=11),
    GradCase("transpose_perm_4d", "Transpose", [r(2, 3, 4, 5)], {"perm": [0, 2, 3, 1]}),
    GradCase("transpose_default", "Transpose", [r(2, 3, 4)]),
    # ---- joining and splitting ----
    GradCase("concat_axis1_4d", "Concat", [r(2, 3, 4, 4), r(2, 5, 4, 4)], {"axis": 1}),
    GradCase("concat_neg_axis_3", "Concat", [r(2, 3), r(2, 1), r(2, 4)], {"axis": -1}),
    GradCase("concat_one_needed", "Concat", [r(2, 3), Const(r(4, 3)), r(1, 3)], {"axis": 0},
             wrt=(2,)),
    GradCase("split_sizes_out0", "Split", [r(6, 3), i64(2, 4)], {"axis": 0}, n_outputs=2),
    GradCase("split_sizes_out1", "Split", [r(6, 3), i64(2, 4)], {"axis": 0}, n_outputs=2,
             output=1),
    GradCase("split_even_neg_axis", "Split", [r(2, 6)], {"axis": -1}, n_outputs=3, output=2),
    GradCase("split_opset11_attr_4d", "Split", [r(2, 6, 3, 3)], {"axis": 1, "split": [1, 5]},
             n_outputs=2, output=1, opset=11),
    GradCase("split_num_outputs_opset18", "Split", [r(2, 7)], {"axis": 1, "num_outputs": 3},
             n_outputs=3, output=2, opset=18),
    # ---- slicing ----
    GradCase("slice_unit", "Slice", [r(5, 6), i64(1, 2), i64(4, 100), i64(0, 1)]),
    GradCase("slice_neg_bounds", "Slice", [r(5, 6), i64(-4), i64(-1), i64(-1)]),
    GradCase("slice_step2", "Slice", [r(5, 7), i64(0, 1), i64(5, 7), i64(0, 1), i64(2, 3)]),
    GradCase("slice_neg_step", "Slice", [r(5, 6), i64(-1), i64(-100), i64(1), i64(-2)]),
    GradCase("slice_neg_step_clamped", "Slice", [r(4, 6), i64(10, 4), i64(0, -10), i64(0, 1),
                                                  i64(-1, -3)]),
    GradCase("slice_4d_channels", "Slice", [r(2, 6, 3, 3), i64(1), i64(5), i64(1)]),
    GradCase("slice_opset1_attrs", "Slice", [r(4, 5)],
             {"starts": [1, 0], "ends": [3, 4], "axes": [0, 1]}, opset=1),
    GradCase("slice_empty", "Slice", [r(4, 5), i64(3), i64(1), i64(0)]),
    # ---- gathering and scattering ----
    GradCase("gather_axis0_repeat", "Gather", [r(4, 3), Const(IDX)], {"axis": 0}),
    GradCase("gather_axis1_neg", "Gather", [r(2, 4, 3), Const(IDX)], {"axis": -2}),
    GradCase("gather_scalar_index", "Gather", [r(4, 3), Const(np.array(-1, np.int64))],
             {"axis": 1}),
    GradCase("gather_4d", "Gather", [r(2, 5, 3, 3), Const(np.array([4, 0, 4], np.int64))],
             {"axis": 1}),
    GradCase("gather_elements_axis1", "GatherElements",
             [r(3, 4), Const(np.array([[0, 3, 3], [1, -1, 0], [2, 2, 2]], np.int64))],
             {"axis": 1}),
    GradCase("gather_elements_axis0", "GatherElements",
             [r(3, 2), Const(np.array([[0, 1], [2, 0], [0, -3], [1, 1]], np.int64))],
             {"axis": 0}),
    GradCase("gather_nd", "GatherND",
             [r(3, 4, 2), Const(np.array([[0, 1], [2, 3], [0, 1], [-1, 0]], np.int64))]),
    GradCase("gather_nd_full_index", "GatherND",
             [r(3, 4), Const(np.array([[[0, 1]], [[2, -1]], [[0, 1]]], np.int64))]),
    GradCase("gather_nd_batch_dims", "GatherND",
             [r(2, 3, 4), Const(np.array([[[1], [1]], [[0], [2]]], np.int64))],
             {"batch_dims": 1}),
    GradCase("scatter_elements_none", "ScatterElements",
             [r(3, 4), Const(np.array([[1, 3], [0, -1]], np.int64)), r(2, 2)], {"axis": 1}),
    GradCase("scatter_elements_axis0", "ScatterElements",
             [r(3, 3), Const(np.array([[2, 0, 1]], np.int64)), r(1, 3)], {"axis": 0}),
    GradCase("scatter_elements_add", "ScatterElements",
             [r(3, 4), Const(np.array([[1, 1], [0, -1]], np.int64)), r(2, 2)],
             {"axis": 1, "reduction": "add"}, opset=16),
    # ScatterND: distinct index tuples for reduction none (repeats leave the winner undefined)
    GradCase("scatter_nd_none_rows", "ScatterND",
             [r(4, 3), Const(np.array([[2], [-4]], np.int64)), r(2, 3)]),
    GradCase("scatter_nd_none_batch_elements", "ScatterND",
             [r(3, 4), Const(np.array([[[0, 1], [2, -1]], [[-1, 0], [1, 1]]], np.int64)),
              r(2, 2)], opset=18),
    GradCase("scatter_nd_add_repeated", "ScatterND",
             [r(3, 2, 2), Const(np.array([[1], [-2], [0], [1]], np.int64)), r(4, 2, 2)],
             {"reduction": "add"}, opset=16),
    # ---- broadcasting, padding, tiling ----
    GradCase("expand", "Expand", [r(3, 1), i64(2, 3, 4)]),
    GradCase("expand_lower_rank_shape", "Expand", [r(2, 1, 4), i64(3, 1)]),
    GradCase("pad_constant", "Pad", [r(3, 4), i64(1, 0, 2, 3), Const(np.array(0.5))]),
    # onnx.reference's Pad rejects negative pads (np.pad): finite differences use our forward
    GradCase("pad_constant_negative", "Pad", [r(4, 5), i64(-1, 2, 1, -2)], fd_oracle="ours"),
    GradCase("pad_constant_4d", "Pad", [r(2, 3, 4, 4), i64(0, 0, 1, 2, 0, 0, 2, 1)]),
    GradCase("pad_reflect", "Pad", [r(3, 4), i64(2, 3, 1, 3)], {"mode": "reflect"}),
    GradCase("pad_edge_4d", "Pad", [r(2, 3, 3, 4), i64(0, 0, 2, 1, 0, 0, 1, 3)],
             {"mode": "edge"}),
    GradCase("pad_wrap_large", "Pad", [r(2, 3), i64(3, 4, 2, 5)], {"mode": "wrap"}, opset=19),
    GradCase("pad_reflect_cropped", "Pad", [r(5, 4), i64(-1, 2, 2, -1)], {"mode": "reflect"},
             fd_oracle="ours"),  # negative pads: see pad_constant_negative
    GradCase("pad_axes_opset18", "Pad", [r(3, 4, 5), i64(1, 2), None, i64(-1)],
             {"mode": "edge"}, opset=18),
    GradCase("pad_opset2_attrs", "Pad", [r(3, 4)], {"pads": [1, 0, 0, 2], "value": 1.0},
             opset=2),
    GradCase("tile", "Tile", [r(2, 3), i64(2, 3)]),
    GradCase("tile_4d_partial", "Tile", [r(2, 3, 2, 2), i64(1, 2, 1, 3)]),
    # ---- rearrangements, triangles, scans, selection, einsum ----
    GradCase("depth_to_space_dcr", "DepthToSpace", [r(2, 8, 3, 2)], {"blocksize": 2}),
    GradCase("depth_to_space_crd", "DepthToSpace", [r(1, 8, 2, 3)],
             {"blocksize": 2, "mode": "CRD"}),
    GradCase("space_to_depth", "SpaceToDepth", [r(2, 3, 4, 6)], {"blocksize": 2}),
    GradCase("trilu_upper_k", "Trilu", [r(2, 4, 5), i64(1)]),
    GradCase("trilu_lower_neg_k", "Trilu", [r(4, 5), i64(-1)], {"upper": 0}),
    GradCase("trilu_default_k", "Trilu", [r(4, 3)], {"upper": 0}),
    GradCase("cumsum", "CumSum", [r(3, 4), axis(1)]),
    GradCase("cumsum_exclusive", "CumSum", [r(3, 4), axis(0)], {"exclusive": 1}),
    GradCase("cumsum_reverse", "CumSum", [r(3, 4), axis(-1)], {"reverse": 1}),
    GradCase("cumsum_reverse_exclusive", "CumSum", [r(2, 3, 4), axis(1)],
             {"reverse": 1, "exclusive": 1}),
    GradCase("cumprod", "CumProd", [r(3, 4), axis(1)], opset=26),
    GradCase("cumprod_with_zeros", "CumProd", [_with_zeros(r(3, 5), [(0, 1), (1, 0), (1, 3),
                                                                      (2, 4)]), axis(1)],
             opset=26),
    GradCase("cumprod_exclusive", "CumProd", [_with_zeros(r(4, 3), [(1, 2)]), axis(0)],
             {"exclusive": 1}, opset=26),
    GradCase("cumprod_reverse", "CumProd", [_with_zeros(r(3, 4), [(2, 1)]), axis(-1)],
             {"reverse": 1}, opset=26),
    GradCase("cumprod_reverse_exclusive", "CumProd", [r(2, 4, 3), axis(1)],
             {"reverse": 1, "exclusive": 1}, opset=26),
    GradCase("reverse_sequence_time0", "ReverseSequence", [r(4, 3, 2), i64(4, 1, 2)],
             {"time_axis": 0, "batch_axis": 1}, opset=10),
    GradCase("reverse_sequence_batch0", "ReverseSequence", [r(3, 5, 2), i64(0, 5, 3)],
             {"time_axis": 1, "batch_axis": 0}, opset=10),
    GradCase("scatter_legacy", "Scatter",
             [r(3, 4), Const(np.array([[1, 3], [0, -1]], np.int64)), r(2, 2)], {"axis": 1},
             opset=10, reference_ops=(Scatter,)),
    GradCase("topk_largest", "TopK", [distinct(3, 5), i64(2)], n_outputs=2),
    GradCase("topk_smallest_axis0", "TopK", [distinct(5, 3), i64(3)],
             {"axis": 0, "largest": 0}, n_outputs=2),
    GradCase("topk_opset1_attr", "TopK", [distinct(2, 6)], {"k": 3}, n_outputs=2, opset=1),
    GradCase("einsum_matmul", "Einsum", [r(3, 4), r(4, 5)], {"equation": "ij,jk->ik"}),
    GradCase("einsum_batch_ellipsis", "Einsum", [r(2, 3, 4), r(2, 4, 5)],
             {"equation": "...ij,...jk->...ik"}),
    GradCase("einsum_broadcast_ellipsis", "Einsum", [r(2, 1, 3, 4), r(1, 3, 4, 5)],
             {"equation": "...ij,...jk->...ik"}),
    GradCase("einsum_ellipsis_one_side", "Einsum", [r(2, 3, 4), r(4, 5)],
             {"equation": "...ij,jk->...ik"}),
    GradCase("einsum_trace", "Einsum", [r(4, 4)], {"equation": "ii->"}),
    GradCase("einsum_diagonal", "Einsum", [r(3, 3, 2)], {"equation": "iij->ji"}),
    GradCase("einsum_sum_axis", "Einsum", [r(3, 4)], {"equation": "ij->i"}),
    GradCase("einsum_implicit_outer", "Einsum", [r(3), r(4)], {"equation": "i,j"}),
    GradCase("einsum_implicit_transpose", "Einsum", [r(3, 4)], {"equation": "ba"}),
    GradCase("einsum_three_operands", "Einsum", [r(2, 3), r(3, 4), r(4)],
             {"equation": "ij, jk, k -> i"}),
]
