"""ONNX import: load -> check -> convert opset -> infer shapes -> fold constants -> IR.

``import_model`` does the shape-independent part once per model; ``specialize`` makes the IR
for one set of concrete input shapes (and values of inputs that must be plan-time constants),
folding what those make constant. Symbolic batch dimensions stay symbolic until then.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PureWindowsPath

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from . import ir
from .const_feeds import const_feed_inputs, opdef_for
from .constant_folding import (
    DEFAULT_FOLD_LIMIT_BYTES,
    SHAPE_OPS,
    data_independent_values,
    fold_to_fixpoint,
    infer_node,
    infer_shapes,
    static_shape,
)
from .domains import ONNX_DOMAINS
from .dtypes import elem_type_name, is_supported, np_dtype, onnx_elem_type
from .errors import (
    InputError,
    ModelLoadError,
    ShapeError,
    UnsupportedModelError,
    unsupported_message,
)
from .legacy_opsets import prepare_for_conversion
from .registry import OpRegistry, canonical_domain, default_registry, schema_for
from .shape_checks import check_node_shapes, check_nodes

MIN_OPSET = 7  # older models are converted up (opset 6 and below had legacy broadcasting)
MAX_OPSET = onnx.defs.onnx_opset_version()


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple  # ints and str (symbolic)
    dtype: np.dtype


@dataclass
class ImportedModel:
    """A checked, opset-converted, shape-inferred, statically folded model."""

    proto: onnx.ModelProto
    source: str
    original: onnx.ModelProto  # as loaded (external data inlined): what export writes back
    inputs: list[InputSpec]
    outputs: list[InputSpec]
    param_names: frozenset[str]  # float initializers of the original model (trainable candidates)
    const_feeds: frozenset[str]  # graph inputs a plan must treat as constants (Reshape shape...)
    original_opset: int
    registry: OpRegistry = field(repr=False, default=None)
    fold_limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES  # specialize folds with it too

    def specialize(self, shapes: dict[str, tuple], const_values: dict[str, np.ndarray],
                   resolve=None, regions=None) -> ir.Graph:
        return specialize(self, shapes, const_values, resolve, regions)


def load_model(src: str | Path | onnx.ModelProto | bytes,
               external_data_dir: str | Path | None = None) -> tuple[onnx.ModelProto, str]:
    """Read a model; a missing, truncated or non-ONNX file is a ``ModelLoadError`` naming it.

    Tensors kept in external files are read (``load_external_data``) from the model file's
    folder; a model given as bytes or a ModelProto has no folder of its own: its external data
    is read from ``external_data_dir``, and without one it is refused (never read relative to
    the working folder). A given ModelProto is not changed."""
    if isinstance(src, onnx.ModelProto):
        model, name, folder = src, "<ModelProto>", None
    else:
        if isinstance(src, bytes):
            name, data, folder = "<bytes>", src, None
        else:
            path = Path(src)
            name, folder = str(path), path.parent
            if not path.is_file():
                raise ModelLoadError(f"{name}: no such model file")
            data = path.read_bytes()
        try:
            model = onnx.load_model_from_string(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{name}: not a valid ONNX model (truncated or not ONNX): "
                                 f"{exc}") from None
        if model.ir_version == 0 or not model.HasField("graph") or not model.opset_import:
            raise ModelLoadError(f"{name}: not a valid ONNX model (no IR version, graph or "
                                 "opset import; truncated or not ONNX)")
    external = external_tensors(model)
    if external:
        base = folder if folder is not None else external_data_dir
        if base is None:
            t = external[0]
            raise ModelLoadError(
                f"{name}: tensor {t.name!r} keeps its data in an external file "
                f"({external_location(t)!r}), and a model given as bytes or a ModelProto has no "
                "folder to read it from: pass external_data_dir= (the folder the model was "
                "saved in), or give the model's path")
        if isinstance(src, onnx.ModelProto):  # the caller's proto keeps its references
            model = onnx.ModelProto()
            model.CopyFrom(src)
        load_external_data(model, Path(base), name)
    return model, name


def _graph_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes):
    for node in nodes:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sparse in ([a.sparse_tensor] if a.HasField("sparse_tensor") else []) + \
                    list(a.sparse_tensors):
                yield from (sparse.values, sparse.indices)
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _graph_tensors(g)


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Every tensor of ``model`` whose data lives in an external file: initializers, sparse
    ones, node attributes, subgraphs and functions (onnx's own walk skips sparse tensors)."""
    tensors = list(_graph_tensors(model.graph))
    for function in model.functions:
        tensors += _node_tensors(function.node)
    return [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]


def external_location(tensor: onnx.TensorProto) -> str:
    return next((e.value for e in tensor.external_data if e.key == "location"), "")


def _contained(base: Path, location: str) -> Path:
    """``base / location`` if it is a regular file inside ``base``; else why not (ValueError).
    The rules of onnx's loader, kept here whatever onnx version is installed: a relative path,
    no ``..``, not a symbolic link, not resolving outside ``base`` through a linked folder."""
    parts = location.replace("\\", "/").split("/")
    if not location:
        raise ValueError("the location is empty")
    if location.startswith(("/", "\\")) or Path(location).is_absolute() or \
            PureWindowsPath(location).drive:
        raise ValueError("an absolute path; external data must be relative to the model's "
                         "folder")
    if ".." in parts:
        raise ValueError("'..' leaves the model's folder")
    path = base / location
    if path.is_symlink():
        raise ValueError("a symbolic link; external data must be a regular file")
    real, root = os.path.realpath(path), os.path.realpath(base)
    if os.path.commonpath([real, root]) != root:
        raise ValueError(f"it resolves to {real}, outside {root} (through a linked folder)")
    if not path.is_file():
        raise ValueError(f"no such file in {base}")
    return path


def load_external_data(model: onnx.ModelProto, base: Path, name: str) -> None:
    """Read every external tensor of ``model`` (in place) from files inside ``base``; one that
    names a file elsewhere (absolute, ``..``, a symbolic link) is a ``ModelLoadError``."""
    for t in external_tensors(model):
        location = external_location(t)
        try:
            _contained(base, location)
            onnx.external_data_helper.load_external_data_for_tensor(t, str(base))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"{name}: external data of tensor {t.name!r} ({location!r}) "
                                 f"could not be read: {reason}") from None


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's ai.onnx opset, or None when it uses no default-domain op."""
    for o in model.opset_import:
        if o.domain in ONNX_DOMAINS:
            return o.version
    return None


def _check(model: onnx.ModelProto, name: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelLoadError(f"{name}: fails onnx.checker: {first}") from None
    except UnicodeDecodeError as exc:  # the checker's message quotes a name that is not UTF-8
        raise ModelLoadError(f"{name}: fails onnx.checker, on a name or string that is not "
                             f"valid UTF-8 ({exc})") from None


def _check_tensors(model: onnx.ModelProto, name: str, in_memory: bool) -> None:
    """Every initializer and every node's tensor attribute (Constant's value) must decode to
    its dims and type: the checker does not compare the data with the dims. A model given as
    bytes or a ModelProto has no folder its external data could be read from."""
    tensors = [(f"initializer {t.name!r}", t) for t in model.graph.initializer] + [
        (f"node {node.name or node.op_type!r} ({node.op_type}) attribute {a.name!r}", a.t)
        for node in model.graph.node for a in node.attribute
        if a.type == onnx.AttributeProto.TENSOR]
    for what, t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:  # not read by load_model
            why = ("a model given as bytes or a ModelProto has no folder to read it from; pass "
                   "external_data_dir= or load the model from its path") if in_memory \
                else "it was not read"
            raise ModelLoadError(f"{name}: {what} keeps its data in an external file: {why}")
        try:
            numpy_helper.to_array(t)
        except (ValueError, TypeError, KeyError, onnx.checker.ValidationError) as exc:
            raise ModelLoadError(
                f"{name}: {what} ({elem_type_name(t.data_type)}, dims {list(t.dims)}) does not "
                f"hold data of its dims and type: {exc}") from None


def _convert(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    opset = default_opset(model)
    target = None if opset is None else MIN_OPSET if opset < MIN_OPSET else \
        MAX_OPSET if opset > MAX_OPSET else None
    if target is None:
        return model
    try:
        if opset < MIN_OPSET:
            model = prepare_for_conversion(model, opset)
        return onnx.version_converter.convert_version(model, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors for missing adapters
        raise ModelLoadError(f"{name}: cannot convert opset {opset} to {target}: {exc}") from None


# Attributes whose default ONNX's shape inference reads differently from the op's schema: STFT's
# ``onesided`` is 1 by the schema (onnx.reference and the node suite's data agree) but 0 in its
# inference function (onnx 1.23, defs/math/defs.cc), which then types a onesided output as full.
_INFERENCE_DEFAULT_MISMATCH = {("", "STFT"): ("onesided", 1)}


def _spell_out_defaults(model: onnx.ModelProto, src) -> onnx.ModelProto:
    """``model`` with each ``_INFERENCE_DEFAULT_MISMATCH`` attribute written out where a node
    leaves it to the default (on a copy if ``model`` is the caller's ``src``)."""
    missing = []
    for n in model.graph.node:
        attr, value = _INFERENCE_DEFAULT_MISMATCH.get((canonical_domain(n.domain), n.op_type),
                                                      (None, None))
        if attr is not None and attr not in {a.name for a in n.attribute}:
            missing.append((n.output[0], attr, value))
    if not missing:
        return model
    if model is src:
        model = onnx.ModelProto()
        model.CopyFrom(src)
    by_output = {n.output[0]: n for n in model.graph.node if n.output}
    for output, attr, value in missing:
        by_output[output].attribute.append(onnx.helper.make_attribute(attr, value))
    return model


# Ops whose kernels run no subgraph attribute: a node carrying one (FlexAttention's score_mod
# or prob_mod) is replaced by its schema's function body for that node, which onnx builds with
# the subgraph inlined, so kernels run the plain ops it is made of. Nodes without one keep
# their kernel.
_INLINED_WITH_SUBGRAPHS = {("ai.onnx.preview", "FlexAttention")}
_INLINED_DOMAIN = "ai.tr_onnx.inlined"


def _inline_subgraph_ops(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``model`` (a copy if it changes) with each ``_INLINED_WITH_SUBGRAPHS`` node that has a
    graph attribute replaced by its schema's context-dependent function (top-level graph):
    each becomes a model-local function of its own that onnx's inliner expands, so names
    stay unique and the other nodes of that op stay as they are."""
    picked = [i for i, n in enumerate(model.graph.node)
              if (canonical_domain(n.domain), n.op_type) in _INLINED_WITH_SUBGRAPHS
              and any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute)]
    if not picked:
        return model
    g = infer_shapes(model, name).graph
    types = {vi.name: vi.type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, t.dims)
                  for t in g.initializer})
    opsets = {o.domain or "": o.version for o in model.opset_import}
    out, inlined = onnx.ModelProto(), []
    out.CopyFrom(model)
    for i in picked:
        node = out.graph.node[i]
        schema = schema_for(node.domain, node.op_type, opsets.get(node.domain or "", 1))
        body = onnx.FunctionProto()
        body.ParseFromString(schema.get_context_dependent_function(
            node.SerializeToString(),
            [types.get(x, onnx.TypeProto()).SerializeToString() for x in node.input]))
        if not body.node:  # onnx could not build it (input types unknown): the node stays,
            continue  # and its kernel names the subgraph it cannot run
        body.domain, body.name = _INLINED_DOMAIN, f"{node.op_type}_{i}"
        node.domain, node.op_type = body.domain, body.name
        out.functions.append(body)
        inlined.append((body.domain, body.name))
    if not inlined:
        return model
    out.opset_import.append(onnx.helper.make_opsetid(_INLINED_DOMAIN, 1))
    out = onnx.inliner.inline_selected_functions(out, inlined)
    kept = [o for o in out.opset_import if o.domain != _INLINED_DOMAIN]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out


def check_byte_limit(option: str, value) -> int | None:
    """``value`` of the byte-count option ``option`` (``fold_limit_bytes``,
    ``max_arena_bytes``) if it is an int >= 0 or None (no limit); else an ``InputError``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise InputError(f"{option}={value!r}: must be a number of bytes >= 0, or None for no "
                         "limit")
    return value


def check_supported(model: onnx.ModelProto, source: str, registry: OpRegistry, backend: str,
                    param_names) -> None:
    """Raise one error listing every unsupported (domain, op, version) with its nodes."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    shape_only = data_independent_values(model, param_names)
    missing: dict[tuple[str, str, int], list[str]] = {}
    for i, node in enumerate(model.graph.node):
        if all(o in shape_only for o in node.output if o) and node.output:
            continue  # folds away once input shapes are concrete
        opset = opsets.get(node.domain or "", opsets.get("ai.onnx", 1))
        version = registry.resolve_version(node.domain, node.op_type, opset)
        if version is None or registry.lookup(node.domain, node.op_type, version, backend) is None:
            key = (node.domain, node.op_type, version if version is not None else opset)
            missing.setdefault(key, []).append(node.name or f"{node.op_type}_{i}")
    bad_types = []
    graph_values = {vi.name for vi in list(model.graph.input) + list(model.graph.output)}
    outputs = {vi.name for vi in model.graph.output}
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        t = vi.type.tensor_type
        if vi.name in outputs and not vi.type.HasField("tensor_type") and \
                _held(vi.type).elem_type:  # a plan lists the tensors of a sequence or optional
            t = _held(vi.type)  # output (passes.control_flow)
        elif not vi.type.HasField("tensor_type"):  # a model input or output must be a tensor
            if vi.name in graph_values:
                bad_types.append(f"{vi.name!r} ({vi.type.WhichOneof('value') or 'no type'}, "
                                 "not a tensor)")
        elif (t.elem_type or vi.name in graph_values) and not is_supported(t.elem_type):
            bad_types.append(f"{vi.name!r} ({elem_type_name(t.elem_type)})")
    if missing or bad_types:
        entries = [(d, o, v, n) for (d, o, v), n in missing.items()]
        msg = unsupported_message(entries, backend, source, partial(
            registry.registered_versions, backend=backend)) if entries else source + ":"
        if bad_types:
            msg += "\n  values with element types tr_onnx cannot hold: " + ", ".join(bad_types[:10])
        raise UnsupportedModelError(msg, entries)


# Exporters fold a module's ``weight.to(torch.bfloat16)`` into a bfloat16 initializer: such a
# weight is a float32 parameter (its master copy) read through a Cast, so it trains as PyTorch
# trains the module's float32 weight, and export rounds it back into the bfloat16 initializer.
_LOW_PRECISION_MASTER = onnx.TensorProto.BFLOAT16


def master_weights(g: onnx.GraphProto) -> list[str]:
    """Each bfloat16 initializer of ``g`` (not a graph output) becomes a float32 initializer of
    the same name (exact: float32 holds every bfloat16) and a Cast back to bfloat16 at the head
    of the graph that its readers read instead. Returns the names changed; edits ``g``."""
    outputs = {o.name for o in g.output}
    names = [t.name for t in g.initializer
             if t.data_type == _LOW_PRECISION_MASTER and t.name not in outputs]
    if not names:
        return names
    cast_of = {n: f"{n}/bfloat16" for n in names}
    _rename_inputs(g.node, cast_of)
    for vi in g.value_info:  # an exporter's bfloat16 type of the initializer is the Cast's
        vi.name = cast_of.get(vi.name, vi.name)
    for k, t in enumerate(g.initializer):
        if t.name in cast_of:
            g.initializer[k].CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(t).astype(np.float32), t.name))
    casts = [onnx.helper.make_node("Cast", [n], [c], name=c, to=_LOW_PRECISION_MASTER)
             for n, c in cast_of.items()]
    rest = list(g.node)
    del g.node[:]
    g.node.extend(casts + rest)
    return names


def _rename_inputs(nodes, renamed: dict[str, str]) -> None:
    """Node inputs renamed, in control-flow bodies too (they read outer values by name)."""
    for node in nodes:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        for a in node.attribute:
            for body in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                _rename_inputs(body.node, renamed)


_INTERNAL_OPS_ALLOWED: ContextVar[bool] = ContextVar("internal_ops_allowed", default=False)


@contextmanager
def internal_ops_allowed():
    """Within it, models may hold tr_onnx's internal ops (domain ai.tr_onnx), which a user's
    model may not (``shape_checks.check_nodes``): for the tests that run those ops' kernels
    and gradients as a model's nodes."""
    token = _INTERNAL_OPS_ALLOWED.set(True)
    try:
        yield
    finally:
        _INTERNAL_OPS_ALLOWED.reset(token)


def load_checked(src: str | Path | onnx.ModelProto | bytes,
                 external_data_dir: str | Path | None = None,
                 internal_ops: bool = False) -> tuple[onnx.ModelProto, str]:
    """``load_model``, then the checks every model passes before anything reads it: onnx.checker
    (duplicate local functions, ...), ``shape_checks.check_nodes`` (before anything runs
    onnx's shape inference) and the tensors' data against their dims. What rewrites a user's
    model before import (a new head, LoRA branches) loads it here too."""
    model, name = load_model(src, external_data_dir)
    _check(model, name)
    check_nodes(model, name, internal_ops or _INTERNAL_OPS_ALLOWED.get())
    _check_tensors(model, name, in_memory=isinstance(src, (bytes, onnx.ModelProto)))
    return model, name


@ir.collector_paused()
def import_model(src, registry: OpRegistry | None = None, backend: str = "numpy",
                 external_data_dir: str | Path | None = None,
                 fold_limit_bytes: int | None = DEFAULT_FOLD_LIMIT_BYTES,
                 internal_ops: bool = False) -> ImportedModel:
    """Load, check, convert, infer and fold ``src``; verify every op has a kernel for
    ``backend``. ``external_data_dir``: where a model given as bytes or a ModelProto keeps its
    external data (``load_model``). ``fold_limit_bytes``: no folded constant is larger (None:
    no limit). ``internal_ops``: ``src`` is tr_onnx's own and may hold its internal ops (as
    within ``internal_ops_allowed``)."""
    check_byte_limit("fold_limit_bytes", fold_limit_bytes)
    registry = registry or default_registry()
    model, name = load_checked(src, external_data_dir, internal_ops)
    original = onnx.ModelProto()
    original.CopyFrom(model)
    original_opset = default_opset(model)
    model = _inline_subgraph_ops(_spell_out_defaults(_convert(model, name), src), name)
    # IR < 4 listed initializers among the graph inputs; they are parameters, not feeds.
    init_names = {i.name for i in model.graph.initializer}
    if any(i.name in init_names for i in model.graph.input):
        if model is src:  # edit a copy, never the caller's ModelProto
            model = onnx.ModelProto()
            model.CopyFrom(original)
        inputs = [i for i in model.graph.input if i.name not in init_names]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        if model.ir_version < 4:
            model.ir_version = 4
    if model is src and any(i.data_type == _LOW_PRECISION_MASTER for i in model.graph.initializer):
        model = onnx.ModelProto()
        model.CopyFrom(original)
    master_weights(model.graph)
    param_names = frozenset(i.name for i in model.graph.initializer
                            if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                               onnx.TensorProto.FLOAT16))
    model = fold_to_fixpoint(model, param_names, name, fold_limit_bytes)
    check_supported(model, name, registry, backend, param_names)
    const_feeds = const_feed_inputs(model, registry, backend)
    specs = [_spec(vi) for vi in model.graph.input]
    outs = [_spec(vi) for vi in model.graph.output]
    return ImportedModel(model, name, original, specs, outs, param_names,
                         frozenset(const_feeds), original_opset, registry, fold_limit_bytes)


def _held(tp: onnx.TypeProto):
    """The tensor type of a tensor, or of what a sequence or optional holds."""
    if tp.HasField("optional_type"):
        tp = tp.optional_type.elem_type
    return tp.sequence_type.elem_type.tensor_type if tp.HasField("sequence_type") \
        else tp.tensor_type


def _spec(vi: onnx.ValueInfoProto) -> InputSpec:
    """An input's or output's name, shape and dtype (a sequence output's: its tensors')."""
    t = _held(vi.type)
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                 for d in t.shape.dim) if t.HasField("shape") else None
    return InputSpec(vi.name, dims, np_dtype(t.elem_type))


def specialize(imported: ImportedModel, shapes: dict[str, tuple],
               const_values: dict[str, np.ndarray], resolve=None, regions=None) -> ir.Graph:
    """The IR for concrete input shapes; ``const_values`` binds the model's const-feed inputs.
    ``resolve(model, fold, param_names)``: the pass turning static control flow (If, Loop,
    Scan, sequences) into plain ops once shapes and const feeds are bound
    (``passes.control_flow.resolve``); ``fold`` infers and folds again between its rounds.
    ``regions`` (``subplan.Regions``): ``settle(model)`` the sizes of data-dependent nodes
    that constants decide, ``cut(model, graph)`` the rest into regions run as sub-plans;
    without it a data-dependent size is a ``ShapeError``. Both are the compiler's to give: the
    importer imports neither passes nor the compiler."""
    model = onnx.ModelProto()
    model.CopyFrom(imported.proto)
    g = model.graph
    for vi in g.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            for d in shapes[vi.name]:
                dims.add().dim_value = int(d)
    if const_values:
        kept = [vi for vi in g.input if vi.name not in const_values]
        del g.input[:]
        g.input.extend(kept)
        g.initializer.extend(numpy_helper.from_array(np.asarray(v), k)
                             for k, v in const_values.items())
    fold = partial(fold_to_fixpoint, param_names=imported.param_names, name=imported.source,
                   limit_bytes=imported.fold_limit_bytes)
    model = fold(model)
    if resolve is not None:
        model = resolve(model, fold, imported.param_names)
    if regions is not None:
        model = regions.settle(model)  # sizes that constants decide (a kernel checks)
    check_node_shapes(model, imported.source)
    _custom_shapes(model, imported)
    opsets = {o.domain or "": o.version for o in model.opset_import}

    def schema_of(domain, op_type):
        return schema_for(domain, op_type, opsets.get(domain or "", 1)) \
            if canonical_domain(domain) in ("", "ai.onnx.ml", "ai.onnx.preview.training") else None

    graph = ir.graph_from_onnx(model, schema_of)
    for v in graph.values.values():
        if v.kind == ir.PARAM and v.name not in imported.param_names:
            v.kind = ir.CONST
    if regions is not None:
        regions.cut(model, graph)  # data-dependent parts -> sub-plans
    for node in graph.nodes:  # the first node whose output shape the data decides
        for v in node.outputs:
            if v is not None and not v.is_static:
                raise ShapeError(_data_dependent_message(imported, node, v))
    for v in graph.values.values():
        if not v.is_static:
            raise ShapeError(f"{imported.source}: value {v.name!r} has a dynamic shape "
                             f"{list(v.shape)} even with concrete inputs (data-dependent shapes "
                             "are not supported)")
    return graph


def _data_dependent_message(imported: ImportedModel, node: ir.Node, value) -> str:
    """Name the node, the value, and the model inputs whose values decide its shape (through
    the node's plan-time inputs where it declares them: Reshape's shape, not its data)."""
    opdef = imported.registry.lookup(node.domain, node.op_type, node.since_version, "numpy")
    deciding = opdef.const_inputs if opdef is not None and opdef.const_inputs else \
        range(len(node.inputs))
    inputs, seen = [], set()
    pending = [node.inputs[i] for i in deciding if i < len(node.inputs) and node.inputs[i]]
    while pending:
        v = pending.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if v.kind == ir.INPUT:
            inputs.append(v.name)
        elif v.producer is not None and v.producer.op_type not in SHAPE_OPS:
            pending.extend(i for i in v.producer.inputs if i is not None)
    where = f" (from the values of input(s) {sorted(inputs)})" if inputs else ""
    return (f"{imported.source}: {node.label} gives value {value.name!r} a shape "
            f"{list(value.shape)} that depends on data{where}, even with concrete input "
            "shapes; tr_onnx plans every shape before a step runs (a data-dependent size must "
            "become static again before a model output, or be decided by model inputs)")


def _custom_shapes(model: onnx.ModelProto, imported: ImportedModel) -> None:
    """Fill shapes ONNX inference left unknown using the ops' own shape rules (custom domains),
    then let ONNX inference carry them downstream."""
    g = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    rules: dict[tuple[str, str], object] = {}  # (domain, op) -> its OpDef if it has a shape rule
    for node in g.node:
        key = (node.domain, node.op_type)
        if key not in rules:
            opdef = opdef_for(node, opsets, imported.registry, "numpy")
            rules[key] = opdef if opdef is not None and opdef.shape is not None else None
    if not any(rules.values()):
        return  # what ONNX inference could not type, nothing here can
    infos = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    inits = {i.name: i for i in g.initializer}
    for name, init in inits.items():  # made value infos when read (a model holds many)
        infos.setdefault(name, init)
    # custom op -> standard op -> custom op: each pass types what the previous one made known
    for _ in range(len(g.node)):
        if not _custom_shapes_pass(model, imported, infos, inits, rules):
            return


def _info(infos: dict, name: str) -> onnx.ValueInfoProto | None:
    info = infos.get(name)
    if isinstance(info, onnx.TensorProto):  # an initializer: its dims are its shape
        info = infos[name] = onnx.helper.make_tensor_value_info(name, info.data_type,
                                                                list(info.dims))
    return info


def _custom_shapes_pass(model, imported, infos, inits, rules) -> bool:
    g = model.graph
    changed = False
    declared = {vi.name: vi for vi in list(g.value_info) + list(g.output)}
    for node in g.node:
        if all(static_shape(infos.get(o)) is not None for o in node.output if o):
            continue
        opdef = rules[(node.domain, node.op_type)]
        if opdef is None and not changed:
            continue
        in_infos = [_info(infos, n) if n else None for n in node.input]
        in_shapes = [static_shape(vi) for vi in in_infos]
        if any(n and shape is None for n, shape in zip(node.input, in_shapes)):
            continue  # an input is not known yet; a later pass gets it
        if opdef is not None:
            in_types = [np_dtype(vi.type.tensor_type.elem_type) if vi is not None else None
                        for vi in in_infos]
            results = [(shape, onnx_elem_type(dtype))
                       for shape, dtype in opdef.shape(node, in_shapes, in_types)]
        else:  # a standard op reading what this pass typed: typed now, not in another pass
            # over the whole model (one per custom op of a chain of them was quadratic)
            inferred = infer_node(node, model.opset_import, {
                n: vi.type for n, vi in zip(node.input, in_infos) if n}, {
                n: inits[n] for n in node.input if n in inits})
            results = [inferred.get(o, (None, 0)) for o in node.output]
        for out_name, (shape, elem) in zip(node.output, results):
            if not out_name or shape is None or not elem:
                continue
            vi = onnx.helper.make_tensor_value_info(out_name, elem, list(shape))
            if out_name in declared:  # a graph output's declared (symbolic) type, or what
                declared[out_name].type.CopyFrom(vi.type)  # inference could tell, is replaced
                vi = declared[out_name]
            else:
                g.value_info.append(vi)
            infos[out_name] = vi
            changed = True
    if changed:
        inferred = infer_shapes(model, imported.source)
        model.CopyFrom(inferred)
        g = model.graph
        infos.update({vi.name: vi for vi in list(g.value_info) + list(g.output)})
    return changed
