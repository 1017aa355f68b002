"""Dropout: the ONNX op outside the training session (inference: y = x; a seeded training-mode
node: a fixed mask, as onnx.reference draws it) and the training session's
``ai.tr_onnx.DropoutTraining``, whose counter-based mask a resumed run redraws bitwise. Both
gradient rules mask gy with the forward's mask; the node builders are ops/elementwise.py's.
Dropout's OpDef carries its training form (a DropoutTraining per node with a ratio), its eval
form and its export rule (training_mode off).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import numpy_helper

from .. import ir
from ..domains import INTERNAL_DOMAIN
from ..dtypes import onnx_elem_type
from ..hookspecs import hookimpl
from ..ir import Value
from ..opdef import OpDef, TrainingContext
from .elementwise import _identity_vjp, masked, scaled


def dropout_drop_ratio(since_version: int, ratio, training) -> float:
    """The ratio a Dropout node drops at outside the training session: 0 unless its
    ``training_mode`` input (opset 12 on; a plan-time constant) is true, then its ``ratio``
    input (default 0.5)."""
    if since_version < 12 or training is None or not bool(np.asarray(training).reshape(())):
        return 0.0
    return 0.5 if ratio is None else float(np.asarray(ratio).reshape(()))


def check_inference_dropout(ctx) -> None:
    """Inference Dropout only: training mode with a ratio of 0 drops nothing, so it is the
    same; any other training mode is an error naming the node (every backend's kernel factory
    calls this; the numpy kernel first runs a seeded one, ``seeded_dropout_mask``)."""
    if dropout_drop_ratio(ctx.since_version, ctx.const(1), ctx.const(2)):
        raise ctx.error("training-mode Dropout needs the training session")


def seeded_dropout_mask(seed: int, shape, ratio: float) -> np.ndarray:
    """The keep mask of a training-mode Dropout with a ``seed`` attribute run outside the
    training session: u >= ratio for the uniforms of NumPy's ``RandomState(seed)`` in the
    logical C order of x, drawn afresh for each run -- onnx.reference's definition (and the
    node suite's), so every run keeps the same elements. The training session draws its own
    masks instead (``DropoutTraining``)."""
    return np.random.RandomState(seed).random_sample(tuple(shape)) >= ratio


def dropout_numpy(ctx):
    """Inference Dropout: y = x, the optional mask all ones (True)
    (``check_inference_dropout``); a seeded training-mode one: y = x * mask / (1 - ratio)
    with the mask of ``seeded_dropout_mask``, a plan-time constant."""
    with_mask = ctx.has_output(1)
    ratio = dropout_drop_ratio(ctx.since_version, ctx.const(1), ctx.const(2))
    if ratio and ctx.attrs.get("seed") is not None:
        if not 0.0 <= ratio < 1.0:
            raise ctx.error(f"ratio {ratio} is not in [0, 1)")
        keep = seeded_dropout_mask(int(ctx.attrs["seed"]), ctx.inputs[0].shape, ratio)
        scale = ctx.inputs[0].dtype.type(dropout_scale(ratio))

        def run_training(ins, outs, ws):
            np.multiply(ins[0], keep, out=outs[0])
            outs[0] *= scale
            if with_mask:
                np.copyto(outs[1], keep)

        return run_training
    check_inference_dropout(ctx)

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])
        if with_mask:
            outs[1].fill(1)

    return run


def _dropout_vjp(b, node, gys, needed):
    """Inference Dropout passes gy through; a seeded training-mode one (run outside the
    training session, ``dropout_numpy``) gy * mask / (1 - ratio) with its constant mask."""
    def data(i):
        v = node.inputs[i] if i < len(node.inputs) else None
        return None if v is None else v.data

    ratio = dropout_drop_ratio(node.since_version, data(1), data(2))
    if not ratio or node.attrs.get("seed") is None or gys[0] is None or not needed[0]:
        return _identity_vjp(b, node, gys, needed)
    x = node.inputs[0]
    keep = b.const(seeded_dropout_mask(int(node.attrs["seed"]), x.shape, ratio))
    gx = masked(b, keep, scaled(b, gys[0], dropout_scale(ratio)))
    return [gx] + [None] * (len(node.inputs) - 1)


def _dropout_shape(node, shapes, dtypes):
    """What ONNX inference leaves untyped: opset 7-9's mask output, of x's shape and type
    (from opset 10 a bool, which inference types)."""
    return [(shapes[0], dtypes[0])] * len(node.output)


# ---- training-mode dropout -------------------------------------------------------------------

def dropout_training_numpy(ctx):
    """``ai.tr_onnx.DropoutTraining(x, step[, rows_before]) -> (y, mask)``: mask = u >= ratio
    for uniforms u drawn from Philox(key=seed) jumped ``step`` times, y = x * mask / (1 -
    ratio). The stream is counter-based: the mask of a step depends only on (seed, step), so a
    run resumed from a checkpoint redraws it bitwise. The uniforms are float64 in the logical C
    order of x's shape whatever x's dtype and layout, so the mask does not depend on either.

    ``rows_before`` (int64 scalar, data parallelism): x is this rank's rows of a batch-major
    tensor with that many rows of the global batch before them; the stream is skipped past
    their uniforms (one 64-bit draw each, four per Philox counter), so the mask is the one a
    single process with the global batch draws for these rows, and no two ranks' overlap."""
    missing = [k for k in ("ratio", "seed") if k not in ctx.attrs]
    if missing:
        raise ctx.error(f"DropoutTraining needs the attributes {missing} (internal ops have "
                        f"no defaults)")
    ratio = float(ctx.attrs["ratio"])
    if not 0.0 <= ratio <= 1.0:
        raise ctx.error(f"ratio {ratio} is not in [0, 1]")
    scale = ctx.inputs[0].dtype.type(dropout_scale(ratio))
    if ratio == 0.0:
        def run(ins, outs, ws):
            np.copyto(outs[0], ins[0])
            outs[1].fill(True)

        return run
    k = ctx.workspace(ctx.inputs[0].shape, np.float64)
    shape = ctx.inputs[0].shape
    per_row = math.prod(shape[1:]) if ctx.has_input(2) else 0
    skipped = ctx.workspace((3,), np.float64) if per_row else None
    stream = np.random.Philox(key=int(ctx.attrs["seed"]) % 2**64)  # a negative seed wraps

    def run(ins, outs, ws):
        x, step = ins[:2]
        u, (y, mask) = ws[k], outs
        # jumped() leaves ``stream`` as it is; the small Generator/Philox pair it makes per
        # step is an unavoidable temporary (the stream position changes every step)
        bits = stream.jumped(int(step.reshape(())))
        rng = np.random.Generator(bits)
        if per_row:
            before = int(ins[2].reshape(())) * per_row
            bits.advance(before // 4)
            rng.random(out=ws[skipped][:before % 4])
        rng.random(out=u.reshape(-1))
        np.greater_equal(u, ratio, out=mask)
        np.multiply(x, mask, out=y)
        y *= scale

    return run


def dropout_scale(ratio: float) -> float:
    """1 / (1 - ratio), 0 when everything is dropped."""
    return 0.0 if ratio >= 1.0 else 1.0 / (1.0 - ratio)


def _dropout_training_shape(node, shapes, dtypes):
    return [(shapes[0], dtypes[0]), (shapes[0], np.dtype(np.bool_))]


def _dropout_training_vjp(b, node, gys, needed):
    """gx = gy * mask / (1 - ratio); the step counter gets nothing."""
    gy, mask = gys[0], node.outputs[1]
    rest = [None] * (len(node.inputs) - 1)
    if gy is None or not needed[0]:
        return [None, *rest]
    return [masked(b, mask, scaled(b, gy, dropout_scale(float(node.attrs["ratio"])))), *rest]


# ----------------------------------------------- training form, eval form, export


def dropout_training_form(node, ctx: TrainingContext) -> bool:
    """A Dropout with a ratio draws its mask each step (``ai.tr_onnx.DropoutTraining``, keyed
    by ``ctx.seed`` and counted by the step counter)."""
    graph = ctx.graph
    ratio = node.attrs.get("ratio", 0.5) if node.since_version < 12 else (
        float(np.asarray(node.inputs[1].data)) if len(node.inputs) > 1
        and node.inputs[1] is not None else 0.5)
    if ratio == 0.0:
        return False
    y = node.outputs[0]
    old_mask = node.outputs[1] if len(node.outputs) > 1 else None
    mask = old_mask if old_mask is not None and old_mask.dtype == np.bool_ else None
    if mask is None:
        mask = Value(graph.unique_name(f"{node.name}/mask"), y.shape, np.dtype(np.bool_))
        graph.values[mask.name] = mask
    offset = ctx.sample_offset(node.inputs[0])
    inputs = [node.inputs[0], ctx.step_counter] + ([offset] if offset is not None else [])
    new = ctx.make_node("DropoutTraining", node.name, inputs, [y, mask],
                        {"ratio": float(ratio), "seed": ctx.seed})
    graph.replace_node(node, new)
    if old_mask is not None and old_mask is not mask:
        _legacy_mask(ctx, new, old_mask)
    return True


def _legacy_mask(ctx: TrainingContext, dropout, old_mask) -> None:
    """Opset 7-9 Dropout gave its mask in x's type: where something reads it, a Cast of the
    training mask makes it; otherwise it goes."""
    graph = ctx.graph
    if not old_mask.consumers and old_mask not in graph.outputs:
        del graph.values[old_mask.name]
        old_mask.producer = None
        return
    cast = ctx.make_node("Cast", graph.unique_name(f"{dropout.name}/mask_cast"),
                         [dropout.outputs[1]], [old_mask], {"to": onnx_elem_type(old_mask.dtype)},
                         domain="", since_version=13)
    graph.insert(graph.nodes.index(dropout) + 1, cast)


def dropout_inference_form(node, graph) -> bool:
    """A training_mode input (opset 12+) becomes a constant False."""
    if node.since_version < 12 or len(node.inputs) <= 2 or node.inputs[2] is None:
        return False
    off = Value(graph.unique_name(f"{node.name}/eval"), (), np.dtype(np.bool_), ir.CONST,
                data=np.array(False))
    graph.values[off.name] = off
    graph.replace_input(node, 2, off)
    return True


def dropout_export(node, g, used) -> None:
    """A training_mode input (opset 12+) becomes a constant False initializer."""
    if len(node.input) > 2 and node.input[2]:
        name = f"{node.name or node.output[0]}/eval_mode"
        g.initializer.append(numpy_helper.from_array(np.array(False), name))
        node.input[2] = name


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Dropout", (1, 6, 7, 10, 12, 13, 22), {"numpy": dropout_numpy},
              const_inputs=(1, 2), differentiable=True, gradient=_dropout_vjp,
              grad_inputs=(0,), forwards_params=True, shape=_dropout_shape,
              training=dropout_training_form, inference=dropout_inference_form,
              export=dropout_export),
        OpDef("DropoutTraining", (1,), {"numpy": dropout_training_numpy},
              domain=INTERNAL_DOMAIN,
              shape=_dropout_training_shape, differentiable=True,
              gradient=_dropout_training_vjp, grad_inputs=(0,),
              doc="Training-mode dropout with a counter-based mask: inputs (x, step: int64 "
                  "scalar[, rows_before: int64 scalar, the global batch's rows before x's]), "
                  "attributes ratio (float), seed (int); outputs (y, mask: bool)."),
    ]
