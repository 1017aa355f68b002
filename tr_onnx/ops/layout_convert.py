"""``LayoutTranspose`` (domain ai.tr_onnx): the layout pass inserts it where an op cannot read
the layout its input has. Kernels see logical views, so the conversion is one strided copy."""

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..layouts import GatherRowsLayout
from ..opdef import STRIDED_TO_PLAIN, OpDef
from .tensor import onednn_transpose


def layout_transpose_numpy(ctx):
    src = ctx.inputs[0].layout
    if isinstance(src, GatherRowsLayout):  # a permuted-row matrix back to logical order
        keep = np.nonzero(src.index >= 0)[0]
        target = src.index[keep]

        def run_gather(ins, outs, ws):
            # fancy indexing makes a temporary; the layout pass never needs this in the models
            # we ship (absorbed Flattens feed only Gemm/MatMul), it exists for completeness
            np.moveaxis(outs[0], src.axis, 0)[target] = np.moveaxis(ins[0], src.axis, 0)[keep]

        return run_gather

    # the same strided copy as a Transpose with the identity permutation: one oneDNN reorder
    # for a large float32 map (channels-last -> NCHW), else NumPy's strided copy
    fast = onednn_transpose(ctx, tuple(range(len(ctx.inputs[0].shape))))
    if fast is not None:
        return fast

    def run(ins, outs, ws):
        np.copyto(outs[0], ins[0])

    return run


def _identity_vjp(b, node, gys, needed):
    """A layout change is the identity on logical values."""
    return [gys[0]]


@hookimpl
def tr_onnx_op_definitions():
    # The output layout is set by the pass that inserts the node, not by the rule.
    return [OpDef("LayoutTranspose", (1,), {"numpy": layout_transpose_numpy},
                  domain=INTERNAL_DOMAIN,
                  layout=STRIDED_TO_PLAIN, differentiable=True, gradient=_identity_vjp,
                  doc="copy a value into another physical layout")]
