"""LoRA adapters for an exported model: inject ``y = W x + (alpha/r) * B(A(x))`` beside its
weights, train only A and B, then export the result three ways.

``add_lora`` rewrites a copy of the model: beside every targeted 2-D weight ``W`` of a MatMul
(``x @ W``, W [in, out]), a Gemm (W [in, out], or [out, in] with ``transB=1``) or a 1x1 Conv
(W [out, in, 1, 1], group 1) it adds a branch ``scale * B(A(x))`` (``scale = alpha / rank``)
whose sum with the node's output replaces that output. A and B keep peft's shapes (A [r, in],
B [out, r]; a Conv's [r, in, 1, 1] and [out, r, 1, 1]) so the adapters are peft's
``lora_A.weight``/``lora_B.weight`` as they are; the branch transposes them for a MatMul. A is
Kaiming-uniform with ``a = sqrt(5)`` (``U(-1/sqrt(in), 1/sqrt(in))``, peft's
``kaiming_uniform_``) from a seeded generator, B zero, so the model starts as the base model.

Names: an adapter is named after the PyTorch parameter its weight came from: the initializer's
own name where it is one (``fc.weight``), else what the dynamo exporter's optimizer folded it
from (``model.layers.0.self_attn.q_proj.weight``, ``torch_metadata.folded_from``), else the
module path of the node using it (the classic exporter's ``/model/layers.0/self_attn/q_proj/
MatMul`` -> ``model.layers.0.self_attn.q_proj.weight``), else the initializer's name. A and B
are ``<that name>.lora_A`` and ``<that name>.lora_B``. ``targets`` selects weights by that
name: a regular expression (``re.search``), or a list of module names as peft's
``target_modules`` (a weight matches when its module path is one of them or ends with
``.<one of them>``). A weight that some other node also reads (a tied embedding) is skipped:
folding the adapter into it would change that node too (``LoraInfo.skipped`` says why).

The three exports: ``merge_lora`` (the base graph with ``W + scale * B A`` folded into W, the
same nodes and names, nothing added), ``adapter_model`` + ``write_adapter`` (the base graph
with the branches whose A/B are graph inputs, defaulting to zeros, for onnxruntime's
``RunOptions.add_active_adapter``, and the trained A/B as an ``.onnx_adapter`` file), and
``save_adapters`` / ``apply_lora`` (the trained tensors alone as ``.npz`` with the base
graph's hash, re-applied to a fresh copy of the base).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import torch_metadata
from ..domains import ONNX_DOMAINS
from ..errors import TrOnnxError
from ..importer import load_checked

FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
               onnx.TensorProto.BFLOAT16)
BASE_DTYPES = {"bfloat16": onnx.TensorProto.BFLOAT16, "float16": onnx.TensorProto.FLOAT16}
_AUTO_NAME = re.compile(r"^(onnx::|val_\d+$|_val_\d+$)")  # exporter-made initializer names
CONFIG_KEY = "__lora_config__"  # the .npz entry holding the LoraInfo as JSON


class LoraError(TrOnnxError):
    """A LoRA request the model cannot take, or adapters that do not fit the base model."""


@dataclass(frozen=True)
class LoraTarget:
    """One adapted weight. ``kind``: ``matmul`` (W [in, out] read as ``x @ W``), ``gemm``
    (the same; Gemm's ``transB=0``), ``gemm_t`` (W [out, in], ``transB=1``) or ``conv``
    (W [out, in, 1, 1]); it decides how ``scale * B A`` folds into W."""

    weight: str  # the base model's initializer
    name: str  # the parameter name the adapters are named after
    lora_A: str
    lora_B: str
    kind: str
    in_features: int
    out_features: int
    nodes: tuple[str, ...]  # the nodes reading the weight, each given a branch


@dataclass
class LoraInfo:
    """What ``add_lora`` did: the adapted weights, the names a session should train, and
    the settings needed to do it again on a fresh copy of the base (``apply_lora``)."""

    rank: int
    alpha: float
    dropout: float
    targets: str | list[str] | None
    seed: int
    base_dtype: str | None
    train_also: str | None
    base_sha256: str
    adapters: list[LoraTarget] = field(default_factory=list)
    trainable: list[str] = field(default_factory=list)  # A/B, then train_also's initializers
    skipped: dict[str, str] = field(default_factory=dict)  # weight -> why it has no adapter

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapter_names(self) -> list[str]:
        return [n for t in self.adapters for n in (t.lora_A, t.lora_B)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoraInfo:
        d = json.loads(text)
        d["adapters"] = [LoraTarget(**{**t, "nodes": tuple(t["nodes"])}) for t in d["adapters"]]
        return cls(**d)


def base_hash(model: onnx.ModelProto) -> str:
    """sha256 of the graph (nodes and initializers): what adapters were trained against."""
    return hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()


def add_lora(model: onnx.ModelProto | str | Path, rank: int = 8, alpha: float = 16,
             dropout: float = 0.0, targets: str | Sequence[str] | None = None, seed: int = 0,
             base_dtype: str | None = None, train_also: str | None = None
             ) -> tuple[onnx.ModelProto, LoraInfo]:
    """A copy of ``model`` with LoRA branches beside its targeted weights (module docstring),
    and what was done. ``targets``: a regular expression over the weights' parameter names,
    or a list of module names as peft's ``target_modules``; None: every eligible weight.
    ``dropout`` > 0: a Dropout on each branch's input (active in training only).
    ``base_dtype``: ``"bfloat16"`` or ``"float16"`` holds the adapted (frozen) weights in that
    type, cast to float before use, halving their memory. ``train_also``: a regular
    expression over initializer (and parameter) names trained besides A and B (biases, a
    head). Train with ``TrainingSession(model, trainable=info.trainable)``."""
    base = _load(model)
    info = LoraInfo(rank=_positive_int("rank", rank), alpha=float(alpha),
                    dropout=_ratio(dropout), targets=_targets(targets), seed=int(seed),
                    base_dtype=_base_dtype(base_dtype), train_also=train_also,
                    base_sha256=base_hash(base))
    found, info.skipped = _find_targets(base, info)
    if not found:
        raise LoraError(f"targets={info.targets!r} matched no 2-D MatMul/Gemm or 1x1 Conv "
                        f"weight; candidates: {sorted(_candidate_names(base))}"
                        + (f"; skipped: {info.skipped}" if info.skipped else ""))
    info.adapters = found
    rng = np.random.default_rng(seed)
    values = {}
    for t in found:  # peft: kaiming_uniform_(A, a=sqrt(5)) -> bound 1/sqrt(fan_in); B = 0
        a_shape, b_shape = _adapter_shapes(t, rank)
        bound = 1.0 / math.sqrt(t.in_features)
        values[t.lora_A] = rng.uniform(-bound, bound, a_shape).astype(np.float32)
        values[t.lora_B] = np.zeros(b_shape, np.float32)
    out = _inject(base, info, values, as_inputs=False)
    info.trainable = info.adapter_names() + _also_trained(base, info)
    return out, info


def merge_lora(base: onnx.ModelProto | str | Path, trained, info: LoraInfo) -> onnx.ModelProto:
    """The base model with ``W + scale * B A`` folded into each adapted weight (and the
    ``train_also`` tensors replaced by their trained values): the same nodes and names as
    the base, nothing added. ``trained``: the trained LoRA model (``TrainingSession.
    export_proto()``), or its tensors by name (``load_adapters``)."""
    base = _load(base)
    _check_base(base, info)
    values = _values(trained, info.adapter_names() + info.trainable)
    out = copy.deepcopy(base)
    inits = {i.name: i for i in out.graph.initializer}
    for t in info.adapters:
        w = numpy_helper.to_array(inits[t.weight])
        delta = _delta(t, values[t.lora_A], values[t.lora_B], info.scale)
        inits[t.weight].CopyFrom(numpy_helper.from_array(
            (w.astype(np.float64) + delta).astype(w.dtype), t.weight))
    for name in info.trainable:
        if name in inits:  # a train_also tensor (A/B are not the base's)
            inits[name].CopyFrom(numpy_helper.from_array(
                values[name].astype(numpy_helper.to_array(inits[name]).dtype), name))
    return out


def adapter_model(base: onnx.ModelProto | str | Path, info: LoraInfo) -> onnx.ModelProto:
    """The base model with the LoRA branches, A and B graph inputs that default to zeros
    (initializers of the same names: onnxruntime feeds an active adapter's tensors in their
    place, and without one the model computes the base output). The ``train_also`` tensors
    (a head) are graph inputs too, defaulting to the base's values, so an adapter file
    carries them as well. Serve it with onnxruntime: ``LoraAdapter.Load(file)``,
    ``RunOptions.add_active_adapter``. No dropout."""
    base = _load(base)
    _check_base(base, info)
    zeros = {}
    for t in info.adapters:
        a_shape, b_shape = _adapter_shapes(t, info.rank)
        zeros[t.lora_A] = np.zeros(a_shape, np.float32)
        zeros[t.lora_B] = np.zeros(b_shape, np.float32)
    serving = copy.copy(info)
    serving.dropout, serving.base_dtype = 0.0, None
    out = _inject(base, serving, zeros, as_inputs=True)
    inits = {i.name: i for i in out.graph.initializer}
    out.graph.input.extend(helper.make_tensor_value_info(n, inits[n].data_type, inits[n].dims)
                           for n in info.trainable if n not in zeros)
    return out


def write_adapter(path: str | Path, trained, info: LoraInfo, model_version: int = 0,
                  adapter_version: int = 0) -> Path:
    """The trained A and B (and ``train_also`` tensors) written as an onnxruntime adapter
    file (``onnxruntime.AdapterFormat``) for ``adapter_model``'s model."""
    import onnxruntime as ort

    values = _values(trained, info.trainable)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(adapter_version)
    fmt.set_model_version(model_version)
    fmt.set_parameters({n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(values[n]))
                        for n in info.trainable})
    path = Path(path)
    fmt.export_adapter(str(path))
    return path


def save_adapters(path: str | Path, trained, info: LoraInfo) -> Path:
    """The trained tensors alone (A, B and the ``train_also`` ones) as ``.npz``, with the
    LoraInfo (settings, names, the base graph's sha256) under ``__lora_config__``."""
    values = _values(trained, info.trainable)
    path = Path(path)
    with open(path, "wb") as f:  # np.savez would add ".npz" to a name without it
        np.savez(f, **{n: values[n] for n in info.trainable},
                 **{CONFIG_KEY: np.array(info.to_json())})
    return path


def load_adapters(path: str | Path) -> tuple[dict[str, np.ndarray], LoraInfo]:
    """What ``save_adapters`` wrote: the tensors by name, and the LoraInfo."""
    with np.load(path, allow_pickle=False) as z:
        info = LoraInfo.from_json(str(z[CONFIG_KEY]))
        return {n: z[n] for n in z.files if n != CONFIG_KEY}, info


def apply_lora(base: onnx.ModelProto | str | Path, adapters
               ) -> tuple[onnx.ModelProto, LoraInfo]:
    """Saved adapters (a ``save_adapters`` file, or its ``(tensors, info)``) put back on a
    fresh copy of the base: the LoRA model with the trained A/B (and ``train_also``
    tensors), to run, train further or ``merge_lora``. Raises if the base is not the
    model the adapters were trained on (its graph's sha256 differs)."""
    base = _load(base)
    values, info = load_adapters(adapters) if isinstance(adapters, (str, Path)) else adapters
    _check_base(base, info)
    out = _inject(base, info, values, as_inputs=False)
    inits = {i.name: i for i in out.graph.initializer}
    for name in info.trainable:
        if name in inits and name not in info.adapter_names():
            inits[name].CopyFrom(numpy_helper.from_array(
                values[name].astype(numpy_helper.to_array(inits[name]).dtype), name))
    return out, info


def parse_lora(text: str) -> dict:
    """``rank=8,alpha=16,dropout=0.05,targets=PATTERN`` (the CLI's ``--lora``) as
    ``add_lora``'s keyword arguments. ``targets`` takes the rest of the text after it (a
    pattern may hold commas: ``targets=q_proj|v_proj``); also ``seed``, ``base_dtype`` and
    ``train_also`` (the same). Errors name the bad key or value."""
    kinds = {"rank": int, "alpha": float, "dropout": float, "seed": int, "base_dtype": str,
             "targets": str, "train_also": str}
    out: dict = {}
    rest = text.strip()
    while rest:
        key, sep, value = rest.partition("=")
        key = key.strip()
        if not sep:
            raise LoraError(f"--lora: {key!r} has no value (expected key=value; keys: "
                            f"{', '.join(kinds)})")
        if key not in kinds:
            raise LoraError(f"--lora: unknown key {key!r}; valid: {', '.join(kinds)}")
        if key in ("targets", "train_also"):  # a regular expression: up to the next key
            m = re.search(rf",\s*(?:{'|'.join(kinds)})=", value)
            value, rest = (value[:m.start()], value[m.start() + 1:]) if m else (value, "")
        else:
            value, _, rest = value.partition(",")
        if key in out:
            raise LoraError(f"--lora: key {key!r} given twice")
        try:
            out[key] = kinds[key](value.strip())
        except ValueError:
            raise LoraError(f"--lora: {key}={value.strip()!r} is not "
                            f"{'an integer' if kinds[key] is int else 'a number'}") from None
        rest = rest.strip()
    if "rank" in out:
        _positive_int("rank", out["rank"])
    if "dropout" in out:
        _ratio(out["dropout"])
    if "base_dtype" in out:
        _base_dtype(out["base_dtype"])
    return out


# ---- finding the weights --------------------------------------------------------------------

def _load(model) -> onnx.ModelProto:
    return load_checked(model)[0]


def _positive_int(what: str, v) -> int:
    if isinstance(v, bool) or int(v) != v or v < 1:
        raise LoraError(f"{what}={v!r}: must be an integer >= 1")
    return int(v)


def _ratio(v) -> float:
    if not 0.0 <= float(v) < 1.0:
        raise LoraError(f"dropout={v!r}: must be in [0, 1)")
    return float(v)


def _base_dtype(v):
    if v is not None and v not in BASE_DTYPES:
        raise LoraError(f"base_dtype={v!r}; valid: None, {', '.join(BASE_DTYPES)}")
    return v


def _targets(targets):
    if targets is None or isinstance(targets, str):
        return targets
    return [str(t) for t in targets]


def _matches(targets, name: str) -> bool:
    if targets is None:
        return True
    if isinstance(targets, str):
        return re.search(targets, name) is not None
    module = name.rsplit(".", 1)[0] if "." in name else name
    return any(module == t or module.endswith("." + t) for t in targets)


def _node_module(node: onnx.NodeProto) -> str | None:
    """A node's module path: the dynamo exporter's name scopes, or the classic exporter's
    node name (``/model/layers.0/self_attn/q_proj/MatMul`` -> ``model.layers.0.self_attn.
    q_proj``)."""
    module = torch_metadata.module_of(node)
    if module:
        return module
    parts = node.name.split("/")
    if node.name.startswith("/") and len(parts) > 2:
        return ".".join(parts[1:-1])
    return None


def _param_name(weight: str, node: onnx.NodeProto, folded: dict[str, list[str]]) -> str:
    if not _AUTO_NAME.match(weight):
        return weight
    sources = folded.get(weight, [])
    if len(sources) == 1 and not _AUTO_NAME.match(sources[0]):
        return sources[0]
    module = _node_module(node)
    return f"{module}.weight" if module else weight


def _eligible(node: onnx.NodeProto, inits) -> tuple[str, int, int] | None:
    """(kind, in, out) when ``node`` reads a float initializer as a LoRA-able weight."""
    if len(node.input) < 2 or node.input[1] not in inits:
        return None
    w = inits[node.input[1]]
    if w.data_type not in FLOAT_TYPES:
        return None
    dims = list(w.dims)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.domain not in ONNX_DOMAINS:
        return None
    if node.op_type == "MatMul" and len(dims) == 2:
        return "matmul", dims[0], dims[1]
    if node.op_type == "Gemm" and len(dims) == 2:
        return ("gemm_t", dims[1], dims[0]) if attrs.get("transB", 0) else \
            ("gemm", dims[0], dims[1])
    if node.op_type == "Conv" and len(dims) == 4 and dims[2:] == [1, 1] \
            and attrs.get("group", 1) == 1:
        return "conv", dims[1], dims[0]
    return None


def _candidate_names(model: onnx.ModelProto) -> set[str]:
    inits = {i.name: i for i in model.graph.initializer}
    folded = torch_metadata.folded_from(model)
    return {_param_name(n.input[1], n, folded) for n in model.graph.node
            if _eligible(n, inits)}


def _find_targets(model: onnx.ModelProto, info: LoraInfo
                  ) -> tuple[list[LoraTarget], dict[str, str]]:
    inits = {i.name: i for i in model.graph.initializer}
    folded = torch_metadata.folded_from(model)
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node, nested in _all_nodes(model.graph):
        for i, x in enumerate(node.input):
            if x in inits:  # a branch goes beside top-level nodes only: -1 marks the others
                readers.setdefault(x, []).append((node, -1 if nested else i))
    found, skipped, names = [], {}, set()
    for weight, uses in readers.items():
        adaptable = [n for n, i in uses if i == 1 and _eligible(n, inits)]
        if not adaptable:
            continue
        first = adaptable[0]
        shape = _eligible(first, inits)
        name = _param_name(weight, first, folded)
        if not _matches(info.targets, name):
            continue
        if any(i != 1 or _eligible(n, inits) != shape for n, i in uses):
            skipped[weight] = (f"{name}: also read by {[n.op_type + ' ' + n.name for n, i in uses]}"
                               "; an adapter folded into it would change those too")
            continue
        if name in names or f"{name}.lora_A" in inits:
            name = weight  # two weights came from one parameter: the initializer names them
        names.add(name)
        kind, n_in, n_out = shape
        found.append(LoraTarget(weight, name, f"{name}.lora_A", f"{name}.lora_B", kind, n_in,
                                n_out, tuple(n.name for n, _ in uses)))
    return found, skipped


def _all_nodes(graph: onnx.GraphProto, nested: bool = False):
    """(node, whether it is inside a subgraph) of every node."""
    for node in graph.node:
        yield node, nested
        for a in node.attribute:  # a subgraph reading the weight keeps it from an adapter
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from _all_nodes(g, True)


def _also_trained(model: onnx.ModelProto, info: LoraInfo) -> list[str]:
    if not info.train_also:
        return []
    adapted = {t.weight for t in info.adapters}
    folded = torch_metadata.folded_from(model)
    out = []
    for init in model.graph.initializer:
        if init.data_type not in FLOAT_TYPES or init.name in adapted:
            continue
        names = [init.name, *folded.get(init.name, [])]
        if any(re.search(info.train_also, n) for n in names):
            out.append(init.name)
    return out


def _adapter_shapes(t: LoraTarget, rank: int) -> tuple[tuple, tuple]:
    if t.kind == "conv":
        return (rank, t.in_features, 1, 1), (t.out_features, rank, 1, 1)
    return (rank, t.in_features), (t.out_features, rank)


def _delta(t: LoraTarget, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """``scale * B A`` laid out as the base weight."""
    ba = scale * (b.reshape(t.out_features, -1).astype(np.float64)
                  @ a.reshape(-1, t.in_features).astype(np.float64))  # [out, in]
    if t.kind == "conv":
        return ba[:, :, None, None]
    return ba if t.kind == "gemm_t" else ba.T


def _values(trained, names) -> dict[str, np.ndarray]:
    if isinstance(trained, onnx.ModelProto):
        trained = {i.name: numpy_helper.to_array(i) for i in trained.graph.initializer}
    elif not isinstance(trained, Mapping):  # a TrainingSession
        trained = trained.parameters()
    missing = [n for n in names if n not in trained]
    if missing:
        raise LoraError(f"the trained tensors lack {missing}")
    return {n: np.asarray(trained[n]) for n in names}


def _check_base(base: onnx.ModelProto, info: LoraInfo) -> None:
    found = base_hash(base)
    if found != info.base_sha256:
        raise LoraError(f"the adapters were trained on a base model whose graph has sha256 "
                        f"{info.base_sha256}; this one has {found}")


# ---- rewriting the graph --------------------------------------------------------------------

def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 1)


def _inject(base: onnx.ModelProto, info: LoraInfo, values: Mapping[str, np.ndarray],
            as_inputs: bool) -> onnx.ModelProto:
    """A copy of ``base`` with a branch per adapted weight and use, A/B set to ``values``
    (graph inputs with those as defaults when ``as_inputs``)."""
    out = copy.deepcopy(base)
    g = out.graph
    opset = _opset(out)
    inits = {i.name: i for i in g.initializer}
    by_weight = {t.weight: t for t in info.adapters}
    missing = [t.weight for t in info.adapters if t.weight not in inits]
    if missing:
        raise LoraError(f"the model has no initializers {missing} to adapt")
    new_inits, new_inputs = [], []
    scale_name = _unique_name(g, "lora.scale")
    new_inits.append(numpy_helper.from_array(np.array(info.scale, np.float32), scale_name))
    ratio_name = None
    if info.dropout > 0 and opset >= 12:
        ratio_name = _unique_name(g, "lora.dropout_ratio")
        new_inits.append(numpy_helper.from_array(np.array(info.dropout, np.float32), ratio_name))
    for t in info.adapters:
        for name in (t.lora_A, t.lora_B):
            if name in inits:
                raise LoraError(f"{name}: the model already has an initializer of that name")
            new_inits.append(numpy_helper.from_array(
                np.ascontiguousarray(values[name], np.float32), name))
            if as_inputs:
                new_inputs.append(helper.make_tensor_value_info(
                    name, onnx.TensorProto.FLOAT, list(values[name].shape)))
    nodes, uses = [], dict.fromkeys(by_weight, 0)
    for node in g.node:
        nodes.append(node)
        t = by_weight.get(node.input[1]) if len(node.input) > 1 else None
        if t is None:
            continue
        suffix = "" if len(t.nodes) == 1 else f"_{uses[t.weight]}"
        uses[t.weight] += 1
        branch, consts = _branch(node, t, f"{t.name}.lora{suffix}", scale_name, ratio_name,
                                 info.dropout)
        nodes += branch
        new_inits += consts
    g.ClearField("node")
    g.node.extend(nodes)
    if info.base_dtype is not None:
        for t in info.adapters:
            _hold_in(g, inits[t.weight], BASE_DTYPES[info.base_dtype])
    g.initializer.extend(new_inits)
    g.input.extend(new_inputs)
    if as_inputs and out.ir_version < 4:
        out.ir_version = 4  # initializers as input defaults
    return out


def _unique_name(g: onnx.GraphProto, stem: str) -> str:
    used = {i.name for i in g.initializer} | {x for n in g.node for x in [*n.input, *n.output]}
    name, k = stem, 0
    while name in used:
        k += 1
        name = f"{stem}_{k}"
    return name


def _hold_in(g: onnx.GraphProto, init: onnx.TensorProto, to: int) -> None:
    """Store a frozen weight in a half type and cast it back to float where it is read."""
    w = numpy_helper.to_array(init)
    half = helper.tensor_dtype_to_np_dtype(to)
    init.CopyFrom(numpy_helper.from_array(w.astype(half), init.name))
    cast = f"{init.name}.float"
    for node in g.node:
        for i, x in enumerate(node.input):
            if x == init.name:
                node.input[i] = cast
    g.node.insert(0, helper.make_node("Cast", [init.name], [cast], name=f"{init.name}.cast",
                                      to=helper.np_dtype_to_tensor_dtype(w.dtype)))


def _branch(node: onnx.NodeProto, t: LoraTarget, prefix: str, scale_name: str,
            ratio_name: str | None, dropout: float
            ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes (and constants) that make ``node``'s output ``base + scale * B(A(x))``;
    ``node`` now writes ``base``."""
    y = node.output[0]
    base_y = f"{prefix}/base"
    node.output[0] = base_y
    nodes, consts = [], []
    x = node.input[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if t.kind in ("gemm", "gemm_t") and attrs.get("transA", 0):
        nodes.append(helper.make_node("Transpose", [x], [f"{prefix}/x_t"], f"{prefix}/x_t"))
        x = f"{prefix}/x_t"
    if dropout > 0:
        ins = [x, ratio_name] if ratio_name else [x]
        extra = {} if ratio_name else {"ratio": dropout}
        nodes.append(helper.make_node("Dropout", ins, [f"{prefix}/x_drop"],
                                      f"{prefix}/dropout", **extra))
        x = f"{prefix}/x_drop"
    if t.kind == "conv":
        conv = {k: v for k, v in attrs.items() if k in ("strides", "pads", "dilations",
                                                           "auto_pad")}
        nodes += [helper.make_node("Conv", [x, t.lora_A], [f"{prefix}/a"], f"{prefix}/A",
                                   **conv),
                  helper.make_node("Conv", [f"{prefix}/a", t.lora_B], [f"{prefix}/b"],
                                   f"{prefix}/B")]
    else:
        nodes += [helper.make_node("Transpose", [t.lora_A], [f"{prefix}/A_t"], f"{prefix}/A_t",
                                   perm=[1, 0]),
                  helper.make_node("Transpose", [t.lora_B], [f"{prefix}/B_t"], f"{prefix}/B_t",
                                   perm=[1, 0]),
                  helper.make_node("MatMul", [x, f"{prefix}/A_t"], [f"{prefix}/a"],
                                   f"{prefix}/A"),
                  helper.make_node("MatMul", [f"{prefix}/a", f"{prefix}/B_t"], [f"{prefix}/b"],
                                   f"{prefix}/B")]
        gemm_alpha = float(attrs.get("alpha", 1.0)) if t.kind != "matmul" else 1.0
        if gemm_alpha != 1.0:  # Gemm scales its product: so does the branch, as merged
            consts.append(numpy_helper.from_array(np.array(gemm_alpha, np.float32),
                                                  f"{prefix}/gemm_alpha"))
            nodes.append(helper.make_node("Mul", [f"{prefix}/b", f"{prefix}/gemm_alpha"],
                                          [f"{prefix}/b_alpha"], f"{prefix}/alpha"))
    nodes += [helper.make_node("Mul", [nodes[-1].output[0], scale_name], [f"{prefix}/scaled"],
                               f"{prefix}/scale"),
              helper.make_node("Add", [base_y, f"{prefix}/scaled"], [y], f"{prefix}/add")]
    return nodes, consts
