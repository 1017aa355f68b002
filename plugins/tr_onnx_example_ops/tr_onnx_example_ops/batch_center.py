"""``com.example`` BatchCenter, version 1: an op that means one thing in inference and another
in training, declared in its OpDef alone (tr_onnx itself names it nowhere).

Inference: ``y = x - running_mean`` (``running_mean``, input 1, one value per feature of x's
last axis). Training: ``y = x - mean(x)`` over every axis but the last (the batch's mean), and
``running_mean`` moves to ``momentum * running_mean + (1 - momentum) * mean(x)`` after each
good step (attribute ``momentum``, default 0.9) -- BatchNorm's running statistic without the
scaling. The training form rewrites the node into ``BatchCenterTraining`` (same domain) and
commits the new running mean; the export rule writes a standard ``Sub``, so any ONNX runtime
runs the trained model; the value bound proves it finite in inference plans; the running mean
stays float32 in half-precision training.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from tr_onnx.plugin import PLAIN_ONLY, OpDef, TrainingContext

DOMAIN = "com.example"
MOMENTUM = 0.9  # the default of attribute momentum


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])  # PLAIN_ONLY: a compact view, never a copy


def batch_center_numpy(ctx):
    def run(ins, outs, ws):
        np.subtract(ins[0], ins[1], out=outs[0])

    return run


def batch_center_training_numpy(ctx):
    momentum = float(ctx.attrs["momentum"])
    mean_ws, kept_ws = (ctx.workspace(ctx.inputs[1].shape, np.float64) for _ in range(2))

    def run(ins, outs, ws):
        mean, kept = ws[mean_ws], ws[kept_ws]
        np.mean(_rows(ins[0]), axis=0, dtype=np.float64, out=mean)
        np.subtract(ins[0], mean, out=outs[0], casting="same_kind")
        np.multiply(ins[1], momentum, out=kept)
        np.multiply(mean, 1.0 - momentum, out=mean)
        np.add(kept, mean, out=kept)
        np.copyto(outs[1], kept, casting="same_kind")

    return run


def batch_center_shape(node, shapes, dtypes):
    return [(shapes[0], dtypes[0])]


def batch_center_training_shape(node, shapes, dtypes):
    return [(shapes[0], dtypes[0]), (shapes[1], dtypes[1])]


def batch_center_vjp(b, node, gys, needed):
    """Inference form: the running mean is fixed, gx = gy."""
    return [gys[0], None]


def batch_center_training_vjp(b, node, gys, needed):
    """gx = gy - mean(gy) over the batch axes (the mean's own gradient); none through the new
    running mean."""
    gy = gys[0]
    if gy is None:
        return [None, None]
    axes = list(range(len(gy.shape) - 1))
    return [b.sub(gy, b.op("ReduceMean", [gy], {"axes": axes, "keepdims": 1})), None]


def batch_center_training_form(node, ctx: TrainingContext) -> bool:
    """The batch's mean instead of the running one, and the running mean committed."""
    x, running_mean = node.inputs[:2]
    new_mean = ctx.new_value(f"{node.name}/new_running_mean", running_mean.shape,
                             running_mean.dtype)
    new = ctx.make_node("BatchCenterTraining", node.name, [x, running_mean],
                        [node.outputs[0], new_mean], {"momentum": float(node.attrs["momentum"])},
                        domain=DOMAIN, since_version=1)
    ctx.graph.replace_node(node, new)
    ctx.commit(running_mean, new_mean)
    return True


def batch_center_export(node, graph, used) -> None:
    """Written back as the standard op it is in inference: ``Sub(x, running_mean)``."""
    node.CopyFrom(helper.make_node("Sub", list(node.input[:2]), list(node.output[:1]),
                                   name=node.name))


def batch_center_value_bound(node, bound, stats) -> float | None:
    """|x - m| <= |x| + max |m| for a constant running mean m."""
    x, m = bound(node.inputs[0]), stats.max_abs(node.inputs[1])
    return None if x is None or m is None else x + m


OPDEFS = [
    OpDef("BatchCenter", (1,), {"numpy": batch_center_numpy}, domain=DOMAIN,
          layout=PLAIN_ONLY, shape=batch_center_shape, differentiable=True,
          gradient=batch_center_vjp, grad_inputs=(0,), param_inputs=(),
          attr_defaults={"momentum": MOMENTUM}, training=batch_center_training_form,
          export=batch_center_export, value_bounds=batch_center_value_bound,
          doc="y = x - running_mean; in training x's batch mean, running_mean updated"),
    OpDef("BatchCenterTraining", (1,), {"numpy": batch_center_training_numpy}, domain=DOMAIN,
          layout=PLAIN_ONLY, shape=batch_center_training_shape, differentiable=True,
          gradient=batch_center_training_vjp, grad_inputs=(0,), fp32_inputs=(1,),
          fp32_outputs=(1,), doc="(x, running_mean) -> (x - batch mean, new running_mean)"),
]
