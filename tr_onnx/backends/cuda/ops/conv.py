"""cuda bindings of ``ops/conv.py``: Conv and its backward ops ConvGradData / ConvGradFilter,
each one cuDNN graph (``cudnn_graphs``) over the padded channels-last buffers.

An inference Conv whose output only a Relu (or ReLU6) reads takes the activation into the
graph's epilogue; the activation node then has no calls of its own. A convolution may use as
much cuDNN workspace as its explicit im2col matrix would take (``bind.CUDNN_WORKSPACE`` at
least): engines that need more are deselected before the plan is built.
"""

from __future__ import annotations

import math

from ....hookspecs import hookimpl
from ....opdef import KernelContext, KernelDef
from ..bind import INTERNAL, BindContext, cudnn_binding, cudnn_workspace
from ..cudnn_graphs import fusable_activation

# op -> (index of the weight-shaped tensor, index of the output-sized feature map), as
# ("in"|"out", position)
_ROLES = {"Conv": (("in", 1), ("out", 0)), "ConvGradData": (("in", 1), ("in", 0)),
          "ConvGradFilter": (("out", 0), ("in", 1))}


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


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Conv", "cuda", conv_factory),
            KernelDef("ConvGradData", "cuda", cudnn_binding(im2col_bytes), domain=INTERNAL),
            KernelDef("ConvGradFilter", "cuda", cudnn_binding(im2col_bytes), domain=INTERNAL)]
