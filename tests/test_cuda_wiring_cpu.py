"""The cuda backend wired into the sessions, checked without a GPU.

* ``resolve_backend``: ``auto`` is numpy without a GPU and cuda with one; ``cuda`` without one
  is an error that says why and what to install.
* ``InferenceSession`` and ``TrainingSession`` with ``backend="cuda"`` drive a ``CudaExecutor``
  through ``ExecutorAPI`` only; the device is tr_onnx.backends.cuda.host_emulator
  (``FakeRecorder``'s capture checks + the kernels' host build + numpy kernels for the cuDNN
  nodes), injected with the sessions' ``device=`` hook. Outputs, losses and state equal the
  numpy backend's.
* ``scripts/gpu_check.py --dry-run``: the whole GPU check (parity and benchmark plumbing) on
  the CPU.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np
import pytest
from script_modules import ROOT, gpu_check

import tr_onnx
from tr_onnx.backends import (
    BACKENDS,
    DEFAULT_CHANNEL_ALIGN,
    ExecutorAPI,
    cuda_unavailable_reason,
    resolve_backend,
)
from tr_onnx.backends.cuda import device as cuda_device
from tr_onnx.backends.cuda import executor as cuda_executor
from tr_onnx.backends.cuda.executor import CudaExecutor, CudaUnsupported
from tr_onnx.backends.cuda.host_emulator import build_host_library, host_emulator
from tr_onnx.backends.numpy_backend import NumpyExecutor
from tr_onnx.errors import TrOnnxError
from tr_onnx.optim import SGD

ZOO = ROOT / "model_zoo"
SHAPES = {"mlp": (4, 64), "resnet": (4, 3, 16, 16), "mobilenet": (4, 3, 16, 16)}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The device factory the sessions take: ``factory(plan) -> HostEmulator``."""
    return host_emulator(build_host_library(tmp_path_factory.mktemp("host_kernels")))


def _x(stem, seed=0):
    return np.random.default_rng(seed).standard_normal(SHAPES[stem]).astype(np.float32)


# --------------------------------------------------------------------------------------------
# resolve_backend
# --------------------------------------------------------------------------------------------

def test_auto_is_numpy_and_cuda_is_a_named_error_without_a_gpu(monkeypatch):
    monkeypatch.setattr(cuda_device, "cuda_available", lambda: False)
    assert resolve_backend("auto") == "numpy"
    assert resolve_backend("numpy") == "numpy"
    with pytest.raises(TrOnnxError, match=r"backend 'cuda' is not usable here: .*tr_onnx\[cu13\]"):
        resolve_backend("cuda")
    with pytest.raises(TrOnnxError, match="not usable here"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend="cuda")


def test_the_reason_names_a_missing_cupy(monkeypatch):
    monkeypatch.setattr(cuda_device, "cuda_available", lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert "CuPy is not importable" in cuda_unavailable_reason()
    assert "pip install 'tr_onnx[cu13]'" in cuda_unavailable_reason()


def test_auto_picks_cuda_when_a_gpu_is_usable(monkeypatch):
    monkeypatch.setattr(cuda_device, "cuda_available", lambda: True)
    assert resolve_backend("auto") == "cuda"
    assert resolve_backend("cuda") == "cuda"


def test_unknown_backends_list_the_valid_ones():
    assert BACKENDS == ("numpy", "cuda") and DEFAULT_CHANNEL_ALIGN["cuda"] == 8
    with pytest.raises(TrOnnxError, match=r"available: numpy, cuda \(or 'auto'\)"):
        resolve_backend("tpu")


def test_this_machine_has_no_gpu_so_auto_stays_numpy():
    if cuda_device.cuda_available():  # a GPU machine: nothing to say about CPU behaviour
        assert resolve_backend("auto") == "cuda"
    else:
        assert tr_onnx.TrainingSession(ZOO / "mlp.onnx").backend == "numpy"


# --------------------------------------------------------------------------------------------
# Sessions over a CudaExecutor
# --------------------------------------------------------------------------------------------

def test_both_executors_implement_the_executor_api(device):
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend="cuda", device=device)
    plan = sess.plan_for({"input": _x("mlp")})
    assert isinstance(plan.executor, CudaExecutor) and isinstance(plan.executor, ExecutorAPI)
    assert not hasattr(plan.executor, "arena")  # nothing for a session to index
    assert plan.backend == "cuda" and plan.host_steps
    ref = tr_onnx.InferenceSession(ZOO / "mlp.onnx", channel_align=8).plan_for(
        {"input": _x("mlp")})
    assert isinstance(ref.executor, NumpyExecutor) and isinstance(ref.executor, ExecutorAPI)
    names = [t for t in plan.memory.tensors if not plan.memory.tensors[t].span][:6]
    want, got = ref.executor.read_state(names), plan.executor.read_state(names)
    for n in names:  # the initial contents were uploaded
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)


@pytest.mark.parametrize("stem", ["mlp", "resnet"])
def test_inference_session_on_cuda_equals_numpy(stem, device):
    x = _x(stem)
    want = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=8).run(None, {"input": x})
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", backend="cuda", device=device)
    assert sess.channel_align == 8 and sess.get_providers() == ["tr_onnx:cuda"]
    for _ in range(3):  # eager, captured + launched, replayed
        (got,) = sess.run(None, {"input": x})
        np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-6)
    dev = next(iter(sess._plans.values())).executor.device
    assert [c.op for c in dev.calls].count("begin_capture") == 1 and dev.launched_graphs == 2


def _train(stem, steps, **kw):
    sess = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", optimizer=SGD(lr=0.05, momentum=0.9),
                                   channel_align=8, **kw)
    y = np.arange(SHAPES[stem][0]) % 10
    losses = [sess.train_step({"input": _x(stem, i)}, y) for i in range(steps)]
    return sess, losses


@pytest.mark.parametrize("stem", ["mlp", "resnet"])
def test_training_session_on_cuda_equals_numpy(stem, device):
    ref, want = _train(stem, 3, backend="numpy")
    sess, got = _train(stem, 3, backend="cuda", device=device)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert sess.last_grad_norm == pytest.approx(ref.last_grad_norm, rel=1e-4)
    a, b = sess.state_arrays(), ref.state_arrays()
    assert a.keys() == b.keys()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=2e-6, err_msg=name)
    out_a, out_b = sess.last_outputs(), ref.last_outputs()
    for name in out_b:
        np.testing.assert_allclose(out_a[name], out_b[name], rtol=1e-4, atol=1e-5)
    # eval mode: a second (inference-form) plan gets the trained weights from the first
    x = _x(stem, 9)
    np.testing.assert_allclose(sess.run(None, {"input": x})[0], ref.run(None, {"input": x})[0],
                               rtol=1e-4, atol=1e-5)
    ex = sess._active.executor
    assert isinstance(ex, CudaExecutor)
    assert list(ex.graphs) == [ex.step_phases()] == ["compute+guard+commit+discard+apply+report"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_training_step_is_one_graph_launch_and_one_sync(device, precision):
    """After the warm-up and the capture, a step is: the batch and per-step scalars uploaded
    asynchronously, one graph launch, 16 bytes back and one synchronize."""
    sess, _ = _train("resnet", 2, backend="cuda", device=device, precision=precision,
                     loss_scale={"init": 1024.0} if precision == "fp16" else None)
    dev = sess._active.executor.device
    start = len(dev.calls)
    sess.train_step({"input": _x("resnet", 7)}, np.arange(SHAPES["resnet"][0]) % 10)
    ops = [c.op for c in dev.calls[start:]]
    assert ops.count("launch_graph") == 1 and ops.count("synchronize") == 1
    assert not any(c.capturing for c in dev.calls[start:])
    assert [c.args["nbytes"] for c in dev.calls[start:] if c.op == "memcpy_async"
            and c.args["kind"] == "d2h"] == [16]
    assert ops.index("launch_graph") < ops.index("synchronize")
    assert all(op in ("memcpy_async", "launch", "launch_graph", "synchronize") for op in ops)
    assert sess.step == 3


def test_checkpoint_round_trip_through_the_device(device, tmp_path):
    sess, _ = _train("mlp", 2, backend="cuda", device=device)
    path = sess.save_checkpoint(tmp_path / "ck.npz")
    back = tr_onnx.TrainingSession.from_checkpoint(path, backend="cuda", device=device)
    x, y = _x("mlp", 5), np.arange(4) % 10
    assert back.train_step({"input": x}, y) == pytest.approx(sess.train_step({"input": x}, y),
                                                             rel=1e-6)


def test_a_non_finite_step_is_dropped_on_the_device(device):
    sess, _ = _train("mlp", 1, backend="cuda", device=device)
    before = sess.parameters()
    x = _x("mlp")
    x[0, 0] = np.inf
    with pytest.warns(RuntimeWarning, match="non-finite"):
        sess.train_step({"input": x}, np.arange(4) % 10)
    after = sess.parameters()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    grads = sess.state_arrays()
    assert all(np.all(grads[g] == 0) for g in sess._active.info.grads.values())


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_device_step_guard_decides_as_the_host_does(device, accumulation):
    """ResNet (BatchNorm running statistics, SGD momentum), a batch with a NaN among good
    ones, micro-batches accumulated or not: the one-graph cuda step (guard, conditional
    commit, discard, update skipped on the device) ends where the numpy backend's host-decided
    steps end, with the same warnings; max_bad_steps still stops training."""
    def run(**kw):
        sess = tr_onnx.TrainingSession(ZOO / "resnet.onnx", channel_align=8, max_bad_steps=2,
                                       optimizer=SGD(lr=0.05, momentum=0.9),
                                       grad_accumulation=accumulation, **kw)
        y = np.arange(4) % 10
        bad = _x("resnet", 5)
        bad[1, 0, 2, 2] = np.nan
        caught = []
        for i, x in enumerate([_x("resnet", 1), _x("resnet", 2), bad, _x("resnet", 3),
                               _x("resnet", 4)]):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                sess.train_step({"input": x}, y)
            caught += [(i, str(m.message).split(";")[0]) for m in w]
        with pytest.raises(tr_onnx.TrainingDiverged, match="2 steps in a row"), \
                pytest.warns(RuntimeWarning):
            for _ in range(2):
                sess.train_step({"input": bad}, y)
        return sess, caught

    ref, ref_warnings = run(backend="numpy")
    sess, got_warnings = run(backend="cuda", device=device)
    assert got_warnings == ref_warnings and len(ref_warnings) == 1
    assert (sess.step, sess.micro_step, sess.bad_steps) == (ref.step, ref.micro_step,
                                                            ref.bad_steps)
    a, b = sess.state_arrays(), ref.state_arrays()
    for name in b:  # weights, momentum, running statistics, gradient accumulators
        np.testing.assert_allclose(a[name], b[name], rtol=2e-4, atol=2e-6, err_msg=name)


def _d2h_bytes(dev, start: int) -> int:
    return sum(c.args["nbytes"] for c in dev.calls[start:]
               if c.op in ("memcpy_async", "memcpy") and c.args["kind"] == "d2h")


def test_all_finite_reads_back_only_the_flag(device):
    sess, _ = _train("mlp", 1, backend="cuda", device=device)
    ex = sess._active.executor
    dev, grads = ex.device, ex.memory.tensors["__grads"]
    assert grads.nbytes > 1000
    start = len(dev.calls)
    assert ex.all_finite("__grads") is True
    assert _d2h_bytes(dev, start) == 4  # the flag, not the span
    launched = [c.args["kernel"].name for c in dev.calls[start:] if c.op == "launch"]
    assert launched == ["tr_zero_lanes_b4", "tr_unscale_check_f32"]
    assert {c.phase for c in dev.calls[start:] if c.op != "synchronize"} == {"check"}
    # a NaN written into one gradient is found; the span is not written by the check
    name = next(iter(sess._active.info.grads.values()))
    g = ex.read_output(name)
    g.reshape(-1)[-1] = np.nan
    ex.write_tensor(name, g)
    before = ex.read_output("__grads")
    start = len(dev.calls)
    assert ex.all_finite("__grads") is False and _d2h_bytes(dev, start) == 4
    np.testing.assert_array_equal(ex.read_output("__grads"), before)
    ex.zero("__grads")
    assert ex.all_finite("__grads") is True  # the flag is cleared on every call
    # a train step reads back 16 bytes: loss, bad-batch flag, overflow flag, grad norm
    start = len(dev.calls)
    sess.train_step({"input": _x("mlp", 3)}, np.arange(4) % 10)
    assert _d2h_bytes(dev, start) == 16


def test_ops_without_a_cuda_binding_are_listed_not_run_on_numpy(device, monkeypatch):
    monkeypatch.delitem(cuda_executor.BINDERS, ("", "Relu"))
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend="cuda", device=device)
    with pytest.raises(CudaUnsupported, match=r"ai\.onnx Relu v14") as info:
        sess.run(None, {"input": _x("mlp")})
    assert {op for _, op, _, _ in info.value.missing} == {"Relu"}


def test_device_hook_is_for_the_cuda_backend_only(device):
    with pytest.raises(ValueError, match="device= is for the cuda backend"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend="numpy", device=device).run(
            None, {"input": _x("mlp")})


# --------------------------------------------------------------------------------------------
# scripts/gpu_check.py --dry-run
# --------------------------------------------------------------------------------------------

def test_gpu_check_parity_functions_pass_on_the_emulator(device):
    rows = gpu_check.run_parity(["mlp"], device, steps=2)
    assert rows[0]["ok"] is True and rows[0]["replay"] == 0.0
    assert rows[0]["export"] <= 1e-5 and rows[0]["export_oracle"] == "CPUExecutionProvider"
    for precision in ("fp16", "bf16"):
        half = rows[0][precision]
        assert half["ok"] and half["steps"] == gpu_check.HALF_STEPS, half


@pytest.mark.slow
def test_gpu_check_dry_run_runs_the_whole_script(tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mode"].startswith("dry run")
    assert [r["model"] for r in results["parity"]] == ["mlp", "resnet"]
    assert all(r["ok"] for r in results["parity"])
    bench = results["benchmark"]
    assert {r["model"] for r in bench} == {"resnet50", "mlp", "resnet", "mobilenet", "lenet"}
    errors = [r for r in bench if r.get("note", "").startswith("error")]
    assert not errors, errors
    runners = {r["runner"] for r in bench}
    assert {"torch fp32 eager", "torch AMP fp16 channels_last eager",
            "torch AMP bf16 channels_last eager"} <= runners
    assert {f"tr_onnx cuda {p} ({how})" for p in ("fp32", "fp16", "bf16")
            for how in ("train_step", "captured step")} <= runners
    assert all(r[p]["ok"] for r in results["parity"] for p in ("fp16", "bf16"))
    table = (tmp_path / "results.md").read_text()
    assert "| resnet50 |" in table and "images/s" in table


def test_cuda_graphs_off_runs_every_step_eagerly_with_the_same_result(device):
    _, want = _train("mlp", 3, backend="cuda", device=device)
    sess, got = _train("mlp", 3, backend="cuda", device=device, cuda_graphs="off")
    assert got == want
    dev = sess._active.executor.device
    assert "begin_capture" not in [c.op for c in dev.calls] and dev.launched_graphs == 0
    with pytest.raises(ValueError, match=r"cuda_graphs='always'; valid: fallback, require, off"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend="cuda", device=device,
                                 cuda_graphs="always")


def test_gpu_check_table_gives_ratios_to_torch_amp():
    rows = [{"model": "resnet50", "runner": "tr_onnx cuda fp16 (train_step)", "batch": 64,
             "images_s": 2000.0},
            {"model": "resnet50", "runner": gpu_check.RATIO_BASE, "batch": 64,
             "images_s": 1600.0},
            {"model": "mlp", "runner": "tr_onnx cuda fp32 (train_step)", "images_s": 10.0}]
    table = gpu_check.markdown({"mode": "GPU", "env": "-", "parity": [], "benchmark": rows})
    assert "| resnet50 | tr_onnx cuda fp16 (train_step) | 64 | 2000 | 1.25x |" in table
    assert f"| resnet50 | {gpu_check.RATIO_BASE} | 64 | 1600 | 1.00x |" in table
    assert "| mlp | tr_onnx cuda fp32 (train_step) | - | 10 | - |" in table  # no torch row
