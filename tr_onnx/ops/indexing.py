"""Indexing: ops that move data by index values rather than by shape. Gather, GatherElements,
GatherND, ScatterElements (and its opset 9-10 name Scatter) and ScatterND, OneHot, TopK and
ReverseSequence, with the backward ops GatherGrad and GatherNDGrad (scatter-adds of gy at the
gathered positions).

They are one family because their gradients are the same few moves run the other way: what
a gather reads, its gradient scatter-adds back (GatherGrad, GatherNDGrad, ScatterElements with
reduction add), and what a scatter writes, its gradient gathers (GatherElements, GatherND).
Index inputs never get a gradient. The axis and gradient helpers (``positive_axis``,
``zeros_like``, ``first_only``) are ops/tensor.py's.

Kernels read logical views. NumPy's advanced indexing has no ``out=``: where a kernel indexes
with arrays it makes one temporary the size of its output (noted at each place).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from .. import host_blas
from ..domains import INTERNAL_DOMAIN
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, OpDef, bounded_like_input
from .conv_window import merged_view
from .tensor import DATA_INPUT, first_only, positive_axis, zeros_like

# ---- forward kernels ----------------------------------------------------------------------


def gather_numpy(ctx):
    axis = positive_axis(ctx.attrs["axis"], len(ctx.inputs[0].shape))

    def run(ins, outs, ws):
        np.take(ins[0], ins[1], axis=axis, out=outs[0])

    return run


def gather_elements_numpy(ctx):
    shape = ctx.inputs[1].shape
    axis = positive_axis(ctx.attrs["axis"], len(shape))
    # The indices may be shorter than the data along every axis (take_along_axis would need
    # them to broadcast): index with aranges over the indices' own axes.
    grids = np.indices(shape, sparse=True)

    def run(ins, outs, ws):
        index = tuple(ins[1] if a == axis else g for a, g in enumerate(grids))
        # Advanced indexing has no out=: one temporary the size of the output.
        np.copyto(outs[0], ins[0][index])

    return run


def _nd_grids(idx_shape, batch_dims: int) -> tuple:
    """Broadcastable aranges over GatherND's batch axes, against ``indices[..., j]``."""
    rank = len(idx_shape)
    return tuple(np.arange(n).reshape((1,) * i + (n,) + (1,) * (rank - 2 - i))
                 for i, n in enumerate(idx_shape[:batch_dims]))


def gather_nd_numpy(ctx):
    k = ctx.inputs[1].shape[-1]
    grids = _nd_grids(ctx.inputs[1].shape, int(ctx.attrs.get("batch_dims", 0)))

    def run(ins, outs, ws):
        idx = ins[1]
        # Advanced indexing has no out=: one temporary the size of the output.
        np.copyto(outs[0], ins[0][grids + tuple(idx[..., j] for j in range(k))])

    return run


_SCATTER_REDUCE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def scatter_elements_numpy(ctx):
    shape = ctx.inputs[2].shape
    axis = positive_axis(ctx.attrs["axis"], len(shape))
    reduce = _SCATTER_REDUCE.get(ctx.attrs.get("reduction", "none"))
    grids = np.indices(shape, sparse=True)  # broadcastable aranges over the updates' axes

    def run(ins, outs, ws):
        y = outs[0]
        np.copyto(y, ins[0])
        index = tuple(ins[1] if a == axis else g for a, g in enumerate(grids))
        if reduce is None:
            y[index] = ins[2]  # repeated indices: the last update wins, as in the reference
        else:
            reduce.at(y, index, ins[2])

    return run


def _nd_out_of_range(idx: np.ndarray, dims: np.ndarray) -> str | None:
    """Why the index tuples ``idx[..., :k]`` do not all address ``dims`` (None when they do):
    names the first tuple out of range and where it sits in the indices."""
    bad = ((idx < -dims) | (idx >= dims)).any(axis=-1)
    if not bad.any():
        return None
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"index tuple {idx[at].tolist()} at indices{list(at)} is out of range for the "
            f"data's leading dims {dims.tolist()} (valid: -d <= i < d)")


def scatter_nd_numpy(ctx):
    data_shape, k = ctx.inputs[0].shape, ctx.inputs[1].shape[-1]
    if not 1 <= k <= len(data_shape):
        raise ctx.error(f"indices address {k} axes of a rank-{len(data_shape)} data input "
                        f"(ScatterND needs 1 <= indices.shape[-1] <= rank)")
    dims = np.array(data_shape[:k], np.int64)
    reduce = _SCATTER_REDUCE.get(ctx.attrs.get("reduction", "none"))
    const_idx = ctx.const(1)
    fixed = None  # the index arrays, when the indices are known at plan time
    if const_idx is not None:  # exporters store slice_scatter's indices: check them once, here
        problem = _nd_out_of_range(const_idx, dims)
        if problem is not None:
            raise ctx.error(problem)
        fixed = tuple(np.ascontiguousarray(const_idx[..., j]) for j in range(k))

    def run(ins, outs, ws):
        y = outs[0]
        np.copyto(y, ins[0])
        index = fixed
        if index is None:
            problem = _nd_out_of_range(ins[1], dims)
            if problem is not None:
                raise IndexError(problem)  # the executor's KernelError names the node
            index = tuple(ins[1][..., j] for j in range(k))
        # One index array per addressed axis, negative entries counting from the end. Indexing
        # the (possibly strided) view itself, never a flattened copy, keeps the writes in y.
        if reduce is None:
            y[index] = ins[2]  # repeated tuples: the last update wins, as in the reference
        else:
            reduce.at(y, index, ins[2])  # unbuffered: every repeated tuple reduces

    return run


def one_hot_numpy(ctx):
    axis = positive_axis(ctx.attrs["axis"], len(ctx.outputs[0].shape))
    depth = int(np.asarray(ctx.const(1)).reshape(-1)[0])
    rank = len(ctx.outputs[0].shape)
    positions = np.arange(depth).reshape((1,) * axis + (depth,) + (1,) * (rank - axis - 1))
    wrapped = positions - depth  # negative indices in [-depth, -1] count from the end
    hit, hit_wrapped = (ctx.workspace(ctx.outputs[0].shape, np.bool_) for _ in range(2))
    expand = (slice(None),) * axis + (None,)

    def run(ins, outs, ws):
        idx, values, y = ins[0][expand], ins[2], outs[0]
        np.equal(idx, positions, out=ws[hit])
        np.equal(idx, wrapped, out=ws[hit_wrapped])
        np.logical_or(ws[hit], ws[hit_wrapped], out=ws[hit])
        y.fill(values[0])
        np.copyto(y, values[1], where=ws[hit])

    return run


def top_k_numpy(ctx):
    rank = len(ctx.inputs[0].shape)
    axis = positive_axis(ctx.attrs["axis"], rank)
    n, k = ctx.inputs[0].shape[axis], ctx.outputs[0].shape[axis]
    largest = bool(ctx.attrs.get("largest", 1))
    head = (slice(None),) * axis
    flip = head + (slice(None, None, -1),)
    first_k = head + (slice(0, k),)

    def run(ins, outs, ws):
        x = ins[0]
        # argsort allocates its result; a stable sort keeps equal values in index order. For
        # the largest, sorting the reversed axis ascending and reading it backwards does both.
        if largest:
            order = np.argsort(x[flip], axis=axis, kind="stable")[flip][first_k]
            np.subtract(n - 1, order, out=outs[1])
        else:
            np.copyto(outs[1], np.argsort(x, axis=axis, kind="stable")[first_k])
        np.copyto(outs[0], np.take_along_axis(x, outs[1], axis))  # a temporary of k values

    return run


def reverse_sequence_numpy(ctx):
    """Each batch entry's first ``sequence_lens[b]`` steps along ``time_axis`` reversed, the
    rest copied. The gather index is built once when the lengths are plan-time constants, else
    per step (one small int64 array [T, B])."""
    shape = ctx.inputs[0].shape
    t_axis, b_axis = int(ctx.attrs["time_axis"]), int(ctx.attrs["batch_axis"])
    steps = np.arange(shape[t_axis]).reshape(-1, 1)  # [T, 1]
    view = [1] * len(shape)
    view[t_axis], view[b_axis] = shape[t_axis], shape[b_axis]
    swap = t_axis > b_axis  # the [T, B] index laid along the input's axes in their order

    def index_of(lens: np.ndarray) -> np.ndarray:
        if ((lens < 0) | (lens > shape[t_axis])).any():
            raise IndexError(f"sequence_lens {lens.tolist()} outside [0, {shape[t_axis]}] "
                             f"(the time axis' length)")
        lens = lens.reshape(1, -1).astype(np.int64)
        idx = np.where(steps < lens, lens - 1 - steps, steps)  # [T, B]
        return (idx.T if swap else idx).reshape(view)

    const_lens = ctx.const(1)
    fixed = None
    if const_lens is not None:
        try:
            fixed = index_of(np.asarray(const_lens))
        except IndexError as exc:
            raise ctx.error(str(exc)) from None

    def run(ins, outs, ws):
        idx = fixed if fixed is not None else index_of(ins[1])
        # take_along_axis has no out=: one temporary the size of the output
        np.copyto(outs[0], np.take_along_axis(ins[0], idx, t_axis))

    return run


# ---- backward ops (domain ai.tr_onnx) -------------------------------------------------------
# Each writes a gradient shaped like the forward data input (``ctx.outputs[0]``) from ``gy``
# (input 0) and the indices (input 1).


# one-hot products up to this many table elements (V * D) per head index: np.add.at costs ~5
# us per index, the GEMM V * D multiply-adds per index (position table 128 x 256, 64 indices:
# 363 vs ~20 us; token types 2 x 256, 512 indices: 2.4 ms vs ~10 us; 2 threads, 2026-12-02)
_ONE_HOT_ELEMENTS = 1 << 18
_ONE_HOT_BYTES = 4 << 20  # the one-hot matrix's workspace
# up to this many indices, one slice add per index: an exporter's split of a fused QKV
# projection (Gather of a scalar index from [3, ...]) took ~90 us per call as a one-hot GEMM,
# ~10 us so (the fill and one add of 8k values; 2 threads, 2026-12-02)
_SLICE_ADDS = 16


def gather_grad_numpy(ctx):
    """``gx = 0; gx[..., indices, ...] += gy`` along ``axis`` (non-negative attr): repeated
    indices accumulate, negative ones count from the end (input 1). ``np.add.at`` in general;
    for a few indices (<= ``_SLICE_ADDS``) one slice add each, in index order as np.add.at;
    for a small table in float32/64, ``onehot(indices) @ gy`` (one GEMM per head index, BLAS;
    the one-hot workspace is rebuilt each step) where every gy value is finite (else 0 * inf
    would spread NaN to rows no index names)."""
    axis = int(ctx.attrs["axis"])
    head = (slice(None),) * axis
    gy_info, idx_info, gx_info = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    dtype = np.dtype(gx_info.dtype)

    def scatter(ins, outs, ws):
        outs[0].fill(0)
        np.add.at(outs[0], head + (ins[1],), ins[0])

    rows = gx_info.shape[axis]
    n = math.prod(idx_info.shape)
    width = math.prod(gx_info.shape[axis + 1:])
    gy_splits = (axis, axis + len(idx_info.shape))
    if 0 < n <= _SLICE_ADDS:
        return host_blas.prepared_step(partial(_slice_adds, scatter, rows, gy_splits, axis))
    if dtype not in (np.float32, np.float64) or not rows or not n \
            or rows * width > _ONE_HOT_ELEMENTS or rows * n * dtype.itemsize > _ONE_HOT_BYTES:
        return scatter
    onehot_k, hit_k = ctx.workspace((rows, n), dtype), ctx.workspace((rows, n), np.bool_)
    index_k, negative_k = ctx.workspace((n,), np.int64), ctx.workspace((n,), np.bool_)
    finite_k = ctx.workspace(tuple(gy_info.shape), np.bool_)
    table_rows = np.arange(rows).reshape(rows, 1)

    def make(ins, outs, ws):
        gy, gx = merged_view(ins[0], gy_splits), merged_view(outs[0], (axis, axis + 1))
        if gy is None or gx is None or not ins[1].flags.c_contiguous:
            return [partial(scatter, ins, outs, ws)]
        onehot, index, negative = ws[onehot_k], ws[index_k], ws[negative_k]
        finite = ws[finite_k]
        flat = ins[1].reshape(-1)

        def run():
            np.isfinite(ins[0], out=finite)
            if not finite.all():
                scatter(ins, outs, ws)
                return
            np.copyto(index, flat)
            np.less(index, 0, out=negative)
            np.add(index, rows, out=index, where=negative)
            np.equal(table_rows, index, out=ws[hit_k])
            np.copyto(onehot, ws[hit_k])
            np.matmul(onehot, gy, out=gx)

        return [run]

    return host_blas.prepared_step(make)


def _slice_adds(scatter, rows: int, gy_splits: tuple[int, int], axis: int, ins, outs, ws):
    """GatherGrad's calls for a few indices: ``gx[:, i] += gy[:, j]`` on the ``[head, index,
    tail]`` views, made once (``host_blas.prepared_step``); np.add.at where a view would need
    a copy."""
    gy, gx = merged_view(ins[0], gy_splits), merged_view(outs[0], (axis, axis + 1))
    if gy is None or gx is None:
        return [partial(scatter, ins, outs, ws)]
    gy_rows = [gy[:, j] for j in range(gy.shape[1])]
    gx_rows = [gx[:, i] for i in range(rows)]
    indices, target = ins[1], outs[0]

    def run():
        target.fill(0)
        for j, i in enumerate(indices.reshape(-1).tolist()):
            if not -rows <= i < rows:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {rows}")
            np.add(gx_rows[i], gy_rows[j], out=gx_rows[i])

    return [run]


def gather_nd_grad_numpy(ctx):
    """GatherND's scatter-add: ``gx = 0; gx[batch grids + indices] += gy`` (attr
    ``batch_dims``; input 1 the indices)."""
    k = ctx.inputs[1].shape[-1]
    grids = _nd_grids(ctx.inputs[1].shape, int(ctx.attrs["batch_dims"]))

    def run(ins, outs, ws):
        outs[0].fill(0)
        idx = ins[1]
        np.add.at(outs[0], grids + tuple(idx[..., j] for j in range(k)), ins[0])

    return run


# ---- gradient rules -------------------------------------------------------------------------
# Each returns one entry per forward input; index inputs never get one (``grad_inputs``).


def gather_vjp(b, node, gys, needed):
    x = node.inputs[0]
    axis = positive_axis(node.attrs["axis"], x.rank)
    return first_only(node, b.op("GatherGrad", [gys[0], node.inputs[1]], {"axis": axis},
                             domain=INTERNAL_DOMAIN, like=x))


def gather_elements_vjp(b, node, gys, needed):
    """Scatter-add of gy into zeros (ScatterElements, reduction add)."""
    x = node.inputs[0]
    return first_only(node, b.op("ScatterElements", [zeros_like(b, x), node.inputs[1], gys[0]],
                             {"axis": int(node.attrs["axis"]), "reduction": "add"}, like=x))


def gather_nd_vjp(b, node, gys, needed):
    x = node.inputs[0]
    return first_only(node, b.op("GatherNDGrad", [gys[0], node.inputs[1]],
                             {"batch_dims": int(node.attrs.get("batch_dims", 0))},
                             domain=INTERNAL_DOMAIN, like=x))


def scatter_elements_vjp(b, node, gys, needed):
    """reduction none: data's gradient is gy with the overwritten positions zeroed, the
    updates' is gy gathered there (with repeated indices only the last update reaches y; all
    receive gy, as in PyTorch's scatter). reduction add: data's gradient is gy itself."""
    x, idx, updates = node.inputs
    gy = gys[0]
    axis = int(node.attrs["axis"])
    reduction = node.attrs.get("reduction", "none")
    if reduction not in ("none", "add"):
        raise UnsupportedModelError(f"{node.label}: no gradient for ScatterElements with "
                                    f"reduction {reduction!r} (none and add have one)", [])
    gx = gu = None
    if needed[0]:
        gx = gy if reduction == "add" else b.op(
            "ScatterElements", [gy, idx, zeros_like(b, updates)], {"axis": axis}, like=x)
    if needed[2]:
        gu = b.op("GatherElements", [gy, idx], {"axis": axis}, like=updates)
    return [gx, None, gu]


def scatter_nd_vjp(b, node, gys, needed):
    """reduction none: data's gradient is gy with the scattered slices zeroed (ScatterND of
    zeros), the updates' is gy gathered there (GatherND; repeated index tuples all receive gy,
    as in PyTorch's index_put). reduction add: data's gradient is gy itself. mul/max/min have
    no rule here (they would need the forward's operands and a tie rule)."""
    x, idx, updates = node.inputs
    gy = gys[0]
    reduction = node.attrs.get("reduction", "none")
    if reduction not in ("none", "add"):
        raise UnsupportedModelError(f"{node.label}: no gradient for ScatterND with reduction "
                                    f"{reduction!r} (none and add have one); freeze the "
                                    f"parameters that reach its data and updates", [])
    gx = gu = None
    if needed[0]:
        gx = gy if reduction == "add" else b.op(
            "ScatterND", [gy, idx, zeros_like(b, updates)], like=x)
    if needed[2]:
        gu = b.op("GatherND", [gy, idx], like=updates)
    return [gx, None, gu]


def reverse_sequence_vjp(b, node, gys, needed):
    """The reversal is its own inverse: the same reversal of gy."""
    return first_only(node, b.op("ReverseSequence", [gys[0], node.inputs[1]],
                                 {"time_axis": int(node.attrs["time_axis"]),
                                  "batch_axis": int(node.attrs["batch_axis"])},
                                 like=node.inputs[0]))


def top_k_vjp(b, node, gys, needed):
    """The values' gradient scattered back to where they came from (the indices output)."""
    x = node.inputs[0]
    if gys[0] is None:
        return first_only(node, None)
    g = b.op("ScatterElements", [zeros_like(b, x), node.outputs[1], gys[0]],
             {"axis": positive_axis(node.attrs["axis"], x.rank)}, like=x)
    return first_only(node, g)


# ---- registration ---------------------------------------------------------------------------


def tensor_scatter_numpy(ctx):
    """TensorScatter (a KV cache update): ``present`` is ``past`` with ``update``'s slices
    written along ``axis`` from each batch row's ``write_indices[b]`` (0 when absent), wrapping
    round the axis in ``circular`` mode."""
    shape = ctx.inputs[0].shape
    axis = positive_axis(ctx.attrs.get("axis", -2), len(shape))
    if axis == 0:
        raise ctx.error("axis 0 is the batch axis that write_indices index")
    mode = ctx.attrs.get("mode", "linear")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in ("linear", "circular"):
        raise ctx.error(f"mode {mode!r} is not linear or circular")
    steps = np.arange(ctx.inputs[1].shape[axis])
    size, has_indices = shape[axis], ctx.has_input(2)

    def run(ins, outs, ws):
        past, update, y = ins[0], ins[1], outs[0]
        if not np.may_share_memory(y, past):
            np.copyto(y, past)
        for b in range(shape[0]):
            rows = steps + (int(ins[2][b]) if has_indices else 0)
            if mode == "circular":
                rows %= size
            np.moveaxis(y[b], axis - 1, 0)[rows] = np.moveaxis(update[b], axis - 1, 0)

    return run


def array_feature_extractor_numpy(ctx):
    """ai.onnx.ml ArrayFeatureExtractor: the last axis's elements at the (flattened) indices;
    a 1-D input gives one row, as onnxruntime does."""
    taken = ctx.inputs[0].shape[:-1] + (math.prod(ctx.inputs[1].shape),)

    def run(ins, outs, ws):
        np.take(ins[0], ins[1].reshape(-1), axis=-1, out=outs[0].reshape(taken))

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("ArrayFeatureExtractor", (1,), {"numpy": array_feature_extractor_numpy},
              domain="ai.onnx.ml", layout=PLAIN_ONLY, differentiable=False),
        OpDef("TensorScatter", (24,), {"numpy": tensor_scatter_numpy}, differentiable=False),
        OpDef("Gather", (1, 11, 13), {"numpy": gather_numpy}, differentiable=True,
              gradient=gather_vjp, grad_inputs=DATA_INPUT, param_inputs=DATA_INPUT,
              value_bounds=bounded_like_input),
        OpDef("GatherElements", (11, 13), {"numpy": gather_elements_numpy}, differentiable=True,
              gradient=gather_elements_vjp, grad_inputs=DATA_INPUT),
        OpDef("GatherND", (11, 12, 13), {"numpy": gather_nd_numpy}, differentiable=True,
              gradient=gather_nd_vjp, grad_inputs=DATA_INPUT),
        OpDef("ScatterElements", (11, 13, 16, 18), {"numpy": scatter_elements_numpy},
              differentiable=True, gradient=scatter_elements_vjp, grad_inputs=(0, 2)),
        OpDef("Scatter", (9, 11), {"numpy": scatter_elements_numpy}, differentiable=True,
              gradient=scatter_elements_vjp, grad_inputs=(0, 2),
              doc="opset 9-10's name of ScatterElements (no reduction); deprecated at 11"),
        OpDef("ScatterND", (11, 13, 16, 18), {"numpy": scatter_nd_numpy},
              differentiable=True, gradient=scatter_nd_vjp, grad_inputs=(0, 2),
              doc="y = data with the slice at each index tuple (indices' last axis, k <= "
                  "rank) set to its updates (reduction none) or reduced with them (add; mul "
                  "from v16; max, min from v18). Negative indices count from the end; an "
                  "out-of-range one is an error naming the node. With repeated index tuples "
                  "and reduction none ONNX leaves the winner undefined (NumPy keeps the last, "
                  "as onnx.reference does). Gradients for none and add; indices get none"),
        OpDef("ReverseSequence", (10, 28), {"numpy": reverse_sequence_numpy},
              differentiable=True, gradient=reverse_sequence_vjp, grad_inputs=DATA_INPUT,
              doc="per batch entry, the first sequence_lens[b] steps along time_axis reversed"),
        OpDef("OneHot", (9, 11, 28), {"numpy": one_hot_numpy}, const_inputs=(1,),
              differentiable=False),
        OpDef("TopK", (1, 10, 11, 24), {"numpy": top_k_numpy}, const_inputs=(1,),
              differentiable=True, gradient=top_k_vjp, grad_inputs=DATA_INPUT),
        # backward-only ops of the rules above
        OpDef("GatherGrad", (1,), {"numpy": gather_grad_numpy}, domain=INTERNAL_DOMAIN,
              doc="gradient of Gather: scatter-add of gy along axis"),
        OpDef("GatherNDGrad", (1,), {"numpy": gather_nd_grad_numpy}, domain=INTERNAL_DOMAIN,
              doc="gradient of GatherND: scatter-add of gy at the index tuples"),
    ]
