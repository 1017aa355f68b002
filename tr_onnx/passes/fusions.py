"""Pattern fusions of a dispatched graph, before any training pass: a chain of standard nodes
that one kernel of the backend computes faster becomes one node of a standard op. They run on
inference and training plans alike (``compiler.compile_plan``); the backward pass then
differentiates the fused node (one GeluGrad where the chain's rules emitted a dozen nodes). An
exported model is the imported proto with trained weights, so its nodes stay as they came.

``fuse_erf_gelu``: ``x * 0.5 * (1 + erf(x / sqrt(2)))``, how ``torch.onnx`` exports
``nn.GELU()`` and Hugging Face's ``gelu`` below opset 20 (Div or Mul by 1/sqrt(2), Erf, Add 1,
then two Muls in any of their operand orders), becomes ``Gelu(x)`` (opset 20, approximate
"none") where the backend's Gelu kernel is the faster one: the numpy backend with oneDNN in
float32 (BERT-shaped encoder, 4 layers: the chain's forward and backward kernels took ~56 ms of
a ~235 ms step, Gelu and GeluGrad ~8 ms; 2026-12-01). Its values differ from the chain's by
float32 rounding (``tests/test_gelu_fusion.py``).
"""

from __future__ import annotations

import math

import numpy as np

from .. import ir, onednn
from ..domains import ONNX_DOMAINS

# how close an exported constant must be to sqrt(2), 1/sqrt(2), 1 or 0.5: float32 rounding
_CONSTANT_RTOL = 1e-6


def is_standard(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ONNX_DOMAINS


def _scalar_is(v: ir.Value | None, target: float) -> bool:
    """``v`` is a one-element constant (not a parameter, which may train) equal to ``target``
    up to float32 rounding."""
    if v is None or v.kind != ir.CONST or v.data is None or np.size(v.data) != 1:
        return False
    value = float(np.asarray(v.data, np.float64).reshape(()))
    return math.isclose(value, target, rel_tol=_CONSTANT_RTOL)


def _other(node: ir.Node, v: ir.Value) -> ir.Value | None:
    """The binary node's operand that is not ``v`` (None if ``v`` is not exactly one of them)."""
    a, b = node.inputs
    if (a is v) == (b is v):
        return None
    return b if a is v else a


def _scalar_operand(node: ir.Node, target: float) -> ir.Value | None:
    """The operand of a binary node whose other operand is the constant ``target``."""
    a, b = node.inputs
    if _scalar_is(b, target):
        return a
    return b if _scalar_is(a, target) else None


def sole_consumer(graph: ir.Graph, v: ir.Value | None) -> ir.Node | None:
    """The one node reading ``v``, when nothing else does (no other node, not a graph output)."""
    if v is None or len(v.consumers) != 1 or v in graph.outputs:
        return None
    return v.consumers[0]


def _erf_gelu_chain(graph: ir.Graph, erf: ir.Node) -> tuple[ir.Value, ir.Value, list] | None:
    """(x, y, the chain's nodes) of the GELU around this Erf, or None."""
    scaled = erf.inputs[0]
    div = scaled.producer
    if is_standard(div, "Div") and _scalar_is(div.inputs[1], math.sqrt(2.0)):
        x = div.inputs[0]
    elif is_standard(div, "Mul"):
        x = _scalar_operand(div, 1.0 / math.sqrt(2.0))
    else:
        return None
    add = sole_consumer(graph, erf.outputs[0])
    if x is None or sole_consumer(graph, scaled) is not erf or not is_standard(add, "Add") \
            or _scalar_operand(add, 1.0) is not erf.outputs[0]:
        return None
    one_plus = add.outputs[0]
    first = sole_consumer(graph, one_plus)
    if not is_standard(first, "Mul"):
        return None
    other = _other(first, one_plus)
    if other is x:  # (x * (1 + erf)) * 0.5
        last = sole_consumer(graph, first.outputs[0])
        if not is_standard(last, "Mul") or _scalar_operand(last, 0.5) is not first.outputs[0]:
            return None
        nodes = [div, erf, add, first, last]
    elif other is not None and is_standard(other.producer, "Mul") \
            and _scalar_operand(other.producer, 0.5) is x \
            and sole_consumer(graph, other) is first:  # (x * 0.5) * (1 + erf)
        last = first
        nodes = [div, erf, add, other.producer, first]
    elif other is not None and _scalar_is(other, 0.5):  # x * ((1 + erf) * 0.5)
        last = sole_consumer(graph, first.outputs[0])
        if not is_standard(last, "Mul") or _other(last, first.outputs[0]) is not x:
            return None
        nodes = [div, erf, add, first, last]
    else:
        return None
    y = last.outputs[0]
    if y.shape != x.shape or y.dtype != x.dtype:
        return None
    return x, y, nodes


def _fast_gelu(dtype: np.dtype, backend: str) -> bool:
    """Whether the backend's Gelu kernel beats the chain for ``dtype`` (unary.py's oneDNN
    Gelu; NumPy's Gelu computes erf as the chain's Erf does, in more passes)."""
    return backend == "numpy" and dtype == np.float32 and onednn.available()


def fuse_erf_gelu(graph: ir.Graph, registry, backend: str) -> int:
    """Replace each erf GELU chain with one Gelu node; returns how many."""
    fused = 0
    for erf in [n for n in graph.nodes if is_standard(n, "Erf")]:
        found = _erf_gelu_chain(graph, erf)
        if found is None or not _fast_gelu(found[0].dtype, backend):
            continue
        x, y, nodes = found
        opdef = registry.lookup("", "Gelu", 20, backend)
        if opdef is None:
            return fused
        gelu = ir.Node(graph.unique_name(f"{erf.name}/gelu"), "Gelu", "", 20, [x], [y],
                       {"approximate": "none"}, opdef=opdef)
        at = graph.nodes.index(nodes[-1])  # x is ready there: it was read before
        constants = [v for n in nodes for v in n.inputs if v is not None and v.kind == ir.CONST]
        for node in nodes:
            for v in node.outputs:
                if v is not None and v is not y:
                    del graph.values[v.name]
        for node in nodes:
            graph.remove_node(node)
        graph.insert(at - len(nodes) + 1, gelu)
        for v in constants:  # constants nothing reads any more hold no arena memory
            if not v.consumers and v not in graph.outputs and graph.values.get(v.name) is v:
                del graph.values[v.name]
        fused += 1
    return fused
