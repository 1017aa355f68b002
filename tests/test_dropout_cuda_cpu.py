"""Dropout on the cuda backend, checked on the host emulator: ``tr_dropout_<dt>``
(``kernels/elementwise.cu``) draws DropoutTraining's masks with NumPy's Philox4x64-10 on the
device, so the numpy kernel is the oracle bit for bit -- every seed (negative: keys above 2^63),
step, ratio (0 and 1 included), storage type and data-parallel row offset (``rows_before``,
values starting amid a Philox block of four); inference Dropout copies; a model with Dropout
trains on cuda as on numpy, and two emulated data-parallel ranks draw their rows of the global
batch's mask as the numpy ranks do (tests/dist_cuda_emulated.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.errors import TrOnnxError
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
ELEM = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("dropout_kernels")))


def dropout_training(shape, ratio: float, seed: int, dtype=np.float32, rows_before=False):
    """x -> DropoutTraining(x, step[, rows_before]) -> (y, mask)."""
    elem = ELEM[dtype]
    extra = ["rows_before"] if rows_before else []
    node = helper.make_node("DropoutTraining", ["x", "step", *extra], ["y", "mask"],
                            domain="ai.tr_onnx", ratio=ratio, seed=seed)
    graph = helper.make_graph(
        [node], "dropout", [helper.make_tensor_value_info("x", elem, shape)] + [
            helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in ["step", *extra]],
        [helper.make_tensor_value_info("y", elem, shape),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("ai.tr_onnx", 1)])


def both(model, feed, device):
    """(numpy's outputs, the emulated cuda backend's) of ``model`` on ``feed``."""
    return [tr_onnx.InferenceSession(model, **kw).run(None, feed) for kw in (
        {"backend": "numpy"}, {"backend": CudaBackend(device=device)})]


@pytest.mark.parametrize(("shape", "ratio", "seed", "step"), [
    ((4, 33), 0.3, 11, 0), ((2, 3, 5, 7), 0.5, -3, 9), ((257,), 0.1, -2**63 + 12345, 2**40),
    ((8, 16), 0.0, 5, 3), ((8, 16), 1.0, 5, 3), ((3, 1001), 0.75, 0, 123456789)])
def test_the_device_draws_the_numpy_kernels_mask_and_output_bit_for_bit(
        shape, ratio, seed, step, device):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:4] = [np.inf, -np.inf, np.nan, -0.0]  # x * 0 keeps their signs and NaNs
    feed = {"x": x, "step": np.array(step, np.int64)}
    (y_ref, m_ref), (y, m) = both(dropout_training(list(shape), ratio, seed), feed, device)
    np.testing.assert_array_equal(m, m_ref)
    assert np.array_equal(y.view(np.uint32), y_ref.view(np.uint32))
    if 0 < ratio < 1:  # a mask that drops and keeps, so equal masks are no accident
        assert 0 < m.mean() < 1


@pytest.mark.parametrize(("shape", "split"), [((10, 7), (3, 3, 4)), ((9, 3, 5), (4, 5)),
                                              ((6, 2, 3, 3), (1, 2, 3))])
def test_each_shards_mask_is_its_rows_of_the_whole_batchs(shape, split, device):
    """Data parallelism's ``rows_before``: 7, 15 and 18 values per row start shards amid a
    Philox block; the device and the numpy kernel agree with the whole batch's mask."""
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    step = {"step": np.array(4, np.int64)}
    (_, whole), _ = both(dropout_training(list(shape), 0.4, 7), {"x": x, **step}, device)
    start = 0
    for rows in split:
        model = dropout_training([rows, *shape[1:]], 0.4, 7, rows_before=True)
        feed = {"x": x[start:start + rows], **step, "rows_before": np.array(start, np.int64)}
        (_, m_ref), (_, m) = both(model, feed, device)
        np.testing.assert_array_equal(m, whole[start:start + rows], err_msg=f"rows {start}+")
        np.testing.assert_array_equal(m_ref, m)
        start += rows


def test_half_storage_draws_the_same_mask(device):
    """fp16 x: the mask of the float32 draw (the uniforms are float64 whatever x's dtype);
    at ratio 0.5 the scale 2 is exact, so y is the numpy kernel's too."""
    x = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float16)
    feed = {"x": x, "step": np.array(2, np.int64)}
    (y16_ref, m16_ref), (y16, m16) = both(dropout_training([6, 40], 0.5, 3, np.float16), feed,
                                          device)
    (_, m32), _ = both(dropout_training([6, 40], 0.5, 3), {**feed, "x": x.astype(np.float32)},
                       device)
    np.testing.assert_array_equal(m16, m32)
    np.testing.assert_array_equal(m16, m16_ref)
    assert np.array_equal(y16.view(np.uint16), y16_ref.view(np.uint16))


def inference_dropout(training: bool | None, ratio: float = 0.3):
    inputs = ["x", "ratio"] + (["training"] if training is not None else [])
    inits = [helper.make_tensor("ratio", TensorProto.FLOAT, [], [ratio])]
    if training is not None:
        inits.append(helper.make_tensor("training", TensorProto.BOOL, [], [training]))
    graph = helper.make_graph(
        [helper.make_node("Dropout", inputs, ["y", "mask"], name="drop")], "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [3, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_inference_dropout_copies_and_refuses_training_mode_as_numpy_does(device):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    y, mask = tr_onnx.InferenceSession(inference_dropout(False),
                                       backend=CudaBackend(device=device)).run(None, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.all()
    for backend in ("numpy", "cuda"):
        target = CudaBackend(device=device) if backend == "cuda" else backend
        with pytest.raises(TrOnnxError, match="'drop'.*training-mode Dropout needs the "
                                              "training session"):
            tr_onnx.InferenceSession(inference_dropout(True), backend=target).run(
                None, {"x": x})


def test_a_model_with_dropout_trains_on_cuda_as_on_numpy(device):
    """The zoo's MobileNet exported in training mode: Dropout(0.2) before the classifier."""
    kw = dict(optimizer=SGD(lr=0.05, momentum=0.9), channel_align=8)
    cuda = tr_onnx.TrainingSession(ZOO / "mobilenet_train.onnx", backend=CudaBackend(device=device),
                                   **kw)
    ref = tr_onnx.TrainingSession(ZOO / "mobilenet_train.onnx", backend="numpy", **kw)
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
        y = rng.integers(0, 10, 4)
        np.testing.assert_allclose(cuda.train_step({"input": x}, y),
                                   ref.train_step({"input": x}, y), rtol=1e-5)
    assert any(n.op_type == "DropoutTraining" for n in cuda._state.active.graph.nodes)
    a, b = cuda.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=2e-6, err_msg=name)
