"""The fuzzer's cases: ``make_case(seed, index)`` is a pure function of its two arguments.

A case is files (written into a folder of its own, the model's folder: ``model/``) and an
action the worker's child runs on them:

- ``session``: import ``model/model.onnx`` with ``tr_onnx.InferenceSession`` and run one
  batch; ``oracle`` says the outputs must equal the references where both references run the
  model and agree (``onnx.reference`` and onnxruntime, run first in a child of their own).
- ``train``: ``tr-onnx train model/model.onnx --data DATA`` for one epoch.

``canary.bin`` lies next to ``model/``, outside it: a case reading it is a file escape.
"""

from __future__ import annotations

import io
import random
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import fuzz_models
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "model_zoo"
GENERATORS = ("zoo_structure", "zoo_bytes", "random_graph", "bad_data")
CANARY = "canary.bin"  # beside the model's folder: no case may read it
MODEL = "model/model.onnx"


@dataclass
class Case:
    """One case: its generator, a line saying what it is (``subject``: the op or mutation
    kind, part of a bug's signature), its files (relative path -> bytes), the action and its
    arguments."""

    generator: str
    index: int
    subject: str
    description: str
    files: dict[str, bytes] = field(default_factory=dict)
    action: str = "session"
    oracle: bool = False
    data: str = ""  # the --data path of a train action, relative to the case folder


def make_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: the generators take turns, each drawing from its own
    ``random.Random``."""
    # the turn rotates every round of four: the workers take every k-th case, and no worker
    # may draw only some generators
    generator = GENERATORS[(index + index // len(GENERATORS)) % len(GENERATORS)]
    rng = random.Random(f"{seed}:{index}:{generator}")
    case = {"zoo_structure": _zoo_structure, "zoo_bytes": _zoo_bytes,
            "random_graph": _random_graph, "bad_data": _bad_data}[generator](rng)
    case.index = index
    case.files.setdefault(CANARY, bytes(4096))
    return case


# ---- (a) structure-aware and (b) byte-level mutations of the zoo ------------------------------


def _zoo_structure(rng: random.Random) -> Case:
    if rng.random() < 0.25:
        return _external_data(rng)
    for attempt in range(1000):  # fuzz_models' cases mix both kinds: take a structured one
        case = fuzz_models.make_case(rng.randrange(2 ** 31), attempt)
        if case.kind == "proto":
            break
    mutant = case.mutant if isinstance(case.mutant, bytes) else case.mutant.SerializeToString()
    kinds = sorted({m.split(":")[-1].split()[0] if ":" in m else m.split()[0]
                    for m in case.mutations})
    return Case("zoo_structure", 0, f"{case.model}:{'+'.join(kinds)}",
                f"{case.model}: {'; '.join(case.mutations)}", {MODEL: mutant},
                oracle=case.oracle)


def _zoo_bytes(rng: random.Random) -> Case:
    name = rng.choice(fuzz_models.MODELS)
    data = (ZOO / name).read_bytes()
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        mutate = rng.choice(fuzz_models.BYTE_MUTATIONS)
        data, what = mutate(rng, data) if data else (data, "empty")
        done.append(what)
    return Case("zoo_bytes", 0, name, f"{name}: {'; '.join(done)}", {MODEL: data})


_LOCATIONS = ["weights.bin", "../canary.bin", "sub/../../canary.bin", "{abs_canary}",
              "/etc/hostname", "/proc/self/environ", "link.bin", "", ".", "weights.bin\0x",
              "../model/weights.bin", "nested/weights.bin"]


def _external_data(rng: random.Random) -> Case:
    """A zoo model whose largest initializer is stored in a file: in the folder, or pointing
    out of it (a relative path up, an absolute path, a symlink), with odd offsets/lengths."""
    name = rng.choice(["mlp.onnx", "lenet.onnx"])
    m = onnx.load(ZOO / name)
    t = max(m.graph.initializer, key=lambda x: len(x.raw_data) or x.ByteSize())
    raw = numpy_helper.to_array(t).tobytes()
    t.ClearField("raw_data")
    del t.float_data[:]
    t.data_location = TensorProto.EXTERNAL
    location = rng.choice(_LOCATIONS)
    t.external_data.add(key="location", value=location)
    offset = rng.choice([None, 0, 7, len(raw), 2 ** 40, -1])
    length = rng.choice([None, len(raw), 4, 0, 2 ** 40, -5])
    if offset is not None:
        t.external_data.add(key="offset", value=str(offset))
    if length is not None:
        t.external_data.add(key="length", value=str(length))
    files = {MODEL: m.SerializeToString(), "model/weights.bin": raw,
             "model/nested/weights.bin": raw}
    what = f"{name}: {t.name!r} external at {location!r}, offset {offset}, length {length}"
    if location == "link.bin":  # a symlink in the folder pointing out of it
        files["model/link.bin"] = b"symlink:../canary.bin"
    return Case("zoo_structure", 0, f"{name}:external", what, files)


# ---- (c) random small graphs of registered ops ------------------------------------------------

OPSET = 17


def _f(rng, shape, low=-2.0, high=2.0):
    return np.asarray(np.random.default_rng(rng.randrange(2 ** 32)).uniform(
        low, high, shape), np.float32)


def _shape(rng, rank_low=1, rank_high=4):
    return [rng.randint(1, 4) for _ in range(rng.randint(rank_low, rank_high))]


def _unary(op, low=-2.0, high=2.0, **choices):
    def build(rng):
        shape = _shape(rng)
        return [("x", _f(rng, shape, low, high))], [], _pick(rng, choices)
    return op, build


def _pick(rng, choices: dict) -> dict:
    """Each attribute in ``choices`` set to one of its values, or left to its default."""
    return {k: rng.choice(v) for k, v in choices.items() if rng.random() < 0.7}


def _binary(op, low=-2.0, high=2.0):
    def build(rng):
        shape = _shape(rng)
        other = shape[rng.randrange(len(shape)):] if rng.random() < 0.5 else shape
        if rng.random() < 0.3:
            other = [1 if rng.random() < 0.5 else d for d in other]
        return [("a", _f(rng, shape, low, high)), ("b", _f(rng, other, low, high))], [], {}
    return op, build


def _axis_op(op, extra=None, const_inputs=None):
    def build(rng):
        shape = _shape(rng)
        attrs = {"axis": rng.randint(-len(shape), len(shape) - 1 + (rng.random() < 0.1))}
        attrs.update(_pick(rng, extra or {}))
        consts = const_inputs(rng, shape) if const_inputs else []
        return [("x", _f(rng, shape))], consts, attrs
    return op, build


def _reduce(op, low=-2.0, high=2.0):
    def build(rng):
        shape = _shape(rng)
        attrs = _pick(rng, {"keepdims": [0, 1]})
        axes = sorted(rng.sample(range(-len(shape), len(shape)), rng.randint(0, len(shape))))
        if axes and {a % len(shape) for a in axes}.__len__() == len(axes):
            attrs["axes"] = axes
        return [("x", _f(rng, shape, low, high))], [], attrs
    return op, build


def _spatial(op, channels_match=False):
    def build(rng):
        n, c = rng.randint(1, 2), rng.randint(1, 3)
        spatial = [rng.randint(1, 6) for _ in range(rng.choice([1, 2, 2, 3]))]
        k = [rng.randint(1, 3) for _ in spatial]
        attrs = {"kernel_shape": k}
        attrs.update(_pick(rng, {"strides": [[rng.randint(1, 3) for _ in spatial]],
                                 "pads": [[rng.randint(0, 2) for _ in spatial * 2]],
                                 "dilations": [[rng.randint(1, 2) for _ in spatial]],
                                 "auto_pad": ["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"],
                                 "ceil_mode": [0, 1]}))
        if attrs.get("auto_pad", "NOTSET") != "NOTSET":
            attrs.pop("pads", None)
        if op == "AveragePool":
            attrs.update(_pick(rng, {"count_include_pad": [0, 1]}))
            attrs.pop("dilations", None)
        if op == "Conv":
            attrs.pop("ceil_mode", None)
            group = rng.choice([1, 1, c])
            m = group * rng.randint(1, 2)
            attrs["group"] = group
            w = _f(rng, [m, c // group, *k])
            consts = [("w", w)] + ([("b", _f(rng, [m]))] if rng.random() < 0.5 else [])
            return [("x", _f(rng, [n, c, *spatial]))], consts, attrs
        return [("x", _f(rng, [n, c, *spatial]))], [], attrs
    return op, build


def _recurrent(op):
    def build(rng):
        t, n, i, h = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)
        direction = rng.choice(["forward", "reverse", "bidirectional"])
        d = 2 if direction == "bidirectional" else 1
        g = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
        consts = [("W", _f(rng, [d, g * h, i])), ("R", _f(rng, [d, g * h, h]))]
        if rng.random() < 0.5:
            consts.append(("B", _f(rng, [d, 2 * g * h])))
        attrs = {"hidden_size": h, "direction": direction}
        attrs.update(_pick(rng, {"layout": [0, 1], "clip": [0.5, 3.0]}))
        if op == "GRU":
            attrs.update(_pick(rng, {"linear_before_reset": [0, 1]}))
        x = [t, n, i] if attrs.get("layout", 0) == 0 else [n, t, i]
        return [("x", _f(rng, x))], consts, attrs
    return op, build


def _transpose(rng):
    shape = _shape(rng)
    return [("x", _f(rng, shape))], [], ({"perm": rng.sample(range(len(shape)), len(shape))}
                                         if rng.random() < 0.8 else {})


def _gemm(rng):
    m, k, n = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
    attrs = _pick(rng, {"transA": [0, 1], "transB": [0, 1], "alpha": [0.5, 2.0],
                        "beta": [0.0, 1.5]})
    a = [k, m] if attrs.get("transA") else [m, k]
    b = [n, k] if attrs.get("transB") else [k, n]
    consts = [("c", _f(rng, rng.choice([[n], [m, n], [1, n], [m, 1]])))] \
        if rng.random() < 0.6 else []
    return [("a", _f(rng, a)), ("b", _f(rng, b))], consts, attrs


def _matmul(rng):
    batch = _shape(rng, 0, 2)
    m, k, n = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
    return [("a", _f(rng, [*batch, m, k])), ("b", _f(rng, [k, n]))], [], {}


def _slice_inputs(rng, shape):
    axes = rng.sample(range(len(shape)), rng.randint(1, len(shape)))
    starts = [rng.randint(-4, 4) for _ in axes]
    ends = [rng.choice([rng.randint(-4, 4), 2 ** 62, -2 ** 62]) for _ in axes]
    steps = [rng.choice([1, 1, 2, -1, -2]) for _ in axes]
    return [("starts", np.array(starts, np.int64)), ("ends", np.array(ends, np.int64)),
            ("axes", np.array(axes, np.int64)), ("steps", np.array(steps, np.int64))]


def _slice(rng):
    shape = _shape(rng)
    return [("x", _f(rng, shape))], _slice_inputs(rng, shape), {}


def _gather(rng):
    shape = _shape(rng)
    axis = rng.randrange(len(shape))
    idx = np.array([rng.randint(-shape[axis], shape[axis] - 1)
                    for _ in range(rng.randint(1, 4))], np.int64)
    return [("x", _f(rng, shape))], [("i", idx.reshape(rng.choice([[-1], [1, -1]])))], \
        {"axis": axis}


def _pad(rng):
    shape = _shape(rng)
    pads = [rng.randint(0, 2) for _ in shape * 2]
    mode = rng.choice(["constant", "reflect", "edge"])
    if mode == "reflect":
        pads = [min(p, d - 1) for p, d in zip(pads, shape * 2)]
    return [("x", _f(rng, shape))], [("pads", np.array(pads, np.int64))], {"mode": mode}


def _clip(rng):
    shape = _shape(rng)
    lo, hi = sorted([rng.uniform(-1, 1), rng.uniform(-1, 1)])
    return [("x", _f(rng, shape))], [("lo", np.array(lo, np.float32)),
                                     ("hi", np.array(hi, np.float32))], {}


def _norm(op):
    def build(rng):
        n, c = rng.randint(1, 3), rng.randint(1, 4)
        spatial = [rng.randint(1, 4) for _ in range(rng.randint(0, 2))]
        x = [("x", _f(rng, [n, c, *spatial]))]
        if op == "BatchNormalization":
            return x, [("s", _f(rng, [c])), ("b", _f(rng, [c])), ("m", _f(rng, [c])),
                       ("v", _f(rng, [c], 0.1, 2.0))], _pick(rng, {"epsilon": [1e-5, 0.1]})
        if op == "InstanceNormalization":
            return x, [("s", _f(rng, [c])), ("b", _f(rng, [c]))], {}
        if op == "LRN":
            return x, [], {"size": rng.choice([1, 3, 5]), **_pick(
                rng, {"alpha": [1e-4, 0.5], "beta": [0.75, 1.0], "bias": [1.0, 2.0]})}
        axis = rng.randint(-1, 1 + len(spatial))
        width = [n, c, *spatial][axis:]
        return x, [("s", _f(rng, width)), ("b", _f(rng, width))], \
            {"axis": axis, **_pick(rng, {"stash_type": [1, 1, 1, 0, 11]})}
    return op, build


def _topk(rng):
    shape = _shape(rng)
    axis = rng.randrange(len(shape))
    return [("x", _f(rng, shape))], [("k", np.array([rng.randint(1, shape[axis])],
                                                      np.int64))], \
        {"axis": axis, **_pick(rng, {"largest": [0, 1], "sorted": [1]})}


def _space(op):
    def build(rng):
        b = rng.randint(1, 3)
        c = rng.randint(1, 2) * (b * b if op == "DepthToSpace" else 1)
        h, w = (rng.randint(1, 3) * (b if op == "SpaceToDepth" else 1) for _ in range(2))
        attrs = {"blocksize": b}
        if op == "DepthToSpace":
            attrs.update(_pick(rng, {"mode": ["DCR", "CRD"]}))
        return [("x", _f(rng, [rng.randint(1, 2), c, h, w]))], [], attrs
    return op, build


def _cumsum(rng):
    shape = _shape(rng)
    return [("x", _f(rng, shape))], [("axis", np.array(rng.randrange(len(shape)), np.int64))], \
        _pick(rng, {"exclusive": [0, 1], "reverse": [0, 1]})


def _nll(rng):
    n, c = rng.randint(1, 4), rng.randint(1, 4)
    extra = _shape(rng, 0, 1)
    target = np.array([rng.randint(-2, c - 1) for _ in range(n * int(np.prod(extra)))],
                      np.int64).reshape([n, *extra])
    attrs = _pick(rng, {"reduction": ["none", "sum", "mean"], "ignore_index": [-1, 0]})
    return [("x", _f(rng, [n, c, *extra]))], [("t", target)], attrs


def _dequantize(rng):
    shape = _shape(rng)
    axis = rng.randint(-len(shape) - 1, len(shape))
    width = shape[axis] if -len(shape) <= axis < len(shape) else 3
    q = np.random.default_rng(rng.randrange(2 ** 32)).integers(-8, 8, shape).astype(np.int8)
    return [], [("q", q), ("s", _f(rng, [width] if rng.random() < 0.5 else [], 0.1, 1.0))], \
        {"axis": axis}


_OPS = dict([
    _unary("Relu"), _unary("Sigmoid"), _unary("Tanh"), _unary("Abs"), _unary("Neg"),
    _unary("Exp"), _unary("Softplus"), _unary("Softsign"), _unary("Erf"), _unary("Sin"),
    _unary("Cos"), _unary("Floor"), _unary("Ceil"), _unary("Sign"), _unary("Identity"),
    _unary("Reciprocal", 0.5, 2.0), _unary("Sqrt", 0.1, 2.0), _unary("Log", 0.1, 2.0),
    _unary("Elu", alpha=[0.5, 1.0, 2.0]), _unary("LeakyRelu", alpha=[0.01, 0.3]),
    _unary("Selu", alpha=[1.5], gamma=[1.1]), _unary("HardSigmoid", alpha=[0.2, 0.5],
                                                     beta=[0.5, 0.1]),
    _unary("HardSwish"), _unary("ThresholdedRelu", alpha=[0.5, 1.0]),
    _axis_op("Softmax"), _axis_op("LogSoftmax"), _axis_op("Hardmax"),
    _axis_op("Flatten"), _axis_op("ArgMax", {"keepdims": [0, 1], "select_last_index": [0, 1]}),
    _axis_op("ArgMin", {"keepdims": [0, 1]}),
    _binary("Add"), _binary("Sub"), _binary("Mul"), _binary("Div", 0.5, 2.0),
    _binary("Max"), _binary("Min"), _binary("Pow", 0.5, 1.5), _binary("PRelu"),
    _reduce("ReduceMean"), _reduce("ReduceMax"), _reduce("ReduceMin"), _reduce("ReduceProd"),
    _reduce("ReduceL1"), _reduce("ReduceL2"), _reduce("ReduceLogSumExp"),
    _reduce("ReduceSumSquare"),
    _spatial("Conv"), _spatial("MaxPool"), _spatial("AveragePool"),
    ("GlobalAveragePool", lambda rng: ([("x", _f(rng, [1, 2, *_shape(rng, 1, 2)]))], [], {})),
    ("GlobalMaxPool", lambda rng: ([("x", _f(rng, [2, 1, *_shape(rng, 1, 2)]))], [], {})),
    _recurrent("LSTM"), _recurrent("GRU"), _recurrent("RNN"),
    ("Transpose", _transpose), ("Gemm", _gemm), ("MatMul", _matmul), ("Slice", _slice),
    ("Gather", _gather), ("Pad", _pad), ("Clip", _clip), ("TopK", _topk),
    ("CumSum", _cumsum), ("NegativeLogLikelihoodLoss", _nll),
    ("DequantizeLinear", _dequantize),
    _norm("BatchNormalization"), _norm("InstanceNormalization"), _norm("LRN"),
    _norm("LayerNormalization"), _space("DepthToSpace"), _space("SpaceToDepth"),
])


def _loop_graph(rng: random.Random):
    """A Loop carrying h through h = f(h * w + x): a while loop (a trip count of 2**31 - 1, a
    condition the body computes from the data, capped by an iteration count), or a counted
    one (its trip count from 0 to 300, the condition passed through)."""
    shape = _shape(rng, 1, 3)
    x, w = _f(rng, shape), _f(rng, shape, -1.5, 1.5)
    f = rng.choice(["Tanh", "Sigmoid", "Relu", "Neg", "Softsign"])
    body = [helper.make_node("Mul", ["h", "w"], ["hw"]), helper.make_node("Add", ["hw", "x"],
                                                                          ["pre"]),
            helper.make_node(f, ["pre"], ["h_next"])]
    if rng.random() < 0.5:
        kind, trip = "while", 2 ** 31 - 1
        body += [helper.make_node("ReduceSumSquare", ["h_next"], ["energy"], keepdims=0),
                 helper.make_node("Greater", ["energy", "threshold"], ["busy"]),
                 helper.make_node("Less", ["i", "cap"], ["under_cap"]),
                 helper.make_node("And", ["busy", "under_cap"], ["c_next"])]
        cond_out = "c_next"
    else:
        kind, trip, cond_out = "counted", rng.randrange(0, 301), "c"
    consts = [numpy_helper.from_array(np.array(rng.uniform(0.01, 2.0), np.float32),
                                      "threshold"),
              numpy_helper.from_array(np.array(rng.randrange(0, 20), np.int64), "cap")]
    graph = helper.make_graph(body, "body", [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        helper.make_tensor_value_info("h", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_next", TensorProto.FLOAT, shape)],
        consts if kind == "while" else [])
    nodes = [helper.make_node("Loop", ["M", "go", "x"], ["y0"], body=graph)]
    inits = [numpy_helper.from_array(np.array(trip, np.int64), "M"),
             numpy_helper.from_array(np.array(True), "go"), numpy_helper.from_array(w, "w")]
    return nodes, [("x", x)], inits, f"{kind} Loop of {f}, trip {trip}"


def _random_graph(rng: random.Random) -> Case:
    """One op with random inputs and attributes, sometimes followed by a unary op; its inputs
    are graph inputs (fed), its other operands initializers. One case in twelve is a Loop
    (``_loop_graph``)."""
    if rng.random() < 1 / 12:
        nodes, fed, inits, what = _loop_graph(rng)
        return _oracle_case("Loop", what, nodes, fed, inits, ["y0"],
                            {"y0": list(fed[0][1].shape)})  # ONNX infers no carried shape
    op = rng.choice(sorted(_OPS))
    fed, consts, attrs = _OPS[op](rng)
    out_count = {"TopK": 2, "LSTM": 3, "GRU": 2, "RNN": 2}.get(op, 1)
    outs = [f"y{k}" for k in range(out_count)]
    inputs = [n for n, _ in fed] + [n for n, _ in consts]
    if op in ("LSTM", "GRU", "RNN") and "B" not in inputs:
        inputs.append("")
    nodes = [helper.make_node(op, inputs, outs, **attrs)]
    if rng.random() < 0.3:
        tail = rng.choice(["Relu", "Tanh", "Abs", "Neg"])
        nodes.append(helper.make_node(tail, ["y0"], ["z"]))
        outs = ["z", *outs[1:]]
    return _oracle_case(op, f"{op} {attrs} on {[list(v.shape) for _, v in fed]}", nodes, fed,
                        [numpy_helper.from_array(v, n) for n, v in consts], outs)


def _oracle_case(op: str, description: str, nodes, fed, inits, outs, shapes=None) -> Case:
    """A graph of ``nodes`` whose fed inputs are float tensors, checked against the
    references (``runner``), at the default channel alignment and with channels padded.
    ``shapes``: float outputs declared with these shapes (else inferred)."""
    shapes = shapes or {}
    graph = helper.make_graph(
        nodes, "fuzz",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in fed],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) if o in shapes else
         helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for o in model.graph.output:  # the inferred types, so that the model is complete
            found = {v.name: v for v in model.graph.value_info}
            if o.name in found:
                o.CopyFrom(found[o.name])
    except Exception:  # an invalid combination: the model as generated, a refusal expected
        pass
    feed = io.BytesIO()
    np.savez(feed, **dict(fed))
    return Case("random_graph", 0, op, description,
                {MODEL: model.SerializeToString(), "feed.npz": feed.getvalue()}, oracle=True)


# ---- (d) bad training data ---------------------------------------------------------------


def _npy(a) -> bytes:
    out = io.BytesIO()
    np.save(out, a, allow_pickle=True)
    return out.getvalue()


def _npz(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


def _header(shape, descr="<f4", extra=b"") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False,
                                               "shape": tuple(shape)})
    return out.getvalue() + extra


def _bad_data(rng: random.Random) -> Case:
    n = rng.choice([0, 1, 5, 16])
    npr = np.random.default_rng(rng.randrange(2 ** 32))
    x = npr.standard_normal((n, 64)).astype(np.float32)
    y = npr.integers(0, 10, n)
    kind = rng.choice(["npz_ok", "npz_truncated", "npz_flipped", "npz_dtype", "npz_huge_header",
                       "npz_shape", "npz_empty", "npz_bare_npy", "npz_object", "npz_labels",
                       "npz_member_short", "npy_folder", "npy_folder_huge", "csv", "csv_empty",
                       "csv_garbage", "csv_ragged", "npz_nan"])
    members = {"input.npy": _npy(x), "labels.npy": _npy(y)}
    name = "data.npz"
    if kind == "npz_truncated":
        data = _npz(members)
        data = data[:rng.randrange(len(data))]
    elif kind == "npz_flipped":
        data = bytearray(_npz(members))
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        data = bytes(data)
    elif kind == "npz_dtype":
        dtype = rng.choice([np.int8, np.complex64, np.float16, np.uint64, "U3", np.bool_,
                            "datetime64[s]", [("a", "f4"), ("b", "i4")]])
        members["input.npy"] = _npy(np.zeros((n, 64), dtype))
        data = _npz(members)
    elif kind == "npz_huge_header":
        shape = rng.choice([(2 ** 40,), (2 ** 20, 2 ** 20), (n, 2 ** 40), (2 ** 62, 64)])
        members[rng.choice(["input.npy", "labels.npy"])] = _header(shape, extra=bytes(64))
        data = _npz(members)
    elif kind == "npz_member_short":
        members["input.npy"] = _npy(x)[:-rng.randint(1, 64)] if n else _header((3, 64))
        data = _npz(members)
    elif kind == "npz_shape":
        members["input.npy"] = _npy(npr.standard_normal(rng.choice([(n, 63), (n,), (n, 8, 8),
                                                                    ()])).astype(np.float32))
        data = _npz(members)
    elif kind == "npz_empty":
        data = b""
    elif kind == "npz_bare_npy":
        data = _npy(x)
    elif kind == "npz_object":
        members["labels.npy"] = _npy(np.array([{"a": 1}] * max(n, 1), object))
        data = _npz(members)
    elif kind == "npz_labels":
        members["labels.npy"] = _npy(rng.choice([y.astype(np.float32), y - 20, y + 2 ** 40,
                                                 y.reshape(-1, 1), np.zeros(n + 1, np.int64)]))
        data = _npz(members)
    elif kind == "npz_nan":
        x[:, 0] = np.nan
        members["input.npy"] = _npy(x)
        data = _npz(members)
    elif kind.startswith("npy_folder"):
        files = {"data/input.npy": _npy(x), "data/labels.npy": _npy(y)}
        if kind == "npy_folder_huge":
            files[f"data/{rng.choice(['input', 'labels'])}.npy"] = _header(
                rng.choice([(2 ** 40, 64), (n, 2 ** 30)]), extra=bytes(64))
        elif rng.random() < 0.5:
            files["data/input.npy"] = files["data/input.npy"][:rng.randint(0, 200)]
        return _train_case(kind, files, "data")
    elif kind.startswith("csv"):
        rows = ["," .join([f"f{k}" for k in range(64)] + ["label"])]
        rows += [",".join([f"{v:.3f}" for v in x[i]] + [str(y[i])]) for i in range(n)]
        if kind == "csv_empty":
            rows = rng.choice([[], [""], rows[:1]])
        elif kind == "csv_garbage":
            rows = [rows[0]] + [",".join(rng.choice(["x", "1e400", "nan", "", "\x00", "1,2"])
                                         for _ in range(65)) for _ in range(max(n, 1))]
        elif kind == "csv_ragged":
            rows = [rows[0]] + [r[:rng.randrange(len(r) + 1)] for r in rows[1:]]
        return _train_case(kind, {"data.csv": "\n".join(rows).encode()}, "data.csv")
    else:
        data = _npz(members)
    return _train_case(kind, {name: data}, name)


def _train_case(kind: str, files: dict, data: str) -> Case:
    files = {MODEL: (ZOO / "mlp.onnx").read_bytes(), **files}
    return Case("bad_data", 0, kind, f"mlp.onnx trained on {kind} ({data})", files,
                action="train", data=data)
