"""Bounds on the magnitude of a dispatched inference graph's values, given a bound on its float
inputs: what proves that no NaN or infinity can reach a node (``inference_folds``'s fused
activations need that proof).

``magnitude_bounds(graph, input_limit)`` maps a value's name to a number M with |v| <= M for
every element, for every run whose float inputs are finite and within +-``input_limit``, or
leaves the value out where no rule applies (an op whose OpDef declares no ``value_bounds``, a
weight that is not a constant, a non-finite constant). Each op's rule is beside it
(``ops/conv.py``'s for Conv, ``ops/unary.py``'s for Clip...); this module runs them. A bound of
at most ``SAFE`` (float32's largest value / 34) proves the value finite in float32: a sum of up
to 5e8 products rounds to at most (1 + 5e8 * 2^-24) ~ 31 times its exact bound. The bounds are
loose (triangle inequality through every layer) but cheap: each weight is read once.
"""

from __future__ import annotations

import math

import numpy as np

from .. import ir

SAFE = float(np.finfo(np.float32).max) / 34

# the dtypes bounds are given for: a bound below SAFE keeps them finite
BOUNDED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class ConstantStats:
    """What the rules read of the constants, each computed once however many limits are
    tried (ResNet-18's 11 M weights: reading them took ~0.3 s per pass)."""

    def __init__(self):
        self._memo: dict[tuple[str, str], object] = {}

    def _get(self, v: ir.Value, what: str, compute):
        key = (v.name, what)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def data(self, v: ir.Value | None) -> np.ndarray | None:
        """A constant's float64 values, if it is one and finite."""
        if v is None or not v.is_constant or v.data is None:
            return None

        def compute():
            data = np.asarray(v.data)
            if data.dtype not in BOUNDED_DTYPES and not np.issubdtype(data.dtype, np.integer):
                return None
            data = data.astype(np.float64)
            return data if np.all(np.isfinite(data)) else None

        return self._get(v, "data", compute)

    def max_abs(self, v: ir.Value | None) -> float | None:
        data = self.data(v)
        return None if data is None else self._get(v, "max_abs", lambda: _max_abs(data))

    def largest_sum(self, v: ir.Value | None, axis: int) -> float | None:
        """The largest sum of |w| over ``axis`` of a constant matrix-like w (Conv: over all
        but axis 0, per output channel; Gemm/MatMul: over the input axis, per column)."""
        data = self.data(v)
        if data is None:
            return None

        def compute():
            w = np.abs(data.reshape(data.shape[0], -1)) if axis == 1 else np.abs(data)
            sums = w.sum(axis=axis)
            return float(sums.max()) if sums.size else 0.0

        return self._get(v, f"sum{axis}", compute)


def _max_abs(data: np.ndarray) -> float:
    return float(np.max(np.abs(data))) if data.size else 0.0


def magnitude_bounds(graph: ir.Graph, input_limit: float,
                     stats: ConstantStats | None = None) -> dict[str, float]:
    """Value name -> a bound of at most ``SAFE`` on |v|, where the rules prove one (see the
    module's doc). ``stats``: the constants' numbers, shared by calls for several limits."""
    stats = stats or ConstantStats()
    bounds: dict[str, float] = {}
    for v in graph.values.values():
        magnitude = stats.max_abs(v)
        if magnitude is not None:
            bounds[v.name] = magnitude
    for v in graph.inputs:
        if v.kind not in (ir.PARAM, ir.CONST) and v.dtype in BOUNDED_DTYPES:
            bounds[v.name] = float(input_limit)

    def bound(v: ir.Value | None) -> float | None:
        return None if v is None else bounds.get(v.name)

    for node in graph.nodes:
        rule = node.opdef.value_bounds if node.opdef is not None else None
        out = node.outputs[0] if node.outputs else None
        if rule is None or out is None or out.dtype not in BOUNDED_DTYPES or out.name in bounds:
            continue
        try:
            value = rule(node, bound, stats)
        except (ValueError, TypeError, IndexError, ArithmeticError):
            continue  # a malformed node proves nothing; its kernel names what is wrong
        if value is not None and math.isfinite(value) and value <= SAFE:
            bounds[out.name] = value
    return bounds
