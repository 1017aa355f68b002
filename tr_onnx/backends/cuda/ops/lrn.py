"""cuda bindings of ``ops/lrn.py``: LRN and its backward LRNGrad (``kernels/lrn.cu``), one
thread per element of the output (padded lanes included: written 0), each operand a
channels-last or compact map of its own, each thread summing its own channel window (no
scratch: the backward recomputes its neighbours' denominators, ``size`` of them)."""

from __future__ import annotations

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import BindContext, binding, f32, float_dt, i32, i64
from ..sources import STORAGE, KernelSource, instantiate, kernel_source
from .normalization import map_args, map_lanes, map_strides


def lrn_source() -> KernelSource:
    """kernels/lrn.cu: LRN forward and backward."""
    return kernel_source("lrn", instantiate("TR_LRN({T}, {dt})",
                                            ("tr_lrn_fwd_{dt}", "tr_lrn_bwd_{dt}"), STORAGE))


KERNELS = lrn_source()


def _window(node) -> list:
    """The window [ch - lo, ch + hi] as ops/lrn.py's and the forward's scalars, rounded to
    float32 as NumPy rounds them: (lo, hi, alpha / size, bias, -beta)."""
    size = int(node.attrs["size"])
    lo = (size - 1) // 2
    return [i32(lo), i32(size - 1 - lo), f32(float(node.attrs["alpha"]) / size),
            f32(float(node.attrs["bias"])), f32(-float(node.attrs["beta"]))]


def _sizes(b: BindContext, x, out) -> tuple[int, list, int]:
    """(the output's elements, padded lanes included; [n, s, c]; the output's lanes)."""
    n, s, c, *_ = map_strides(b, x)
    lanes = map_lanes(b, out)
    return n * s * lanes, [i64(n), i64(s), i64(c)], lanes


def bind_lrn(b: BindContext, node) -> list:
    """LRN: ``tr_lrn_fwd``."""
    x, y = node.inputs[0], node.outputs[0]
    count, dims, lanes = _sizes(b, x, y)
    return [b.launch(f"tr_lrn_fwd_{float_dt(b, x, y)}", count, [
        b.buf(x), b.buf(y, True), *dims, *map_args(b, x), *map_args(b, y), i64(lanes),
        *_window(node)])]


def bind_lrn_grad(b: BindContext, node) -> list:
    """LRNGrad(gy, x) -> gx: ``tr_lrn_bwd``."""
    gy, x = node.inputs[:2]
    gx = node.outputs[0]
    count, dims, lanes = _sizes(b, x, gx)
    beta, alpha, size = float(node.attrs["beta"]), float(node.attrs["alpha"]), \
        int(node.attrs["size"])
    return [b.launch(f"tr_lrn_bwd_{float_dt(b, gy, x, gx)}", count, [
        b.buf(gy), b.buf(x), b.buf(gx, True), *dims, *map_args(b, gy), *map_args(b, x),
        *map_args(b, gx), i64(lanes), *_window(node), f32(-beta - 1.0),
        f32(-2.0 * beta * alpha / size)])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("LRN", "cuda", binding(bind_lrn)),
            KernelDef("LRNGrad", "cuda", binding(bind_lrn_grad), domain=INTERNAL_DOMAIN)]
