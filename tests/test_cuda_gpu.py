"""The cuda backend on a real GPU against the numpy backend (fp32; fp16/bf16 against the fp32
curve), marker ``gpu``.

For a developer on a GPU: ``pytest -m gpu tests/test_cuda_gpu.py``. The checks are
scripts/gpu_check.py's parity functions, which scripts/gpu_check.sh's stages
(scripts/gpu_stages.py) also call on the lent H200, one result line each, and which
tests/test_cuda_wiring_cpu.py runs on the CPU over the host emulator; tolerances are
``gpu_check.TOL`` (room for TF32 in cuDNN's fp32 convolutions). Without a usable GPU every
test here skips with "needs a CUDA device".
"""

from __future__ import annotations

import pytest
from script_modules import ROOT, gpu_check

from tr_onnx.backends.cuda.device import cuda_available

TOL = gpu_check.TOL
MODELS = ["mlp", "resnet", "mobilenet", "lenet", "transformer"]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("stem", MODELS)
def test_forward_equals_numpy(stem):
    assert gpu_check.forward_parity(stem)["forward"] <= TOL["forward"]


@pytest.mark.parametrize("stem", MODELS)
def test_gradients_equal_numpy(stem):
    assert gpu_check.gradient_parity(stem)["gradient"] <= TOL["gradient"]


@pytest.mark.parametrize("stem", MODELS)
def test_20_sgd_steps_equal_numpy(stem):
    got = gpu_check.training_parity(stem, steps=20)
    assert got["loss"] <= TOL["loss"] and got["weights"] <= TOL["weights"], got


@pytest.mark.parametrize("stem", MODELS)
def test_graph_replay_equals_the_eager_first_step(stem):
    got = gpu_check.replay_parity(stem)
    assert got["replay"] <= TOL["replay"], got
    assert got["captured_graphs"] == ["compute+guard+commit+discard+apply+report"], got


def test_the_device_arena_is_one_aligned_allocation():
    import tr_onnx

    sess = tr_onnx.InferenceSession(ROOT / "model_zoo" / "resnet.onnx", backend="cuda")
    plan = sess.plan_for({"input": gpu_check._batch("resnet", 4, 0)["input"]})
    dev = plan.executor.device
    assert dev.arena_base % 256 == 0 and dev.arena.nbytes == plan.memory.total_bytes


@pytest.mark.parametrize("precision", list(gpu_check.HALF_TOL))
@pytest.mark.parametrize("stem", MODELS)
def test_half_precision_tracks_the_fp32_curve(stem, precision):
    got = gpu_check.precision_parity(stem, precision=precision)
    assert got["ok"], got


@pytest.mark.parametrize("stem", MODELS)
def test_the_model_trained_on_cuda_and_exported_runs_the_same_in_onnxruntime(stem):
    """onnxruntime is the oracle for the exported model (CUDA provider where onnxruntime-gpu
    is installed, else CPU)."""
    got = gpu_check.export_parity(stem)
    assert got["export"] <= TOL["export"], got
