"""``com.example`` MatMulBiasRelu, version 1: ``y = relu(a @ w + bias)``, a [M, K], w [K, N],
bias [N]. Its cuda kernel is a cuDNN graph the op declares itself (``CudnnGraph``): matmul, bias
and ReLU fused into one frontend graph, described from the MemoryPlan's tensors here, with no
line of tr_onnx knowing the op. Shape rule, layout rule, gradient rule, NumPy kernel, cuDNN graph
and the ``onnx.reference`` implementation side by side."""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from tr_onnx.backends.cuda.cudnn_graphs import (
    CudnnGraph,
    CudnnGraphError,
    GraphDesc,
    PlanIndex,
    one_data_type,
)
from tr_onnx.plugin import PLAIN_ONLY, OpDef

DOMAIN = "com.example"


def matmul_shape(node, shapes, dtypes):
    """Shape rule: [M, K] @ [K, N] (+ [N]) -> [M, N]."""
    (m, k), (k2, n), bias = shapes
    if k != k2 or tuple(bias) != (n,):
        raise ValueError(f"MatMulBiasRelu: a {list(shapes[0])} @ w {list(shapes[1])} + bias "
                         f"{list(bias)} does not fit ([M, K] @ [K, N] + [N])")
    return [((m, n), dtypes[0])]


def matmul_bias_relu_numpy(ctx):
    """Half storage computes in float32 scratch (as cuDNN's graph, fp32 compute); float64
    (the gradient checks) in float64."""
    a, w, y = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    acc = np.float64 if y.dtype == np.float64 else np.float32
    a_ws, w_ws, t_ws = (ctx.workspace(s, acc) for s in (a.shape, w.shape, y.shape))

    def run(ins, outs, ws):
        a, w, t = ws[a_ws], ws[w_ws], ws[t_ws]
        np.copyto(a, ins[0])
        np.copyto(w, ins[1])
        np.matmul(a, w, out=t)
        t += ins[2]
        np.maximum(t, 0, out=t)
        np.copyto(outs[0], t, casting="same_kind")

    return run


def matmul_bias_relu_vjp(b, node, gys, needed):
    """gt = gy where y > 0 (relu'(0) = 0: sign(y) is 0 or 1), then the matmul's and the bias'
    gradients of gt."""
    a, w, bias = node.inputs
    gt = b.mul(gys[0], b.op("Sign", [node.outputs[0]]))
    return [b.op("MatMul", [gt, b.op("Transpose", [w], {"perm": [1, 0]})]) if needed[0] else None,
            b.op("MatMul", [b.op("Transpose", [a], {"perm": [1, 0]}), gt]) if needed[1] else None,
            b.unbroadcast(gt, bias.shape) if needed[2] else None]


# ---- the cuDNN graph ------------------------------------------------------------------------

def _batched(index: PlanIndex, t, port: str, dims: tuple[int, ...], label: str):
    """A compact tensor as cuDNN's [batch = 1, rows, cols] (a vector: one row)."""
    if not t.layout.is_plain:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} must be compact, got "
                              f"{t.layout.describe()}")
    rows, cols = dims
    return index.tensor(t, port, (1, rows, cols), (rows * cols, cols, 1), label)


def describe_matmul_bias_relu(node, plan, workspace: tuple[int, int]) -> GraphDesc:
    """A [1, M, K] @ B [1, K, N] + bias [1, 1, N], then ReLU, into Y [1, M, N]."""
    index = PlanIndex(plan)
    a, w, bias, y = (plan.tensors[v.name] for v in (*node.inputs, node.outputs[0]))
    (m, k), n = a.shape, w.shape[1]
    ins = {"A": _batched(index, a, "A", (m, k), node.label),
           "B": _batched(index, w, "B", (k, n), node.label),
           "bias": _batched(index, bias, "bias", (1, n), node.label)}
    outs = {"Y": _batched(index, y, "Y", (m, n), node.label)}
    return one_data_type(GraphDesc("matmul_bias_relu", node.label, ins["A"].data_type, ins, outs,
                                   build=build_matmul_bias_relu))


def build_matmul_bias_relu(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    """The frontend calls: matmul, bias, relu (the intermediates are virtual tensors)."""
    t = g.matmul(ins["A"], ins["B"], name="matmul")
    t = g.bias(input=t, bias=ins["bias"], name="bias")
    return {"Y": g.relu(input=t, name="relu")}


class MatMulBiasRelu(OpRun):
    """``onnx.reference`` implementation (float64)."""

    op_domain = DOMAIN
    op_schema = None  # ours: no ONNX schema (onnx.reference looks schemas up by name)

    def _run(self, a, w, bias):
        y = a.astype(np.float64) @ w + bias
        return (np.maximum(y, 0.0).astype(a.dtype),)


OPDEFS = [
    OpDef("MatMulBiasRelu", (1,), {"numpy": matmul_bias_relu_numpy,
                                   "cuda": CudnnGraph(describe_matmul_bias_relu)},
          domain=DOMAIN, layout=PLAIN_ONLY, shape=matmul_shape, differentiable=True,
          gradient=matmul_bias_relu_vjp, doc="y = relu(a @ w + bias): one cuDNN graph on cuda"),
]
