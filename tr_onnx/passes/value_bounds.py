"""Bounds on the magnitude of a dispatched inference graph's values, given a bound on its float
inputs: what proves that no NaN or infinity can reach a node (``inference_folds``'s fused
activations need that proof).

``magnitude_bounds(graph, input_limit)`` maps a value's name to a number M with |v| <= M for
every element, for every run whose float inputs are finite and within +-``input_limit``, or
leaves the value out where no rule applies (an op below without a rule, a weight that is not a
constant, a non-finite constant). A bound of at most ``SAFE`` (float32's largest value / 34)
proves the value finite in float32: a sum of up to 5e8 products rounds to at most (1 + 5e8 *
2^-24) ~ 31 times its exact bound. The bounds are loose (triangle inequality through every
layer) but cheap: each weight is read once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .. import ir

SAFE = float(np.finfo(np.float32).max) / 34

# ops whose output is bounded by their first input's bound (a selection, a max or a mean of its
# values, or the values themselves moved)
_SAME = frozenset({
    "Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Identity",
    "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Gather",
    "Neg", "Abs", "ReduceMax", "ReduceMin", "ReduceMean", "SpaceToDepth", "DepthToSpace",
    "Expand", "Tile"})
# the dtypes bounds are given for: a bound below SAFE keeps them finite
BOUNDED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_UNIT = frozenset({"Sigmoid", "Tanh", "Softmax", "HardSigmoid", "Softsign", "Sin", "Cos"})


def _const(v: ir.Value | None) -> np.ndarray | None:
    """A constant's float64 values, if it is one and finite."""
    if v is None or not v.is_constant or v.data is None:
        return None
    data = np.asarray(v.data)
    if data.dtype not in BOUNDED_DTYPES and not np.issubdtype(data.dtype, np.integer):
        return None
    data = data.astype(np.float64)
    return data if np.all(np.isfinite(data)) else None


def _max_abs(data: np.ndarray) -> float:
    return float(np.max(np.abs(data))) if data.size else 0.0


def _linear(x_bound: float, row_sums: float, bias: float) -> float:
    """|sum_k w_k x_k + b| <= max_o sum_k |w_ok| * max|x| + max|b|."""
    return x_bound * row_sums + bias


def _conv(node: ir.Node, bound) -> float | None:
    w = _const(node.inputs[1])
    b = _const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None \
        else np.zeros(1)
    x = bound(node.inputs[0])
    if w is None or b is None or x is None or w.ndim < 2:
        return None
    sums = np.abs(w).reshape(w.shape[0], -1).sum(axis=1)  # per output channel
    return _linear(x, float(sums.max()) if sums.size else 0.0, _max_abs(b))


def _gemm(node: ir.Node, bound) -> float | None:
    a, w = bound(node.inputs[0]), _const(node.inputs[1])
    if a is None or w is None or w.ndim != 2 or int(node.attrs.get("transA", 0)):
        return None
    if int(node.attrs.get("transB", 0)):
        w = w.T
    alpha, beta = abs(float(node.attrs.get("alpha", 1.0))), abs(float(node.attrs.get("beta", 1.0)))
    c = node.inputs[2] if len(node.inputs) > 2 else None
    c_bound = 0.0 if c is None else bound(c)
    if c_bound is None:
        return None
    sums = np.abs(w).sum(axis=0)  # per output column
    return _linear(a, alpha * float(sums.max()) if sums.size else 0.0, beta * c_bound)


def _matmul(node: ir.Node, bound) -> float | None:
    a, w = bound(node.inputs[0]), _const(node.inputs[1])
    if a is None or w is None or w.ndim != 2:
        return None
    sums = np.abs(w).sum(axis=0)
    return _linear(a, float(sums.max()) if sums.size else 0.0, 0.0)


def _clip(node: ir.Node, bound) -> float | None:
    """Both limits finite constants: the clip of a finite x lies between them."""
    x = bound(node.inputs[0])
    if node.since_version < 11:
        limits = [node.attrs.get(k) for k in ("min", "max")]
        limits = [None if v is None else np.float64(v) for v in limits]
    else:
        limits = []
        for i in (1, 2):
            v = node.inputs[i] if len(node.inputs) > i else None
            data = _const(v)
            if v is not None and (data is None or data.size != 1):
                return None  # a runtime or non-finite limit
            limits.append(None if data is None else data.reshape(()))
    if x is None or any(v is not None and not np.isfinite(v) for v in limits):
        return None
    if all(v is not None for v in limits):
        return float(max(abs(v) for v in limits))
    return max(x, *(abs(float(v)) for v in limits if v is not None))


def _batchnorm(node: ir.Node, bound) -> float | None:
    x = bound(node.inputs[0])
    stats = [_const(v) for v in node.inputs[1:5]]
    if x is None or any(s is None for s in stats) or int(node.attrs.get("training_mode", 0)):
        return None
    gamma, beta, mean, var = stats
    scale = np.abs(gamma) / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    return float(np.max(scale)) * (x + _max_abs(mean)) + _max_abs(beta)


def _sum(node: ir.Node, bound) -> float | None:
    parts = [bound(v) for v in node.inputs]
    return None if any(p is None for p in parts) else math.fsum(parts)


def _product(node: ir.Node, bound) -> float | None:
    parts = [bound(v) for v in node.inputs]
    return None if any(p is None for p in parts) else math.prod(parts)


def _largest(node: ir.Node, bound) -> float | None:
    parts = [bound(v) for v in node.inputs if v is not None]
    return None if not parts or any(p is None for p in parts) else max(parts)


_RULES: dict[str, Callable] = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul, "Clip": _clip,
    "BatchNormalization": _batchnorm, "Add": _sum, "Sub": _sum, "Sum": _sum, "Mul": _product,
    "Concat": _largest, "Max": _largest, "Min": _largest,
    **{op: lambda node, bound: bound(node.inputs[0]) for op in _SAME},
    **{op: lambda node, bound: 1.0 if bound(node.inputs[0]) is not None else None
       for op in _UNIT},
}


def magnitude_bounds(graph: ir.Graph, input_limit: float) -> dict[str, float]:
    """Value name -> a bound of at most ``SAFE`` on |v|, where the rules prove one (see the
    module's doc)."""
    bounds: dict[str, float] = {}
    for v in graph.values.values():
        data = _const(v)
        if data is not None:
            bounds[v.name] = _max_abs(data)
    for v in graph.inputs:
        if v.kind not in (ir.PARAM, ir.CONST) and v.dtype in BOUNDED_DTYPES:
            bounds[v.name] = float(input_limit)

    def bound(v: ir.Value | None) -> float | None:
        return None if v is None else bounds.get(v.name)

    for node in graph.nodes:
        rule = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        out = node.outputs[0] if node.outputs else None
        if rule is None or out is None or out.dtype not in BOUNDED_DTYPES or out.name in bounds:
            continue
        try:
            value = rule(node, bound)
        except (ValueError, TypeError, IndexError, ArithmeticError):
            continue  # a malformed node proves nothing; its kernel names what is wrong
        if value is not None and math.isfinite(value) and value <= SAFE:
            bounds[out.name] = value
    return bounds
