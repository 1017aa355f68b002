"""``com.example`` BiasGelu, version 1: ``y = gelu(x + bias)`` (erf form), ``bias`` broadcast on
the last axis of ``x``. Its gradient is a named backward op of this domain, BiasGeluGrad
``(gy, x, bias) -> gy * gelu'(x + bias)``, with its own kernels; the bias gradient sums that
over the broadcast axes."""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun

from tr_onnx.plugin import ELEMENTWISE, CudaKernel, OpDef

from ._cuda import PRELUDE, entry_points
from ._erf import erf_into

DOMAIN = "com.example"
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def like_input0(node, shapes, dtypes):
    """Shape rule: the output is shaped like x (bias broadcasts on the last axis)."""
    return [(shapes[0], dtypes[0])]


def _scratch(ctx, x_index: int):
    """Checks bias against x; reserves t, erf and erf's scratch (float64) for x's shape."""
    x, bias = ctx.inputs[x_index], ctx.inputs[x_index + 1]
    if len(bias.shape) != 1 or bias.shape[0] != x.shape[-1]:
        raise ctx.error(f"bias shape {list(bias.shape)} must be [{x.shape[-1]}], the last axis "
                        f"of x (shape {list(x.shape)})")
    return [ctx.workspace(x.shape, np.float64) for _ in range(5)] + [
        ctx.workspace(x.shape, np.bool_)]


def _gelu_parts(x, bias, ws, scratch):
    """t = x + bias and erf(t / sqrt 2), both float64 (views of the workspaces)."""
    t, erf, z, u, p, small = (ws[i] for i in scratch)
    np.add(x, bias, out=t)
    erf_into(t, erf, _INV_SQRT2, z, u, p, small)
    return t, erf, z


def bias_gelu_numpy(ctx):
    scratch = _scratch(ctx, 0)

    def run(ins, outs, ws):
        t, r, _ = _gelu_parts(ins[0], ins[1], ws, scratch)
        r += 1.0  # gelu(t) = t (1 + erf(t / sqrt 2)) / 2
        r *= t
        r *= 0.5
        np.copyto(outs[0], r, casting="same_kind")

    return run


def bias_gelu_grad_numpy(ctx):
    scratch = _scratch(ctx, 1)

    def run(ins, outs, ws):
        gy = ins[0]
        t, r, z = _gelu_parts(ins[1], ins[2], ws, scratch)
        r += 1.0  # gelu'(t) = Phi(t) + t phi(t)
        r *= 0.5
        np.square(t, out=z)
        z *= -0.5
        np.exp(z, out=z)
        z *= _INV_SQRT_2PI
        z *= t
        r += z
        r *= gy
        np.copyto(outs[0], r, casting="same_kind")

    return run


def bias_gelu_vjp(b, node, gys, needed):
    x, bias = node.inputs
    gt = b.op("BiasGeluGrad", [gys[0], x, bias], domain=DOMAIN, like=x)
    return [gt if needed[0] else None, b.unbroadcast(gt, bias.shape) if needed[1] else None]


CUDA_SOURCE = PRELUDE + r"""
// bias broadcasts on the last axis: element i reads bias[i % bias_len]
template <typename T>
__device__ void bias_gelu(const T* __restrict__ x, const T* __restrict__ bias,
                          T* __restrict__ y, long long n, long long bias_len) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float t = load_f32(x, i) + load_f32(bias, i % bias_len);
        store_f32(y, i, 0.5f * t * (1.0f + erff(t * 0.70710678118654752f)));
    }
}

template <typename T>
__device__ void bias_gelu_grad(const T* __restrict__ gy, const T* __restrict__ x,
                               const T* __restrict__ bias, T* __restrict__ gx,
                               long long n, long long bias_len) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float t = load_f32(x, i) + load_f32(bias, i % bias_len);
        const float cdf = 0.5f * (1.0f + erff(t * 0.70710678118654752f));
        const float pdf = 0.39894228040143268f * __expf(-0.5f * t * t);
        store_f32(gx, i, load_f32(gy, i) * (cdf + t * pdf));
    }
}
""" + entry_points("bias_gelu", "const T* x, const T* bias, T* y, long long n, long long bias_len",
                   "x, bias, y, n, bias_len") + entry_points(
    "bias_gelu_grad", "const T* gy, const T* x, const T* bias, T* gx, long long n, "
    "long long bias_len", "gy, x, bias, gx, n, bias_len")

# Launch "bias_last_axis": the elementwise launch (entry points <function>_f32 / _f16) over
# the output's logical elements, with the bias length (x's last dimension) after n.
BIAS_GELU_CUDA = CudaKernel(CUDA_SOURCE, "bias_gelu", launch="bias_last_axis")
BIAS_GELU_GRAD_CUDA = CudaKernel(CUDA_SOURCE, "bias_gelu_grad", launch="bias_last_axis")


def _gelu64(t):
    erf = np.vectorize(math.erf, otypes=[np.float64])(t.astype(np.float64) * _INV_SQRT2)
    return 0.5 * t * (1.0 + erf)


class BiasGelu(OpRun):
    """``onnx.reference`` implementation (math.erf in float64)."""

    op_domain = DOMAIN
    op_schema = None  # ours: no ONNX schema (onnx.reference looks schemas up by name)

    def _run(self, x, bias):
        return (_gelu64(x.astype(np.float64) + bias).astype(x.dtype),)


class BiasGeluGrad(OpRun):
    op_domain = DOMAIN
    op_schema = None  # ours: no ONNX schema (onnx.reference looks schemas up by name)

    def _run(self, gy, x, bias):
        t = x.astype(np.float64) + bias
        erf = np.vectorize(math.erf, otypes=[np.float64])(t * _INV_SQRT2)
        slope = 0.5 * (1.0 + erf) + t * _INV_SQRT_2PI * np.exp(-0.5 * t * t)
        return ((gy * slope).astype(x.dtype),)


OPDEFS = [
    OpDef("BiasGelu", (1,), {"numpy": bias_gelu_numpy, "cuda": BIAS_GELU_CUDA}, domain=DOMAIN,
          layout=ELEMENTWISE, shape=like_input0, differentiable=True, gradient=bias_gelu_vjp,
          doc="y = gelu(x + bias), bias on the last axis"),
    # second derivatives are not provided: autodiff stops at the backward op
    OpDef("BiasGeluGrad", (1,), {"numpy": bias_gelu_grad_numpy, "cuda": BIAS_GELU_GRAD_CUDA},
          domain=DOMAIN, layout=ELEMENTWISE, shape=lambda node, shapes, dtypes:
          [(shapes[1], dtypes[1])], differentiable=False, doc="gy * gelu'(x + bias)"),
]
