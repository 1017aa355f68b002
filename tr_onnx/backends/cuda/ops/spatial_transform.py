"""cuda bindings of ``ops/spatial_transform.py`` and ``ops/grid_sample.py``
(``kernels/spatial_transform.cu``): GridSample (16, 20, 22) and GridSampleGrad,
AffineGrid (20), RoiAlign (10, 16, 22) and RoiAlignGrad,
Col2Im (18) and Col2ImGrad, CenterCropPad (18) and CenterCropPadGrad, MaxUnpool (9, 11, 22).

Layouts: every op but CenterCropPad is ``PLAIN_ONLY``, so the plan hands these bindings compact
tensors (``need_compact`` refuses anything else). CenterCropPad and its gradient read a strided
input (a channels-last feature map after a Conv) and write a compact output: a zero fill and
one strided copy of the centred window (the tensor family's kernels), through each operand's
logical strides.

Exactness against the numpy kernels (the tests state the bounds):

* GridSample's taps repeat ``_GridTaps`` operation by operation in fp32 (the kernels compile
  with ``--fmad=false``), so indices and weights are its bits, and the forward sums and
  GridSampleGrad's gx sums run in NumPy's order with NumPy's roundings to the storage type:
  bit for bit in f32, f16 and bf16. gx is a deterministic gather: a first pass writes every
  (n, tap combination, q)'s flat index and weight into scratch, then one thread per map
  position scans its batch item's table in (combination, q) order -- ``np.add.at``'s order --
  at O(taps * q) per position (no atomics). An output nothing reads (gx when the sampled map
  is the network's input image) is not computed. The grid's gradient sums over channels in fp32
  where NumPy's einsum has its own order: within a few ulp of the channel sum's magnitude.
* AffineGrid: the base positions in float64 as NumPy's linspace; the matmul's sum order is
  BLAS's on the numpy side (a few ulp). Its gradient is MatMul/Transpose/Reshape (other
  families' bindings).
* RoiAlign: the per-box weight matrices ``_roi_matrix`` builds, bit for bit (float64 sample
  positions, the low taps then the high ones); the average is summed in fp32 in an order of
  its own (NumPy: two BLAS matmuls), max mode is exact. RoiAlignGrad: one thread per map
  element walks the boxes of its batch item in order (NumPy's order of box contributions).
* Col2Im (a gather over the taps in row-major order: NumPy's in-place adds), Col2ImGrad,
  CenterCropPad and MaxUnpool: bit for bit. MaxUnpool keeps ``np.put``'s "last write wins"
  for repeated indices deterministically: an integer atomicMax picks the last position per
  target, then only that one writes.

Refused (``Unbound``): layouts other than the plan's (compact, or strided for CenterCropPad's
input), dtypes other than f32/f16/bf16, a grid of another dtype than the map, maps of more
than three spatial axes (GridSample, AffineGrid, Col2Im; MaxUnpool: rank above five), maps of
2^31 or more positions per batch item (GridSampleGrad's int32 tap table), RoiAlign batch
indices other than int64 and MaxUnpool indices other than int64.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....ir import Node
from ....opdef import KernelContext, KernelDef
from ....ops.grid_sample import sample_attrs
from ....ops.spatial_transform import col2im_plan, unpool_shape_of
from ..bind import (
    BindContext,
    Unbound,
    binding,
    f64,
    float_dt,
    i32,
    i64,
    logical_strides,
    move_kernel,
    need_compact,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source, plain, widths
from .tensor import strided_copy

# ---- kernels/spatial_transform.cu: the family's name table --------------------------------------


def spatial_transform_source() -> KernelSource:
    """kernels/spatial_transform.cu: GridSample (forward, tap table, both gradients),
    AffineGrid, RoiAlign (matrices, avg, max, gradient), Col2Im (and its gradient), MaxUnpool."""
    return kernel_source(
        "spatial_transform",
        plain("tr_max_unpool_winner", "tr_gs_count", "tr_gs_scan", "tr_gs_bucket"),
        instantiate("TR_GRID_SAMPLE({T}, {dt})",
                    ("tr_grid_sample_{dt}", "tr_grid_sample_taps_{dt}",
                     "tr_grid_sample_grad_x_{dt}", "tr_grid_sample_grad_grid_{dt}"), STORAGE),
        instantiate("TR_AFFINE_GRID({T}, {dt})", "tr_affine_grid_{dt}", STORAGE),
        instantiate("TR_ROI_ALIGN({T}, {dt})",
                    ("tr_roi_align_matrix_{dt}", "tr_roi_align_avg_{dt}",
                     "tr_roi_align_max_{dt}", "tr_roi_align_grad_{dt}"), STORAGE),
        instantiate("TR_COL2IM({T}, {dt})", ("tr_col2im_{dt}", "tr_col2im_grad_{dt}"), STORAGE),
        instantiate("TR_MAX_UNPOOL({U}, {bytes})", "tr_max_unpool_b{bytes}", widths(2, 4)))


KERNELS = spatial_transform_source()

MAX_SPATIAL = 3  # the spatial axes the GridSample / AffineGrid / Col2Im kernels take
MODES = {"nearest": 0, "linear": 1, "cubic": 2}
TAPS = {"nearest": 1, "linear": 2, "cubic": 4}  # taps per axis of each mode
PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


def _refusal(reason: str):
    def bind(b: BindContext, node: Node) -> list:
        raise Unbound(reason)

    return bind


def _spatial(spatial, what: str) -> list:
    """The spatial axes, padded with 1s to ``MAX_SPATIAL`` (``s0, s1, s2`` of the kernels)."""
    if len(spatial) > MAX_SPATIAL:
        raise Unbound(f"{what} with {len(spatial)} spatial axes; the kernels take "
                      f"{MAX_SPATIAL}")
    return [int(s) for s in spatial] + [1] * (MAX_SPATIAL - len(spatial))


def _zero(b: BindContext, v) -> list:
    """Launches that zero every byte of ``v`` (the tensor family's lane zeroing, c = 0)."""
    t = b.t(v)
    words = t.nbytes // 4 if t.nbytes % 4 == 0 else t.nbytes // 2
    kernel = "tr_zero_lanes_b4" if t.nbytes % 4 == 0 else "tr_zero_lanes_b2"
    return [b.launch(kernel, words, [b.buf(v, True), i64(words), i64(0), i64(1)])]


# ---- GridSample ---------------------------------------------------------------------------------


def _grid_args(ctx: KernelContext, x_shape, what: str) -> tuple[list, list, int]:
    """(spatial dims s0..s2, the mode/padding/align int32 arguments, taps per axis) of a
    GridSample node or of its gradient (v20 mode names)."""
    mode, padding, align = sample_attrs(ctx)
    s = [i64(d) for d in _spatial(x_shape[2:], what)]
    return s, [i32(MODES[mode]), i32(PADDINGS[padding]), i32(align)], TAPS[mode]


def grid_sample_factory(ctx: KernelContext):
    """GridSample: one thread per (batch item, output position) over every channel."""
    n, c, *spatial = ctx.inputs[0].shape
    q = math.prod(ctx.outputs[0].shape[2:])
    try:
        s, modes, _ = _grid_args(ctx, ctx.inputs[0].shape, "GridSample")
    except Unbound as e:
        return _refusal(str(e))

    def bind(b: BindContext, node: Node) -> list:
        x, grid = node.inputs
        y = node.outputs[0]
        need_compact(b, x, grid, y)
        dt = float_dt(b, x, grid, y)
        return [b.launch(f"tr_grid_sample_{dt}", n * q,
                         [b.buf(x), b.buf(grid), b.buf(y, True), i64(n), i64(c), i64(q),
                          i64(len(spatial)), *s, *modes])]

    return bind


def grid_sample_grad_factory(ctx: KernelContext):
    """GridSampleGrad(gy, x, grid) -> (gx, ggrid): scratch for the tap table of gx's gather
    (an int32 flat index and a float32 weight per batch item, tap combination and position)
    and its buckets by map position (each bucket's start, a fill cursor per position, the
    taps' ids in bucket order), so the gather reads each tap once."""
    n, c, *spatial = ctx.inputs[1].shape
    q, p = math.prod(ctx.inputs[0].shape[2:]), math.prod(spatial)
    try:
        s, modes, per_axis = _grid_args(ctx, ctx.inputs[1].shape, "GridSampleGrad")
    except Unbound as e:
        return _refusal(str(e))
    taps = per_axis ** len(spatial)
    if p >= 2 ** 31 or taps * q >= 2 ** 31:
        return _refusal(f"a map of {p} positions read by {taps * q} taps; the tap table "
                        "holds int32")
    table = None
    if ctx.has_output(0):
        table = (ctx.workspace((n * taps * q,), np.int32),
                 ctx.workspace((n * taps * q,), np.float32),
                 ctx.workspace((n * (p + 1),), np.int32), ctx.workspace((n * p,), np.int32),
                 ctx.workspace((n * taps * q,), np.int32))

    def bind(b: BindContext, node: Node) -> list:
        gy, x, grid = node.inputs
        # the autodiff walk emits both outputs; one nothing reads (gx of a network's input
        # image: the costly gather) is not computed
        gx, ggrid = (v if v is not None and (v.consumers or v in b.graph.outputs) else None
                     for v in (list(node.outputs) + [None, None])[:2])
        need_compact(b, gy, x, grid, gx, ggrid)
        dt = float_dt(b, gy, x, grid, gx, ggrid)
        nd = len(spatial)
        calls = []
        if gx is not None:
            flat, wt, start, fill, order = (b.ws(k) for k in table)
            m = taps * q
            calls += [b.launch(f"tr_grid_sample_taps_{dt}", n * q,
                               [b.buf(grid), flat, wt, i64(n), i64(q), i64(nd), *s,
                                *modes]),
                      *(b.launch("tr_zero_lanes_b4", size, [buf, i64(1), i64(0), i64(size)])
                        for buf, size in ((start, n * (p + 1)), (fill, n * p))),
                      b.launch("tr_gs_count", n * m,
                               [b.ws(table[0], False), start, i64(n), i64(m), i64(p)]),
                      b.launch("tr_gs_scan", n, [start, i64(n), i64(p)]),
                      b.launch("tr_gs_bucket", n * m,
                               [b.ws(table[0], False), b.ws(table[2], False), fill, order,
                                i64(n), i64(m), i64(p)]),
                      b.launch(f"tr_grid_sample_grad_x_{dt}", n * p,
                               [b.buf(gy), b.ws(table[1], False), b.ws(table[2], False),
                                order, b.buf(gx, True), i64(n), i64(c), i64(q), i64(p),
                                i64(m)])]
        if ggrid is not None:
            calls.append(b.launch(f"tr_grid_sample_grad_grid_{dt}", n * q,
                                  [b.buf(gy), b.buf(x), b.buf(grid), b.buf(ggrid, True), i64(n),
                                   i64(c), i64(q), i64(nd), *s, *modes]))
        return calls

    return bind


def bind_affine_grid(b: BindContext, node: Node) -> list:
    """AffineGrid: grid[n, q, :] = theta[n] @ (base position, 1), one thread per element."""
    theta, grid = node.inputs[0], node.outputs[0]
    need_compact(b, theta, grid)
    dt = float_dt(b, theta, grid)
    n, *spatial, nd = b.t(grid).shape
    s = _spatial(spatial, "AffineGrid")
    return [b.launch(f"tr_affine_grid_{dt}", n * math.prod(spatial) * nd,
                     [b.buf(theta), b.buf(grid, True), i64(n), i64(nd), *[i64(d) for d in s],
                      i32(bool(node.attrs["align_corners"]))])]


# ---- RoiAlign -----------------------------------------------------------------------------------


def _roi_box_args(node: Node) -> list:
    """spatial_scale, sampling_ratio, half_pixel (v10 boxes behave as output_half_pixel)."""
    half = node.attrs.get("coordinate_transformation_mode", "output_half_pixel") == "half_pixel"
    return [f64(float(node.attrs["spatial_scale"])), i64(int(node.attrs["sampling_ratio"])),
            i32(half)]


def _roi_indices(b: BindContext, batch) -> None:
    if np.dtype(b.t(batch).dtype) != np.int64:
        raise Unbound(f"batch indices of dtype {np.dtype(b.t(batch).dtype).name}; the kernels "
                      "read int64")


def _roi_matrices(ctx: KernelContext, r: int, oh: int, ow: int, h: int, w: int):
    """Scratch of the per-box weight matrices ([R, oh, h], [R, ow, w]) and sample counts."""
    return (ctx.workspace((r * oh * h,), np.float32), ctx.workspace((r * ow * w,), np.float32),
            ctx.workspace((r,), np.float32))


def _matrix_launch(b: BindContext, dt: str, rois, ws, r, oh, ow, h, w, node) -> object:
    ay, ax, count = (b.ws(k) for k in ws)
    return b.launch(f"tr_roi_align_matrix_{dt}", r * (oh + ow),
                    [b.buf(rois), ay, ax, count, i64(r), i64(oh), i64(ow), i64(h), i64(w),
                     *_roi_box_args(node)])


def roi_align_factory(ctx: KernelContext):
    """RoiAlign: avg builds the weight matrices, then one thread per output element; max
    samples the bins directly."""
    _, c, h, w = ctx.inputs[0].shape
    r, _, oh, ow = ctx.outputs[0].shape
    avg = ctx.attrs["mode"] == "avg"
    ws = _roi_matrices(ctx, r, oh, ow, h, w) if avg else None

    def bind(b: BindContext, node: Node) -> list:
        x, rois, batch = node.inputs
        y = node.outputs[0]
        need_compact(b, x, rois, batch, y)
        dt = float_dt(b, x, rois, y)
        _roi_indices(b, batch)
        sizes = [i64(r), i64(c), i64(oh), i64(ow), i64(h), i64(w)]
        if not avg:
            return [b.launch(f"tr_roi_align_max_{dt}", r * c * oh * ow,
                             [b.buf(x), b.buf(rois), b.buf(batch), b.buf(y, True), *sizes,
                              *_roi_box_args(node)])]
        return [_matrix_launch(b, dt, rois, ws, r, oh, ow, h, w, node),
                b.launch(f"tr_roi_align_avg_{dt}", r * c * oh * ow,
                         [b.buf(x), b.buf(batch), *(b.ws(k, False) for k in ws),
                          b.buf(y, True), *sizes])]

    return bind


def roi_align_grad_factory(ctx: KernelContext):
    """RoiAlignGrad(gy, rois, batch_indices) -> gx of an average RoiAlign."""
    n, c, h, w = ctx.outputs[0].shape
    r, _, oh, ow = ctx.inputs[0].shape
    ws = _roi_matrices(ctx, r, oh, ow, h, w)

    def bind(b: BindContext, node: Node) -> list:
        gy, rois, batch = node.inputs
        gx = node.outputs[0]
        need_compact(b, gy, rois, batch, gx)
        dt = float_dt(b, gy, rois, gx)
        _roi_indices(b, batch)
        return [_matrix_launch(b, dt, rois, ws, r, oh, ow, h, w, node),
                b.launch(f"tr_roi_align_grad_{dt}", n * c * h * w,
                         [b.buf(gy), b.buf(batch), *(b.ws(k, False) for k in ws),
                          b.buf(gx, True), i64(n), i64(r), i64(c), i64(oh), i64(ow), i64(h),
                          i64(w)])]

    return bind


# ---- Col2Im -------------------------------------------------------------------------------------


def _col2im_factory(grad: bool):
    def factory(ctx: KernelContext):
        cols = ctx.outputs[0] if grad else ctx.inputs[0]
        win, c = col2im_plan(ctx, cols.shape, ctx.const(1), ctx.const(2))
        lead = MAX_SPATIAL - win.ndim
        if lead < 0:
            return _refusal(f"Col2Im over {win.ndim} spatial axes; the kernels take "
                            f"{MAX_SPATIAL}")
        geometry = [i64(cols.shape[0]), i64(c)] + [
            i64(v) for field, fill in ((win.in_shape, 1), (win.kernel, 1), (win.strides, 1),
                                       (win.dilations, 1), (win.pads_begin, 0),
                                       (win.out_shape, 1))
            for v in [fill] * lead + list(field)]
        count = cols.shape[0] * c * (math.prod(win.kernel) * math.prod(win.out_shape) if grad
                                     else math.prod(win.in_shape))

        def bind(b: BindContext, node: Node) -> list:
            src, dst = node.inputs[0], node.outputs[0]
            need_compact(b, src, dst)
            dt = float_dt(b, src, dst)
            name = f"tr_col2im_grad_{dt}" if grad else f"tr_col2im_{dt}"
            return [b.launch(name, count, [b.buf(src), b.buf(dst, True), *geometry])]

        return bind

    return factory


# ---- CenterCropPad ------------------------------------------------------------------------------


def bind_center_crop_pad(b: BindContext, node: Node) -> list:
    """CenterCropPad (and its gradient): zero the output where it pads, then copy the centred
    window of the input (compact or channels-last) into the centred window of the output."""
    x, y = node.inputs[0], node.outputs[0]
    need_compact(b, y)
    move_kernel(b, y)
    shape_in, shape_out = b.t(x).shape, b.t(y).shape
    xs, ys = logical_strides(b, x), logical_strides(b, y)
    count, xo, yo = [], 0, 0
    for i, o, sx, sy in zip(shape_in, shape_out, xs, ys):
        count.append(min(i, o))
        xo += (i - o) // 2 * sx if i >= o else 0
        yo += (o - i) // 2 * sy if o > i else 0
    calls = _zero(b, y) if any(o > i for i, o in zip(shape_in, shape_out)) else []
    if math.prod(count):
        calls.append(strided_copy(b, x, y, count, xs, ys, xo=xo, yo=yo))
    return calls


# ---- MaxUnpool ----------------------------------------------------------------------------------


def max_unpool_factory(ctx: KernelContext):
    """MaxUnpool: scratch for the winning position of every target of the indices."""
    full = unpool_shape_of(ctx.inputs[0].shape, ctx.attrs)
    if len(full) > 5:
        return _refusal(f"a rank-{len(full)} MaxUnpool; the kernel takes rank 5")
    win = ctx.workspace((math.prod(full),), np.int64)

    def bind(b: BindContext, node: Node) -> list:
        x, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
        need_compact(b, x, idx, y)
        float_dt(b, x, y)
        if np.dtype(b.t(idx).dtype) != np.int64:
            raise Unbound("MaxUnpool indices other than int64")
        out = tuple(b.t(y).shape)
        if any(o < f for o, f in zip(out, full)):
            raise Unbound(f"output shape {list(out)} is smaller than the unpooled shape "
                          f"{list(full)}")
        m, total = math.prod(b.t(x).shape), math.prod(full)
        pad = [1] * (5 - len(full))
        return _zero(b, y) + [
            b.launch("tr_zero_lanes_b4", 2 * total, [b.ws(win), i64(2 * total), i64(0), i64(1)]),
            b.launch("tr_max_unpool_winner", m, [b.buf(idx), b.ws(win), i64(m), i64(total)]),
            b.launch(f"tr_max_unpool_{move_kernel(b, y)}", m,
                     [b.buf(x), b.buf(idx), b.ws(win, False), b.buf(y, True), i64(m),
                      i64(total), *[i64(d) for d in pad + list(full)],
                      *[i64(d) for d in pad + list(out)]])]

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("GridSample", "cuda", grid_sample_factory),
            KernelDef("GridSampleGrad", "cuda", grid_sample_grad_factory, domain=INTERNAL_DOMAIN),
            KernelDef("AffineGrid", "cuda", binding(bind_affine_grid)),
            KernelDef("RoiAlign", "cuda", roi_align_factory),
            KernelDef("RoiAlignGrad", "cuda", roi_align_grad_factory, domain=INTERNAL_DOMAIN),
            KernelDef("Col2Im", "cuda", _col2im_factory(False)),
            KernelDef("Col2ImGrad", "cuda", _col2im_factory(True), domain=INTERNAL_DOMAIN),
            KernelDef("CenterCropPad", "cuda", binding(bind_center_crop_pad)),
            KernelDef("CenterCropPadGrad", "cuda", binding(bind_center_crop_pad),
                      domain=INTERNAL_DOMAIN),
            KernelDef("MaxUnpool", "cuda", max_unpool_factory)]
