"""cuda bindings of ``ops/conv.py``: Conv and its backward ops ConvGradData / ConvGradFilter,
and ConvTranspose, each one cuDNN graph (``cudnn_graphs``) over the padded channels-last
buffers.

ConvTranspose is the data gradient of its adjoint Conv
(``ops.conv.conv_transpose_adjoint_attrs``: the same weight, its pads those of the uncropped
frame): one ``conv_dgrad`` graph, described here (``describe_conv_transpose``), and the bias
added by the broadcasting add kernel. Its own gradient ops are a Conv and a ConvGradFilter.

An inference Conv whose output only a Relu (or ReLU6) reads takes the activation into the
graph's epilogue; the activation node then has no calls of its own. A convolution may use as
much cuDNN workspace as its explicit im2col matrix would take (``bind.CUDNN_WORKSPACE`` at
least): engines that need more are deselected before the plan is built.
"""

from __future__ import annotations

import math

from ....errors import UnsupportedModelError
from ....hookspecs import hookimpl
from ....memory import MemoryPlan
from ....opdef import KernelContext, KernelDef
from ....ops.conv import conv_transpose_adjoint_attrs
from ..bind import (
    INTERNAL,
    BindContext,
    Unbound,
    collapse,
    cudnn_binding,
    cudnn_workspace,
    f32,
    float_dt,
    geometry,
    i32,
    i64,
)
from ..cudnn_graphs import CudnnGraphError, GraphDesc, conv_desc, fusable_activation
from .elementwise import BCAST_FLOAT

# op -> (index of the weight-shaped tensor, index of the output-sized feature map), as
# ("in"|"out", position)
_ROLES = {"Conv": (("in", 1), ("out", 0)), "ConvGradData": (("in", 1), ("in", 0)),
          "ConvGradFilter": (("out", 0), ("in", 1)), "ConvTranspose": (("in", 1), ("in", 0))}


def im2col_bytes(ctx: KernelContext) -> int:
    """Bytes of the im2col matrix of this convolution: (N * output pixels) x (C/g * kernel)."""
    (wk, wi), (fk, fi) = _ROLES[ctx.node.op_type]
    w = (ctx.inputs if wk == "in" else ctx.outputs)[wi]
    fm = (ctx.inputs if fk == "in" else ctx.outputs)[fi]
    return fm.shape[0] * math.prod(fm.shape[2:]) * math.prod(w.shape[1:]) * fm.dtype.itemsize


def conv_factory(ctx: KernelContext):
    k = cudnn_workspace(ctx, im2col_bytes(ctx))

    def bind(b: BindContext, node) -> list:
        if node.phase == "forward":
            activation = fusable_activation(node, b.graph)
            if activation is not None:
                b.fused[id(activation[0])] = node.label
                return b.cudnn(node, k, activation)
        return b.cudnn(node, k)

    return bind


def describe_conv_transpose(node, plan: MemoryPlan, workspace: tuple[int, int]) -> GraphDesc:
    """ConvTranspose(x, w[, b]) -> y as the ``conv_dgrad`` graph of its adjoint Conv y -> x:
    loss = x, filter = w (ONNX's [C_in, C_out / group, *k] is that Conv's [O, I / group, *k]),
    DX = y. The bias is not in the graph: a dgrad with a bias epilogue takes runtime-fusion
    engines only, which compile through the driver when built (and so cannot be checked
    without a GPU); ``conv_transpose_factory`` adds it after."""
    t = plan.tensors
    x, w, y = (t[v.name] for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
    try:
        attrs = conv_transpose_adjoint_attrs(node)
    except UnsupportedModelError as e:
        raise CudnnGraphError(str(e)) from None
    desc = conv_desc(node, plan, "conv_dgrad", y, w, x, {"loss": "y", "filter": "w"},
                     {"DX": "x"}, attrs=attrs)
    desc.workspace, desc.node_inputs = workspace, (0, 1)
    return desc


def conv_transpose_factory(ctx: KernelContext):
    """The adjoint's dgrad graph, then y += b over y's padded channels-last rows: the bias is
    read over the padded channel count from its slot (a half plan's bias is a compact cast
    whose slot lanes past the channels hold anything), and y's pad lanes are zeroed after."""
    k = cudnn_workspace(ctx, im2col_bytes(ctx))

    def bind(b: BindContext, node) -> list:
        calls = b.cudnn(node, k, describe=describe_conv_transpose)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is None:
            return calls
        y = node.outputs[0]
        g, tb = geometry(b.t(y)), b.t(bias)
        row_bytes = g.cp * tb.dtype.itemsize if g is not None else 0
        if g is None or g.kind != "channels_last" or geometry(tb) is None or \
                len(tb.shape) != 1 or max(tb.slot_bytes, tb.nbytes) < row_bytes:
            raise Unbound(f"the bias add reads {y.name!r} channels-last and {bias.name!r} as "
                          "a vector over its padded channels")
        # rows x padded channels: y (read and written) walks both, the bias only the channels
        dims, (sy, sb, sy_out) = collapse([g.n // g.cp, g.cp], [[g.cp, 1], [0, 1], [g.cp, 1]])
        calls.append(b.launch(f"tr_bcast_binary_{float_dt(b, y, bias)}", g.n, [
            b.buf(y), b.tensor_buf(tb, nbytes=row_bytes), b.buf(y, True), i64(g.n),
            i32(BCAST_FLOAT["Add"]), f32(0)] + [i64(v) for v in dims + sy + sb + sy_out]))
        return calls + ([b.zero_lanes(y, g)] if g.padded else [])

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Conv", "cuda", conv_factory),
            KernelDef("ConvTranspose", "cuda", conv_transpose_factory),
            KernelDef("ConvGradData", "cuda", cudnn_binding(im2col_bytes), domain=INTERNAL),
            KernelDef("ConvGradFilter", "cuda", cudnn_binding(im2col_bytes), domain=INTERNAL)]
