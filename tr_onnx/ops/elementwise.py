"""Elementwise ops of several inputs: broadcasting binary ops (arithmetic, comparisons, logic,
bitwise, PRelu), variadic Sum/Mean/Max/Min, Where, Cast/CastLike and Identity. The one-input
ops (activations, math, Clip) are ``ops/unary.py``, and Dropout ``ops/dropout.py``; both build
on what this module shares: the ``Elementwise`` table entry, the attribute and scratch helpers
of the kernel factories and the small node builders gradient rules are written with.

Most bodies are one line over NumPy ufuncs with ``out=``; they sit in a table (``BINARY``, and
``UNARY`` in ops/unary.py) that one factory turns into kernels. A body that needs intermediate
arrays names its scratch buffers in the table (``scratch``); the factory reserves them with
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

from ..dtypes import cast_into, cast_scratch, is_float, onnx_elem_type
from ..hookspecs import hookimpl
from ..opdef import LAYOUT_ONLY, MASK_PATH, OpDef, bounded_like_input


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


# ---- bodies ----------------------------------------------------------------------------------

def positive_plus(x, y, neg):
    """y = max(x, 0) + neg, where ``neg`` is what the op makes of min(x, 0): exact for both
    halves, since one term is always zero (PRelu here; LeakyRelu, Elu, Celu in ops/unary.py)."""
    np.maximum(x, 0, out=y)
    y += neg


def _prelu(x, slope, y, t, a):
    np.minimum(x, 0, out=t[0])
    t[0] *= slope
    positive_plus(x, y, t[0])


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


def _ufunc2(ufunc):
    return lambda x1, x2, y, t, a: ufunc(x1, x2, out=y)


# ---- gradient rules --------------------------------------------------------------------------
# Binary derivatives ``d(b, x1, x2, y, gy, a, needed) -> (g1, g2)`` give the gradients at the
# output's (broadcast) shape, None where not needed; ``_binary`` unbroadcasts them to the
# inputs' shapes. The node builders below are shared with ops/unary.py's rules; constants take
# the dtype of the Value they combine with.

def const_like(b, value: float, like):
    """A scalar constant of ``like``'s dtype."""
    return b.scalar_like(value, like)


def greater_than(b, x, value: float):
    return b.op("Greater", [x, const_like(b, value, x)])


def where(b, cond, a, c=None):
    """Where(cond, a, c), ``c`` defaulting to zero (broadcast to ``a``'s shape)."""
    return b.op("Where", [cond, a, c if c is not None else const_like(b, 0.0, a)])


def masked(b, cond, gy):
    """gy where ``cond``, else 0."""
    return where(b, cond, gy)


def scaled(b, g, value: float):
    """g * value."""
    return b.mul(g, const_like(b, value, g))


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
        power = b.op("Pow", [x1, b.sub(e, const_like(b, 1.0, e))])
        g1 = b.mul(gy, b.mul(e, power))
    if needed[1]:
        at_zero = b.op("Equal", [x1, const_like(b, 0.0, x1)])
        g_log = b.mul(gy, b.mul(y, b.op("Log", [x1])))
        g2 = _cast(b, where(b, at_zero, const_like(b, 0.0, gy), g_log), x2.dtype)
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
    positive = greater_than(b, x, 0.0)
    g1 = where(b, positive, gy, b.mul(gy, slope)) if needed[0] else None
    g2 = where(b, positive, const_like(b, 0.0, gy), b.mul(gy, x)) if needed[1] else None
    return g1, g2


def _sum_vjp(b, node, gys, needed, scale: float = 1.0):
    gy = gys[0]
    if gy is None:
        return [None] * len(node.inputs)
    if scale != 1.0:
        gy = scaled(b, gy, scale)
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
            gxs[i] = b.unbroadcast(masked(b, first, gy), x.shape)
        if i < last:
            taken = hit if taken is None else b.op("Or", [taken, hit])
    return gxs


def _where_vjp(b, node, gys, needed):
    cond, x1, x2 = node.inputs
    gy = gys[0]
    if gy is None:
        return [None] * 3
    zero = const_like(b, 0.0, gy)
    return [None,
            b.unbroadcast(where(b, cond, gy, zero), x1.shape) if needed[1] else None,
            b.unbroadcast(where(b, cond, zero, gy), x2.shape) if needed[2] else None]


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


_ARITH = (1, 6, 7, 13, 14)  # Add, Sub, Mul, Div
# Where a constant operand is a learned parameter (OpDef.param_inputs): Add's bias or position
# embedding and Mul's layer scale are tensors; a scalar there is an exporter's epsilon or
# multiplier. Sub's and Div's constants are buffers (an input's mean and std), not parameters.
_PARAM_PORTS = {"Add": {"param_inputs": (0, 1), "param_min_size": 2},
                "Mul": {"param_inputs": (0, 1), "param_min_size": 2},
                "PRelu": {"param_inputs": (1,)},
                # normalising by an input's mean and std (torchvision-style buffers), and a
                # Pow exponent (its gradient is not even finite for a negative base)
                "Sub": {"constant_operands": {
                    1: "a subtracted constant: a buffer, such as an input's mean"}},
                "Div": {"constant_operands": {
                    1: "a divisor constant: a buffer, such as an input's std"}},
                "Pow": {"constant_operands": {
                    1: "an exponent: a constant the exporter materialised"}}}

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


# ---- factories -------------------------------------------------------------------------------

def attrs_for(ctx, dtype: np.dtype, derived: Callable | None = None) -> SimpleNamespace:
    """The node's attributes, floats as ``dtype`` scalars when ``dtype`` is a float type (so a
    float32 kernel multiplies by a float32 alpha, as onnxruntime does) and as Python ints for
    integer types; every float attribute is also kept as a Python float under ``<name>_f``.
    ``derived(dtype) -> {name: value}``: constants a body needs in the float ``dtype``,
    computed once per node."""
    a = {}
    for k, v in ctx.attrs.items():
        if isinstance(v, float):
            a[k + "_f"] = v
            v = dtype.type(v) if is_float(dtype) else int(v)
        a[k] = v
    if is_float(dtype) and derived is not None:
        a.update(derived(dtype))
    return SimpleNamespace(**a)


def request_scratch(ctx, scratch: tuple[str, ...] | Callable, chunk: int = 0) -> None:
    """Reserve the scratch buffers a table entry names (``Elementwise.scratch``); being the
    node's only requests, they are ``ws``. Each has the output's shape or, with ``chunk``,
    ``chunk`` elements (flat, for ``Chunked``)."""
    x_dtype, y = ctx.inputs[0].dtype, ctx.outputs[0]
    codes = scratch(x_dtype, y.dtype) if callable(scratch) else scratch
    dtypes = {"y": y.dtype, "x": x_dtype, "f8": np.dtype(np.float64), "?": np.dtype(np.bool_),
              "i8": np.dtype(np.intp)}
    for c in codes:
        ctx.workspace((chunk,) if chunk else y.shape, dtypes[c])


# Elements per piece of a chunked body: its float64 scratch (5 x 128 KiB for Erf) stays in the
# 512 KiB L2 between passes. Measured on Erf [8,64,1024] float32: 4096 and 8192 pay the ufunc
# calls' overhead, 32768 spills; 16384 was the fastest.
CHUNK = 16384


def chunk_size(ctx, scratch) -> int:
    """The scratch length (``request_scratch``'s ``chunk``) of a body run by ``Chunked``: 0 (no
    chunking) for a body without scratch, whose passes are one or two ufuncs over its operands,
    or for a tensor of one chunk or less."""
    return CHUNK if scratch and int(np.prod(ctx.outputs[0].shape)) > CHUNK else 0


def chunk_views(arrays, scratch, n: int) -> list[tuple[list, list]]:
    """Cut same-shape views ``arrays`` (None for an absent one) into pieces of at most ``n``
    elements: [(pieces of arrays, scratch views of the pieces' shape)]. The axes are walked in
    the memory order of ``arrays[-1]`` (the output), so a channels-last view is cut into runs
    of rows of its physical layout and the flat ``scratch`` follows that order too."""
    out = arrays[-1]
    perm = sorted(range(out.ndim), key=lambda i: -abs(out.strides[i]))
    arrays = [None if a is None else a.transpose(perm) for a in arrays]
    shape = arrays[-1].shape
    k, inner = len(shape), 1
    while k > 0 and inner * shape[k - 1] <= n:
        k -= 1
        inner *= shape[k]
    if k == 0:
        return [(arrays, [t[:inner].reshape(shape) for t in scratch])]
    rows, pieces = n // inner, []
    for index in np.ndindex(*shape[:k - 1]):
        for j in range(0, shape[k - 1], rows):
            views = [None if a is None else a[index + (slice(j, j + rows),)] for a in arrays]
            m = views[-1].shape
            pieces.append((views, [t[:int(np.prod(m))].reshape(m) for t in scratch]))
    return pieces


class Chunked:
    """A multi-pass elementwise body ``fn(*arrays, t, a)`` run piece by piece
    (``chunk_views``), so that its intermediates stay in cache between passes: each pass over
    a whole tensor would go to memory and back. The pieces are cut on the first call and again
    only when the views change (they do not between steps)."""

    __slots__ = ("fn", "a", "n", "key", "pieces")

    def __init__(self, fn: Callable, a, n: int):
        self.fn, self.a, self.n, self.key, self.pieces = fn, a, n, (), []

    def __call__(self, arrays, ws) -> None:
        key = (*arrays, *ws)
        if len(key) != len(self.key) or any(p is not q for p, q in zip(key, self.key)):
            self.pieces, self.key = chunk_views(arrays, ws, self.n), key
        fn, a = self.fn, self.a
        for views, t in self.pieces:
            fn(*views, t, a)


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
        a = attrs_for(ctx, ctx.inputs[0].dtype)
        request_scratch(ctx, entry.scratch)
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


_BIT_PATTERNS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                 8: np.dtype(np.uint64)}


def _all_bits_zero(value: np.ndarray | None) -> bool:
    """Whether a plan-time constant is +0 everywhere (its bytes are all zero; -0.0 is not)."""
    return value is not None and not np.ascontiguousarray(value).reshape(-1).view(np.uint8).any()


_FILLED: dict[tuple[str, bytes], np.ndarray] = {}


def filled_like(info, value) -> np.ndarray:
    """A read-only array holding ``value`` with the shape and strides of the view a kernel gets
    for ``info`` (a ``TensorInfo``). NumPy's maximum and minimum
    against a scalar run a scalar loop; against an array laid out like the other operand, a
    vector loop: ``np.maximum(x, 0)`` on 131k float32 took 87-108 µs, against such an array
    26 µs (AVX2, NumPy 2.4, 2026-12-01). Same values (NaN propagates either way). One buffer per
    (dtype, value) serves every kernel, grown when a larger one is asked for; +0 is
    ``np.zeros``, whose pages are never written, so they read as the OS's one zero page and
    take no memory."""
    dtype = np.dtype(info.dtype)
    shape = tuple(info.shape)
    strides = tuple(info.layout.view_strides(dtype.itemsize))
    if 0 in shape or any(s < 0 for s in strides):  # nothing to read, or not a plain view
        return np.broadcast_to(np.asarray(value, dtype), shape)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) // dtype.itemsize + 1
    pattern = np.asarray(value, dtype).tobytes()
    buffer = _FILLED.get((dtype.str, pattern))
    if buffer is None or buffer.size < span:
        buffer = np.zeros(span, dtype) if not any(pattern) else np.full(span, value, dtype)
        buffer.flags.writeable = False
        _FILLED[dtype.str, pattern] = buffer
    return np.lib.stride_tricks.as_strided(buffer, shape, strides, writeable=False)


def shared_fills() -> list[np.ndarray]:
    """The fill buffers every plan of the process reads (``filled_like``'s current ones): memory
    of the process, not of a plan (``compiler.plan_bytes`` leaves them out)."""
    return list(_FILLED.values())


def keep_where(cond, a, out) -> None:
    """``out = a`` where ``cond``, else +0, on the values' bit patterns: ``a * cond`` as
    unsigned integers keeps or zeroes a pattern exactly (NaN, inf and -0.0 included), ~15x
    faster than a masked ``np.copyto(where=)``. One pass; ``out`` may be ``a``. For dtypes of
    1, 2, 4 or 8 bytes (every float type)."""
    bits = _BIT_PATTERNS[out.dtype.itemsize]
    np.multiply(a.view(bits), cond, out=out.view(bits))


def select_where(cond, a, b, out) -> None:
    """``out = a`` where ``cond``, else ``b``, exactly, on the bit patterns: b + (a - b) * cond
    with wrap-around (three passes). ``out`` may be ``a``, never ``b`` (read again after
    ``out`` is written)."""
    bits = _BIT_PATTERNS[out.dtype.itemsize]
    b, y = b.view(bits), out.view(bits)
    np.subtract(a.view(bits), b, out=y)
    np.multiply(y, cond, out=y)
    np.add(y, b, out=y)


def where_numpy(ctx):
    """Where on the values' bit patterns (``keep_where``, ``select_where``). The gradient
    rules' ``Where(cond, gy, 0)`` and ``Where(cond, 0, gy)`` take one and two passes; the
    general case three. Other dtypes (strings, complex128) keep the masked copy."""
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
            keep_where(ins[0], ins[1], outs[0])
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
            if np.may_share_memory(outs[0], ins[2]):
                masked_copy(ins, outs, ws)
                return
            select_where(ins[0], ins[1], ins[2], outs[0])

    return run


def cast_numpy(ctx):
    """Cast/CastLike: the output's dtype (from ``to`` or the second input) is already known
    from shape inference; ONNX's rules (``dtypes.cast_into``): C-style conversion as
    onnxruntime (float -> int truncates), float8 saturation (``saturate``, 19+) and float8e8m0
    rounding (``round_mode``, 24+)."""
    src, dst = ctx.inputs[0].dtype, ctx.outputs[0].dtype
    saturate = bool(ctx.attrs.get("saturate", 1))
    round_mode = ctx.attrs.get("round_mode", "up")
    if isinstance(round_mode, bytes):
        round_mode = round_mode.decode()
    if round_mode not in ("up", "down", "nearest"):
        raise ctx.error(f"round_mode {round_mode!r} is not up, down or nearest")
    slots = [ctx.workspace(ctx.inputs[0].shape, d) for d in cast_scratch(src, dst, saturate)]

    def run(ins, outs, ws):
        cast_into(ins[0], outs[0], [ws[k] for k in slots], saturate, round_mode)

    return run


def swiglu_numpy(ctx):
    """SwiGLU: ``a * sigmoid(alpha a) * b`` (a and b of one shape), in float64 workspace and
    rounded once."""
    alpha = float(ctx.attrs.get("alpha", 1.0))
    gate, tmp = (ctx.workspace(ctx.outputs[0].shape, np.float64) for _ in range(2))

    def run(ins, outs, ws):
        g, t = ws[gate], ws[tmp]
        np.copyto(g, ins[0])
        np.multiply(g, -alpha, out=t)
        np.exp(t, out=t)
        np.add(t, 1, out=t)
        np.divide(g, t, out=g)
        np.multiply(g, ins[1], out=g)
        np.copyto(outs[0], g)

    return run


def binarizer_numpy(ctx):
    """ai.onnx.ml Binarizer: 1 where x > threshold, else 0 (NaN gives 0), in x's type."""
    threshold = float(ctx.attrs.get("threshold", 0.0))

    def run(ins, outs, ws):
        np.greater(ins[0], threshold, out=outs[0], casting="unsafe")

    return run


def bitcast_numpy(ctx):
    """BitCast: the same bytes read as the output's type (of the same width; the schema's
    type check refuses others)."""
    dtype = ctx.outputs[0].dtype

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0].view(dtype))

    return run


def copy_numpy(ctx):
    """Identity where it cannot be a view (layouts differ): a strided copy."""

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])

    return run


_CAST_LIKE = (15, 19, 21, 23, 24, 25)
_CAST = (1, 6, 9, 13, 19, 21, 23, 24, 25, 28)
_IDENTITY = (1, 13, 14, 16, 19, 21, 23, 24, 25)
def sum_of_input_bounds(node, bound, stats) -> float | None:
    """``OpDef.value_bounds`` of a sum or difference: |x1 +- x2| <= |x1| + |x2|."""
    parts = [bound(v) for v in node.inputs]
    return None if any(p is None for p in parts) else math.fsum(parts)


def product_of_input_bounds(node, bound, stats) -> float | None:
    """``OpDef.value_bounds`` of a product: |x1 * x2| <= |x1| * |x2|."""
    parts = [bound(v) for v in node.inputs]
    return None if any(p is None for p in parts) else math.prod(parts)


def largest_input_bound(node, bound, stats) -> float | None:
    """``OpDef.value_bounds`` of an op whose values are some input's (Max, Min, Concat)."""
    parts = [bound(v) for v in node.inputs if v is not None]
    return None if not parts or any(p is None for p in parts) else max(parts)


_TRAITS = {"Add": frozenset({MASK_PATH})}  # ``OpDef.traits``
# what bounds each op's values (``OpDef.value_bounds``)
_VALUE_BOUNDS = {"Add": sum_of_input_bounds, "Sub": sum_of_input_bounds,
                 "Sum": sum_of_input_bounds, "Mul": product_of_input_bounds,
                 "Max": largest_input_bound, "Min": largest_input_bound}


_VARIADIC = {  # op: (versions, ufunc, gradient rule)
    "Sum": ((1, 6, 8, 13), np.add, _sum_vjp),
    "Mean": ((1, 6, 8, 13), np.add, _mean_vjp),
    "Max": ((1, 6, 8, 12, 13), np.maximum, _extremum_vjp),
    "Min": ((1, 6, 8, 12, 13), np.minimum, _extremum_vjp),
}


@hookimpl
def tr_onnx_op_definitions():
    defs = [OpDef(op, e.versions, {"numpy": binary_numpy(e)}, differentiable=e.differentiable,
                  gradient=e.vjp, value_bounds=_VALUE_BOUNDS.get(op),
                  traits=_TRAITS.get(op, frozenset()), **_PARAM_PORTS.get(op, {}))
            for op, e in BINARY.items()]
    defs += [OpDef(op, versions, {"numpy": variadic_numpy(ufunc, mean=op == "Mean")},
                   differentiable=True, gradient=vjp, value_bounds=_VALUE_BOUNDS.get(op))
             for op, (versions, ufunc, vjp) in _VARIADIC.items()]
    defs += [
        OpDef("Where", (9, 16), {"numpy": where_numpy}, differentiable=True,
              gradient=_where_vjp, grad_inputs=(1, 2), traits=frozenset({MASK_PATH})),
        OpDef("Cast", _CAST, {"numpy": cast_numpy}, differentiable=True, gradient=_cast_vjp,
              forwards_params=True),
        OpDef("CastLike", _CAST_LIKE, {"numpy": cast_numpy}, differentiable=True,
              gradient=_cast_vjp, grad_inputs=(0,), forwards_params=True),
        OpDef("BitCast", (26,), {"numpy": bitcast_numpy}, differentiable=False),
        OpDef("SwiGLU", (28,), {"numpy": swiglu_numpy}, differentiable=False),
        OpDef("Binarizer", (1,), {"numpy": binarizer_numpy}, domain="ai.onnx.ml",
              differentiable=False),
        OpDef("Identity", _IDENTITY, {"numpy": copy_numpy}, alias_output=True,
              differentiable=True, gradient=_identity_vjp, forwards_params=True,
              value_bounds=bounded_like_input, traits=frozenset({LAYOUT_ONLY})),
    ]
    return defs
