"""The training step's guard on the device: the calls that let a whole step run as one CUDA graph
with the keep-or-drop decision made on the GPU (``kernels/amp.cu``).

A session's cuda training plan carries the guard's arena scalars (``training.train_pass``
``add_step_guard``). ``guard_phases`` turns them into three pseudo-phases the executor puts
around the plan's own (``CudaExecutor.step_phases``):

* ``guard`` after ``compute``: clear the bad-batch flag, set it when the loss -- without loss
  scaling, also a gradient -- is not finite, or when the step was launched with a step number
  that assumed an earlier step applied which did not (rejected); with loss scaling, clear its
  overflow flag and set it for a bad batch, so the update skips itself and the scale backs off,
  as GradScaler's check of the then non-finite gradients does;
* ``discard`` after ``commit``: zero the GRAD span of a bad batch (dropping the micro-batches
  accumulated since the last step);
* ``report`` last: loss, flags and gradient norm into ``REPORT_BYTES`` at the start of
  WORKSPACE, for one small read-back (``read_report``).

The running-statistics commits and the optimizer update skip themselves on the flag
(``ops/optimizers.py``), so nothing else needs the host.
"""

from __future__ import annotations

import math

import numpy as np

from ... import ir
from ...memory import Region
from .. import APPLIED, BAD_BATCH, REJECT, StepReport
from .bind import DT, INTERNAL, BindContext, BoundNode, Unbound, i64
from .capture import DeviceBuffer
from .sources import STORAGE, KernelSource, instantiate, kernel_source, plain

# ---- kernels/amp.cu: the family's name table ----------------------------------------------------

def amp_source() -> KernelSource:
    """kernels/amp.cu: dynamic loss scaling and the one-graph step's guard."""
    return kernel_source(
        "amp",
        instantiate("TR_UNSCALE_CHECK({T}, {dt})", "tr_unscale_check_{dt}", STORAGE),
        plain("tr_step_advance", "tr_loss_scale_update", "tr_flag_or", "tr_copy_unless_b4",
              "tr_zero_if_b4", "tr_step_check", "tr_step_report"))


KERNELS = amp_source()


REPORT_FIELDS = 5
"""What ``tr_step_report`` writes: loss, bad-batch flag, overflow flag, gradient norm, reject
flag (float32 each)."""
REPORT_BYTES = 32
"""The report's bytes: ``REPORT_FIELDS`` float32, padded to 32."""


def has_step_guard(b: BindContext) -> bool:
    """Whether the plan carries the guard's scalars and room for its report."""
    return b.guard_flag is not None and b.memory.regions[Region.WORKSPACE][1] >= REPORT_BYTES


def guard_phases(b: BindContext, info, bound: list[BoundNode]) -> dict[str, list[BoundNode]]:
    """The ``guard``, ``discard`` and ``report`` pseudo-phases (module docstring) of a plan
    whose training ``info`` (``train_pass.TrainInfo``) names the loss and the gradient norm,
    ``bound`` its bound nodes (the optimizer update's step input, loss scaling's flag)."""
    bad = b.named_scalar(BAD_BATCH, np.float32)
    loss = b.named_scalar(info.loss, np.float32, writes=False)
    grads = b.tensors["__grads"]
    found = next((bn.node.attrs["loss_scale"]["found_inf"] for bn in bound
                  if bn.node.attrs.get("loss_scale")), None)
    clear = [bad, i64(1), i64(0), i64(1)]
    guard = [b.launch("tr_zero_lanes_b4", 1, clear),
             b.launch("tr_unscale_check_f32", 1, [loss, i64(1), None, bad])]
    if found is None:
        n = math.prod(grads.shape)
        guard.append(b.launch(f"tr_unscale_check_{DT[grads.dtype.name]}", n, [
            b.tensor_buf(grads), i64(n), None, bad]))
    reject = b.named_scalar(REJECT, np.float32)
    update = next(bn.node for bn in bound if bn.node.op_type.endswith("Update"))
    guard.append(b.launch("tr_step_check", 1, [
        b.named_scalar(update.inputs[-1].name, np.int64, writes=False),  # the step number
        b.named_scalar(APPLIED, np.int64, writes=False), reject, bad], single_block=True))
    if found is not None:
        flag = b.named_scalar(found, np.float32)
        guard += [b.launch("tr_zero_lanes_b4", 1, [flag, i64(1), i64(0), i64(1)]),
                  b.launch("tr_flag_or", 1, [flag, bad], single_block=True)]
    if grads.nbytes % 4:
        raise Unbound(f"the GRAD span is {grads.nbytes} bytes, not whole 4-byte words")
    words = grads.nbytes // 4
    discard = [b.launch("tr_zero_if_b4", words, [
        b.tensor_buf(grads, True), i64(words),
        b.named_scalar(BAD_BATCH, np.float32, writes=False)])]
    ws_start, _ = b.memory.regions[Region.WORKSPACE]
    report = [b.launch("tr_step_report", 1, [
        loss, b.named_scalar(BAD_BATCH, np.float32, writes=False),
        None if found is None else b.named_scalar(found, np.float32, writes=False),
        b.named_scalar(info.grad_norm, np.float32, writes=False),
        b.named_scalar(REJECT, np.float32, writes=False),
        DeviceBuffer(b.base + ws_start, REPORT_BYTES, True)], single_block=True)]

    def pseudo(name: str, phase: str, calls: list) -> list[BoundNode]:
        return [BoundNode(ir.Node(f"<{name}>", name, INTERNAL, 1, [], [], phase=phase), calls)]

    return {"guard": pseudo("step guard", "guard", guard),
            "discard": pseudo("discard a bad batch", "guard", discard),
            "report": pseudo("step report", "report", report)}


def read_report(host: np.ndarray, offset: int, apply: bool) -> StepReport:
    """The ``StepReport`` of the report copied to ``host[offset:]``."""
    value, bad, found, norm, reject = (float(x) for x in
                                       np.ndarray(REPORT_FIELDS, np.float32, host, offset))
    bad = bad != 0.0
    return StepReport(value, bad=bad, overflow=found != 0.0 and not bad,
                      grad_norm=norm if apply and not bad else None, rejected=reject != 0.0)
