"""Which initializers are the model's parameters, and which are one parameter stored twice.

An exported model's float initializers mix what PyTorch's ``model.parameters()`` would be with
constants the exporter materialised: the dynamo exporter stores ReLU6's bounds, attention
scales, epsilons and Pow exponents as float initializers. Training those trains something the
user never asked for (a Pow exponent's gradient is not even finite for a negative base). The
default trainable set is the parameters, decided per initializer (``parameter_roles``):

1. The torch dynamo exporter records torch.export's signature on each initializer it lifted
   from the module (value_info metadata ``pkg.torch.export.graph_signature.InputSpec.kind``):
   a PARAMETER trains, a BUFFER does not.
   An initializer its optimizer folded (value_info metadata
   ``pkg.onnxscript.optimizer.folded_from``) trains iff one of the values it was folded from is
   a parameter (named in the signature the exporter writes into the model's metadata, or by a
   submodule's dotted target): a weight stored transposed trains; affine_grid's base grid,
   folded from arange and friends, does not.
2. Otherwise (other exporters, and folds without that metadata) the data flow decides
   (``_PortWalk.role``): an initializer trains when a differentiable path takes it to an input
   at which an op declares a constant a learned parameter (``OpDef.param_inputs``: Conv's
   weight and bias, a normalization's scale and bias, Gather's table, MatMul's operand, a
   tensor added or multiplied...) or to the model's output -- unchanged through ops that
   forward a value (``OpDef.forwards_params``: Reshape, Transpose, Cast, Q/DQ...), or
   transformed on the way through any other differentiable input (weight norm's ReduceL2 and
   Div, a LayerNorm of DeBERTa's relative embedding table). Frozen as constants the exporter
   materialised: single-element values where they meet the data (attention scales, epsilons,
   ReLU6 bounds) -- a scalar the graph still transforms on its own trains (exporters fold
   constant-only expressions, so that is a parameter: CLIP's ``logit_scale.exp()``); inputs that
   carry no gradient (Clip bounds, BatchNorm's running statistics, shapes, indices); the
   non-value inputs of forwarding ops (a shape, a quantization scale); ``OpDef.constant_operands``
   (Sub/Div buffers, Pow exponents). A tensor added to the scores of a
   Softmax whose values are all 0 or <= -100 is an attention mask (a causal mask, Swin's
   shifted-window mask), not a parameter; other values there are a bias the exporter folded from
   a trained table (Swin's relative position bias) and train.

``trainable=`` / ``frozen=`` override both; ``tr-onnx inspect`` lists every initializer with
its reason.

Exporters also store one parameter twice: as two equal initializers, or as the weight and its
folded transpose (GPT-2's tied embedding and output projection after either torch exporter
folds the Transpose), or as Identity copies of one initializer. Equal values that are not
constant-filled and have at least ``TIE_MIN_SIZE`` elements are almost surely one parameter
(independent random initialisations never coincide; a zero bias and a zero running mean do,
which is why constant-filled values stay apart): ``parameter_sharing`` ties them by default.
The dynamo exporter's optimizer does the opposite too: it merges equal-valued initializers,
so a fresh model's LayerNorm weights (all ones) become one initializer read by every
LayerNorm. Where its node metadata names each reader's module (``pkg.torch.onnx.name_scopes``),
a constant-filled parameter read from modules other than its own is split back into one
parameter per module, named as PyTorch names it (``<module>.weight``); a module shared on
purpose (ALBERT's layers) reads it from one module and stays one.

``share_parameters`` applies the decision to a specialised graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from .. import ir
from ..const_feeds import opdef_for
from ..errors import OptionError
from ..opdef import BROADCASTS, LINEAR, MASK_PATH, SOFTMAX
from ..passes.autodiff import GradBuilder
from ..registry import canonical_domain
from ..torch_metadata import exported_parameters, folded_from, input_kinds, module_of

TIE_MIN_SIZE = 256
_ONNX_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")
MASKED = -100.0  # an additive attention mask's masked entries are at most this (-inf, -1e4...)


@dataclass(frozen=True)
class ParamRole:
    """Whether an initializer is in the default trainable set, and why (for ``inspect``)."""

    trainable: bool
    reason: str


@dataclass(frozen=True)
class SharedCopy:
    """An initializer that is another one (``source``), or its transpose by ``perm``."""

    source: str
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ParamSharing:
    """``untie``: Identity copies of a parameter that train as parameters of their own;
    ``tie``: initializers that train as their ``SharedCopy.source`` (or its transpose);
    ``identity``: every Identity copy of a parameter -> the initializer it copies;
    ``split``: a merged initializer -> {reader node name: the parameter that node reads
    instead}, a copy of the initializer's initial value."""

    untie: frozenset[str] = frozenset()
    tie: Mapping[str, SharedCopy] = field(default_factory=dict)
    identity: Mapping[str, str] = field(default_factory=dict)
    split: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def split_sources(self) -> dict[str, str]:
        """Every parameter split off a merged initializer -> that initializer."""
        return {new: source for source, readers in self.split.items()
                for new in readers.values()}


def parameter_sharing(imported, tie: bool | None = None) -> ParamSharing:
    """What trains as one parameter. ``tie``: None (default) ties equal values that are not
    constant-filled and have >= TIE_MIN_SIZE elements, Identity copies included, and keeps the
    rest apart (merged initializers split); True also keeps every Identity copy and every merged
    initializer one parameter; False keeps all apart."""
    arrays = _param_arrays(imported)
    identity = {n.output[0]: n.input[0] for n in imported.proto.graph.node
                if n.op_type == "Identity" and n.input and n.input[0] in arrays}
    if tie is True:
        untie = frozenset()
    elif tie is False:
        untie = frozenset(identity)
    else:
        untie = frozenset(c for c, s in identity.items() if not _one_parameter(arrays[s]))
    ties = {} if tie is False else _equal_values(arrays)
    split = {} if tie is True else _merged_by_exporter(imported, arrays)
    return ParamSharing(untie, ties, identity, split)


def parameter_roles(imported, sharing: ParamSharing | None = None) -> dict[str, ParamRole]:
    """Every float initializer (and untied Identity copy) -> whether it trains by default."""
    sharing = sharing or ParamSharing()
    signature = input_kinds(imported.original)
    folded = folded_from(imported.original)
    exported_params = exported_parameters(imported.original)
    ports = _PortWalk(imported)
    split = sharing.split_sources()
    names = list(ports.params) + sorted(sharing.untie) + list(split)
    roles = {}
    for name in names:
        source = sharing.identity.get(name, split.get(name, name))
        kind = signature.get(name, signature.get(source))
        if kind == "PARAMETER":
            roles[name] = ParamRole(True, "a parameter in torch.export's signature")
        elif kind is not None:
            roles[name] = ParamRole(False, f"a {kind.lower()} in torch.export's signature, "
                                           "not a parameter")
        elif source in folded:
            roles[name] = _folded_role(folded[source], exported_params)
        else:
            roles[name] = ports.role(source)
        if name in split:
            roles[name] = ParamRole(roles[name].trainable, f"split from {source!r}, which the "
                                    f"exporter merged: {roles[name].reason}")
    for copy, shared in sharing.tie.items():  # one parameter: trains if any use is a parameter
        if copy in roles and shared.source in roles:
            how = "its transpose" if shared.perm else "an equal copy"
            if roles[copy].trainable and not roles[shared.source].trainable:
                roles[shared.source] = ParamRole(True, f"{how} {copy!r}: "
                                                       f"{roles[copy].reason}")
            roles[copy] = ParamRole(roles[shared.source].trainable,
                                    f"tied: {how} of {shared.source!r}")
    return roles


def share_parameters(graph: ir.Graph, sharing: ParamSharing | None, registry,
                     backend: str) -> dict[str, str]:
    """Apply ``sharing`` to a specialised, dispatched graph: untie Identity copies (each
    becomes a parameter of its own; None: every one) and make tied initializers read their
    source (through a Transpose where the copy is transposed). Returns the untied copies."""
    untied = {}
    for node in list(graph.nodes):
        x = node.inputs[0] if node.inputs else None
        if node.op_type != "Identity" or x is None or x.kind != ir.PARAM:
            continue
        y = node.outputs[0]
        if sharing is None or y.name in sharing.untie:
            graph.remove_node(node)
            y.kind, y.data, y.producer = ir.PARAM, np.array(x.data, copy=True), None
            untied[y.name] = x.name
    for source_name, readers in (sharing.split.items() if sharing is not None else ()):
        source = graph.values.get(source_name)
        if source is None or source.kind != ir.PARAM:
            continue
        for node in list(source.consumers):
            if node.name in readers:
                own = ir.Value(readers[node.name], source.shape, source.dtype, ir.PARAM,
                               data=np.array(source.data, copy=True))
                graph.values[own.name] = own
                for i, v in enumerate(node.inputs):
                    if v is source:
                        graph.replace_input(node, i, own)
    for copy, shared in (sharing.tie.items() if sharing is not None else ()):
        value, source = graph.values.get(copy), graph.values.get(shared.source)
        if value is None or source is None or value.kind != ir.PARAM or value in graph.outputs:
            continue
        if shared.perm is not None:
            b = GradBuilder(graph, registry, backend, prefix="tied")
            view = b.op("Transpose", [source], {"perm": list(shared.perm)})
            graph.remove_node(view.producer)
            graph.insert(0, view.producer)
        else:
            view = source
        for node in list(value.consumers):
            for i, v in enumerate(node.inputs):
                if v is value:
                    graph.replace_input(node, i, view)
        del graph.values[copy]
    return untied


def shared_value(values: Mapping[str, np.ndarray], shared: SharedCopy) -> np.ndarray:
    """A tied copy's value from its source's (what export writes under the copy's name)."""
    source = values[shared.source]
    return source if shared.perm is None else np.ascontiguousarray(source.transpose(shared.perm))


# ---- internals ------------------------------------------------------------------------------


def _param_arrays(imported) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in imported.proto.graph.initializer
            if i.name in imported.param_names}


def _one_parameter(a: np.ndarray) -> bool:
    """Equal values this large and not constant-filled are one parameter stored twice."""
    return a.size >= TIE_MIN_SIZE and not np.all(a == a.reshape(-1)[0])


def _digest(a: np.ndarray) -> tuple:
    return a.dtype.str, a.shape, hashlib.blake2b(np.ascontiguousarray(a).tobytes(),
                                                  digest_size=16).digest()


def _equal_values(arrays: Mapping[str, np.ndarray]) -> dict[str, SharedCopy]:
    """Initializers equal to an earlier one, or to its transpose (2-D), in graph order."""
    first: dict[tuple, str] = {}
    ties = {}
    for name, a in arrays.items():
        if not _one_parameter(a):
            continue
        key = _digest(a)
        if key in first and np.array_equal(arrays[first[key]], a):
            ties[name] = SharedCopy(first[key])
            continue
        if a.ndim == 2:
            tkey = _digest(a.T)
            if tkey in first and np.array_equal(arrays[first[tkey]], a.T):
                ties[name] = SharedCopy(first[tkey], (1, 0))
                continue
        first[key] = name
    return ties


def _is_mask(a: np.ndarray) -> bool:
    masked = a <= MASKED
    return bool(masked.any() and np.all(masked | (a == 0)))


def _merged_by_exporter(imported, arrays) -> dict[str, dict[str, str]]:
    """Constant-filled parameters that nodes of other modules read (the dynamo optimizer's
    merge of equal initializers), by the readers' modules (``_reader_module``). A name is
    given to one reader only: a name two readers would take (two merged biases read inside
    one module that calls ``F.linear`` twice, as Swin's attention does) or, where the export
    lists its parameters, a name that is no parameter of the module, leaves that reader on
    the merged initializer rather than train it under a guessed name."""
    g = imported.proto.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in dict.fromkeys(node.input):
            if name in arrays:
                readers.setdefault(name, []).append(node)
    taken = set(arrays) | {v for n in g.node for v in n.output}
    exported = exported_parameters(imported.original)
    reader_module = _ReaderModule(imported)
    proposed: dict[tuple[str, str], str] = {}  # (initializer, reader) -> its own name
    for name, nodes in readers.items():
        a = arrays[name]
        if len(nodes) < 2 or "." not in name or not np.all(a == a.reshape(-1)[0]):
            continue
        owner, leaf = name.rsplit(".", 1)
        for node in nodes:
            module = reader_module(node)
            if module is None or module == owner:
                continue
            new = f"{module}.{leaf}"
            if new not in taken and (not exported or new in exported):
                proposed[name, node.name] = new
    claims: dict[str, int] = {}
    for new in proposed.values():
        claims[new] = claims.get(new, 0) + 1
    split: dict[str, dict[str, str]] = {}
    for (name, reader), new in proposed.items():
        if claims[new] == 1:
            split.setdefault(name, {})[reader] = new
    return split


def _opdef(node: onnx.NodeProto, opsets: dict, registry):
    return opdef_for(node, opsets, registry, "numpy") or opdef_for(node, opsets, registry, "cuda")


def _traits(node: onnx.NodeProto, opsets: dict, registry) -> frozenset[str]:
    opdef = _opdef(node, opsets, registry)
    return opdef.traits if opdef is not None else frozenset()


class _ReaderModule:
    """The module a node reads a parameter for: the layer whose weight the node's input was
    multiplied by (a bias Add after a MatMul or Gemm whose weight is ``<layer>.weight``, by
    name or as the exporter folded it), else the node's name scope (``module_of``). The
    scope alone names the module that called the function: ``F.linear(x, self.proj.weight,
    self.proj.bias)`` in an attention module's forward is scoped to the attention module."""

    def __init__(self, imported):
        g = imported.proto.graph
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.folded = folded_from(imported.original)
        self.registry = imported.registry
        self.opsets = {o.domain or "": o.version for o in imported.proto.opset_import}

    def __call__(self, node: onnx.NodeProto) -> str | None:
        if node.op_type == "Add":
            for value in node.input:
                layer = self.producer.get(value)
                if layer is not None and LINEAR in _traits(layer, self.opsets, self.registry) \
                        and len(layer.input) > 1:
                    weight = layer.input[1]
                    for source in [weight, *self.folded.get(weight, ())]:
                        if source.endswith(".weight"):
                            return source[: -len(".weight")]
        return module_of(node)


def _folded_role(sources: list[str], exported_params: frozenset[str]) -> ParamRole:
    """An initializer the exporter folded trains iff it was folded from a parameter (a weight
    stored transposed); one folded from constants alone (affine_grid's base grid, a causal
    mask) is a constant, whatever op reads it. A parameter is a name in the signature the
    exporter wrote into the metadata, where it wrote one, else a dotted name: torch.export names
    a submodule's parameter by its target (``blocks.0.qkv.weight``) and every intermediate
    value by an identifier (``val_12``, ``linspace``; a lifted constant is dotted too:
    ``features.1.1.attn.lifted_tensor_4``, Swin's shift-mask ids). (A top-level parameter
    folded without that metadata is the one case this misses; ``trainable=`` names it.)"""
    params = [n for n in sources if n in exported_params] if exported_params else \
        [n for n in sources if "." in n]
    if params:
        return ParamRole(True, f"folded by the exporter from the parameter(s) {params}")
    return ParamRole(False, "a constant the exporter folded from values that are not "
                            "parameters")


class _PortWalk:
    """Classifies an initializer by where its data flow goes (``OpDef.param_inputs``)."""

    def __init__(self, imported):
        self.registry = imported.registry
        g = imported.proto.graph
        # values are read only where they decide (an attention mask's), never all at once
        self.params = {i.name: i for i in g.initializer if i.name in imported.param_names}
        self.opsets = {o.domain or "": o.version for o in imported.proto.opset_import}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in ir.proto_nodes(g):  # control-flow bodies read weights too
            for i, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((node, i))
        self.sizes = {i.name: int(np.prod(i.dims)) for i in g.initializer}
        self.outputs = {o.name for o in g.output}
        self.copied = {n.output[0]: n.input[0] for n in g.node
                       if n.op_type == "Identity" and n.input and n.input[0] in self.params}

    def role(self, name: str) -> ParamRole:
        """Follows the initializer's data flow: unchanged through ``forwards_params`` ops,
        transformed through the differentiable inputs of others (weight norm's ReduceL2 and
        Div, a LayerNorm of an embedding table, Exp), until a parameter input or the model's
        output; never through an input that carries no gradient or holds a constant
        (``OpDef.constant_operands``). A scalar trains only at a parameter input that takes one
        (PRelu's slope) or transformed on its own (exporters fold constant-only expressions,
        so a scalar the graph still transforms alone is a parameter: CLIP's logit_scale.exp())."""
        source = self.copied.get(name, name)
        size = self.sizes.get(source)
        frozen: list[str] = []
        pending = [(name, "")]  # (value, ", through <the first op that transformed it>")
        seen = set()
        while pending:
            value, via = pending.pop()
            if value in seen:
                continue
            seen.add(value)
            for node, index in self.consumers.get(value, ()):
                opdef = self._opdef(node)
                where = self._where(node, index)
                outputs = [o for o in node.output if o]
                if index in self._ports(node, opdef):
                    if size is not None and size < opdef.param_min_size:
                        frozen.append(f"a scalar at {where}: a constant the exporter "
                                      "materialised")
                    elif node.op_type == "Add" and source in self.params \
                            and self._feeds_softmax(node) \
                            and _is_mask(numpy_helper.to_array(self.params[source])):
                        frozen.append(f"an attention mask (values 0 and <= {MASKED:g}) added "
                                      f"to a Softmax's scores at {where}")
                    else:
                        return ParamRole(True, where + via)
                elif opdef is not None and opdef.forwards_params:
                    if index != 0:  # a shape, axes, a quantization scale: not the value
                        frozen.append(f"{where} is not the value {node.op_type} forwards")
                    elif size == 1 and BROADCASTS in opdef.traits:
                        frozen.append(f"a scalar broadcast by {node.op_type} (node "
                                      f"{node.name!r}): a constant fill, such as a zero "
                                      "initial state")
                    else:
                        pending.extend((o, via) for o in outputs)
                elif not self._differentiable(opdef, index):
                    frozen.append(f"{where} carries no gradient")
                elif index in opdef.constant_operands:
                    frozen.append(f"{where}: {opdef.constant_operands[index]}")
                elif size is not None and size <= 1:
                    if sum(1 for i in node.input if i) == 1:
                        return ParamRole(True, f"a scalar transformed on its own at {where}: "
                                               "a learned scalar (CLIP's logit_scale)")
                    frozen.append(f"a scalar at {where}: a constant the exporter materialised")
                elif any(o in self.outputs for o in outputs):
                    return ParamRole(True, f"reaches the model's output through {where}")
                else:
                    pending.extend((o, via or f", through {where}") for o in outputs)
        return ParamRole(False, frozen[0] if frozen else "read by no node")

    @staticmethod
    def _differentiable(opdef, index: int) -> bool:
        if opdef is None or not opdef.differentiable:
            return False
        return opdef.grad_inputs is None or index in opdef.grad_inputs

    def _opdef(self, node):
        return _opdef(node, self.opsets, self.registry)

    @staticmethod
    def _ports(node, opdef) -> tuple[int, ...] | range:
        if opdef is None:
            return ()
        ports = opdef.param_inputs
        if ports is None:  # undeclared: none for ONNX ops, gradient inputs for a plugin's
            if canonical_domain(node.domain) in _ONNX_DOMAINS or not opdef.differentiable:
                return ()
            ports = opdef.grad_inputs if opdef.grad_inputs is not None else "all"
        return range(len(node.input)) if ports == "all" else ports

    def _where(self, node, index: int) -> str:
        name = f"input {index}"
        if canonical_domain(node.domain) in _ONNX_DOMAINS:
            try:
                schema = onnx.defs.get_schema(node.op_type, self.opsets.get(node.domain or "", 1),
                                              node.domain)
                formal = schema.inputs[min(index, len(schema.inputs) - 1)]
                name = formal.name
            except onnx.defs.SchemaError:
                pass
        return f"{node.op_type} {name} (node {node.name!r})"

    def _feeds_softmax(self, node, depth: int = 4) -> bool:
        for out in node.output:
            for consumer, _ in self.consumers.get(out, ()):
                opdef = self._opdef(consumer)
                traits = opdef.traits if opdef is not None else frozenset()
                if SOFTMAX in traits:
                    return True
                forwards = opdef is not None and opdef.forwards_params
                if depth and (forwards or MASK_PATH in traits) \
                        and self._feeds_softmax(consumer, depth - 1):
                    return True
        return False


def name_patterns(option: str, patterns, names) -> list[str]:
    """``patterns`` (``trainable=`` / ``frozen=``: initializer names or fnmatch patterns; one
    string is one pattern) as a list, each checked to match one of ``names`` at least. A
    pattern that matches nothing is almost always a typo that would otherwise train (or freeze)
    something else silently: an ``OptionError`` naming the nearest names (difflib)."""
    import difflib
    import fnmatch

    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    names = sorted(names)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise OptionError(f"{option}: {pattern!r} is not a name or pattern (a string)")
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            continue
        # compare the pattern without its wildcards: "fc*.weigth" is near "fc1.weight"
        bare = pattern.replace("*", "").replace("?", "")
        near = difflib.get_close_matches(bare, names, n=5, cutoff=0.5)
        hint = (f"did you mean {', '.join(map(repr, near))}?" if near else
                f"the model's initializers are {', '.join(map(repr, names[:10]))}"
                + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
        raise OptionError(f"{option}: {pattern!r} matches no initializer of the model; {hint} "
                          "(`tr-onnx inspect MODEL` lists them)")
    return patterns
