"""Elementwise ops: unary math and activations, broadcasting binary ops, variadic reductions
over inputs (Sum/Mean/Max/Min), Clip, Where, Cast/CastLike, Identity, Dropout (inference) and
the training-mode ``ai.tr_onnx.DropoutTraining``.

Most bodies are one line over NumPy ufuncs with ``out=``; they sit in two tables (``UNARY``,
``BINARY``) that one factory each turns into kernels. A body that needs intermediate arrays
names its scratch buffers in the table (``scratch``); the factory reserves them with
``ctx.workspace`` at plan time, so ``run`` allocates nothing. Inputs are logical views (maybe
channels-last and padded): bodies only read through them and write through ``out=``.

The tables' ``vjp`` column holds each op's gradient rule: it builds IR nodes (see
``tr_onnx.passes.autodiff``), one line or two per op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from ..dtypes import finfo, is_float, onnx_elem_type
from ..hookspecs import hookimpl
from ..opdef import OpDef


class Elementwise(NamedTuple):
    """A table entry. ``fn`` is the body: unary ``fn(x, y, t, a)``, binary ``fn(x1, x2, y, t, a)``
    where ``t`` are the scratch buffers and ``a`` the node's attributes (floats already in the
    input's dtype when it is a float type). ``scratch``: the scratch dtypes, a tuple of codes
    (``"y"``: the output's dtype, ``"x"``: input 0's, ``"f8"``: float64, ``"?"``: bool) or a
    callable ``(x_dtype, y_dtype) -> codes``; every buffer has the output's shape. ``vjp``: the
    gradient rule (``vjp(b, node, gys, needed)``) of a differentiable op."""

    versions: tuple[int, ...]
    fn: Callable
    differentiable: bool
    scratch: tuple[str, ...] | Callable = ()
    vjp: Callable | None = None


# ---- bodies that are more than one ufunc -----------------------------------------------------

_ERF_SPLIT = 2.0  # series below, continued fraction above (both reach float64 precision there)
# (series terms, continued-fraction terms) for float64 results and for float32/float16 ones
# (errors below 2e-16 and 2e-9 respectively, measured against the C library's erf)
_ERF_TERMS = {8: (30, 40), 4: (22, 12), 2: (22, 12)}
# erf(z) = 2/sqrt(pi) exp(-z^2) z sum_n (2 z^2)^n / (2n+1)!!  (all terms positive: no
# cancellation); the coefficients for Horner's scheme in u = z^2:
_ERF_SERIES = tuple(2.0 ** n / math.prod(range(1, 2 * n + 2, 2)) for n in range(30))
_ERF_SCRATCH = ("f8", "f8", "f8", "f8", "?")


def erf_float64(x, t, scale=1.0, terms=_ERF_TERMS[8]):
    """``erf(scale * x)`` into ``t[1]`` (float64), using ``t[0], t[2], t[3]`` (float64) and
    ``t[4]`` (bool) as scratch. NumPy has no erf; with the default ``terms`` this one is
    accurate to a few float64 ulps: the series above for |z| < 2 and, above, erfc's continued
    fraction erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + (2/2)/(z + (3/2)/(z + ...))))."""
    z, r, u, p, small = t
    n_series, n_cf = terms
    np.abs(x, out=z)
    if scale != 1.0:
        z *= scale
    np.less(z, _ERF_SPLIT, out=small)
    # continued fraction on max(z, split), evaluated from the bottom up
    np.maximum(z, _ERF_SPLIT, out=u)
    np.copyto(p, u)
    for n in range(n_cf, 0, -1):
        np.divide(n / 2.0, p, out=p)
        p += u
    np.square(u, out=r)
    np.negative(r, out=r)
    np.exp(r, out=r)
    r /= p
    r *= -1.0 / math.sqrt(math.pi)
    r += 1.0
    # series on min(z, split)
    np.minimum(z, _ERF_SPLIT, out=z)
    np.square(z, out=u)
    p.fill(_ERF_SERIES[n_series - 1])
    for c in _ERF_SERIES[n_series - 2::-1]:
        p *= u
        p += c
    p *= z
    np.negative(u, out=u)
    np.exp(u, out=u)
    p *= u
    p *= 2.0 / math.sqrt(math.pi)
    np.copyto(r, p, where=small)
    np.copysign(r, x, out=r)


def _erf(x, y, t, a):
    erf_float64(x, t, terms=a.erf_terms)
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
    erf_float64(x, t, 1.0 / math.sqrt(2.0), a.erf_terms)  # float64: erf is computed there
    r = t[1]
    r += 1.0
    r *= x
    r *= 0.5
    np.copyto(y, r, casting="same_kind")


def _sigmoid(x, y, t, a):
    # exp(-|x|) never overflows: 1/(1+e) for x >= 0, e/(1+e) below
    e, negative = t
    np.abs(x, out=e)
    np.negative(e, out=e)
    np.exp(e, out=e)
    np.add(e, 1, out=y)
    np.reciprocal(y, out=y)
    np.less(x, 0, out=negative)
    np.multiply(y, e, out=y, where=negative)


def _softplus(x, y, t, a):
    # log1p(exp(-|x|)) + max(x, 0): exact where exp(x) would overflow
    np.abs(x, out=y)
    np.negative(y, out=y)
    np.exp(y, out=y)
    np.log1p(y, out=y)
    np.maximum(x, 0, out=t[0])
    y += t[0]


def _mish(x, y, t, a):
    _softplus(x, y, t, a)
    np.tanh(y, out=y)
    y *= x


def _positive_plus(x, y, neg):
    """y = max(x, 0) + neg, where ``neg`` is what the op makes of min(x, 0): exact for both
    halves, since one term is always zero."""
    np.maximum(x, 0, out=y)
    y += neg


def _leaky_relu(x, y, t, a):
    np.minimum(x, 0, out=t[0])
    t[0] *= a.alpha
    _positive_plus(x, y, t[0])


def _elu(x, y, t, a):
    np.minimum(x, 0, out=t[0])
    np.expm1(t[0], out=t[0])
    t[0] *= a.alpha
    _positive_plus(x, y, t[0])


def _selu(x, y, t, a):
    _elu(x, y, t, a)
    y *= a.gamma


def _celu(x, y, t, a):
    np.minimum(x, 0, out=t[0])
    t[0] /= a.alpha
    np.expm1(t[0], out=t[0])
    t[0] *= a.alpha
    _positive_plus(x, y, t[0])


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


def _prelu(x, slope, y, t, a):
    np.minimum(x, 0, out=t[0])
    t[0] *= slope
    _positive_plus(x, y, t[0])


def _div(x1, x2, y, t, a):
    if y.dtype.kind in "iu" and t:
        # ONNX integer Div truncates toward zero; numpy floors. x1 - fmod(x1, x2) is an exact
        # multiple of x2, so flooring it divides exactly.
        np.fmod(x1, x2, out=t[0])
        np.subtract(x1, t[0], out=y)
        np.floor_divide(y, x2, out=y)
    elif y.dtype.kind in "iu":
        np.floor_divide(x1, x2, out=y)  # unsigned: floor is truncation
    else:
        np.divide(x1, x2, out=y)


def _div_scratch(x_dtype, y_dtype):
    return ("y",) if y_dtype.kind == "i" else ()


def _pow(x1, x2, y, t, a):
    # The exponent may have another dtype (Pow-12+): numpy computes in the common type and the
    # result is cast back to the base's dtype, as ONNX defines the output.
    np.power(x1, x2, out=y, casting="unsafe")


def _mod(x1, x2, y, t, a):
    (np.fmod if a.fmod else np.remainder)(x1, x2, out=y)


def _bit_shift(x1, x2, y, t, a):
    (np.left_shift if a.direction == "LEFT" else np.right_shift)(x1, x2, out=y)


def _ufunc1(ufunc):
    return lambda x, y, t, a: ufunc(x, out=y)


def _ufunc2(ufunc):
    return lambda x1, x2, y, t, a: ufunc(x1, x2, out=y)


# ---- gradient rules --------------------------------------------------------------------------
# Unary derivatives ``d(b, x, y, gy, a) -> gx`` build gy * f'(x) from the forward input ``x``,
# output ``y`` (Values), the output gradient ``gy`` and the node's attributes ``a`` (schema
# defaults filled); ``_unary`` turns one into a rule. Binary ones ``d(b, x1, x2, y, gy, a,
# needed) -> (g1, g2)`` give the gradients at the output's (broadcast) shape, None where not
# needed; ``_binary`` unbroadcasts them to the inputs' shapes. Constants take the input's dtype.

def _c(b, value: float, like):
    return b.scalar_like(value, like)


def _greater(b, x, value: float):
    return b.op("Greater", [x, _c(b, value, x)])


def _less(b, x, value: float):
    return b.op("Less", [x, _c(b, value, x)])


def _where(b, cond, a, c=None):
    """Where(cond, a, c), ``c`` defaulting to zero (broadcast to ``a``'s shape)."""
    return b.op("Where", [cond, a, c if c is not None else _c(b, 0.0, a)])


def _masked(b, cond, gy):
    """gy where ``cond``, else 0."""
    return _where(b, cond, gy)


def _scaled(b, g, value: float):
    return b.mul(g, _c(b, value, g))


def _unary(d):
    def vjp(b, node, gys, needed):
        if gys[0] is None or not needed[0]:
            return [None]
        return [d(b, node.inputs[0], node.outputs[0], gys[0], node.attrs)]

    return vjp


def _binary(d):
    def vjp(b, node, gys, needed):
        if gys[0] is None:
            return [None, None]
        (x1, x2), y = node.inputs, node.outputs[0]
        gs = d(b, x1, x2, y, gys[0], node.attrs, needed)
        return [b.unbroadcast(g, x.shape) if need and g is not None else None
                for g, x, need in zip(gs, (x1, x2), needed)]

    return vjp


def _cast(b, v, dtype: np.dtype):
    return v if v.dtype == dtype else b.op("Cast", [v], {"to": onnx_elem_type(dtype)})


def _one_minus_square(b, v):
    return b.sub(_c(b, 1.0, v), b.mul(v, v))


def _over_sqrt(b, gy, v):
    return b.div(gy, b.op("Sqrt", [v]))


def _hard_sigmoid_d(b, x, y, gy, a):
    inside = b.op("And", [_greater(b, y, 0.0), _less(b, y, 1.0)])  # slope alpha off the clamps
    return _masked(b, inside, _scaled(b, gy, a["alpha"]))


def _hard_swish_d(b, x, y, gy, a):
    # x/3 + 1/2 on (-3, 3), 1 above, 0 below
    inner = b.mul(gy, b.add(_scaled(b, x, 1.0 / 3.0), _c(b, 0.5, x)))
    return _where(b, _less(b, x, -3.0), _c(b, 0.0, gy), _where(b, _greater(b, x, 3.0), gy, inner))


def _erf_d(b, x, y, gy, a):  # 2/sqrt(pi) exp(-x^2)
    e = b.op("Exp", [b.neg(b.mul(x, x))])
    return b.mul(gy, _scaled(b, e, 2.0 / math.sqrt(math.pi)))


def _gelu_d(b, x, y, gy, a):
    x2 = b.mul(x, x)
    if a["approximate"] == "tanh":
        # y = x/2 (1 + t), t = tanh(c (x + k x^3)): y' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3k x^2)
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        t = b.op("Tanh", [_scaled(b, b.mul(x, b.add(_scaled(b, x2, k), _c(b, 1.0, x))), c)])
        slope = b.mul(_one_minus_square(b, t), b.add(_scaled(b, x2, 3 * k * c), _c(b, c, x)))
        d = b.add(b.add(t, _c(b, 1.0, t)), b.mul(x, slope))
        return b.mul(gy, _scaled(b, d, 0.5))
    # y = x Phi(x): y' = Phi(x) + x phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2
    cdf = b.add(b.op("Erf", [_scaled(b, x, 1.0 / math.sqrt(2.0))]), _c(b, 1.0, x))
    pdf = _scaled(b, b.op("Exp", [_scaled(b, x2, -0.5)]), 1.0 / math.sqrt(2.0 * math.pi))
    return b.mul(gy, b.add(_scaled(b, cdf, 0.5), b.mul(x, pdf)))


def _mish_d(b, x, y, gy, a):  # tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x), sp = softplus(x)
    t = b.op("Tanh", [b.op("Softplus", [x])])
    d = b.add(t, b.mul(x, b.mul(_one_minus_square(b, t), b.op("Sigmoid", [x]))))
    return b.mul(gy, d)


def _softsign_d(b, x, y, gy, a):  # 1 / (1 + |x|)^2
    s = b.add(b.op("Abs", [x]), _c(b, 1.0, x))
    return b.div(gy, b.mul(s, s))


def _mul_d(b, x1, x2, y, gy, a, needed):
    return (b.mul(gy, x2) if needed[0] else None, b.mul(gy, x1) if needed[1] else None)


def _div_d(b, x1, x2, y, gy, a, needed):  # d/dx2 (x1/x2) = -y/x2
    q = b.div(gy, x2)
    return q, (b.neg(b.mul(q, y)) if needed[1] else None)


def _pow_d(b, x1, x2, y, gy, a, needed):
    """x1^x2: x2 x1^(x2-1) for the base; y log(x1) for the exponent, 0 where x1 == 0 (the limit
    for a positive exponent, as PyTorch). Pow-12+ exponents may have another dtype: they are
    cast to the base's, and the exponent's gradient back."""
    e = _cast(b, x2, x1.dtype)
    g1 = g2 = None
    if needed[0]:
        power = b.op("Pow", [x1, b.sub(e, _c(b, 1.0, e))])
        g1 = b.mul(gy, b.mul(e, power))
    if needed[1]:
        at_zero = b.op("Equal", [x1, _c(b, 0.0, x1)])
        g2 = _cast(b, _where(b, at_zero, _c(b, 0.0, gy), b.mul(gy, b.mul(y, b.op("Log", [x1])))),
                   x2.dtype)
    return g1, g2


def _mod_d(b, x1, x2, y, gy, a, needed):
    """y = x1 - x2 q with q = trunc(x1/x2) (fmod) or floor(x1/x2): 1 for x1, -q for x2; q is
    recovered exactly as round((x1 - y) / x2)."""
    g2 = None
    if needed[1]:
        q = b.op("Round", [b.div(b.sub(x1, y), x2)])
        g2 = b.neg(b.mul(gy, q))
    return gy, g2


def _prelu_d(b, x, slope, y, gy, a, needed):
    positive = _greater(b, x, 0.0)
    g1 = _where(b, positive, gy, b.mul(gy, slope)) if needed[0] else None
    g2 = _where(b, positive, _c(b, 0.0, gy), b.mul(gy, x)) if needed[1] else None
    return g1, g2


def _sum_vjp(b, node, gys, needed, scale: float = 1.0):
    gy = gys[0]
    if gy is None:
        return [None] * len(node.inputs)
    if scale != 1.0:
        gy = _scaled(b, gy, scale)
    return [b.unbroadcast(gy, x.shape) if need else None for x, need in zip(node.inputs, needed)]


def _mean_vjp(b, node, gys, needed):
    return _sum_vjp(b, node, gys, needed, 1.0 / len(node.inputs))


def _extremum_vjp(b, node, gys, needed):
    """Max/Min: the whole gradient goes to the input that gave the output, the first one on a
    tie (as onnxruntime's and numpy's reductions pick it)."""
    gy, y = gys[0], node.outputs[0]
    if gy is None:
        return [None] * len(node.inputs)
    last = max((i for i, need in enumerate(needed) if need), default=-1)
    gxs, taken = [None] * len(node.inputs), None
    for i, x in enumerate(node.inputs[:last + 1]):
        hit = b.op("Equal", [x, y])
        first = hit if taken is None else b.op("And", [hit, b.op("Not", [taken])])
        if needed[i]:
            gxs[i] = b.unbroadcast(_masked(b, first, gy), x.shape)
        if i < last:
            taken = hit if taken is None else b.op("Or", [taken, hit])
    return gxs


def _clip_vjp(b, node, gys, needed):
    """Pass-through where Clip left x unchanged (inside [min, max], bounds included, whatever
    the opset put them in attributes or inputs); the bounds get no gradient."""
    x, y = node.inputs[0], node.outputs[0]
    if gys[0] is None or not needed[0]:
        return [None] * len(node.inputs)
    return [_masked(b, b.op("Equal", [x, y]), gys[0])] + [None] * (len(node.inputs) - 1)


def _where_vjp(b, node, gys, needed):
    cond, x1, x2 = node.inputs
    gy = gys[0]
    if gy is None:
        return [None] * 3
    zero = _c(b, 0.0, gy)
    return [None,
            b.unbroadcast(_where(b, cond, gy, zero), x1.shape) if needed[1] else None,
            b.unbroadcast(_where(b, cond, zero, gy), x2.shape) if needed[2] else None]


def _cast_vjp(b, node, gys, needed):
    """float -> float: the gradient cast back; a cast to or from a non-float type has none."""
    x, y, gy = node.inputs[0], node.outputs[0], gys[0]
    rest = [None] * (len(node.inputs) - 1)
    if gy is None or not needed[0] or not is_float(y.dtype) or not is_float(x.dtype):
        return [None] + rest
    return [_cast(b, gy, x.dtype)] + rest


def _identity_vjp(b, node, gys, needed):
    """Identity and inference Dropout: y = x; Dropout's ratio/training_mode get nothing."""
    return [gys[0] if needed[0] else None] + [None] * (len(node.inputs) - 1)


_TRIG_1 = (7, 22)  # Sin, Cos, Tan, Asin, Acos, Atan
_TRIG_2 = (9, 22)  # Sinh, Cosh, Asinh, Acosh, Atanh
_MATH = (1, 6, 13)  # Exp, Log, Sqrt, Reciprocal, Neg, Abs, Floor, Ceil, Tanh, Sigmoid

UNARY: dict[str, Elementwise] = {
    "Relu": Elementwise((1, 6, 13, 14), lambda x, y, t, a: np.maximum(x, 0, out=y), True,
                        vjp=_unary(lambda b, x, y, gy, a: _masked(b, _greater(b, x, 0), gy))),
    "LeakyRelu": Elementwise((1, 6, 16), _leaky_relu, True, ("y",), _unary(
        lambda b, x, y, gy, a: _where(b, _greater(b, x, 0), gy, _scaled(b, gy, a["alpha"])))),
    "Elu": Elementwise((1, 6, 22), _elu, True, ("y",), _unary(  # alpha e^x = y + alpha below 0
        lambda b, x, y, gy, a: _where(b, _greater(b, x, 0), gy,
                                      b.mul(gy, b.add(y, _c(b, a["alpha"], y)))))),
    "Selu": Elementwise((1, 6, 22), _selu, True, ("y",), _unary(
        lambda b, x, y, gy, a: _where(b, _greater(b, x, 0), _scaled(b, gy, a["gamma"]),
                                      b.mul(gy, b.add(y, _c(b, a["gamma"] * a["alpha"], y)))))),
    "Celu": Elementwise((12, 28), _celu, True, ("y",), _unary(  # e^(x/alpha) = y/alpha + 1
        lambda b, x, y, gy, a: _where(b, _greater(b, x, 0), gy, b.mul(
            gy, b.add(_scaled(b, y, 1.0 / a["alpha"]), _c(b, 1.0, y)))))),
    "ThresholdedRelu": Elementwise((10, 22), _thresholded_relu, True, ("?",), _unary(
        lambda b, x, y, gy, a: _masked(b, _greater(b, x, a["alpha"]), gy))),
    "Sigmoid": Elementwise(_MATH, _sigmoid, True, ("y", "?"), _unary(
        lambda b, x, y, gy, a: b.mul(gy, b.mul(y, b.sub(_c(b, 1.0, y), y))))),
    "HardSigmoid": Elementwise((1, 6, 22), _hard_sigmoid, True, vjp=_unary(_hard_sigmoid_d)),
    "HardSwish": Elementwise((14, 22), _hard_swish, True, vjp=_unary(_hard_swish_d)),
    "Tanh": Elementwise(_MATH, _ufunc1(np.tanh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, _one_minus_square(b, y)))),
    "Erf": Elementwise((9, 13), _erf, True, _ERF_SCRATCH, _unary(_erf_d)),
    "Gelu": Elementwise((20,), _gelu, True, _ERF_SCRATCH, _unary(_gelu_d)),
    "Softplus": Elementwise((1, 22), _softplus, True, ("y",), _unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Sigmoid", [x])))),
    "Softsign": Elementwise((1, 22), _softsign, True, vjp=_unary(_softsign_d)),
    "Mish": Elementwise((18, 22), _mish, True, ("y",), _unary(_mish_d)),
    "Exp": Elementwise(_MATH, _ufunc1(np.exp), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, y))),
    "Log": Elementwise(_MATH, _ufunc1(np.log), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, x))),
    "Sqrt": Elementwise(_MATH, _ufunc1(np.sqrt), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(_scaled(b, gy, 0.5), y))),
    "Reciprocal": Elementwise(_MATH, _ufunc1(np.reciprocal), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(b.mul(gy, b.mul(y, y))))),
    "Neg": Elementwise(_MATH, _ufunc1(np.negative), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(gy))),
    "Abs": Elementwise(_MATH, _ufunc1(np.absolute), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Sign", [x])))),
    "Sign": Elementwise((9, 13), _ufunc1(np.sign), False),
    "Floor": Elementwise(_MATH, _ufunc1(np.floor), False),
    "Ceil": Elementwise(_MATH, _ufunc1(np.ceil), False),
    "Round": Elementwise((11, 22), _ufunc1(np.rint), False),  # half to even, as ONNX
    "Sin": Elementwise(_TRIG_1, _ufunc1(np.sin), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Cos", [x])))),
    "Cos": Elementwise(_TRIG_1, _ufunc1(np.cos), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(b.mul(gy, b.op("Sin", [x]))))),
    "Tan": Elementwise(_TRIG_1, _ufunc1(np.tan), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.add(_c(b, 1.0, y), b.mul(y, y))))),
    "Asin": Elementwise(_TRIG_1, _ufunc1(np.arcsin), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, _one_minus_square(b, x)))),
    "Acos": Elementwise(_TRIG_1, _ufunc1(np.arccos), True, vjp=_unary(
        lambda b, x, y, gy, a: b.neg(_over_sqrt(b, gy, _one_minus_square(b, x))))),
    "Atan": Elementwise(_TRIG_1, _ufunc1(np.arctan), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, b.add(_c(b, 1.0, x), b.mul(x, x))))),
    "Sinh": Elementwise(_TRIG_2, _ufunc1(np.sinh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Cosh", [x])))),
    "Cosh": Elementwise(_TRIG_2, _ufunc1(np.cosh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.mul(gy, b.op("Sinh", [x])))),
    "Asinh": Elementwise(_TRIG_2, _ufunc1(np.arcsinh), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, b.add(b.mul(x, x), _c(b, 1.0, x))))),
    "Acosh": Elementwise(_TRIG_2, _ufunc1(np.arccosh), True, vjp=_unary(
        lambda b, x, y, gy, a: _over_sqrt(b, gy, b.sub(b.mul(x, x), _c(b, 1.0, x))))),
    "Atanh": Elementwise(_TRIG_2, _ufunc1(np.arctanh), True, vjp=_unary(
        lambda b, x, y, gy, a: b.div(gy, _one_minus_square(b, x)))),
    "IsNaN": Elementwise((9, 13, 20), _ufunc1(np.isnan), False),
    "IsInf": Elementwise((10, 20), _is_inf, False),
    "Not": Elementwise((1,), _ufunc1(np.logical_not), False),
    "BitwiseNot": Elementwise((18,), _ufunc1(np.invert), False),
    "Shrink": Elementwise((9,), _shrink, True, ("?", "?"), _unary(  # slope 1 outside the band
        lambda b, x, y, gy, a: _masked(b, _greater(b, b.op("Abs", [x]), a["lambd"]), gy))),
}

_ARITH = (1, 6, 7, 13, 14)  # Add, Sub, Mul, Div

BINARY: dict[str, Elementwise] = {
    "Add": Elementwise(_ARITH, _ufunc2(np.add), True, vjp=_binary(
        lambda b, x1, x2, y, gy, a, needed: (gy, gy))),
    "Sub": Elementwise(_ARITH, _ufunc2(np.subtract), True, vjp=_binary(
        lambda b, x1, x2, y, gy, a, needed: (
            gy, b.neg(b.unbroadcast(gy, x2.shape)) if needed[1] else None))),
    "Mul": Elementwise(_ARITH, _ufunc2(np.multiply), True, vjp=_binary(_mul_d)),
    "Div": Elementwise(_ARITH, _div, True, _div_scratch, _binary(_div_d)),
    "Pow": Elementwise((1, 7, 12, 13, 15), _pow, True, vjp=_binary(_pow_d)),
    "Mod": Elementwise((10, 13, 28), _mod, True, vjp=_binary(_mod_d)),
    "BitShift": Elementwise((11, 28), _bit_shift, False),
    "PRelu": Elementwise((1, 6, 7, 9, 16), _prelu, True, ("y",), _binary(_prelu_d)),
    "Equal": Elementwise((1, 7, 11, 13, 19), _ufunc2(np.equal), False),
    "Less": Elementwise((1, 7, 9, 13), _ufunc2(np.less), False),
    "LessOrEqual": Elementwise((12, 16), _ufunc2(np.less_equal), False),
    "Greater": Elementwise((1, 7, 9, 13), _ufunc2(np.greater), False),
    "GreaterOrEqual": Elementwise((12, 16), _ufunc2(np.greater_equal), False),
    "And": Elementwise((1, 7), _ufunc2(np.logical_and), False),
    "Or": Elementwise((1, 7), _ufunc2(np.logical_or), False),
    "Xor": Elementwise((1, 7), _ufunc2(np.logical_xor), False),
    "BitwiseAnd": Elementwise((18,), _ufunc2(np.bitwise_and), False),
    "BitwiseOr": Elementwise((18,), _ufunc2(np.bitwise_or), False),
    "BitwiseXor": Elementwise((18,), _ufunc2(np.bitwise_xor), False),
}

# Constants some bodies need, computed once per node in the input's float dtype.
_DERIVED = {
    "Erf": lambda dt: {"erf_terms": _ERF_TERMS[dt.itemsize]},
    "Gelu": lambda dt: {"cubic": dt.type(0.044715), "erf_terms": _ERF_TERMS[dt.itemsize],
                        "sqrt_2_over_pi": dt.type(math.sqrt(2 / math.pi))},
    "HardSwish": lambda dt: {"one_sixth": dt.type(1.0 / 6.0)},
}


# ---- factories -------------------------------------------------------------------------------

def _attrs_for(ctx, dtype: np.dtype) -> SimpleNamespace:
    """The node's attributes, floats as ``dtype`` scalars when ``dtype`` is a float type (so a
    float32 kernel multiplies by a float32 alpha, as onnxruntime does) and as Python ints for
    integer types; every float attribute is also kept as a Python float under ``<name>_f``."""
    a = {}
    for k, v in ctx.attrs.items():
        if isinstance(v, float):
            a[k + "_f"] = v
            v = dtype.type(v) if is_float(dtype) else int(v)
        a[k] = v
    if is_float(dtype):
        a.update(_DERIVED.get(ctx.node.op_type, lambda dt: {})(dtype))
    return SimpleNamespace(**a)


def _request_scratch(ctx, entry: Elementwise) -> None:
    """Reserve the entry's scratch buffers; being the node's only requests, they are ``ws``."""
    x_dtype, y = ctx.inputs[0].dtype, ctx.outputs[0]
    codes = entry.scratch(x_dtype, y.dtype) if callable(entry.scratch) else entry.scratch
    dtypes = {"y": y.dtype, "x": x_dtype, "f8": np.dtype(np.float64), "?": np.dtype(np.bool_)}
    for c in codes:
        ctx.workspace(y.shape, dtypes[c])


def unary_numpy(entry: Elementwise):
    """The kernel factory of a ``UNARY`` table entry."""
    fn = entry.fn

    def factory(ctx):
        a = _attrs_for(ctx, ctx.inputs[0].dtype)
        _request_scratch(ctx, entry)

        def run(ins, outs, ws):
            fn(ins[0], outs[0], ws, a)

        return run

    return factory


def _legacy_broadcast_index(ctx, rank_x1: int, rank_x2: int) -> tuple | None:
    """Opset < 7 ``broadcast=1, axis=k``: x2's dims align with x1's from axis k; numpy aligns
    trailing dims, so x2 gets (rank_x1 - k - rank_x2) trailing unit axes (a view)."""
    if ctx.since_version >= 7 or not ctx.attrs.get("broadcast") or "axis" not in ctx.attrs:
        return None
    axis = ctx.attrs["axis"] % max(rank_x1, 1)
    extra = rank_x1 - axis - rank_x2
    return (Ellipsis,) + (None,) * extra if extra > 0 else None


def _prelu_legacy_index(ctx, shape_x, shape_slope) -> tuple | None:
    """PRelu < 7: a 1-D slope of size C holds one value per channel (axis 1)."""
    if (ctx.since_version >= 7 or len(shape_slope) != 1 or len(shape_x) < 3
            or shape_slope[0] == 1 or shape_slope[0] != shape_x[1]):
        return None
    return (Ellipsis,) + (None,) * (len(shape_x) - 2)


def binary_numpy(entry: Elementwise):
    """The kernel factory of a ``BINARY`` table entry (numpy broadcasting: ONNX multidirectional
    broadcasting, and PRelu's unidirectional one, are the same rule)."""
    fn = entry.fn

    def factory(ctx):
        a = _attrs_for(ctx, ctx.inputs[0].dtype)
        _request_scratch(ctx, entry)
        shape_x1, shape_x2 = ctx.inputs[0].shape, ctx.inputs[1].shape
        index = (_prelu_legacy_index(ctx, shape_x1, shape_x2) if ctx.node.op_type == "PRelu"
                 else _legacy_broadcast_index(ctx, len(shape_x1), len(shape_x2)))

        if index is None:
            def run(ins, outs, ws):
                fn(ins[0], ins[1], outs[0], ws, a)
        else:
            def run(ins, outs, ws):
                fn(ins[0], ins[1][index], outs[0], ws, a)

        return run

    return factory


def variadic_numpy(ufunc, mean: bool = False):
    """Sum/Mean/Max/Min over any number of inputs (broadcast from opset 8; before, all inputs
    have one shape, which broadcasting handles alike)."""

    def factory(ctx):
        n = len(ctx.inputs)

        def run(ins, outs, ws):
            y = outs[0]
            np.copyto(y, ins[0])
            for x in ins[1:]:
                ufunc(y, x, out=y)
            if mean:
                y /= n

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
    lower bound above the upper one gives the upper, as onnxruntime."""
    dtype = ctx.inputs[0].dtype
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
        if low is not None:
            np.maximum(x, low, out=y)
            x = y
        if high is not None:
            np.minimum(x, high, out=y)

    return run


_BIT_PATTERNS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                 8: np.dtype(np.uint64)}


def _all_bits_zero(value: np.ndarray | None) -> bool:
    """Whether a plan-time constant is +0 everywhere (its bytes are all zero; -0.0 is not)."""
    return value is not None and not np.ascontiguousarray(value).reshape(-1).view(np.uint8).any()


def where_numpy(ctx):
    """Where as unsigned integer arithmetic on the values' bit patterns (``x * cond`` keeps or
    zeroes a pattern exactly, NaN and -0.0 included): a masked ``np.copyto(where=)`` runs ~15x
    slower than a multiply by the bool mask. The gradient rules' ``Where(cond, gy, 0)`` and
    ``Where(cond, 0, gy)`` take one and two passes; the general case three, b + (a - b) * cond
    with wrap-around. Other dtypes (strings, complex128) keep the masked copy."""
    dtype = np.dtype(ctx.outputs[0].dtype)
    bits = _BIT_PATTERNS.get(dtype.itemsize) if dtype.kind in "biufc" or is_float(dtype) \
        else None

    def masked_copy(ins, outs, ws):
        np.copyto(outs[0], ins[2])
        np.copyto(outs[0], ins[1], where=ins[0])

    if bits is None:
        return masked_copy
    if _all_bits_zero(ctx.const(2)):
        def run(ins, outs, ws):
            np.multiply(ins[1].view(bits), ins[0], out=outs[0].view(bits))
    elif _all_bits_zero(ctx.const(1)):
        def run(ins, outs, ws):
            b, y = ins[2], outs[0]
            if np.may_share_memory(y, b):  # b is read again after y is written
                masked_copy(ins, outs, ws)
                return
            b, y = b.view(bits), y.view(bits)
            np.multiply(b, ins[0], out=y)
            np.subtract(b, y, out=y)
    else:
        def run(ins, outs, ws):
            b, y = ins[2], outs[0]
            if np.may_share_memory(y, b):
                masked_copy(ins, outs, ws)
                return
            b, y = b.view(bits), y.view(bits)
            np.subtract(ins[1].view(bits), b, out=y)
            np.multiply(y, ins[0], out=y)
            np.add(y, b, out=y)

    return run


def cast_numpy(ctx):
    """Cast/CastLike: the output's dtype (from ``to`` or the second input) is already known
    from shape inference; C-style conversion as onnxruntime (float -> int truncates)."""

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0], casting="unsafe")

    return run


def copy_numpy(ctx):
    """Identity where it cannot be a view (layouts differ): a strided copy."""

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])

    return run


def dropout_numpy(ctx):
    """Inference Dropout: y = x, the optional mask all ones (True). Training mode with a
    constant ratio of 0 drops nothing, so it is the same; any other training mode is not."""
    if ctx.since_version >= 12:
        training, ratio = ctx.const(2), ctx.const(1)
        drops = ratio is None or float(np.asarray(ratio).reshape(())) != 0.0  # default 0.5
        if training is not None and bool(np.asarray(training).reshape(())) and drops:
            raise ctx.error("training-mode Dropout needs the training session")
    with_mask = ctx.has_output(1)

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])
        if with_mask:
            outs[1].fill(1)

    return run


_CAST_LIKE = (15, 19, 21, 23, 24, 25)
_CAST = (1, 6, 9, 13, 19, 21, 23, 24, 25, 28)
_IDENTITY = (1, 13, 14, 16, 19, 21, 23, 24, 25)
_VARIADIC = {  # op: (versions, ufunc, gradient rule)
    "Sum": ((1, 6, 8, 13), np.add, _sum_vjp),
    "Mean": ((1, 6, 8, 13), np.add, _mean_vjp),
    "Max": ((1, 6, 8, 12, 13), np.maximum, _extremum_vjp),
    "Min": ((1, 6, 8, 12, 13), np.minimum, _extremum_vjp),
}


# ---- training-mode dropout -------------------------------------------------------------------

def dropout_training_numpy(ctx):
    """``ai.tr_onnx.DropoutTraining(x, step) -> (y, mask)``: mask = u >= ratio for uniforms u
    drawn from Philox(key=seed) jumped ``step`` times, y = x * mask / (1 - ratio). The stream is
    counter-based: the mask of a step depends only on (seed, step), so a run resumed from a
    checkpoint redraws it bitwise. The uniforms are float64 in the logical C order of x's shape
    whatever x's dtype and layout, so the mask does not depend on either."""
    missing = [k for k in ("ratio", "seed") if k not in ctx.attrs]
    if missing:
        raise ctx.error(f"DropoutTraining needs the attributes {missing} (internal ops have "
                        f"no defaults)")
    ratio = float(ctx.attrs["ratio"])
    if not 0.0 <= ratio <= 1.0:
        raise ctx.error(f"ratio {ratio} is not in [0, 1]")
    scale = ctx.inputs[0].dtype.type(_dropout_scale(ratio))
    if ratio == 0.0:
        def run(ins, outs, ws):
            np.copyto(outs[0], ins[0])
            outs[1].fill(True)

        return run
    k = ctx.workspace(ctx.inputs[0].shape, np.float64)
    stream = np.random.Philox(key=int(ctx.attrs["seed"]) % 2**64)  # a negative seed wraps

    def run(ins, outs, ws):
        x, step = ins
        u, (y, mask) = ws[k], outs
        # jumped() leaves ``stream`` as it is; the small Generator/Philox pair it makes per
        # step is an unavoidable temporary (the stream position changes every step)
        rng = np.random.Generator(stream.jumped(int(step.reshape(()))))
        rng.random(out=u.reshape(-1))
        np.greater_equal(u, ratio, out=mask)
        np.multiply(x, mask, out=y)
        y *= scale

    return run


def _dropout_scale(ratio: float) -> float:
    return 0.0 if ratio >= 1.0 else 1.0 / (1.0 - ratio)


def _dropout_training_shape(node, shapes, dtypes):
    return [(shapes[0], dtypes[0]), (shapes[0], np.dtype(np.bool_))]


def _dropout_training_vjp(b, node, gys, needed):
    """gx = gy * mask / (1 - ratio); the step counter gets nothing."""
    gy, mask = gys[0], node.outputs[1]
    if gy is None or not needed[0]:
        return [None, None]
    return [_masked(b, mask, _scaled(b, gy, _dropout_scale(float(node.attrs["ratio"])))), None]


@hookimpl
def tr_onnx_op_definitions():
    defs = [OpDef(op, e.versions, {"numpy": unary_numpy(e)}, differentiable=e.differentiable,
                  gradient=e.vjp) for op, e in UNARY.items()]
    defs += [OpDef(op, e.versions, {"numpy": binary_numpy(e)}, differentiable=e.differentiable,
                   gradient=e.vjp) for op, e in BINARY.items()]
    defs += [OpDef(op, versions, {"numpy": variadic_numpy(ufunc, mean=op == "Mean")},
                   differentiable=True, gradient=vjp)
             for op, (versions, ufunc, vjp) in _VARIADIC.items()]
    defs += [
        OpDef("Clip", (1, 6, 11, 12, 13), {"numpy": clip_numpy}, differentiable=True,
              gradient=_clip_vjp, grad_inputs=(0,)),
        OpDef("Where", (9, 16), {"numpy": where_numpy}, differentiable=True,
              gradient=_where_vjp, grad_inputs=(1, 2)),
        OpDef("Cast", _CAST, {"numpy": cast_numpy}, differentiable=True, gradient=_cast_vjp),
        OpDef("CastLike", _CAST_LIKE, {"numpy": cast_numpy}, differentiable=True,
              gradient=_cast_vjp, grad_inputs=(0,)),
        OpDef("Identity", _IDENTITY, {"numpy": copy_numpy}, alias_output=True,
              differentiable=True, gradient=_identity_vjp),
        OpDef("Dropout", (1, 6, 7, 10, 12, 13, 22), {"numpy": dropout_numpy},
              const_inputs=(1, 2), differentiable=True, gradient=_identity_vjp,
              grad_inputs=(0,)),
        OpDef("DropoutTraining", (1,), {"numpy": dropout_training_numpy}, domain="ai.tr_onnx",
              shape=_dropout_training_shape, differentiable=True,
              gradient=_dropout_training_vjp, grad_inputs=(0,),
              doc="Training-mode dropout with a counter-based mask: inputs (x, step: int64 "
                  "scalar), attributes ratio (float), seed (int); outputs (y, mask: bool)."),
    ]
    return defs
