"""Export: the trained weights written back into the model as it was loaded.

The last step of the pipeline (ARCHITECTURE.md, "export"). ``TrainingSession.export_proto``
hands ``export_model`` three things:

* the original ModelProto (``ImportedModel.original``: as loaded, external data inlined,
  before the opset conversion and folding the plan was made from), so the result keeps the
  exporter's opset, node names and graph structure;
* the parameters as logical host arrays (``TrainingSession.parameters()``): the executor has
  already dropped the channel padding and turned the layout pass's NHWC / OHWI back into the
  model's NCHW / OIHW (``memory.read_host``), and BatchNorm running statistics are among them;
* the parameters that were untied from exporter-shared Identity copies (``{copy: source}``);
* the parameters split off an initializer the exporter merged (``{initializer: {reader node:
  parameter}}``, ``training.parameters``).

``export_model`` then, on a copy:

1. replaces every initializer that has a trained value, same name, same place, in the
   initializer's own dtype;
2. makes each untied copy an initializer of its own and drops the Identity node that made it;
   makes each split parameter an initializer of its own, read by its node;
3. puts the graph back in inference form (``inference_form``, each op's ``OpDef.export``
   rule): a model exported in training mode gets BatchNormalization ``training_mode=0`` (it
   then reads the trained running statistics) and Dropout off;
4. runs ``onnx.checker``.

Any ONNX runtime runs the result; the tests compare onnxruntime's outputs with the session's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..importer import opdef_for
from ..registry import OpRegistry, default_registry


def export_model(original: onnx.ModelProto, params: Mapping[str, np.ndarray],
                 untied: Mapping[str, str],
                 split: Mapping[str, Mapping[str, str]] | None = None,
                 registry: OpRegistry | None = None) -> onnx.ModelProto:
    """``original`` with the trained ``params`` (logical NCHW host arrays by initializer name)
    written into it; ``untied``: Identity outputs that trained as parameters of their own ->
    the initializer they copied (their values are in ``params``). ``original`` is not changed.
    ``registry``: where the ops' export rules are (default: ``default_registry()``).
    Raises ``onnx.checker.ValidationError`` if the result is not a valid model."""
    model = onnx.ModelProto()
    model.CopyFrom(original)
    g = model.graph
    for init in g.initializer:
        if init.name in params:
            value = params[init.name].astype(numpy_helper.to_array(init).dtype, copy=False)
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    if untied:
        keep = [n for n in g.node if not (n.op_type == "Identity" and n.output[0] in untied)]
        del g.node[:]
        g.node.extend(keep)
        for name in untied:
            g.initializer.append(numpy_helper.from_array(params[name], name))
    for source, readers in (split or {}).items():
        for node in g.node:
            if node.name in readers:
                node.input[:] = [readers[node.name] if i == source else i for i in node.input]
        dtype = next(numpy_helper.to_array(i).dtype for i in g.initializer if i.name == source)
        g.initializer.extend(numpy_helper.from_array(params[name].astype(dtype, copy=False), name)
                             for name in readers.values())
    inference_form(model, registry or default_registry())
    onnx.checker.check_model(model)
    return model


def inference_form(model: onnx.ModelProto, registry: OpRegistry) -> None:
    """A training-mode export goes back in inference form: each node whose OpDef has an
    export rule (``OpDef.export``: BatchNormalization with its running statistics,
    training_mode=0 and one output; Dropout off) rewrites itself."""
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for node in g.node:
        opdef = opdef_for(node, opsets, registry, "numpy")
        if opdef is not None and opdef.export is not None:
            opdef.export(node, g, used)
