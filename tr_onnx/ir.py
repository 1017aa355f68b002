"""The IR: a graph of Nodes and Values with logical (ONNX) shapes.

Shapes are the ones ONNX defines (NCHW for feature maps); how a value sits in memory is its
``layout``, chosen by the layout pass, and where it sits is the MemoryPlan's business.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .dtypes import np_dtype
from .errors import ShapeError, UnsupportedModelError
from .layouts import Layout, StridedLayout


class ValueKind(StrEnum):
    """What a value holds; with its role in a training step it decides its MemoryPlan region."""

    INPUT = "input"
    PARAM = "param"
    CONST = "const"
    ACTIVATION = "activation"
    GRAD = "grad"  # gradient accumulators (training)
    STATE = "state"  # optimizer state, step scalars, half-precision copies (training)


INPUT, PARAM, CONST, ACTIVATION, GRAD, STATE = (
    ValueKind.INPUT, ValueKind.PARAM, ValueKind.CONST, ValueKind.ACTIVATION, ValueKind.GRAD,
    ValueKind.STATE)


class Phase(StrEnum):
    """Which part of a step runs a node. An executor runs (and the cuda one captures) a phase
    as one unit; ``backends.cuda.capture.WRITE_POLICY`` says which regions each may write."""

    FORWARD = "forward"  # an inference plan; a training graph's nodes before the train pass
    COMPUTE = "compute"  # forward and backward of a micro-batch, adding into the gradients
    REDUCE = "reduce"  # data parallel: the gradients averaged over the ranks
    BROADCAST = "broadcast"  # data parallel: rank 0's running statistics to every rank
    COMMIT = "commit"  # running statistics take the batch's values
    APPLY = "apply"  # clip, scale and the optimizer update
    GUARD = "guard"  # the step guard: was the batch good, was the step launched in order
    DISCARD = "discard"  # a bad batch's gradients dropped
    REPORT = "report"  # the step's outcome written for the host


@dataclass(eq=False)
class Value:
    name: str
    shape: tuple  # ints, or str for a symbolic dimension (only before specialisation)
    dtype: np.dtype
    kind: ValueKind = ACTIVATION
    data: np.ndarray | None = None  # PARAM / CONST contents (logical layout)
    producer: Node | None = None
    consumers: list[Node] = field(default_factory=list)
    layout: Layout | None = None
    alias_of: Value | None = None  # shares the memory of another value (zero-copy reshape)
    # Training: a GRAD/STATE value stored exactly like the parameter it mirrors, and where in
    # its region it goes, so a region can be updated as one flat span
    mirror_of: Value | None = None
    slot_order: int = 1 << 30
    span_of: list[Value] | None = None  # a flat view over these (contiguous) values

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def is_constant(self) -> bool:
        return self.kind in (PARAM, CONST)

    def get_layout(self) -> Layout:
        return self.layout if self.layout is not None else StridedLayout.plain(self.shape)

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {list(self.shape)}, {self.dtype}, {self.kind})"


@dataclass(eq=False)
class Node:
    name: str
    op_type: str
    domain: str
    since_version: int
    inputs: list[Value | None]
    outputs: list[Value | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    opdef: Any = None  # the registry's OpDef, bound at dispatch
    phase: Phase = Phase.FORWARD
    grad_of: Node | None = None  # backward nodes: the forward node whose gradient rule made it
    # the plan proved every value this node reads finite (inference plans whose inputs are
    # checked: passes.inference_folds), so a kernel that maps NaN elsewhere may run
    proven_finite: bool = False

    @property
    def label(self) -> str:
        """How errors name this node: ``'conv1' (Conv, ai.onnx v11)``."""
        domain = self.domain or "ai.onnx"
        return f"node {self.name!r} ({self.op_type}, {domain} v{self.since_version})"

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op_type})"


@dataclass(eq=False)
class Graph:
    name: str
    nodes: list[Node]
    values: dict[str, Value]
    inputs: list[Value]
    outputs: list[Value]
    opsets: dict[str, int]
    backward_start: int | None = None  # index of the first backward node (training graphs)

    def remove_node(self, node: Node) -> None:
        index = self.nodes.index(node)
        del self.nodes[index]
        if self.backward_start is not None and index < self.backward_start:
            self.backward_start -= 1
        for v in node.inputs:
            if v is not None and node in v.consumers:
                v.consumers.remove(node)

    def insert(self, index: int, node: Node) -> None:
        """Put ``node`` at ``index`` of the schedule and wire its values (one place for it);
        a node put before the backward pass belongs to the forward pass."""
        self.nodes.insert(index, node)
        if self.backward_start is not None and index < self.backward_start:
            self.backward_start += 1
        self.wire(node)

    def insert_before_each(self, inserts: dict[Node, list[Node]]) -> None:
        """Put each anchor's nodes (already ``wire``d) before it, in one pass over the
        schedule: ``insert_before`` one at a time would search and shift the whole list each."""
        nodes, start = [], self.backward_start
        for index, anchor in enumerate(self.nodes):
            if index == start:  # as insert: a node put before the first backward node
                self.backward_start = len(nodes)  # belongs to the backward pass
            nodes.extend(inserts.get(anchor, ()))
            nodes.append(anchor)
        if start is not None and start >= len(self.nodes):
            self.backward_start = len(nodes)
        self.nodes[:] = nodes

    def wire(self, node: Node) -> None:
        """Make ``node`` a consumer of its inputs, the producer of its outputs, and its outputs
        values of the graph (where it sits in the schedule is the caller's business)."""
        for v in node.inputs:
            if v is not None and node not in v.consumers:
                v.consumers.append(node)
        for v in node.outputs:
            if v is not None:
                v.producer = node
                self.values[v.name] = v

    def append(self, node: Node) -> None:
        self.insert(len(self.nodes), node)

    def insert_before(self, anchor: Node, node: Node) -> None:
        self.insert(self.nodes.index(anchor), node)

    def replace_node(self, old: Node, new: Node) -> None:
        index = self.nodes.index(old)
        self.remove_node(old)
        self.insert(index, new)

    def replace_input(self, node: Node, index: int, new: Value) -> None:
        old = node.inputs[index]
        node.inputs[index] = new
        if old is not None and old not in node.inputs:
            old.consumers.remove(node)
        if node not in new.consumers:
            new.consumers.append(node)

    def unique_name(self, base: str) -> str:
        name, i = base, 0
        while name in self.values:
            i += 1
            name = f"{base}_{i}"
        return name


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a model is imported or planned: what they build
    stays alive, yet each collection of the oldest generation walks all of it again (half the
    time of a 100,000-node plan). The collector's state is restored afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def subgraphs(proto: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs in ``proto``'s attributes (If's branches, Loop's and Scan's bodies)."""
    for a in proto.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def proto_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph``, then of its subgraphs (a Loop body's MatMul reads a weight of
    the graph around it: which op inputs a weight reaches is asked of all of them)."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from proto_nodes(sub)


def proto_reads(proto: onnx.NodeProto) -> Iterator[str]:
    """The names a proto node reads: its inputs, then what its subgraphs read from outer
    scopes (an If's branch may compute from any value of the graph around it)."""
    yield from (i for i in proto.input if i)
    for sub in subgraphs(proto):
        local = {i.name for i in sub.input} | {t.name for t in sub.initializer} | {
            o for n in sub.node for o in n.output}
        yield from (i for n in sub.node for i in proto_reads(n) if i not in local)


def attribute_value(attr: onnx.AttributeProto) -> Any:
    """An attribute as a Python value: str for strings, np.ndarray for tensors."""
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    return value


def node_attributes(proto: onnx.NodeProto, schema: onnx.defs.OpSchema | None) -> dict[str, Any]:
    """The node's attributes with the schema's defaults filled in, once, here.

    Kernels never repeat a default; an attribute the schema marks required and the node lacks
    is an error naming the node.
    """
    attrs = {a.name: attribute_value(a) for a in proto.attribute}
    if schema is None:
        return attrs
    for name, default, required in _schema_attributes(schema.domain, schema.name,
                                                      schema.since_version):
        if name in attrs:
            continue
        if default is not None:
            attrs[name] = attribute_value(default)
        elif required:
            raise UnsupportedModelError(
                f"node {proto.name!r} ({proto.op_type}) lacks required attribute {name!r}", [])
    return attrs


@lru_cache(maxsize=4096)  # onnx parses every default anew on each access: once per schema here
def _schema_attributes(domain: str, op_type: str, since_version: int
                       ) -> tuple[tuple[str, onnx.AttributeProto | None, bool], ...]:
    """(name, default or None, required) of each attribute of a schema."""
    schema = onnx.defs.get_schema(op_type, since_version, domain)
    return tuple((name, spec.default_value if spec.default_value is not None
                  and spec.default_value.type != 0 else None, spec.required)
                 for name, spec in schema.attributes.items())


def _value_info_shape(vi: onnx.ValueInfoProto) -> tuple | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = []
    for i, d in enumerate(t.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or f"{vi.name}:{i}")
    return tuple(dims)


def graph_from_onnx(model: onnx.ModelProto, schema_of) -> Graph:
    """Build the IR from an imported (checked, inferred, folded) model.

    ``schema_of(domain, op_type)`` returns the ONNX schema for the model's opset, or None.
    """
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values: dict[str, Value] = {}

    def new_value(vi: onnx.ValueInfoProto, kind: str) -> Value:
        shape = _value_info_shape(vi)
        if shape is None:
            raise ShapeError(f"value {vi.name!r} has no inferred shape")
        return Value(vi.name, shape, np_dtype(vi.type.tensor_type.elem_type), kind)

    for init in g.initializer:
        data = numpy_helper.to_array(init)
        values[init.name] = Value(init.name, tuple(data.shape), data.dtype, PARAM, data=data)
    inputs = []
    for vi in g.input:
        if vi.name in values:  # IR < 4: initializers were listed as inputs too
            continue
        values[vi.name] = v = new_value(vi, INPUT)
        inputs.append(v)
    infos = {vi.name: vi for vi in list(g.value_info) + list(g.output)}

    nodes = []
    for i, p in enumerate(g.node):
        schema = schema_of(p.domain, p.op_type)
        name = p.name or f"{p.op_type}_{i}"
        ins = []
        for n in p.input:
            if not n:
                ins.append(None)
                continue
            if n not in values:
                raise ShapeError(f"node {name!r} ({p.op_type}) reads {n!r}, which nothing defines")
            ins.append(values[n])
        outs = []
        for n in p.output:
            if not n:
                outs.append(None)
                continue
            if n not in infos:
                raise ShapeError(f"node {name!r} ({p.op_type}): output {n!r} has no inferred "
                                 "type/shape")
            try:
                values[n] = v = new_value(infos[n], ACTIVATION)
            except ShapeError:
                raise ShapeError(f"node {name!r} ({p.op_type}): output {n!r} has no inferred "
                                 "shape") from None
            except TypeError as exc:  # no element type (a Cast to=0), or one we cannot hold
                raise UnsupportedModelError(f"node {name!r} ({p.op_type}): output {n!r}: "
                                            f"{exc}", []) from None
            outs.append(v)
        version = schema.since_version if schema is not None else opsets.get(p.domain, 1)
        node = Node(name, p.op_type, p.domain, version, ins, outs, node_attributes(p, schema))
        for v in dict.fromkeys(v for v in ins if v is not None):  # a new node: no search of
            v.consumers.append(node)  # consumers, which a shared constant has thousands of
        for v in outs:
            if v is not None:
                v.producer = node
        nodes.append(node)
    outputs = [values[o.name] for o in g.output]
    return Graph(g.name, nodes, values, inputs, outputs, opsets)
