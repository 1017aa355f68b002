"""Mixed precision for a training graph: half-precision activations and gradients, fp32
master weights (``precision="fp16"`` on the cuda backend).

``to_half_precision`` runs on the finished training graph (after ``build_training_graph``,
before layouts and the MemoryPlan), so autodiff, the loss and the optimizer stay
precision-agnostic and the change is one retyping, visible in the plan:

* every float32 value the ``compute`` phase produces (activations, local gradients, the loss)
  and every float32 constant it reads become float16;
* each trainable parameter ``p`` keeps its float32 master in PARAM (the optimizer's span); the
  compute nodes read ``p.half`` instead, an OPT_STATE mirror of ``p`` (same slot geometry:
  its slot is half its master's, ``memory.slot_bytes``) initialised from ``p`` and rewritten by
  the fused optimizer kernel's weight-copy output after every update (the optimizer node's
  ``weight_copy`` attribute names the ``__params_half`` span over them);
* the GRAD accumulators (and the ``__grads`` span) are float16, as the gradients feeding them.

The per-step scalars (lr, step, grad scale) and the apply phase's grad-norm stay float32.
Not covered yet (a named error): bf16 (NumPy has no bfloat16 for the plan's reference
kernels), frozen float parameters and BatchNorm running statistics (they would need fp32 reads
inside a half graph), and dynamic loss scaling.
"""

from __future__ import annotations

import numpy as np

from .. import ir
from ..errors import UnsupportedModelError
from ..ir import Graph, Value

PRECISIONS = {"fp32": np.float32, "fp16": np.float16, "bf16": None}
HALF_SPAN = "__params_half"


def check_precision(precision: str, backend: str) -> str:
    """``precision`` validated for ``backend``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision != "fp32" and backend != "cuda":
        raise ValueError(f"precision={precision!r} needs backend='cuda'; the {backend} backend "
                         "trains in fp32 only (precision='fp32')")
    if precision == "bf16":
        raise NotImplementedError("precision='bf16' is not wired yet (the plan's reference "
                                  "kernels are NumPy, which has no bfloat16); use 'fp16'")
    return precision


def to_half_precision(graph: Graph, info, dtype=np.float16) -> str:
    """Retype ``graph`` (a training graph; ``info`` its ``TrainInfo``) as the module docstring
    says. Returns the name of the half weight-copy span."""
    half = np.dtype(dtype)
    f32 = np.dtype(np.float32)
    trainable = [graph.values[n] for n in info.trainable]
    if trainable[0].dtype != f32:
        raise UnsupportedModelError(f"mixed precision needs float32 parameters, got "
                                    f"{trainable[0].dtype}", [])
    compute = [n for n in graph.nodes if n.phase == "compute"]
    for node in compute:
        for v in node.inputs:
            if v is not None and v.kind == ir.PARAM and v.dtype == f32 \
                    and v.name not in info.trainable:
                raise UnsupportedModelError(
                    f"mixed precision: {node.label} reads the float32 parameter {v.name!r}, "
                    "which is not trained (frozen or a running statistic); not supported yet", [])
    n_state = len({k for s in info.states.values() for k in s})
    copies = []
    for i, p in enumerate(trainable):
        h = Value(f"{p.name}.half", p.shape, half, ir.STATE, data=p.data.astype(half),
                  mirror_of=p, slot_order=(n_state + 2) * len(trainable) + i)
        graph.values[h.name] = h
        copies.append(h)
        for node in list(p.consumers):
            if node.phase == "compute":
                for k, v in enumerate(node.inputs):
                    if v is p:
                        graph.replace_input(node, k, h)
    # The loss and the seed of its gradient stay float32: the loss kernels read half scores
    # and write a float32 loss, and their gradient reads a float32 d(loss).
    keep = {info.loss}
    for node in compute:
        if node.op_type.endswith("LossGrad") and node.inputs and node.inputs[0] is not None:
            keep.add(node.inputs[0].name)
    for node in compute:
        for k, v in enumerate(node.inputs):
            if v is not None and v.name not in keep and v.kind == ir.CONST and v.dtype == f32:
                c = Value(graph.unique_name(f"{v.name}.half"), v.shape, half, ir.CONST,
                          data=np.asarray(v.data).astype(half))
                graph.values[c.name] = c
                graph.replace_input(node, k, c)
        for v in node.outputs:
            if v is not None and v.kind == ir.ACTIVATION and v.dtype == f32 \
                    and v.name not in keep:
                v.dtype = half
    for name in list(info.grads.values()) + ["__grads"]:
        graph.values[name].dtype = half
    span = Value(HALF_SPAN, (0,), half, ir.STATE, span_of=copies)
    graph.values[span.name] = span
    for node in graph.nodes:
        if node.phase == "apply" and node.inputs and node.inputs[0] is graph.values["__params"] \
                and node.op_type.endswith("Update"):
            node.attrs["weight_copy"] = HALF_SPAN
    return HALF_SPAN
