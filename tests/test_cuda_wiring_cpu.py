"""The cuda backend wired into the sessions, checked without a GPU.

* ``resolve_backend``: ``auto`` is numpy without a GPU and cuda with one; ``cuda`` without one
  is an error that says why and what to install.
* ``InferenceSession`` and ``TrainingSession`` with ``backend="cuda"`` drive a ``CudaExecutor``
  through ``ExecutorAPI`` only; the device is tr_onnx.testing.host_emulator
  (``FakeRecorder``'s capture checks + the kernels' host build + numpy kernels for the cuDNN
  nodes), the device of the ``CudaBackend`` the sessions are given. Outputs, losses and state
  equal the numpy backend's.
* ``scripts/gpu_check.py --dry-run``: the whole GPU check (parity and benchmark plumbing) on
  the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from script_modules import ROOT, gpu_check

import tr_onnx
from tr_onnx.backends import (
    BACKENDS,
    ExecutorAPI,
    backend_named,
    resolve_backend,
)
from tr_onnx.backends.cuda import device as cuda_device
from tr_onnx.backends.cuda import executor as cuda_executor
from tr_onnx.backends.cuda.backend import CudaBackend, cuda_unavailable_reason
from tr_onnx.backends.cuda.executor import CudaExecutor, CudaUnsupported
from tr_onnx.backends.numpy_backend import NumpyExecutor
from tr_onnx.errors import TrOnnxError, UnsupportedModelError
from tr_onnx.optim import SGD
from tr_onnx.registry import OpKey, build_registry
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

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


def test_auto_without_a_driver_never_imports_cupy():
    """CuPy's import costs about 200 MB and a second: ``auto`` makes it only where a CUDA
    driver library loads (a fresh interpreter, so no other test has imported CuPy)."""
    code = ("import sys\n"
            "import tr_onnx.backends.cuda.device as device\n"
            "device.driver_loads = lambda: False\n"
            "import tr_onnx\n"
            "tr_onnx.InferenceSession(sys.argv[1]).run(None, {'input': __import__('numpy')"
            ".zeros((1, 64), 'float32')})\n"
            "print('cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(ZOO / "mlp.onnx")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


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
    assert BACKENDS == ("numpy", "cuda") and backend_named("cuda").channel_align == 8
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
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend=CudaBackend(device=device))
    plan = sess.plan_for({"input": _x("mlp")})
    assert isinstance(plan.executor, CudaExecutor) and isinstance(plan.executor, ExecutorAPI)
    assert not hasattr(plan.executor, "arena")  # nothing for a session to index
    assert plan.backend == "cuda" and plan.bindings  # made from the cuda bindings
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
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", backend=CudaBackend(device=device))
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
    sess, got = _train(stem, 3, backend=CudaBackend(device=device))
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
    ex = sess._state.active.executor
    assert isinstance(ex, CudaExecutor)
    assert list(ex.graphs) == [ex.step_phases()] == ["compute+guard+commit+discard+apply+report"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_training_step_is_one_graph_launch_and_one_wait(device, precision):
    """After the warm-up and the capture, a step is: the batch and per-step scalars uploaded
    asynchronously through one pinned buffer (waiting first for that buffer's previous use,
    two steps back), one graph launch, the report copied behind it into the same buffer, and
    one wait for that buffer's event."""
    sess, _ = _train("resnet", 2, backend=CudaBackend(device=device), precision=precision,
                     loss_scale={"init": 1024.0} if precision == "fp16" else None)
    dev = sess._state.active.executor.device
    start = len(dev.calls)
    sess.train_step({"input": _x("resnet", 7)}, np.arange(SHAPES["resnet"][0]) % 10)
    calls = dev.calls[start:]
    ops = [c.op for c in calls]
    assert ops.count("launch_graph") == 1 and "synchronize" not in ops
    assert not any(c.capturing for c in calls)
    assert all(op in ("memcpy_async", "launch", "launch_graph", "record_event", "wait_event")
               for op in ops)
    back = [c for c in calls if c.op == "memcpy_async" and c.args["kind"] == "d2h"]
    scores = sess._state.active.memory.tensors[sess.output_name]  # read back with its step
    assert [c.args["nbytes"] for c in back] == [cuda_executor.REPORT_BYTES, scores.nbytes]
    graph = ops.index("launch_graph")
    assert ops[graph + 1:] == ["memcpy_async", "memcpy_async", "record_event", "wait_event"]
    buffer = calls[-1].args["index"]
    assert calls[-2].args["index"] == buffer and calls[0].op == "wait_event"
    assert sess.step == 3


def test_checkpoint_round_trip_through_the_device(device, tmp_path):
    sess, _ = _train("mlp", 2, backend=CudaBackend(device=device))
    path = sess.save_checkpoint(tmp_path / "ck.npz")
    back = tr_onnx.TrainingSession.from_checkpoint(path, backend=CudaBackend(device=device))
    x, y = _x("mlp", 5), np.arange(4) % 10
    assert back.train_step({"input": x}, y) == pytest.approx(sess.train_step({"input": x}, y),
                                                             rel=1e-6)


def test_a_non_finite_step_is_dropped_on_the_device(device):
    sess, _ = _train("mlp", 1, backend=CudaBackend(device=device))
    before = sess.parameters()
    x = _x("mlp")
    x[0, 0] = np.inf
    with pytest.warns(RuntimeWarning, match="non-finite"):
        sess.train_step({"input": x}, np.arange(4) % 10)
    after = sess.parameters()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    grads = sess.state_arrays()
    assert all(np.all(grads[g] == 0) for g in sess._state.active.info.grads.values())


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
    sess, got_warnings = run(backend=CudaBackend(device=device))
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
    sess, _ = _train("mlp", 1, backend=CudaBackend(device=device))
    ex = sess._state.active.executor
    dev, grads = ex.device, ex.memory.tensors["__grads"]
    assert grads.nbytes > 1000
    start = len(dev.calls)
    assert ex.all_finite("__grads") is True
    assert _d2h_bytes(dev, start) == 4  # the flag, not the span
    launched = [c.args["kernel"].name for c in dev.calls[start:] if c.op == "launch"]
    assert launched == ["tr_zero_lanes_b4", "tr_unscale_check_f32"]
    assert {c.phase for c in dev.calls[start:] if c.op != "synchronize"} == {"check"}
    # a NaN written into one gradient is found; the span is not written by the check
    name = next(iter(sess._state.active.info.grads.values()))
    g = ex.read_output(name)
    g.reshape(-1)[-1] = np.nan
    ex.write_tensor(name, g)
    before = ex.read_output("__grads")
    start = len(dev.calls)
    assert ex.all_finite("__grads") is False and _d2h_bytes(dev, start) == 4
    np.testing.assert_array_equal(ex.read_output("__grads"), before)
    ex.zero("__grads")
    assert ex.all_finite("__grads") is True  # the flag is cleared on every call
    # a train step reads back its report (loss, bad-batch and overflow flags, grad norm,
    # reject) and its scores
    start = len(dev.calls)
    sess.train_step({"input": _x("mlp", 3)}, np.arange(4) % 10)
    scores = ex.memory.tensors[sess.output_name]
    assert _d2h_bytes(dev, start) == cuda_executor.REPORT_BYTES + scores.nbytes


def test_ops_without_a_cuda_binding_are_listed_not_run_on_numpy(device, monkeypatch):
    registry = build_registry()
    del registry._entries[OpKey("", "Relu", 14, "cuda")]
    monkeypatch.setattr(tr_onnx.registry, "_default", registry)
    with pytest.raises(UnsupportedModelError, match=r"Relu \(domain 'ai\.onnx', "
                       r"since_version 14\)(.|\n)*backend='numpy'") as info:
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend=CudaBackend(device=device))
    assert {op for _, op, _, _ in info.value.missing} == {"Relu"}


def test_a_binding_that_refuses_the_plan_names_the_node_and_why(device, monkeypatch):
    """A cuda binding exists but cannot take the node as planned: the same message, with why."""
    from tr_onnx.backends.cuda.bind import Unbound
    from tr_onnx.backends.cuda.ops import unary

    def refuse(b, node):
        raise Unbound("test: no kernel for this layout")

    monkeypatch.setattr(unary, "bind_unary", refuse)
    monkeypatch.setattr(tr_onnx.registry, "_default", build_registry())
    sess = tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend=CudaBackend(device=device))
    with pytest.raises(CudaUnsupported, match=r"Relu \(domain 'ai\.onnx', since_version "
                       r"14\)(.|\n)*test: no kernel for this layout") as info:
        sess.run(None, {"input": _x("mlp")})
    assert {op for _, op, _, _ in info.value.missing} == {"Relu"}


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
            for how in ("train_step", "pipelined", "captured step")} <= runners
    assert all(r[p]["ok"] for r in results["parity"] for p in ("fp16", "bf16"))
    # the bare captured-step loop numbers each step as the step guard expects, so its fp32
    # steps are applied, not rejected (issue 10, finding 9)
    captured = [r for r in bench if r["runner"] == "tr_onnx cuda fp32 (captured step)"]
    assert captured and all(r["note"].endswith("1/1 steps applied") for r in captured)
    table = (tmp_path / "results.md").read_text()
    assert "| resnet50 |" in table and "images/s" in table


def test_cuda_graphs_off_runs_every_step_eagerly_with_the_same_result(device):
    _, want = _train("mlp", 3, backend=CudaBackend(device=device))
    sess, got = _train("mlp", 3, backend=CudaBackend(device=device), cuda_graphs="off")
    assert got == want
    dev = sess._state.active.executor.device
    assert "begin_capture" not in [c.op for c in dev.calls] and dev.launched_graphs == 0
    with pytest.raises(ValueError, match=r"cuda_graphs='always'; valid: fallback, require, off"):
        tr_onnx.InferenceSession(ZOO / "mlp.onnx", backend=CudaBackend(device=device),
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


# ---- steps launched before the previous one is read back (train_step(..., wait=False)) -------

def _pipeline_run(device, stem, batches, wait, **kw):
    """Train on ``batches`` ((x, y) pairs) with ``train_step(..., wait=wait)``: the losses,
    the warnings (text, in order), the raised error's text, the final counters and state."""
    sess = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=8,
                                   backend=CudaBackend(device=device), **{"optimizer": SGD(lr=0.05,
                                                                                           momentum=0.9),
                                                     **kw})
    losses, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for x, y in batches:
                losses.append(sess.train_step({"input": x}, y, wait=wait))
        except tr_onnx.TrainingDiverged as e:
            error = str(e)
        losses = [float(v) for v in losses]  # the last pending step's warnings come here
    counters = (sess.step, sess.bad_steps, sess.rng_counter, sess.micro_step)
    return sess, losses, [str(w.message) for w in caught], error, counters, sess.state_arrays()


def _assert_same_run(a, b):
    _, la, wa, ea, ca, sa = a
    _, lb, wb, eb, cb, sb = b
    np.testing.assert_array_equal(la, lb)  # NaN where the batch was bad
    assert wa == wb and ea == eb and ca == cb
    assert sa.keys() == sb.keys()
    for name in sa:  # the same kernels on the same values: bit for bit
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def _resnet_batches(n, bad=()):
    out = []
    for i in range(n):
        x = _x("resnet", 20 + i)
        if i in bad:
            x[0, 0, 1, 1] = np.nan
        out.append((x, np.arange(4) % 10))
    return out


def test_pipelined_steps_equal_waited_ones_with_a_bad_batch(device):
    """A NaN batch in the middle: the step launched after it assumed it applied, was rejected
    on the device and launched again; warnings, counters and every weight, momentum and
    running statistic end as when each step is waited for."""
    batches = _resnet_batches(6, bad={2})
    waited = _pipeline_run(device, "resnet", batches, True)
    piped = _pipeline_run(device, "resnet", batches, False)
    _assert_same_run(piped, waited)
    assert len(waited[2]) == 1 and "step 3: non-finite loss" in waited[2][0]
    ex = piped[0]._state.active.executor
    # 6 steps, one relaunch: the graph ran 7 times (the first step eagerly, no graph)
    assert ex.device.launched_graphs == waited[0]._state.active.executor.device.launched_graphs + 1


def test_pipelined_steps_raise_training_diverged_where_waited_ones_stop(device):
    """max_bad_steps=2 and two NaN batches in a row: the pipelined run raises in the call
    after the second (its batch was launched assuming the second applied, so the device
    rejected it and it is dropped): state and RNG counter as when waiting."""
    batches = _resnet_batches(6, bad={2, 3})
    waited = _pipeline_run(device, "resnet", batches, True, max_bad_steps=2)
    piped = _pipeline_run(device, "resnet", batches, False, max_bad_steps=2)
    assert waited[3] is not None and "2 steps in a row" in waited[3]
    assert len(piped[1]) == len(waited[1]) + 1  # the call that raised had returned nothing
    _assert_same_run((*piped[:1], piped[1][:-1], *piped[2:]), waited)


def test_pipelined_fp16_overflow_and_lr_schedule_match_waited_steps(device):
    """An fp16 overflow (the loss scale starts at 2^24) skips a step; the one launched after it
    assumed a step count one too high (a StepLR schedule makes the lr differ too): rejected,
    launched again with the right step and lr, as when waiting."""
    from tr_onnx.optim import StepLR

    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal((4, 64)).astype(np.float32), rng.integers(0, 10, 4))
               for _ in range(6)]
    kw = dict(precision="fp16", loss_scale={"init": 2.0 ** 24},
              lr_schedule=StepLR(step_size=1, gamma=0.5))
    waited = _pipeline_run(device, "mlp", batches, True, **kw)
    piped = _pipeline_run(device, "mlp", batches, False, **kw)
    assert any("overflow" in w for w in waited[2])
    _assert_same_run(piped, waited)
    assert piped[0].loss_scale == waited[0].loss_scale


def test_pending_steps_are_waited_for_before_state_is_read(device, tmp_path):
    batches = _resnet_batches(3)
    sess = tr_onnx.TrainingSession(ZOO / "resnet.onnx", channel_align=8,
                                   backend=CudaBackend(device=device), optimizer=SGD(lr=0.05,
                                                                                     momentum=0.9))
    pending = [sess.train_step({"input": x}, y, wait=False) for x, y in batches]
    assert not pending[-1].done and pending[0].done
    path = sess.save_checkpoint(tmp_path / "ck.npz")  # waits
    assert pending[-1].done and sess.step == 3
    back = tr_onnx.TrainingSession.from_checkpoint(path, backend=CudaBackend(device=device))
    x, y = _resnet_batches(4)[-1]
    assert back.train_step({"input": x}, y) == sess.train_step({"input": x}, y)
    p = sess.train_step({"input": x}, y, wait=False)
    out = sess.run(None, {"input": x})  # eval mode waits too
    assert p.done and out[0].shape == (4, 10)


def test_wait_false_is_a_waited_step_where_steps_cannot_overlap(device):
    """numpy, and gradient accumulation (the micro-step count depends on the previous one):
    the step is read back before train_step returns."""
    x, y = _x("mlp"), np.arange(4) % 10
    for kw in ({"backend": "numpy"}, {"backend": CudaBackend(device=device),
                                      "grad_accumulation": 2}):
        sess = tr_onnx.TrainingSession(ZOO / "mlp.onnx", **kw)
        p = sess.train_step({"input": x}, y, wait=False)
        assert p.done and np.isfinite(float(p))


def test_the_trainer_pipelines_cuda_steps_and_ends_as_when_waiting(device, tmp_path):
    """tr-onnx train's loop (Trainer) on the cuda backend: batch b is accounted for after
    b+1 was launched (its scores read back with its step), except before a checkpoint or a
    metrics line; with a NaN batch and mid-epoch checkpoints the history, the metrics lines
    and the weights equal a run whose every step is waited for."""
    from tr_onnx.data import split
    from tr_onnx.training.trainer import Trainer

    def fit(pipelined: bool, out):
        sess = tr_onnx.TrainingSession(ZOO / "mlp.onnx", backend=CudaBackend(device=device),
                                       optimizer=SGD(lr=0.05, momentum=0.9))
        if not pipelined:
            sess._steps.pipelined = lambda plan: False
        spec = sess.imported.inputs[0]
        rng = np.random.default_rng(1)
        x = rng.standard_normal((200, 64)).astype(np.float32)
        x[37] = np.nan  # batch 2 of every epoch
        y = rng.integers(0, 10, 200)
        train, val = split({spec.name: x}, y, 0.2, 0)
        trainer = Trainer(sess, train, val, epochs=2, batch_size=16, log=None,
                          checkpoint_dir=out, checkpoint_every=4, metrics_every=3,
                          metrics_path=out / "m.jsonl")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = trainer.fit()
        lines = (out / "m.jsonl").read_text().splitlines()
        return sess, history, lines, [str(w.message) for w in caught]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref, ref_history, ref_lines, ref_warnings = fit(False, tmp_path / "a")
    sess, history, lines, caught = fit(True, tmp_path / "b")
    def strip(record):  # what the clock decides
        return {k: v for k, v in record.items() if k not in ("seconds", "samples_per_s")}

    assert [strip(r) for r in history] == [strip(r) for r in ref_history]
    assert [strip(json.loads(a)) for a in lines] == [strip(json.loads(b)) for b in ref_lines]
    assert caught == ref_warnings and history[0]["skipped_batches"] == 1
    a, b = sess.parameters(), ref.parameters()
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    launched = sess._state.active.executor.device.launched_graphs
    assert launched > ref._state.active.executor.device.launched_graphs  # the relaunches
