"""The train pass: the steps that turn a specialised, dispatched inference graph into one
training step. ``training.pipeline.build_training_step`` calls them in order; each one is a
function here, so that order reads in one place:

1. untie parameters that exporters shared through Identity nodes (unless asked to keep ties);
2. the per-step scalars the host writes (learning rate, step, 1/k, RNG counter);
3. training semantics, whatever mode the model was exported in: each op's training form
   (``OpDef.training``): every BatchNormalization uses batch statistics and updates its
   running statistics (``ai.tr_onnx.BatchNormTraining``), every Dropout with a ratio draws a
   mask (``ai.tr_onnx.DropoutTraining``), random ops draw from the step counter;
4. the labels input and the loss nodes (a builtin loss, or a user's ONNX loss model spliced
   in);
5. the trainable parameters, and the backward pass of the loss w.r.t. them
   (``passes.autodiff``);
6. gradient accumulators (GRAD), optimizer state (OPT_STATE), the flat spans over them;
7. the commit of running statistics and the update (scale/clip, optimizer, zero GRAD);
8. the step guard's scalars (cuda);
9. with one micro-batch per step, each gradient computed straight into GRAD and no ZeroFill
   (``fold_accumulators``, numpy).

Nodes are tagged with the phase of the step they belong to: ``compute`` (forward, backward,
accumulate into GRAD), ``commit`` (running statistics; only after a step with finite loss and
gradients) and ``apply`` (scale/clip, optimizer update, zero GRAD; every k-th micro-batch).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import ir
from ..compiler import compile_region
from ..domains import INTERNAL_DOMAIN
from ..errors import TrOnnxError, UnsupportedModelError
from ..importer import ImportedModel
from ..ir import Graph, Node, Phase, Value
from ..opdef import TrainingContext
from ..ops.optimizers import UPDATE_STATES
from ..optim import Optimizer
from ..passes import control_flow
from ..passes.autodiff import GradBuilder, carries_grad, differentiate
from ..passes.dispatch import dispatch
from ..registry import OpRegistry
from ..subplan import Regions
from .groups import update_group, update_runs
from .losses import INTEGER_LABELS, LOSSES, LossSpec, label_dtype
from .parameters import ParamSharing
from .reserved import Reserved

# ops ``TrainInfo.converted`` counts even where a model has none
REPORTED_TRAINING_FORMS = ("BatchNormalization", "Dropout")


@dataclass
class TrainConfig:
    """What the training pipeline needs besides the graph: the session's choices, the same
    for every batch shape (the labels' shape follows the model output's, per plan)."""

    loss: LossSpec | ImportedModel  # a builtin loss, or a user's ONNX loss model
    optimizer: Optimizer
    output_name: str
    label_name: str
    trainable: list[str] | None = None  # names or fnmatch patterns; None: default_trainable
    frozen: list[str] = field(default_factory=list)
    # the model's parameters (``training.parameters.parameter_roles``); None: every float
    # initializer the loss depends on
    default_trainable: frozenset[str] | None = None
    clip_grad_norm: float | None = None
    bn_unbiased_running_var: bool = False
    sharing: ParamSharing | None = None  # None: every Identity copy untied, nothing tied
    seed: int = 0
    precision: str = "fp32"  # training.precision.PRECISIONS
    loss_scale: dict | None = None  # dynamic loss scaling (check_loss_scale); None: off
    step_guard: bool = False  # the cuda executor's on-device step guard (add_step_guard)
    data_inputs: tuple[str, ...] = ()  # the model's own inputs (precision: stored half)
    # data parallelism: the id ``distributed.register`` gave the session's world (size > 1;
    # None: one process), and whether BatchNorm's batch statistics span every rank
    world: int | None = None
    sync_batchnorm: bool = False
    grad_bucket_bytes: int = 25 << 20  # all-reduce buckets (``training.data_parallel``)
    grad_accumulation: int = 1  # micro-batches per optimizer step (1: ``fold_accumulators``)
    # BatchNorms whose scale and bias are both frozen stay in inference mode (running
    # statistics used, not updated), as model.eval() on frozen layers in torchvision recipes
    frozen_batchnorm_eval: bool = False
    # fnmatch pattern -> learning-rate multiplier (discriminative fine-tuning); a parameter
    # takes its first matching pattern's, else 1 (``lr_group_runs``)
    lr_groups: dict[str, float] = field(default_factory=dict)
    # parameter -> optimizer steps taken before it became trainable (``TrainingSession.
    # unfreeze``): its update counts its own steps, as PyTorch's per-parameter state does
    step_offsets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling's arena scalars (``precision.add_loss_scaling``): the scale that
    seeds the backward pass, its inverse (ScaleClipGrad unscales by it), the growth tracker,
    and the overflow flag the update skips on."""

    scale: str
    inv_scale: str
    growth_tracker: str
    found_inf: str


@dataclass(frozen=True)
class StepGuard:
    """The on-device step guard's OPT_STATE tensors (``add_step_guard``): the bad-batch and
    reject flags (float32), the count of applied optimizer steps (int64; the session writes it
    when it loads state) and the report the host reads back after a step (float32 x 8, fields
    ``ops.optimizers.REPORT_FIELDS``)."""

    bad_batch: str = Reserved.BAD_BATCH
    reject: str = Reserved.REJECT
    applied: str = Reserved.APPLIED
    report: str = Reserved.STEP_REPORT


@dataclass
class TrainInfo:
    """The training contract: what the session and the executors drive the compiled step by
    (all value and node names). ``update`` is the optimizer's update node; ``weight_copy`` the
    half-precision parameter span it writes (mixed precision); ``loss_scaling`` and
    ``step_guard`` are set when the plan has them."""

    loss: str
    outputs: list[str]
    trainable: list[str]
    grads: dict[str, str]
    states: dict[str, dict[str, str]]
    running_stats: list[str]
    untied: dict[str, str]  # parameter made from an Identity copy -> the initializer it copied
    grad_norm: str
    converted: dict[str, int] = field(default_factory=dict)
    # mixed precision: each float32 parameter a compute node reads through a half copy -> that
    # copy (written from the parameter whenever the session loads it)
    half_copies: dict[str, str] = field(default_factory=dict)
    params_span: str = Reserved.PARAMS_SPAN
    grads_span: str = Reserved.GRADS_SPAN
    step: str = Reserved.STEP
    update: str = ""
    weight_copy: str | None = None
    loss_scaling: LossScaling | None = None
    step_guard: StepGuard | None = None
    # data parallelism: the world (size > 1) whose ranks must agree on every step's fate; the
    # plan then has a ``reduce`` phase (GradAllReduceWait) that runs before the apply phase
    world: Any = None
    # one micro-batch per step (``fold_accumulators``): the compute phase writes every GRAD
    # slot afresh and nothing zeroes them after the update, so between steps they hold the
    # last step's gradients, not an accumulation; the session reads them as zeros
    grads_overwritten: bool = False

    @property
    def frozen_half(self) -> dict[str, str]:
        """The half copies of parameters that do not train (read where no float32 port is)."""
        return {p: c for p, c in self.half_copies.items() if p not in self.trainable}


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def is_chosen(name: str, cfg: TrainConfig) -> bool:
    """Whether ``cfg`` picks parameter ``name`` to train (if the loss depends on it)."""
    if _matches(name, cfg.frozen):
        return False
    if cfg.trainable is not None:
        return _matches(name, cfg.trainable)
    return cfg.default_trainable is None or name in cfg.default_trainable


def internal_node(graph: Graph, registry: OpRegistry, backend: str, op_type: str, name: str,
              inputs, outputs, attrs) -> Node:
    opdef = registry.lookup(INTERNAL_DOMAIN, op_type, 1, backend)
    if opdef is None:
        raise UnsupportedModelError(f"training needs {INTERNAL_DOMAIN}.{op_type} for backend "
                                    f"{backend!r}, which is not registered", [])
    return Node(name, op_type, INTERNAL_DOMAIN, 1, inputs, outputs, attrs, opdef)


def to_training_mode(graph: Graph, registry: OpRegistry, backend: str, cfg: TrainConfig,
                     counter: Value) -> tuple[list[tuple[Value, Value]], dict[str, int]]:
    """Rewrite every node whose OpDef has a training form (``OpDef.training``: BatchNorm's
    batch statistics, Dropout's mask, the random ops' draws driven by the step counter).

    Returns the (running-statistic parameter, its new value) pairs to commit, and how many
    nodes of each op type changed (``REPORTED_TRAINING_FORMS`` listed even at 0).
    """
    commits: list[tuple[Value, Value]] = []
    counts = dict.fromkeys(REPORTED_TRAINING_FORMS, 0)

    def make_node(op_type, name, inputs, outputs, attrs, domain=INTERNAL_DOMAIN, since_version=1):
        if domain == INTERNAL_DOMAIN and since_version == 1:
            return internal_node(graph, registry, backend, op_type, name, inputs, outputs, attrs)
        return Node(name, op_type, domain, since_version, inputs, outputs, attrs,
                    registry.lookup(domain, op_type, since_version, backend))

    for index, node in enumerate(list(graph.nodes)):
        rule = _training_form(node)
        if rule is None:
            continue
        ctx = TrainingContext(
            graph, int(cfg.seed) * 1_000_003 + index, counter, make_node,
            trains=lambda v: is_chosen(v.name, cfg),
            sample_offset=lambda x: sample_offset(graph, cfg, x),
            unbiased_running_var=cfg.bn_unbiased_running_var,
            frozen_batchnorm_eval=cfg.frozen_batchnorm_eval,
            sync_world=cfg.world if cfg.sync_batchnorm else None, commits=commits)
        if rule(node, ctx):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return commits, counts


def sample_offset(graph: Graph, cfg: TrainConfig, x: Value) -> Value | None:
    """Data parallelism: the per-step input ``SAMPLE_OFFSET`` (made on first use) for a dropout
    of ``x`` whose axis 0 is the batch -- the extent the model's data inputs share on axis 0 --
    so rank r draws the mask rows one process with the whole global batch would draw for its
    rows (``DropoutTraining``'s third input). None without a world or when axis 0 is not the
    batch (a sequence-first [S, B, D] tensor): then every rank draws the same mask."""
    if cfg.world is None or x.rank == 0:
        return None
    data = [graph.values[n] for n in cfg.data_inputs if n in graph.values]
    rows = {v.shape[0] for v in data if v.kind == ir.INPUT and v.rank > 0}  # no plan constant
    if rows != {x.shape[0]}:
        return None
    offset = graph.values.get(Reserved.SAMPLE_OFFSET)
    if offset is None:
        offset = Value(Reserved.SAMPLE_OFFSET, (), np.dtype(np.int64), ir.INPUT)
        graph.values[offset.name] = offset
        graph.inputs.append(offset)
    return offset


def _training_form(node: Node):
    return node.opdef.training if node.opdef is not None else None


def to_inference_mode(graph: Graph) -> int:
    """Eval semantics for a model exported in training mode (``OpDef.inference``:
    BatchNormalization uses its running statistics, Dropout passes its input through).
    Returns how many nodes changed."""
    changed = 0
    for node in list(graph.nodes):
        rule = _inference_form(node)
        if rule is not None and rule(node, graph):
            changed += 1
    return changed


def _inference_form(node: Node):
    return node.opdef.inference if node.opdef is not None else None


def contributes_to(graph: Graph, target: Value) -> set[Value]:
    """Values whose change can change ``target`` through differentiable inputs."""
    needed = {target}
    for node in reversed(graph.nodes):
        if node.opdef.differentiable is False or not any(o in needed for o in node.outputs):
            continue
        positions = node.opdef.grad_inputs
        needed.update(v for i, v in enumerate(node.inputs) if v is not None
                      and carries_grad(v) and (positions is None or i in positions))
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


def add_step_scalars(graph: Graph) -> dict[str, Value]:
    """The per-step scalars the host writes before each step (``LR``, ``STEP``, ``GRAD_SCALE``,
    ``RNG``), as graph inputs."""
    scalars = {}
    for name, dtype in ((Reserved.LR, np.float32), (Reserved.STEP, np.int64),
                        (Reserved.GRAD_SCALE, np.float32), (Reserved.RNG, np.int64)):
        scalars[name] = Value(name, (), np.dtype(dtype), ir.INPUT)
        graph.values[name] = scalars[name]
        graph.inputs.append(scalars[name])
    return scalars


def add_labels(graph: Graph, cfg: TrainConfig, model_outputs: list[Value]) -> tuple[Value, Value]:
    """The model output the loss reads and a new graph input for the labels: class indices
    (int64, the output's shape without the class axis) for ``INTEGER_LABELS`` losses, the
    output's shape and dtype for other builtins, and for an ONNX loss model what its second
    input declares (its symbolic dimensions bound by name to the output's, ``loss_label_shape``)."""
    if cfg.output_name not in graph.values:
        raise TrOnnxError(f"output {cfg.output_name!r} is not a value of the model; outputs: "
                          f"{[v.name for v in model_outputs]}")
    output = graph.values[cfg.output_name]
    if isinstance(cfg.loss, LossSpec):
        if cfg.loss.name in INTEGER_LABELS:  # the output's shape without the class axis
            axis = cfg.loss.class_axis_of(len(output.shape))
            shape = tuple(d for i, d in enumerate(output.shape) if i != axis)
        else:
            shape = tuple(output.shape)
        dtype = label_dtype(cfg.loss, output.dtype)
    else:
        shape = loss_label_shape(cfg.loss, output)
        dtype = cfg.loss.inputs[1].dtype
    labels = Value(cfg.label_name, shape, np.dtype(dtype), ir.INPUT)
    if labels.name in graph.values:
        raise TrOnnxError(f"label name {labels.name!r} is already a value of the model; pass "
                          "another label_name")
    graph.values[labels.name] = labels
    graph.inputs.append(labels)
    return output, labels


def loss_label_shape(loss_model: ImportedModel, output: Value) -> tuple[int, ...]:
    """The labels' shape an ONNX loss model declares, its symbolic dimensions bound by name to
    the model output's: a name at position i of the loss model's first input is
    ``output.shape[i]`` (``[N, T, V]`` against logits [4, 6, 11] makes labels ``[N, T]``
    [4, 6]). A label dimension named nowhere in the first input is an error naming it."""
    scores, labels = loss_model.inputs[0], loss_model.inputs[1]
    if len(scores.shape) != len(output.shape):
        raise TrOnnxError(f"the loss model's input {scores.name!r} has rank {len(scores.shape)} "
                          f"{list(scores.shape)}; the model output has shape "
                          f"{list(output.shape)}")
    bound: dict[str, int] = {}
    for declared, actual in zip(scores.shape, output.shape):
        if isinstance(declared, str):
            if bound.setdefault(declared, actual) != actual:
                raise TrOnnxError(f"the loss model's dimension {declared!r} is both "
                                  f"{bound[declared]} and {actual} in the model output "
                                  f"{list(output.shape)}")
        elif declared != actual:
            raise TrOnnxError(f"the loss model's input {scores.name!r} {list(scores.shape)} "
                              f"does not match the model output {list(output.shape)}")
    unknown = [d for d in labels.shape if isinstance(d, str) and d not in bound]
    if unknown:
        raise TrOnnxError(f"the loss model's labels {labels.name!r} {list(labels.shape)} have "
                          f"dimensions {unknown} that its input {scores.name!r} "
                          f"{list(scores.shape)} does not name: give them names from there "
                          "or fixed sizes")
    return tuple(bound[d] if isinstance(d, str) else d for d in labels.shape)


def add_loss(b: GradBuilder, cfg: TrainConfig, output: Value, labels: Value) -> Value:
    """The loss nodes, emitted through ``b``: a builtin loss (``training.losses``), or the
    user's ONNX loss model specialised to these shapes, dispatched, and spliced in."""
    if isinstance(cfg.loss, LossSpec):
        return LOSSES[cfg.loss.name](b, output, labels, cfg.loss)
    loss_model = cfg.loss
    loss_graph = loss_model.specialize({loss_model.inputs[0].name: output.shape,
                                        loss_model.inputs[1].name: labels.shape}, {},
                                       control_flow.resolve, Regions(b.registry, compile_region))
    dispatch(loss_graph, b.registry, b.backend)
    return splice_loss_graph(b.graph, loss_graph, output, labels)


def select_trainable(graph: Graph, loss: Value, cfg: TrainConfig) -> list[Value]:
    """The float parameters the loss depends on, matching ``cfg.trainable`` (default: the
    model's parameters, ``cfg.default_trainable``) and not ``cfg.frozen``, in graph order; all
    of one dtype."""
    params = [v for v in graph.values.values() if v.kind == ir.PARAM and v.dtype.kind == "f"]
    reach = contributes_to(graph, loss)

    selected = [p for p in params if p in reach and is_chosen(p.name, cfg)]
    if not selected:
        what = (f"trainable={cfg.trainable}" if cfg.trainable is not None else
                "the model's parameters (scalar constants and buffers are frozen by default; "
                "`tr-onnx inspect` lists why)")
        raise TrOnnxError(f"no trainable parameters: nothing the loss depends on matches {what} "
                          f"minus frozen={cfg.frozen}")
    if cfg.lr_groups or cfg.step_offsets:  # each group adjacent: one update over its spans
        selected.sort(key=lambda p: update_group(p.name, cfg)[0])
    dtypes = {p.dtype for p in selected}
    if len(dtypes) != 1:
        raise TrOnnxError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; freeze "
                          "some or cast the model")
    return selected


def add_backward(graph: Graph, loss: Value, trainable: list[Value], registry: OpRegistry,
                 backend: str, cfg: TrainConfig) -> dict[str, Value]:
    """The backward pass (``passes.autodiff``): the gradient of the loss w.r.t. each trainable
    parameter, by name. With loss scaling its seed is the ``LOSS_SCALE`` state scalar, so every
    gradient is of ``loss * scale``."""
    graph.backward_start = len(graph.nodes)
    seed = None
    if cfg.loss_scale is not None:
        if loss.shape:
            raise TrOnnxError(f"loss scaling needs a scalar loss, got shape {list(loss.shape)}")
        seed = Value(Reserved.LOSS_SCALE, (), np.dtype(np.float32), ir.STATE,
                     data=np.array(cfg.loss_scale["init"], np.float32))
        graph.values[seed.name] = seed
    weight = graph.values.get(Reserved.ROW_WEIGHT)
    if weight is not None:  # data parallelism: d(objective)/d(loss) is this rank's share
        b = GradBuilder(graph, registry, backend, prefix="loss")
        b.anchor = loss.producer  # the loss's own gradient (half precision: a float32 island)
        seed = weight if seed is None else b.op("Mul", [seed, weight])
        if loss.shape:
            seed = b.op("Expand", [seed, b.ints(loss.shape)])
    return differentiate(graph, loss, trainable, registry, backend, seed=seed)


def add_rank_loss(b: GradBuilder, cfg: TrainConfig, loss: Value) -> Value:
    """Data parallelism: the per-step inputs ``ROW_WEIGHT`` (``add_backward`` seeds with it)
    and ``HAS_ROWS``, and the loss this rank reports and checks: ``ROW_WEIGHT`` (0) where the
    rank has no rows in this global batch (its mean over no rows is NaN, which would make every
    rank drop the step), else ``loss``. Without a world, ``loss`` itself. (No constant: the
    CONST region is one process's less the backward pass's seed of 1.)"""
    if cfg.world is None:
        return loss
    weight = Value(Reserved.ROW_WEIGHT, (), loss.dtype, ir.INPUT)
    has_rows = Value(Reserved.HAS_ROWS, (), np.dtype(bool), ir.INPUT)
    for v in (weight, has_rows):
        b.graph.values[v.name] = v
        b.graph.inputs.append(v)
    return b.op("Where", [has_rows, loss, weight])


def add_grad_accumulators(b: GradBuilder, trainable: list[Value],
                          grads: dict[str, Value]) -> dict[str, Value]:
    """One GRAD accumulator per trainable parameter (``p.grad``, mirroring its slot) and the
    ``compute``-phase node adding the step's gradient into it."""
    b.phase = Phase.COMPUTE
    accumulators = {}
    for i, p in enumerate(trainable):
        p.slot_order = i
        acc = Value(f"{p.name}.grad", p.shape, p.dtype, ir.GRAD, mirror_of=p, slot_order=i)
        b.graph.values[acc.name] = acc
        accumulators[p.name] = acc
        b.op("Accumulate", [acc, grads[p.name]], domain=INTERNAL_DOMAIN, shapes=[])
    return accumulators


def fold_accumulators(graph: Graph, info: TrainInfo, cfg: TrainConfig, registry: OpRegistry,
                      backend: str) -> bool:
    """With one micro-batch per optimizer step, on numpy, the step decided on the host (a
    graph with the on-device step guard keeps GRAD as the cuda backend has it):
    GRAD never accumulates, so each parameter's gradient is computed straight into its
    accumulator (the node producing it writes the GRAD value instead of a temporary; numpy
    kernels write through their outputs' logical views, whatever the layout) or, where that
    cannot be (a view op, a dtype or shape that differs, a value that is also another
    parameter's gradient or a step output), copied there (``Assign``) -- never added to zeros
    -- and the apply phase's ZeroFill of the GRAD span goes: the next step overwrites every
    slot (the host still zeroes GRAD after a bad batch, which is harmless). Runs last, on the
    final dtypes (half precision casts some gradients on their way to GRAD). Returns whether
    it folded (``TrainInfo.grads_overwritten``)."""
    if cfg.grad_accumulation != 1 or backend != "numpy" or cfg.step_guard:
        return False
    accumulators = {info.grads[p] for p in info.trainable}
    outputs = set(map(id, graph.outputs))
    for node in [n for n in graph.nodes if n.op_type == "Accumulate" and n.domain == INTERNAL_DOMAIN
                 and n.inputs[0].name in accumulators]:
        acc, g = node.inputs
        producer = g.producer
        # g.kind: a gradient folded into an earlier accumulator is that GRAD value now
        # data parallel: the slot is summed in place while the backward pass goes on, so a
        # later reader of the gradient must keep reading its own copy
        if (producer is None or g.kind != ir.ACTIVATION or id(g) in outputs
                or producer.opdef.alias_output or g.dtype != acc.dtype or g.shape != acc.shape
                or g.alias_of is not None
                or cfg.world is not None and any(c is not node for c in g.consumers)):
            copy = internal_node(graph, registry, backend, "Assign", node.name, [acc, g], [], {})
            copy.phase = node.phase
            graph.replace_node(node, copy)
            continue
        graph.remove_node(node)
        producer.outputs[producer.outputs.index(g)] = acc
        acc.producer = producer
        for reader in list(g.consumers):
            for k, v in enumerate(reader.inputs):
                if v is g:
                    graph.replace_input(reader, k, acc)
        del graph.values[g.name]
    span = graph.values[info.grads_span]
    for node in [n for n in graph.nodes if n.op_type == "ZeroFill" and n.phase == Phase.APPLY
                 and n.inputs[0] is span and len(n.inputs) == 1]:
        graph.remove_node(node)
    return True


def add_optimizer_state(graph: Graph, trainable: list[Value],
                        optimizer: Optimizer) -> dict[str, dict[str, Value]]:
    """The optimizer's state tensors per trainable parameter (``p.<state>``, OPT_STATE,
    initialised as the optimizer says), by parameter then state name."""
    states: dict[str, dict[str, Value]] = {}
    n = len(trainable)
    for k, state in enumerate(optimizer.state):
        init = optimizer.state_init(state)
        for i, p in enumerate(trainable):
            v = Value(f"{p.name}.{state}", p.shape, p.dtype, ir.STATE, mirror_of=p,
                      slot_order=k * n + i,
                      data=np.full(p.shape, init, p.dtype) if init else None)
            graph.values[v.name] = v
            states.setdefault(p.name, {})[state] = v
    return states


def add_spans(graph: Graph, trainable: list[Value], accumulators: dict[str, Value],
              states: dict[str, dict[str, Value]], optimizer: Optimizer) -> list[Value]:
    """The flat spans the update runs over: ``__params``, ``__grads`` and one per optimizer
    state (``__<state>``), each a view of its members' adjacent slots."""
    def span(name: str, kind: str, members: list[Value]) -> Value:
        v = Value(name, (0,), members[0].dtype, kind, span_of=members)
        graph.values[name] = v
        return v

    return [span(Reserved.PARAMS_SPAN, ir.PARAM, trainable),
            span(Reserved.GRADS_SPAN, ir.GRAD, [accumulators[p.name] for p in trainable]),
            *(span(f"__{state}", ir.STATE, [states[p.name][state] for p in trainable])
              for state in optimizer.state)]


def add_commit(b: GradBuilder, commits: list[tuple[Value, Value]], cfg: TrainConfig) -> None:
    """The ``commit`` phase: running statistics take the values the training-mode BatchNorms
    computed (only after a step whose loss and gradients were finite). Data parallel without
    ``sync_batchnorm``, a rank with no rows in this global batch (``HAS_ROWS`` false) keeps its
    own: statistics of no rows are NaN (synchronised ones are the world's rows')."""
    b.phase = Phase.COMMIT
    has_rows = None if cfg.sync_batchnorm else b.graph.values.get(Reserved.HAS_ROWS)
    for stat, new in commits:
        if has_rows is not None:
            new = b.op("Where", [has_rows, new, stat])
        b.op("Assign", [stat, new], domain=INTERNAL_DOMAIN, shapes=[])


def add_update(b: GradBuilder, spans: list[Value], scalars: dict[str, Value],
               cfg: TrainConfig) -> tuple[Value, Node]:
    """The ``apply`` phase: scale the accumulated gradients by 1/k and clip them, the
    optimizer's update over the spans, and GRAD zeroed. Returns the gradient norm and the
    update node (its optional inputs, skip and weight copy, are wired by the passes that
    need them)."""
    p_span, g_span, *s_spans = spans
    b.phase = Phase.APPLY
    grad_norm = b.op("ScaleClipGrad", [g_span, scalars[Reserved.GRAD_SCALE]],
                     {"max_norm": float(cfg.clip_grad_norm or 0.0)}, domain=INTERNAL_DOMAIN,
                     shapes=[((), np.float32)])
    if cfg.lr_groups or cfg.step_offsets:
        update = add_group_updates(b, spans, scalars, cfg)
    else:
        b.op(cfg.optimizer.op,
             [p_span, g_span, *s_spans, scalars[Reserved.LR], scalars[Reserved.STEP]],
             cfg.optimizer.attrs(), domain=INTERNAL_DOMAIN, shapes=[])
        update = b.graph.nodes[-1]
    b.op("ZeroFill", [g_span], domain=INTERNAL_DOMAIN, shapes=[])
    return grad_norm, update


def add_group_updates(b: GradBuilder, spans: list[Value], scalars: dict[str, Value],
                      cfg: TrainConfig) -> Node:
    """One optimizer update per update group (``update_group``), over its run of each span (a
    span of those members: adjacent slots, as ``select_trainable`` ordered them), with the
    learning rate times the group's multiplier and the step less the group's offset; returns
    the first."""
    updates = []
    for k, (mult, offset, start, stop) in enumerate(update_runs(spans[0].span_of, cfg)):
        parts = []
        for span in spans:
            part = Value(f"{span.name}/group{k}", (0,), span.dtype, span.kind,
                         span_of=span.span_of[start:stop])
            b.graph.values[part.name] = part
            parts.append(part)
        lr = scalars[Reserved.LR]
        lr = lr if mult == 1.0 else b.mul(lr, b.const(np.float32(mult)))
        step = scalars[Reserved.STEP] if offset == 0 else b.op(
            "Sub", [scalars[Reserved.STEP], b.const(np.int64(offset))])
        b.op(cfg.optimizer.op, [*parts, lr, step], cfg.optimizer.attrs(), domain=INTERNAL_DOMAIN,
             shapes=[])
        updates.append(b.graph.nodes[-1])
    return updates[0]


def set_optional_input(graph: Graph, node: Node, index: int, value: Value) -> None:
    """Declare optional input ``index`` of ``node`` (absent ones before it stay None)."""
    node.inputs += [None] * (index + 1 - len(node.inputs))
    graph.replace_input(node, index, value)


def update_skip_index(update: Node) -> int:
    """The ``skip`` input of an update op, after (params, grads, states..., lr, step); the
    ``weight_copy`` input follows it (``ops.optimizers.with_skip_and_copy``)."""
    return UPDATE_STATES[update.op_type] + 4


def set_step_outputs(graph: Graph, loss: Value, model_outputs: list[Value],
                     grad_norm: Value) -> None:
    """The forward nodes join the ``compute`` phase; the step's outputs are the loss, the
    model's outputs and the gradient norm."""
    for node in graph.nodes:
        if node.phase == Phase.FORWARD:
            node.phase = Phase.COMPUTE
    graph.outputs = [loss] + [v for v in model_outputs if v is not loss] + [grad_norm]


def add_step_guard(graph: Graph, info: TrainInfo, registry: OpRegistry,
                   backend: str, world: int | None = None) -> StepGuard:
    """The on-device step guard, so the cuda executor can run a training step as one CUDA
    graph and decide there whether the batch is kept (``CudaExecutor.run_step``): OPT_STATE
    tensors (``StepGuard``) and nodes in three phases the host never waits between --
    ``guard`` (StepCheck, after ``compute``: the bad-batch and reject flags), ``discard``
    (ZeroFill of GRAD when the batch was bad, after ``commit``) and ``report`` (StepReport,
    last) -- and flag inputs on the commits and the update, which skip themselves on a bad
    batch (with loss scaling the update already skips on its overflow flag, which StepCheck
    sets for a bad batch). StepAdvance counts applied steps after the update.

    ``world`` (data parallelism: the id ``distributed.register`` gave it): StepCheck makes a
    batch bad on every rank when it is on any (its ``world`` attribute), so the ranks drop the
    same micro-batches and count the same steps and bad steps: their collectives stay in step.
    """
    guard = StepGuard()
    f32 = np.dtype(np.float32)
    for name, shape, dtype in ((guard.bad_batch, (), f32), (guard.reject, (), f32),
                               (guard.applied, (), np.dtype(np.int64)),
                               (guard.report, (8,), f32)):
        graph.values[name] = Value(name, shape, dtype, ir.STATE, data=np.zeros(shape, dtype))
    v = graph.values
    bad, reject = v[guard.bad_batch], v[guard.reject]
    scaling = info.loss_scaling
    update = next(n for n in graph.nodes if n.name == info.update)
    for node in list(graph.nodes):
        if node.phase == Phase.COMMIT and node.op_type == "Assign":
            set_optional_input(graph, node, 2, bad)
    skip = v[scaling.found_inf] if scaling else bad  # what the update skips on
    if not scaling:
        set_optional_input(graph, update, update_skip_index(update), bad)

    def add(op_type: str, phase: str, inputs: list, attrs: dict | None = None) -> Node:
        node = internal_node(graph, registry, backend, op_type, f"{guard.bad_batch}/{op_type}",
                             inputs, [], attrs or {})
        node.phase = phase
        graph.append(node)
        return node

    check = [bad, reject, v[info.loss], v[info.step], v[guard.applied]]
    check += [None, v[scaling.found_inf]] if scaling else [v[info.grads_span]]
    add("StepCheck", Phase.GUARD, check, {"world": world} if world is not None else None)
    add("ZeroFill", Phase.DISCARD, [v[info.grads_span], bad])
    add("StepAdvance", Phase.APPLY, [v[guard.applied], skip])
    if scaling:
        scale_update = next(n for n in graph.nodes if n.op_type == "LossScaleUpdate")
        set_optional_input(graph, scale_update, 4, reject)
    add("StepReport", Phase.REPORT, [v[guard.report], v[info.loss], bad,
                                 v[scaling.found_inf] if scaling else None,
                                 v[info.grad_norm], reject])
    return guard

