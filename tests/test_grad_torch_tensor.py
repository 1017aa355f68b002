"""PyTorch autograd parity (float64) for the heavier tensor/matmul gradient rules: Gather's and
GatherND's scatter-add with repeated and negative indices, ScatterND's (index_put) with
negative and, for reduction add, repeated index tuples, Slice with steps, Pad's reflect/
edge/wrap accumulation, Einsum's diagonal and broadcast, MatMul's batch broadcasting, CumProd
with zeros (torch's cumprod backward), ReverseSequence."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gradcheck import Const, GradCase, build_model

from tr_onnx.training.gradients import vjp

RNG = np.random.default_rng(11)


def r(*shape):
    return RNG.standard_normal(shape)


def i64(*values):
    return np.array(values, np.int64)


def _index_put(idx, accumulate=False):
    """torch's ScatterND: ``x.index_put(idx.T, u)``, one index tensor per addressed axis."""
    index = tuple(torch.tensor(idx[..., j]) for j in range(idx.shape[-1]))
    return lambda x, u: x.index_put(index, u, accumulate=accumulate)


def _zeros_at(x, *at):
    for index in at:
        x[index] = 0.0
    return x


# distinct tuples, negative entries; [2, 3, k] with k < rank (slices along the last axis)
ND_BATCH = np.array([[[0, 1], [-1, 3], [2, -4]], [[1, 1], [-3, 0], [3, 2]]])
ND_REPEATED = np.array([[[1], [-2]], [[0], [1]], [[-2], [-2]]])  # [3, 2, 1], repeated


def _reflect(x, p):
    return F.pad(x[None], p, mode="reflect")[0]


def _replicate(x, p):
    return F.pad(x[None, None], p, mode="replicate")[0, 0]


def _circular(x, p):
    return F.pad(x[None, None], p, mode="circular")[0, 0]


# (id, GradCase, torch function of the differentiated inputs (tensors) -> output)
PARITY = [
    ("gather_repeated_negative",
     GradCase("t_gather", "Gather", [r(5, 3), Const(np.array([[1, -1], [1, 0], [-1, -1]]))],
              {"axis": 0}),
     lambda x: x[torch.tensor([[1, 4], [1, 0], [4, 4]])]),
    ("gather_nd_batch",
     GradCase("t_gather_nd", "GatherND", [r(2, 3, 4), Const(np.array([[[1], [1], [-1]],
                                                                 [[0], [2], [0]]]))],
              {"batch_dims": 1}),
     lambda x: torch.stack([x[0][[1, 1, 2]], x[1][[0, 2, 0]]])),
    ("scatter_nd_none_batch_slices",
     GradCase("t_scatter_nd", "ScatterND", [r(4, 5, 3), Const(ND_BATCH), r(2, 3, 3)], opset=18),
     _index_put(ND_BATCH)),
    ("scatter_nd_none_full_index",
     GradCase("t_scatter_nd_full", "ScatterND",
              [r(3, 4), Const(np.array([[2, -1], [0, 0], [-2, 1]])), r(3)]),
     _index_put(np.array([[2, -1], [0, 0], [-2, 1]]))),
    ("scatter_nd_add_repeated",
     GradCase("t_scatter_nd_add", "ScatterND", [r(4, 2, 3), Const(ND_REPEATED), r(3, 2, 2, 3)],
              {"reduction": "add"}, opset=16),
     _index_put(ND_REPEATED, accumulate=True)),
    ("slice_step3",
     GradCase("t_slice", "Slice", [r(7, 5), Const(i64(1)), Const(i64(7)), Const(i64(0)),
                                   Const(i64(3))]),
     lambda x: x[1:7:3]),
    ("slice_negative_step",
     GradCase("t_slice_neg", "Slice", [r(6, 4), Const(i64(-2)), Const(i64(-100)),
                                       Const(i64(0)), Const(i64(-2))]),
     lambda x: torch.flip(x, [0])[1::2]),
    ("pad_reflect",
     GradCase("t_pad_reflect", "Pad", [r(3, 4, 5), Const(i64(0, 2, 1, 0, 3, 2))],
              {"mode": "reflect"}),
     lambda x: _reflect(x, (1, 2, 2, 3))),
    ("pad_edge",
     GradCase("t_pad_edge", "Pad", [r(3, 4), Const(i64(3, 1, 2, 4))], {"mode": "edge"}),
     lambda x: _replicate(x, (1, 4, 3, 2))),
    ("pad_wrap",
     GradCase("t_pad_wrap", "Pad", [r(3, 4), Const(i64(2, 3, 1, 2))], {"mode": "wrap"},
              opset=19),
     lambda x: _circular(x, (3, 2, 2, 1))),
    ("einsum_diagonal_broadcast",
     GradCase("t_einsum", "Einsum", [r(3, 3, 1, 2), r(2, 4, 2)],
              {"equation": "ii...j,...kj->i...k"}),
     lambda a, b: torch.einsum("ii...j,...kj->i...k", a, b)),
    ("cumprod_with_zeros",
     GradCase("t_cumprod", "CumProd", [_zeros_at(r(3, 6), (0, 2), (1, 0), (1, 4), (2, 5)),
                                       Const(i64(1))], opset=26),
     lambda x: torch.cumprod(x, 1)),
    ("cumprod_reverse_two_zeros",
     GradCase("t_cumprod_rev", "CumProd", [_zeros_at(r(5, 2), (1, 0), (3, 0), (2, 1)),
                                           Const(i64(0))], {"reverse": 1}, opset=26),
     lambda x: torch.flip(torch.cumprod(torch.flip(x, [0]), 0), [0])),
    ("reverse_sequence",
     GradCase("t_revseq", "ReverseSequence", [r(5, 3, 2), Const(i64(5, 2, 0))],
              {"time_axis": 0, "batch_axis": 1}, opset=10),
     lambda x: torch.stack([torch.flip(x[:, 0], [0]),
                            torch.cat([torch.flip(x[:2, 1], [0]), x[2:, 1]]), x[:, 2]], 1)),
    ("matmul_broadcast",
     GradCase("t_matmul", "MatMul", [r(2, 1, 3, 4), r(3, 4, 5)]),
     torch.matmul),
    ("gemm_trans",
     GradCase("t_gemm", "Gemm", [r(4, 3), r(5, 4), r(5)],
              {"transA": 1, "transB": 1, "alpha": 0.25, "beta": -2.0}),  # exact in float32
     lambda a, b, c: 0.25 * a.T @ b.T + -2.0 * c),
]


@pytest.mark.parametrize("case,torch_fn", [p[1:] for p in PARITY], ids=[p[0] for p in PARITY])
def test_gradient_matches_torch(case, torch_fn):
    model = build_model(case)
    feed = {f"x{i}": x for i, x in enumerate(case.inputs)
            if x is not None and not isinstance(x, Const)}
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in feed.items()}
    y_torch = torch_fn(*leaves.values())
    cot = RNG.standard_normal(tuple(y_torch.shape))
    (y_torch * torch.tensor(cot)).sum().backward()
    y, grads = vjp(model, feed, list(feed), cot, channel_align=8)
    np.testing.assert_allclose(y, y_torch.detach().numpy(), rtol=1e-12, atol=1e-12)
    for name, leaf in leaves.items():
        np.testing.assert_allclose(grads[name], leaf.grad.numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)
