"""The public plugin API: everything an op-set plugin needs, and nothing internal.

A plugin is a module (or object) with a function marked ``@hookimpl`` named
``tr_onnx_op_definitions`` returning ``OpDef`` (a new op: kernels per backend, layout rule,
gradient rule, shape rule), ``GradientDef`` (a gradient for an op registered elsewhere) and
``KernelDef`` (one backend's kernel for an op registered elsewhere; the builtin cuda bindings
are KernelDefs, ``tr_onnx/backends/cuda/ops/<family>.py``) objects. It is found through the
entry-point group ``tr_onnx`` of an installed package, or
passed as ``plugins=[module]`` to ``InferenceSession``/``TrainingSession``. See docs/plugins.md.

Kernels (per backend):
    ``def factory(ctx: KernelContext) -> run`` runs once at plan time; ``run(ins, outs, ws)``
    runs every step and writes its outputs in place (``ins``/``outs`` are arena views in ONNX
    axis order, ``ws`` the workspaces asked for with ``ctx.workspace``). For the cuda backend a
    ``CudaKernel`` (CUDA C++ source) takes the factory's place.
Gradient rules:
    ``def vjp(b: GradBuilder, node, gys, needed) -> [gx or None per input]`` builds IR nodes with
    ``b.op(...)``, ``b.const``, ``b.add/sub/mul/div/neg``, ``b.unbroadcast``; never arrays.
Layout rules:
    ``ELEMENTWISE`` (the default: any layout, outputs follow), ``SPATIAL`` (NHWC feature maps),
    ``PLAIN_ONLY`` (compact inputs and outputs; the safe choice for ops that reshape),
    ``STRIDED_TO_PLAIN``, or a ``LayoutRule(...)``.
Shape rules (for ops ONNX shape inference does not know):
    ``def shape(node, input_shapes, input_dtypes) -> [(shape, dtype) per output]``.
Training, eval and export forms, float32 ports, value bounds:
    ``OpDef(training=..., inference=..., export=..., fp32_inputs=..., value_bounds=...)``; a
    training form is handed a ``TrainingContext`` (``tr_onnx.opdef.OpDef`` explains each).
"""

from __future__ import annotations

from .hookspecs import hookimpl
from .opdef import (
                    CHANNEL_VECTOR,
                    CHANNELS_LAST,
                    CONV_WEIGHT,
                    ELEMENTWISE,
                    FOLLOW,
                    MATMUL,
                    PLAIN,
                    PLAIN_ONLY,
                    SPATIAL,
                    STRIDED,
                    STRIDED_TO_PLAIN,
                    CudaKernel,
                    GradientDef,
                    KernelContext,
                    KernelDef,
                    LayoutRule,
                    OpDef,
                    TensorInfo,
                    TrainingContext,
                    bounded_like_input,
                    unit_bounded,
)
from .passes.autodiff import GradBuilder

__all__ = [
    "hookimpl", "OpDef", "GradientDef", "KernelDef", "CudaKernel", "KernelContext", "TensorInfo",
    "GradBuilder", "LayoutRule", "ELEMENTWISE", "SPATIAL", "PLAIN_ONLY", "STRIDED_TO_PLAIN",
    "MATMUL", "STRIDED", "PLAIN", "CHANNELS_LAST", "FOLLOW", "CONV_WEIGHT", "CHANNEL_VECTOR",
    "TrainingContext", "bounded_like_input", "unit_bounded",
]
