"""Compress with a plan-time condition on the cuda backend (backends/cuda/ops/dynamic.py,
``tr_compress_b<bytes>`` in kernels/dynamic.cu), without a GPU: single-node models through the
host emulator (the kernel's g++ build) against ``backend="numpy"`` (``np.take`` of the kept
positions, itself held against onnxruntime by the node suite), bit for bit (data movement),
and a model trained three SGD steps through Compress's gradient (GatherGrad), losses and
parameters rtol 1e-5 / atol 1e-7 (the Gemm's sums run as the numpy kernel in the emulator;
the Compress adds no arithmetic). That the data-dependent forms are refused with their reason
is checked too.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures
from test_cuda_indexing_ops_cpu import assert_bits_equal, run_both, single_node

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("dynamic_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


COMPRESS = {  # id: (data shape, condition, axis or None)
    "axis0": ((5, 3), [1, 0, 1, 1, 0], 0),
    "axis1": ((2, 4, 3), [0, 1, 1, 0], 1),
    "last-axis": ((2, 3, 4), [1, 0, 0, 1], -1),
    "short-condition": ((2, 6), [0, 1, 1], 1),
    "flattened": ((2, 3, 2), [1, 0, 0, 1, 1, 0, 1], None),
    "keeps-none": ((3, 4), [0, 0, 0], 1),
}
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16, "i64": np.int64,
          "f64": np.float64}  # 4, 2, 2, 8, 8 bytes


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", list(COMPRESS))
def test_compress_by_a_constant_condition_equals_numpy_bit_for_bit(device, signatures, case,
                                                                    dt):
    shape, cond, axis = COMPRESS[case]
    x = (np.random.default_rng(1).standard_normal(shape) * 10).astype(DTYPES[dt])
    attrs = {} if axis is None else {"axis": axis}
    model = single_node("Compress", {"x": x}, {"cond": np.array(cond, bool)}, attrs, ["y"],
                        opset=11)
    want, got, kernels = run_both(model, {"x": x}, device, signatures)
    assert_bits_equal(got, want)
    assert kernels == ([] if case == "keeps-none" else
                       [f"tr_compress_b{np.dtype(DTYPES[dt]).itemsize}"])


def test_a_condition_from_the_data_is_left_to_the_numpy_backend(device):
    """NonZero of a model input: its count depends on the batch (a DynamicRegion), which the
    cuda backend does not run (docs/gpu.md): the plan is refused naming the op, rather than run a
    graph of fixed sizes."""
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["where"]),
         helper.make_node("Shape", ["where"], ["y"])], "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.array([1, 0, 2, 0], np.float32)
    np.testing.assert_array_equal(tr_onnx.InferenceSession(model).run(None, {"x": x})[0],
                                  [1, 2])
    with pytest.raises(UnsupportedModelError, match=r"no kernel for backend 'cuda':\s+- NonZero"):
        tr_onnx.InferenceSession(model, backend=CudaBackend(device=device)).run(None, {"x": x})


# ---- training through Compress's gradient ----------------------------------------------------

N, F, H = 4, 6, 7
KEEP = np.array([1, 0, 1, 1, 0, 1, 1], bool)  # 5 of the 7 hidden units reach the scores


def compress_model() -> onnx.ModelProto:
    w = (0.5 * np.random.default_rng(2).standard_normal((F, H))).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["input", "w"], ["h"]),
         helper.make_node("Compress", ["h", "keep"], ["scores"], axis=1)], "m",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [N, int(KEEP.sum())])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(KEEP, "keep")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def train(backend, **kw):
    sess = tr_onnx.TrainingSession(compress_model(), loss="cross_entropy",
                                   optimizer=SGD(lr=0.1), backend=backend, **kw)
    rng = np.random.default_rng(3)
    batches = [({"input": rng.standard_normal((N, F)).astype(np.float32)},
                rng.integers(0, int(KEEP.sum()), N)) for _ in range(3)]
    return sess, [sess.train_step(*b) for b in batches]


def test_three_sgd_steps_through_compress_equal_numpy(device, signatures):
    ref, want = train("numpy")
    sess, got = train(CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() == {"w"}
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-5, atol=1e-7)
    # the dropped units' weight columns get no gradient: they stay as initialised
    w0 = numpy_helper.to_array(compress_model().graph.initializer[0])
    np.testing.assert_array_equal(a["w"][:, ~KEEP], w0[:, ~KEEP])
    launches = launches_of(sess._state.active)
    check_launch_arguments(launches, sess._state.active, signatures)
    assert "tr_compress_b4" in {c.kernel.name for c in launches}
