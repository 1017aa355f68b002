"""Gemm and MatMul. Both may read a feature map flattened in its physical (h, w, c) order: the
layout pass then stores the weight's rows in the same order, so the kernel is a plain matmul
over whatever matrices it is handed (``ctx.inputs[i].shape`` is the physical shape then).

``np.matmul`` is a gufunc with optional core dimensions, so 1-D operands, batch broadcasting
and integer types all go through one ``np.matmul(a, b, out=y)`` with no temporary.
"""

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import MATMUL, OpDef


def gemm_numpy(ctx):
    """``y = alpha * op(A) @ op(B) + beta * C``; C (optional from v11) broadcasts to ``y``."""
    alpha, beta = float(ctx.attrs["alpha"]), float(ctx.attrs["beta"])
    trans_a, trans_b = bool(ctx.attrs["transA"]), bool(ctx.attrs["transB"])
    has_c = ctx.has_input(2) and beta != 0.0
    dtype = ctx.outputs[0].dtype
    alpha_t, beta_t = dtype.type(alpha), dtype.type(beta)
    scaled_c = ctx.workspace(ctx.inputs[2].shape, dtype) if has_c and beta != 1.0 else None

    def run(ins, outs, ws):
        a, b, y = ins[0], ins[1], outs[0]
        np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=y)
        if alpha != 1.0:
            np.multiply(y, alpha_t, out=y)
        if has_c:
            c = ins[2]
            if scaled_c is not None:
                c = np.multiply(c, beta_t, out=ws[scaled_c])
            np.add(y, c, out=y)

    return run


def matmul_numpy(ctx):
    def run(ins, outs, ws):
        np.matmul(ins[0], ins[1], out=outs[0])

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Gemm", (1, 6, 7, 9, 11, 13), {"numpy": gemm_numpy}, layout=MATMUL,
              differentiable=True),
        OpDef("MatMul", (1, 9, 13), {"numpy": matmul_numpy}, layout=MATMUL, differentiable=True),
    ]
