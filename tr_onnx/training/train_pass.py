"""The train pass: turn a specialised, dispatched inference graph into one training step.

1. untie parameters that exporters shared through Identity nodes (unless asked to keep ties);
2. training semantics: every BatchNormalization uses batch statistics and updates its running
   statistics (``ai.tr_onnx.BatchNormTraining``), every Dropout with a ratio draws a mask
   (``ai.tr_onnx.DropoutTraining``), whatever mode the model was exported in;
3. the loss nodes and the labels input;
4. the backward pass of the trainable parameters (``passes.autodiff``);
5. gradient accumulators (GRAD), optimizer state (OPT_STATE), and the update over flat spans.

Nodes are tagged with the phase of the step they belong to: ``compute`` (forward, backward,
accumulate into GRAD), ``commit`` (running statistics; only after a step with finite loss and
gradients) and ``apply`` (scale/clip, optimizer update, zero GRAD; every k-th micro-batch).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from .. import ir
from ..backends import APPLIED, BAD_BATCH, REJECT
from ..errors import TrOnnxError, UnsupportedModelError
from ..ir import Graph, Node, Value
from ..optim import Optimizer
from ..passes.autodiff import GradBuilder, differentiate
from ..registry import OpRegistry
from .losses import LOSSES, LossSpec

# per-step scalars the host writes: learning rate, optimizer step (1-based, the one being
# taken), 1/k for k accumulated micro-batches, and the count of micro-batches seen (dropout)
LR, STEP, GRAD_SCALE, RNG = "__lr", "__step", "__grad_scale", "__rng_counter"
# dynamic loss scaling (``training.precision``): the scale lives in the arena (OPT_STATE) and
# seeds the backward pass, d(loss * scale)/d(loss)
LOSS_SCALE = "__loss_scale"
INTERNAL = "ai.tr_onnx"


@dataclass
class TrainConfig:
    loss: LossSpec | object  # a LossSpec, or an ImportedModel (a user's ONNX loss)
    optimizer: Optimizer
    output_name: str
    label_name: str
    label_shape: tuple[int, ...]
    label_dtype: np.dtype
    trainable: list[str] | None = None  # names or fnmatch patterns; None: every parameter
    frozen: list[str] = field(default_factory=list)
    clip_grad_norm: float | None = None
    bn_unbiased_running_var: bool = False
    tie_shared_initializers: bool = False
    seed: int = 0
    loss_scale: float | None = None  # initial dynamic loss scale; None: the seed is 1


@dataclass
class TrainInfo:
    """What the session needs to drive the compiled step (all value names)."""

    loss: str
    outputs: list[str]
    trainable: list[str]
    grads: dict[str, str]
    states: dict[str, dict[str, str]]
    running_stats: list[str]
    untied: dict[str, str]  # parameter made from an Identity copy -> the initializer it copied
    grad_norm: str
    converted: dict[str, int] = field(default_factory=dict)
    frozen_half: dict[str, str] = field(default_factory=dict)  # fp16: frozen param -> copy


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def untie_identity_params(graph: Graph) -> dict[str, str]:
    """Exporters share equal-valued initializers through Identity nodes; make each copy a
    parameter of its own (it trains separately, as in the model that was exported)."""
    untied = {}
    for node in list(graph.nodes):
        x = node.inputs[0] if node.inputs else None
        if node.op_type == "Identity" and x is not None and x.kind == ir.PARAM:
            y = node.outputs[0]
            graph.remove_node(node)
            y.kind, y.data, y.producer = ir.PARAM, np.array(x.data, copy=True), None
            untied[y.name] = x.name
    return untied


def _internal(graph: Graph, registry: OpRegistry, backend: str, op_type: str, name: str,
              inputs, outputs, attrs) -> Node:
    opdef = registry.lookup(INTERNAL, op_type, 1, backend)
    if opdef is None:
        raise UnsupportedModelError(f"training needs {INTERNAL}.{op_type} for backend "
                                    f"{backend!r}, which is not registered", [])
    return Node(name, op_type, INTERNAL, 1, inputs, outputs, attrs, opdef)


def to_training_mode(graph: Graph, registry: OpRegistry, backend: str, cfg: TrainConfig,
                     counter: Value) -> tuple[list[tuple[Value, Value]], dict[str, int]]:
    """Rewrite BatchNormalization and Dropout to their training forms.

    Returns the (running-statistic parameter, its new value) pairs to commit, and counts.
    """
    commits, counts = [], {"BatchNormalization": 0, "Dropout": 0}
    for index, node in enumerate(list(graph.nodes)):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization":
            if node.attrs.get("spatial", 1) != 1 and node.inputs[0].rank > 2:
                raise UnsupportedModelError(f"{node.label}: spatial=0 BatchNormalization cannot "
                                            "be trained", [])
            x, scale, bias, mean, var = node.inputs[:5]
            c = (scale.shape[0],)
            outs = list(node.outputs) + [None] * (5 - len(node.outputs))
            y = outs[0]
            saved = [Value(graph.unique_name(f"{node.name}/saved_{k}"), c, x.dtype)
                     for k in ("mean", "inv_std")]
            for v in saved:
                graph.values[v.name] = v
            new_stats = []
            for k, old in enumerate(outs[1:3]):
                if old is None or old.shape != c:  # opset < 9 had other optional outputs
                    old = Value(graph.unique_name(f"{node.name}/new_running_{k}"), c, x.dtype)
                    graph.values[old.name] = old
                new_stats.append(old)
            attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5)),
                     "momentum": float(node.attrs.get("momentum", 0.9)),
                     "unbiased_running_var": int(cfg.bn_unbiased_running_var)}
            new = _internal(graph, registry, backend, "BatchNormTraining", node.name,
                            [x, scale, bias, mean, var], [y, *saved, *new_stats], attrs)
            graph.replace_node(node, new)
            commits += [(stat, v) for stat, v in zip((mean, var), new_stats)
                        if stat.kind == ir.PARAM]
            counts["BatchNormalization"] += 1
        elif node.op_type == "Dropout":
            ratio = node.attrs.get("ratio", 0.5) if node.since_version < 12 else (
                float(np.asarray(node.inputs[1].data)) if len(node.inputs) > 1
                and node.inputs[1] is not None else 0.5)
            if ratio == 0.0:
                continue
            y = node.outputs[0]
            mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] is not None \
                and node.outputs[1].dtype == np.bool_ else None
            if mask is None:
                mask = Value(graph.unique_name(f"{node.name}/mask"), y.shape, np.dtype(np.bool_))
                graph.values[mask.name] = mask
            new = _internal(graph, registry, backend, "DropoutTraining", node.name,
                            [node.inputs[0], counter], [y, mask],
                            {"ratio": float(ratio), "seed": int(cfg.seed) * 1_000_003 + index})
            graph.replace_node(node, new)
            counts["Dropout"] += 1
    return commits, counts


def to_inference_mode(graph: Graph) -> int:
    """Eval semantics for a model exported in training mode: BatchNormalization uses its
    running statistics, Dropout passes its input through. Returns how many nodes changed."""
    changed = 0
    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization" and node.attrs.get("training_mode", 0):
            node.attrs["training_mode"] = 0
            for k in range(1, len(node.outputs)):
                out = node.outputs[k]
                if out is not None and not out.consumers and out not in graph.outputs:
                    node.outputs[k] = None
            changed += 1
        elif node.op_type == "Dropout" and node.since_version >= 12 and len(node.inputs) > 2 \
                and node.inputs[2] is not None:
            off = Value(graph.unique_name(f"{node.name}/eval"), (), np.dtype(np.bool_), ir.CONST,
                        data=np.array(False))
            graph.values[off.name] = off
            graph.replace_input(node, 2, off)
            changed += 1
    return changed


def contributes_to(graph: Graph, target: Value) -> set[Value]:
    """Values whose change can change ``target`` through differentiable inputs."""
    needed = {target}
    for node in reversed(graph.nodes):
        if node.opdef.differentiable is False or not any(o in needed for o in node.outputs):
            continue
        positions = node.opdef.grad_inputs
        needed.update(v for i, v in enumerate(node.inputs) if v is not None
                      and v.dtype.kind == "f" and (positions is None or i in positions))
    return needed


def splice_loss_graph(graph: Graph, loss_graph: Graph, output: Value, labels: Value) -> Value:
    """Copy a user's loss graph (inputs: model output, labels; output: scalar) into ``graph``."""
    if len(loss_graph.inputs) != 2 or len(loss_graph.outputs) != 1:
        raise TrOnnxError("an ONNX loss model takes exactly (model output, labels) and returns "
                          f"one scalar; this one has inputs {[v.name for v in loss_graph.inputs]} "
                          f"and outputs {[v.name for v in loss_graph.outputs]}")
    mapping = {id(loss_graph.inputs[0]): output, id(loss_graph.inputs[1]): labels}

    def mapped(v: Value | None) -> Value | None:
        if v is None:
            return None
        if id(v) not in mapping:
            kind = ir.CONST if v.kind in (ir.PARAM, ir.CONST) else v.kind
            copy = Value(graph.unique_name(f"loss/{v.name}"), v.shape, v.dtype, kind, data=v.data)
            graph.values[copy.name] = copy
            mapping[id(v)] = copy
        return mapping[id(v)]

    for node in loss_graph.nodes:
        new = Node(graph.unique_name(f"loss/{node.name}"), node.op_type, node.domain,
                   node.since_version, [mapped(v) for v in node.inputs],
                   [mapped(v) for v in node.outputs], node.attrs, node.opdef)
        graph.append(new)
    loss = mapped(loss_graph.outputs[0])
    if loss.shape not in ((), (1,)):
        raise TrOnnxError(f"the ONNX loss model returns shape {list(loss.shape)}, not a scalar")
    return loss


def build_training_graph(graph: Graph, registry: OpRegistry, backend: str,
                         cfg: TrainConfig) -> TrainInfo:
    """Mutate ``graph`` into a training step; see the module docstring."""
    model_outputs = list(graph.outputs)
    untied = {} if cfg.tie_shared_initializers else untie_identity_params(graph)
    scalars = {LR: np.float32, STEP: np.int64, GRAD_SCALE: np.float32, RNG: np.int64}
    hidden = {}
    for name, dtype in scalars.items():
        hidden[name] = Value(name, (), np.dtype(dtype), ir.INPUT)
        graph.values[name] = hidden[name]
        graph.inputs.append(hidden[name])
    commits, converted = to_training_mode(graph, registry, backend, cfg, hidden[RNG])

    if cfg.output_name not in graph.values:
        raise TrOnnxError(f"output {cfg.output_name!r} is not a value of the model; outputs: "
                          f"{[v.name for v in model_outputs]}")
    output = graph.values[cfg.output_name]
    labels = Value(cfg.label_name, tuple(cfg.label_shape), np.dtype(cfg.label_dtype), ir.INPUT)
    if labels.name in graph.values:
        raise TrOnnxError(f"label name {labels.name!r} is already a value of the model; pass "
                          "another label_name")
    graph.values[labels.name] = labels
    graph.inputs.append(labels)
    b = GradBuilder(graph, registry, backend, prefix="loss")
    if isinstance(cfg.loss, LossSpec):
        loss = LOSSES[cfg.loss.name](b, output, labels, cfg.loss)
    else:
        loss_graph = cfg.loss
        loss = splice_loss_graph(graph, loss_graph, output, labels)

    params = [v for v in graph.values.values() if v.kind == ir.PARAM and v.dtype.kind == "f"]
    reach = contributes_to(graph, loss)
    selected = [p for p in params if p in reach
                and (cfg.trainable is None or _matches(p.name, cfg.trainable))
                and not _matches(p.name, cfg.frozen)]
    if not selected:
        raise TrOnnxError("no trainable parameters: nothing the loss depends on matches "
                          f"trainable={cfg.trainable} minus frozen={cfg.frozen}")
    dtypes = {p.dtype for p in selected}
    if len(dtypes) != 1:
        raise TrOnnxError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; freeze "
                          "some or cast the model")

    graph.backward_start = len(graph.nodes)
    seed = None
    if cfg.loss_scale is not None:
        if loss.shape:
            raise TrOnnxError(f"loss scaling needs a scalar loss, got shape {list(loss.shape)}")
        seed = Value(LOSS_SCALE, (), np.dtype(np.float32), ir.STATE,
                     data=np.array(cfg.loss_scale, np.float32))
        graph.values[seed.name] = seed
    grads = differentiate(graph, loss, selected, registry, backend, seed=seed)
    b.phase = "compute"
    accumulators, states = {}, {}
    n = len(selected)
    for i, p in enumerate(selected):
        p.slot_order = i
        acc = Value(f"{p.name}.grad", p.shape, p.dtype, ir.GRAD, mirror_of=p, slot_order=i)
        graph.values[acc.name] = acc
        accumulators[p.name] = acc
        b.op("Accumulate", [acc, grads[p.name]], domain=INTERNAL, shapes=[])
    for k, state in enumerate(cfg.optimizer.state):
        init = cfg.optimizer.state_init(state)
        for i, p in enumerate(selected):
            v = Value(f"{p.name}.{state}", p.shape, p.dtype, ir.STATE, mirror_of=p,
                      slot_order=k * n + i,
                      data=np.full(p.shape, init, p.dtype) if init else None)
            graph.values[v.name] = v
            states.setdefault(p.name, {})[state] = v

    def span(name: str, kind: str, members: list[Value]) -> Value:
        v = Value(name, (0,), members[0].dtype, kind, span_of=members)
        graph.values[name] = v
        return v

    p_span = span("__params", ir.PARAM, selected)
    g_span = span("__grads", ir.GRAD, [accumulators[p.name] for p in selected])
    s_spans = [span(f"__{state}", ir.STATE, [states[p.name][state] for p in selected])
               for state in cfg.optimizer.state]

    b.phase = "commit"
    for stat, new in commits:
        b.op("Assign", [stat, new], domain=INTERNAL, shapes=[])
    b.phase = "apply"
    grad_norm = b.op("ScaleClipGrad", [g_span, hidden[GRAD_SCALE]],
                     {"max_norm": float(cfg.clip_grad_norm or 0.0)}, domain=INTERNAL,
                     shapes=[((), np.float32)])
    b.op(cfg.optimizer.op, [p_span, g_span, *s_spans, hidden[LR], hidden[STEP]],
         cfg.optimizer.attrs(), domain=INTERNAL, shapes=[])
    b.op("ZeroFill", [g_span], domain=INTERNAL, shapes=[])
    for node in graph.nodes:
        if node.phase == "forward":
            node.phase = "compute"
    graph.outputs = [loss] + [v for v in model_outputs if v is not loss] + [grad_norm]
    return TrainInfo(
        loss=loss.name, outputs=[v.name for v in model_outputs],
        trainable=[p.name for p in selected],
        grads={p: a.name for p, a in accumulators.items()},
        states={p: {k: v.name for k, v in s.items()} for p, s in states.items()},
        running_stats=[stat.name for stat, _ in commits], untied=untied,
        grad_norm=grad_norm.name, converted=converted)


def add_step_guard(graph: Graph) -> None:
    """The step guard's OPT_STATE scalars (``backends.BAD_BATCH``, ``REJECT``: float32 flags;
    ``APPLIED``: the int64 count of applied optimizer steps, which the session writes when it
    loads state): the cuda executor runs a training step as one CUDA graph and decides there
    whether the batch is kept and whether the step was launched on a right assumption
    (``CudaExecutor.run_step``)."""
    for name, dtype in ((BAD_BATCH, np.float32), (REJECT, np.float32), (APPLIED, np.int64)):
        graph.values[name] = Value(name, (), np.dtype(dtype), ir.STATE,
                                   data=np.array(0, dtype))
