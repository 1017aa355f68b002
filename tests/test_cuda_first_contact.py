"""First-contact failures of the cuda backend found by reviewing it against the real libraries
(issue 10), each checked on the CPU with a device double that behaves as the GPU stack does:

3. a cuDNN graph the device cannot build is the node's binding refusing it: MatMul falls back
   to its own kernel (same outputs as NumPy on the emulator), Gemm is listed with every node
   that cannot run, never a crash;
4. a capture the driver invalidates, or whose end/upload fails, ends the capture and reaches
   the ``cuda_graphs=`` behaviour (eager fallback with a warning, or the error when required);
   CupyDevice ends a capture whose state query raises;
7. each kernel family is compiled once per process and architecture, not per device;
11. the garbage collector is paused while a step is captured.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.backends.cuda import device as cuda_device
from tr_onnx.backends.cuda import sources
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import CudnnCall, Launch
from tr_onnx.backends.cuda.capture import CaptureError
from tr_onnx.backends.cuda.cudnn_graphs import CudnnGraphError
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY, CudaUnsupported
from tr_onnx.testing.host_emulator import HostEmulator, build_host_library
from tr_onnx.testing.recorder import FakeRecorder

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("first_contact"))


def _refusing(base, kinds):
    """``base`` whose cuDNN cannot build graphs of ``kinds`` (as build_pygraph raises)."""

    class Refusing(base):
        def build_cudnn(self, desc):
            if desc.kind in kinds:
                raise CudnnGraphError(f"{desc.node}: cuDNN has no engine for the {desc.kind} "
                                      "graph (test: the device refuses it)")
            return super().build_cudnn(desc)

    return Refusing


def _batched_matmul_model():
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((6, 4, 5)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 3, 5])],
                              [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_matmul_graph_the_device_cannot_build_runs_on_its_own_kernel(host_lib):
    model = _batched_matmul_model()
    x = np.random.default_rng(1).standard_normal((6, 3, 4)).astype(np.float32)
    want = tr_onnx.InferenceSession(model).run(None, {"x": x})[0]
    device = _refusing(HostEmulator, {"matmul"})
    sess = tr_onnx.InferenceSession(
        model, backend=CudaBackend(device=lambda plan: device(plan, host_lib)))
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plan = sess.plan_for({"x": x})
    calls = [c for bn in plan.executor.bound for c in bn.calls]
    assert not any(isinstance(c, CudnnCall) for c in calls)
    assert [c.kernel.name for c in calls if isinstance(c, Launch)] == ["tr_matmul_f32"]


def test_a_gemm_graph_the_device_cannot_build_is_listed_not_a_crash():
    device = _refusing(FakeRecorder, {"matmul"})
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx",
                                    backend=CudaBackend(device=lambda plan: device(plan.memory)))
    with pytest.raises(CudaUnsupported, match=r"Gemm(.|\n)*the device refuses it") as info:
        sess.run(None, {"input": np.zeros((4, 64), np.float32)})
    gemms = [n for d, op, v, names in info.value.missing if op == "Gemm" for n in names]
    assert len(gemms) == 3  # every Gemm of the MLP, in one error


class _EndFails(FakeRecorder):
    """The driver invalidates the capture: ending it raises (cudaErrorStreamCaptureInvalidated)."""

    def end_capture(self):
        super().end_capture()
        raise RuntimeError("cudaErrorStreamCaptureInvalidated: operation failed due to a "
                           "previous error during capture")


def _mlp_session(device_cls, cuda_graphs):
    return tr_onnx.InferenceSession(ZOO / "mlp.onnx", cuda_graphs=cuda_graphs,
                                    backend=CudaBackend(device=lambda plan: device_cls(
                                        plan.memory, policy=EXECUTOR_POLICY)))


def test_a_capture_that_fails_at_its_end_falls_back_to_eager_with_a_warning():
    sess = _mlp_session(_EndFails, "fallback")
    x = {"input": np.zeros((4, 64), np.float32)}
    sess.run(None, x)  # eager warm-up
    with pytest.warns(RuntimeWarning, match=r"<end of capture>.*CaptureInvalidated.*eager"):
        sess.run(None, x)
    ex = sess.plan_for(x).executor
    ops = [c.op for c in ex.device.calls]
    assert ops.count("begin_capture") == 1 and "abort_capture" in ops
    assert ex.eager_phases == {"forward"} and not ex.graphs
    sess.run(None, x)  # eager from now on
    assert [c.op for c in ex.device.calls].count("begin_capture") == 1


def test_a_capture_that_fails_at_its_end_is_the_capture_error_when_required():
    sess = _mlp_session(_EndFails, "require")
    x = {"input": np.zeros((4, 64), np.float32)}
    sess.run(None, x)
    with pytest.raises(CaptureError, match=r"<end of capture>.*cuda_graphs='fallback'"):
        sess.run(None, x)


class _InvalidatedStream:
    """A CuPy stream whose capture the driver invalidated: the state query raises."""

    def __init__(self):
        self.ended = 0

    def is_capturing(self):
        raise RuntimeError("cudaErrorStreamCaptureInvalidated")

    def end_capture(self):
        self.ended += 1
        raise RuntimeError("cudaErrorStreamCaptureInvalidated")


def test_cupy_device_ends_a_capture_whose_state_query_raises():
    device = object.__new__(cuda_device.CupyDevice)  # no GPU here: only the stream matters
    device.stream = _InvalidatedStream()
    device.abort_capture()
    assert device.stream.ended == 1


def test_each_kernel_family_is_compiled_once_per_process_and_architecture(monkeypatch):
    compiled = []
    monkeypatch.setattr(sources, "compile_nvrtc",
                        lambda family, arch: compiled.append((family, arch)) or b"image")
    cuda_device.kernel_image.cache_clear()
    try:
        for _ in range(3):  # three devices' worth of plans
            assert cuda_device.kernel_image("unary", "sm_90") == b"image"
        cuda_device.kernel_image("unary", "sm_100")
        assert compiled == [("unary", "sm_90"), ("unary", "sm_100")]
    finally:
        cuda_device.kernel_image.cache_clear()


class _WatchesTheCollector(FakeRecorder):
    def begin_capture(self):
        super().begin_capture()
        self.collector_during_capture = gc.isenabled()


def test_the_collector_is_paused_while_a_step_is_captured():
    assert gc.isenabled()
    sess = _mlp_session(_WatchesTheCollector, "require")
    x = {"input": np.zeros((4, 64), np.float32)}
    sess.run(None, x)
    sess.run(None, x)  # captured
    device = sess.plan_for(x).executor.device
    assert device.collector_during_capture is False and gc.isenabled()


@pytest.mark.parametrize("stem", ["mlp", "resnet"])
def test_cudnn_graphs_get_the_workspace_their_bindings_reserve(stem):
    """Finding 5: the cuDNN workspace was the NumPy kernels' scratch (im2col: 74% of the ResNet
    arena; MLP inference had none). Now each cuDNN node's binding reserves its own (at least
    CUDNN_WORKSPACE, a convolution its im2col size) and its graph's limit is exactly that."""
    from tr_onnx.backends.cuda.bind import CUDNN_WORKSPACE
    from tr_onnx.memory import Region

    shape = {"mlp": (4, 64), "resnet": (4, 3, 16, 16)}[stem]
    plan = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", backend=CudaBackend(device=lambda p:
                                    FakeRecorder(p.memory))).plan_for(
        {"input": np.zeros(shape, np.float32)})
    assert plan.memory.regions[Region.WORKSPACE][1] >= CUDNN_WORKSPACE
    index = {id(node): i for i, node, _ in plan.bindings}
    cudnn_nodes = 0
    for bn in plan.executor.bound:
        for call in bn.calls:
            if isinstance(call, CudnnCall):
                (ws,) = plan.memory.workspaces[index[id(bn.node)]]
                assert call.desc.workspace == (ws.offset, ws.nbytes)
                assert ws.nbytes >= CUDNN_WORKSPACE
                assert call.workspace == call.desc.workspace[0] + (1 << 40)
                cudnn_nodes += 1
    assert cudnn_nodes
