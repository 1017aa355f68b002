"""Reductions (Reduce*, ArgMax/ArgMin) and the normalising reductions along an axis (Softmax,
LogSoftmax, Hardmax), with their gradient rules (standard ops only). ReduceMax/ReduceMin send
the gradient to every element equal to the extremum, split evenly among ties (PyTorch's
amax/amin); Hardmax, ArgMax and ArgMin are not differentiable.

All read logical views (``ELEMENTWISE``): a reduction over a channels-last feature map is a
strided numpy reduction, and an output of the same rank stays channels-last. Reductions write
into the output view itself; with ``keepdims=0`` the kernel writes through
``np.expand_dims(out, axes)``, a view of the same memory in keepdims form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from .. import host_blas
from ..dtypes import finfo, is_float, onnx_elem_type
from ..errors import InternalError
from ..hookspecs import hookimpl
from ..opdef import SOFTMAX, OpDef, bounded_like_input, unit_bounded
from . import softmax_onednn

# The schema version from which each Reduce op takes ``axes`` as input 1 instead of an attribute.
_AXES_INPUT_SINCE = {"ReduceSum": 13}
_AXES_INPUT_SINCE_DEFAULT = 18


def _normalize_axes(axes, rank: int, what: str, ctx) -> tuple[int, ...]:
    out = []
    for a in axes:
        a = int(a)
        if not -rank <= a < max(rank, 1):
            raise ctx.error(f"{what} {a} is out of range for a rank-{rank} input")
        out.append(a % rank if rank else 0)
    return tuple(sorted(set(out)))


def _reduce_axes(ctx) -> tuple[int, ...] | None:
    """The axes a Reduce node reduces, or None for "no reduction" (noop_with_empty_axes)."""
    rank = len(ctx.inputs[0].shape)
    if ctx.since_version >= _AXES_INPUT_SINCE.get(ctx.node.op_type, _AXES_INPUT_SINCE_DEFAULT):
        axes = ctx.const(1) if ctx.has_input(1) else None
    else:
        axes = ctx.attrs.get("axes")  # the attribute has no schema default: absent = all axes
    if axes is None or len(np.ravel(axes)) == 0:
        # noop_with_empty_axes exists only where axes is an input; older schemas reduce all.
        if ctx.attrs.get("noop_with_empty_axes", 0):
            return ()
        return tuple(range(rank))
    return _normalize_axes(np.ravel(axes), rank, "axis", ctx)


@dataclass(frozen=True)
class _Reducer:
    """``pre`` maps x elementwise into a workspace (None: reduce x itself); ``reduce`` is the
    numpy reduction; ``post`` maps the reduced values in place; ``initial`` is the identity for
    max/min so that an empty reduction is defined."""

    reduce: object
    pre: object = None
    post: object = None
    initial: str | None = None
    float_only_math: bool = False  # real-valued math (mean, sqrt, log, exp): ints go via float64


_REDUCERS = {
    "ReduceSum": _Reducer(np.sum),
    "ReduceMean": _Reducer(np.mean, float_only_math=True),
    "ReduceMax": _Reducer(np.max, initial="min"),
    "ReduceMin": _Reducer(np.min, initial="max"),
    "ReduceProd": _Reducer(np.prod),
    "ReduceL1": _Reducer(np.sum, pre=np.abs),
    "ReduceL2": _Reducer(np.sum, pre=np.square, post=np.sqrt, float_only_math=True),
    "ReduceSumSquare": _Reducer(np.sum, pre=np.square),
    "ReduceLogSum": _Reducer(np.sum, post=np.log, float_only_math=True),
    "ReduceLogSumExp": _Reducer(np.sum, float_only_math=True),  # max-shifted, see below
}


def _lowest(dtype: np.dtype, which: str):
    """The identity of max (``"min"``) or min (``"max"``) reductions for ``dtype``."""
    if dtype == np.bool_:
        return which == "max"
    if is_float(dtype):
        return -np.inf if which == "min" else np.inf
    info = np.iinfo(dtype)
    return info.min if which == "min" else info.max


# Sums over a block of leading or trailing axes of a contiguous float tensor are one einsum
# over its [rows, columns] matrix: NumPy's add.reduce starts its inner loop once per row where
# einsum's loops run along the whole matrix (the softmax gradient's row sums [2048, 64] 77 ->
# 22 us, [1024, 8] 26 -> 8 us; [8192, 32] -> [32] 183 -> 58 us; 2 threads, 2026-12-02).
# Single-threaded on purpose: a ones-vector BLAS product was as fast alone, but OpenBLAS
# threads a GEMV from 9216 elements, and waking the thread pool for microseconds of work
# stalled the zoo transformer's step (median 3.4 -> 5.6 ms). Leading axes: einsum too adds
# row after row, as add.reduce does. Trailing axes: add.reduce sums a row pairwise, einsum
# in a few straight-through lanes; up to this length that measured as accurate.
_MATRIX_SUM_TRAILING_MAX = 1024


def matrix_sum_geometry(x_shape, axes, dtype) -> tuple[bool, int, int] | None:
    """(leading, rows, columns): how ``matrix_sum`` sees a sum of a ``x_shape`` tensor over
    ``axes`` as a [rows, columns] matrix, or None where it does not apply."""
    rank, n = len(x_shape), len(axes)
    if np.dtype(dtype) not in (np.float32, np.float64) or not 0 < n < rank \
            or 0 in x_shape:
        return None
    leading = tuple(axes) == tuple(range(n))
    if not leading and tuple(axes) != tuple(range(rank - n, rank)):
        return None
    split = n if leading else rank - n
    rows, columns = math.prod(x_shape[:split]), math.prod(x_shape[split:])
    if not leading and columns > _MATRIX_SUM_TRAILING_MAX:
        return None
    return leading, rows, columns


def matrix_sum(geometry: tuple[bool, int, int], x: np.ndarray, y: np.ndarray):
    """The call summing contiguous ``x`` into contiguous ``y`` (the reduced shape, any
    keepdims form) as ``matrix_sum_geometry`` describes, or None where a view would need a
    copy."""
    leading, rows, columns = geometry
    if not (x.flags.c_contiguous and y.flags.c_contiguous):
        return None
    matrix = x.reshape(rows, columns)
    if leading:
        return partial(np.einsum, "ij->j", matrix, out=y.reshape(columns))
    return partial(np.einsum, "ij->i", matrix, out=y.reshape(rows))


def _matrix_sum_step(ctx, geometry, mean: bool, fallback):
    """ReduceSum / ReduceMean as ``matrix_sum`` (then / count), made on the first call;
    ``fallback`` (the generic kernel) where the views are not contiguous."""
    dtype = ctx.outputs[0].dtype
    count = dtype.type(geometry[1] if geometry[0] else geometry[2])

    def make(ins, outs, ws):
        call = matrix_sum(geometry, ins[0], outs[0])
        if call is None:
            return [partial(fallback, ins, outs, ws)]
        if not mean:
            return [call]
        y = outs[0]
        return [call, partial(np.divide, y, count, out=y)]

    return host_blas.prepared_step(make)


def reduce_numpy(ctx):
    """One factory for every Reduce* op: (pre) -> reduce -> (post) into the keepdims view;
    ReduceSum / ReduceMean over leading or trailing axes as one einsum over a matrix
    (``matrix_sum_geometry``)."""
    op = ctx.node.op_type
    spec = _REDUCERS[op]
    x_info, y_info = ctx.inputs[0], ctx.outputs[0]
    axes = _reduce_axes(ctx)
    keepdims = bool(ctx.attrs["keepdims"])
    dtype = y_info.dtype
    kept_shape = tuple(1 if a in axes else d for a, d in enumerate(x_info.shape))
    # Integer outputs of float math (mean, sqrt, log, exp) are computed in float64 and cast
    # back with truncation, as the ONNX reference does (``.astype(data.dtype)``).
    acc = dtype if is_float(dtype) or dtype.kind == "c" or not spec.float_only_math \
        else np.dtype(np.float64)
    pre_ws = ctx.workspace(x_info.shape, acc) if spec.pre is not None or op == "ReduceLogSumExp" \
        else None
    acc_ws = ctx.workspace(kept_shape, acc) if acc != dtype else None
    max_ws = ctx.workspace(kept_shape, acc) if op == "ReduceLogSumExp" else None
    initial = {} if spec.initial is None else {"initial": _lowest(dtype, spec.initial)}
    expand = axes if not keepdims else ()
    if op == "ReduceLogSumExp":
        acc_info = finfo(acc)
    empty = 0 in x_info.shape

    def run(ins, outs, ws):
        x = ins[0]
        y = np.expand_dims(outs[0], expand) if expand else outs[0]
        r = ws[acc_ws] if acc_ws is not None else y
        if op == "ReduceLogSumExp":
            # shift by the max, clamped to finite values so +/-inf inputs stay exact
            m = ws[max_ws]
            np.max(x, axis=axes, keepdims=True, out=m, initial=-np.inf)
            np.clip(m, acc_info.min, acc_info.max, out=m)
            t = ws[pre_ws]
            np.subtract(x, m, out=t)
            np.exp(t, out=t)
            np.sum(t, axis=axes, keepdims=True, out=r)
            with np.errstate(divide="ignore"):
                np.log(r, out=r)
            np.add(r, m, out=r)
        else:
            src = x
            if spec.pre is not None:
                src = ws[pre_ws]
                spec.pre(x, out=src)
            if empty and op == "ReduceMean":
                r[...] = np.nan  # the mean of an empty set; numpy would warn
            else:
                spec.reduce(src, axis=axes, keepdims=True, out=r, **initial)
            if spec.post is not None:
                with np.errstate(divide="ignore"):  # log(0) = -inf on an empty set is ONNX's
                    spec.post(r, out=r)
        if acc_ws is not None:
            np.copyto(y, r, casting="unsafe")

    geometry = matrix_sum_geometry(x_info.shape, axes, dtype) \
        if op in ("ReduceSum", "ReduceMean") and x_info.dtype == dtype else None
    if geometry is not None:
        return _matrix_sum_step(ctx, geometry, op == "ReduceMean", run)
    return run


def _softmax_axes(ctx) -> tuple[int, ...]:
    """Softmax-family axes: v1/v11 coerce to 2-D at ``axis`` (= every axis from it on)."""
    rank = len(ctx.inputs[0].shape)
    (axis,) = _normalize_axes([ctx.attrs["axis"]], rank, "axis", ctx) if rank else (0,)
    if ctx.since_version < 13:
        return tuple(range(axis, rank))
    return (axis,)


# NumPy's max over the last axis costs ~55 ns per row ([1024, 8]: 60 us); for rows this
# short, one np.maximum per column over all rows at once is faster (22 us), and exact alike
_SHORT_ROW = 16


def _short_row_max(x2: np.ndarray, m: np.ndarray) -> None:
    """m = the max of each row of [rows, columns] ``x2``, column by column (NaN kept)."""
    np.copyto(m, x2[:, 0])
    for j in range(1, x2.shape[1]):
        np.maximum(m, x2[:, j], out=m)


def softmax_numpy(ctx):
    """Softmax and LogSoftmax, shifted by the max; float16 sums accumulate in float32. The
    sum over a trailing axis of a contiguous map is one einsum (``matrix_sum``)."""
    log = ctx.node.op_type == "LogSoftmax"
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    axes = _softmax_axes(ctx)
    kept_shape = tuple(1 if a in axes else d for a, d in enumerate(x_info.shape))
    acc = np.promote_types(dtype, np.float32)
    m_ws = ctx.workspace(kept_shape, acc)
    s_ws = ctx.workspace(kept_shape, acc)
    # float16: exp, sum and divide in float32 (as onnxruntime does); rounding exp(x - m) to
    # float16 before the sum costs up to a few ulps of the result
    e_ws = ctx.workspace(x_info.shape, acc) if acc != dtype else None
    if 0 in x_info.shape:
        return lambda ins, outs, ws: None
    geometry = matrix_sum_geometry(x_info.shape, axes, acc)

    def make(ins, outs, ws):
        x, y, m, s = ins[0], outs[0], ws[m_ws], ws[s_ws]
        e = y if e_ws is None else ws[e_ws]
        row_sum = matrix_sum(geometry, e, s) if geometry is not None else None
        row_max = partial(np.maximum.reduce, x, axis=axes, keepdims=True, out=m)
        if row_sum is None:
            row_sum = partial(np.add.reduce, e, axis=axes, keepdims=True, dtype=acc, out=s)
        elif not geometry[0] and geometry[2] <= _SHORT_ROW and x.flags.c_contiguous:
            row_max = partial(_short_row_max, x.reshape(geometry[1], geometry[2]),
                              m.reshape(geometry[1]))

        def run():
            row_max()
            np.subtract(x, m, out=e)
            np.exp(e, out=e)
            row_sum()
            if log:
                # (x - m) - log(s): adding log(s) to m first would lose it next to a large m
                np.log(s, out=s)
                np.subtract(x, m, out=e)
                np.subtract(e, s, out=y, casting="same_kind")
            else:
                np.divide(e, s, out=y, casting="same_kind")

        return [run]

    fast = softmax_onednn.softmax_step(ctx, axes, make) if acc == dtype and not log else None
    return fast if fast is not None else host_blas.prepared_step(make)


def hardmax_numpy(ctx):
    """1 at the first maximum along the axis (v1/v11: over the flattened axes from ``axis``)."""
    x_info, dtype = ctx.inputs[0], ctx.outputs[0].dtype
    axes = _softmax_axes(ctx)
    shape = x_info.shape
    if 0 in shape:
        return lambda ins, outs, ws: None
    outer = int(np.prod(shape[:axes[0]], dtype=np.int64))
    inner = int(np.prod(shape[axes[0]:axes[-1] + 1], dtype=np.int64))
    if len(axes) == 1:
        axis = axes[0]
        idx_ws = ctx.workspace(tuple(1 if a == axis else d for a, d in enumerate(shape)), np.intp)

        def run(ins, outs, ws):
            idx, y = ws[idx_ws], outs[0]
            np.argmax(ins[0], axis=axis, keepdims=True, out=idx)
            y[...] = 0
            np.put_along_axis(y, idx, 1, axis=axis)  # small index temporaries (size of idx)

        return run

    # Several trailing axes: argmax over their flattening, which needs a contiguous copy.
    flat_ws = ctx.workspace((outer, inner), dtype)
    idx_ws = ctx.workspace((outer, 1), np.intp)

    def run_flat(ins, outs, ws):
        flat, idx = ws[flat_ws], ws[idx_ws]
        np.copyto(flat.reshape(shape), ins[0])  # reshape of a contiguous workspace: a view
        np.argmax(flat, axis=1, keepdims=True, out=idx)
        flat[...] = 0
        np.put_along_axis(flat, idx, 1, axis=1)  # small index temporaries (size of idx)
        np.copyto(outs[0], flat.reshape(shape))

    return run_flat


def argmax_numpy(ctx):
    """ArgMax/ArgMin: int64 indices; select_last_index searches a reversed view."""
    x_info = ctx.inputs[0]
    rank = len(x_info.shape)
    (axis,) = _normalize_axes([ctx.attrs["axis"]], rank, "axis", ctx)
    keepdims = bool(ctx.attrs["keepdims"])
    last = bool(ctx.attrs.get("select_last_index", 0))  # attribute exists from v12
    find = np.argmax if ctx.node.op_type == "ArgMax" else np.argmin
    n = x_info.shape[axis]
    flip = tuple(slice(None, None, -1) if a == axis else slice(None) for a in range(rank))

    def run(ins, outs, ws):
        x = ins[0][flip] if last else ins[0]
        y = outs[0] if keepdims else np.expand_dims(outs[0], axis)
        find(x, axis=axis, keepdims=True, out=y)
        if last:
            np.subtract(n - 1, y, out=y)

    return run


# ----------------------------------------------------------------------------- gradient rules
# Rules emit standard ops at the autodiff GRAD_OPSET (17): ReduceSum takes axes as an input,
# the other Reduce ops as an attribute.


def reduce_kept(b, op_type: str, v, axes) -> object:
    """``op_type`` over ``axes`` of ``v`` with keepdims=1, in GRAD_OPSET form (no axes: the
    sum/mean of one element, ``v`` itself; an empty axes list would mean "all axes")."""
    axes = [int(a) for a in axes]
    if not axes and op_type in ("ReduceSum", "ReduceMean"):
        return v
    if op_type == "ReduceSum":
        return b.op("ReduceSum", [v, b.ints(axes)], {"keepdims": 1})
    return b.op(op_type, [v], {"axes": axes, "keepdims": 1})


def node_reduce_axes(node) -> tuple[int, ...]:
    """The forward node's reduced axes (() for a no-op with empty axes), as ``_reduce_axes``."""
    rank = node.inputs[0].rank
    if node.since_version >= _AXES_INPUT_SINCE.get(node.op_type, _AXES_INPUT_SINCE_DEFAULT):
        given = node.inputs[1] if len(node.inputs) > 1 else None
        axes = None if given is None else given.data
    else:
        axes = node.attrs.get("axes")
    if axes is None or len(np.ravel(axes)) == 0:
        return () if node.attrs.get("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted({int(a) % rank for a in np.ravel(axes)}))


def _kept(b, v, shape):
    """``v`` (the reduced output or its gradient, keepdims 0 or 1) in keepdims form."""
    return v if tuple(v.shape) == tuple(shape) else b.op("Reshape", [v, b.ints(shape)])


def _reduce_term(b, op, x, y, gy, axes, count):
    """The factor gx = gy (kept, broadcast) * term; None means term = 1."""
    if op == "ReduceSum":
        return None
    if op == "ReduceMean":
        return b.scalar_like(1.0 / count, x)
    if op in ("ReduceMax", "ReduceMin"):
        # every element equal to the extremum shares the gradient evenly (PyTorch's amax/amin)
        mask = b.op("Cast", [b.op("Equal", [x, y])], {"to": onnx_elem_type(x.dtype)})
        return b.div(mask, reduce_kept(b, "ReduceSum", mask, axes))
    if op == "ReduceProd":
        return b.div(y, x)  # prod / x: undefined where x == 0
    if op == "ReduceL1":
        return b.op("Sign", [x])
    if op == "ReduceL2":
        return b.div(x, y)  # undefined where the norm is 0
    if op == "ReduceSumSquare":
        return b.mul(x, b.scalar_like(2.0, x))
    if op == "ReduceLogSum":
        return b.op("Exp", [b.neg(y)])  # 1 / sum = exp(-log(sum))
    if op == "ReduceLogSumExp":
        return b.op("Exp", [b.sub(x, y)])  # softmax over the reduced axes
    raise InternalError(f"{op} has no gradient term in ops/reduce.py's table")


def reduce_vjp(b, node, gys, needed):
    """gx = broadcast(gy) * d(reduction)/dx, the reduced values kept as size-1 axes. With
    noop_with_empty_axes the op is elementwise (|x|, x^2, log x...) and so is its rule."""
    x, gy = node.inputs[0], gys[0]
    axes = node_reduce_axes(node)
    kept = tuple(1 if a in axes else d for a, d in enumerate(x.shape))
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    term = _reduce_term(b, node.op_type, x, _kept(b, node.outputs[0], kept), gy, axes,
                        max(count, 1))
    g = _kept(b, gy, kept)
    if term is not None:
        g = b.mul(g, term)
    if tuple(g.shape) != tuple(x.shape):
        g = b.op("Expand", [g, b.ints(x.shape)])
    return [g] + [None] * (len(node.inputs) - 1)


def softmax_vjp(b, node, gys, needed):
    """Softmax: gx = y * (gy - sum(gy * y)); LogSoftmax: gx = gy - exp(y) * sum(gy); sums over
    the op's axes (v1/v11: every axis from ``axis`` on)."""
    x, y, gy = node.inputs[0], node.outputs[0], gys[0]
    rank = x.rank
    axis = int(node.attrs["axis"]) % max(rank, 1)
    axes = list(range(axis, rank)) if node.since_version < 13 else [axis]
    if node.op_type == "Softmax":
        return [b.mul(y, b.sub(gy, reduce_kept(b, "ReduceSum", b.mul(gy, y), axes)))]
    return [b.sub(gy, b.mul(b.op("Exp", [y]), reduce_kept(b, "ReduceSum", gy, axes)))]


# a max, a min or a mean of x's values: within x's range (``OpDef.value_bounds``)
_WITHIN_INPUT_RANGE = ("ReduceMax", "ReduceMin", "ReduceMean")
_REDUCE_VERSIONS = {
    "ReduceMean": (1, 11, 13, 18),
    "ReduceSum": (1, 11, 13),
    "ReduceMax": (1, 11, 12, 13, 18, 20),
    "ReduceMin": (1, 11, 12, 13, 18, 20),
    "ReduceProd": (1, 11, 13, 18),
    "ReduceL1": (1, 11, 13, 18),
    "ReduceL2": (1, 11, 13, 18),
    "ReduceLogSum": (1, 11, 13, 18, 28),
    "ReduceLogSumExp": (1, 11, 13, 18, 28),
    "ReduceSumSquare": (1, 11, 13, 18),
}


@hookimpl
def tr_onnx_op_definitions():
    reduces = [OpDef(op, versions, {"numpy": reduce_numpy}, const_inputs=(1,),
                     differentiable=True, gradient=reduce_vjp, grad_inputs=(0,),
                     value_bounds=bounded_like_input if op in _WITHIN_INPUT_RANGE else None)
               for op, versions in _REDUCE_VERSIONS.items()]
    return reduces + [
        OpDef("Softmax", (1, 11, 13), {"numpy": softmax_numpy}, differentiable=True,
              gradient=softmax_vjp, value_bounds=unit_bounded, traits=frozenset({SOFTMAX})),
        OpDef("LogSoftmax", (1, 11, 13), {"numpy": softmax_numpy}, differentiable=True,
              gradient=softmax_vjp, traits=frozenset({SOFTMAX})),
        # piecewise constant (one-hot of the maximum) / integer outputs: no gradient
        OpDef("Hardmax", (1, 11, 13), {"numpy": hardmax_numpy}, differentiable=False),
        OpDef("ArgMax", (1, 11, 12, 13), {"numpy": argmax_numpy}, differentiable=False),
        OpDef("ArgMin", (1, 11, 12, 13), {"numpy": argmax_numpy}, differentiable=False),
    ]
