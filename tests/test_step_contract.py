"""The training step's contract ops (ops/optimizers.py: StepCheck, StepAdvance, LossScaleUpdate,
StepReport; the update ops' skip input; ScaleClipGrad's unscaling; the guarded Assign and
ZeroFill): their NumPy kernels, the reference, against the cuda kernels on the host emulator.

One guarded training graph with dynamic loss scaling (``build_training_step`` with
``step_guard=True`` and ``loss_scale``; float32, so the NumPy backend can hold it) is compiled
for both backends; both run the same sequence of steps phase by phase -- good steps, a NaN
batch, a step launched with a wrong step number (rejected), a loss scale that grows -- and every
tensor of the contract and every parameter agrees after each step. The host-decided step
(``training.step_policy.host_step``) is the independent oracle of the decisions: bad, rejected and
applied steps are the ones it would make.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tr_onnx import distributed
from tr_onnx.backends.cuda import nccl
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.compiler import compile_plan
from tr_onnx.importer import import_model
from tr_onnx.ops.optimizers import REPORT_FIELDS
from tr_onnx.optim import SGD
from tr_onnx.registry import default_registry
from tr_onnx.testing.host_emulator import build_host_library, host_emulator
from tr_onnx.testing.host_nccl import HostNccl
from tr_onnx.training.losses import make_loss_spec
from tr_onnx.training.pipeline import build_training_step
from tr_onnx.training.reserved import Reserved
from tr_onnx.training.train_pass import TrainConfig

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
PHASES = ("compute", "guard", "commit", "discard", "apply", "report")
LOSS_SCALE = {"init": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("contract_kernels")))


def guarded_plan(backend: str, device=None, world: int | None = None):
    registry = default_registry()
    imported = import_model(ZOO / "mlp.onnx", registry, backend)
    cfg = TrainConfig(make_loss_spec("cross_entropy"), SGD(lr=0.1, momentum=0.9), "logits",
                      "labels", clip_grad_norm=5.0, loss_scale=dict(LOSS_SCALE),
                      step_guard=True, data_inputs=("input",), world=world)
    target = CudaBackend(device=device) if device is not None else backend
    return compile_plan(imported, {"input": (4, 64)}, {}, target, 8,
                        transform=partial(build_training_step, registry=registry,
                                          backend=backend, cfg=cfg),
                        absorb_flatten=False)


def contract_names(info) -> list[str]:
    guard, scaling = info.step_guard, info.loss_scaling
    return [info.params_span, info.grads_span, info.grad_norm, guard.bad_batch, guard.reject,
            guard.applied, guard.report, scaling.scale, scaling.inv_scale,
            scaling.growth_tracker, scaling.found_inf] + [
        v for s in info.states.values() for v in s.values()]


def test_the_contract_ops_numpy_kernels_equal_the_cuda_kernels(device):
    ref, dev = guarded_plan("numpy"), guarded_plan("cuda", device)
    info = ref.info
    assert info.step_guard is not None and info.loss_scaling is not None
    assert {n.op_type for n in ref.graph.nodes} >= {
        "StepCheck", "StepAdvance", "LossScaleUpdate", "StepReport", "ZeroFill"}
    rng = np.random.default_rng(0)
    applied = 0
    # (batch is NaN, step number the host launches with, expected: bad, rejected)
    script = [(False, 1, False, False), (False, 2, False, False), (True, 3, True, False),
              (False, 3, False, False), (False, 9, True, True), (False, 4, False, False),
              (False, 5, False, False)]
    for i, (nan, step, want_bad, want_reject) in enumerate(script):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        if nan:
            x[1, 3] = np.nan
        labels = np.arange(4) % 10
        for plan in (ref, dev):
            ex = plan.executor
            ex.write_input("input", x)
            ex.write_input("labels", labels)
            ex.write_scalar(Reserved.LR, 0.1)
            ex.write_scalar(Reserved.STEP, step)
            ex.write_scalar(Reserved.GRAD_SCALE, 1.0)
            ex.write_scalar(Reserved.RNG, i)
        for phase in PHASES:
            ref.executor.run(phase=phase)
        dev.executor.run("+".join(PHASES))
        report = dict(zip(REPORT_FIELDS, ref.executor.read_output(info.step_guard.report)))
        assert (report["bad"] != 0, report["rejected"] != 0) == (want_bad, want_reject), i
        applied += not want_bad
        assert ref.executor.read_scalar(info.step_guard.applied) == applied
        want = ref.executor.read_state(contract_names(info))
        got = dev.executor.read_state(contract_names(info))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-7,
                                       err_msg=f"step {i}: {name}")
    scaling = info.loss_scaling
    # two good steps grow 256 to 512 (growth_interval 2), the NaN step backs off to 256, the
    # rejected step changes nothing, two more good steps grow it to 512 again
    assert ref.executor.read_scalar(scaling.scale) == 512.0
    assert ref.executor.read_scalar(scaling.inv_scale) == np.float32(1 / 512)


class MirrorWorld:
    """Rank 0 of two whose partner holds the same gradients (its sums are twice this rank's,
    so their mean is this rank's own) and judges its batch bad where ``partner_bad`` says."""

    rank, size, local_rank, comm = 0, 2, 0, object()

    def __init__(self):
        self.partner_bad = False

    def start_allreduce_sum_(self, array):
        array *= 2

    def wait_started(self):
        pass

    def allreduce_sum_(self, array):
        array *= 2
        return array

    def allreduce_max_(self, array):
        np.maximum(array, float(self.partner_bad), out=array)
        return array

    def bcast_object(self, obj=None, root=0):
        return obj


def test_a_batch_bad_on_another_rank_is_bad_on_this_one_on_both_backends(device, monkeypatch):
    """Data parallelism: StepCheck's flag is the ranks' maximum (NumPy: MPI, cuda: ncclMax on
    the host stand-in), so a good batch here is dropped with the partner's bad one -- nothing
    committed, applied or counted -- and the scale backs off on both ranks alike."""
    world = MirrorWorld()
    monkeypatch.setattr(nccl, "nccl_module", lambda: HostNccl(world))
    monkeypatch.setattr(nccl, "_COMMUNICATORS", {})
    key = distributed.register(world)
    ref, dev = guarded_plan("numpy", world=key), guarded_plan("cuda", device, world=key)
    info = ref.info
    assert [n.attrs.get("world") for n in ref.graph.nodes if n.op_type == "StepCheck"] == [key]
    rng = np.random.default_rng(1)
    applied = 0
    for i, (partner_bad, step) in enumerate([(False, 1), (True, 2), (False, 2), (True, 3),
                                             (False, 3)]):
        world.partner_bad = partner_bad
        x = rng.standard_normal((4, 64)).astype(np.float32)
        for plan in (ref, dev):
            ex = plan.executor
            ex.write_input("input", x)
            ex.write_input("labels", np.arange(4) % 10)
            for name, value in ((Reserved.LR, 0.1), (Reserved.STEP, step),
                                (Reserved.GRAD_SCALE, 1.0), (Reserved.RNG, i),
                                (Reserved.ROW_WEIGHT, 1.0),
                                (Reserved.HAS_ROWS, True)):  # both ranks 4 rows
                ex.write_scalar(name, value)
        # every step applies (cuda: its reduce phase)
        ref.executor.write_scalar(Reserved.REDUCE, 1.0)
        before = ref.executor.read_state([info.params_span])[info.params_span]
        for phase in ("compute", "reduce", *PHASES[1:]):
            ref.executor.run(phase=phase)
        dev.executor.run("+".join(("compute", "reduce", *PHASES[1:])))
        report = dict(zip(REPORT_FIELDS, ref.executor.read_output(info.step_guard.report)))
        assert np.isfinite(report["loss"]) and (report["bad"] != 0) == partner_bad, i
        applied += not partner_bad
        assert ref.executor.read_scalar(info.step_guard.applied) == applied
        after = ref.executor.read_state([info.params_span])[info.params_span]
        assert np.array_equal(after, before) == partner_bad, i
        want = ref.executor.read_state(contract_names(info))
        got = dev.executor.read_state(contract_names(info))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=1e-7,
                                       err_msg=f"step {i}: {name}")
    # 256 halved twice, never grown (growth_interval 2: no two good steps in a row)
    assert ref.executor.read_scalar(info.loss_scaling.scale) == 64.0
