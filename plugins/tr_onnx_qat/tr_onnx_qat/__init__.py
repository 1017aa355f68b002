"""Quantization-aware training for tr_onnx, against ``tr_onnx.plugin`` only.

- ``Round`` (every ONNX version): a straight-through-estimator gradient, ``gx = gy``. Round's
  true derivative is 0 almost everywhere, so a model with Div/Round/Clip/Mul fake quantization
  could not train; this replaces "no gradient" on purpose (``tr-onnx plugins`` reports it).
- ``com.example.quant`` ``FakeQuantize`` version 1 (``fake_quantize``): inputs ``x``, ``scale``
  (broadcastable to x; a scalar for per-tensor quantization); attributes ``zero_point`` (int, 0),
  ``qmin``/``qmax`` (ints, -128/127)::

      y = (clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale

``REFERENCE_OPS`` runs models using FakeQuantize in ``onnx.reference``.
"""

from __future__ import annotations

import onnx

from tr_onnx.plugin import GradientDef, hookimpl

from . import fake_quantize

DOMAIN = fake_quantize.DOMAIN
OPSET_VERSION = 1
REFERENCE_OPS = [fake_quantize.FakeQuantize]
ROUND_VERSIONS = tuple(sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                               if s.name == "Round" and s.domain == ""}))


def round_ste_vjp(b, node, gys, needed):
    """Straight-through estimator: Round passes its output gradient through unchanged."""
    return [gys[0]]


@hookimpl
def tr_onnx_op_definitions():
    return [GradientDef("Round", ROUND_VERSIONS, round_ste_vjp), fake_quantize.OPDEF]
