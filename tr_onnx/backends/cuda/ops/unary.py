"""cuda bindings of the one-input elementwise ops (``ops/unary.py``): the activations and math
of ``ONNX_UNARY``, Clip, Erf, and the named backward ops ``<Op>Grad`` that run the fused
``tr_<stem>_bwd`` kernels (``kernels/unary.cu``).

The kernels read and write one layout (``bind.same_layout``). An op whose f(+0) is +0 bit for
bit keeps padded lanes zero by itself; after any other a ``tr_zero_lanes`` launch clears them.
"""

from __future__ import annotations

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.unary import UNARY_GRADS
from ..bind import (
    TO_COMPACT,
    TO_PADDED,
    BindContext,
    Unbound,
    binding,
    f32,
    float_dt,
    geometry,
    i64,
    operand_spec,
    out_geometry,
    same_layout,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, values

# ---- kernels/unary.cu: the family's name table --------------------------------------------------

UNARY_OPS = ("relu", "leaky_relu", "elu", "sigmoid", "hardsigmoid", "hardswish", "tanh", "gelu",
             "gelu_tanh", "softplus", "exp", "log", "sqrt", "neg", "abs", "sign", "clip",
             "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
             "atanh", "reciprocal", "floor", "ceil", "round", "celu", "selu", "mish",
             "softsign", "shrink", "thresholded_relu")
"""Kernel stems of ``tr_<op>_fwd_<dt>`` / ``tr_<op>_bwd_<dt>``."""

ONNX_UNARY = {
    "Relu": ("relu", ()), "LeakyRelu": ("leaky_relu", ("alpha",)), "Elu": ("elu", ("alpha",)),
    "Sigmoid": ("sigmoid", ()), "HardSigmoid": ("hardsigmoid", ("alpha", "beta")),
    "HardSwish": ("hardswish", ()), "Tanh": ("tanh", ()), "Gelu": ("gelu", ()),
    "Softplus": ("softplus", ()), "Exp": ("exp", ()), "Log": ("log", ()), "Sqrt": ("sqrt", ()),
    "Neg": ("neg", ()), "Abs": ("abs", ()), "Sign": ("sign", ()),
    "Clip": ("clip", ("min", "max")),
    "Sin": ("sin", ()), "Cos": ("cos", ()), "Tan": ("tan", ()), "Asin": ("asin", ()),
    "Acos": ("acos", ()), "Atan": ("atan", ()), "Sinh": ("sinh", ()), "Cosh": ("cosh", ()),
    "Asinh": ("asinh", ()), "Acosh": ("acosh", ()), "Atanh": ("atanh", ()),
    "Reciprocal": ("reciprocal", ()), "Floor": ("floor", ()), "Ceil": ("ceil", ()),
    "Round": ("round", ()), "Celu": ("celu", ("alpha",)), "Selu": ("selu", ("alpha", "gamma")),
    "Mish": ("mish", ()), "Softsign": ("softsign", ()), "Shrink": ("shrink", ("bias", "lambd")),
    "ThresholdedRelu": ("thresholded_relu", ("alpha",)),
}
"""ONNX op -> (kernel stem, the attributes passed as the kernels' ``a``, ``b``). Gelu with
``approximate="tanh"`` uses ``gelu_tanh``; Clip's bounds (inputs from opset 11) go in ``a, b``
(-inf/inf when absent)."""


_TANH_FORM = {"gelu_tanh"} if "Gelu" in UNARY_GRADS else set()  # Gelu(approximate="tanh")
GRAD_STEMS = tuple(stem for stem in UNARY_OPS
                   if stem in {ONNX_UNARY[op][0] for op in UNARY_GRADS} | _TANH_FORM)
"""Stems with a ``tr_<op>_bwd_<dt>`` kernel: those of the ops whose gradient rule emits a named
``<Op>Grad`` node (``ops.unary.UNARY_GRADS``); the others' rules are one IR node of their own
(Neg, Exp, Log) or none (Sign), so a backward kernel would never launch."""


def unary_source() -> KernelSource:
    """kernels/unary.cu: forward of every op of ``UNARY_OPS``, backward of ``GRAD_STEMS``,
    and Erf."""
    return kernel_source(
        "unary",
        instantiate("TR_UNARY_FWD({op}, {T}, {dt})", "tr_{op}_fwd_{dt}",
                    values("op", UNARY_OPS), STORAGE),
        instantiate("TR_UNARY_BWD({op}, {T}, {dt})", "tr_{op}_bwd_{dt}",
                    values("op", GRAD_STEMS), STORAGE),
        instantiate("TR_ERF({T}, {dt})", "tr_erf_{dt}", STORAGE))


KERNELS = unary_source()


def zero_preserving(stem: str, a: float, b: float) -> bool:
    """f(+0) is +0 bit for bit, so the kernel keeps padded lanes zero by itself."""
    if stem in ("relu", "hardswish", "tanh", "gelu", "gelu_tanh", "sqrt", "abs", "sin", "tan",
                "asin", "atan", "sinh", "asinh", "atanh", "floor", "ceil", "round", "mish",
                "softsign", "thresholded_relu"):
        return True
    if stem in ("leaky_relu", "elu", "celu"):
        return a >= 0
    if stem == "selu":
        return a >= 0 and b >= 0
    if stem == "shrink":  # 0 is inside the band: +0, else 0 - bias
        return b >= 0
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


def kernel_args(node, op: str | None = None) -> tuple[str, float, float]:
    """(stem, a, b) of ``tr_<stem>_fwd/bwd`` for ONNX op ``op`` (default: the node's), from
    the node's attributes as the kernels read them (a named backward op carries its forward's
    attributes; ``tr_clip_grad`` compares x with y and takes no bounds)."""
    op = op or node.op_type
    stem, attr_names = ONNX_UNARY[op]
    if op == "Gelu" and node.attrs.get("approximate", "none") == "tanh":
        stem = "gelu_tanh"
    if op == "Clip":
        return (stem, *clip_bounds(node)) if node.op_type == "Clip" else (stem, 0.0, 0.0)
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


def bind_unary_grad(b: BindContext, node) -> list:
    """``<Op>Grad(gy[, x][, y])`` (``ops/unary.py``: the named backward op of a unary op)
    as one ``tr_<stem>_bwd`` launch. x, y and gx share a layout; a gy in the other one (the
    compact gradient of a GlobalAveragePool meeting a padded feature map) is first brought into
    gx's slot (``tr_pad_nhwc`` / ``tr_unpad_nhwc``), which the kernel then reads and writes
    element by element. With gy, x and y zero every formula gives +0 except Sqrt's (0 / 0):
    its padded lanes are cleared after."""
    op = node.op_type.removesuffix("Grad")
    stem, a, c = kernel_args(node, op)
    gy, x, y = (list(node.inputs) + [None, None])[:3]
    gx = node.outputs[0]
    dt = float_dt(b, gy, x, y, gx)
    out = out_geometry(b, gx)
    for v in (x, y):
        if v is not None:
            same_layout(b, v, gx)
    spec = operand_spec(b.t(gy), geometry(b.t(gy)), out)
    calls = []
    if spec == out.n:
        g = b.buf(gy)
    elif spec == TO_PADDED:
        calls.append(b.launch(f"tr_pad_nhwc_{dt}_{dt}", out.n, [
            b.buf(gy), b.buf(gx, True), i64(out.n), i64(out.c), i64(out.s), i64(out.cp)]))
        g = b.buf(gx)
    elif spec == TO_COMPACT:
        src = geometry(b.t(gy))
        calls.append(b.launch(f"tr_unpad_nhwc_{dt}_{dt}", src.m, [
            b.buf(gy), b.buf(gx, True), i64(src.m), i64(src.c), i64(src.s), i64(src.cp)]))
        g = b.buf(gx)
    else:
        raise Unbound(f"gy {gy.name!r} ({b.t(gy).layout.describe()}) does not map onto gx's "
                      "elements")
    calls.append(b.launch(f"tr_{stem}_bwd_{dt}", out.n, [
        b.buf(x), b.buf(y), g, b.buf(gx, True), i64(out.n), f32(a), f32(c)]))
    if out.padded and stem == "sqrt":
        calls.append(b.zero_lanes(gx, out))
    return calls


def bind_erf(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    gy = same_layout(b, x, y)
    dt = float_dt(b, x, y)  # erf(+0) = +0: padded lanes stay zero
    return [b.launch(f"tr_erf_{dt}", gy.n, [b.buf(x), b.buf(y, True), i64(gy.n)])]


@hookimpl
def tr_onnx_op_definitions():
    return ([KernelDef(op, "cuda", binding(bind_unary)) for op in ONNX_UNARY]
            + [KernelDef(f"{op}Grad", "cuda", binding(bind_unary_grad), domain=INTERNAL_DOMAIN)
               for op in UNARY_GRADS]
            + [KernelDef("Erf", "cuda", binding(bind_erf))])
