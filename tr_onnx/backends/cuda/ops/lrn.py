"""cuda bindings of ``ops/lrn.py``: the family's KernelDefs are registered here."""

from __future__ import annotations

from ....hookspecs import hookimpl


@hookimpl
def tr_onnx_op_definitions():
    return []
