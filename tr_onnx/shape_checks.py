"""ONNX's shape rules, strictly, over a model specialised to concrete input shapes: a node whose
inputs do not fit its op is named before a shape rule, the layout pass or a kernel relies on it
(``importer.specialize`` calls ``check_node_shapes``). Before any shape inference runs,
``check_nodes`` refuses tr_onnx's internal ops and the attribute values onnx's own shape rules
read unchecked (a ConvTranspose with a zero kernel once crashed the process inside onnx, issue
35)."""

from __future__ import annotations

import math
from functools import partial

import onnx

from .domains import INTERNAL_DOMAIN, is_onnx_domain
from .dtypes import elem_type_name
from .errors import ModelLoadError, ShapeError, UnsupportedModelError
from .registry import schema_for


def check_node_shapes(model: onnx.ModelProto, source: str) -> None:
    """ONNX's shape rules, strictly, over concrete input shapes. Import infers leniently (an
    exporter's value_info may be stale, and a node ONNX cannot type is left to tr_onnx's own
    rules), which lets a node whose inputs do not fit its op through (a Conv weight of rank 1,
    a float Gemm given an int64 bias): it is named here, before a shape rule, the layout pass
    or a kernel relies on it. Checked without the value_info and output shapes, with large
    initializers as typed inputs (their shapes are what the rules read); then the element
    types each op binds to one type parameter, and the declared shapes the nodes contradict."""
    g = model.graph
    big = [t for t in g.initializer if math.prod(t.dims) > 64]
    small = [t for t in g.initializer if math.prod(t.dims) <= 64]
    outputs = [onnx.helper.make_tensor_value_info(o.name, o.type.tensor_type.elem_type, None)
               for o in g.output]
    graph = onnx.helper.make_graph(
        g.node, g.name, list(g.input) + [onnx.helper.make_tensor_value_info(
            t.name, t.data_type, list(t.dims)) for t in big], outputs, initializer=small)
    bare = onnx.helper.make_model(graph, opset_imports=model.opset_import,
                                  ir_version=max(model.ir_version, 4), functions=model.functions)
    infer = partial(onnx.shape_inference.infer_shapes, check_type=False, data_prop=True)
    try:
        try:
            inferred = infer(bare, strict_mode=True).graph
        except (onnx.shape_inference.InferenceError, ValueError):  # ValueError: a bad type
            # strict mode also fails inside the function bodies some ops are inferred through
            # (MeanVarianceNormalization's Constant), and names no node: ask each node's own
            # rule, over the types a lenient inference finds
            inferred = infer(bare, strict_mode=False).graph
            _check_each_node(bare, inferred, source)
    except (onnx.shape_inference.InferenceError, ValueError) as exc:
        raise ShapeError(f"{source}: ONNX shape inference fails: {str(exc).strip()}") from None
    _check_type_params(bare, inferred, source)
    computed = {vi.name: _dims(vi) for vi in list(inferred.output) + list(inferred.value_info)
                + list(inferred.input)}  # an output that is an input is the input
    output_names = {o.name for o in g.output}
    for vi in list(g.value_info) + list(g.output):  # what the lenient inference kept
        declared, want = _dims(vi), computed.get(vi.name)
        if declared is not None and want is not None and (len(declared) != len(want) or any(
                a is not None and b is not None and a != b for a, b in zip(declared, want))):
            kind = "output" if vi.name in output_names else "value"
            raise ShapeError(f"{source}: {kind} {vi.name!r} is declared with shape "
                             f"{_shown(declared)}, but the model gives it {_shown(want)} for "
                             "these input shapes (a stale or wrong shape in the model)")


def _check_type_params(bare: onnx.ModelProto, inferred: onnx.GraphProto, source: str) -> None:
    """The inputs an op's schema binds to one type parameter have one element type: a float
    Mul of an int64 tensor is no model. Which types an op takes is the registry's business,
    not the schema's (tr_onnx runs float64 where ONNX lists float only), so that is not
    checked here."""
    opsets = {o.domain or "": o.version for o in bare.opset_import}
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in list(inferred.input)
            + list(inferred.value_info) + list(inferred.output) if vi.type.HasField("tensor_type")}
    elem.update({t.name: t.data_type for t in bare.graph.initializer})
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    for i, node in enumerate(bare.graph.node):
        schema = schema_for(node.domain, node.op_type, opsets.get(node.domain or "", 1))
        if schema is None or not schema.inputs:
            continue
        params = {c.type_param_str for c in schema.type_constraints}
        bound: dict[str, tuple[int, str, int]] = {}
        for j, name in enumerate(node.input):
            formal = schema.inputs[min(j, len(schema.inputs) - 1)]
            if j >= len(schema.inputs) and not (formal.option == variadic and
                                                 formal.is_homogeneous):
                continue
            if not name or not elem.get(name) or formal.type_str not in params:
                continue
            first = bound.setdefault(formal.type_str, (j, name, elem[name]))
            if first[2] != elem[name]:
                label = node.name or f"{node.op_type}_{i}"
                raise ShapeError(
                    f"{source}: node {label!r} ({node.op_type}): input {first[0]} "
                    f"({first[1]!r}) is {elem_type_name(first[2])} but input {j} ({name!r}) is "
                    f"{elem_type_name(elem[name])}; the op takes one type for both "
                    f"({formal.type_str})")


def _check_each_node(bare: onnx.ModelProto, inferred: onnx.GraphProto, source: str) -> None:
    """Each node of a standard domain whose schema has its own shape rule, alone, strictly,
    over the input types the lenient inference found: the first one that fails is named."""
    opsets = {o.domain or "": o.version for o in bare.opset_import}
    typed = {vi.name: vi for vi in list(inferred.input) + list(inferred.value_info)
             if vi.type.tensor_type.elem_type}  # untyped: an earlier node's failure
    inits = {t.name: t for t in bare.graph.initializer}
    for i, node in enumerate(bare.graph.node):
        schema = schema_for(node.domain, node.op_type, opsets.get(node.domain or "", 1))
        names = [n for n in dict.fromkeys(node.input) if n]
        if schema is None or not schema.has_type_and_shape_inference_function or any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                for a in node.attribute) or any(n not in typed and n not in inits for n in names):
            continue
        alone = onnx.helper.make_model(
            onnx.helper.make_graph([node], "node", [typed[n] for n in names if n not in inits],
                                   [], initializer=[inits[n] for n in names if n in inits]),
            opset_imports=bare.opset_import, ir_version=bare.ir_version)
        try:
            onnx.shape_inference.infer_shapes(alone, check_type=False, strict_mode=True,
                                              data_prop=True)
        except (onnx.shape_inference.InferenceError, ValueError) as exc:
            label = node.name or f"{node.op_type}_{i}"
            raise ShapeError(f"{source}: node {label!r} ({node.op_type}): its inputs do not "
                             f"fit the op (ONNX shape inference, with the inputs' concrete "
                             f"shapes): {str(exc).strip()}") from None


def _dims(vi: onnx.ValueInfoProto) -> list | None:
    """A value's dims (None for one that is not a number), or None without a shape."""
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    return [int(d.dim_value) if d.HasField("dim_value") else None for d in t.shape.dim]


def _shown(dims: list) -> list:
    return ["?" if d is None else d for d in dims]


# Ops with a sliding window, whose window attributes ONNX's shape rules index by the kernel's
# spatial rank without checking their lengths or signs.
_WINDOW_OPS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv",
                         "MaxPool", "AveragePool", "LpPool", "MaxUnpool"})
# (op, attribute) pairs naming an element type, where 0 (UNDEFINED) means nothing
_TYPE_ATTRIBUTES = {("Cast", "to"), ("EyeLike", "dtype"), ("RandomNormal", "dtype"),
                    ("RandomUniform", "dtype"), ("RandomNormalLike", "dtype"),
                    ("RandomUniformLike", "dtype"), ("Multinomial", "dtype"),
                    ("Bernoulli", "dtype")}
_ELEMENT_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}


def check_nodes(model: onnx.ModelProto, source: str, internal_ops: bool = False) -> None:
    """Refuse, naming the node, what ``onnx.checker`` lets through and later steps cannot take.

    - tr_onnx's internal ops (domain ai.tr_onnx; unless ``internal_ops``, as tests of their
      kernels build): the forms its passes make, whose inputs the pass that makes them
      guarantees (issue 35 item 14: DropoutTraining in a model was an IndexError);
    - the attribute values ONNX's shape inference reads without a check: window sizes,
      strides and dilations below 1, window attributes whose lengths disagree with each other
      or with the rank of the weight or input they describe, and an element type that is
      none. Inference over such a node may read out of bounds and kill the process (issue 35
      item 4: ConvTranspose(kernel_shape=[0]) followed by EyeLike).

    Every graph is walked: the main graph, subgraphs and local functions."""
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in model.graph.input
             if vi.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in model.graph.initializer})
    # (where, nodes, the ranks their names may read): a function's names are its own
    graphs = [("", model.graph.node, ranks)] + [(f"function {f.name!r}: ", f.node, {})
                                                for f in model.functions]
    while graphs:
        where, nodes, known = graphs.pop()
        for i, node in enumerate(nodes):
            if node.domain == INTERNAL_DOMAIN and not internal_ops:
                raise UnsupportedModelError(
                    f"{_label(source, where, node, i)}: {node.op_type} is one of tr_onnx's "
                    f"internal ops (domain {INTERNAL_DOMAIN!r}): its passes add them (training "
                    "forms, gradients, optimizer steps, layout changes), and a model may not "
                    "contain them; use the ONNX op the model means", [])
            if not node.attribute:  # most nodes: nothing more to read
                continue
            onnx_op = is_onnx_domain(node.domain)
            if onnx_op and node.op_type in _WINDOW_OPS:
                _check_window(node, {a.name: a for a in node.attribute}, known,
                              _label(source, where, node, i))
            for a in node.attribute:
                if onnx_op and (node.op_type, a.name) in _TYPE_ATTRIBUTES and \
                        a.i not in _ELEMENT_TYPES:
                    raise ModelLoadError(f"{_label(source, where, node, i)}: attribute "
                                         f"{a.name!r} is {a.i}, which is no ONNX element type")
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    graphs.append((f"{where}node {node.name or f'{node.op_type}_{i}'!r} "
                                   f"attribute {a.name!r}: ", g.node, known))


def _label(source: str, where: str, node: onnx.NodeProto, index: int) -> str:
    """How a refusal names a node: the model, the graph it is in, its name (or op and
    position) and op."""
    return f"{source}: {where}node {node.name or f'{node.op_type}_{index}'!r} ({node.op_type})"


def _check_window(node: onnx.NodeProto, attrs: dict, ranks: dict, label: str) -> None:
    ints = {name: list(attrs[name].ints) for name in
            ("kernel_shape", "strides", "dilations", "pads", "output_padding")
            if name in attrs and attrs[name].ints}  # an empty list: some exporters' default
    for name in ("kernel_shape", "strides", "dilations"):
        if any(v < 1 for v in ints.get(name, ())):
            raise ModelLoadError(f"{label}: attribute {name!r} is {ints[name]}; each entry "
                                 "must be at least 1")
    if len(ints.get("pads", ())) % 2:
        raise ModelLoadError(f"{label}: attribute 'pads' ({ints['pads']}) has an odd number of "
                             "entries; it lists a begin and an end per spatial axis")
    spatial = {}  # spatial rank -> what says so
    for name, values in ints.items():
        spatial.setdefault(len(values) // 2 if name == "pads" else len(values),
                           f"attribute {name!r} ({values})")
    # the weight (Conv, ConvTranspose, ConvInteger, DeformConv: input 1; QLinearConv: input 3)
    # and the data input hold the spatial rank too, where their rank is known here (below rank
    # 3 ONNX's rule refuses the input itself)
    described = [(0, "input")] + ([(3, "weight")] if node.op_type == "QLinearConv" else
                                  [(1, "weight")] if "Conv" in node.op_type else [])
    for index, what in described:
        if index < len(node.input) and ranks.get(node.input[index], 0) > 2:
            spatial.setdefault(ranks[node.input[index]] - 2,
                               f"{what} {node.input[index]!r} (rank {ranks[node.input[index]]})")
    if len(spatial) > 1:
        (a, what_a), (b, what_b) = list(spatial.items())[:2]
        raise ModelLoadError(f"{label}: {what_a} describes {_axes(a)} but {what_b} "
                             f"describes {_axes(b)}")


def _axes(count: int) -> str:
    return f"{count} spatial axis" if count == 1 else f"{count} spatial axes"
