"""cuda bindings of ``ops/collective.py``: GradAllReduce as one NCCL all-reduce (ncclAvg) of
its gradient span, in place, on the step's stream (``nccl.NcclAllReduce``), so the step's CUDA
graph captures it in its ``reduce`` phase, and the step guard (phase ``guard``, after it)
reads the averaged gradients: a non-finite gradient on any rank makes every rank's average
non-finite, so every rank drops the step and the loss scale stays identical across ranks. A
rank whose loss is not finite fills its gradients with NaN first
(``tr_poison_nonfinite_<dt>``, ``kernels/amp.cu``), as the NumPy kernel does.

The node carries the id of its ``distributed.World`` (``distributed.register``); the world's
NCCL communicator is made when the first plan is bound (``nccl.communicator``: rank 0's unique
id broadcast through the world), on the device the plan runs on.
"""

from __future__ import annotations

import math

import numpy as np

from ....distributed import lookup
from ....errors import DistributedError
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import INTERNAL, BindContext, Unbound, binding, i64
from ..nccl import NCCL_AVG, NcclAllReduce, communicator, nccl_dtype


def bind_grad_all_reduce(b: BindContext, node) -> list:
    """GradAllReduce(grads[, loss]): NaN into grads where ``loss`` is not finite, then the mean
    over the world's ranks, in place, of every element of the span (pad lanes included: they
    are zero on every rank)."""
    g = node.inputs[0]
    loss = node.inputs[1] if len(node.inputs) > 1 else None
    t = b.t(g)
    try:
        dtype = nccl_dtype(t.dtype)
    except DistributedError as e:
        raise Unbound(str(e)) from None
    count = t.nbytes // t.dtype.itemsize
    if count < math.prod(t.shape):
        raise Unbound(f"{g.name!r} spans fewer elements than its shape")
    calls = []
    if loss is not None:
        if b.t(loss).dtype != np.float32 or math.prod(b.t(loss).shape) != 1:
            raise Unbound(f"the loss {loss.name!r} must be a float32 scalar")
        calls.append(b.launch(f"tr_poison_nonfinite_{b.dt(g)}", count,
                              [b.buf(g, writes=True), i64(count), b.buf(loss)]))
    world = lookup(int(node.attrs["world"]))
    comm = communicator(world, getattr(b.device, "device_id", 0))
    return calls + [NcclAllReduce(comm, b.buf(g, writes=True), count, dtype, NCCL_AVG,
                                  world.rank, world.size)]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("GradAllReduce", "cuda", binding(bind_grad_all_reduce), domain=INTERNAL)]
