"""One-input elementwise ops: activations (Relu, Sigmoid, Tanh, Gelu, Elu, HardSwish...), math
(Exp, Log, Sqrt, trigonometric and hyperbolic functions...), rounding, predicates (IsNaN,
IsInf), Not/BitwiseNot, Shrink, and Clip; and the named backward ops ``ai.tr_onnx.<Op>Grad``
(``UNARY_GRADS``): one node for a derivative a backend runs as one fused kernel.

They are one family because they share one shape (the output is the input's, element for
element) and so one kernel factory over the ``UNARY`` table, one rule shape (``gy * f'(x)``
from x, y and gy) and one layout rule: any strided layout in, the same layout out. The table
entry, the attribute and scratch helpers and the node builders of the gradient rules come
from ops/elementwise.py, the family of ops with several inputs; erf in float64 from ops/erf.py;
the oneDNN kernels float32 Gelu, Elu, Selu and Mish run on from ops/unary_onednn.py.

A body ``fn(x, y, t, a)`` reads ``x`` (a logical view, maybe channels-last and padded) and
writes ``y`` through ``out=``; ``t`` are the scratch buffers its table entry names, reserved
with ``ctx.workspace`` at plan time, and ``a`` the attributes in the input's dtype. The
``vjp`` column holds each op's gradient rule, built from IR nodes (see
``tr_onnx.passes.autodiff``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..dtypes import finfo, is_float
from ..hookspecs import hookimpl
from ..host_math import negate
from ..opdef import OpDef, bounded_like_input, unit_bounded
from .elementwise import (
    Chunked,
    Elementwise,
    attrs_for,
    chunk_size,
    const_like,
    filled_like,
    greater_than,
    keep_where,
    masked,
    positive_plus,
    request_scratch,
    scaled,
    select_where,
    where,
)
from .erf import ERF_SCRATCH, erf_float64
from .unary_onednn import onednn_finite_eltwise, onednn_gelu

# ---- bodies that are more than one ufunc -----------------------------------------------------

def _erf(x, y, t, a):
    erf_float64(x, t, exact=a.erf_exact)
    np.copyto(y, t[1], casting="same_kind")


def _gelu(x, y, t, a):
    if a.approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        np.multiply(x, x, out=y)
        y *= a.cubic
        y += 1
        y *= x
        y *= a.sqrt_2_over_pi
        np.tanh(y, out=y)
        y += 1
        y *= x
        y *= 0.5
        return
    erf_float64(x, t, 1.0 / math.sqrt(2.0), a.erf_exact)  # float64: erf is computed there
    r = t[1]
    r += 1.0
    r *= x
    r *= 0.5
    np.copyto(y, r, casting="same_kind")


def _sigmoid(x, y, t, a):
    # exp(-|x|) never overflows: 1/(1+e) for x >= 0, e/(1+e) below
    e, negative = t
    np.abs(x, out=e)
    negate(e, e)
    np.exp(e, out=e)
    np.add(e, 1, out=y)
    np.reciprocal(y, out=y)
    np.less(x, 0, out=negative)
    np.multiply(y, e, out=y, where=negative)


def _softplus(x, y, t, a):
    # log1p(exp(-|x|)) + max(x, 0): exact where exp(x) would overflow
    np.abs(x, out=y)
    negate(y, y)
    np.exp(y, out=y)
    np.log1p(y, out=y)
    np.maximum(x, 0, out=t[0])
    y += t[0]


def _mish(x, y, t, a):
    _softplus(x, y, t, a)
    np.tanh(y, out=y)
    y *= x


def _leaky_relu(x, y, t, a):
    # x < 0 ? alpha x : x is max(x, alpha x) for 0 < alpha <= 1 and min(x, alpha x) above 1,
    # exactly (NaN stays NaN, -0.0 stays -0.0, infinities keep their sign): two vector passes,
    # where NumPy's max and min against the scalar 0 run a scalar loop ([8, 64, 32, 32]:
    # 1366 -> 344 us, 2 threads, Zen 3, 2026-12-02)
    if 0 < a.alpha_f <= 1:
        np.multiply(x, a.alpha, out=t[0])
        np.maximum(x, t[0], out=y)
    elif a.alpha_f > 1:
        np.multiply(x, a.alpha, out=t[0])
        np.minimum(x, t[0], out=y)
    else:  # alpha = 0 (0 * inf is NaN) or a negative slope: the two halves apart
        np.minimum(x, 0, out=t[0])
        t[0] *= a.alpha
        positive_plus(x, y, t[0])


def _elu(x, y, t, a):
    np.minimum(x, 0, out=t[0])
    np.expm1(t[0], out=t[0])
    t[0] *= a.alpha
    positive_plus(x, y, t[0])


def _selu(x, y, t, a):
    _elu(x, y, t, a)
    y *= a.gamma


def _celu(x, y, t, a):
    np.minimum(x, 0, out=t[0])
    t[0] /= a.alpha
    np.expm1(t[0], out=t[0])
    t[0] *= a.alpha
    positive_plus(x, y, t[0])


def _thresholded_relu(x, y, t, a):
    np.greater(x, a.alpha, out=t[0])
    y.fill(0)
    np.copyto(y, x, where=t[0])


def _hard_sigmoid(x, y, t, a):
    np.multiply(x, a.alpha, out=y)
    y += a.beta
    np.clip(y, 0, 1, out=y)


def _hard_swish(x, y, t, a):  # x * HardSigmoid(x; alpha=1/6, beta=0.5)
    np.multiply(x, a.one_sixth, out=y)
    y += 0.5
    np.clip(y, 0, 1, out=y)
    y *= x


def _softsign(x, y, t, a):
    np.abs(x, out=y)
    y += 1
    np.divide(x, y, out=y)


def _is_inf(x, y, t, a):
    if a.detect_positive and a.detect_negative:
        np.isinf(x, out=y)
    elif a.detect_positive:
        np.equal(x, np.inf, out=y)
    elif a.detect_negative:
        np.equal(x, -np.inf, out=y)
    else:
        y.fill(False)


def _shrink(x, y, t, a):
    # lambd compares in float (an integer x against 0.5 must not round it to 0)
    above, below = t
    np.greater(x, a.lambd_f, out=above)
    np.less(x, -a.lambd_f, out=below)
    y.fill(0)
    np.subtract(x, a.bias, out=y, where=above, casting="unsafe")
    np.add(x, a.bias, out=y, where=below, casting="unsafe")


def _ufunc1(ufunc):
    return lambda x, y, t, a: ufunc(x, out=y)


# ---- gradient rules --------------------------------------------------------------------------
# Derivatives ``d(b, x, y, gy, a) -> gx`` build gy * f'(x) from the forward input ``x``, output
# ``y`` (Values), the output gradient ``gy`` and the node's attributes ``a`` (schema defaults
# filled); ``_unary`` turns one into a rule. Constants take the dtype of the Value they combine
# with.

def _unary(d):
    def vjp(b, node, gys, needed):
        if gys[0] is None or not needed[0]:
            return [None]
        return [d(b, node.inputs[0], node.outputs[0], gys[0], node.attrs)]

    return vjp


def _one_minus_square(b, v):
    return b.sub(const_like(b, 1.0, v), b.mul(v, v))


def _over_sqrt(b, gy, v):
    return b.div(gy, b.op("Sqrt", [v]))


def _erf_d(b, x, y, gy, a):  # 2/sqrt(pi) exp(-x^2)
    e = b.op("Exp", [b.neg(b.mul(x, x))])
    return b.mul(gy, scaled(b, e, 2.0 / math.sqrt(math.pi)))


def _mish_d(b, x, y, gy, a):  # tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x), sp = softplus(x)
    t = b.op("Tanh", [b.op("Softplus", [x])])
    d = b.add(t, b.mul(x, b.mul(_one_minus_square(b, t), b.op("Sigmoid", [x]))))
    return b.mul(gy, d)


def _softsign_d(b, x, y, gy, a):  # 1 / (1 + |x|)^2
    s = b.add(b.op("Abs", [x]), const_like(b, 1.0, x))
    return b.div(gy, b.mul(s, s))


# ---- named backward ops (domain ai.tr_onnx) ---------------------------------------------------
# As PyTorch's derivatives.yaml names ``tanh_backward(grad, result)``, the rule ``_grad_op``
# makes for an op in ``UNARY_GRADS`` emits one node ``ai.tr_onnx.<Op>Grad(gy, x, y) -> gx``
# rather than a chain of Where/Mul/Greater..., so that a backend can run the derivative as one
# fused kernel (the cuda backend's ``tr_<stem>_bwd``). Inputs are positional: gy always, then x
# and y where the formula reads them (an unread one is absent: empty in the middle, dropped at
# the end); the forward's attributes are copied. The NumPy kernels compute the formulas of
# backends/cuda/kernels/elementwise.cuh (``tr_<stem>_grad``) operation by operation in the
# input's dtype, which are also the chains of standard ops these ops replace, so the results
# are those chains' bit for bit. Derivatives that are one standard node already (Neg: -gy,
# Exp: gy * y, Log: gy / x) keep it: a named op would run the same single kernel.


class UnaryGrad(NamedTuple):
    """A ``UNARY_GRADS`` entry. ``reads``: the forward values the formula needs, ``"x"``,
    ``"y"`` or ``"xy"``. ``fn(gy, x, y, gx, t, a)`` writes gx (x or y is None where not read);
    ``t`` and ``a`` as for ``Elementwise`` bodies. ``scratch``: codes as ``Elementwise``'s, or
    ``scratch(attrs) -> codes``. ``derived(dtype) -> {name: value}``: constants ``fn`` reads
    from ``a``, in the float dtype."""

    reads: str
    fn: Callable
    scratch: tuple[str, ...] | Callable = ()
    derived: Callable | None = None


def _relu_grad(gy, x, y, gx, t, a):  # y > 0 ? gy : 0
    np.greater(y, 0, out=t[0])
    keep_where(t[0], gy, gx)


def _leaky_relu_grad(gy, x, y, gx, t, a):  # x > 0 ? gy : gy * alpha
    mask, slope = t
    np.multiply(gy, a.alpha, out=slope)
    np.greater(x, 0, out=mask)
    select_where(mask, gy, slope, gx)


def _elu_grad(gy, x, y, gx, t, a):  # x > 0 ? gy : gy * (y + alpha), as alpha e^x = y + alpha
    mask, slope = t
    np.add(y, a.alpha, out=slope)
    slope *= gy
    np.greater(x, 0, out=mask)
    select_where(mask, gy, slope, gx)


def _sigmoid_grad(gy, x, y, gx, t, a):  # gy * (y * (1 - y))
    np.subtract(1, y, out=gx)
    gx *= y
    gx *= gy


def _hard_sigmoid_grad(gy, x, y, gx, t, a):  # 0 < y < 1 ? gy * alpha : 0 (off the clamps)
    inside, below_one = t
    np.greater(y, 0, out=inside)
    np.less(y, 1, out=below_one)
    np.logical_and(inside, below_one, out=inside)
    np.multiply(gy, a.alpha, out=gx)
    keep_where(inside, gx, gx)


def _hard_swish_grad(gy, x, y, gx, t, a):  # x < -3 ? 0 : x > 3 ? gy : gy * (x / 3 + 1 / 2)
    mask, inner = t
    np.multiply(x, a.one_third, out=inner)
    inner += 0.5
    inner *= gy
    np.greater(x, 3, out=mask)
    select_where(mask, gy, inner, gx)
    np.less(x, -3, out=mask)
    np.logical_not(mask, out=mask)  # not (x < -3): NaN keeps its NaN
    keep_where(mask, gx, gx)


def _tanh_grad(gy, x, y, gx, t, a):  # gy * (1 - y * y)
    np.multiply(y, y, out=gx)
    np.subtract(1, gx, out=gx)
    gx *= gy


def _gelu_grad(gy, x, y, gx, t, a):
    (_gelu_tanh_grad if a.approximate == "tanh" else _gelu_erf_grad)(gy, x, gx, t, a)


def _gelu_erf_grad(gy, x, gx, t, a):
    """y = x Phi(x): y' = Phi(x) + x phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi(x) =
    exp(-x^2 / 2) / sqrt(2 pi); the erf of the rounded x / sqrt 2, rounded, as an Erf node
    computes it."""
    *erf_scratch, pdf = t
    np.multiply(x, a.sqrt1_2, out=gx)
    erf_float64(gx, erf_scratch, exact=a.erf_exact)
    np.copyto(gx, erf_scratch[1], casting="same_kind")
    gx += 1
    gx *= 0.5
    np.multiply(x, x, out=pdf)
    pdf *= -0.5
    np.exp(pdf, out=pdf)
    pdf *= a.inv_sqrt_2pi
    pdf *= x
    gx += pdf
    gx *= gy


def _gelu_tanh_grad(gy, x, gx, t, a):
    """y = x/2 (1 + u), u = tanh(c (x + k x^3)): y' = (1 + u)/2 + x/2 (1 - u^2) c (1 + 3k x^2)."""
    x2, slope = t
    np.multiply(x, x, out=x2)
    np.multiply(x2, a.cubic, out=gx)
    gx += 1
    gx *= x
    gx *= a.sqrt_2_over_pi
    np.tanh(gx, out=gx)  # u
    np.multiply(gx, gx, out=slope)
    np.subtract(1, slope, out=slope)
    x2 *= a.three_kc
    x2 += a.sqrt_2_over_pi
    slope *= x2  # (1 - u^2) (3 k c x^2 + c)
    slope *= x
    gx += 1
    gx += slope
    gx *= 0.5
    gx *= gy


def _gelu_grad_scratch(attrs) -> tuple[str, ...]:
    return ("x", "x") if attrs["approximate"] == "tanh" else ERF_SCRATCH + ("x",)


def _softplus_grad(gy, x, y, gx, t, a):  # gy * sigmoid(x)
    _sigmoid(x, gx, t, a)
    gx *= gy


def _sqrt_grad(gy, x, y, gx, t, a):  # gy * 0.5 / y
    np.multiply(gy, 0.5, out=gx)
    gx /= y


def _abs_grad(gy, x, y, gx, t, a):  # gy * sign(x), with sign(+-0) = +-0 and sign(NaN) = NaN
    np.sign(x, out=gx)
    np.copysign(gx, x, out=gx)
    gx *= gy


def _clip_grad(gy, x, y, gx, t, a):  # x == y ? gy : 0 (inside the bounds, bounds included)
    np.equal(x, y, out=t[0])
    keep_where(t[0], gy, gx)


def _gelu_grad_constants(dt):
    k, c = 0.044715, math.sqrt(2.0 / math.pi)
    return {"cubic": dt.type(k), "sqrt_2_over_pi": dt.type(c), "three_kc": dt.type(3 * k * c),
            "sqrt1_2": dt.type(1.0 / math.sqrt(2.0)),
            "inv_sqrt_2pi": dt.type(1.0 / math.sqrt(2.0 * math.pi)),
            "erf_exact": dt.itemsize == 8}


UNARY_GRADS: dict[str, UnaryGrad] = {
    "Relu": UnaryGrad("y", _relu_grad, ("?",)),
    "LeakyRelu": UnaryGrad("x", _leaky_relu_grad, ("?", "x")),
    "Elu": UnaryGrad("xy", _elu_grad, ("?", "x")),
    "Sigmoid": UnaryGrad("y", _sigmoid_grad),
    "HardSigmoid": UnaryGrad("y", _hard_sigmoid_grad, ("?", "?")),
    "HardSwish": UnaryGrad("x", _hard_swish_grad, ("?", "x"),
                           lambda dt: {"one_third": dt.type(1.0 / 3.0)}),
    "Tanh": UnaryGrad("y", _tanh_grad),
    "Gelu": UnaryGrad("x", _gelu_grad, _gelu_grad_scratch, _gelu_grad_constants),
    "Softplus": UnaryGrad("x", _softplus_grad, ("x", "?")),
    "Sqrt": UnaryGrad("y", _sqrt_grad),
    "Abs": UnaryGrad("x", _abs_grad),
    "Clip": UnaryGrad("xy", _clip_grad, ("?",)),
}


def _grad_signature(reads: str) -> str:
    inputs = ["gy", "x" if "x" in reads else "''", "y" if "y" in reads else ""]
    return f"({', '.join(v for v in inputs if v)}) -> gx"


def _grad_op(op: str):
    """The rule of an op in ``UNARY_GRADS``: one ``<op>Grad`` node. Clip's bounds (inputs from
    opset 11) get no gradient."""
    reads = UNARY_GRADS[op].reads

    def vjp(b, node, gys, needed):
        rest = [None] * (len(node.inputs) - 1)
        if gys[0] is None or not needed[0]:
            return [None] + rest
        x, y = node.inputs[0], node.outputs[0]
        inputs = [gys[0], x if "x" in reads else None, y if "y" in reads else None]
        while inputs[-1] is None:
            inputs.pop()
        gx = b.op(f"{op}Grad", inputs, dict(node.attrs), domain=INTERNAL_DOMAIN, like=x)
        return [gx] + rest

    return vjp


_TRIG_1 = (7, 22)  # Sin, Cos, Tan, Asin, Acos, Atan
_TRIG_2 = (9, 22)  # Sinh, Cosh, Asinh, Acosh, Atanh
_MATH = (1, 6, 13)  # Exp, Log, Sqrt, Reciprocal, Neg, Abs, Floor, Ceil, Tanh, Sigmoid

UNARY: dict[str, Elementwise] = {
    "Relu": Elementwise((1, 6, 13, 14), lambda x, y, t, a: np.maximum(x, a.zero, out=y), True,
                        vjp=_grad_op("Relu")),
    "LeakyRelu": Elementwise((1, 6, 16), _leaky_relu, True, ("y",), _grad_op("LeakyRelu")),
    "Elu": Elementwise((1, 6, 22), _elu, True, ("y",), _grad_op("Elu")),
    "Selu": Elementwise((1, 6, 22), _selu, True, ("y",), _unary(
        lambda b, x, y, gy, a: where(b, greater_than(b, x, 0), scaled(b, gy, a["gamma"]), b.mul(
            gy, b.add(y, const_like(b, a["gamma"] * a["alpha"], y)))))),
    "Celu": Elementwise((12, 28), _celu, True, ("y",), _unary(  # e^(x/alpha) = y/alpha + 1
        lambda b, x, y, gy, a: where(b, greater_than(b, x, 0), gy, b.mul(
            gy, b.add(scaled(b, y, 1.0 / a["alpha"]), const_like(b, 1.0, y)))))),
    "ThresholdedRelu": Elementwise((10, 22), _thresholded_relu, True, ("?",), _unary(
        lambda b, x, y, gy, a: masked(b, greater_than(b, x, a["alpha"]), gy))),
    "Sigmoid": Elementwise(_MATH, _sigmoid, True, ("y", "?"), _grad_op("Sigmoid")),
    "HardSigmoid": Elementwise((1, 6, 22), _hard_sigmoid, True, vjp=_grad_op("HardSigmoid")),
    "HardSwish": Elementwise((14, 22), _hard_swish, True, vjp=_grad_op("HardSwish")),
    "Tanh": Elementwise(_MATH, _ufunc1(np.tanh), True, vjp=_grad_op("Tanh")),
    "Erf": Elementwise((9, 13), _erf, True, ERF_SCRATCH, _unary(_erf_d)),
    "Gelu": Elementwise((20,), _gelu, True, ERF_SCRATCH, _grad_op("Gelu")),
    "Softplus": Elementwise((1, 22), _softplus, True, ("y",), _grad_op("Softplus")),
    "Softsign": Elementwise((1, 22), _softsign, True, vjp=_unary(_softsign_d)),
    "Mish": Elementwise((18, 22), _mish, True, ("y",), _unary(_mish_d)),
    "Exp": Elementwise(_MATH, _ufunc1(np.exp), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, y))),
    "Log": Elementwise(_MATH, _ufunc1(np.log), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, x))),
    "Sqrt": Elementwise(_MATH, _ufunc1(np.sqrt), True, vjp=_grad_op("Sqrt")),
    "Reciprocal": Elementwise(_MATH, _ufunc1(np.reciprocal), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(b.mul(gy, b.mul(y, y))))),
    "Neg": Elementwise(_MATH, (lambda x, y, t, a: negate(x, y)), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(gy))),
    "Abs": Elementwise(_MATH, _ufunc1(np.absolute), True, vjp=_grad_op("Abs")),
    "Sign": Elementwise((9, 13), _ufunc1(np.sign), False),
    "Floor": Elementwise(_MATH, _ufunc1(np.floor), False),
    "Ceil": Elementwise(_MATH, _ufunc1(np.ceil), False),
    "Round": Elementwise((11, 22), _ufunc1(np.rint), False),  # half to even, as ONNX
    "Sin": Elementwise(_TRIG_1, _ufunc1(np.sin), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Cos", [x])))),
    "Cos": Elementwise(_TRIG_1, _ufunc1(np.cos), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(b.mul(gy, b.op("Sin", [x]))))),
    "Tan": Elementwise(_TRIG_1, _ufunc1(np.tan), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.add(const_like(b, 1.0, y), b.mul(y, y))))),
    "Asin": Elementwise(_TRIG_1, _ufunc1(np.arcsin), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, _one_minus_square(b, x)))),
    "Acos": Elementwise(_TRIG_1, _ufunc1(np.arccos), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(_over_sqrt(b, gy, _one_minus_square(b, x))))),
    "Atan": Elementwise(_TRIG_1, _ufunc1(np.arctan), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, b.add(const_like(b, 1.0, x), b.mul(x, x))))),
    "Sinh": Elementwise(_TRIG_2, _ufunc1(np.sinh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Cosh", [x])))),
    "Cosh": Elementwise(_TRIG_2, _ufunc1(np.cosh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Sinh", [x])))),
    "Asinh": Elementwise(_TRIG_2, _ufunc1(np.arcsinh), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, b.add(b.mul(x, x), const_like(b, 1.0, x))))),
    "Acosh": Elementwise(_TRIG_2, _ufunc1(np.arccosh), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, b.sub(b.mul(x, x), const_like(b, 1.0, x))))),
    "Atanh": Elementwise(_TRIG_2, _ufunc1(np.arctanh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, _one_minus_square(b, x)))),
    "IsNaN": Elementwise((9, 13, 20), _ufunc1(np.isnan), False),
    "IsInf": Elementwise((10, 20), _is_inf, False),
    "Not": Elementwise((1,), _ufunc1(np.logical_not), False),
    "BitwiseNot": Elementwise((18,), _ufunc1(np.invert), False),
    "Shrink": Elementwise((9,), _shrink, True, ("?", "?"), _unary(  # slope 1 outside the band
        lambda b, x, y, gy, a: masked(b, greater_than(b, b.op("Abs", [x]), a["lambd"]), gy))),
}

# Constants some bodies need, computed once per node in the input's float dtype.
_DERIVED = {
    "Erf": lambda dt: {"erf_exact": dt.itemsize == 8},
    # Gelu adds 1 to erf before rounding: the pieces' erf(4) = -1 + 1.5e-8 there would make
    # Gelu(-10) -7.5e-8 instead of -7.7e-23 and Gelu(-inf) -inf instead of NaN, so the exact erf
    "Gelu": lambda dt: {"cubic": dt.type(0.044715), "erf_exact": True,
                        "sqrt_2_over_pi": dt.type(math.sqrt(2 / math.pi))},
    "HardSwish": lambda dt: {"one_sixth": dt.type(1.0 / 6.0)},
}
# Constant operands a body reads as arrays laid out like its input (``filled_like``: NumPy's
# maximum and minimum against a scalar are 3-4x slower), by name in ``a``.
_FILLED_OPERANDS = {"Relu": {"zero": 0}}


# ---- factories -------------------------------------------------------------------------------

def unary_numpy(entry: Elementwise):
    """The kernel factory of a ``UNARY`` table entry."""
    fn = entry.fn

    def factory(ctx):
        if ctx.node.op_type == "Gelu":
            fast = onednn_gelu(ctx, [ctx.inputs[0], ctx.outputs[0]])
            if fast is not None:
                return fast
        a = attrs_for(ctx, ctx.inputs[0].dtype, _DERIVED.get(ctx.node.op_type))
        for name, value in _FILLED_OPERANDS.get(ctx.node.op_type, {}).items():
            setattr(a, name, filled_like(ctx.inputs[0], value))
        chunk = chunk_size(ctx, entry.scratch)
        request_scratch(ctx, entry.scratch, chunk)
        if chunk:
            pieces = Chunked(fn, a, chunk)

            def run(ins, outs, ws):
                pieces((ins[0], outs[0]), ws)
        else:
            def run(ins, outs, ws):
                fn(ins[0], outs[0], ws, a)

        return onednn_finite_eltwise(ctx, a, run) or run

    return factory


def unary_grad_numpy(entry: UnaryGrad):
    """The kernel factory of a ``UNARY_GRADS`` entry: ``<Op>Grad(gy, x, y) -> gx``."""
    fn = entry.fn

    def factory(ctx):
        if ctx.node.op_type == "GeluGrad" and ctx.has_input(1):
            fast = onednn_gelu(ctx, [ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]])
            if fast is not None:
                return fast
        a = attrs_for(ctx, ctx.inputs[0].dtype, entry.derived)
        scratch = entry.scratch(ctx.attrs) if callable(entry.scratch) else entry.scratch
        chunk = chunk_size(ctx, scratch)
        request_scratch(ctx, scratch, chunk)
        x_at = 1 if "x" in entry.reads else None
        y_at = 2 if "y" in entry.reads else None
        for i in (x_at, y_at):
            if i is not None and not ctx.has_input(i):
                raise ctx.error(f"input {i} ({'xy'[i - 1]}) is absent; the formula reads it")

        if chunk:
            pieces = Chunked(fn, a, chunk)

            def run(ins, outs, ws):
                pieces((ins[0], ins[x_at] if x_at else None, ins[y_at] if y_at else None,
                        outs[0]), ws)

            return run

        def run(ins, outs, ws):
            fn(ins[0], ins[x_at] if x_at else None, ins[y_at] if y_at else None, outs[0], ws, a)

        return run

    return factory


def _bound(value, dtype: np.dtype):
    """A Clip bound in the input's dtype, or None when it does not limit that dtype."""
    value = np.asarray(value).reshape(())
    if is_float(dtype):
        info = finfo(dtype)
        if not np.isnan(value) and not info.min <= float(value) <= info.max:
            return None
    return dtype.type(value)


def clip_numpy(ctx):
    """Clip: min/max attributes before opset 11, optional inputs after (constants are read at
    plan time; runtime bounds are read as 0-d views in ``run``). min(max(x, lo), hi), so a
    lower bound above the upper one gives the upper, as onnxruntime; one ``np.clip`` pass
    (NaN stays NaN; -0 stays -0, as in onnxruntime and onnx.reference), not a maximum and a
    minimum pass: [32, 8, 8, 64] float32 27 vs 41 us, 2 threads, 2026-12-02."""
    dtype = ctx.inputs[0].dtype
    for i in (1, 2):
        if ctx.has_input(i) and int(np.prod(ctx.inputs[i].shape)) != 1:
            raise ctx.error(f"bound {i} ({'min' if i == 1 else 'max'}) has shape "
                            f"{list(ctx.inputs[i].shape)}; a Clip bound is a scalar")
    if ctx.since_version < 11:
        lo = _bound(ctx.attrs["min"], dtype) if "min" in ctx.attrs else None
        hi = _bound(ctx.attrs["max"], dtype) if "max" in ctx.attrs else None
        runtime = ()
    else:
        lo = _bound(ctx.const(1), dtype) if ctx.const(1) is not None else None
        hi = _bound(ctx.const(2), dtype) if ctx.const(2) is not None else None
        runtime = tuple(i for i in (1, 2) if ctx.has_input(i) and ctx.const(i) is None)

    def run(ins, outs, ws):
        x, y = ins[0], outs[0]
        low = ins[1].reshape(()) if 1 in runtime else lo  # a 0-d view, no copy
        high = ins[2].reshape(()) if 2 in runtime else hi
        if low is None and high is None:
            np.copyto(y, x)
            return
        np.clip(x, low, high, out=y)

    return run


def clip_value_bound(node, bound, stats) -> float | None:
    """Both limits finite constants: the clip of a finite x lies between them."""
    x = bound(node.inputs[0])
    if node.since_version < 11:
        limits = [node.attrs.get(k) for k in ("min", "max")]
        limits = [None if v is None else np.float64(v) for v in limits]
    else:
        limits = []
        for i in (1, 2):
            v = node.inputs[i] if len(node.inputs) > i else None
            data = stats.data(v)
            if v is not None and (data is None or data.size != 1):
                return None  # a runtime or non-finite limit
            limits.append(None if data is None else data.reshape(()))
    if x is None or any(v is not None and not np.isfinite(v) for v in limits):
        return None
    if all(v is not None for v in limits):
        return float(max(abs(v) for v in limits))
    return max(x, *(abs(float(v)) for v in limits if v is not None))


# what bounds each op's values (``OpDef.value_bounds``): its input's bound (Relu, Neg, Abs),
# or [-1, 1] for any finite input
_VALUE_BOUNDS = {**dict.fromkeys(("Relu", "Neg", "Abs"), bounded_like_input),
                 **dict.fromkeys(("Sigmoid", "Tanh", "HardSigmoid", "Softsign", "Sin", "Cos"),
                                 unit_bounded)}


@hookimpl
def tr_onnx_op_definitions():
    defs = [OpDef(op, e.versions, {"numpy": unary_numpy(e)}, differentiable=e.differentiable,
                  gradient=e.vjp, value_bounds=_VALUE_BOUNDS.get(op)) for op, e in UNARY.items()]
    defs.append(OpDef("Clip", (1, 6, 11, 12, 13), {"numpy": clip_numpy}, differentiable=True,
                      gradient=_grad_op("Clip"), grad_inputs=(0,),
                      value_bounds=clip_value_bound))
    defs += [OpDef(f"{op}Grad", (1,), {"numpy": unary_grad_numpy(g)}, domain=INTERNAL_DOMAIN,
                   doc=f"gx of {op}: {_grad_signature(g.reads)}, the forward's attributes")
             for op, g in UNARY_GRADS.items()]
    return defs
