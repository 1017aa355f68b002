"""Collectives inside a training step (data parallelism, ``tr_onnx.distributed``).

``GradAllReduce`` averages a span of the GRAD region over the ranks in place, as PyTorch DDP
averages gradients, in the ``reduce`` phase: after the micro-batches accumulated, before the
host's finiteness check and the update, and only on steps that apply. A rank whose loss is not
finite fills its gradients with NaN first, so after the reduction every rank sees the same
non-finite gradient and skips the same step, with no second collective.

``BroadcastStats`` overwrites BatchNorm running statistics with rank 0's at the start of a
step, as DDP's ``broadcast_buffers`` does before each forward (without ``sync_batchnorm`` each
rank's statistics otherwise drift apart with its own shard).

Their nodes carry the world as the attribute ``world``: the id ``distributed.register`` gave
it (a node attribute can only be a number or a string, and a kernel is bound from its node).
"""

from __future__ import annotations

import numpy as np

from ..distributed import lookup
from ..hookspecs import hookimpl
from ..opdef import LayoutRule, OpDef

INTERNAL = "ai.tr_onnx"
IN_PLACE = LayoutRule(outputs="plain")


def grad_all_reduce_numpy(ctx):
    """GradAllReduce(grads, loss): grads = mean over ranks of grads (MPI Allreduce in place on
    the arena's view, then a divide by the world size); NaN first where this rank's loss is
    not finite."""
    world = lookup(int(ctx.attrs["world"]))
    has_loss = ctx.has_input(1)

    def run(ins, outs, ws):
        g = ins[0]
        if has_loss and not np.isfinite(ins[1]).all():
            g.fill(np.nan)
        world.allreduce_mean_(g)

    return run


def broadcast_stats_numpy(ctx):
    """BroadcastStats(stat...): every input overwritten with rank 0's, in place, through one
    float64 workspace (one message for all of them; float32 round-trips exactly)."""
    world = lookup(int(ctx.attrs["world"]))
    sizes = [int(np.prod(v.shape, dtype=np.int64)) for v in ctx.inputs]
    bounds = np.cumsum([0] + sizes)
    buf_ws = ctx.workspace((int(bounds[-1]),), np.float64)

    def run(ins, outs, ws):
        buf = ws[buf_ws]
        for x, lo, hi in zip(ins, bounds, bounds[1:]):
            np.copyto(buf[lo:hi], x.reshape(-1))
        world.bcast_(buf, root=0)
        for x, lo, hi in zip(ins, bounds, bounds[1:]):
            np.copyto(x, buf[lo:hi].reshape(x.shape), casting="same_kind")

    return run


@hookimpl
def tr_onnx_op_definitions():
    internal = dict(domain=INTERNAL, layout=IN_PLACE, differentiable=False)
    return [
        OpDef("GradAllReduce", (1,), {"numpy": grad_all_reduce_numpy}, updates_inputs=(0,),
              doc="(grads, loss) -> (): grads averaged over the ranks in place (NaN where "
                  "this rank's loss is not finite)", **internal),
        OpDef("BroadcastStats", (1,), {"numpy": broadcast_stats_numpy}, updates_inputs=(0,),
              doc="(stat...) -> (): every input overwritten with rank 0's", **internal),
    ]
