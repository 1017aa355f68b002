"""Inference-only rewrites of a dispatched graph whose parameters never change (an
``InferenceSession``; never a training session's plans, whose weights train).

``apply_inference_folds``: each op's inference fold (``OpDef.inference_fold``): a Conv whose
only consumer is an inference BatchNormalization with constant statistics becomes one Conv
with per-output-channel scaled weights and a bias (``ops/batch_norm.py``). One kernel and one
pass over the feature map fewer per pair.

``freeze_parameters``: every parameter becomes a constant, so a kernel may prepare it once at
plan time (``KernelContext.const``): conv_onednn reorders Conv weights into oneDNN's blocked
layout once instead of on every run.

``finite_rewrites``: Conv -> Add (of a same-shaped tensor) -> Relu or Clip, Conv -> Add,
or Conv -> Relu/Clip, each intermediate read by nothing else, becomes one FusedConv
(ops/fused_conv.py), as onnxruntime fuses them: after ``apply_inference_folds``, a ResNet block's
Conv -> BatchNormalization -> Add -> Relu is one oneDNN call. oneDNN's clip maps NaN to its low
limit where ONNX's Relu and Clip keep NaN, so a chain fuses only where ``value_bounds`` proves
its values finite for every run whose float inputs are finite and within +-``input_limit``;
``InferenceSession`` checks that per run and runs the unfused plan otherwise. A training plan
keeps the Conv's output for the backward pass, so this is an inference rewrite. MaxPools whose
input is proven finite run oneDNN's pooling, whose max drops NaN too.

``fuse_matmul_bias``: a MatMul by a 2-D constant whose only reader adds a per-column constant
bias becomes one MatMulBias (the bias inside the GEMM: no pass of its own; BERT's run 4-8%
shorter). It needs no proof, so the unfused plan gets it too.
"""

from __future__ import annotations

import numpy as np

from .. import ir, onednn
from ..domains import INTERNAL_DOMAIN
from .fusions import is_standard, sole_consumer
from .value_bounds import ConstantStats, magnitude_bounds

FUSED_CONV = (INTERNAL_DOMAIN, "FusedConv", 1)
MATMUL_BIAS = (INTERNAL_DOMAIN, "MatMulBias", 1)


def _constant(v: ir.Value | None) -> bool:
    return v is not None and v.is_constant and v.data is not None


def apply_inference_folds(graph: ir.Graph) -> int:
    """Fold every node whose OpDef has an inference fold (``OpDef.inference_fold``: an
    inference BatchNormalization into the Conv before it) where it applies; returns how many
    were folded."""
    folded = 0
    for node in list(graph.nodes):
        rule = node.opdef.inference_fold if node.opdef is not None else None
        if rule is not None and rule(node, graph):
            folded += 1
    return folded


def freeze_parameters(graph: ir.Graph) -> int:
    """Make every parameter (a float initializer) a constant; returns how many. Their values
    stay where they were (the plan's CONST region instead of PARAM): nothing in an inference
    plan writes either."""
    frozen = 0
    for v in graph.values.values():
        if v.kind == ir.PARAM:
            v.kind = ir.CONST
            frozen += 1
    return frozen


def _residual(add: ir.Node, y: ir.Value) -> ir.Value | None:
    """The Add's other operand, if it has ``y``'s shape and dtype (no broadcast)."""
    a, b = add.inputs
    z = b if a is y else a
    if (a is y) == (b is y) or z is None or tuple(z.shape) != tuple(y.shape) \
            or z.dtype != y.dtype:
        return None
    return z


def _clip_limits(node: ir.Node) -> tuple[float, float] | None:
    """(lo, hi) of a Relu (0, inf) or of a Clip with constant limits lo <= hi, else None."""
    if is_standard(node, "Relu"):
        return 0.0, np.inf
    if not is_standard(node, "Clip"):
        return None
    if node.since_version < 11:
        limits = [node.attrs.get("min"), node.attrs.get("max")]
    else:
        limits = []
        for i in (1, 2):
            v = node.inputs[i] if len(node.inputs) > i else None
            if v is not None and not (_constant(v) and np.size(v.data) == 1):
                return None
            limits.append(None if v is None else np.asarray(v.data).reshape(()))
    lo = -np.inf if limits[0] is None else float(limits[0])
    hi = np.inf if limits[1] is None else float(limits[1])
    return (lo, hi) if lo <= hi else None  # oneDNN's clip of lo > hi is not min(max(x, lo), hi)


class _Chain:
    """A Conv and what may fuse into it: ``add`` (the Add node and its other operand ``z``),
    ``act`` (the Relu/Clip node and its limits)."""

    def __init__(self, graph: ir.Graph, conv: ir.Node):
        self.conv, self.add, self.z, self.act, self.limits = conv, None, None, None, None
        nxt = sole_consumer(graph, conv.outputs[0])
        if is_standard(nxt, "Add"):
            self.z = _residual(nxt, conv.outputs[0])
            if self.z is not None:
                self.add = nxt
                nxt = sole_consumer(graph, nxt.outputs[0])
        self.limits = _clip_limits(nxt) if nxt is not None else None
        if self.limits is not None:
            self.act = nxt

    def nodes(self) -> list[ir.Node]:
        return [n for n in (self.conv, self.add, self.act) if n is not None]

    def proven(self, bounds: dict[str, float]) -> bool:
        """Whether every value the fused node reads or computes is proven finite (an
        activation's NaN would otherwise become its low limit)."""
        if self.act is None:
            return True  # an Add alone computes what the unfused one does, NaN included
        reads = [self.conv.inputs[0], self.conv.outputs[0], self.z,
                 self.add.outputs[0] if self.add is not None else None]
        return all(v is None or v.name in bounds for v in reads)


# float inputs up to +-1e6 accepted without a fallback where the bounds allow; less where the
# weights grow the bounds so far that more chains fuse with a smaller limit
INPUT_LIMITS = (1e6, 1e4, 1e2, 1e1)


def _max_pools(graph: ir.Graph) -> list[ir.Node]:
    """float32 MaxPools without the indices output: oneDNN's pooling can run them."""
    return [n for n in graph.nodes if is_standard(n, "MaxPool") and n.outputs[0].dtype ==
            np.float32 and (len(n.outputs) < 2 or n.outputs[1] is None)]


def finite_rewrites(graph: ir.Graph, registry, backend: str) -> float | None:
    """What needs values proven finite: fuse each Conv [-> Add] [-> Relu/Clip] chain (one of
    them at least) whose intermediate values nothing else reads into one FusedConv, and mark
    MaxPools whose input is proven finite (``ir.Node.proven_finite``: oneDNN's pooling).
    Returns the input limit the proofs need (the largest of ``INPUT_LIMITS`` that proves as
    many nodes as the smallest), or None if nothing changed: where the backend has no
    FusedConv kernel, the values are not float32, or oneDNN (the point of it) is missing."""
    opdef = registry.lookup(*FUSED_CONV, backend)
    if opdef is None or not onednn.available():
        return None
    chains = [_Chain(graph, n) for n in graph.nodes if is_standard(n, "Conv")
              and n.outputs[0].dtype == np.float32]
    chains = [c for c in chains if len(c.nodes()) > 1]
    pools = _max_pools(graph)
    if not chains and not pools:
        return None
    stats = ConstantStats()
    proofs = {limit: magnitude_bounds(graph, limit, stats) for limit in INPUT_LIMITS}
    counts = {limit: sum(c.proven(b) for c in chains) + sum(p.inputs[0].name in b for p in pools)
              for limit, b in proofs.items()}
    limit = max(lim for lim in INPUT_LIMITS if counts[lim] == counts[INPUT_LIMITS[-1]])
    bounds, changed, taken = proofs[limit], 0, set()
    for pool in pools:
        if pool.inputs[0].name in bounds:
            pool.proven_finite = True
            changed += 1
    for chain in chains:
        # two Convs may feed one Add (a ResNet block's downsample and its second Conv)
        if not chain.proven(bounds) or taken.intersection(chain.nodes()):
            continue
        taken.update(chain.nodes())
        conv, last = chain.conv, chain.nodes()[-1]
        inputs = list(conv.inputs) + [None] * (3 - len(conv.inputs))
        attrs = {**conv.attrs, "activation": ""}
        if chain.act is not None:
            relu = chain.limits == (0.0, np.inf)
            attrs.update(activation="Relu" if relu else "Clip",
                         activation_params=[] if relu else list(chain.limits))
        node = ir.Node(conv.name, FUSED_CONV[1], FUSED_CONV[0], FUSED_CONV[2],
                       inputs[:3] + ([chain.z] if chain.z is not None else []),
                       [last.outputs[0]], attrs, opdef=opdef)
        for n in chain.nodes()[:-1]:
            del graph.values[n.outputs[0].name]
            graph.remove_node(n)
        graph.replace_node(last, node)  # x and the residual are ready there
        changed += 1
    return limit if changed else None


def _column_bias(add: ir.Node, y: ir.Value) -> ir.Value | None:
    """The Add's other operand if it is a constant of one value per column of ``y`` ([N], or
    [1, ..., N] no longer than y) of y's dtype, so that the Add leaves y's shape alone."""
    a, b = add.inputs
    bias = b if a is y else a
    if (a is y) == (b is y) or not _constant(bias) or bias.dtype != y.dtype \
            or tuple(add.outputs[0].shape) != tuple(y.shape) or bias.rank > len(y.shape):
        return None
    shape = tuple(bias.shape)
    return bias if shape and shape[-1] == y.shape[-1] and all(n == 1 for n in shape[:-1]) \
        else None


def fuse_matmul_bias(graph: ir.Graph, registry, backend: str) -> int:
    """Each float32 MatMul by a 2-D constant whose only reader is an Add of a per-column
    constant bias becomes one MatMulBias (``ops/matmul.py``): the bias goes into the GEMM (its C,
    or oneDNN's bias) instead of a second pass over the product, as onnxruntime's MatMul+Add
    fusion does for 2-D ones. Exact up to where the GEMM adds C (summation order). Returns how
    many were fused; none where the backend has no MatMulBias kernel."""
    opdef = registry.lookup(*MATMUL_BIAS, backend)
    if opdef is None:
        return 0
    fused = 0
    for matmul in [n for n in graph.nodes if is_standard(n, "MatMul")]:
        x, w = matmul.inputs
        y = matmul.outputs[0]
        add = sole_consumer(graph, y)
        if not is_standard(add, "Add") or y.dtype != np.float32 or not _constant(w) \
                or w.rank != 2 or x.rank < 2:
            continue
        bias = _column_bias(add, y)
        if bias is None:
            continue
        node = ir.Node(matmul.name, MATMUL_BIAS[1], MATMUL_BIAS[0], MATMUL_BIAS[2],
                       [x, w, bias], [add.outputs[0]], {}, opdef=opdef)
        graph.remove_node(matmul)
        del graph.values[y.name]
        graph.replace_node(add, node)
        fused += 1
    return fused
