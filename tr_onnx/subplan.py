"""Data-dependent shapes inside a static plan: dynamic regions run through nested sub-plans.

A layer between the passes and the compiler: ``compiler.compile_plan`` hands
``importer.specialize`` a ``Regions`` that settles and cuts the regions, and hands each region
the compile function that makes its sub-plans (a sub-plan is a plan); the regions' kernels
(``ops.dynamic``) delegate here through the node's ``attrs["region"]``.

A plan knows every shape before a step runs. A node whose output size depends on data (NonZero,
Compress with a condition computed at run time, Unique) breaks that; ``cut`` (called by
``importer.specialize`` through ``Regions``) cuts the nodes from such producers down to the
first values whose shapes are static again (``x[mask].mean(0)``: NonZero -> Transpose ->
GatherND -> ReduceMean gives a static [D]) out of the graph, and puts ONE ``DynamicRegion`` node
(domain ai.tr_onnx) in their place: its inputs are the region's static inputs, its outputs the
region's static outputs, and its ``Region`` (``attrs["region"]``) holds the cut part as a small
ONNX model. Every node on a path between two region nodes joins the region, so the one node
keeps the schedule acyclic. A dynamic value that reaches a graph output is not cut: specialize
then names it (``ShapeError``), except that import makes the model inputs deciding such an
output plan-time constants (``const_feeds.output_deciding_names``), as Reshape's shape is:
the plan is then made for their values.

Each step the region's kernel runs its *root producers* (data-dependent nodes reading only the
region's inputs) eagerly in NumPy (``ops.dynamic.EAGER``; others by ``onnx.reference``), which
allocates their small index results, then a sub-plan made by the usual pipeline
(``Regions.compile``: ``compiler.compile_region``) for the sizes they gave: the sub-model's
inputs are the region's inputs and the producers' results, with concrete shapes. A
data-dependent node inside the sub-model becomes a region of the sub-plan in turn. Sub-plans are
cached by size (least recently used beyond ``MAX_SUBPLANS``): a step allocates only when it
meets a size it has not planned (or one evicted since), and that step compiles the sub-plan.

Gradients: a root Compress is run as ``Gather(x, kept positions)`` in the sub-model, so its data
gets a gradient. When autodiff reaches a DynamicRegion, its rule (``ops.dynamic``) asks the
region for gradients of the needed inputs; the region's sub-plans are then compiled with a
backward pass (cotangent inputs for the region's float outputs, gradient outputs for the
inputs), as two phases: the DynamicRegion kernel runs ``region_forward``, the
DynamicRegionGrad kernel later in the same step runs ``region_backward`` of the same sub-plan,
which still holds the forward's activations.

If with a condition computed at run time (``prepare_if``): the outer values its branches read by
name become the node's inputs, each branch is a ``SubModel`` planned once (both branches must
give the same static output shapes, else a named error), the kernel runs the branch the
condition selects, and the same gradient node runs that branch's backward (the inputs only the
other branch reads get zero gradients). An If whose condition is known when the plan is made is
the static control-flow pass's to inline; one that reaches this kernel still runs correctly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from . import ir
from .const_feeds import DECIDING_INPUTS
from .domains import INTERNAL_DOMAIN, ONNX_DOMAINS
from .dtypes import is_float, onnx_elem_type
from .errors import ShapeError
from .importer import ImportedModel, import_model
from .ops.dynamic import EAGER, compress_indices
from .passes.autodiff import GradBuilder, differentiate
from .passes.control_flow_rules import declared_shape

MAX_SUBPLANS = 32
FORWARD, BACKWARD = "region_forward", "region_backward"


@dataclass(frozen=True)
class Regions:
    """What ``importer.specialize`` is handed (by ``compiler.compile_plan``) for data-dependent
    sizes: ``settle`` them where constants decide them, ``cut`` the rest into regions. A
    region's sub-models are compiled by ``compile(imported, shapes, const_values, transform)
    -> plan``, the compiler's, handed down rather than imported: the compiler imports this
    module."""

    registry: Any
    compile: Callable[[ImportedModel, dict, dict, Callable | None], Any]

    def settle(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return settle(model)

    def cut(self, model: onnx.ModelProto, graph: ir.Graph) -> None:
        cut(model, graph, self)


# ---- specialize: cut the regions -------------------------------------------------------------


def cut(model: onnx.ModelProto, graph: ir.Graph, regions: Regions) -> None:
    """Replace the data-dependent part of ``graph`` (made from ``model``'s nodes, one IR node
    per proto node in order) by one DynamicRegion node. Leaves the graph as it is where the
    part does not close (a dynamic value is a graph output): the caller names that value."""
    for node in graph.nodes:
        if node.domain in ONNX_DOMAINS and "region" not in node.attrs:
            if node.op_type == "If":
                prepare_if(node, graph, model, regions)
            elif node.op_type == "Loop":
                prepare_loop(node, graph, model, regions)
    if all(v.is_static for v in graph.values.values()):
        return
    nodes = graph.nodes
    protos = {id(n): p for n, p in zip(nodes, model.graph.node)}
    seeds = {id(n) for n in nodes if any(v is not None and not v.is_static
                                         for v in list(n.inputs) + list(n.outputs))}
    if not seeds or any(not v.is_static for v in graph.outputs):
        return
    down: set[int] = set()
    for n in nodes:  # reachable from a region node
        if id(n) in seeds or any(v is not None and v.producer is not None and
                                 id(v.producer) in down for v in n.inputs):
            down.add(id(n))
    up: set[int] = set()
    for n in reversed(nodes):  # reaching a region node
        if id(n) in seeds or any(v is not None and any(id(c) in up for c in v.consumers)
                                 for v in n.outputs):
            up.add(id(n))
    members = [n for n in nodes if id(n) in seeds or (id(n) in down and id(n) in up)]
    inside = {id(n) for n in members}
    made = {id(v) for n in members for v in n.outputs if v is not None}
    inputs = list(dict.fromkeys(v for n in members for v in n.inputs
                                if v is not None and id(v) not in made))
    graph_outputs = {id(v) for v in graph.outputs}
    outputs = [v for n in members for v in n.outputs if v is not None and (
        id(v) in graph_outputs or any(id(c) not in inside for c in v.consumers))]
    if any(not v.is_static for v in outputs):
        return
    region = Region.from_members(model, members, protos, inputs, outputs, regions)
    if not region.producers and not region.sub.imported().const_feeds:
        return  # nothing would make the sub-plan's sizes known: the caller names the value
    fed = [v for v in inputs if v.kind != ir.CONST]
    node = ir.Node(graph.unique_name(f"DynamicRegion/{members[0].name}"), "DynamicRegion",
                   INTERNAL_DOMAIN, 1, fed, outputs, {"region": region})
    last = nodes.index(members[-1]) - (len(members) - 1)
    for n in members:
        graph.remove_node(n)
    kept = {id(v) for v in outputs}
    for n in members:
        for v in n.outputs:
            if v is not None and id(v) not in kept:
                graph.values.pop(v.name, None)
    graph.insert(last, node)


def settle(model: onnx.ModelProto) -> onnx.ModelProto:
    """Sizes of data-dependent nodes whose deciding inputs are constants once the plan's inputs
    are bound (import does not fold a node making a graph output, nor Compress over computed
    data): Compress's from its condition, NonZero's and Unique's from their one possible
    result. Written into the model, whose shapes are then inferred again; their kernels check
    them at run time."""
    g = model.graph
    consts = {t.name: t for t in g.initializer}
    infos = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    known: dict[str, list[int]] = {}
    for node in g.node:
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        deciding = DECIDING_INPUTS.get(key)
        if deciding is None or not all(node.input[i] in consts for i in deciding
                                       if i < len(node.input) and node.input[i]):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        try:
            if key == ("", "Compress"):
                shape = _static_dims(infos.get(node.input[0]), consts.get(node.input[0]))
                if shape is None:
                    continue
                kept = len(compress_indices(numpy_helper.to_array(consts[node.input[1]])))
                axis = attrs.get("axis")
                known[node.output[0]] = [kept] if axis is None else [
                    kept if a == axis % len(shape) else d for a, d in enumerate(shape)]
            elif all(n in consts for n in node.input if n):
                results = EAGER[key](attrs, *(numpy_helper.to_array(consts[n])
                                              for n in node.input if n))
                known.update({o: list(r.shape) for o, r in zip(node.output, results) if o})
        except ImportError:  # a library the op needs (ImageDecoder's Pillow): say that
            raise
        except Exception:  # a node its inputs do not fit (an axis out of range...): leaving
            continue  # its sizes unknown is always correct; specialize or its kernel names it
    if not known:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept_infos = [vi for vi in out.graph.value_info if vi.name in known]
    del out.graph.value_info[:]  # inferred again from the sizes now known
    out.graph.value_info.extend(kept_infos)
    for vi in list(out.graph.value_info) + list(out.graph.output):
        if vi.name in known:
            elem = vi.type.tensor_type.elem_type
            vi.type.CopyFrom(helper.make_tensor_type_proto(elem, known.pop(vi.name)))
    for name, dims in known.items():
        elem = infos[name].type.tensor_type.elem_type if name in infos else 0
        out.graph.value_info.append(helper.make_tensor_value_info(name, elem, dims))
    try:
        return onnx.shape_inference.infer_shapes(out, check_type=False, strict_mode=False,
                                                 data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError):
        return model  # as it was: specialize's own checks name what does not fit


def _static_dims(vi, init) -> list[int] | None:
    if init is not None:
        return list(init.dims)
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = vi.type.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


class _Producer:
    """A root producer run eagerly: ``run(values by name) -> {output name: array}``."""

    def __init__(self, proto: onnx.NodeProto, node: ir.Node, opsets):
        self.inputs = [v.name if v is not None else None for v in node.inputs]
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        self.attrs = node.attrs
        self.gather = key == ("", "Compress")  # the sub-model gathers; only positions here
        if self.gather:
            self.outputs = [keep_name(node.outputs[0].name)]
            self.fn = lambda attrs, x, condition: [compress_indices(condition)]
        elif key in EAGER:
            self.outputs = [v.name if v is not None else "" for v in node.outputs]
            self.fn = EAGER[key]
        else:
            self.outputs = [v.name if v is not None else "" for v in node.outputs]
            names = [n for n in self.inputs if n]
            single = helper.make_model(helper.make_graph(
                [proto], "producer", [helper.make_tensor_value_info(n, 0, None) for n in names],
                [helper.make_tensor_value_info(o, 0, None) for o in self.outputs if o]),
                opset_imports=opsets)
            evaluator = ReferenceEvaluator(single)
            self.fn = lambda attrs, *xs: evaluator.run(None, dict(zip(names, xs)))

    def run(self, values: dict) -> dict:
        args = [values[n] if n else None for n in self.inputs]
        while args and args[-1] is None:
            args.pop()
        return {o: np.asarray(r) for o, r in zip(self.outputs, self.fn(self.attrs, *args)) if o}


def keep_name(output: str) -> str:
    return f"{output}__kept_positions"


def _gather_for_compress(node: ir.Node, initializers: list) -> list[onnx.NodeProto]:
    """Compress(x, condition) as Gather(x, kept positions) (flattened first without an axis)."""
    x, y = node.inputs[0].name, node.outputs[0].name
    keep = keep_name(y)
    axis = node.attrs.get("axis")
    if axis is not None:
        return [helper.make_node("Gather", [x, keep], [y], axis=int(axis))]
    flat = f"{y}__flat_shape"
    initializers.append(numpy_helper.from_array(np.array([-1], np.int64), flat))
    return [helper.make_node("Reshape", [x, flat], [f"{y}__flat"]),
            helper.make_node("Gather", [f"{y}__flat", keep], [y], axis=0)]


def _value_info(v: ir.Value, shape=None, name: str | None = None) -> onnx.ValueInfoProto:
    dims = [d if isinstance(d, int) else None for d in (v.shape if shape is None else shape)]
    return helper.make_tensor_value_info(name or v.name, onnx_elem_type(v.dtype), dims)


def _eager(node: ir.Node) -> bool:
    """Whether a data-dependent node reading only the region's inputs runs eagerly: the
    producers ``ops.dynamic`` knows (Compress as positions for a Gather), and any node with no
    float input (no gradient to lose). Others (Tile by a computed count, a Reshape to a computed
    shape) stay in the sub-model, whose plan binds their plan-time inputs by value."""
    key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
    return all(v is None or v.is_static for v in node.inputs) and (
        key in DECIDING_INPUTS or not any(v is not None and is_float(v.dtype)
                                          for v in node.inputs))


class SubModel:
    """A part of a graph as a small ONNX model, compiled by the usual pipeline per set of input
    sizes (cached, least recently used beyond ``MAX_SUBPLANS``), with a backward pass when
    gradients of some inputs are asked for."""

    def __init__(self, model: onnx.ModelProto, outputs: list[str], regions: Regions):
        self.model, self.outputs, self.regions = model, outputs, regions
        self.registry = regions.registry
        self.inputs = {vi.name for vi in model.graph.input}
        self.wrt: list[str] = []  # inputs whose gradients the backward pass gives
        self.plans: OrderedDict = OrderedDict()
        self._imported = None

    def imported(self):
        """The sub-model imported (checked, inferred, folded), once."""
        if self._imported is None:
            self._imported = import_model(self.model, self.registry, "numpy",
                                          internal_ops=True)  # carved out by tr_onnx
        return self._imported

    def require_gradients(self, names) -> None:
        self.wrt = [n for n in names if n in self.inputs]
        self.plans.clear()

    def plan(self, values: dict, key=()):
        """The sub-plan for the sizes of ``values`` (by input name), with ``key`` naming them;
        inputs the sub-model needs at plan time (a Reshape's shape) are bound by value and
        join the key."""
        consts = {n: np.asarray(values[n]) for n in self.imported().const_feeds}
        if consts:  # rare: an int input of the region deciding a shape inside it
            key = (key, tuple((n, v.tobytes()) for n, v in sorted(consts.items())))
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        transform = self._backward if self.wrt else None
        shapes = {n: np.shape(v) for n, v in values.items() if n in self.inputs and
                  n not in consts}
        plan = self.regions.compile(self._imported, shapes, consts, transform)
        self.plans[key] = plan
        while len(self.plans) > MAX_SUBPLANS:
            self.plans.popitem(last=False)
        return plan

    def _backward(self, graph: ir.Graph):
        """Objective sum_i <output_i, cotangent_i> over the float outputs; gradients of
        ``wrt``; forward and backward nodes in two phases, run by two kernels of a step."""
        b = GradBuilder(graph, self.registry, "numpy", prefix="region")
        terms = []
        for name in self.outputs:
            y = graph.values[name]
            if not is_float(y.dtype):
                continue
            cot = ir.Value(cotangent_name(name), tuple(y.shape), y.dtype, ir.INPUT)
            graph.values[cot.name] = cot
            graph.inputs.append(cot)
            terms.append(b.op("ReduceSum", [b.mul(y, cot)], {"keepdims": 0}))
        loss = terms[0] if len(terms) == 1 else b.op("Sum", terms)
        graph.backward_start = len(graph.nodes)
        grads = differentiate(graph, loss, [graph.values[n] for n in self.wrt], self.registry,
                              "numpy")
        for i, node in enumerate(graph.nodes):
            node.phase = FORWARD if i < graph.backward_start else BACKWARD
        graph.outputs = [graph.values[n] for n in self.outputs] + list(grads.values())
        return grads

    def forward(self, plan, values: dict, outs: list) -> None:
        """Write ``values`` (by input name) into ``plan``, run its forward, copy its outputs
        into ``outs``."""
        tensors, arena = plan.memory.tensors, plan.executor.arena
        for name, value in values.items():
            if name in tensors and plan.graph.values[name].kind == ir.INPUT:
                np.copyto(tensors[name].kernel_view(arena), value)
        plan.executor.run(phase=FORWARD if self.wrt else None)
        for name, y in zip(self.outputs, outs):
            np.copyto(y, tensors[name].kernel_view(arena))

    def backward(self, plan, cots: list, grads: dict) -> None:
        """The backward of the forward ``plan`` ran last: ``cots`` per output in, ``grads``
        ({input name: array to write}) out; an input this part does not read gets zeros."""
        tensors, arena = plan.memory.tensors, plan.executor.arena
        for name, cot in zip(self.outputs, cots):
            if cotangent_name(name) in tensors:
                np.copyto(tensors[cotangent_name(name)].kernel_view(arena), cot)
        plan.executor.run(phase=BACKWARD)
        for name, g in grads.items():
            if name in plan.info:
                np.copyto(g, tensors[plan.info[name].name].kernel_view(arena))
            else:
                g.fill(0)


class Region:
    """A cut data-dependent part of a graph: its root producers, run eagerly, and the
    ``SubModel`` of the rest, planned per size of what they made."""

    def __init__(self, sub_model, producers, fed, dynamic, outputs, regions: Regions):
        self.sub = SubModel(sub_model, outputs, regions)
        self.producers = producers
        self.fed = fed  # names of the DynamicRegion node's inputs, in order
        self.dynamic = dynamic  # sub-model inputs the producers make (their sizes key a plan)
        self.wrt: tuple[int, ...] = ()  # node input positions a gradient is asked for
        self.last = None  # the sub-plan the latest forward ran (its backward follows)
        self.consts: dict[str, np.ndarray] = {}  # plan-time inputs the producers read

    @classmethod
    def from_members(cls, model, members, protos, inputs, outputs, regions) -> Region:
        outside = {id(v) for v in inputs}
        producers, sub_nodes, initializers = [], [], []
        for n in members:
            dynamic_out = any(v is not None and not v.is_static for v in n.outputs)
            reads_outside = all(v is None or id(v) in outside for v in n.inputs)
            if dynamic_out and reads_outside and _eager(n):
                producers.append(_Producer(protos[id(n)], n, model.opset_import))
                if producers[-1].gather:
                    sub_nodes.extend(_gather_for_compress(n, initializers))
            else:
                sub_nodes.append(protos[id(n)])
        read = {name for p in sub_nodes for name in p.input if name}
        sub_inputs, dynamic = [], []
        for v in inputs:
            if v.name not in read:
                continue
            if v.kind == ir.CONST:
                initializers.append(numpy_helper.from_array(np.asarray(v.data), v.name))
            else:
                sub_inputs.append(_value_info(v))
        by_name = {v.name: v for n in members for v in n.outputs if v is not None}
        for p in producers:
            for o in p.outputs:
                if o not in read:
                    continue
                dynamic.append(o)
                if p.gather:
                    sub_inputs.append(helper.make_tensor_value_info(o, onnx.TensorProto.INT64,
                                                                    [None]))
                else:
                    sub_inputs.append(_value_info(by_name[o]))
        graph = helper.make_graph(sub_nodes, "dynamic_region", sub_inputs,
                                  [_value_info(v) for v in outputs], initializer=initializers)
        sub_model = helper.make_model(graph, opset_imports=model.opset_import,
                                      ir_version=model.ir_version, functions=model.functions)
        fed = [v.name for v in inputs if v.kind != ir.CONST]
        region = cls(sub_model, producers, fed, dynamic, [v.name for v in outputs], regions)
        # a producer's constant inputs (NonMaxSuppression's limits) are read by name, not fed
        region.consts = {v.name: np.asarray(v.data) for v in inputs if v.kind == ir.CONST}
        return region

    def require_gradients(self, positions) -> None:
        """Compile sub-plans with a backward pass for these DynamicRegion input positions."""
        self.wrt = tuple(positions)
        self.sub.require_gradients(self.fed[i] for i in self.wrt)

    def forward(self, ins: list, outs: list) -> None:
        """The DynamicRegion kernel: producers eagerly, then the sub-plan for their sizes."""
        values = {**self.consts, **dict(zip(self.fed, ins))}
        for p in self.producers:
            values.update(p.run(values))
        self.last = self.sub.plan(values, key=tuple(values[n].shape for n in self.dynamic))
        self.sub.forward(self.last, values, outs)

    def backward(self, ins: list, outs: list) -> None:
        """The DynamicRegionGrad kernel: cotangents of the outputs (``ins``) to gradients of
        the asked inputs (``outs``), through the sub-plan the forward ran this step."""
        self.sub.backward(self.last, ins, {self.fed[i]: g for i, g in zip(self.wrt, outs)})


class Branches:
    """A data-dependent If: each branch a ``SubModel`` (the outer values it reads by name are
    its inputs; the If node reads them all after its condition), one planned per branch, the
    one the condition selects run."""

    def __init__(self, node: ir.Node, model: onnx.ModelProto, regions: Regions):
        self.fed = [v.name for v in node.inputs[1:]]
        values = {v.name: v for v in node.inputs[1:]}
        self.subs = [self._sub(node.attrs[key], values, node.outputs, model, regions)
                     for key in ("else_branch", "then_branch")]  # indexed by the condition
        self.wrt: tuple[int, ...] = ()
        self.last = None

    @staticmethod
    def _sub(branch: onnx.GraphProto, values: dict, results: list, model, regions
             ) -> SubModel:
        reads = free_names(branch)
        outputs = [f"{o.name}__branch_out" for o in branch.output]
        nodes = list(branch.node) + [helper.make_node("Identity", [o.name], [name])
                                     for o, name in zip(branch.output, outputs)]
        graph = helper.make_graph(nodes, branch.name or "branch",
                                  [_value_info(values[n]) for n in reads],
                                  [helper.make_tensor_value_info(
                                      n, onnx_elem_type(v.dtype), list(v.shape))
                                   for v, n in zip(results, outputs)],
                                  initializer=branch.initializer,
                                  sparse_initializer=branch.sparse_initializer)
        sub = helper.make_model(graph, opset_imports=model.opset_import,
                                ir_version=model.ir_version, functions=model.functions)
        return SubModel(sub, outputs, regions)

    def require_gradients(self, positions) -> None:
        self.wrt = tuple(positions)
        for sub in self.subs:
            sub.require_gradients([self.fed[i - 1] for i in self.wrt])

    def forward(self, ins: list, outs: list) -> None:
        sub = self.subs[int(bool(np.asarray(ins[0]).reshape(-1)[0]))]
        values = dict(zip(self.fed, ins[1:]))
        self.last = sub, sub.plan(values)
        sub.forward(self.last[1], values, outs)

    def backward(self, ins: list, outs: list) -> None:
        sub, plan = self.last
        sub.backward(plan, ins, {self.fed[i - 1]: g for i, g in zip(self.wrt, outs)})


class Iterations:
    """A Loop run at run time: one too long to unroll, or whose trip count or condition is
    known only then (``passes.control_flow`` leaves it). Its body is one ``SubModel`` (inputs:
    the iteration number, the condition, the carried values and the outer values it reads),
    planned once: the carried values keep their static shapes. The kernel runs it while the
    trip count and the condition allow.

    Gradients: the forward keeps each iteration's carried inputs; the backward walks the
    iterations in reverse, running each body again (its activations are not kept, only the
    carried values) and then its backward. The gradients of the carried values chain from one
    iteration to the one before; those of the outer values add up."""

    def __init__(self, node: ir.Node, model: onnx.ModelProto, regions: Regions):
        body = node.attrs["body"]
        self.carried = len(body.input) - 2
        self.fed = [v.name for v in node.inputs[2 + self.carried:]]  # outer values read
        self.names = [i.name for i in body.input]  # iteration number, condition, carried
        self.scalars = [declared_shape(i.type) for i in body.input[:2]]
        outputs = [f"{o.name}__body_out" for o in body.output]
        nodes = list(body.node) + [helper.make_node("Identity", [o.name], [name])
                                   for o, name in zip(body.output, outputs)]
        values = {v.name: v for v in node.inputs[2:] if v is not None}
        carried_in = node.inputs[2:2 + self.carried]
        inputs = [helper.make_tensor_value_info(self.names[0], onnx.TensorProto.INT64,
                                                list(self.scalars[0])),
                  helper.make_tensor_value_info(self.names[1], onnx.TensorProto.BOOL,
                                                list(self.scalars[1]))]
        inputs += [_value_info(v, name=n) for v, n in zip(carried_in, self.names[2:])]
        inputs += [_value_info(values[n]) for n in self.fed]
        results = [helper.make_tensor_value_info(outputs[0], onnx.TensorProto.BOOL,
                                                 declared_shape(body.output[0].type))] + [
            _value_info(v, name=n) for v, n in zip(carried_in, outputs[1:])]
        graph = helper.make_graph(nodes, body.name or "loop_body", inputs, results,
                                  initializer=body.initializer,
                                  sparse_initializer=body.sparse_initializer)
        self.sub = SubModel(helper.make_model(graph, opset_imports=model.opset_import,
                                              ir_version=model.ir_version,
                                              functions=model.functions), outputs, regions)
        self.float_carried = [n for n, v in zip(self.names[2:], carried_in) if is_float(v.dtype)]
        self.wrt: tuple[int, ...] = ()
        # while gradients are asked for: the outer values, then each iteration's own inputs
        self.kept: list[dict] = []

    def require_gradients(self, positions) -> None:
        """Sub-plans with a backward pass: the float carried values always (their gradients
        chain through the iterations), and the outer values at these Loop input positions."""
        self.wrt = tuple(p for p in positions if p >= 2)
        outer = [self.fed[p - 2 - self.carried] for p in self.wrt if p >= 2 + self.carried]
        self.sub.require_gradients(self.float_carried + outer)

    def forward(self, ins: list, outs: list) -> None:
        """The Loop kernel: ``ins`` are the trip count and condition (None where absent), the
        initial carried values and the outer values; ``outs`` the final carried values."""
        trip = None if ins[0] is None else int(np.asarray(ins[0]).reshape(-1)[0])
        go = True if ins[1] is None else bool(np.asarray(ins[1]).reshape(-1)[0])
        values = dict(zip(self.fed, ins[2 + self.carried:]))
        # the outer values once (the arena may reuse their memory before the backward runs),
        # then each iteration's own inputs
        self.kept = [{n: np.array(v) for n, v in values.items()}] if self.wrt else []
        carried = [np.array(v) for v in ins[2:2 + self.carried]]
        after = [None] + [np.empty_like(v) for v in carried]
        counter = values[self.names[0]] = np.zeros(self.scalars[0], np.int64)
        values[self.names[1]] = np.ones(self.scalars[1], bool)  # a body runs while it is true
        i = 0
        while go and (trip is None or i < trip):
            counter.fill(i)
            values.update(zip(self.names[2:], carried))
            if self.wrt:
                self.kept.append({n: np.array(values[n]) for n in self.names})
            plan = self.sub.plan(values)
            if after[0] is None:
                after[0] = self._condition(plan)
            self.sub.forward(plan, values, after)
            go = bool(after[0].reshape(-1)[0])
            carried, after[1:] = after[1:], carried
            i += 1
        for y, v in zip(outs, carried):
            np.copyto(y, v)

    def backward(self, ins: list, outs: list) -> None:
        """The gradient kernel: cotangents of the final carried values (``ins``) to gradients
        of the asked Loop inputs (``outs``), iteration by iteration in reverse."""
        cot = dict(zip(self.names[2:], (np.array(c) for c in ins)))
        outer = {self.fed[p - 2 - self.carried]: np.zeros_like(g)
                 for p, g in zip(self.wrt, outs) if p >= 2 + self.carried}
        scratch = [None] + [np.empty_like(cot[n]) for n in self.names[2:]]
        # written whole by each backward (a gradient or zeros), after it has read the
        # cotangents, so the carried ones serve as the next iteration's cotangents in place
        grads = {n: np.empty_like(cot[n]) for n in self.float_carried}
        grads.update({n: np.empty_like(g) for n, g in outer.items()})
        outer_values = self.kept[0] if self.kept else {}
        for own in reversed(self.kept[1:]):
            values = {**outer_values, **own}
            plan = self.sub.plan(values)
            if scratch[0] is None:
                scratch[0] = self._condition(plan)
            self.sub.forward(plan, values, scratch)  # the activations its backward reads
            self.sub.backward(plan, [None] + [cot[n] for n in self.names[2:]], grads)
            for n in outer:
                outer[n] += grads[n]
            cot.update({n: grads[n] for n in self.float_carried})
        for p, g in zip(self.wrt, outs):
            np.copyto(g, cot[self.names[p]] if p < 2 + self.carried
                      else outer[self.fed[p - 2 - self.carried]])
        self.kept = []

    def _condition(self, plan) -> np.ndarray:
        """A buffer for the body's condition output, of the shape the sub-plan gives it."""
        return np.empty(plan.graph.values[self.sub.outputs[0]].shape, bool)


def prepare_loop(node: ir.Node, graph: ir.Graph, model: onnx.ModelProto, regions: Regions
                 ) -> None:
    """A Loop the control-flow pass left to run at run time: the outer values its body reads
    become its inputs, and its ``Iterations`` ride in ``attrs["region"]``. Its carried values
    must keep static shapes; scan outputs (one slice per iteration, so a length known only
    at run time) are refused by the pass."""
    body = node.attrs["body"]
    carried = len(body.input) - 2
    for v, out in zip(node.inputs[2:2 + carried], node.outputs):
        if v is None or not v.is_static or (out is not None and tuple(out.shape) != v.shape):
            raise ShapeError(f"{node.label}: a Loop run at run time carries values of one "
                             f"static shape through its iterations; "
                             f"{(v or out).name!r} changes its shape or has none")
    for name in free_names(body):
        if name not in graph.values:
            raise ShapeError(f"{node.label}: its body reads {name!r}, which nothing defines")
        node.inputs.append(graph.values[name])
    graph.wire(node)
    node.attrs["region"] = Iterations(node, model, regions)
    # its kernel: M and cond are run-time values here (Loop's own OpDef needs them constant)
    node.op_type, node.domain, node.since_version = "RunLoop", INTERNAL_DOMAIN, 1


def free_names(graph: onnx.GraphProto) -> list[str]:
    """The outer-scope values a (sub)graph reads by name, nested subgraphs included."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {
        t.values.name for t in graph.sparse_initializer}
    free = []
    for node in graph.node:
        free.extend(n for n in node.input if n and n not in defined)
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                free.extend(n for n in free_names(sub) if n not in defined)
        defined.update(node.output)
    free.extend(o.name for o in graph.output if o.name not in defined)
    return list(dict.fromkeys(free))


def prepare_if(node: ir.Node, graph: ir.Graph, model: onnx.ModelProto, regions: Regions
               ) -> None:
    """An If whose condition is computed at run time: the outer values its branches read
    become its inputs (so they are planned, kept and differentiated), and its ``Branches``
    ride in ``attrs["region"]``. Its outputs must have static shapes, equal in both branches."""
    for v in node.outputs:
        if v is not None and not v.is_static:
            raise ShapeError(f"{node.label}: output {v.name!r} has shape {list(v.shape)}: the "
                             "branches give it different or data-dependent shapes; a "
                             "condition known only at run time needs both branches to give "
                             "the same static shapes")
    names = free_names(node.attrs["then_branch"]) + free_names(node.attrs["else_branch"])
    for name in dict.fromkeys(names):
        if name not in graph.values:
            raise ShapeError(f"{node.label}: a branch reads {name!r}, which nothing defines")
        node.inputs.append(graph.values[name])
    graph.wire(node)
    node.attrs["region"] = Branches(node, model, regions)


def cotangent_name(output: str) -> str:
    return f"{output}__cotangent"


