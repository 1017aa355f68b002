"""The cuda executor: a compiled cuda plan's bound nodes, run phase by phase, each phase captured
into a CUDA Graph and replayed.

Binding (``CudaExecutor.__init__``) calls, once, the binding each node's cuda kernel factory
returned when the plan was made (``bind``; the builtin ones are in ``ops/<family>.py``), with
the node's own scratch buffers: every node becomes a ``BoundNode`` of prepared calls. Nothing
is looked up, compiled or allocated in a step. A node whose binding refuses the plan's layouts
or dtypes is collected; after the walk one ``CudaUnsupported`` lists every such (domain, op,
version) with its nodes and why. There is no per-node fallback to NumPy.

Phases: a training plan's ``compute``, ``commit`` and ``apply`` nodes are separate step lists;
an inference plan has one, ``forward``. ``run(phase)`` goes through ``capture.PhaseGraphs``
(eager, then captured, then replayed; ``cuda_graphs`` says what happens when capture fails).
A session's training plan carries the step guard (``train_pass.add_step_guard``: nodes in the
phases ``guard``, ``discard`` and ``report``): a training step then runs whole -- compute,
reduce (a data-parallel plan's NCCL all-reduce), guard, commit, discard, apply, report -- as
one graph (``launch_step``), and its report tensor (``REPORT_BYTES``) comes back after one
wait (``finish_step``); what the report means is ``training.step_policy``'s. Host transfers are
``transfers``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import InternalError
from ...ir import Phase
from ...memory import MemoryPlan, Region
from ...ops.optimizers import REPORT_FIELDS
from .bind import BindContext, BoundNode, CudaUnsupported, Unbound
from .capture import WRITE_POLICY, CaptureStep, PhaseGraphs
from .transfers import REPORT_BYTES, DeviceTransfers

EXECUTOR_POLICY = {**WRITE_POLICY,
                   "upload": frozenset({Region.INPUT, Region.WORKSPACE}),
                   "download": frozenset({Region.WORKSPACE}),
                   "check": frozenset({Region.WORKSPACE})}
"""``capture.WRITE_POLICY`` plus the executor's transfers, issued outside the captured step:
``upload`` (the batch and per-step scalars into INPUT, staged through WORKSPACE),
``download`` (unpadding an output into WORKSPACE before the copy to the host) and ``check``
(``all_finite``'s flag, the first 4 bytes of WORKSPACE)."""


class CudaExecutor(DeviceTransfers):
    """Binds ``plan`` (a cuda ``compiler.CompiledPlan``) to ``device`` and runs its phases.

    ``device`` implements ``capture.DeviceAPI`` (``CupyDevice`` on a GPU, a recorder or the
    host emulator in the tests). A fresh device arena is zero: call ``load_constants()`` once
    before the first step.
    """

    def __init__(self, plan, device, cuda_graphs: str = "fallback"):
        if plan.backend != "cuda":
            raise ValueError(f"a {plan.backend!r} plan has no cuda bindings; compile it for "
                             "backend='cuda'")
        self.plan, self.device = plan, device
        self.memory: MemoryPlan = plan.memory
        self.captured = PhaseGraphs(device, cuda_graphs)
        self.bind_ctx = BindContext(plan, device)
        self.bound: list[BoundNode] = self._bind(plan.bindings)
        self.phases: dict[str, list[BoundNode]] = {}
        for bn in self.bound:
            self.phases.setdefault(bn.phase, []).append(bn)
        guard = plan.info.step_guard if plan.info is not None else None
        self._report_tensor = None if guard is None else self.memory.tensors[guard.report]
        if self._report_tensor is not None and self._report_tensor.nbytes != REPORT_BYTES:
            raise InternalError(f"the step report {guard.report!r} is "
                                f"{self._report_tensor.nbytes} bytes, not {REPORT_BYTES}")
        self._first_phase = Phase.FORWARD if Phase.FORWARD in self.phases else Phase.COMPUTE
        self._init_transfers()

    @property
    def cuda_graphs(self) -> str:
        return self.captured.mode

    @property
    def graphs(self) -> dict:
        """Phase key -> its captured graph."""
        return self.captured.graphs

    @property
    def eager_phases(self) -> set[str]:
        """Phases that could not be captured and run eagerly."""
        return self.captured.eager_phases

    # -- binding -----------------------------------------------------------------------------
    def _bind(self, bindings) -> list[BoundNode]:
        missing: dict[tuple[str, str, int], list[str]] = {}
        reasons: dict[str, str] = {}
        bound: list[BoundNode] = []
        for index, node, bind in bindings:
            fused_into = self.bind_ctx.fused.get(id(node))
            if fused_into is not None:
                bound.append(BoundNode(node, [], fused_into))
                continue
            b = self.bind_ctx.at(node, self.memory.workspaces.get(index, ()))
            try:
                calls = bind(b, node)
            except Unbound as e:
                key = (node.domain if node.domain != "ai.onnx" else "", node.op_type,
                       node.since_version)
                missing.setdefault(key, []).append(node.name)
                reasons[node.label] = str(e)
                continue
            bound.append(BoundNode(node, calls))
        if missing:
            raise CudaUnsupported([(d, o, v, n) for (d, o, v), n in missing.items()], reasons)
        return bound

    # -- the step ----------------------------------------------------------------------------
    def steps(self, phase: str) -> list[CaptureStep]:
        return [CaptureStep(bn.label, bn.phase, bn.run)
                for p in phase.split("+") for bn in self.phases.get(p, [])]

    def run(self, phase: str | None = None) -> None:
        """Run ``phase`` (default: the plan's only or first phase; ``"a+b"``: phases ``a``
        and ``b`` as one): eagerly the first time, captured into one graph the second,
        replayed after (``capture.PhaseGraphs``)."""
        phase = phase or self._first_phase
        if not any(p in self.phases for p in phase.split("+")):
            return
        if phase.split("+")[0] == self._first_phase:
            self._flip_host_buffers()
        self.captured.run(phase, self.steps)

    def step_phases(self, apply: bool = True) -> str:
        """The ``run`` key of a guarded training step: one graph of all its phases (a
        data-parallel plan's ``reduce`` only in a step that applies)."""
        reduce = (Phase.REDUCE,) if apply and Phase.REDUCE in self.phases else ()
        return "+".join((Phase.COMPUTE, *reduce, Phase.GUARD, Phase.COMMIT, Phase.DISCARD)
                        + ((Phase.APPLY,) if apply else ()) + (Phase.REPORT,))

    @property
    def can_launch_steps(self) -> bool:
        """Whether ``launch_step`` / ``finish_step`` work (a plan with the step guard)."""
        return self._report_tensor is not None and Phase.GUARD in self.phases

    def launch_step(self, apply: bool, outputs: Sequence[str] = ()) -> int:
        """Launch a training step without waiting for it: compute, the step guard, commit,
        discard, apply (when ``apply``) and the report, captured together (one graph per
        ``apply`` value) and launched once, then its report and the model ``outputs`` asked
        for (those a plain copy reads, ``step_outputs``) copied (async) into the pinned buffer
        this step's batch came up through, behind that buffer's event. Returns the token
        ``finish_step`` takes (the buffer's index)."""
        self.run(self.step_phases(apply))
        k = 1 - self._k  # run() flipped to the other buffer for the next step's uploads
        self.device.begin_node("<step report>", "download")
        self.device.memcpy_async(self._host[k][self._report:self._report + REPORT_BYTES],
                                 self.bind_ctx.tensor_buf(self._report_tensor), REPORT_BYTES,
                                 "d2h")
        for name in outputs:
            t, off = self.memory.tensors[name], self._outputs[name]
            self.device.memcpy_async(self._host[k][off:off + t.nbytes], self.bind_ctx.tensor_buf(t),
                                     t.nbytes, "d2h")
        self.device.record_host_buffer(k)
        return k

    @property
    def step_outputs(self) -> frozenset[str]:
        """The model outputs ``launch_step`` can read back with the step."""
        return frozenset(self._outputs)

    def step_output(self, token: int, name: str) -> np.ndarray:
        """A copy of output ``name`` as ``launch_step(..., outputs=[name])`` read it back
        (call after ``finish_step(token, ...)``)."""
        t, off = self.memory.tensors[name], self._outputs[name]
        return np.ndarray(t.shape, t.dtype, self._host[token], off).copy()

    def finish_step(self, token: int) -> dict[str, float]:
        """Wait for the step ``launch_step`` returned ``token`` for (its buffer's event: the
        step and its report copy) and read its report: ``REPORT_FIELDS`` by name (what they
        mean for the step is training's, ``training.step_policy.finish_step``)."""
        self.device.wait_host_buffer(token)
        return dict(zip(REPORT_FIELDS, (float(x) for x in np.ndarray(
            len(REPORT_FIELDS), np.float32, self._host[token], self._report))))


__all__ = ["EXECUTOR_POLICY", "CudaExecutor", "CudaUnsupported"]
