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

Dynamic loss scaling (``add_loss_scaling``, on by default with fp16), as
``torch.amp.GradScaler``: four scalars in OPT_STATE (they persist across steps, are written
only by the apply phase, and travel with the optimizer state through re-plans and
checkpoints): ``__loss_scale`` (float32, the backward pass's seed, so every gradient is of
``loss * scale``), ``__inv_loss_scale`` (float32), ``__loss_scale_growth`` (int32, good steps
since the last change) and ``__found_inf`` (float32 flag). The apply phase, bound by the cuda
executor from attributes these set on its nodes (``amp.cu``): clear ``__found_inf``; unscale
the GRAD span and check it (``tr_unscale_check``, before ScaleClipGrad, so clipping sees true
gradients); the fused optimizer takes ``__found_inf`` and skips itself when set; then
``tr_loss_scale_update`` (backoff on overflow, growth after ``growth_interval`` good steps).
The host reads the 4-byte flag after apply: an overflow step is no step.

Not covered yet (a named error): bf16 (NumPy has no bfloat16 for the plan's reference
kernels), frozen float parameters and BatchNorm running statistics (they would need fp32 reads
inside a half graph), and loss scaling with an ONNX loss model.
"""

from __future__ import annotations

import numpy as np

from .. import ir
from ..errors import UnsupportedModelError
from ..ir import Graph, Value
from .train_pass import LOSS_SCALE

PRECISIONS = {"fp32": np.float32, "fp16": np.float16, "bf16": None}
HALF_SPAN = "__params_half"
INV_LOSS_SCALE, GROWTH_TRACKER, FOUND_INF = "__inv_loss_scale", "__loss_scale_growth", \
    "__found_inf"
LOSS_SCALE_DEFAULTS = {"init": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000}


def check_loss_scale(loss_scale, precision: str) -> dict | None:
    """The dynamic loss scaling settings (``LOSS_SCALE_DEFAULTS`` updated by a dict; ``True``
    or ``None``: the defaults with fp16, none otherwise; ``False``: none)."""
    if loss_scale is False or precision != "fp16":
        if loss_scale not in (None, False):
            raise ValueError(f"loss_scale is for precision='fp16', not {precision!r}")
        return None
    cfg = dict(LOSS_SCALE_DEFAULTS)
    if isinstance(loss_scale, dict):
        unknown = sorted(set(loss_scale) - set(cfg))
        if unknown:
            raise ValueError(f"loss_scale keys {unknown}; valid: {', '.join(cfg)}")
        cfg.update(loss_scale)
    elif loss_scale not in (None, True):
        raise ValueError(f"loss_scale must be a dict, True, False or None, got {loss_scale!r}")
    cfg = {k: float(v) for k, v in cfg.items()}
    cfg["growth_interval"] = int(cfg["growth_interval"])
    if not (cfg["init"] > 0 and cfg["growth_factor"] >= 1 and 0 < cfg["backoff_factor"] < 1
            and cfg["growth_interval"] >= 1):
        raise ValueError(f"loss_scale {cfg}: needs init > 0, growth_factor >= 1, "
                         "0 < backoff_factor < 1, growth_interval >= 1")
    return cfg


def add_loss_scaling(graph: Graph, cfg: dict) -> None:
    """The arena scalars and apply-phase attributes of dynamic loss scaling (module
    docstring); ``graph`` was built with ``TrainConfig.loss_scale`` (its seed is
    ``__loss_scale``)."""
    scale = graph.values[LOSS_SCALE]
    for node in scale.consumers:
        if not node.op_type.endswith("LossGrad"):
            raise UnsupportedModelError(
                f"loss scaling: the loss gradient seed feeds {node.label}; only the built-in "
                "losses are supported yet (pass loss_scale=False)", [])
    f32 = np.dtype(np.float32)
    for name, dtype, value in ((INV_LOSS_SCALE, f32, 1.0 / cfg["init"]),
                               (GROWTH_TRACKER, np.dtype(np.int32), 0),
                               (FOUND_INF, f32, 0.0)):
        graph.values[name] = Value(name, (), dtype, ir.STATE, data=np.array(value, dtype))
    attrs = {"scale": LOSS_SCALE, "inv_scale": INV_LOSS_SCALE, "growth_tracker": GROWTH_TRACKER,
             "found_inf": FOUND_INF, "growth_factor": cfg["growth_factor"],
             "backoff_factor": cfg["backoff_factor"],
             "growth_interval": cfg["growth_interval"]}
    for node in graph.nodes:
        if node.phase == "apply" and node.op_type == "ScaleClipGrad":
            node.attrs["unscale"] = {"inv_scale": INV_LOSS_SCALE, "found_inf": FOUND_INF}
        elif node.phase == "apply" and node.op_type.endswith("Update") and node.inputs \
                and node.inputs[0] is graph.values["__params"]:
            node.attrs["loss_scale"] = attrs


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
