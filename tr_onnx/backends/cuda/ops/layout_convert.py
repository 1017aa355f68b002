"""cuda binding of ``ops/layout_convert.py``: LayoutTranspose between a compact tensor and a
padded channels-last one, in either direction and between float storage types
(``kernels/layout_convert.cu``; the host transfers use the same kernels)."""

from __future__ import annotations

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ..bind import BindContext, Unbound, binding, geometry, i64
from ..sources import KernelSource, instantiate, kernel_source, storage_pairs

# ---- kernels/layout_convert.cu: the family's name table -----------------------------------------

STORAGE_PAIRS = (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("f32", "f16"),
                 ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the NHWC pad/unpad kernels."""


def layout_convert_source() -> KernelSource:
    """kernels/layout_convert.cu: NHWC pad/unpad between host and device layouts."""
    return kernel_source(
        "layout_convert",
        instantiate("TR_PAD({S}, {sdt}, {D}, {ddt})",
                    ("tr_pad_nhwc_{sdt}_{ddt}", "tr_unpad_nhwc_{sdt}_{ddt}"),
                    storage_pairs(STORAGE_PAIRS)))


KERNELS = layout_convert_source()


def bind_layout_transpose(b: BindContext, node) -> list:
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    gx, gy = geometry(tx), geometry(ty)
    dt_x, dt_y = b.dt(x), b.dt(y)
    if gx is None or gy is None or tuple(tx.shape) != tuple(ty.shape):
        raise Unbound(f"{tx.layout.describe()} -> {ty.layout.describe()} has no kernel")
    if gx.kind == "channels_last" and gy.kind == "flat" and tx.layout.kind == "channels_last":
        return [b.launch(f"tr_unpad_nhwc_{dt_x}_{dt_y}", gx.m,
                         [b.buf(x), b.buf(y, True), i64(gx.m), i64(gx.c), i64(gx.s),
                          i64(gx.cp)])]
    if gx.kind == "flat" and gy.kind == "channels_last" and ty.layout.kind == "channels_last":
        return [b.launch(f"tr_pad_nhwc_{dt_x}_{dt_y}", gy.n,
                         [b.buf(x), b.buf(y, True), i64(gy.n), i64(gy.c), i64(gy.s),
                          i64(gy.cp)])]
    raise Unbound(f"{tx.layout.describe()} -> {ty.layout.describe()} has no kernel")


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("LayoutTranspose", "cuda", binding(bind_layout_transpose),
                      domain=INTERNAL_DOMAIN)]
