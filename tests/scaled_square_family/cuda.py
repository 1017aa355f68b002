"""cuda bindings of ScaledSquare and ScaledSquareGrad (``ops.py``), launching the family's own
kernels (``scaled_square.cu``, named in ``SOURCE``).

Each factory reserves, at plan time, a float32 scratch vector of x's physical elements for the
product: ``x * x`` forward, ``x * gy`` backward; a second launch scales it into the output
(``alpha``, ``2 alpha``). Padded lanes are zero in, and so zero out.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tr_onnx.backends.cuda import sources
from tr_onnx.backends.cuda.bind import BindContext, Unbound, f32, i64, same_layout
from tr_onnx.hookspecs import hookimpl
from tr_onnx.opdef import KernelContext, KernelDef

from .ops import DOMAIN

# the family's .cu sits beside this module (it includes tr_onnx's elementwise.cuh)
SOURCE = sources.KernelSource(
    "scaled_square", "scaled_square.cu",
    *sources.instantiate("TR_SCALED_SQUARE({T}, {dt})",
                         ("tr_scaled_square_mul_{dt}", "tr_scaled_square_scale_{dt}"),
                         sources.STORAGE), directory=Path(__file__).parent)


def product_then_scale(ctx: KernelContext, operands: tuple[int, int], scale):
    """The factory of both ops: ``out = (in[a] * in[b]) * scale(alpha)`` through a float32
    scratch of the last input's physical size (x in both ops)."""
    x = ctx.inputs[-1]
    t_ws = ctx.workspace((math.prod(x.layout.phys_shape),), np.float32)

    def bind(b: BindContext, node) -> list:
        a, c = (node.inputs[k] for k in operands)
        y = node.outputs[0]
        g = same_layout(b, a, y)
        same_layout(b, c, y)
        dt = b.dt(y)
        if b.dt(a) != dt or b.dt(c) != dt:
            raise Unbound("operands of different dtypes")
        t = b.ws(t_ws)
        if t.nbytes < 4 * g.n:
            raise Unbound(f"{g.n} elements, scratch for {t.nbytes // 4}")
        alpha = float(node.attrs["alpha"])
        return [b.launch(f"tr_scaled_square_mul_{dt}", g.n, [b.buf(a), b.buf(c), t, i64(g.n)],
                         family=SOURCE),
                b.launch(f"tr_scaled_square_scale_{dt}", g.n,
                         [b.ws(t_ws, writes=False), b.buf(y, True), i64(g.n), f32(scale(alpha))],
                         family=SOURCE)]

    return bind


def scaled_square_factory(ctx: KernelContext):
    """ScaledSquare(x): t = x * x, y = alpha * t."""
    return product_then_scale(ctx, (0, 0), lambda alpha: alpha)


def scaled_square_grad_factory(ctx: KernelContext):
    """ScaledSquareGrad(gy, x): t = x * gy, gx = (2 alpha) * t."""
    return product_then_scale(ctx, (1, 0), lambda alpha: 2.0 * alpha)


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("ScaledSquare", "cuda", scaled_square_factory, domain=DOMAIN),
            KernelDef("ScaledSquareGrad", "cuda", scaled_square_grad_factory, domain=DOMAIN)]
