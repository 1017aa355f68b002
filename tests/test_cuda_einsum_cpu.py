"""Einsum's cuda binding (backends/cuda/ops/matmul.py, ``tr_einsum_<dt>`` in kernels/matmul.cu),
checked without a GPU: single-node models on ``backend="cuda"`` through the host emulator (the
kernel's g++ build) against ``backend="numpy"`` (``np.einsum``, itself held against
onnxruntime by the node suite), and models trained three SGD steps through Einsum's gradient
rule (one Einsum per operand, with identity and ones constants for diagonals and broadcasts).

Tolerances: the kernel sums each output's products in double and rounds once, so it is within
half an ulp of the exact sum; ``np.einsum`` sums in the storage type (float32, or float32 for
bf16 through ``compute_wide``) in its own order, within ``m * eps * sum|terms|`` of it (m the
number of summed terms). The bound used is ``(m + 1) * eps * sum|terms|`` per element
(``sum|terms|`` computed in float64 by ``np.einsum`` of the absolute values), plus one storage
ulp of the result for float16 / bfloat16 storage. Training: losses and parameters after three
SGD steps rtol 1e-5 / atol 1e-7 (the sums here have at most 12 terms: a few float32 ulp).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures
from test_cuda_indexing_ops_cpu import run_both, single_node

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.ops.matmul import einsum_terms
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

FLOATS = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16}
EPS = {"f32": 2.0 ** -23, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("einsum_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


EQUATIONS = {  # id: (equation, operand shapes)
    "matmul": ("ij,jk->ik", [(3, 4), (4, 5)]),
    "batched": ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    "attention-scores": ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    "implicit-output": ("ij,jk", [(3, 4), (4, 2)]),
    "transpose": ("ij->ji", [(3, 4)]),
    "trace": ("ii->", [(4, 4)]),
    "diagonal": ("ii->i", [(4, 4)]),
    "sum-all": ("ijk->", [(2, 3, 4)]),
    "outer": ("i,j->ij", [(3,), (4,)]),
    "three-operands": ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    "ellipsis-broadcast": ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 2)]),
    "bilinear": ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),
}


def _bound(equation: str, xs: list[np.ndarray], dt: str) -> np.ndarray:
    """``(m + 1) * eps * sum|terms|`` per output element, plus one storage ulp of the result
    for a half type (module docstring)."""
    wide = [np.abs(x.astype(np.float64)) for x in xs]
    spelled, out, _ = einsum_terms(equation, [x.shape for x in xs])
    sizes = {c: n for term, x in zip(spelled, xs) for c, n in zip(term, x.shape)}
    m = int(np.prod([sizes[c] for c in set("".join(spelled)) - set(out)] or [1]))
    magnitude = np.einsum(equation, *wide)
    return (m + 1) * 2.0 ** -23 * magnitude + (EPS[dt] * magnitude if dt != "f32" else 0.0)


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("case", list(EQUATIONS))
def test_einsum_equals_numpy_within_the_summation_bound(device, signatures, case, dt):
    equation, shapes = EQUATIONS[case]
    rng = np.random.default_rng(len(case))
    xs = [rng.standard_normal(s).astype(FLOATS[dt]) for s in shapes]
    feeds = {f"x{k}": x for k, x in enumerate(xs)}
    model = single_node("Einsum", feeds, {}, {"equation": equation}, ["y"], opset=12)
    (want,), (got,), kernels = run_both(model, feeds, device, signatures)
    assert kernels == [f"tr_einsum_{dt}"]
    assert got.dtype == want.dtype and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= _bound(equation, xs, dt)), err.max()


def test_an_empty_output_launches_nothing(device, signatures):
    feeds = {"x0": np.ones((0, 3), np.float32), "x1": np.ones((3, 2), np.float32)}
    model = single_node("Einsum", feeds, {}, {"equation": "ij,jk->ik"}, ["y"], opset=12)
    (want,), (got,), kernels = run_both(model, feeds, device, signatures)
    assert got.shape == want.shape == (0, 2) and kernels == []


def test_five_operands_are_refused_with_the_reason(device):
    feeds = {f"x{k}": np.ones((2,), np.float32) for k in range(5)}
    model = single_node("Einsum", feeds, {}, {"equation": "i,i,i,i,i->i"}, ["y"], opset=12)
    with pytest.raises(tr_onnx.backends.cuda.bind.CudaUnsupported, match="5 operands"):
        tr_onnx.InferenceSession(model, backend=CudaBackend(device=device)).run(None, feeds)


# ---- training: Einsum's gradient rule on cuda (emulated) against numpy ------------------------

N, F = 4, 6
TRAIN = {  # id: (equation over (input, w), w's shape, scores' shape)
    "projection": ("nf,fc->nc", (F, 5), [N, 5]),
    # w broadcast over a size-1 axis: its gradient sums gy over the longer one (a ones constant)
    "broadcast-weight": ("nf,xfc->nc", (1, F, 5), [N, 5]),
    # a letter only w has (summed away): the gradient broadcasts gy back along it
    "summed-weight-axis": ("nf,fkc->nc", (F, 2, 5), [N, 5]),
}


def einsum_model(equation: str, w_shape, out_shape) -> onnx.ModelProto:
    w = (0.5 * np.random.default_rng(3).standard_normal(w_shape)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Einsum", ["input", "w"], ["scores"], equation=equation)], "m",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def train(case, backend, **kw):
    sess = tr_onnx.TrainingSession(einsum_model(*TRAIN[case]), loss="cross_entropy",
                                   optimizer=SGD(lr=0.1), backend=backend, **kw)
    rng = np.random.default_rng(4)
    batches = [({"input": rng.standard_normal((N, F)).astype(np.float32)},
                rng.integers(0, 5, N)) for _ in range(3)]
    return sess, [sess.train_step(*b) for b in batches]


@pytest.mark.parametrize("case", list(TRAIN))
def test_three_sgd_steps_through_einsums_gradient_equal_numpy(device, signatures, case):
    ref, want = train(case, "numpy")
    sess, got = train(case, CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() == {"w"}
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-5, atol=1e-7)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    # the forward Einsum and the weight's gradient Einsum both run the contraction kernel
    assert sum(c.kernel.name == "tr_einsum_f32" for c in launches) >= 2
