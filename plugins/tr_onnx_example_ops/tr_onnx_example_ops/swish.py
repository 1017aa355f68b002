"""``com.example`` Swish, version 1: ``y = x * sigmoid(beta * x)`` (attribute ``beta``, float,
default 1.0). Shape rule, layout rule, gradient rule, NumPy and CUDA kernels and the
``onnx.reference`` implementation side by side."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from tr_onnx.plugin import ELEMENTWISE, CudaKernel, OpDef

from ._cuda import PRELUDE, entry_points

DOMAIN = "com.example"
BETA = 1.0  # the default of attribute beta: every reader below takes it from here


def beta_of(attrs) -> float:
    return float(attrs["beta"])  # the OpDef's attr_defaults fill it in when a node omits it


def same_shape(node, shapes, dtypes):
    """Shape rule: ONNX does not know com.example ops; the output is shaped like input 0."""
    return [(shapes[0], dtypes[0])]


def swish_numpy(ctx):
    beta = beta_of(ctx.attrs)
    x = ctx.inputs[0]
    z_ws = ctx.workspace(x.shape, x.dtype)
    e_ws = ctx.workspace(x.shape, x.dtype)
    pos_ws = ctx.workspace(x.shape, np.bool_)

    def run(ins, outs, ws):
        x, y = ins[0], outs[0]
        z, e, pos = ws[z_ws], ws[e_ws], ws[pos_ws]
        # sigmoid(z) = 1/(1+e) for z >= 0 and e/(1+e) below, e = exp(-|z|): never overflows
        np.multiply(x, beta, out=z)
        np.greater_equal(z, 0, out=pos)
        np.abs(z, out=e)
        np.negative(e, out=e)
        np.exp(e, out=e)
        np.add(e, 1, out=z)
        np.divide(e, z, out=e)
        np.divide(1, z, out=e, where=pos)
        np.multiply(x, e, out=y)

    return run


def swish_vjp(b, node, gys, needed):
    """dy/dx = s + beta * y * (1 - s), s = sigmoid(beta x): standard ops only."""
    x, y = node.inputs[0], node.outputs[0]
    beta = b.scalar_like(beta_of(node.attrs), x)
    s = b.op("Sigmoid", [b.mul(x, beta)])
    slope = b.add(s, b.mul(b.mul(y, beta), b.sub(b.scalar_like(1.0, x), s)))
    return [b.mul(gys[0], slope)]


CUDA_SOURCE = PRELUDE + r"""
template <typename T>
__device__ void swish(const T* __restrict__ x, T* __restrict__ y, long long n, float beta) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = load_f32(x, i);
        store_f32(y, i, v / (1.0f + __expf(-beta * v)));
    }
}
""" + entry_points("swish", "const T* x, T* y, long long n, float beta", "x, y, n, beta")

# launch "elementwise": swish_f32 / swish_f16 (x, y, n, beta) over the logical elements
SWISH_CUDA = CudaKernel(CUDA_SOURCE, "swish", launch="elementwise", scalar_attrs=("beta",))


class Swish(OpRun):
    """``onnx.reference`` implementation, for ``ReferenceEvaluator(model, new_ops=...)``."""

    op_domain = DOMAIN
    op_schema = None  # not the schema of a same-named op of another domain (ai.onnx Swish)

    def _run(self, x, beta=None):
        beta = BETA if beta is None else beta
        sigmoid = 0.5 * (1.0 + np.tanh(0.5 * beta * x))  # a different formula than the kernel's
        return ((x * sigmoid).astype(x.dtype),)


OPDEF = OpDef("Swish", (1,), {"numpy": swish_numpy, "cuda": SWISH_CUDA}, domain=DOMAIN,
              layout=ELEMENTWISE, shape=same_shape, differentiable=True, gradient=swish_vjp,
              attr_defaults={"beta": BETA}, doc="y = x * sigmoid(beta * x)")
