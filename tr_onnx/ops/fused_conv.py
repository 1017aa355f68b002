"""FusedConv (domain ai.tr_onnx): a Conv, then an Add of a tensor of the Conv's output shape (a
residual branch, input 3, optional), then a Relu or Clip (``activation`` "Relu" or "Clip" with
``activation_params`` [lo, hi], optional), as one node; onnxruntime's com.microsoft.FusedConv
has the same inputs and attributes. Only an inference plan has it, and only where its values
are proven finite (``passes.inference_folds.finite_rewrites``).

With oneDNN (float32) the convolution adds and clips each output value while it is still in
registers (``onednn.PostOps``): neither the Add nor the activation makes a pass over the
feature map. oneDNN's clip maps NaN to the low limit where ONNX keeps NaN, hence the proof.
Elsewhere (no oneDNN, other dtypes, a window oneDNN refuses) Conv's own kernel runs, then the
Add and the activation in place on its output, as the unfused nodes compute them.
"""

from __future__ import annotations

import math

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import OpDef
from .conv import CONV_LAYOUT, conv_kernel
from .elementwise import filled_like

ACTIVATIONS = ("", "Relu", "Clip")


def activation_limits(ctx) -> tuple[float, float] | None:
    """(lo, hi) the node's activation clips to (Relu: (0, inf)), or None without one."""
    activation = ctx.attrs.get("activation", "")
    if activation not in ACTIVATIONS:
        raise ctx.error(f"activation {activation!r}: FusedConv applies one of {ACTIVATIONS}")
    if activation == "Relu":
        return 0.0, math.inf
    if activation == "Clip":
        params = [float(v) for v in ctx.attrs.get("activation_params", ())]
        if len(params) != 2 or math.isnan(params[0]) or math.isnan(params[1]):
            raise ctx.error(f"activation_params {params}: Clip takes [lo, hi]")
        return params[0], params[1]
    return None


def fused_conv_numpy(ctx):
    clip = activation_limits(ctx)
    add = ctx.has_input(3)
    y_info = ctx.outputs[0]
    if add and (tuple(ctx.inputs[3].shape) != tuple(y_info.shape)
                or ctx.inputs[3].dtype != y_info.dtype):
        raise ctx.error(f"the added input {list(ctx.inputs[3].shape)} "
                        f"({np.dtype(ctx.inputs[3].dtype)}) is not the Conv output's "
                        f"{list(y_info.shape)} ({np.dtype(y_info.dtype)})")
    conv, fused = conv_kernel(ctx, add=add, clip=clip)
    if fused or not (add or clip):
        return conv
    dtype = np.dtype(y_info.dtype)
    relu = clip == (0.0, math.inf)
    # as the Relu and Clip kernels (ops/unary.py) compute them
    zero = filled_like(y_info, 0) if relu else None
    lo, hi = (None, None) if clip is None or relu else (
        None if math.isinf(v) else dtype.type(v) for v in clip)

    def run(ins, outs, ws):
        conv(ins, outs, ws)
        y = outs[0]
        if add:
            np.add(y, ins[3], out=y)
        if relu:
            np.maximum(y, zero, out=y)
        elif lo is not None or hi is not None:
            np.clip(y, lo, hi, out=y)

    return run


@hookimpl
def tr_onnx_op_definitions():
    return [OpDef("FusedConv", (1,), {"numpy": fused_conv_numpy}, domain=INTERNAL_DOMAIN,
                  layout=CONV_LAYOUT, doc="Conv, + input 3, then Relu or Clip (inference plans "
                  "whose values are proven finite)")]
