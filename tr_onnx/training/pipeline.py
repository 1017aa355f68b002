"""The training pipeline in one place: what turns a dispatched inference graph into the graph
of one training step, in the order it runs.

``compile_plan`` specialises the model to the batch's shapes and dispatches it, then calls
``build_training_step`` as its ``transform``; layout, kernels, the MemoryPlan and the
executor follow (``tr_onnx.compiler``). The steps themselves live in ``train_pass``
(training semantics, labels, loss, backward pass, optimizer) and ``precision`` (half storage,
loss scaling); this module only orders them.
"""

from __future__ import annotations

from ..distributed import lookup
from ..ir import Graph
from ..passes.autodiff import GradBuilder
from ..registry import OpRegistry
from .data_parallel import add_grad_reduce
from .parameters import share_parameters
from .precision import PRECISIONS, add_loss_scaling, to_half_precision
from .reserved import Reserved, check_no_reserved_names
from .train_pass import (
    TrainConfig,
    TrainInfo,
    add_backward,
    add_commit,
    add_grad_accumulators,
    add_labels,
    add_loss,
    add_optimizer_state,
    add_rank_loss,
    add_spans,
    add_step_guard,
    add_step_scalars,
    add_update,
    fold_accumulators,
    select_trainable,
    set_step_outputs,
    to_training_mode,
)


def build_training_step(graph: Graph, registry: OpRegistry, backend: str,
                        cfg: TrainConfig) -> TrainInfo:
    """Mutate ``graph`` (specialised and dispatched for ``backend``'s kernels, as
    ``compile_plan`` hands it to its ``transform``) into one training step as ``cfg`` says;
    returns the value names the session drives the step by (``TrainInfo``).

    The body is the pipeline, one statement per step, in the order the graph goes through
    them: untie or tie shared parameters (``training.parameters``), per-step scalars,
    train-mode BatchNorm/Dropout, labels, loss, the trainable parameters, the backward pass,
    GRAD accumulators, optimizer state and the spans over them, their all-reduce across ranks
    (data parallelism), the running statistics'
    commit, the update (scale/clip, optimizer, zero GRAD), the step's outputs; then, where
    ``cfg`` asks for them, half precision, loss scaling and the cuda step guard; last, with one
    micro-batch per step, gradients written straight into GRAD (``fold_accumulators``).
    """
    check_no_reserved_names(graph)
    model_outputs = list(graph.outputs)
    untied = share_parameters(graph, cfg.sharing, registry, backend)
    scalars = add_step_scalars(graph)
    commits, converted = to_training_mode(graph, registry, backend, cfg, scalars[Reserved.RNG])
    output, labels = add_labels(graph, cfg, model_outputs)
    b = GradBuilder(graph, registry, backend, prefix="loss")  # loss and update nodes
    loss = add_loss(b, cfg, output, labels)
    rank_loss = add_rank_loss(b, cfg, loss)
    trainable = select_trainable(graph, loss, cfg)
    grads = add_backward(graph, loss, trainable, registry, backend, cfg)
    accumulators = add_grad_accumulators(b, trainable, grads)
    states = add_optimizer_state(graph, trainable, cfg.optimizer)
    spans = add_spans(graph, trainable, accumulators, states, cfg.optimizer)
    add_grad_reduce(b, list(accumulators.values()), spans[1], rank_loss, commits, cfg)
    add_commit(b, commits, cfg)
    grad_norm, update = add_update(b, spans, scalars, cfg)
    set_step_outputs(graph, rank_loss, model_outputs, grad_norm)
    info = TrainInfo(
        loss=rank_loss.name, outputs=[v.name for v in model_outputs],
        trainable=[p.name for p in trainable],
        grads={p: a.name for p, a in accumulators.items()},
        states={p: {k: v.name for k, v in s.items()} for p, s in states.items()},
        running_stats=[stat.name for stat, _ in commits], untied=untied,
        grad_norm=grad_norm.name, converted=converted, update=update.name,
        world=lookup(cfg.world) if cfg.world is not None else None)
    if cfg.precision != "fp32":
        info.weight_copy = to_half_precision(
            graph, info, PRECISIONS[cfg.precision], registry=registry, backend=backend,
            data_inputs=cfg.data_inputs, output=cfg.output_name)
    if cfg.loss_scale:
        info.loss_scaling = add_loss_scaling(graph, info, cfg.loss_scale, registry, backend,
                                             guarded=cfg.step_guard)
    if cfg.step_guard:  # the step runs as one cuda graph, guarded on the device
        info.step_guard = add_step_guard(graph, info, registry, backend, world=cfg.world)
    info.grads_overwritten = fold_accumulators(graph, info, cfg, registry, backend)
    return info
