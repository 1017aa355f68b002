"""The layout pass: choose each value's physical layout from the ops' LayoutRules.

Feature maps read by spatial ops become channels-last with channels padded to ``align``;
conv weights OHWI; elementwise ops follow their inputs. A ``Flatten``/``Reshape`` of a feature
map feeding only Gemm/MatMul is absorbed: its output keeps the physical (h, w, c) order and
the weight's rows are stored in that order instead. Where an op's rule cannot take the layout
its input has, a ``LayoutTranspose`` node (domain ``ai.tr_onnx``) converts it; the report
counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..domains import INTERNAL_DOMAIN
from ..errors import ShapeError
from ..ir import ACTIVATION, GRAD, INPUT, Graph, Node, Value
from ..layouts import GatherRowsLayout, StridedLayout
from ..opdef import CHANNEL_VECTOR, CHANNELS_LAST, CONV_WEIGHT, FOLLOW, PLAIN
from ..registry import OpRegistry

SPATIAL_RANKS = (3, 4, 5)
_FLATTENS = ("Flatten", "Reshape")


@dataclass
class LayoutReport:
    align: int
    transposes: list[str] = field(default_factory=list)  # inserted LayoutTranspose nodes
    absorbed_flattens: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # nodes that became zero-copy views
    channels_last: int = 0


def _layout_for(kind: str, v: Value, align: int, node: Node) -> StridedLayout:
    if kind == CONV_WEIGHT and v.rank < 3 or kind == CHANNEL_VECTOR and v.rank != 1:
        kind = PLAIN  # e.g. BatchNormalization(spatial=0) parameters shaped (C, H, W)
    if kind == CHANNELS_LAST:
        return StridedLayout.channels_last(v.shape, align)
    if kind == CONV_WEIGHT:
        return StridedLayout.conv_weight(v.shape, align, pad_in=node.attrs.get("group", 1) == 1)
    if kind == CHANNEL_VECTOR:
        return StridedLayout.channel_vector(v.shape, align)
    return StridedLayout.plain(v.shape)


def _same_layout(a, b) -> bool:
    return a == b if isinstance(a, StridedLayout) and isinstance(b, StridedLayout) else a is b


class _LayoutPass:
    def __init__(self, graph: Graph, registry: OpRegistry, backend: str, align: int,
                 absorb_flatten: bool):
        self.graph, self.registry, self.backend, self.align = graph, registry, backend, align
        self.absorb_flatten = absorb_flatten
        self.report = LayoutReport(align)
        self.converted: dict[tuple[int, str], Value] = {}
        self.inserts: dict[Node, list[Node]] = {}  # LayoutTransposes, put in place at the end

    def run(self) -> LayoutReport:
        self._graph_inputs()
        for node in list(self.graph.nodes):
            if (self.absorb_flatten and node.op_type in _FLATTENS and not node.domain
                    and self._absorb_flatten(node)):
                continue
            self._node(node)
        self.graph.insert_before_each(self.inserts)
        for v in self.graph.values.values():
            if v.mirror_of is not None:  # gradient accumulators, optimizer state
                v.layout = v.mirror_of.get_layout()
            elif v.layout is None:
                v.layout = StridedLayout.plain(v.shape)
            if v.layout.is_channels_last:
                self.report.channels_last += 1
        return self.report

    def _graph_inputs(self) -> None:
        for v in self.graph.inputs:
            if v.rank in SPATIAL_RANKS and any(
                    n.opdef.layout.inputs == CHANNELS_LAST and n.inputs and n.inputs[0] is v
                    for n in v.consumers):
                v.layout = StridedLayout.channels_last(v.shape, self.align)

    def _node(self, node: Node) -> None:
        rule = node.opdef.layout
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            if i == 0 and rule.inputs == CHANNELS_LAST and v.rank in SPATIAL_RANKS:
                self._require(node, i, CHANNELS_LAST)
            elif i in rule.weights and v.is_constant:
                self._require(node, i, rule.weights[i])
            elif rule.inputs == PLAIN:
                self._require(node, i, PLAIN)
            elif isinstance(v.layout, GatherRowsLayout) and not (i < 2 and rule.absorbs_flatten):
                # inputs 0 and 1 of Gemm/MatMul: the absorbed feature map and its permuted weight
                self._require(node, i, PLAIN)
        for j, out in enumerate(node.outputs):
            if out is not None and out.layout is None:
                out.layout = self._output_layout(node, rule, j, out)
        if node.opdef.alias_output and node.outputs and node.outputs[0] is not None:
            x, y = node.inputs[0], node.outputs[0]
            if math.prod(x.shape) != math.prod(y.shape) or x.dtype != y.dtype:
                # y would view x's memory: checked here, as its kernel (that would) never runs
                raise ShapeError(f"{node.label}: output {y.name!r} {list(y.shape)} {y.dtype} "
                                 f"is not input {x.name!r} {list(x.shape)} {x.dtype} regrouped; "
                                 "the op keeps every element")
            if x.layout is None:  # fix it now: a later reader must not re-lay what y views
                x.layout = StridedLayout.plain(x.shape)
            same_bytes = (x.layout.is_plain and y.layout.is_plain) or (
                x.shape == y.shape and _same_layout(x.layout, y.layout))
            if same_bytes and y.kind == ACTIVATION and x.kind != GRAD:
                y.alias_of = x.alias_of or x
                self.report.aliases.append(node.name)

    def _output_layout(self, node: Node, rule, j: int, out: Value):
        if rule.outputs == CHANNELS_LAST and j == 0 and out.rank in SPATIAL_RANKS:
            return StridedLayout.channels_last(out.shape, self.align)
        if rule.outputs == FOLLOW and out.rank in SPATIAL_RANKS:
            if any(v is not None and v.rank == out.rank and v.layout is not None
                   and v.layout.is_channels_last for v in node.inputs):
                return StridedLayout.channels_last(out.shape, self.align)
        return StridedLayout.plain(out.shape)

    def _require(self, node: Node, i: int, kind: str) -> None:
        v = node.inputs[i]
        want = _layout_for(kind, v, self.align, node)
        if v.layout is None and (v.is_constant or v.kind == INPUT):
            v.layout = want  # the first reader of a constant or feed decides how it is stored
            return
        have = v.layout if v.layout is not None else StridedLayout.plain(v.shape)
        if _same_layout(have, want):
            return
        if kind in (CONV_WEIGHT, CHANNEL_VECTOR) and isinstance(have, StridedLayout):
            return  # kernels read any strided weight through its logical view
        key = (id(v), kind)
        if key not in self.converted:
            self.converted[key] = self._insert_transpose(node, v, want, kind)
        self.graph.replace_input(node, i, self.converted[key])

    def _insert_transpose(self, before: Node, v: Value, layout, kind: str) -> Value:
        name = self.graph.unique_name(f"{v.name}__{kind}")
        out = Value(name, v.shape, v.dtype, ACTIVATION, layout=layout)
        node = Node(name, "LayoutTranspose", INTERNAL_DOMAIN, 1, [v], [out], {"to": kind},
                    phase=before.phase)
        node.opdef = self.registry.lookup(INTERNAL_DOMAIN, "LayoutTranspose", 1, self.backend)
        self.graph.wire(node)  # put in the schedule at the end of the pass
        self.inserts.setdefault(before, []).append(node)
        self.report.transposes.append(name)
        return out

    def _absorb_flatten(self, node: Node) -> bool:
        x, y = node.inputs[0], node.outputs[0]
        if (x.layout is None or not x.layout.is_channels_last or y.rank != 2
                or y.shape != (x.shape[0], math.prod(x.shape[1:])) or y in self.graph.outputs
                or not y.consumers):
            return False
        weights = []
        for c in y.consumers:
            rule = c.opdef.layout
            w = c.inputs[1] if len(c.inputs) > 1 else None
            if (not rule.absorbs_flatten or c.inputs[0] is not y or w is None or w is y
                    or not w.is_constant or w.rank != 2 or w.layout is not None
                    or len(w.consumers) != 1 or c.attrs.get("transA", 0)):
                return False
            weights.append((w, 1 if c.attrs.get("transB", 0) else 0))
        flat = GatherRowsLayout.flattened_channels_last(x.layout)
        if flat.is_identity:
            y.layout = StridedLayout.plain(y.shape)
        else:
            y.layout = flat
            for w, axis in weights:
                w.layout = flat.for_matrix(w.shape, axis)
        y.alias_of = x.alias_of or x
        self.report.absorbed_flattens.append(node.name)
        self.report.aliases.append(node.name)
        return True


def assign_layouts(graph: Graph, registry: OpRegistry, backend: str, align: int,
                   absorb_flatten: bool = True) -> LayoutReport:
    """Give every value a layout (mutates the graph); returns what was decided.

    Training graphs pass ``absorb_flatten=False``: a weight stored in a feature map's physical
    row order would need its gradient in that order too."""
    return _LayoutPass(graph, registry, backend, align, absorb_flatten).run()
