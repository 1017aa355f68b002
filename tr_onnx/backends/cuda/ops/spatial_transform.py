"""cuda bindings of ``ops/spatial_transform.py`` (being written: the family registers its KernelDefs here)."""

from __future__ import annotations

from ....hookspecs import hookimpl


@hookimpl
def tr_onnx_op_definitions():
    return []
