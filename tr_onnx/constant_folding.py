"""Constant folding at import and at specialisation: shape inference, then every node whose
inputs are constants (not parameters) or whose result only its inputs' static shapes decide
(Shape, Size) is evaluated by ``onnx.reference`` and becomes an initializer, to a fixpoint (a
fold can make another Shape static). The importer's step "fold constants": ``import_model``
runs it once per model, ``specialize`` again once shapes and const feeds are bound."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from .domains import ONNX_DOMAINS
from .errors import ShapeError
from .registry import canonical_domain, schema_for

# Ops whose result is not a function of their inputs' values: never folded.
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli", "Dropout"}
SHAPE_OPS = {"Shape", "Size"}
# Constant folding makes no value larger than this (bytes; ``fold_limit_bytes=``): a larger one
# stays a node and is computed into the plan's arena when the model runs
DEFAULT_FOLD_LIMIT_BYTES = 64 << 20


def infer_shapes(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                 data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        raise ShapeError(f"{name}: shape inference failed: {exc}") from None


def static_shape(vi: onnx.ValueInfoProto | None) -> tuple[int, ...] | None:
    return None if vi is None else _type_shape(vi.type)


def _type_shape(tp: onnx.TypeProto) -> tuple[int, ...] | None:
    if not tp.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in tp.tensor_type.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return tuple(dims)


def fold_constants(model: onnx.ModelProto, param_names: frozenset[str],
                   limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES) -> onnx.ModelProto:
    """Evaluate nodes whose inputs are all constant (not parameters), and Shape/Size of values
    with static shapes; their outputs become initializers.

    Float initializers of the original model are parameters: a node reading one is kept, so a
    trainable weight never disappears into a folded constant. A node whose outputs would hold
    more than ``limit_bytes`` is kept too, and runs as a node: its outputs' size is known
    before it is evaluated (``_fold_bytes``), so nothing that large is ever allocated here.
    """
    g = model.graph
    opsets = list(model.opset_import)
    consts = {i.name: i for i in g.initializer if i.name not in param_names}
    infos = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    # a folded value has no value_info: its dims are its shape
    dims = {i.name: tuple(i.dims) for i in g.initializer}

    def shape_of(name: str) -> tuple[int, ...] | None:
        return dims[name] if name in dims else static_shape(infos.get(name))

    graph_outputs = {o.name for o in g.output}
    kept, folded = [], []
    for node in g.node:
        shape_op = node.op_type in SHAPE_OPS and node.domain in ONNX_DOMAINS
        # the cheapest test first: most nodes read a value computed at run time
        foldable = shape_of(node.input[0]) is not None if shape_op else all(
            n in consts for n in node.input if n)
        foldable = foldable and node.op_type not in NONDETERMINISTIC and not any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute) and not any(o in graph_outputs for o in node.output)
        if foldable and not shape_op and limit_bytes is not None:
            foldable = _fold_bytes(node, opsets, consts, infos, limit_bytes) <= limit_bytes
        if not foldable:
            kept.append(node)
            continue
        try:
            results = _evaluate_node(node, opsets, consts,
                                     shape_of(node.input[0]) if shape_op else None)
        except Exception:  # onnx.reference raises whatever its op raises (a bare ValueError in
            # one BERT export's GatherElements): not folding is always correct -- the node
            # stays and runs with its kernel, whose errors name it
            kept.append(node)
            continue
        if any(isinstance(value, list) for value in results):
            kept.append(node)  # a sequence: control_flow makes it a list of values
            continue
        results = [np.asarray(value) for value in results]
        if limit_bytes is not None and sum(r.nbytes for r in results) > limit_bytes:
            kept.append(node)  # a size no inference could tell (see _fold_bytes)
            continue
        for out_name, value in zip(node.output, results):
            if out_name:
                t = numpy_helper.from_array(value, out_name)
                consts[out_name] = t
                dims[out_name] = tuple(t.dims)
                folded.append(t)
    if not folded:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    out.graph.initializer.extend(folded)
    folded_names = {t.name for t in folded}
    live = [vi for vi in out.graph.value_info if vi.name not in folded_names]
    del out.graph.value_info[:]
    out.graph.value_info.extend(live)
    return out


def _fold_bytes(node, opsets, consts, infos, limit_bytes: int) -> int:
    """Bytes of ``node``'s outputs, before evaluating it: their inferred shapes (the model's
    shape inference, else ONNX's inference of this one node given its constant inputs' values:
    ConstantOfShape's shape, Expand's, Tile's repeats, Range's bounds). Where neither tells (ops
    whose output size depends on the data, such as NonZero, bounded by their inputs), the
    inputs' bytes: the node is then folded only if they fit, and its results are checked."""
    types: dict[str, tuple] = {}
    for name in node.output:
        if name and name in infos:
            t = infos[name].type
            types[name] = (_type_shape(t), t.tensor_type.elem_type)
    outputs = [n for n in node.output if n]
    if not all(n in types and types[n][0] is not None and types[n][1] for n in outputs):
        inputs = [n for n in node.input if n]
        types.update(infer_node(node, opsets, {n: onnx.helper.make_tensor_type_proto(
            consts[n].data_type, list(consts[n].dims)) for n in inputs},
            {n: consts[n] for n in inputs}))
    total = 0
    for name in outputs:
        shape, elem = types.get(name, (None, 0))
        size = _value_bytes(shape, elem)
        if size is None:
            sizes = [_value_bytes(consts[n].dims, consts[n].data_type) for n in node.input if n]
            return limit_bytes + 1 if None in sizes else sum(sizes)
        total += size
    return total


def infer_node(node, opsets, types: dict, data: dict) -> dict[str, tuple]:
    """ONNX shape inference of one node: ``types`` of its inputs (``TypeProto``), ``data`` the
    values of those known (``TensorProto``) -> {output: (static shape or None, elem type)}."""
    opset = {o.domain or "": o.version for o in opsets}.get(node.domain or "", 1)
    schema = schema_for(node.domain, node.op_type, opset) \
        if canonical_domain(node.domain) in ("", "ai.onnx.ml") else None
    if schema is None:
        return {}
    try:
        out = onnx.shape_inference.infer_node_outputs(schema, node, types, input_data=data,
                                                      opset_imports=opsets)
    except Exception:  # onnx raises InferenceError, or a bare error from an op's rule
        return {}
    return {name: (_type_shape(t), t.tensor_type.elem_type) for name, t in out.items()}


def _value_bytes(shape, elem_type: int) -> int | None:
    if shape is None or not elem_type or elem_type == onnx.TensorProto.STRING:
        return None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(int(d) for d in shape) * itemsize


def fold_to_fixpoint(model: onnx.ModelProto, param_names, name: str,
                      limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES) -> onnx.ModelProto:
    """Infer and fold until nothing more folds: a fold can make another Shape static."""
    model = infer_shapes(model, name)
    for _ in range(len(model.graph.node) + 1):
        before = len(model.graph.node)
        model = fold_constants(model, param_names, limit_bytes)
        if len(model.graph.node) == before:
            return model
        model = infer_shapes(model, name)
    return model


def _evaluate_node(node, opsets, consts, input_shape) -> list[np.ndarray]:
    """``node``'s outputs; ``input_shape``: Shape's and Size's input's static shape."""
    if node.op_type in SHAPE_OPS and node.domain in ONNX_DOMAINS:
        shape = input_shape
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        rank = len(shape)
        start = attrs.get("start", 0)
        end = attrs.get("end", rank)
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        return [np.array(shape[start:end], dtype=np.int64)]
    graph = onnx.helper.make_graph(
        [node], "fold", [],
        [onnx.helper.make_tensor_value_info(o, 0, None) for o in node.output if o],
        initializer=[consts[n] for n in dict.fromkeys(n for n in node.input if n)])
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    return ReferenceEvaluator(model).run(None, {})


def data_independent_values(model: onnx.ModelProto, param_names) -> set[str]:
    """Values computable from shapes and constants alone (they fold once shapes are concrete)."""
    known = {i.name for i in model.graph.initializer if i.name not in param_names}
    for node in model.graph.node:
        if node.op_type in SHAPE_OPS or all(n in known for n in node.input if n):
            if node.op_type not in NONDETERMINISTIC:
                known.update(o for o in node.output if o)
    return known
