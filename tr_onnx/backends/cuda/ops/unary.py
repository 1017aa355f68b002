"""cuda bindings of the one-input elementwise ops (``ops/unary.py``): the activations and math
of ``ONNX_UNARY``, Clip, and Erf (``kernels/unary.cu``).

The kernels read and write one layout (``bind.same_layout``). An op whose f(+0) is +0 bit for
bit keeps padded lanes zero by itself; after any other a ``tr_zero_lanes`` launch clears them.
"""

from __future__ import annotations

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import BindContext, Unbound, binding, f32, float_dt, i64, same_layout
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, values

# ---- kernels/unary.cu: the family's name table --------------------------------------------------

UNARY_OPS = ("relu", "leaky_relu", "elu", "sigmoid", "hardsigmoid", "hardswish", "tanh", "gelu",
             "gelu_tanh", "softplus", "exp", "log", "sqrt", "neg", "abs", "sign", "clip")
"""Kernel stems of ``tr_<op>_fwd_<dt>`` / ``tr_<op>_bwd_<dt>``."""

ONNX_UNARY = {
    "Relu": ("relu", ()), "LeakyRelu": ("leaky_relu", ("alpha",)), "Elu": ("elu", ("alpha",)),
    "Sigmoid": ("sigmoid", ()), "HardSigmoid": ("hardsigmoid", ("alpha", "beta")),
    "HardSwish": ("hardswish", ()), "Tanh": ("tanh", ()), "Gelu": ("gelu", ()),
    "Softplus": ("softplus", ()), "Exp": ("exp", ()), "Log": ("log", ()), "Sqrt": ("sqrt", ()),
    "Neg": ("neg", ()), "Abs": ("abs", ()), "Sign": ("sign", ()),
    "Clip": ("clip", ("min", "max")),
}
"""ONNX op -> (kernel stem, the attributes passed as the kernels' ``a``, ``b``). Gelu with
``approximate="tanh"`` uses ``gelu_tanh``; Clip's bounds (inputs from opset 11) go in ``a, b``
(-inf/inf when absent)."""


def unary_source() -> KernelSource:
    """kernels/unary.cu: forward and backward of every op of ``UNARY_OPS``, and Erf."""
    return kernel_source(
        "unary",
        instantiate("TR_UNARY({op}, {T}, {dt})", ("tr_{op}_fwd_{dt}", "tr_{op}_bwd_{dt}"),
                    values("op", UNARY_OPS), STORAGE),
        instantiate("TR_ERF({T}, {dt})", "tr_erf_{dt}", STORAGE))


KERNELS = unary_source()


def zero_preserving(stem: str, a: float, b: float) -> bool:
    """f(+0) is +0 bit for bit, so the kernel keeps padded lanes zero by itself."""
    if stem in ("relu", "hardswish", "tanh", "gelu", "gelu_tanh", "sqrt", "abs"):
        return True
    if stem in ("leaky_relu", "elu"):
        return a >= 0
    if stem == "clip":
        return a <= 0 <= b
    return False


def _const_scalar(v) -> float | None:
    if v is None or v.data is None:
        return None
    arr = np.asarray(v.data)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def clip_bounds(node) -> tuple[float, float]:
    """Clip's (min, max): attributes before opset 11, plan-time constant inputs after
    (-inf/inf when absent)."""
    lo, hi = -np.inf, np.inf
    for i, key in ((1, "min"), (2, "max")):
        v = node.inputs[i] if i < len(node.inputs) else None
        if v is not None:
            value = _const_scalar(v)
            if value is None:
                raise Unbound(f"Clip bound {v.name!r} is computed at run time")
        elif node.attrs.get(key) is not None:
            value = float(node.attrs[key])
        else:
            continue
        lo, hi = (value, hi) if i == 1 else (lo, value)
    return lo, hi


def kernel_args(node) -> tuple[str, float, float]:
    """(stem, a, b) of ``tr_<stem>_fwd/bwd``: the op's attributes as the kernels read them."""
    stem, attr_names = ONNX_UNARY[node.op_type]
    if node.op_type == "Gelu" and node.attrs.get("approximate", "none") == "tanh":
        stem = "gelu_tanh"
    if node.op_type == "Clip":
        return (stem, *clip_bounds(node))
    vals = [float(node.attrs.get(k, 0.0)) for k in attr_names] + [0.0, 0.0]
    return stem, vals[0], vals[1]


def bind_unary(b: BindContext, node) -> list:
    stem, a, c = kernel_args(node)
    x, y = node.inputs[0], node.outputs[0]
    dt = b.dt(x)
    gy = same_layout(b, x, y)
    calls = [b.launch(f"tr_{stem}_fwd_{dt}", gy.n,
                      [b.buf(x), b.buf(y, True), i64(gy.n), f32(a), f32(c)])]
    if gy.padded and not zero_preserving(stem, a, c):
        calls.append(b.zero_lanes(y, gy))
    return calls


def bind_erf(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    gy = same_layout(b, x, y)
    dt = float_dt(b, x, y)  # erf(+0) = +0: padded lanes stay zero
    return [b.launch(f"tr_erf_{dt}", gy.n, [b.buf(x), b.buf(y, True), i64(gy.n)])]


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(bind_unary)) for op in ONNX_UNARY]
            + [KernelDef("Erf", "cuda", binding(bind_erf))])
