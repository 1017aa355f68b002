"""What the torch exporters (and onnxscript's optimizer, the dynamo exporter's) record in a
model's metadata, read in one place: torch.export's signature (which initializers are
parameters, buffers or constants), the values an initializer was folded from, a node's module
path and the optimizer's rewrite rules. Readers return empty results for a model without it
(the classic exporter writes none), so callers fall back to what the graph itself shows.
"""

from __future__ import annotations

import ast
import re

import onnx

SIGNATURE_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
GRAPH_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # a node's module path, outermost first
REWRITE_RULES = "pkg.onnxscript.rewriter.rule_name"  # the rules that rewrote a node


def rewrite_rules(node: onnx.NodeProto) -> str:
    """The optimizer's rules that rewrote ``node``, comma-separated ("" where none did)."""
    return next((p.value for p in node.metadata_props if p.key == REWRITE_RULES), "")


def name_scopes(node: onnx.NodeProto) -> list[str]:
    """The node's scopes, outermost first (``['', 'features', 'features.norm0',
    '_native_batch_norm_legit_no_training']``); [] without them."""
    text = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
    try:
        names = ast.literal_eval(text) if text is not None else []
    except (ValueError, SyntaxError):
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def module_of(node: onnx.NodeProto) -> str | None:
    """The module path of a node from the dynamo exporter's name scopes (``['', 'model',
    'model.h.0', 'model.h.0.ln_2', 'layer_norm_1']`` -> ``model.h.0.ln_2``); None without."""
    if not node.name:
        return None
    module = ""
    for scope in name_scopes(node):
        if module == "" or scope.startswith(module + "."):
            module = scope
        elif scope:
            break
    return module or None


def input_kinds(model: onnx.ModelProto) -> dict[str, str]:
    """torch.export's input kinds recorded by the dynamo exporter, by initializer name."""
    g = model.graph
    kinds = {}
    for vi in list(g.value_info) + list(g.input):
        for prop in vi.metadata_props:
            if prop.key == SIGNATURE_KIND:
                kinds[vi.name] = prop.value
    for init in g.initializer:
        for prop in init.metadata_props:
            if prop.key == SIGNATURE_KIND:
                kinds[init.name] = prop.value
    return kinds


def folded_from(model: onnx.ModelProto) -> dict[str, list[str]]:
    """What the dynamo exporter's optimizer folded each initializer from (value_info metadata
    ``pkg.onnxscript.optimizer.folded_from``: the names of the values it replaced)."""
    found = {}
    for vi in list(model.graph.value_info) + list(model.graph.initializer):
        for prop in vi.metadata_props:
            if prop.key == FOLDED_FROM:
                try:
                    names = ast.literal_eval(prop.value)
                except (ValueError, SyntaxError):
                    continue  # not the list this version writes: the port walk decides
                if isinstance(names, list):
                    found[vi.name] = [str(n) for n in names]
    return found


def exported_parameters(model: onnx.ModelProto) -> frozenset[str]:
    """The targets of every PARAMETER in torch.export's signature, which the dynamo exporter
    writes whole into the model's metadata (also those its optimizer folded away)."""
    props = list(model.metadata_props) + list(model.graph.metadata_props)  # where torch wrote it
    text = next((p.value for p in props if p.key == GRAPH_SIGNATURE), "")
    return frozenset(re.findall(r": PARAMETER target='([^']+)'", text))


