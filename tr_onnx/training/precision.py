"""Mixed precision for a training graph: half-precision activations and gradients, fp32
master weights (``precision="fp16"`` or ``"bf16"`` on the cuda backend; "half" below is
float16 or bfloat16, ``ml_dtypes.bfloat16`` in the plan and the reference kernels).

``to_half_precision`` runs on the finished training graph (in ``pipeline.build_training_step``,
after the optimizer update, before layouts and the MemoryPlan), so autodiff, the loss and the
optimizer stay precision-agnostic and the change is one retyping, visible in the plan:

* every float32 value the ``compute`` phase produces (activations, local gradients) and every
  float32 constant it reads become half, and so do the model's float32 inputs
  (the host rounds a batch to half as it uploads it: half the bytes, and conv/matmul read
  operands of one type, as under torch.autocast);
* each trainable parameter ``p`` keeps its float32 master in PARAM (the optimizer's span); the
  compute nodes read ``p.half`` instead, an OPT_STATE mirror of ``p`` (same slot geometry:
  its slot is half its master's, ``memory.slot_bytes``) initialised from ``p`` and rewritten by
  the fused optimizer kernel's weight-copy output after every update (the update node's
  declared ``weight_copy`` input is the ``__params_half`` span over them;
  ``TrainInfo.weight_copy``);
* the GRAD accumulators (and the ``__grads`` span) are half, as the gradients feeding them;
* float32 islands (``OpDef.fp32_inputs`` / ``fp32_outputs``), as cuDNN's BatchNorm takes them
  (half x/y/dy/dx, fp32 per-channel tensors): BatchNormTraining reads scale, bias and the
  running statistics in float32 (the trainable masters themselves, not their half copies) and
  writes float32 saved/running statistics (the running ones stay float32 in PARAM through the
  commit phase); BatchNormGrad reads scale, mean and inv_std in float32 and writes float32
  dscale/dbias, which one Cast (ai.onnx Cast, ``tr_convert`` on the cuda backend) rounds to
  half on their way to the accumulators -- in fp16 an overflow there is an inf that the loss
  scaler's check catches like any other fp16 gradient. A value of another kind on such a port
  (a computed scale) is a named error;
* the loss in float32, as under torch.autocast (``loss_region``): the nodes between the
  model's output and the loss -- a builtin loss's or a user's ONNX loss model's -- and the
  backward nodes their gradient rules emitted read and write float32 (parameters as their
  masters, constants as they are); one Cast takes the half output in and one takes d(output)
  (summed in float32 when the loss reads the output more than once) back to half. The seed
  of the backward pass (1, or the fp16 loss scale) is float32 as well;
* a frozen float32 parameter stays float32 where a float32 port reads it, and elsewhere is
  read through ``p.half`` (half, an OPT_STATE value of its own initialised from ``p``,
  rewritten from ``p`` when the session loads it; ``TrainInfo.half_copies``).

The per-step scalars (lr, step, grad scale) and the apply phase's grad-norm stay float32.

Dynamic loss scaling (``add_loss_scaling``, on by default with fp16), as
``torch.amp.GradScaler``: four scalars in OPT_STATE (they persist across steps, are written
only by the apply phase, and travel with the optimizer state through re-plans and
checkpoints): ``__loss_scale`` (float32, the backward pass's seed, so every gradient is of
``loss * scale``), ``__inv_loss_scale`` (float32), ``__loss_scale_growth`` (int32, good steps
since the last change) and ``__found_inf`` (float32 flag), named by ``TrainInfo.loss_scaling``.
The apply phase, as declared inputs and nodes: clear ``__found_inf`` (a ZeroFill; the step
guard's StepCheck instead where there is one); ScaleClipGrad unscales the GRAD span and checks
it before it clips (its ``inv_scale`` and ``found_inf`` inputs), so clipping sees true
gradients; the update skips itself when its ``skip`` input, ``__found_inf``, is set; then
LossScaleUpdate (backoff on overflow, growth after ``growth_interval`` good steps). The host
reads the 4-byte flag after apply: an overflow step is no step.

bf16 has float32's exponent range, so it needs no loss scaling (``loss_scale`` is for fp16
only, as in PyTorch's AMP); its 8-bit significand rounds 8x coarser than fp16.

Not covered (a named error): running statistics read outside a BatchNorm. Other ops with
float32 parameters read half copies (LayerNorm's scale and bias: checked on the transformer).
"""

from __future__ import annotations

import numpy as np

from .. import ir
from ..dtypes import BFLOAT16, onnx_elem_type
from ..errors import UnsupportedModelError
from ..ir import Graph, Node, Phase, Value
from .reserved import Reserved
from .train_pass import LossScaling, TrainInfo, internal_node, set_optional_input, update_skip_index

PRECISIONS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16),
              "bf16": BFLOAT16}
"""``precision=`` -> the storage dtype of activations and gradients."""
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


def add_loss_scaling(graph: Graph, info: TrainInfo, cfg: dict, registry=None,
                     backend: str = "numpy", guarded: bool = False) -> LossScaling:
    """Dynamic loss scaling (module docstring) on a training graph built with the same
    ``TrainConfig.loss_scale`` (the backward pass's seed is ``__loss_scale``,
    ``train_pass.add_backward``): its arena scalars, ScaleClipGrad's ``inv_scale`` and
    ``found_inf`` inputs, the update's ``skip`` input (the overflow flag) and a LossScaleUpdate
    after it. ``guarded``: the step guard will clear and set the flag each step (StepCheck);
    otherwise a ZeroFill clears it at the start of the apply phase."""
    f32 = np.dtype(np.float32)
    for name, dtype, value in ((Reserved.INV_LOSS_SCALE, f32, 1.0 / cfg["init"]),
                               (Reserved.GROWTH_TRACKER, np.dtype(np.int32), 0),
                               (Reserved.FOUND_INF, f32, 0.0)):
        graph.values[name] = Value(name, (), dtype, ir.STATE, data=np.array(value, dtype))
    scaling = LossScaling(Reserved.LOSS_SCALE, Reserved.INV_LOSS_SCALE, Reserved.GROWTH_TRACKER,
                          Reserved.FOUND_INF)
    v = graph.values
    found = v[Reserved.FOUND_INF]
    clip = next(n for n in graph.nodes if n.phase == Phase.APPLY and n.op_type == "ScaleClipGrad")
    set_optional_input(graph, clip, 2, v[Reserved.INV_LOSS_SCALE])
    set_optional_input(graph, clip, 3, found)
    update = next(n for n in graph.nodes if n.name == info.update)
    set_optional_input(graph, update, update_skip_index(update), found)
    if not guarded:
        clear = internal_node(graph, registry, backend, "ZeroFill", f"{Reserved.FOUND_INF}/clear",
                              [found], [], {})
        clear.phase = Phase.APPLY
        graph.insert_before(clip, clear)
    scale_update = internal_node(graph, registry, backend, "LossScaleUpdate",
                             f"{Reserved.LOSS_SCALE}/update",
                             [v[Reserved.LOSS_SCALE], v[Reserved.INV_LOSS_SCALE],
                              v[Reserved.GROWTH_TRACKER], found], [],
                             {k: cfg[k] for k in ("growth_factor", "backoff_factor",
                                                  "growth_interval")})
    scale_update.phase = Phase.APPLY
    graph.insert(graph.nodes.index(update) + 1, scale_update)
    return scaling


def check_precision(precision: str, backend: str) -> str:
    """``precision`` validated for ``backend``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision != "fp32" and backend != "cuda":
        raise ValueError(f"precision={precision!r} needs backend='cuda'; the {backend} backend "
                         "trains in fp32 only (precision='fp32')")
    return precision


def _fp32_ports(node) -> tuple[set, set]:
    """The ports of ``node`` that stay float32 (``OpDef.fp32_inputs`` / ``fp32_outputs``)."""
    opdef = node.opdef
    if opdef is None:
        return set(), set()
    inputs = range(len(node.inputs)) if opdef.fp32_inputs == "all" else opdef.fp32_inputs
    return set(inputs), set(opdef.fp32_outputs)


def loss_region(graph: Graph, loss: str, output: str) -> set[int]:
    """``id``s of the nodes that compute the loss from the model's ``output`` (what the loss
    builder or a user's ONNX loss model added: forward ancestors of ``loss`` that are not
    ancestors of ``output``) and of the backward nodes their gradient rules emitted
    (``Node.grad_of``), with the Sum that adds up their contributions to d(output)."""
    forward = graph.nodes[:graph.backward_start]

    def ancestors(name: str) -> set[int]:
        need, found = {name}, set()
        for node in reversed(forward):
            if any(v is not None and v.name in need for v in node.outputs):
                found.add(id(node))
                need.update(v.name for v in node.inputs if v is not None)
        return found

    region = ancestors(loss) - ancestors(output)
    forward_region = set(region)
    for node in graph.nodes[graph.backward_start:]:
        # a gradient rule's nodes, and the Sum of several gradients leaving the region (the
        # loss reads the output more than once): d(output) is summed in float32, cast once
        if node.grad_of is not None and (id(node.grad_of) in forward_region or (
                node.op_type == "Sum" and all(v.producer is not None
                                              and id(v.producer) in region
                                              for v in node.inputs))):
            region.add(id(node))
    return region


def _cast(graph: Graph, v: Value, dtype: np.dtype, registry, backend: str) -> Value:
    """``v`` cast to ``dtype`` by one ai.onnx Cast placed right after ``v``'s producer (round to
    nearest even; to fp16 an overflow becomes inf, which the loss scaler's check catches)."""
    if registry is None:
        raise UnsupportedModelError(f"mixed precision: {v.name!r} needs a Cast to {dtype} "
                                    "(to_half_precision(..., registry=...))", [])
    opdef = registry.lookup("", "Cast", 13, backend)
    out = Value(graph.unique_name(f"{v.name}.{dtype.name}"), v.shape, dtype)
    cast = Node(graph.unique_name(f"{v.name}/to_{dtype.name}"), "Cast", "", 13, [v], [out],
                {"to": onnx_elem_type(dtype)}, opdef, phase=Phase.COMPUTE)
    graph.insert(graph.nodes.index(v.producer) + 1 if v.producer is not None else 0, cast)
    return out


def to_half_precision(graph: Graph, info, dtype=np.float16, registry=None,
                      backend: str = "numpy", data_inputs=(), output: str | None = None
                      ) -> str:
    """Retype ``graph`` (a training graph; ``info`` its ``TrainInfo``) as the module docstring
    says. ``registry``/``backend`` dispatch the Cast nodes around the float32 islands.
    ``data_inputs``: the model's own inputs (not the labels); the float32 ones are stored
    half, rounded by the host on upload. ``output``: the model output the loss reads (default
    ``info.outputs[0]``). Returns the name of the half weight-copy span."""
    half = np.dtype(dtype)
    f32 = np.dtype(np.float32)
    region = loss_region(graph, info.loss, output or info.outputs[0])
    for name in data_inputs:
        v = graph.values.get(name)
        if v is not None and v.kind == ir.INPUT and v.dtype == f32:
            v.dtype = half
    trainable = [graph.values[n] for n in info.trainable]
    if trainable[0].dtype != f32:
        raise UnsupportedModelError(f"mixed precision needs float32 parameters, got "
                                    f"{trainable[0].dtype}", [])
    compute = [n for n in graph.nodes if n.phase == Phase.COMPUTE]
    # float32 islands: BatchNorm's fp32 ports, and the loss region, all of whose inputs are
    # read float32 (parameters as their masters, constants as they are, half activations
    # through a Cast) and whose outputs stay float32
    fp32_in = {id(n): set(range(len(n.inputs))) if id(n) in region else _fp32_ports(n)[0]
               for n in compute}
    fp32_out = {id(n): set(range(len(n.outputs))) if id(n) in region else _fp32_ports(n)[1]
                for n in compute}
    island = [v for n in compute for k, v in enumerate(n.outputs)
              if v is not None and k in fp32_out[id(n)] and v.dtype == f32]
    # Frozen float32 parameters: read as they are on a float32 port, else through a half
    # copy (STATE, its own slot, written from the parameter when it is loaded).
    frozen = {}
    for node in compute:
        for k, v in enumerate(node.inputs):
            if v is None or v.kind != ir.PARAM or v.dtype != f32 or v.name in info.trainable \
                    or k in fp32_in[id(node)]:
                continue
            if v.name in info.running_stats:
                raise UnsupportedModelError(
                    f"mixed precision: {node.label} reads the running statistic {v.name!r} "
                    "outside a BatchNorm; not supported", [])
            if v.name not in frozen:
                h = Value(f"{v.name}.half", v.shape, half, ir.STATE,
                          data=np.asarray(v.data).astype(half))
                graph.values[h.name] = h
                frozen[v.name] = h
            graph.replace_input(node, k, frozen[v.name])
    info.half_copies = {name: h.name for name, h in frozen.items()}
    n_state = len({k for s in info.states.values() for k in s})
    copies = []
    for i, p in enumerate(trainable):
        h = Value(f"{p.name}.half", p.shape, half, ir.STATE, data=p.data.astype(half),
                  mirror_of=p, slot_order=(n_state + 2) * len(trainable) + i)
        graph.values[h.name] = h
        info.half_copies[p.name] = h.name
        copies.append(h)
        for node in list(p.consumers):
            if node.phase == Phase.COMPUTE:
                for k, v in enumerate(node.inputs):
                    if v is p and k not in fp32_in[id(node)]:
                        graph.replace_input(node, k, h)
    keep = {v.name for v in island}
    for node in compute:
        for k, v in enumerate(node.inputs):
            if v is not None and v.name not in keep and v.kind == ir.CONST and v.dtype == f32 \
                    and k not in fp32_in[id(node)]:
                c = Value(graph.unique_name(f"{v.name}.half"), v.shape, half, ir.CONST,
                          data=np.asarray(v.data).astype(half))
                graph.values[c.name] = c
                graph.replace_input(node, k, c)
        for v in node.outputs:
            if v is not None and v.kind == ir.ACTIVATION and v.dtype == f32 \
                    and v.name not in keep:
                v.dtype = half
    # into the loss region: the model's half output (and any other half value it reads) is
    # cast to float32 once
    to_f32: dict[str, Value] = {}
    for node in compute:
        if id(node) in region:
            for k, v in enumerate(node.inputs):
                if v is not None and v.dtype == half:
                    if v.name not in to_f32:
                        to_f32[v.name] = _cast(graph, v, f32, registry, backend)
                    graph.replace_input(node, k, to_f32[v.name])
    for node in compute:
        for k in fp32_in[id(node)]:
            v = node.inputs[k] if k < len(node.inputs) else None
            if v is not None and v.dtype not in (f32, half) and id(node) in region:
                continue  # the loss region's integer labels and indices
            if v is not None and v.dtype != f32:
                raise UnsupportedModelError(
                    f"mixed precision: {node.label} reads {v.name!r} ({v.dtype}) on a float32 "
                    f"port (input {k}); only parameters and BatchNorm statistics go there", [])
    # An island's output read by a half consumer (a BatchNorm parameter's gradient on its way
    # to the half accumulator, d(output) leaving the loss region) goes through one Cast.
    for v in island:
        readers = [(n, k) for n in list(v.consumers) if n.phase == Phase.COMPUTE
                   for k, u in enumerate(n.inputs) if u is v and k not in fp32_in.get(id(n), ())]
        if readers:
            out = _cast(graph, v, half, registry, backend)
            for n, k in readers:
                graph.replace_input(n, k, out)
    grads = {*info.grads.values(), info.grads_span}
    for name in grads:
        graph.values[name].dtype = half
    for v in graph.values.values():  # the data-parallel all-reduce's buckets of them
        if v.kind == ir.GRAD and v.span_of and all(m.name in grads for m in v.span_of):
            v.dtype = half
    span = Value(Reserved.HALF_SPAN, (0,), half, ir.STATE, span_of=copies)
    graph.values[span.name] = span
    update = next(n for n in graph.nodes if n.name == info.update)
    set_optional_input(graph, update, update_skip_index(update) + 1, span)
    return Reserved.HALF_SPAN
