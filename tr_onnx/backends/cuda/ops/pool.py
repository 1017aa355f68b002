"""cuda bindings of ``ops/pool.py``: MaxPool, AveragePool, LpPool and their backward ops, and
GlobalAveragePool (``kernels/pool.cu``), over channels-last feature maps with 1-D or 2-D
windows (a compact NCHW map as N * C maps of one channel: tf2onnx exports without its
optimizer pool NCHW maps between Transposes). The window arithmetic is ``ops.conv_window.Window``'s,
the same the NumPy kernels use.
GlobalMaxPool, GlobalLpPool and GlobalMaxPoolGrad are reductions over the spatial axes: the
strided reduction kernels of ``kernels/reduce.cu`` (``backends/cuda/ops/reduce.py``)."""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....ir import Node, Value
from ....opdef import KernelContext, KernelDef
from ....ops.conv_window import Window
from ..bind import BindContext, Unbound, binding, f32, float_dt, geometry, i64
from ..sources import STORAGE, KernelSource, instantiate, kernel_source
from .reduce import RED_LP, REDUCE_OPS, reduction_geometry, strided_reduce
from .tensor import pads_after

# ---- kernels/pool.cu: the family's name table ---------------------------------------------------


def pool_source() -> KernelSource:
    """kernels/pool.cu: MaxPool / AveragePool / LpPool forward and backward,
    GlobalAveragePool."""
    return kernel_source(
        "pool",
        instantiate("TR_POOL({T}, {dt})", ("tr_maxpool_fwd_{dt}", "tr_maxpool_argmax_{dt}",
                                           "tr_maxpool_bwd_{dt}", "tr_avgpool_fwd_{dt}",
                                           "tr_avgpool_bwd_{dt}", "tr_lppool_fwd_{dt}",
                                           "tr_lppool_bwd_{dt}"),
                    STORAGE),
        instantiate("TR_GAP({T}, {dt})", "tr_gap_{dt}", STORAGE))


KERNELS = pool_source()


def _pool_geometry(b: BindContext, node: Node, x: Value, y: Value):
    """(window scalars as kernel args, (lo_h, hi_h, lo_w, hi_w) for count_include_pad on
    and off, x's and y's channels-last geometry): x the tensor the windows slide over, y the
    pooled one."""

    tx, ty = b.t(x), b.t(y)
    gx, gy = geometry(tx), geometry(ty)
    plain = [g is not None and g.kind == "flat" and len(t.shape) >= 3
             for t, g in ((tx, gx), (ty, gy))]
    for t, g, flat in ((tx, gx, plain[0]), (ty, gy, plain[1])):
        if not flat and (g is None or g.kind != "channels_last" or
                         t.layout.kind != "channels_last" or
                         t.layout.phys_shape[0] != t.shape[0]):
            raise Unbound(f"{t.name!r} is {t.layout.describe()}; the pool kernels read "
                           "channels-last or compact (NCHW) feature maps")
    if plain[0] != plain[1]:
        raise Unbound("a pool between a channels-last and a compact feature map")
    spatial = tuple(tx.shape[2:])
    if len(spatial) not in (1, 2):
        raise Unbound(f"a {len(spatial)}-D pool; the kernels pool 1-D and 2-D windows")
    attrs = {**node.attrs, "auto_pad": node.attrs.get("auto_pad", "NOTSET")}
    try:
        win = Window.resolve(attrs, spatial, node.attrs["kernel_shape"],
                             bool(node.attrs.get("ceil_mode", 0)))
    except ValueError as e:
        raise Unbound(str(e)) from None
    if tuple(win.out_shape) != tuple(ty.shape[2:]):
        raise Unbound(f"window output {list(win.out_shape)} != {list(ty.shape[2:])}")
    one = len(spatial) == 1
    H, W = (1, spatial[0]) if one else spatial
    OH, OW = (1, win.out_shape[0]) if one else win.out_shape
    kh, kw = (1, win.kernel[0]) if one else win.kernel
    sh, sw = (1, win.strides[0]) if one else win.strides
    ph, pw = (0, win.pads_begin[0]) if one else win.pads_begin
    pe_h, pe_w = (0, win.pads_end[0]) if one else win.pads_end
    dh, dw = (1, win.dilations[0]) if one else win.dilations
    # a compact [N, C, *S] map is N * C maps of one channel (channels-last [N * C, *S, 1])
    channels = (1, 1, 1) if plain[0] else (tx.shape[1], gx.cp, gy.cp)
    window = [H, W, OH, OW, *channels, kh, kw, sh, sw, ph, pw, dh, dw]
    include = [-ph, H + pe_h, -pw, W + pe_w]
    exclude = [0, H, 0, W]
    return window, include, exclude, gx, gy


def bind_max_pool(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        raise Unbound("the Indices output has no kernel")
    window, _, _, _, gy = _pool_geometry(b, node, x, y)
    dt = float_dt(b, x, y)
    return [b.launch(f"tr_maxpool_fwd_{dt}", gy.n,
                     [b.buf(x), b.buf(y, True), i64(gy.n)] + [i64(v) for v in window])]


def max_pool_grad_factory(ctx: KernelContext):
    """MaxPoolGrad: each window's argmax once per output element (int32 taps into scratch,
    one per logical element of gy), then one thread per gx element gathers the gy of the
    windows whose argmax reads it. A compact x with a channels-last gy and gx (tf2onnx's NCHW
    pools stay compact, their gradients arrive from channels-last Convs) is first padded into
    a channels-last copy in scratch, laid out as gx."""
    x_info, gx_info = ctx.inputs[1], ctx.outputs[0]
    arg_ws = ctx.workspace((math.prod(ctx.inputs[0].shape),), np.int32)
    mixed = (gx_info.layout.kind == "channels_last" and x_info.layout.kind != "channels_last")
    copy_ws = ctx.workspace(tuple(gx_info.layout.phys_shape), x_info.dtype) if mixed else None

    def bind(b: BindContext, node) -> list:
        gy, x = node.inputs[0], node.inputs[1]
        gx = node.outputs[0]
        calls, x_buf, like = [], b.buf(x), x
        if copy_ws is not None:
            g = geometry(b.t(gx))
            dt = float_dt(b, x, gx)
            calls.append(b.launch(f"tr_pad_nhwc_{dt}_{dt}", g.n,
                                  [x_buf, b.ws(copy_ws), i64(g.n), i64(g.c), i64(g.s),
                                   i64(g.cp)]))
            x_buf, like = b.ws(copy_ws, writes=False), gx
        window, _, _, g_x, _ = _pool_geometry(b, node, like, gy)
        if geometry(b.t(gx)) != g_x:
            raise Unbound("gx and x in different layouts")
        dt = float_dt(b, gy, x, gx)
        outputs = math.prod(b.t(gy).shape)
        win = [i64(v) for v in window]
        return calls + [
            b.launch(f"tr_maxpool_argmax_{dt}", outputs,
                     [x_buf, b.ws(arg_ws), i64(outputs)] + win),
            b.launch(f"tr_maxpool_bwd_{dt}", g_x.n,
                     [b.buf(gy), b.ws(arg_ws, writes=False), b.buf(gx, True), i64(g_x.n)]
                     + win)]

    return bind


def _average_pool(b: BindContext, node, pooled, full, stem: str, args: list) -> list:
    """One average-pool kernel over the windows of ``full`` (x, or gx) pooled into ``pooled``
    (y, or gy): count_include_pad picks the window bounds the average divides by."""
    window, include, exclude, g_full, g_pooled = _pool_geometry(b, node, full, pooled)
    bounds = include if int(node.attrs.get("count_include_pad", 0)) else exclude
    n = (g_pooled if stem == "fwd" else g_full).n
    dt = float_dt(b, pooled, full)
    return [b.launch(f"tr_avgpool_{stem}_{dt}", n,
                     args + [i64(n)] + [i64(v) for v in window + bounds])]


def bind_average_pool(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    return _average_pool(b, node, y, x, "fwd", [b.buf(x), b.buf(y, True)])


def bind_average_pool_grad(b: BindContext, node) -> list:
    gy, gx = node.inputs[0], node.outputs[0]
    return _average_pool(b, node, gy, gx, "bwd", [b.buf(gy), b.buf(gx, True)])


def bind_global_average_pool(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    gx, gy = geometry(b.t(x)), geometry(b.t(y))
    dt = b.dt(x)
    tx = b.t(x)
    n, s = tx.shape[0], math.prod(tx.shape[2:])
    if gx is not None and gy is not None and gx.kind == gy.kind == "channels_last" \
            and gx.cp == gy.cp and tx.layout.phys_shape[0] == n:
        cp, sstride, cstride = gx.cp, gx.cp, 1
    elif gx is not None and gy is not None and gx.kind == gy.kind == "flat":
        cp, sstride, cstride = tx.shape[1], 1, s
    else:
        raise Unbound("input and output of GlobalAveragePool must share the layout kind")
    total = n * cp
    return [b.launch(f"tr_gap_{dt}", total,
                     [b.buf(x), b.buf(y, True), i64(total), i64(s), i64(cp), i64(sstride),
                      i64(cstride)])]


def bind_lp_pool(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    window, _, _, _, gy = _pool_geometry(b, node, x, y)
    dt = float_dt(b, x, y)
    return [b.launch(f"tr_lppool_fwd_{dt}", gy.n, [b.buf(x), b.buf(y, True), i64(gy.n)]
                     + [i64(v) for v in window] + [f32(node.attrs["p"])])]


def bind_lp_pool_grad(b: BindContext, node) -> list:
    """LpPoolGrad(gy, x, y) -> gx: one thread per gx element gathers its windows' gy y^(1-p)
    in scan order, times sign(x)|x|^(p-1)."""
    gy, x, y = node.inputs[:3]
    gx = node.outputs[0]
    window, _, _, g_x, g_y = _pool_geometry(b, node, x, gy)
    if geometry(b.t(gx)) != g_x or geometry(b.t(y)) != g_y:
        raise Unbound("gx not laid out as x, or y not as gy")
    dt = float_dt(b, gy, x, y, gx)
    return [b.launch(f"tr_lppool_bwd_{dt}", g_x.n,
                     [b.buf(gy), b.buf(x), b.buf(y), b.buf(gx, True), i64(g_x.n)]
                     + [i64(v) for v in window] + [f32(node.attrs["p"])])]


def _spatial_axes(b: BindContext, x) -> list[int]:
    return list(range(2, len(b.t(x).shape)))


def bind_global_max_pool(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    return strided_reduce(b, x, y, _spatial_axes(b, x), REDUCE_OPS["ReduceMax"])


def bind_global_lp_pool(b: BindContext, node) -> list:
    """(sum over the spatial axes of |x|^p)^(1/p): ReduceL2 / ReduceL1 for p = 2 / 1."""
    x, y = node.inputs[0], node.outputs[0]
    p = float(node.attrs["p"])
    op = {2.0: REDUCE_OPS["ReduceL2"], 1.0: REDUCE_OPS["ReduceL1"]}.get(p, RED_LP)
    return strided_reduce(b, x, y, _spatial_axes(b, x), op, p)


def bind_global_max_pool_grad(b: BindContext, node) -> list:
    """GlobalMaxPoolGrad(gy, x) -> gx: gy at each (n, c) plane's first maximum, 0 elsewhere."""
    gy, x = node.inputs[0], node.inputs[1]
    gx = node.outputs[0]
    axes = _spatial_axes(b, x)
    if 0 in b.t(x).shape:
        return []
    dt = float_dt(b, gy, x, gx)
    kd, rd, (sx, sgy, sgx), (rx, rgx) = reduction_geometry(b, x, axes, reduced=[gy],
                                                          full=[gx])
    total = math.prod(kd)
    return [b.launch(f"tr_global_max_pool_grad_{dt}", total,
                     [b.buf(gy), b.buf(x), b.buf(gx, True), i64(total)]
                     + [i64(v) for v in kd + sx + sgy + sgx + rd + rx + rgx])] \
        + pads_after(b, gx)


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("MaxPool", "cuda", binding(bind_max_pool)),
            KernelDef("MaxPoolGrad", "cuda", max_pool_grad_factory, domain=INTERNAL_DOMAIN),
            KernelDef("AveragePool", "cuda", binding(bind_average_pool)),
            KernelDef("AveragePoolGrad", "cuda", binding(bind_average_pool_grad),
                      domain=INTERNAL_DOMAIN),
            KernelDef("GlobalAveragePool", "cuda", binding(bind_global_average_pool)),
            KernelDef("LpPool", "cuda", binding(bind_lp_pool)),
            KernelDef("LpPoolGrad", "cuda", binding(bind_lp_pool_grad), domain=INTERNAL_DOMAIN),
            KernelDef("GlobalMaxPool", "cuda", binding(bind_global_max_pool)),
            KernelDef("GlobalLpPool", "cuda", binding(bind_global_lp_pool)),
            KernelDef("GlobalMaxPoolGrad", "cuda", binding(bind_global_max_pool_grad),
                      domain=INTERNAL_DOMAIN)]
