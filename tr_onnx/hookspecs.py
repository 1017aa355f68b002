"""The hooks an op set implements. Builtin op sets and third-party plugins use the same ones.

A third-party package makes its op set known through the entry-point group ``tr_onnx``::

    [project.entry-points.tr_onnx]
    my_ops = "my_package.ops"

The module (or object) named there carries functions decorated with ``tr_onnx.hookimpl``.
"""

from __future__ import annotations

import pluggy

PROJECT = "tr_onnx"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def tr_onnx_op_definitions() -> list:
    """Return the ``OpDef`` objects this op set provides (new ops, or ``overrides=True``
    replacements), and ``GradientDef`` objects (gradients for ops registered elsewhere).

    Called once per plugin when the op registry is built (the first time a model is imported,
    or when ``tr-onnx ops`` lists them). Every ``(domain, op_type, since_version, backend)`` a
    definition covers becomes a registry key; a key provided by two plugins is an error that
    names both. Return an empty list to provide nothing.
    """
