"""ScaledSquare and ScaledSquareGrad (domain ``ai.tr_onnx.test``): the NumPy side of the family.

The forward kernel computes in float64 scratch of shape ``(x.size, 3)`` (x, x*x, alpha*x*x in
its columns) and rounds once to the output dtype; its shape is one no cuda binding asks for,
so a NumPy kernel's scratch that leaked into a cuda plan would show. The backward kernel
computes in the output dtype, in the order the cuda kernels do: ``(x * gy) * (2 alpha)``.
"""

from __future__ import annotations

import math

import numpy as np

from tr_onnx.plugin import ELEMENTWISE, OpDef, hookimpl

DOMAIN = "ai.tr_onnx.test"
ALPHA = 1.0  # alpha's default, for nodes that omit it (no ONNX schema to hold it)


def same_shape(node, shapes, dtypes):
    """Shape rule (ONNX does not know the domain): output 0 is shaped like the last input
    (x of ScaledSquare, x of ScaledSquareGrad)."""
    return [(shapes[-1], dtypes[-1])]


def scaled_square_numpy(ctx):
    alpha = float(ctx.attrs["alpha"])
    shape = ctx.inputs[0].shape
    t_ws = ctx.workspace((math.prod(shape), 3), np.float64)

    def run(ins, outs, ws):
        x, sq, y = (ws[t_ws][:, k].reshape(shape) for k in range(3))  # strided views
        np.copyto(x, ins[0])
        np.multiply(x, x, out=sq)
        np.multiply(sq, alpha, out=y)
        np.copyto(outs[0], y, casting="same_kind")

    return run


def scaled_square_grad_numpy(ctx):
    two_alpha = 2.0 * float(ctx.attrs["alpha"])

    def run(ins, outs, ws):
        gy, x, gx = ins[0], ins[1], outs[0]
        np.multiply(x, gy, out=gx)
        np.multiply(gx, two_alpha, out=gx)

    return run


def scaled_square_vjp(b, node, gys, needed):
    """dy/dx = 2 alpha x: the named backward op, which each backend implements directly."""
    if not needed[0]:
        return [None]
    x = node.inputs[0]
    return [b.op("ScaledSquareGrad", [gys[0], x], {"alpha": float(node.attrs["alpha"])},
                 domain=DOMAIN, like=x)]


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("ScaledSquare", (1,), {"numpy": scaled_square_numpy}, domain=DOMAIN,
              layout=ELEMENTWISE, shape=same_shape, differentiable=True,
              gradient=scaled_square_vjp, attr_defaults={"alpha": ALPHA},
              doc="y = alpha * x * x"),
        OpDef("ScaledSquareGrad", (1,), {"numpy": scaled_square_grad_numpy}, domain=DOMAIN,
              layout=ELEMENTWISE, shape=same_shape, attr_defaults={"alpha": ALPHA},
              doc="(gy, x) -> gx = 2 * alpha * x * gy"),
    ]
