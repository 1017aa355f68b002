"""An example tr_onnx op set (domain ``com.example``, version 1): ``Swish`` (attribute ``beta``)
and ``BiasGelu`` (bias on the last axis, erf form), each with a NumPy kernel, a CUDA kernel
source, a layout rule, a shape rule and a gradient rule, written against ``tr_onnx.plugin``
only; ``MatMulBiasRelu``, whose cuda kernel is a cuDNN graph it declares; and ``BatchCenter``
(``batch_center.py``), whose training form, export rule and value bound live in its OpDef.
``REFERENCE_OPS`` runs models using the first three in ``onnx.reference``::

    ReferenceEvaluator(model, new_ops=tr_onnx_example_ops.REFERENCE_OPS)

Installed, it is found through the entry point ``[project.entry-points.tr_onnx] example_ops``.
"""

from __future__ import annotations

from tr_onnx.plugin import hookimpl

from . import batch_center, bias_gelu, matmul_bias_relu, swish

DOMAIN = "com.example"
OPSET_VERSION = 1
REFERENCE_OPS = [swish.Swish, bias_gelu.BiasGelu, bias_gelu.BiasGeluGrad,
                 matmul_bias_relu.MatMulBiasRelu]


@hookimpl
def tr_onnx_op_definitions():
    return [swish.OPDEF, *bias_gelu.OPDEFS, *matmul_bias_relu.OPDEFS, *batch_center.OPDEFS]
