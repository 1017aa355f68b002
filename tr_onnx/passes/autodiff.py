"""Reverse-mode autodiff as a graph pass: each op's gradient rule emits IR nodes into the graph.

A rule is ``vjp(b, node, gys, needed) -> [gx or None per input]``. It reads the forward node
(its inputs/outputs are Values, its attrs have schema defaults) and builds backward nodes
through the ``GradBuilder`` ``b``: standard ONNX ops (emitted at ``GRAD_OPSET``'s semantics,
whatever the model's opset) and named backward ops of domain ``ai.tr_onnx`` (ConvGradData,
MaxPoolGrad, BatchNormGrad...) that backends implement directly. Fan-in (a value read by
several nodes) is summed here, in one place, never in rules. Only what the requested
gradients need is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import numpy as np
import onnx
from onnx import numpy_helper

from ..domains import ONNX_DOMAINS
from ..dtypes import is_float, onnx_elem_type
from ..errors import ShapeError, UnsupportedModelError
from ..ir import ACTIVATION, CONST, Graph, Node, Phase, Value, node_attributes
from ..registry import OpRegistry, schema_for

GRAD_OPSET = 17  # semantics of the standard ops gradient rules emit (ReduceSum axes as input...)


def _is_float(v: Value | None) -> bool:
    """Differentiable: a real (bfloat16 included) or complex float."""
    return v is not None and (is_float(v.dtype) or v.dtype.kind == "c")


def carries_grad(v: Value | None) -> bool:
    """A value a gradient can flow through: a float, or an output of a ``straight_through``
    op (QuantizeLinear's integers, whose gradient is a float tensor of their shape)."""
    return _is_float(v) or (v is not None and v.producer is not None and
                            getattr(v.producer.opdef, "straight_through", False))


def _type_proto(v: Value) -> onnx.TypeProto:
    return onnx.helper.make_tensor_type_proto(onnx_elem_type(v.dtype), list(v.shape))


class GradBuilder:
    """What a gradient rule may use to build backward nodes."""

    def __init__(self, graph: Graph, registry: OpRegistry, backend: str, prefix: str = "grad"):
        self.graph, self.registry, self.backend, self.prefix = graph, registry, backend, prefix
        self._ids = count()
        self.anchor: Node | None = None  # the forward node whose rule is running (for names)
        self.emitted: list[Node] = []
        self.phase = Phase.FORWARD  # stamped on emitted nodes (training: compute, commit, apply)

    # -- values ---------------------------------------------------------------------------

    def _name(self, base: str) -> str:
        tag = self.anchor.name if self.anchor is not None else "root"
        return self.graph.unique_name(f"{self.prefix}/{tag}/{base}_{next(self._ids)}")

    def const(self, value, dtype=None) -> Value:
        """A constant (kind CONST) holding ``value``."""
        data = np.asarray(value, dtype=dtype)
        v = Value(self._name("const"), tuple(data.shape), data.dtype, CONST, data=data)
        self.graph.values[v.name] = v
        return v

    def ints(self, values: Sequence[int]) -> Value:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar_like(self, value: float, like: Value) -> Value:
        return self.const(np.asarray(value, dtype=like.dtype))

    # -- nodes ----------------------------------------------------------------------------

    def op(self, op_type: str, inputs: Sequence[Value | None], attrs: dict | None = None, *,
           domain: str = "", like: Value | Sequence[Value] | None = None,
           shapes: Sequence[tuple[tuple[int, ...], np.dtype]] | None = None,
           outputs: int | None = None) -> Value | list[Value]:
        """Emit one node; returns its output Value (a list when it has several).

        Output shapes/dtypes come from ``like`` (a Value or one per output), ``shapes``, or, for
        standard ops, ONNX shape inference. Internal (``ai.tr_onnx``) ops must say ``like`` or
        ``shapes``.
        """
        opset = GRAD_OPSET if domain in ONNX_DOMAINS else 1
        version = self.registry.resolve_version(domain, op_type, opset)
        opdef = (self.registry.lookup(domain, op_type, version, self.backend)
                 if version is not None else None)
        if opdef is None:
            raise UnsupportedModelError(
                f"gradient of {self.anchor.label if self.anchor else 'the loss'} needs "
                f"{op_type} (domain {domain or 'ai.onnx'!r}), which has no kernel for backend "
                f"{self.backend!r}", [])
        schema = schema_for(domain, op_type, opset) if domain in ONNX_DOMAINS else None
        proto = onnx.helper.make_node(op_type, [v.name if v is not None else "" for v in inputs],
                                      [], domain=domain, **(attrs or {}))
        full_attrs = node_attributes(proto, schema)
        if like is not None:
            likes = [like] if isinstance(like, Value) else list(like)
            specs = [(lk.shape, lk.dtype) for lk in likes]
        elif shapes is not None:
            specs = [(tuple(s), np.dtype(d)) for s, d in shapes]
        else:
            specs = self._infer(schema, proto, inputs, outputs or 1)
        outs = [Value(self._name(op_type), tuple(s), np.dtype(d), ACTIVATION) for s, d in specs]
        node = Node(self._name(op_type), op_type, domain, version, list(inputs), outs, full_attrs,
                    opdef, self.phase, grad_of=self.anchor)
        self.graph.append(node)
        self.emitted.append(node)
        return outs[0] if len(outs) == 1 else outs

    def _infer(self, schema, proto, inputs, n_outputs: int) -> list[tuple[tuple, np.dtype]]:
        if schema is None:
            raise ShapeError(f"{proto.op_type}: give `like` or `shapes` for an internal op")
        proto.output.extend(f"out{i}" for i in range(n_outputs))
        types = {v.name: _type_proto(v) for v in inputs if v is not None}
        data = {v.name: numpy_helper.from_array(np.asarray(v.data), v.name)
                for v in inputs if v is not None and v.kind == CONST}
        inferred = onnx.shape_inference.infer_node_outputs(schema, proto, types, data)
        specs = []
        for name in proto.output:
            t = inferred[name].tensor_type
            dims = tuple(d.dim_value for d in t.shape.dim)
            specs.append((dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))))
        return specs

    # -- helpers rules share ----------------------------------------------------------------

    def add(self, a: Value, b: Value) -> Value:
        return self.op("Add", [a, b])

    def sub(self, a: Value, b: Value) -> Value:
        return self.op("Sub", [a, b])

    def mul(self, a: Value, b: Value) -> Value:
        return self.op("Mul", [a, b])

    def div(self, a: Value, b: Value) -> Value:
        return self.op("Div", [a, b])

    def neg(self, a: Value) -> Value:
        return self.op("Neg", [a])

    def unbroadcast(self, g: Value, shape: tuple[int, ...]) -> Value:
        """Sum ``g`` over the axes numpy broadcasting added or stretched, down to ``shape``."""
        shape = tuple(shape)
        if tuple(g.shape) == shape:
            return g
        lead = len(g.shape) - len(shape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(shape)
                                    if d == 1 and g.shape[lead + i] != 1]
        if axes:
            g = self.op("ReduceSum", [g, self.ints(axes)], {"keepdims": 1})
        if tuple(g.shape) != shape:
            g = self.op("Reshape", [g, self.ints(shape)])
        return g


def requires_grad(graph: Graph, wrt: Sequence[Value]) -> set[Value]:
    """Values that depend on ``wrt`` through inputs a gradient can flow to."""
    reached = set(wrt)
    for node in graph.nodes:
        positions = node.opdef.grad_inputs
        if any(v in reached and (positions is None or i in positions)
               for i, v in enumerate(node.inputs)):
            if node.opdef.differentiable is False:
                continue  # declared non-differentiable: gradient stops here
            reached.update(o for o in node.outputs if carries_grad(o))
    return reached


def differentiate(graph: Graph, loss: Value, wrt: Sequence[Value], registry: OpRegistry,
                  backend: str, seed: Value | None = None) -> dict[str, Value]:
    """Append the backward pass of ``loss`` w.r.t. ``wrt`` to ``graph``.

    Returns ``{name of each wrt value: its gradient Value}`` (a zero constant when ``loss``
    does not depend on it). ``seed`` is d(objective)/d(loss) (default 1).
    """
    reached = requires_grad(graph, wrt)
    forward = list(graph.nodes)
    b = GradBuilder(graph, registry, backend)
    pending: dict[Value, list[Value]] = {loss: [seed if seed is not None
                                                else b.scalar_like(1.0, loss)]}
    if seed is None and loss.shape:
        pending[loss] = [b.op("Expand", [pending[loss][0], b.ints(loss.shape)])]

    def total(v: Value) -> Value | None:
        contributions = pending.pop(v, None)
        if not contributions:
            return None
        if len(contributions) == 1:
            return contributions[0]
        return b.op("Sum", contributions)

    for node in reversed(forward):
        if not any(o in pending for o in node.outputs if o is not None):
            continue
        positions = node.opdef.grad_inputs
        needed = [v is not None and v in reached and carries_grad(v)
                  and (positions is None or i in positions) for i, v in enumerate(node.inputs)]
        b.anchor = node
        gys = [total(o) if o is not None else None for o in node.outputs]
        if not any(needed):
            continue
        rule = node.opdef.gradient
        if rule is None:
            if node.opdef.differentiable is False:
                continue
            names = sorted(v.name for v in wrt if v in reached)[:3]
            raise UnsupportedModelError(
                f"{node.label} is on the path from trainable parameters (e.g. {names}) to the "
                f"loss but has no gradient rule; freeze those parameters or provide the op's "
                f"gradient in a plugin", [(node.domain, node.op_type, node.since_version,
                                           [node.name])])
        gxs = rule(b, node, gys, needed)
        if len(gxs) != len(node.inputs):
            raise UnsupportedModelError(f"{node.label}: gradient rule returned {len(gxs)} "
                                        f"entries for {len(node.inputs)} inputs", [])
        for v, gx, need in zip(node.inputs, gxs, needed):
            if need and gx is not None:
                if tuple(gx.shape) != tuple(v.shape):
                    raise ShapeError(f"{node.label}: gradient for input {v.name!r} has shape "
                                     f"{list(gx.shape)}, expected {list(v.shape)}")
                pending.setdefault(v, []).append(gx)
    b.anchor = None
    grads = {}
    for v in wrt:
        g = total(v)
        grads[v.name] = g if g is not None else b.const(np.zeros(v.shape, v.dtype))
    return grads
