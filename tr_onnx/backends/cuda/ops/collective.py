"""cuda bindings of ``ops/collective.py``: the gradient all-reduce as one NCCL all-reduce
(ncclAvg) of the GRAD span, in place, on the step's stream (``nccl.NcclAllReduce``), so the
step's CUDA graph captures it, in its ``reduce`` phase, and the step guard (phase ``guard``,
after it) reads the averaged gradients: a non-finite gradient on any rank makes every rank's
average non-finite, so every rank drops the step and the loss scale stays identical across
ranks.

``GradAllReduceStart`` (one per bucket, in the backward pass) only fills its bucket with NaN
where this rank's loss is not finite (``tr_poison_nonfinite_<dt>``, ``kernels/amp.cu``), as the
NumPy kernel does before it sends; ``GradAllReduceWait`` reduces the whole span at once. One
stream runs the step's kernels in order, so a bucket's reduction started amid the backward
pass would not overlap it there; a reduction on a second stream, forked and joined with events
in the captured graph, would. The reduce phase runs only in steps that apply
(``CudaExecutor.step_phases``), which is what the NumPy starts read from their ``reduce``
flag. A poisoned bucket in a step that does not apply is dropped with the batch by the guard,
whose loss check already marks it bad.

``BroadcastStats`` (the first node of a step, when BatchNorm is not synchronised) is one NCCL
broadcast of rank 0's values per running statistic, in place (DDP's ``broadcast_buffers``).

The nodes carry the id of their ``distributed.World`` (``distributed.register``); the world's
NCCL communicator is made when the first plan is bound (``nccl.communicator``: rank 0's unique
id broadcast through the world), on the device the plan runs on.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....errors import DistributedError
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import BindContext, Unbound, binding, i64
from ..nccl import NCCL_AVG, NcclBroadcast, nccl_dtype, node_all_reduce, node_communicator


def _span(b: BindContext, g) -> tuple[int, int]:
    """(elements, ncclDataType_t) of the tensor ``g`` (a GRAD span, a running statistic), pad
    lanes included (zero on every rank, so their sum stays zero)."""
    t = b.t(g)
    try:
        dtype = nccl_dtype(t.dtype)
    except DistributedError as e:
        raise Unbound(str(e)) from None
    count = t.nbytes // t.dtype.itemsize
    if count < math.prod(t.shape):
        raise Unbound(f"{g.name!r} spans fewer elements than its shape")
    return count, dtype


def bind_grad_all_reduce_start(b: BindContext, node) -> list:
    """GradAllReduceStart(bucket, loss, reduce): NaN into the bucket where ``loss`` is not
    finite (the reduction itself is GradAllReduceWait's)."""
    g, loss = node.inputs[0], node.inputs[1]
    count, _ = _span(b, g)
    if b.t(loss).dtype != np.float32 or math.prod(b.t(loss).shape) != 1:
        raise Unbound(f"the loss {loss.name!r} must be a float32 scalar")
    return [b.launch(f"tr_poison_nonfinite_{b.dt(g)}", count,
                     [b.buf(g, writes=True), i64(count), b.buf(loss)])]


def bind_grad_all_reduce_wait(b: BindContext, node) -> list:
    """GradAllReduceWait(grads): the mean over the world's ranks of the whole GRAD span, in
    place, as one NCCL all-reduce on the step's stream."""
    g = node.inputs[0]
    count, dtype = _span(b, g)
    return [node_all_reduce(b, node, b.buf(g, writes=True), count, dtype, NCCL_AVG)]


def bind_broadcast_stats(b: BindContext, node) -> list:
    """BroadcastStats(stat...): rank 0's running statistics into every rank's, in place, one
    NCCL broadcast per tensor (``nccl.NcclBroadcast``, under the ``broadcast`` write policy:
    PARAM, at the start of the step)."""
    _, comm = node_communicator(b, node)
    calls = []
    for v in node.inputs:
        count, dtype = _span(b, v)
        calls.append(NcclBroadcast(comm, b.buf(v, writes=True), count, dtype, root=0))
    return calls


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef(op, "cuda", binding(fn), domain=INTERNAL_DOMAIN) for op, fn in (
        ("GradAllReduceStart", bind_grad_all_reduce_start),
        ("GradAllReduceWait", bind_grad_all_reduce_wait),
        ("BroadcastStats", bind_broadcast_stats))]
