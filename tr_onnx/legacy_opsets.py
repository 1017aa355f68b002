"""Models of opset 1-6 before ONNX's version converter lifts them to opset 7.

The converter needs every value's shape (opset 1's adapters assert on it), fails on the legacy
``broadcast=1, axis=k`` binary ops (its shape check misreads the axis), and lifts PRelu without
changing what its slope means: before opset 7 a slope of one value per channel ([C] against
[N, C, H, W]) applied per channel, after it the same [C] would broadcast against the last
axis. ``prepare_for_conversion`` infers shapes, then rewrites both into what opset 7 means the
same way: an ``Unsqueeze`` of the operand (opset 1 form, ``axes`` attribute) so that NumPy
broadcasting aligns it where the legacy rule did, and the ``axis`` attribute dropped. The
initializers keep their shapes, so an exported model writes the trained values back as they
were; the gradient flows through the Unsqueeze.
"""

from __future__ import annotations

import onnx

from .domains import ONNX_DOMAINS

# the binary ops whose opset < 7 schemas carry ``broadcast`` and ``axis``
LEGACY_BROADCAST_OPS = {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal",
                        "Greater", "Less"}


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    ranks = {t.name: len(t.dims) for t in g.initializer}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.HasField("shape"):
            ranks.setdefault(vi.name, len(t.shape.dim))
    return ranks


def _dims(model: onnx.ModelProto, name: str) -> list[int | None] | None:
    g = model.graph
    for t in g.initializer:
        if t.name == name:
            return list(t.dims)
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else None
                    for d in vi.type.tensor_type.shape.dim]
    return None


def prepare_for_conversion(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """A copy of an opset < 7 ``model`` lifted to opset 6, with shapes inferred and the legacy
    broadcasts made explicit (see the module doc); the input is not changed. Opset 1-5
    schemas of BatchNormalization, PRelu, Dropout, Reshape and Gemm have no shape inference:
    their opset 6 forms do, and the adapters up to 6 need no shapes."""
    if opset < 6:
        model = onnx.version_converter.convert_version(model, 6)
    model = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    ranks = _ranks(model)
    nodes = []
    for i, node in enumerate(model.graph.node):
        if node.domain in ONNX_DOMAINS:
            nodes.extend(_explicit_broadcast(model, node, i, ranks))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    # the converter reads the new values' shapes too
    return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)


def _unsqueeze(node: onnx.NodeProto, index: int, axes: list[int], tag: str):
    """An opset-1 Unsqueeze of ``node``'s input ``index`` at ``axes``; rewires the node."""
    source = node.input[index]
    name = f"{node.name or node.op_type}/{tag}"
    out = f"{source}/{tag}_{node.output[0]}"
    node.input[index] = out
    return onnx.helper.make_node("Unsqueeze", [source], [out], name=name, axes=axes)


def _explicit_broadcast(model, node: onnx.NodeProto, i: int, ranks: dict[str, int]) -> list:
    attrs = {a.name: a for a in node.attribute}
    if node.op_type in LEGACY_BROADCAST_OPS and "axis" in attrs and len(node.input) == 2:
        a_rank, b_rank = ranks.get(node.input[0]), ranks.get(node.input[1])
        axis = attrs["axis"].i
        if a_rank is None or b_rank is None:
            return [node]  # the converter names what it cannot lift
        axis = axis + a_rank if axis < 0 else axis
        trailing = a_rank - axis - b_rank
        kept = [a for a in node.attribute if a.name != "axis"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if trailing <= 0:
            return [node]
        node.name = node.name or f"{node.op_type}_{i}"
        return [_unsqueeze(node, 1, list(range(b_rank, b_rank + trailing)), "legacy_axis"),
                node]
    if node.op_type == "PRelu" and len(node.input) == 2:
        x, slope = _dims(model, node.input[0]), _dims(model, node.input[1])
        if x is not None and slope is not None and len(x) > 2 and len(slope) == 1 \
                and slope[0] not in (None, 1) and slope[0] == x[1]:
            node.name = node.name or f"PRelu_{i}"
            return [_unsqueeze(node, 1, list(range(1, len(x) - 1)), "per_channel"), node]
    return [node]
