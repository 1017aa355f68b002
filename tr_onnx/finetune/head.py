"""A new classifier head: the last Gemm / MatMul(+Add) / 1x1 Conv before the model's output
gets fresh weights of K outputs, initialised as PyTorch's ``nn.Linear`` (issue 33).

The classifier is found by walking back from the model's first output through the ops that
keep the class axis where it is (``PASS_THROUGH``: reshapes, identities, softmaxes, casts,
dropout). Its weight and bias are replaced in place: same node, same initializer names, same
stored layout (Gemm's ``transB``, a MatMul's ``[in, out]``, a Transpose before the weight, a
Conv's ``[K, C, 1, 1]``), so the dynamo exporter's folded transposed weight (``val_*``, whose
``folded_from`` names the module's weight) stays what it was, a transpose of the new weight.
Then the output's class dimension is K in every value_info and graph output on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import TrOnnxError
from ..importer import load_checked

# ops that keep each row's class scores in place between the classifier and the output
PASS_THROUGH = ("Flatten", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Softmax",
                "LogSoftmax", "Cast", "Dropout")
HEAD_OPS = ("Gemm", "MatMul", "Conv")


@dataclass(frozen=True)
class HeadChoice:
    """The classifier ``replace_head`` chose: its node's name and op, the initializers it
    replaced (bias: None where the head has none), features in and the classes out before and
    after, and why this node (the ops between it and the output, or ``head=`` given)."""

    node: str
    op_type: str
    weight: str
    bias: str | None
    in_features: int
    old_classes: int
    num_classes: int
    why: str


@dataclass
class _Head:
    node: onnx.NodeProto
    weight: str  # the initializer
    out_first: bool  # stored [out, in] (Gemm transB=1, Conv) rather than [in, out]
    bias: str | None
    bias_add: onnx.NodeProto | None  # a MatMul's Add
    in_features: int
    classes: int


def _label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def _weight_of(node: onnx.NodeProto, inits: dict, producers: dict
               ) -> tuple[str, bool] | None:
    """The initializer a Gemm/MatMul/Conv's weight is, and whether it is stored [out, in]:
    straight or through one 2-D Transpose (the dynamo exporter's unfolded ``t``)."""
    if len(node.input) < 2:
        return None
    name, flipped = node.input[1], False
    source = producers.get(name)
    if name not in inits and source is not None and source.op_type == "Transpose" \
            and source.input[0] in inits:
        name, flipped = source.input[0], True
    if name not in inits:
        return None
    dims = list(inits[name].dims)
    if node.op_type == "Conv":
        return (name, True) if len(dims) == 4 and dims[2:] == [1, 1] and not flipped else None
    if len(dims) != 2:
        return None
    trans_b = any(a.name == "transB" and a.i for a in node.attribute) \
        if node.op_type == "Gemm" else False
    return name, trans_b != flipped


def _heads(graph: onnx.GraphProto) -> dict[str, _Head]:
    """Every node that could be the classifier, by label, in graph order."""
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    heads = {}
    for node in graph.node:
        if node.op_type not in HEAD_OPS:
            continue
        found = _weight_of(node, inits, producers)
        if found is None:
            continue
        weight, out_first = found
        dims = list(inits[weight].dims)
        classes, in_features = (dims[0], int(np.prod(dims[1:]))) if out_first else dims[::-1]
        bias, bias_add = None, None
        if node.op_type in ("Gemm", "Conv") and len(node.input) > 2 and node.input[2]:
            bias = node.input[2] if node.input[2] in inits else None
        elif node.op_type == "MatMul":
            users = consumers.get(node.output[0], [])
            if len(users) == 1 and users[0].op_type == "Add":
                other = [i for i in users[0].input if i != node.output[0]]
                if other and other[0] in inits and int(np.prod(inits[other[0]].dims)) == classes:
                    bias, bias_add = other[0], users[0]
        heads[_label(node)] = _Head(node, weight, out_first, bias, bias_add, in_features, classes)
    return heads


def _path_to_output(graph: onnx.GraphProto, heads: dict[str, _Head]
                    ) -> tuple[_Head, list[onnx.NodeProto]] | None:
    """Walk back from the first graph output through ``PASS_THROUGH`` ops (and a MatMul's bias
    Add) to a head; the head and the ops passed, output first."""
    producers = {o: n for n in graph.node for o in n.output}
    by_node = {id(h.node): h for h in heads.values()}
    by_add = {id(h.bias_add): h for h in heads.values() if h.bias_add is not None}
    name, passed = graph.output[0].name, []
    while (node := producers.get(name)) is not None:
        if id(node) in by_node:
            return by_node[id(node)], passed
        if id(node) in by_add:
            passed.append(node)
            return by_add[id(node)], passed
        if node.op_type not in PASS_THROUGH:
            return None
        passed.append(node)
        name = node.input[0]
    return None


def linear_init(rng: np.random.Generator, classes: int, in_features: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's ``nn.Linear`` initialisation, weight [out, in] then bias: kaiming_uniform
    with a=sqrt(5) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and so is the bias."""
    bound = 1.0 / math.sqrt(in_features)
    w = rng.uniform(-bound, bound, (classes, in_features)).astype(np.float32)
    b = rng.uniform(-bound, bound, classes).astype(np.float32)
    return w, b


def _set_class_dim(vi: onnx.ValueInfoProto, old: int, new: int, conv: bool) -> None:
    """The class axis of a value on the way to the output: axis 1 of a Conv head's [N, K, 1, 1]
    values, else the last axis; left alone where it is not ``old`` (unknown or symbolic)."""
    dims = vi.type.tensor_type.shape.dim
    if not dims:
        return
    axis = 1 if conv and len(dims) >= 3 else len(dims) - 1
    if dims[axis].HasField("dim_value") and dims[axis].dim_value == old:
        dims[axis].dim_value = new


def replace_head(model: onnx.ModelProto | str | Path, num_classes: int, *,
                 head: str | None = None, seed: int = 0) -> tuple[onnx.ModelProto, HeadChoice]:
    """A copy of ``model`` (a ModelProto or a path) whose classifier has ``num_classes``
    outputs, freshly initialised as PyTorch's ``nn.Linear`` (weight then bias, from
    ``np.random.default_rng(seed)``), and the ``HeadChoice`` saying which node it is.
    ``head``: the classifier node's name (default: the last Gemm/MatMul(+Add)/1x1 Conv before
    the first output, through ``PASS_THROUGH`` ops).
    Node and initializer names and the weight's stored layout stay as they were.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
            or num_classes < 1:
        raise TrOnnxError(f"num_classes={num_classes!r}: must be an integer >= 1")
    model = onnx.ModelProto.FromString(load_checked(model)[0].SerializeToString())
    graph = model.graph
    heads = _heads(graph)
    found = _path_to_output(graph, heads)
    if head is not None:
        if head not in heads:
            raise TrOnnxError(f"head={head!r} is not a Gemm, MatMul or 1x1 Conv with a weight "
                              f"initializer; candidates: {list(heads)}")
        chosen = heads[head]
        on_path = found is not None and found[0] is chosen
        why = "head= given" + ("" if on_path else " (it does not reach the first output "
                               "through pass-through ops: the output shape is left as it is)")
    elif found is None:
        raise TrOnnxError(
            f"no classifier reaches the output {graph.output[0].name!r} through "
            f"{', '.join(PASS_THROUGH)}: name one with head=; candidates: {list(heads)}")
    else:
        chosen, on_path = found[0], True
        ops = [n.op_type for n in found[1]]
        why = ("the last " + chosen.node.op_type + " before output " + repr(graph.output[0].name)
               + (" through " + " -> ".join(reversed(ops)) if ops else ""))
    users = [n for n in graph.node if chosen.weight in n.input]
    if len(users) > 1:
        raise TrOnnxError(f"{_label(chosen.node)}: its weight {chosen.weight!r} is shared with "
                          f"{[_label(n) for n in users if n is not chosen.node]}; replacing it "
                          "would change them too")
    _rewrite(model, chosen, int(num_classes), seed, on_path, found)
    _check_shapes(model, _label(chosen.node))
    return model, HeadChoice(_label(chosen.node), chosen.node.op_type, chosen.weight,
                             chosen.bias, chosen.in_features, chosen.classes, int(num_classes),
                             why)


def _rewrite(model: onnx.ModelProto, h: _Head, k: int, seed: int, on_path: bool,
             found) -> None:
    graph = model.graph
    w, b = linear_init(np.random.default_rng(seed), k, h.in_features)
    inits = {i.name: i for i in graph.initializer}
    old_w = inits[h.weight]
    dtype = numpy_helper.to_array(old_w).dtype
    if h.node.op_type == "Conv":
        stored = w.reshape(k, -1, 1, 1)
    else:
        stored = w if h.out_first else w.T
    _assign(old_w, np.ascontiguousarray(stored).astype(dtype))
    if h.bias is not None:
        old_b = inits[h.bias]
        shape = [k if d == h.classes else d for d in old_b.dims]
        _assign(old_b, b.reshape(shape).astype(dtype))
    for vi in [*graph.value_info, *graph.input]:  # the exporter's records of the initializers
        if vi.name in (h.weight, h.bias):
            dims = inits[vi.name].dims
            vi.type.tensor_type.shape.ClearField("dim")
            for d in dims:
                vi.type.tensor_type.shape.dim.add().dim_value = d
    if not on_path:
        return
    names = {o for n in [h.node, *found[1]] for o in n.output}
    for vi in [*graph.value_info, *graph.output]:
        if vi.name in names:
            _set_class_dim(vi, h.classes, k, h.node.op_type == "Conv")
    for node in found[1]:
        if node.op_type == "Reshape" and h.node.op_type != "Conv":
            _reshape_classes(graph, node, h.classes, k)


def _reshape_classes(graph: onnx.GraphProto, node: onnx.NodeProto, old: int, new: int) -> None:
    """A Reshape after a Gemm/MatMul head whose constant shape ends in the class count (an
    export's ``view(-1, 2, classes)``): that last entry becomes ``new``."""
    shape = node.input[1]
    if sum(shape in n.input for n in graph.node) > 1:
        return  # shared: the shape check after the rewrite says whether it still fits
    tensors = [i for i in graph.initializer if i.name == shape]
    tensors += [a.t for n in graph.node if n.op_type == "Constant" and shape in n.output
                for a in n.attribute if a.name == "value"]
    for t in tensors:
        dims = numpy_helper.to_array(t)
        if dims.ndim == 1 and len(dims) and dims[-1] == old:
            dims = dims.copy()
            dims[-1] = new
            _assign(t, dims)


def _check_shapes(model: onnx.ModelProto, label: str) -> None:
    """The rewritten model's shapes, inferred strictly: a later op that still expects the old
    class count (a shape computed at run time, a head= off the output's path) is an error
    here, not at run time. Models over protobuf's 2 GB are left to onnx.checker on a path."""
    if model.ByteSize() >= (1 << 31) - (1 << 24):
        return
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError as exc:
        raise TrOnnxError(f"{label}: with the new class count the model's shapes disagree: "
                          f"{str(exc).strip()}") from None


def _assign(init: onnx.TensorProto, x: np.ndarray) -> None:
    """New values for an initializer, its name and metadata (the exporters' records) kept."""
    props = list(init.metadata_props)
    init.CopyFrom(numpy_helper.from_array(x, init.name))
    init.metadata_props.extend(props)
