"""Elementwise ops: unary math and activations, broadcasting binary ops, variadic reductions
over inputs (Sum/Mean/Max/Min), Clip, Where, Cast/CastLike, Identity, Dropout (inference).

Most bodies are one line over NumPy ufuncs with ``out=``; they sit in two tables (``UNARY``,
``BINARY``) that one factory each turns into kernels. A body that needs intermediate arrays
names its scratch buffers in the table (``scratch``); the factory reserves them with
``ctx.workspace`` at plan time, so ``run`` allocates nothing. Inputs are logical views (maybe
channels-last and padded): bodies only read through them and write through ``out=``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import OpDef


class Elementwise(NamedTuple):
    """A table entry. ``fn`` is the body: unary ``fn(x, y, t, a)``, binary ``fn(x1, x2, y, t, a)``
    where ``t`` are the scratch buffers and ``a`` the node's attributes (floats already in the
    input's dtype when it is a float type). ``scratch``: the scratch dtypes, a tuple of codes
    (``"y"``: the output's dtype, ``"x"``: input 0's, ``"f8"``: float64, ``"?"``: bool) or a
    callable ``(x_dtype, y_dtype) -> codes``; every buffer has the output's shape."""

    versions: tuple[int, ...]
    fn: Callable
    differentiable: bool
    scratch: tuple[str, ...] | Callable = ()


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


_TRIG_1 = (7, 22)  # Sin, Cos, Tan, Asin, Acos, Atan
_TRIG_2 = (9, 22)  # Sinh, Cosh, Asinh, Acosh, Atanh
_MATH = (1, 6, 13)  # Exp, Log, Sqrt, Reciprocal, Neg, Abs, Floor, Ceil, Tanh, Sigmoid

UNARY: dict[str, Elementwise] = {
    "Relu": Elementwise((1, 6, 13, 14), lambda x, y, t, a: np.maximum(x, 0, out=y), True),
    "LeakyRelu": Elementwise((1, 6, 16), _leaky_relu, True, ("y",)),
    "Elu": Elementwise((1, 6, 22), _elu, True, ("y",)),
    "Selu": Elementwise((1, 6, 22), _selu, True, ("y",)),
    "Celu": Elementwise((12, 28), _celu, True, ("y",)),
    "ThresholdedRelu": Elementwise((10, 22), _thresholded_relu, True, ("?",)),
    "Sigmoid": Elementwise(_MATH, _sigmoid, True, ("y", "?")),
    "HardSigmoid": Elementwise((1, 6, 22), _hard_sigmoid, True),
    "HardSwish": Elementwise((14, 22), _hard_swish, True),
    "Tanh": Elementwise(_MATH, _ufunc1(np.tanh), True),
    "Erf": Elementwise((9, 13), _erf, True, _ERF_SCRATCH),
    "Gelu": Elementwise((20,), _gelu, True, _ERF_SCRATCH),
    "Softplus": Elementwise((1, 22), _softplus, True, ("y",)),
    "Softsign": Elementwise((1, 22), _softsign, True),
    "Mish": Elementwise((18, 22), _mish, True, ("y",)),
    "Exp": Elementwise(_MATH, _ufunc1(np.exp), True),
    "Log": Elementwise(_MATH, _ufunc1(np.log), True),
    "Sqrt": Elementwise(_MATH, _ufunc1(np.sqrt), True),
    "Reciprocal": Elementwise(_MATH, _ufunc1(np.reciprocal), True),
    "Neg": Elementwise(_MATH, _ufunc1(np.negative), True),
    "Abs": Elementwise(_MATH, _ufunc1(np.absolute), True),
    "Sign": Elementwise((9, 13), _ufunc1(np.sign), False),
    "Floor": Elementwise(_MATH, _ufunc1(np.floor), False),
    "Ceil": Elementwise(_MATH, _ufunc1(np.ceil), False),
    "Round": Elementwise((11, 22), _ufunc1(np.rint), False),  # half to even, as ONNX
    "Sin": Elementwise(_TRIG_1, _ufunc1(np.sin), True),
    "Cos": Elementwise(_TRIG_1, _ufunc1(np.cos), True),
    "Tan": Elementwise(_TRIG_1, _ufunc1(np.tan), True),
    "Asin": Elementwise(_TRIG_1, _ufunc1(np.arcsin), True),
    "Acos": Elementwise(_TRIG_1, _ufunc1(np.arccos), True),
    "Atan": Elementwise(_TRIG_1, _ufunc1(np.arctan), True),
    "Sinh": Elementwise(_TRIG_2, _ufunc1(np.sinh), True),
    "Cosh": Elementwise(_TRIG_2, _ufunc1(np.cosh), True),
    "Asinh": Elementwise(_TRIG_2, _ufunc1(np.arcsinh), True),
    "Acosh": Elementwise(_TRIG_2, _ufunc1(np.arccosh), True),
    "Atanh": Elementwise(_TRIG_2, _ufunc1(np.arctanh), True),
    "IsNaN": Elementwise((9, 13, 20), _ufunc1(np.isnan), False),
    "IsInf": Elementwise((10, 20), _is_inf, False),
    "Not": Elementwise((1,), _ufunc1(np.logical_not), False),
    "BitwiseNot": Elementwise((18,), _ufunc1(np.invert), False),
    "Shrink": Elementwise((9,), _shrink, True, ("?", "?")),
}

_ARITH = (1, 6, 7, 13, 14)  # Add, Sub, Mul, Div

BINARY: dict[str, Elementwise] = {
    "Add": Elementwise(_ARITH, _ufunc2(np.add), True),
    "Sub": Elementwise(_ARITH, _ufunc2(np.subtract), True),
    "Mul": Elementwise(_ARITH, _ufunc2(np.multiply), True),
    "Div": Elementwise(_ARITH, _div, True, _div_scratch),
    "Pow": Elementwise((1, 7, 12, 13, 15), _pow, True),
    "Mod": Elementwise((10, 13, 28), _mod, False),
    "BitShift": Elementwise((11, 28), _bit_shift, False),
    "PRelu": Elementwise((1, 6, 7, 9, 16), _prelu, True, ("y",)),
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
            v = dtype.type(v) if dtype.kind == "f" else int(v)
        a[k] = v
    if dtype.kind == "f":
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
    if dtype.kind == "f":
        info = np.finfo(dtype)
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


def where_numpy(ctx):
    def run(ins, outs, ws):
        np.copyto(outs[0], ins[2])
        np.copyto(outs[0], ins[1], where=ins[0])

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
_VARIADIC = {  # op: (versions, ufunc, differentiable)
    "Sum": ((1, 6, 8, 13), np.add, True),
    "Mean": ((1, 6, 8, 13), np.add, True),
    "Max": ((1, 6, 8, 12, 13), np.maximum, True),
    "Min": ((1, 6, 8, 12, 13), np.minimum, True),
}


@hookimpl
def tr_onnx_op_definitions():
    defs = [OpDef(op, e.versions, {"numpy": unary_numpy(e)}, differentiable=e.differentiable)
            for op, e in UNARY.items()]
    defs += [OpDef(op, e.versions, {"numpy": binary_numpy(e)}, differentiable=e.differentiable)
             for op, e in BINARY.items()]
    defs += [OpDef(op, versions, {"numpy": variadic_numpy(ufunc, mean=op == "Mean")},
                   differentiable=diff) for op, (versions, ufunc, diff) in _VARIADIC.items()]
    defs += [
        OpDef("Clip", (1, 6, 11, 12, 13), {"numpy": clip_numpy}, differentiable=True),
        OpDef("Where", (9, 16), {"numpy": where_numpy}, differentiable=True),
        OpDef("Cast", _CAST, {"numpy": cast_numpy}, differentiable=True),
        OpDef("CastLike", _CAST_LIKE, {"numpy": cast_numpy}, differentiable=True),
        OpDef("Identity", _IDENTITY, {"numpy": copy_numpy}, alias_output=True,
              differentiable=True),
        OpDef("Dropout", (1, 6, 7, 10, 12, 13, 22), {"numpy": dropout_numpy},
              const_inputs=(1, 2), differentiable=True),
    ]
    return defs
