"""``com.example.quant`` FakeQuantize, version 1: quantize-dequantize in the input's float type.

Gradient (straight-through estimator, clipped): ``gx = gy`` where ``round(x / scale) +
zero_point`` lies in ``[qmin, qmax]``, 0 where the clip saturates. ``scale`` gets no gradient
(``grad_inputs=(0,)``): it is calibrated (e.g. max|x| / qmax) rather than learned. LSQ's learned
step size (d y / d scale = round(x/s) - x/s inside the range) is left out on purpose: it is not
the derivative of any forward function, so it could not be checked by finite differences the way
every other rule here is.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from tr_onnx.plugin import ELEMENTWISE, OpDef

DOMAIN = "com.example.quant"
DEFAULTS = {"zero_point": 0, "qmin": -128, "qmax": 127}  # the attribute defaults, once


def attributes(attrs) -> tuple[int, int, int]:
    zp, qmin, qmax = (int(attrs.get(k, v)) for k, v in DEFAULTS.items())
    if not qmin <= zp <= qmax:
        raise ValueError(f"FakeQuantize: zero_point {zp} outside [qmin, qmax] = [{qmin}, {qmax}]")
    return zp, qmin, qmax


def like_x(node, shapes, dtypes):
    """Shape rule: y is shaped like x."""
    return [(shapes[0], dtypes[0])]


def fake_quantize_numpy(ctx):
    try:
        zp, qmin, qmax = attributes(ctx.attrs)
    except ValueError as exc:
        raise ctx.error(str(exc)) from None

    def run(ins, outs, ws):
        x, scale, y = ins[0], ins[1], outs[0]
        np.divide(x, scale, out=y)
        np.round(y, out=y)  # half to even, as ONNX Round
        y += zp
        np.clip(y, qmin, qmax, out=y)
        y -= zp
        y *= scale

    return run


def fake_quantize_vjp(b, node, gys, needed):
    """gx = gy inside the clip range, 0 outside; built from standard ops."""
    x, scale = node.inputs
    zp, qmin, qmax = attributes(node.attrs)
    q = b.add(b.op("Round", [b.div(x, scale)]), b.scalar_like(zp, x))
    inside = b.op("And", [b.op("GreaterOrEqual", [q, b.scalar_like(qmin, x)]),
                          b.op("LessOrEqual", [q, b.scalar_like(qmax, x)])])
    return [b.op("Where", [inside, gys[0], b.scalar_like(0.0, x)]), None]


class FakeQuantize(OpRun):
    """``onnx.reference`` implementation, for ``ReferenceEvaluator(model, new_ops=...)``."""

    op_domain = DOMAIN
    op_schema = None  # ours: no ONNX schema (onnx.reference looks schemas up by name)

    def _run(self, x, scale, zero_point=None, qmin=None, qmax=None):
        given = {"zero_point": zero_point, "qmin": qmin, "qmax": qmax}
        zp, lo, hi = attributes({k: v for k, v in given.items() if v is not None})
        q = np.clip(np.rint(x / scale) + zp, lo, hi)
        return (((q - zp) * scale).astype(x.dtype),)


OPDEF = OpDef("FakeQuantize", (1,), {"numpy": fake_quantize_numpy}, domain=DOMAIN,
              layout=ELEMENTWISE, shape=like_x, differentiable=True,
              gradient=fake_quantize_vjp, grad_inputs=(0,),
              doc="(clip(round(x/scale) + zero_point, qmin, qmax) - zero_point) * scale")
