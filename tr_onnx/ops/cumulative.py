"""CumSum and CumProd (exclusive and reverse forms) and CumProd's backward op
``ai.tr_onnx.CumProdGrad``, exact where x has zeros (it never divides by x). CumSum's gradient
is a CumSum the other way round. The axis and gradient helpers are ops/tensor.py's.
"""

from __future__ import annotations

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import OpDef
from .tensor import DATA_INPUT, first_only, positive_axis


def _cumulative(ctx, accumulate, identity):
    """CumSum / CumProd: ``accumulate`` (np.cumsum, np.cumprod) along the axis input, the
    exclusive form starting from ``identity``, the reverse form on reversed views."""
    rank = len(ctx.inputs[0].shape)
    axis = positive_axis(int(np.asarray(ctx.const(1)).reshape(-1)[0]), rank)
    head = (slice(None),) * axis
    order = head + (slice(None, None, -1) if ctx.attrs["reverse"] else slice(None),)
    exclusive = bool(ctx.attrs["exclusive"])

    def run(ins, outs, ws):
        x, y = ins[0][order], outs[0][order]
        if exclusive:
            if y.shape[axis]:
                y[head + (0,)] = identity
                accumulate(x[head + (slice(None, -1),)], axis=axis,
                           out=y[head + (slice(1, None),)])
        else:
            accumulate(x, axis=axis, out=y)

    return run


def cumsum_numpy(ctx):
    return _cumulative(ctx, np.cumsum, 0)


def cumprod_numpy(ctx):
    return _cumulative(ctx, np.cumprod, 1)


# ---- backward op (domain ai.tr_onnx) and gradient rules ------------------------------------


def cumprod_grad_numpy(ctx):
    """CumProd's gradient (inputs gy, x, axis; attrs exclusive, reverse), exact where x has
    zeros (no division by x): ``gx_i = P_i * sum_{j >= i+e} gy_j * prod_{i < k <= j-e} x_k``
    with ``P_i`` the product of the elements before i and e = 1 when exclusive, on views
    reversed when ``reverse``. O(n^2) along the axis (n numpy calls over the other axes), and
    a few temporaries per call: a backward step, where exactness with zeros matters more."""
    rank = len(ctx.inputs[1].shape)
    axis = positive_axis(int(np.asarray(ctx.const(2)).reshape(-1)[0]), rank)
    flip = slice(None, None, -1) if ctx.attrs["reverse"] else slice(None)
    e = int(ctx.attrs["exclusive"])

    def run(ins, outs, ws):
        gy, x, gx = (np.moveaxis(a, axis, 0)[flip] for a in (ins[0], ins[1], outs[0]))
        n = x.shape[0]
        before = np.ones_like(x)  # P_i, the product of x_0 .. x_{i-1}
        if n > 1:
            np.cumprod(x[:-1], axis=0, out=before[1:])
        for i in range(n):
            span = n - i - e  # j = i+e .. n-1
            if span <= 0:
                gx[i] = 0
                continue
            q = np.ones_like(x[:span])
            if span > 1:
                np.cumprod(x[i + 1:i + span], axis=0, out=q[1:])
            np.multiply(before[i], np.sum(gy[i + e:] * q, axis=0), out=gx[i])

    return run


def cumsum_vjp(b, node, gys, needed):
    """A cumulative sum the other way round, with the same exclusiveness."""
    attrs = {"exclusive": int(node.attrs["exclusive"]), "reverse": 1 - int(node.attrs["reverse"])}
    return first_only(node, b.op("CumSum", [gys[0], node.inputs[1]], attrs,
                                 like=node.inputs[0]))


def cumprod_vjp(b, node, gys, needed):
    x = node.inputs[0]
    attrs = {"exclusive": int(node.attrs["exclusive"]), "reverse": int(node.attrs["reverse"])}
    return first_only(node, b.op("CumProdGrad", [gys[0], x, node.inputs[1]], attrs,
                                 domain=INTERNAL_DOMAIN, like=x))


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("CumSum", (11, 14), {"numpy": cumsum_numpy}, const_inputs=(1,),
              differentiable=True, gradient=cumsum_vjp, grad_inputs=DATA_INPUT),
        OpDef("CumProd", (26,), {"numpy": cumprod_numpy}, const_inputs=(1,),
              differentiable=True, gradient=cumprod_vjp, grad_inputs=DATA_INPUT),
        # backward-only op of the rule above
        OpDef("CumProdGrad", (1,), {"numpy": cumprod_grad_numpy}, domain=INTERNAL_DOMAIN,
              const_inputs=(2,), doc="gradient of CumProd (inputs gy, x, axis), exact at zeros"),
    ]
