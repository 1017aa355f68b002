"""cuda bindings of ``ops/dynamic.py``: Compress by a plan-time condition (``kernels/dynamic.cu``).

The rest of the family decides sizes or the path from the data of each step -- NonZero,
Unique, an If on a computed condition, and the DynamicRegion (with its gradient) that runs
them: its producers eagerly on the host, then a sub-plan specialised to the sizes they gave.
A captured CUDA Graph replays one path over fixed sizes, so the cuda backend does not run
them (docs/gpu.md, "Ops the cuda backend does not run"); a model with them trains on numpy.
"""

from __future__ import annotations

import math

import numpy as np

from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.dynamic import compress_indices
from ....ops.tensor import positive_axis
from ..bind import BindContext, Unbound, binding, i64, move_kernel, need_compact
from ..sources import KernelSource, instantiate, kernel_source, widths

# ---- kernels/dynamic.cu: the family's name table -----------------------------------------------

def dynamic_source() -> KernelSource:
    """kernels/dynamic.cu: Compress along an axis by a plan-time condition."""
    return kernel_source("dynamic", instantiate("TR_COMPRESS({U}, {bytes})",
                                                "tr_compress_b{bytes}", widths(1, 2, 4, 8)))


KERNELS = dynamic_source()


def bind_compress(b: BindContext, node) -> list:
    """The kept slices along ``axis`` (the flattened data without one), the condition read on
    the device; its length and count checked against the plan here."""
    x, condition, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, x, y)
    if condition.data is None:
        raise Unbound("a condition computed at run time (it runs in a DynamicRegion)")
    if b.t(condition).dtype != np.bool_:
        raise Unbound(f"a {b.t(condition).dtype} condition; the kernel reads bool bytes")
    shape = tuple(b.t(x).shape)
    axis = node.attrs.get("axis")
    if axis is None:
        outer, axis_len, inner = 1, math.prod(shape), 1
    else:
        a = positive_axis(axis, len(shape))
        outer, axis_len, inner = math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])
    keep = compress_indices(condition.data)
    cond_len = int(np.asarray(condition.data).size)
    if keep.size and keep[-1] >= axis_len:
        raise Unbound("the condition selects past the end of the data")
    n = outer * keep.size * inner
    if n != math.prod(b.t(y).shape):
        raise Unbound(f"the condition keeps {keep.size} slices; the output is "
                      f"{list(b.t(y).shape)}")
    if n == 0:
        return []
    return [b.launch(f"tr_compress_{move_kernel(b, y)}", n,
                     [b.buf(x), b.buf(condition), b.buf(y, True), i64(n), i64(keep.size),
                      i64(inner), i64(axis_len), i64(min(cond_len, axis_len))])]


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Compress", "cuda", binding(bind_compress))]
