"""What the exporter probably did to a model, said before it is trained.

tr_onnx trains the graph it is given, exactly; but the graph an exporter writes is not always
the model that was trained in PyTorch. Measured on torch 2.13 (docs/export.md has the
settings that avoid each):

- an eval-mode export with constant folding (both torch exporters' default) folds BatchNorm
  into the convolutions: training then trains the folded function, not PyTorch's ``train()``;
- the dynamo exporter's optimizer drops every all-zero bias of Conv, ConvTranspose and Gemm
  (all of them in a freshly initialised Hugging Face model), and merges equal-valued
  initializers (a fresh model's LayerNorm scales, all ones, become one initializer);
- constant folding turns the Transpose of a tied embedding/output weight (GPT-2) into a copy.

``export_advice`` looks for these signatures in the imported graph and returns one
``ExportAdvice`` per finding; ``TrainingSession`` warns with each (``ExportAdviceWarning``) and
``tr-onnx inspect`` prints them. The detectors are heuristics tuned to stay silent on models
exported as docs/export.md recommends and on the model zoo; each message says when to ignore it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from .importer import ImportedModel, opdef_for
from .opdef import (
    BATCHNORM_FOLDS_INTO,
    CHANNEL_NORMALIZATION,
    CONVOLUTION,
    LAYOUT_ONLY,
    NORMALIZATION,
)
from .registry import OpRegistry, default_registry
from .torch_metadata import exported_parameters, folded_from, module_of, rewrite_rules

DOC = "docs/export.md, 'The recipes'"
# What the detectors ask of an op is in its OpDef's traits (``opdef``): NORMALIZATION (any of
# them in a conv net means BatchNorm was not folded away; LRN too: a network with LRN, AlexNet's
# era, was designed without BatchNorm), CHANNEL_NORMALIZATION (a bias before them is cancelled
# by their mean subtraction, so convolutions in a network that has them are bias-less by
# design; pre-activation ResNets and DenseNets put the BatchNorm before the conv, so "directly
# followed" is not enough), CONVOLUTION, BATCHNORM_FOLDS_INTO (onnxscript's optimizer, the
# dynamo exporter's, fuses a BatchNorm into these layers) and LAYOUT_ONLY (between a layer and
# the normalisation after it, exporters put only these).
# onnxruntime's fused normalisations (com.microsoft), which tr_onnx does not run but an
# exporter's graph for onnxruntime may hold
ORT_NORMALIZATIONS = {"SkipLayerNormalization", "SimplifiedLayerNormalization",
                      "SkipSimplifiedLayerNormalization"}
# Fewer convolutions than this without normalisation is common by design (LeNet, tutorial
# CNNs); from ResNet on, every torchvision conv net normalises after (nearly) every conv, so
# 4+ convs and no normalisation at all means either a pre-2015 design (AlexNet, VGG without
# BN, SqueezeNet; the message names them) or BatchNorm folded away.
MIN_CONVS_FOLDED = 4
# One bias-less layer is as likely a design (a linear probe) as a dropped zero bias; the
# dropped-bias signature is every layer of a kind at once (zero-initialised biases are set
# per layer type: all Linear biases of a Hugging Face model, all folded conv biases of a fresh
# BatchNorm net).
MIN_BIASLESS = 2
SHOWN = 3  # names listed per finding


@dataclass(frozen=True)
class ExportAdvice:
    """One finding: ``code`` (stable, for filtering), ``message`` (what was found, naming the
    first nodes/initializers and their count, why it matters, what to do) and the ``names``
    of every node or initializer involved."""

    code: str
    message: str
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


def _listed(names, what: str) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} {what} ({shown}{more})"


class _Graph:
    """The lookups the detectors share: nodes by name, consumers, initializers."""

    def __init__(self, proto: onnx.ModelProto, params: frozenset[str] | None,
                 registry: OpRegistry):
        g = proto.graph
        self.registry = registry
        self.opsets = {o.domain or "": o.version for o in proto.opset_import}
        self._traits: dict[tuple[str, str], frozenset[str]] = {}
        self.nodes = list(g.node)
        self.inits = {i.name: i for i in g.initializer}
        self.params = params if params is not None else frozenset(
            i.name for i in g.initializer if i.data_type in (
                onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16))
        self.consumers = defaultdict(list)
        self.producer = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
            for name in node.output:
                self.producer[name] = node
        self.traits_present = frozenset().union(*map(self.traits, self.nodes))
        self.exported = exported_parameters(proto)  # the dynamo exporter's record, or empty
        self.folded = folded_from(proto)

    @staticmethod
    def label(node: onnx.NodeProto, index: int | None = None) -> str:
        return node.name or f"{node.op_type}_{index if index is not None else '?'}"

    def traits(self, node: onnx.NodeProto) -> frozenset[str]:
        """The node's ``OpDef.traits`` (an onnxruntime fused normalisation: NORMALIZATION)."""
        key = (node.domain, node.op_type)
        if key not in self._traits:
            opdef = opdef_for(node, self.opsets, self.registry, "numpy") or \
                opdef_for(node, self.opsets, self.registry, "cuda")
            self._traits[key] = opdef.traits if opdef is not None else frozenset(
                {NORMALIZATION} if node.op_type in ORT_NORMALIZATIONS else ())
        return self._traits[key]

    def followed_by(self, node: onnx.NodeProto, trait: str, depth: int = 3) -> bool:
        """Whether ``node``'s output reaches an op with ``trait`` through layout-only ops."""
        frontier = [o for o in node.output if o]
        for _ in range(depth + 1):
            nxt = []
            for value in frontier:
                for c in self.consumers.get(value, ()):
                    if trait in self.traits(c):
                        return True
                    if LAYOUT_ONLY in self.traits(c):
                        nxt.extend(o for o in c.output if o)
            frontier = nxt
        return False

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.inits[name])


def _has_bias(node: onnx.NodeProto) -> bool:
    return len(node.input) > 2 and bool(node.input[2])


def _fused_batchnorm(g: _Graph, node: onnx.NodeProto) -> str | None:
    """The BatchNorm that onnxscript's optimizer fused into ``node`` (its module, where the
    export recorded it), or None. The dynamo exporter's optimizer folds every BatchNorm that
    directly follows a Conv, ConvTranspose or Gemm of an eval-mode export, and keeps the
    others (a DenseNet's BatchNorm after each concatenation): the rewritten node records the
    rule in its metadata, and a layer that had no bias gets one named after its weight."""
    if "FuseBatchNormInto" not in rewrite_rules(node):
        if BATCHNORM_FOLDS_INTO not in g.traits(node) or len(node.input) < 3 or \
                node.input[2] != node.input[1] + "_bias":
            return None
    return module_of(node) or "a BatchNorm"


def fused_batchnorm(g: _Graph) -> list[ExportAdvice]:
    """Layers into which the dynamo exporter's optimizer fused a BatchNorm (whether or not
    other BatchNorm layers remain)."""
    fused = [(g.label(n, i), bn) for i, n in enumerate(g.nodes)
             if (bn := _fused_batchnorm(g, n)) is not None]
    if not fused:
        return []
    names = [f"{label}: {bn}" for label, bn in fused]
    return [ExportAdvice(
        "folded-batchnorm",
        f"{_listed(names, 'layers')} hold a BatchNorm that the torch dynamo exporter's "
        "optimizer fused into them (its FuseBatchNormInto* rule, on an eval-mode export). "
        "Training trains that folded function (no batch statistics, no running statistics), "
        "not what PyTorch's train() does, and drifts from it (measured: a torchvision "
        "DenseNet, 2e-2 in loss after 5 SGD steps). Export with torch.onnx.export(..., "
        f"dynamo=True, optimize=False) or dynamo=False, do_constant_folding=False ({DOC}).",
        tuple(label for label, _ in fused))]


def folded_batchnorm(g: _Graph) -> list[ExportAdvice]:
    """Many convolutions, no normalisation anywhere, biases on all of them (or, after the
    dynamo exporter dropped the all-zero folded biases of a fresh model, on none)."""
    if fused := fused_batchnorm(g):
        return fused
    convs = [(i, n) for i, n in enumerate(g.nodes) if CONVOLUTION in g.traits(n)]
    if len(convs) < MIN_CONVS_FOLDED or NORMALIZATION in g.traits_present:
        return []
    biased = sum(_has_bias(n) for _, n in convs)
    if 0 < biased < len(convs):
        return []  # folding gives every conv a bias: a mix is a design, not a fold
    names = [g.label(n, i) for i, n in convs]
    bias_note = ("each has a bias" if biased else
                 "none has a bias either: the folded biases, all zero in a freshly "
                 "initialised model, were then dropped (the torch dynamo exporter's optimizer "
                 "does both)")
    return [ExportAdvice(
        "folded-batchnorm",
        f"{_listed(names, 'convolutions')} and no normalization anywhere; {bias_note}. "
        "BatchNorm was likely folded into the convolutions by an eval-mode export with "
        "constant folding: training trains that folded function (no batch statistics, no "
        "running statistics), not what PyTorch's train() does. To keep BatchNorm, export with "
        "torch.onnx.export(..., dynamo=False, do_constant_folding=False) or, with the dynamo "
        f"exporter, optimize=False ({DOC}). Ignore this for a network designed without "
        "normalization (AlexNet, VGG without BN, SqueezeNet).",
        tuple(names))]


def removed_biases(g: _Graph) -> list[ExportAdvice]:
    """Layers whose bias the dynamo exporter's optimizer removed: the rule it recorded on the
    node, and a ``<layer>.bias`` the export's signature lists as a parameter. Exact where the
    heuristic of ``dropped_biases`` cannot judge (a convolution followed by a LayerNorm, as in
    ConvNeXt, whose biases the LayerNorm does not cancel)."""
    if not g.exported:
        return []
    layers = []
    for i, node in enumerate(g.nodes):
        if "RemoveOptionalBiasFrom" not in rewrite_rules(node) or len(node.input) < 2:
            continue  # (the rule also fires where the exporter wrote a zero bias itself)
        weight = node.input[1]
        layer = next((s.removesuffix(".weight") for s in [weight, *g.folded.get(weight, ())]
                      if s.endswith(".weight")), None)
        if layer is not None and f"{layer}.bias" in g.exported:
            layers.append((g.label(node, i), f"{layer}.bias"))
    if not layers:
        return []
    return [ExportAdvice(
        "dropped-biases",
        f"{_listed((f'{n}: {b}' for n, b in layers), 'layers')} lost their bias to the torch "
        "dynamo exporter's optimizer (its RemoveOptionalBiasFrom* rule removes every all-zero "
        "bias; a freshly initialised "
        "model's biases are zero): a removed bias is not a parameter of the ONNX model, so "
        "training does not learn it, where PyTorch would (measured: a torchvision ConvNeXt, "
        "0.17 in loss after 4 SGD steps). Export with torch.onnx.export(..., dynamo=True, "
        f"optimize=False) or with dynamo=False ({DOC}).",
        tuple(n for n, _ in layers))]


def dropped_biases(g: _Graph, folded: bool) -> list[ExportAdvice]:
    """Every Gemm (or every convolution) that no normalisation follows lacks its bias.

    MatMul layers are not judged: neither torch exporter drops a MatMul's bias Add (a Linear
    on 3-D input keeps its zero bias; measured), and a MatMul without one is a bias-less
    layer by design (GPT-2's and LLaMA's heads, LLaMA's projections)."""
    families = {"Gemm": [(i, n) for i, n in enumerate(g.nodes) if n.op_type == "Gemm"]}
    if not folded and CHANNEL_NORMALIZATION not in g.traits_present:
        # with the convs folded-batchnorm reports, their missing biases are already said
        families["convolution"] = [(i, n) for i, n in enumerate(g.nodes)
                                   if CONVOLUTION in g.traits(n)]
    out = []
    for family, layers in families.items():
        layers = [(i, n) for i, n in layers if not g.followed_by(n, NORMALIZATION)]
        if len(layers) < MIN_BIASLESS or any(_has_bias(n) for _, n in layers):
            continue
        names = [g.label(n, i) for i, n in layers]
        out.append(ExportAdvice(
            "dropped-biases",
            f"{_listed(names, f'{family} layers')} have no bias, and no normalization follows "
            "them. The torch dynamo exporter drops every all-zero bias (its optimizer's "
            "remove-optional-bias rule; every bias of a freshly initialised Hugging Face "
            "model is zero): a dropped bias is not a parameter of the ONNX model, so training "
            "does not learn it, where PyTorch would. Export with torch.onnx.export(..., "
            f"dynamo=True, optimize=False) or with dynamo=False ({DOC}). Ignore this if "
            "these layers have no bias by design.",
            tuple(names)))
    return out


def _weight_matrix(g: _Graph, node: onnx.NodeProto) -> tuple[str, bool] | None:
    """The initializer a MatMul/Gemm multiplies by on the right, and whether it is used
    transposed (``x @ W.T``): through a Transpose node or Gemm's transB."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return None
    name, transposed = node.input[1], False
    if node.op_type == "Gemm":
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
    producer = g.producer.get(name)
    if producer is not None and producer.op_type == "Transpose":
        perm = [list(a.ints) for a in producer.attribute if a.name == "perm"]
        if perm and perm[0] != [1, 0]:
            return None
        name, transposed = producer.input[0], not transposed
    if name not in g.params or len(g.inits[name].dims) != 2:
        return None
    return name, transposed


def untied_weights(g: _Graph) -> list[ExportAdvice]:
    """An embedding table (Gather from a [V, E] initializer) and a separate initializer that
    equals it as the output projection (``x @ table.T``)."""
    tables = {}
    for node in g.nodes:
        axis = [a.i for a in node.attribute if a.name == "axis"]
        if node.op_type == "Gather" and node.input[0] in g.params and not (axis and axis[0]) \
                and len(g.inits[node.input[0]].dims) == 2:
            tables.setdefault(node.input[0], node)
    if not tables:
        return []
    out, seen = [], set()
    for i, node in enumerate(g.nodes):
        found = _weight_matrix(g, node)
        if found is None or found[0] in tables or found[0] in seen:
            continue
        name, transposed = found
        dims = tuple(g.inits[name].dims)
        for table, gather in tables.items():
            v, e = g.inits[table].dims
            if dims != ((v, e) if transposed else (e, v)):
                continue
            w = g.array(name)
            if np.array_equal(w if transposed else w.T, g.array(table)):
                seen.add(name)
                out.append(ExportAdvice(
                    "untied-weights",
                    f"initializer {name!r} {list(dims)} (the weight of {g.label(node, i)!r}) "
                    f"equals {'' if transposed else 'the transpose of '}the embedding table "
                    f"{table!r} [{v}, {e}] (read by {g.label(gather)!r}): tied input/output "
                    "embeddings (GPT-2's) untied by the exporter, whose constant folding turns "
                    "the Transpose of the tied weight into a copy. Too small to be tied back "
                    "(under 256 elements), they train as two parameters here, as one in "
                    "PyTorch. Export with torch.onnx.export(..., dynamo=False, "
                    "do_constant_folding=False) or (dynamo) optimize=False "
                    f"({DOC}).",
                    (name, table)))
    return out


_QDQ = ("QuantizeLinear", "DequantizeLinear")


def merged_initializers(g: _Graph, split: Collection[str] = ()) -> list[ExportAdvice]:
    """A parameter whose elements are all equal (a fresh model's ones and zeros), read
    directly by several nodes: the dynamo exporter's optimizer merges equal-valued
    initializers into one (the classic exporter shares them through Identity nodes, which
    training unties). ``split``: those training splits back by the readers' modules."""
    merged = []
    # the merged initializer keeps one parameter's name; where the export lists its
    # parameters, an equal-valued constant (Swin's shift-mask ids) read twice is no sign
    for name in (p for p in g.params if p not in split and (not g.exported or p in g.exported)):
        users = [n for n in g.consumers.get(name, ()) if n.op_type != "Identity"]
        if len(users) < 2 or int(np.prod(g.inits[name].dims)) < 2:
            continue
        if all(n.op_type in _QDQ and name not in n.input[:1] for n in users):
            continue  # a Q/DQ pair's scale or zero point: one tensor read by both, by design
        x = g.array(name)
        if np.all(x == x.flat[0]):
            merged.append((name, users))
    if not merged:
        return []
    merged.sort()
    users = [f"{name!r} by {len(nodes)} nodes" for name, nodes in merged]
    shown = "; ".join(users[:SHOWN]) + (f"; and {len(users) - SHOWN} more"
                                        if len(users) > SHOWN else "")
    return [ExportAdvice(
        "merged-initializers",
        f"{len(merged)} constant-valued parameter(s) are each read by several nodes ({shown}). "
        "The torch dynamo exporter merges equal-valued initializers (a freshly initialised "
        "model's LayerNorm scales, all ones, and its zero biases become one initializer each): "
        "training here learns one shared parameter where PyTorch learns one per layer. Export "
        f"with torch.onnx.export(..., dynamo=True, optimize=False) or dynamo=False ({DOC}). "
        "Ignore this if the sharing is by design.",
        tuple(name for name, _ in merged))]


def export_advice(model: ImportedModel | onnx.ModelProto, tied: Collection[str] = (),
                  split: Collection[str] = (),
                  registry: OpRegistry | None = None) -> list[ExportAdvice]:
    """Signs that the exporter changed the model, one ``ExportAdvice`` each (empty: none).

    ``model``: an ``ImportedModel`` (its folded graph and parameter names are read) or a
    ``ModelProto`` (its float initializers are taken as the parameters). ``tied``: copies
    that training ties back to their source (``TrainingSession.sharing.tie``: equal values of
    >= 256 elements); an untied weight among them is no advice; ``split``: merged
    initializers training splits back (``TrainingSession.sharing.split``). ``registry``:
    where the ops' traits are read (default: the ImportedModel's, else ``default_registry()``).
    Cheap: initializer values are read only for the candidates of a tie or a merge."""
    if isinstance(model, ImportedModel):
        g = _Graph(model.proto, model.param_names, registry or model.registry)
    else:
        g = _Graph(model, None, registry or default_registry())
    folded = folded_batchnorm(g)
    untied = [a for a in untied_weights(g) if a.names[0] not in tied]
    dropped = removed_biases(g) or dropped_biases(g, bool(folded))
    return folded + dropped + untied + merged_initializers(g, split)
