"""Data parallelism in the training step: the gradient all-reduce, in buckets, and the
running statistics every rank takes from rank 0 (``tr_onnx.distributed``, ``ops.collective``).

The GRAD region is cut into buckets of adjacent gradient slots of about
``TrainConfig.grad_bucket_bytes`` each, taken from the last parameters back (the backward pass
finishes those first), as PyTorch DDP's ``bucket_cap_mb``. Each accumulator's Accumulate node
moves up to just after the node that produced its gradient, and each bucket's
``GradAllReduceStart`` goes right after the last Accumulate writing into it: a late layer's
reduction is under way while the early layers' backward runs (as far as the MPI library
progresses on its own; ``GradAllReduceWait`` completes them all in the ``reduce`` phase, before
the host's finiteness check and the update). The starts act only on steps that apply (the
``REDUCE`` scalar the session writes), so accumulated micro-batches stay local.
"""

from __future__ import annotations

import numpy as np

from .. import ir
from ..domains import INTERNAL_DOMAIN
from ..ir import Phase, Value
from ..passes.autodiff import GradBuilder
from .reserved import Reserved
from .train_pass import TrainConfig, internal_node


def gradient_buckets(accumulators: list[Value], cap_bytes: int) -> list[list[Value]]:
    """``accumulators`` (in slot order) cut into runs of adjacent slots of at least
    ``cap_bytes`` each (the first run may be smaller), filled from the last one back."""
    buckets, current, size = [], [], 0
    for acc in reversed(accumulators):
        current.insert(0, acc)
        size += int(np.prod(acc.shape, dtype=np.int64)) * acc.dtype.itemsize
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def add_grad_reduce(b: GradBuilder, accumulators: list[Value], grads_span: Value, loss: Value,
                    commits: list[tuple[Value, Value]], cfg: TrainConfig) -> None:
    """With ``cfg.world``: the bucketed gradient all-reduce (its starts in the backward pass,
    its completion and the divide by the world size in the ``reduce`` phase; a rank whose loss
    is not finite sends NaN, so every rank skips the step) and, unless BatchNorm is
    synchronised, rank 0's running statistics broadcast at the start of every step, before any
    BatchNorm reads them (DDP's ``broadcast_buffers``)."""
    if cfg.world is None:
        return
    graph = b.graph
    flag = Value(Reserved.REDUCE, (), np.dtype(np.float32), ir.INPUT)
    graph.values[flag.name] = flag
    graph.inputs.append(flag)
    attrs = {"world": cfg.world}
    writers, names = {}, {a.name for a in accumulators}
    for node in list(graph.nodes):
        if node.op_type == "Accumulate" and node.domain == INTERNAL_DOMAIN \
                and node.inputs[0].name in names:
            gradient = node.inputs[1].producer
            if gradient is not None:  # final once its producer ran: the fan-in sum is before
                graph.remove_node(node)
                graph.insert(graph.nodes.index(gradient) + 1, node)
            writers[node.inputs[0].name] = node
    for k, bucket in enumerate(gradient_buckets(accumulators, cfg.grad_bucket_bytes)):
        span = Value(f"{grads_span.name}/bucket{k}", (0,), bucket[0].dtype, ir.GRAD,
                     span_of=bucket)
        graph.values[span.name] = span
        after = max(graph.nodes.index(writers[a.name]) for a in bucket)
        start = internal_node(graph, b.registry, b.backend, "GradAllReduceStart",
                              graph.unique_name(f"{span.name}/start"), [span, loss, flag], [],
                              attrs)
        start.phase = Phase.COMPUTE
        graph.insert(after + 1, start)
    b.phase = Phase.REDUCE
    b.op("GradAllReduceWait", [grads_span], attrs, domain=INTERNAL_DOMAIN, shapes=[])
    stats = [stat for stat, _ in commits]
    if stats and not cfg.sync_batchnorm:
        b.phase = Phase.COMPUTE
        b.op("BroadcastStats", stats, attrs, domain=INTERNAL_DOMAIN, shapes=[])
        node = graph.nodes[-1]
        graph.remove_node(node)
        graph.insert(0, node)
