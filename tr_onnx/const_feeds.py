"""The model inputs a plan must know by value, not only by shape (``ImportedModel.const_feeds``):
those reaching an op's plan-time input (Reshape's shape, Range's limit), an If's condition,
or the deciding input of a data-dependent producer (NonZero, Compress...) whose result's size
reaches a graph output. A plan is made for their values (``compiler.plan_key``)."""

from __future__ import annotations

import onnx

from . import ir
from .constant_folding import SHAPE_OPS
from .domains import ONNX_DOMAINS
from .registry import OpRegistry

# data-dependent producers: (domain, op_type) -> the inputs whose values decide output shapes
DECIDING_INPUTS = {("", "NonZero"): (0,), ("", "Compress"): (1,), ("", "Unique"): (0,),
                   ("", "NonMaxSuppression"): (0, 1, 2, 3, 4), ("", "ImageDecoder"): (0,)}


def opdef_for(node: onnx.NodeProto, opsets: dict, registry: OpRegistry, backend: str):
    """The OpDef the registry holds for a proto node at the model's opsets (None: none)."""
    opset = opsets.get(node.domain or "", 1)
    version = registry.resolve_version(node.domain, node.op_type, opset)
    return None if version is None else registry.lookup(node.domain, node.op_type, version, backend)


def const_feed_inputs(model, registry, backend) -> set[str]:
    """Graph inputs whose values decide shapes: they reach a ``const_inputs`` position (Reshape's
    shape, Range's limit...) through nodes that compute on values (Shape/Size read only shapes,
    so the walk stops there). Plans specialise on their values."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    graph_inputs = {i.name for i in model.graph.input}
    producer = {o: n for n in model.graph.node for o in n.output if o}
    found, seen = set(), set()
    pending = [node.input[i] for node in model.graph.node
               for i in (getattr(opdef_for(node, opsets, registry, backend), "const_inputs", ()))
               if i < len(node.input) and node.input[i]]
    pending += output_deciding_names(model)  # a data-dependent size in an output
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in graph_inputs:
            found.add(name)
        elif name in producer and producer[name].op_type not in SHAPE_OPS:
            pending.extend(ir.proto_reads(producer[name]))
    return found | _control_inputs(model.graph, graph_inputs)


# the conditions of control-flow ops, which decide what a plan inlines or unrolls (a Loop's
# trip count is one of its const_inputs: the model inputs it is computed from are fed too)
_CONTROL_POSITIONS = {"If": (0,), "Loop": (1,)}


def _control_inputs(graph: onnx.GraphProto, graph_inputs: set[str]) -> set[str]:
    """Model inputs read directly as an If's or a Loop's condition (in subgraphs too): the
    plan specialises on their value, inlines the branch taken and unrolls the loop. A
    condition computed from data is not one: that If runs as sub-plans, that Loop as a loop
    (a plan per batch of the float input deciding a while loop would be no plan at all)."""
    found = set()
    for node in graph.node:
        if node.domain in ONNX_DOMAINS:
            found.update(node.input[i] for i in _CONTROL_POSITIONS.get(node.op_type, ())
                         if i < len(node.input) and node.input[i] in graph_inputs)
        for sub in ir.subgraphs(node):
            found |= _control_inputs(sub, graph_inputs)
    return found


def _unknown_dims(vi: onnx.ValueInfoProto | None) -> bool:
    """No shape, or a dim inference could not tell: neither a value nor a symbol, or a symbol
    it made up (``unk__N``; a model input's symbols are the user's)."""
    if vi is None or not vi.type.HasField("tensor_type"):
        return True
    t = vi.type.tensor_type
    return not t.HasField("shape") or any(
        not d.HasField("dim_value") and (not d.HasField("dim_param") or
                                         d.dim_param.startswith("unk__")) for d in t.shape.dim)


def output_deciding_names(model: onnx.ModelProto) -> list[str]:
    """The deciding inputs (names) of data-dependent producers whose outputs reach a graph
    output while their size is still unknown (a region that never closes): the plan must know
    those values (``const_feed_inputs`` walks them back to model inputs)."""
    g = model.graph
    infos = {vi.name: vi for vi in list(g.value_info) + list(g.output)}
    outputs = {o.name for o in g.output}
    consumers: dict[str, list] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    found = []
    for node in g.node:
        deciding = DECIDING_INPUTS.get((node.domain if node.domain != "ai.onnx" else "",
                                        node.op_type))
        if deciding is None:
            continue
        pending, seen = [o for o in node.output if o and _unknown_dims(infos.get(o))], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in outputs:
                found.extend(node.input[i] for i in deciding if i < len(node.input))
                break
            pending.extend(o for c in consumers.get(name, ()) for o in c.output
                           if o and _unknown_dims(infos.get(o)))
    return found
