"""The real cuDNN library (nvidia-cudnn-cu13, frontend 1.32) checks every graph the cuda backend
declares, without a GPU: deviceless mode describes an H200 from its property list
(``tr_onnx/backends/cuda/data/h200_device_properties.json``) and runs validate, lowering, the
engine heuristics, the node's workspace cut and, for convolutions, ``build_plans()``; a stand-in
``libcuda.so.1`` (built here from the project's copy of its source) answers the driver calls
cuDNN makes at start. The oracle is cuDNN itself.

Every zoo model, inference and training in fp32, fp16 and bf16, channel align 8 (the first
convolution reads the model's 3 logical channels): every graph must find at least one engine
within its workspace. This is what found that BatchNorm training graphs failed ``validate()``
without the running statistics (issue 10, finding 1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.deviceless import (
    H200_PROPERTIES,
    check_graph,
    check_plan,
    device_properties,
    load_cudnn,
    load_driver_stub,
)
from tr_onnx.cli import main as cli_main
from tr_onnx.testing.recorder import FakeRecorder

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (8, 64), "lenet": (8, 1, 8, 8), "resnet": (8, 3, 16, 16),
          "mobilenet": (8, 3, 16, 16), "transformer": (8, 8, 32)}
MODES = ("inference", "fp32", "fp16", "bf16")
CONV = ("conv_fprop", "conv_dgrad", "conv_wgrad")


def recording_device(plan):
    return FakeRecorder(plan.memory)


def cuda_plan(stem: str, mode: str):
    feed = {"input": np.zeros(SHAPES[stem], np.float32)}
    if mode == "inference":
        return tr_onnx.InferenceSession(ZOO / f"{stem}.onnx",
                                        backend=CudaBackend(device=recording_device)).plan_for(feed)
    session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx",
                                      backend=CudaBackend(device=recording_device), precision=mode)
    return session._train_plan(feed)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stem", list(SHAPES))
def test_every_declared_cudnn_graph_plans_on_an_h200(stem, mode):
    plan = cuda_plan(stem, mode)
    rows = check_plan(plan)
    assert rows, "the plan declares no cuDNN graph"
    failing = [(r.node, r.kind, r.error) for r in rows if not r.ok]
    assert not failing
    for r in rows:
        assert 0 < r.within <= r.engines
        if r.kind in CONV:  # built: the chosen plan's workspace fits the node's
            assert r.workspace is not None and r.workspace <= r.limit
    kinds = {r.kind for r in rows}
    if stem in ("resnet", "mobilenet", "lenet"):
        assert "conv_fprop" in kinds
        if mode != "inference":
            assert {"conv_dgrad", "conv_wgrad"} <= kinds
    if stem in ("resnet", "mobilenet") and mode != "inference":
        assert {"batchnorm", "batchnorm_backward"} <= kinds
    if mode in ("fp16", "bf16"):
        assert all(r.dtypes.startswith({"fp16": "HALF", "bf16": "BFLOAT16"}[mode]) for r in rows
                   if r.kind in CONV)


EXPECTED_VERSION = "TR_ONNX_EXPECT_CUDNN"
"""Set by tests/test_cudnn_versions.py when it runs this module against another cuDNN."""


def test_the_checks_run_on_the_cudnn_they_were_meant_for():
    """The test extra's cuDNN (9.28 or later), or the one tests/test_cudnn_versions.py put on
    LD_LIBRARY_PATH: a run meant for cuDNN 9.19 that loaded another proves nothing."""
    version = int(load_cudnn().backend_version())
    expected = os.environ.get(EXPECTED_VERSION)
    if expected:
        assert version == int(expected)
    else:
        assert version >= 92800


def test_the_stand_in_driver_is_loaded_only_where_no_driver_is():
    stub = load_driver_stub()
    if stub is not None:  # no driver here: cuDNN found the stand-in, which reports no device
        assert stub.name == "libcuda.so.1" and stub.exists()
        from tr_onnx.backends.cuda.device import cuda_available

        assert cuda_available() is False
    assert load_driver_stub() == stub  # built and loaded once


def test_a_broadcast_matmul_operand_is_declared_with_batch_stride_0():
    """Some engines reject an implicitly broadcast batch (B declared [1, K, N]): a B shared
    by every batch is declared [b, K, N] with a batch stride of 0 (issue 10, finding 6)."""
    w = numpy_helper.from_array(np.ones((4, 5), np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [6, 3, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [6, 3, 5])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = tr_onnx.InferenceSession(model, backend=CudaBackend(device=recording_device)).plan_for(
        {"x": np.zeros((6, 3, 4), np.float32)})
    from tr_onnx.backends.cuda.bind import CudnnCall

    (desc,) = [c.desc for bn in plan.executor.bound for c in bn.calls
               if isinstance(c, CudnnCall)]
    assert desc.inputs["B"].dims == (6, 4, 5) and desc.inputs["B"].strides == (0, 5, 1)
    cudnn = load_cudnn()
    assert check_graph(desc, cudnn, device_properties(cudnn)).ok


def test_inspect_backend_cuda_prints_the_graph_table_and_its_exit_status(capsys, tmp_path):
    status = cli_main(["inspect", str(ZOO / "resnet.onnx"), "--backend", "cuda", "--train",
                       "--precision", "fp16", "--batch", "8"])
    out = capsys.readouterr().out
    assert status == 0 and "cuDNN graphs: 32" in out and "every graph plans" in out
    assert "FAILS" not in out and "batchnorm_backward" in out
    # a GPU older than Ampere has no bf16 engines: the rows say why, the exit status is 1
    props = json.loads(H200_PROPERTIES.read_text()) | {"deviceVer": 600, "deviceName": "P100"}
    old = tmp_path / "p100.json"
    old.write_text(json.dumps(props))
    status = cli_main(["inspect", str(ZOO / "mlp.onnx"), "--backend", "cuda", "--train",
                       "--precision", "bf16", "--gpu-properties", str(old), "--json"])
    info = json.loads(capsys.readouterr().out)
    assert status == 1 and info["cudnn_graphs"]["target"] == str(old)
    assert any(not g["ok"] and g["error"] for g in info["cudnn_graphs"]["graphs"])
