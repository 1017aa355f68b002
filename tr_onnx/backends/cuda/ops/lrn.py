"""cuda bindings of ``ops/lrn.py``: LRN and its backward LRNGrad (``kernels/lrn.cu``), one
thread per element of a channels-last (padded lanes included: written 0) or compact map, each
summing its own channel window (no scratch: the backward recomputes its neighbours'
denominators, ``size`` of them)."""

from __future__ import annotations

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import INTERNAL, BindContext, binding, f32, float_dt, i32, i64, same_layout
from ..sources import STORAGE, KernelSource, instantiate, kernel_source
from .normalization import map_strides


def lrn_source() -> KernelSource:
    """kernels/lrn.cu: LRN forward and backward."""
    return kernel_source("lrn", instantiate("TR_LRN({T}, {dt})",
                                            ("tr_lrn_fwd_{dt}", "tr_lrn_bwd_{dt}"), STORAGE))


KERNELS = lrn_source()


def _window_args(b: BindContext, node, x) -> tuple[int, list]:
    """(elements of the [N, S, Cp] map, the map and window arguments both kernels start with):
    the window [ch - lo, ch + hi] as ops/lrn.py's, its scalars rounded to float32 as NumPy
    rounds them."""
    n, s, c, cp, sn, ss, sc = map_strides(b, x)
    size = int(node.attrs["size"])
    alpha, bias = float(node.attrs["alpha"]), float(node.attrs["bias"])
    lo = (size - 1) // 2
    return n * s * cp, [i64(n), i64(s), i64(c), i64(cp), i64(sn), i64(ss), i64(sc), i32(lo),
                       i32(size - 1 - lo), f32(alpha / size), f32(bias),
                       f32(-float(node.attrs["beta"]))]


def bind_lrn(b: BindContext, node) -> list:
    """LRN: ``tr_lrn_fwd``; y laid out as x (its padded lanes written 0)."""
    x, y = node.inputs[0], node.outputs[0]
    same_layout(b, x, y)
    count, args = _window_args(b, node, x)
    return [b.launch(f"tr_lrn_fwd_{float_dt(b, x, y)}", count,
                     [b.buf(x), b.buf(y, True), *args])]


def bind_lrn_grad(b: BindContext, node) -> list:
    """LRNGrad(gy, x) -> gx: ``tr_lrn_bwd``; gy and gx laid out as x."""
    gy, x = node.inputs[:2]
    gx = node.outputs[0]
    same_layout(b, gy, x)
    same_layout(b, x, gx)
    count, args = _window_args(b, node, x)
    beta, alpha, size = float(node.attrs["beta"]), float(node.attrs["alpha"]), \
        int(node.attrs["size"])
    return [b.launch(f"tr_lrn_bwd_{float_dt(b, gy, x, gx)}", count,
                     [b.buf(gy), b.buf(x), b.buf(gx, True), *args, f32(-beta - 1.0),
                      f32(-2.0 * beta * alpha / size)])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("LRN", "cuda", binding(bind_lrn)),
            KernelDef("LRNGrad", "cuda", binding(bind_lrn_grad), domain=INTERNAL)]
