"""Collectives inside a training step (data parallelism, ``tr_onnx.distributed``).

``GradAllReduceStart`` starts summing one bucket of the GRAD region over the ranks in place
(in the backward pass, right after the bucket's last gradient is accumulated; only on steps
that apply), ``GradAllReduceWait`` completes them all and divides by the world size in the
``reduce`` phase -- the mean over the ranks of gradients each weighted by its rank's rows
(``train_pass.ROW_WEIGHT`` seeds the backward pass), so the mean over the global batch's
rows; PyTorch DDP averages unweighted -- before the host's
finiteness check and the update (``training.data_parallel`` places them). A rank whose loss
is not finite fills its buckets with NaN first, so after the reduction every rank sees the
same non-finite gradient and skips the same step, with no second collective.

``BroadcastStats`` overwrites BatchNorm running statistics with rank 0's at the start of a
step, as DDP's ``broadcast_buffers`` does before each forward (without ``sync_batchnorm`` each
rank's statistics otherwise drift apart with its own shard).

Their nodes carry the world as the attribute ``world``: the id ``distributed.register`` gave
it (a node attribute can only be a number or a string, and a kernel is bound from its node).
"""

from __future__ import annotations

import numpy as np

from ..distributed import lookup
from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import LayoutRule, OpDef

IN_PLACE = LayoutRule(outputs="plain")


def grad_all_reduce_start_numpy(ctx):
    """GradAllReduceStart(bucket, loss, reduce): when ``reduce`` (a float32 scalar the host
    writes) is set, start summing the bucket (a span of GRAD) over the ranks in place (MPI
    Iallreduce on the arena's view, no copy), after filling it with NaN where this rank's loss
    is not finite."""
    world = lookup(int(ctx.attrs["world"]))

    def run(ins, outs, ws):
        g, loss, flag = ins
        if flag.reshape(()).item() == 0.0:
            return
        if not np.isfinite(loss).all():
            g.fill(np.nan)
        world.start_allreduce_sum_(g)

    return run


def grad_all_reduce_wait_numpy(ctx):
    """GradAllReduceWait(grads): complete the buckets' sums (each within the world's
    deadline), then divide the GRAD span by the world size: the ranks' mean."""
    world = lookup(int(ctx.attrs["world"]))

    def run(ins, outs, ws):
        world.wait_started()
        np.divide(ins[0], world.size, out=ins[0])

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
    internal = dict(domain=INTERNAL_DOMAIN, layout=IN_PLACE, differentiable=False)
    return [
        # half precision: a bucket of the half GRAD, the float32 loss that decides whether
        # it is poisoned, the float32 reduce flag
        OpDef("GradAllReduceStart", (1,), {"numpy": grad_all_reduce_start_numpy},
              updates_inputs=(0,), fp32_inputs=(1, 2), doc="(bucket, loss, reduce) -> (): "
              "when reduce, start the bucket's sum over the ranks in place (NaN where this "
              "rank's loss is not finite)", **internal),
        OpDef("GradAllReduceWait", (1,), {"numpy": grad_all_reduce_wait_numpy},
              updates_inputs=(0,), doc="(grads) -> (): complete the started sums, then "
              "grads /= world size", **internal),
        # rank 0's running statistics, float32 in PARAM (half precision too)
        OpDef("BroadcastStats", (1,), {"numpy": broadcast_stats_numpy}, updates_inputs=(0,),
              fp32_inputs="all",
              doc="(stat...) -> (): every input overwritten with rank 0's", **internal),
    ]
