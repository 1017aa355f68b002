"""Every launch's arguments against its kernel's PTX parameter list (tr_onnx/testing/ptx.py).

The host build runs a kernel through ctypes with the argument types the launch itself passes,
so an int32 given for a ``long long`` is right on the CPU and wrong on the GPU. The PTX NVRTC
emits for compute_90 (no driver needed) is what the device reads; ``FakeRecorder.launch`` (so
the host emulator and every emulated plan of the tests) holds each launch against it. Here:
the parser on known kernels, every kernel a family table names has an entry, the mismatches
it must catch (width, kind, count), that a binding passing a wrong width is caught through a
real plan, and that the zoo's cuda training plans launch only kernels whose PTX they match.
"""

from __future__ import annotations

import numpy as np
import pytest
from paths import ZOO

import tr_onnx
from tr_onnx.backends.cuda import bind, sources
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.capture import DeviceBuffer
from tr_onnx.backends.cuda.device import KernelRef
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
from tr_onnx.testing import ptx
from tr_onnx.testing.recorder import FakeRecorder

SHAPES = {"mlp": (4, 64), "lenet": (4, 1, 8, 8), "resnet": (4, 3, 16, 16),
          "mobilenet": (4, 3, 16, 16), "transformer": (4, 8, 32)}


def recorder(plan) -> FakeRecorder:
    """The device of the sessions' ``CudaBackend``: a recording device with the executor's
    phases."""
    return FakeRecorder(plan.memory, policy=EXECUTOR_POLICY)


def test_nvrtc_is_there_so_every_recorded_launch_is_checked():
    """The test extra installs CuPy's NVRTC binding: without it the recorder could not check
    (and would say nothing), so the tests require it rather than skip."""
    assert ptx.available()


def test_the_parser_reads_each_parameter_type_of_an_entry():
    text = (".visible .entry tr_k(\n\t.param .u64 tr_k_param_0,\n\t.param .u32 tr_k_param_1,"
            "\n\t.param .f32 tr_k_param_2\n)\n{\n}\n.visible .entry tr_j()\n{\n}\n")
    assert ptx.entry_params(text) == {"tr_k": ("u64", "u32", "f32"), "tr_j": ()}


@pytest.mark.parametrize("family, kernel, params", [
    # x, y, then n, xo, yo and six dims and two stride sets: all 64 bits
    ("tensor", "tr_strided_copy_b4", ("u64",) * 23),
    # x, y, rows, c, ld, then the int log flag
    ("reduce", "tr_softmax_f16", ("u64",) * 5 + ("u32",)),
    # x, y, mask, n, step, rows_before, per_row, seed, then the double ratio, float scale
    ("elementwise", "tr_dropout_f32", ("u64",) * 8 + ("f64", "f32")),
], ids=["strided-copy", "softmax-int-flag", "dropout-double-and-float"])
def test_known_kernels_have_the_parameter_types_of_their_c_signatures(family, kernel, params):
    assert ptx.kernel_params(KernelRef(family, kernel)) == params


@pytest.mark.parametrize("family", list(sources.SOURCES))
def test_every_kernel_a_family_table_names_has_a_ptx_entry(family):
    for name in sources.SOURCES[family].kernels:
        assert ptx.kernel_params(KernelRef(family, name)), name


SOFTMAX = KernelRef("reduce", "tr_softmax_f32")
BUF = DeviceBuffer(1 << 40, 64)
GOOD = [BUF, BUF, np.int64(2), np.int64(8), np.int64(8), np.int32(0)]


@pytest.mark.parametrize("args, match", [
    (GOOD[:5] + [np.int64(0)], r"argument 5 is int64 .*parameter 5 is \.u32"),
    (GOOD[:2] + [np.int32(2)] + GOOD[3:], r"argument 2 is int32 .*parameter 2 is \.u64"),
    (GOOD[:5] + [np.float32(0)], r"argument 5 is float32"),
    (GOOD[:5] + [0], r"argument 5 is int "),  # a Python int has no C type at all
    (GOOD[:5], r"passes 5 arguments; its PTX takes 6"),
], ids=["int64-for-int", "int32-for-long-long", "float-for-int", "python-int", "count"])
def test_a_launch_that_the_gpu_would_misread_is_refused(args, match):
    ptx.check_launch(SOFTMAX, GOOD)  # the right one passes
    with pytest.raises(ptx.LaunchSignatureError, match=match):
        ptx.check_launch(SOFTMAX, args, "node 'sm' (Softmax)")


def test_a_kernel_missing_from_its_family_is_named():
    with pytest.raises(ptx.LaunchSignatureError, match="defines no kernel 'tr_no_such'"):
        ptx.kernel_params(KernelRef("reduce", "tr_no_such"))


def test_a_binding_passing_a_wrong_width_fails_its_plan(monkeypatch):
    """Through a real plan: the transformer's softmax binding with its int flag made 64-bit
    (``bind.i32`` patched) is refused by the recorder when the plan is bound."""
    from tr_onnx.backends.cuda.ops import reduce as cuda_reduce

    monkeypatch.setattr(cuda_reduce, "i32", bind.i64)
    x = np.random.default_rng(0).standard_normal(SHAPES["transformer"]).astype(np.float32)
    sess = tr_onnx.InferenceSession(ZOO / "transformer.onnx", backend=CudaBackend(device=recorder))
    with pytest.raises(ptx.LaunchSignatureError, match=r"tr_softmax_f32: argument 5 is int64"):
        sess.run(None, {"input": x})


@pytest.mark.parametrize("stem", list(SHAPES))
def test_the_zoo_training_plans_launch_only_what_their_kernels_ptx_takes(stem, monkeypatch):
    """Every launch of a cuda training step (bound, warm-up, captured) of each zoo model goes
    through the check; count them, so that a plan that launched nothing cannot pass."""
    checked = []
    check = ptx.check_launch

    def counting(ref, args, node=""):
        check(ref, args, node)
        checked.append(ref.name)

    monkeypatch.setattr(ptx, "check_launch", counting)
    x = np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)
    sess = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=8,
                                   backend=CudaBackend(device=recorder))
    sess.train_step({"input": x}, np.arange(4) % 10)
    assert len(checked) > 20 and len(set(checked)) > 5, (stem, sorted(set(checked)))
