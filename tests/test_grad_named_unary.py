"""The named backward ops of tr_onnx/ops/unary.py (``ai.tr_onnx.<Op>Grad``, table
``UNARY_GRADS``): one node each for the gradients of Relu, Sigmoid, Tanh, Gelu, Clip...

1. Each kernel, and each op's gradient through ``vjp``, equals bit for bit, in float32 and
   float64, the chain of standard ops the rule emitted before (written out below as ONNX
   nodes and run by our own kernels), on a grid with 0, -0, the kinks, negatives, tails, inf
   and NaN.
2. It equals PyTorch autograd in float64 on values including 0, negatives and the kinks where
   both sides define the same one-sided derivative.
3. The rule emits one ``<Op>Grad`` node reading (gy, x, y) as the table says.
4. Channels-last with padded channels equals the plain layout, padded lanes stay zero.
5. At a padded lane (gy = x = y = 0) every formula gives 0 except SqrtGrad's (0 * 0.5 / 0): a
   backend whose kernel runs over padded lanes must re-zero them after SqrtGrad.

These are the NumPy kernels: float32 Gelu and GeluGrad run through oneDNN where it is installed
(not bit for bit the chain; tests/test_gelu_fusion.py checks them against float64 and torch),
so here they are switched off.
"""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

import tr_onnx
from tr_onnx import ir
from tr_onnx.compiler import compile_plan
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.importer import import_model
from tr_onnx.layouts import StridedLayout
from tr_onnx.opdef import KernelContext, TensorInfo
from tr_onnx.ops import unary
from tr_onnx.ops.unary import UNARY_GRADS
from tr_onnx.passes.autodiff import differentiate
from tr_onnx.passes.dispatch import dispatch
from tr_onnx.registry import default_registry
from tr_onnx.training.gradients import vjp


@pytest.fixture(autouse=True)
def numpy_gelu(monkeypatch):
    monkeypatch.setattr(unary, "onednn_gelu", lambda ctx, infos: None)

CLIP = (-1.5, 2.25)


def rng(name: str) -> np.random.Generator:
    """A generator of the test's own: the same values whatever runs before it."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def f32(value: float) -> float:
    """An attribute's value as the model holds it (ONNX float attributes are float32)."""
    return float(np.float32(value))


class Row:
    """A forward op: ONNX attrs, opset, constant inputs (Clip's bounds), the input domain."""

    def __init__(self, op, attrs=None, opset=20, consts=(), positive=False):
        self.op, self.attrs, self.opset = op, attrs or {}, opset
        self.consts, self.positive = consts, positive


ROWS = {
    "Relu": Row("Relu"),
    "LeakyRelu": Row("LeakyRelu", {"alpha": 0.1}),
    "Elu": Row("Elu", {"alpha": 1.3}),
    "Sigmoid": Row("Sigmoid"),
    "HardSigmoid": Row("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
    "HardSwish": Row("HardSwish"),
    "Tanh": Row("Tanh"),
    "Gelu": Row("Gelu"),
    "GeluTanh": Row("Gelu", {"approximate": "tanh"}),
    "Softplus": Row("Softplus"),
    "Sqrt": Row("Sqrt", positive=True),
    "Abs": Row("Abs"),
    "Clip": Row("Clip", consts=CLIP, opset=13),
    "ClipAttrs": Row("Clip", {"min": CLIP[0], "max": CLIP[1]}, opset=6),
}


def test_rows_cover_the_named_ops():
    assert {r.op for r in ROWS.values()} == set(UNARY_GRADS)


def _model(row: Row, shape, dtype, pool: bool = False) -> onnx.ModelProto:
    """y = op(x [, consts]); with ``pool``, x goes through a 1x1 MaxPool first (its output is
    a channels-last feature map, padded to the plan's channel alignment)."""
    elem = onnx_elem_type(np.dtype(dtype))
    nodes, src = [], "x"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[1, 1]))
        src = "p"
    inits = [numpy_helper.from_array(np.asarray(c, dtype), f"c{i}")
             for i, c in enumerate(row.consts)]
    nodes.append(helper.make_node(row.op, [src] + [t.name for t in inits], ["y"], **row.attrs))
    graph = helper.make_graph(nodes, row.op, [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info("y", elem, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", row.opset)])


def _grid(row: Row, dtype) -> np.ndarray:
    dense = np.linspace(-6, 6, 241)
    special = [0.0, -0.0, 3.0, -3.0, 1e-30, -1e-30, 0.5, -0.5, 20, -20, 40, -40, 100, -100,
               np.inf, -np.inf, np.nan, *CLIP, -4 / 3, 2.0]
    x = np.concatenate([dense, special])
    if row.positive:
        x = np.concatenate([np.abs(x), [1e-30, 1e30, -1.0]])
    return x.astype(dtype)


# ---- 1. the chains the named ops replace -----------------------------------------------------

class Chain:
    """The calls the composed rules made on the GradBuilder, recorded as ONNX nodes over the
    graph inputs gy, x, y; constants take the dtype of the values."""

    def __init__(self, dtype):
        self.dtype, self.nodes, self.inits = np.dtype(dtype), [], []

    def _name(self) -> str:
        return f"t{len(self.nodes) + len(self.inits)}"

    def op(self, op_type, inputs, attrs=None):
        out = self._name()
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **(attrs or {})))
        return out

    def c(self, value):
        name = self._name()
        self.inits.append(numpy_helper.from_array(np.asarray(value, self.dtype), name))
        return name

    def add(self, a, b):
        return self.op("Add", [a, b])

    def sub(self, a, b):
        return self.op("Sub", [a, b])

    def mul(self, a, b):
        return self.op("Mul", [a, b])

    def div(self, a, b):
        return self.op("Div", [a, b])

    def where(self, cond, a, b=None):
        return self.op("Where", [cond, a, b if b is not None else self.c(0.0)])

    def greater(self, v, value):
        return self.op("Greater", [v, self.c(value)])

    def less(self, v, value):
        return self.op("Less", [v, self.c(value)])

    def scaled(self, v, value):
        return self.mul(v, self.c(value))

    def one_minus_square(self, v):
        return self.sub(self.c(1.0), self.mul(v, v))


def _gelu_chain(b, x, y, gy, a):
    x2 = b.mul(x, x)
    if a.get("approximate") == "tanh":
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        t = b.op("Tanh", [b.scaled(b.mul(x, b.add(b.scaled(x2, k), b.c(1.0))), c)])
        slope = b.mul(b.one_minus_square(t), b.add(b.scaled(x2, 3 * k * c), b.c(c)))
        d = b.add(b.add(t, b.c(1.0)), b.mul(x, slope))
        return b.mul(gy, b.scaled(d, 0.5))
    cdf = b.add(b.op("Erf", [b.scaled(x, 1.0 / math.sqrt(2.0))]), b.c(1.0))
    pdf = b.scaled(b.op("Exp", [b.scaled(x2, -0.5)]), 1.0 / math.sqrt(2.0 * math.pi))
    return b.mul(gy, b.add(b.scaled(cdf, 0.5), b.mul(x, pdf)))


def _hard_swish_chain(b, x, y, gy, a):
    inner = b.mul(gy, b.add(b.scaled(x, 1.0 / 3.0), b.c(0.5)))
    return b.where(b.less(x, -3.0), b.c(0.0), b.where(b.greater(x, 3.0), gy, inner))


CHAINS = {  # the rules as they were before the named ops, (b, x, y, gy, attrs) -> gx
    "Relu": lambda b, x, y, gy, a: b.where(b.greater(x, 0.0), gy),
    "LeakyRelu": lambda b, x, y, gy, a: b.where(b.greater(x, 0.0), gy,
                                                b.scaled(gy, a["alpha"])),
    "Elu": lambda b, x, y, gy, a: b.where(b.greater(x, 0.0), gy,
                                          b.mul(gy, b.add(y, b.c(a["alpha"])))),
    "Sigmoid": lambda b, x, y, gy, a: b.mul(gy, b.mul(y, b.sub(b.c(1.0), y))),
    "HardSigmoid": lambda b, x, y, gy, a: b.where(
        b.op("And", [b.greater(y, 0.0), b.less(y, 1.0)]), b.scaled(gy, a["alpha"])),
    "HardSwish": _hard_swish_chain,
    "Tanh": lambda b, x, y, gy, a: b.mul(gy, b.one_minus_square(y)),
    "Gelu": _gelu_chain,
    "Softplus": lambda b, x, y, gy, a: b.mul(gy, b.op("Sigmoid", [x])),
    "Sqrt": lambda b, x, y, gy, a: b.div(b.scaled(gy, 0.5), y),
    "Abs": lambda b, x, y, gy, a: b.mul(gy, b.op("Sign", [x])),
    "Clip": lambda b, x, y, gy, a: b.where(b.op("Equal", [x, y]), gy),
}


def _forward_attrs(row: Row) -> dict:
    """The forward node's attributes as the gradient rule sees them (schema defaults filled)."""
    imported = import_model(_model(row, [1], np.float64))
    (node,) = imported.specialize({"x": (1,)}, {}).nodes
    return dict(node.attrs)


def _run_chain(row: Row, x, y, gy) -> np.ndarray:
    b = Chain(x.dtype)
    gx = CHAINS[row.op](b, "x", "y", "gy", _forward_attrs(row))
    elem = onnx_elem_type(x.dtype)
    ins = [helper.make_tensor_value_info(n, elem, list(x.shape)) for n in ("gy", "x", "y")]
    graph = helper.make_graph(b.nodes, "chain", ins,
                              [helper.make_tensor_value_info(gx, elem, list(x.shape))], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return tr_onnx.InferenceSession(model).run(None, {"gy": gy, "x": x, "y": y})[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(ROWS))
def test_named_op_equals_the_chain_it_replaces_bitwise(name, dtype):
    row = ROWS[name]
    x = _grid(row, dtype)
    gy = rng(name).standard_normal(x.shape).astype(dtype)
    gy[::17] = 0.0
    y, grads = vjp(_model(row, list(x.shape), dtype), {"x": x}, ["x"], gy)
    want = _run_chain(row, x, y, gy)
    got = _run_kernel(row.op, _forward_attrs(row), gy, x, y)
    assert got.dtype == grads["x"].dtype == want.dtype
    np.testing.assert_array_equal(got, want, err_msg=f"{name}: the kernel")
    np.testing.assert_array_equal(grads["x"], want, err_msg=f"{name}: the rule")


# ---- 2. PyTorch autograd ---------------------------------------------------------------------

TORCH = {
    "Relu": F.relu,
    "LeakyRelu": lambda x: F.leaky_relu(x, f32(0.1)),
    "Elu": lambda x: F.elu(x, f32(1.3)),
    "Sigmoid": torch.sigmoid,
    "HardSigmoid": lambda x: torch.clamp(x * f32(0.3) + f32(0.4), 0, 1),
    "HardSwish": F.hardswish,
    "Tanh": torch.tanh,
    "Gelu": F.gelu,
    "GeluTanh": lambda x: F.gelu(x, approximate="tanh"),
    "Softplus": F.softplus,
    "Sqrt": torch.sqrt,
    "Abs": torch.abs,
    "Clip": lambda x: torch.clamp(x, *CLIP),
    "ClipAttrs": lambda x: torch.clamp(x, f32(CLIP[0]), f32(CLIP[1])),
}

# 0, negatives, and the kinks where both sides take the same one-sided derivative: Relu,
# LeakyRelu, Elu and Abs at 0, Clip at its bounds. Not HardSwish's +-3 (ours, as the cuda
# kernel and the chain before, is x/3 + 1/2 there; torch's 0 and 1), HardSigmoid's clamp
# points (torch's clamp passes the gradient there, ours does not) nor |x| > 20 (torch's
# Softplus is x there).
TORCH_X = np.array([0.0, -0.0, -1.5, 2.25, -7.5, -3.1, -2.9, -1.0, -0.25, 0.25, 0.9, 1.7,
                    2.9, 3.1, 6.0, 15.0, -15.0])


@pytest.mark.parametrize("name", list(ROWS))
def test_named_op_matches_torch_autograd(name):
    row = ROWS[name]
    x = np.abs(TORCH_X) if row.positive else TORCH_X.copy()
    gy = rng(name).standard_normal(x.shape)
    _, grads = vjp(_model(row, list(x.shape), np.float64), {"x": x}, ["x"], gy)
    xt = torch.tensor(x, requires_grad=True)
    (want,) = torch.autograd.grad(TORCH[name](xt), [xt], torch.tensor(gy))
    np.testing.assert_allclose(grads["x"], want.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


# ---- 3. the emitted node ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ROWS))
def test_the_rule_emits_one_named_node_reading_what_the_table_says(name):
    row = ROWS[name]
    registry = default_registry()
    graph = import_model(_model(row, [2, 3], np.float64)).specialize({"x": (2, 3)}, {})
    dispatch(graph, registry, "numpy")
    forward = graph.nodes[0]
    gy = ir.Value("gy", (2, 3), np.dtype(np.float64), ir.INPUT)
    graph.values[gy.name] = gy
    differentiate(graph, graph.values["y"], [graph.values["x"]], registry, "numpy", seed=gy)
    (node,) = graph.nodes[1:]
    assert (node.domain, node.op_type) == ("ai.tr_onnx", f"{row.op}Grad")
    reads = UNARY_GRADS[row.op].reads
    expected = [gy, forward.inputs[0] if "x" in reads else None,
                forward.outputs[0] if "y" in reads else None]
    while expected[-1] is None:
        expected.pop()
    assert node.inputs == expected
    assert node.attrs == forward.attrs
    assert node.outputs[0].shape == (2, 3) and node.opdef.differentiable is None


# ---- 4. channels-last, padded --------------------------------------------------------------

# (2, 13, 30, 30) has more elements than a chunk (ops/elementwise.py CHUNK): the kernels with
# scratch run piece by piece along the channels-last memory order there
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 13, 30, 30)], ids=["small", "chunked"])
@pytest.mark.parametrize("name", list(ROWS))
def test_padded_channels_last_equals_plain(name, shape):
    row = ROWS[name]
    x = rng(name).standard_normal(shape) * 3
    x[0, 0, 0, :3] = [0.0, 3.0, -3.0]
    if row.positive:
        x = np.abs(x) + 0.1
    gy = rng(name + "gy").standard_normal(x.shape)
    model = _model(row, list(x.shape), np.float64, pool=True)
    # vjp checks that the padded lanes of every tensor are still zero after the step
    _, padded = vjp(model, {"x": x}, ["x"], gy, channel_align=8)
    _, plain = vjp(model, {"x": x}, ["x"], gy, channel_align=1)
    np.testing.assert_array_equal(padded["x"], plain["x"])


def test_the_padded_plan_reads_channels_last_views():
    """Guards test 4: the named op there runs on padded channels-last tensors."""
    model = _model(ROWS["Relu"], [2, 3, 4, 5], np.float64, pool=True)
    imported = import_model(model)

    def transform(graph):
        gy = ir.Value("gy", (2, 3, 4, 5), np.dtype(np.float64), ir.INPUT)
        graph.values[gy.name] = gy
        graph.inputs.append(gy)
        graph.backward_start = len(graph.nodes)
        grads = differentiate(graph, graph.values["y"], [graph.values["x"]], default_registry(),
                              "numpy", seed=gy)
        graph.outputs = [graph.values["y"], grads["x"]]
        return grads

    plan = compile_plan(imported, {"x": (2, 3, 4, 5)}, {}, "numpy", 8, transform=transform)
    (node,) = [n for n in plan.graph.nodes if n.op_type == "ReluGrad"]
    gy, _, y = node.inputs
    layout = {v: plan.memory.tensors[v.name].layout for v in (gy, y, node.outputs[0])}
    # gy is a graph input here (plain): the kernel reads its inputs in mixed layouts
    assert layout[y].is_padded and layout[node.outputs[0]].is_padded
    assert layout[gy].kind == "plain"


# ---- 5. padded lanes -------------------------------------------------------------------------

def _run_kernel(op: str, attrs: dict, gy, x, y) -> np.ndarray:
    """The registered numpy kernel of ``<op>Grad`` on plain arrays."""
    reads = UNARY_GRADS[op].reads
    arrays = [gy, x if "x" in reads else None, y if "y" in reads else None]
    while arrays[-1] is None:
        arrays.pop()

    def info(name, a):
        return TensorInfo(name, a.shape, a.dtype, StridedLayout.plain(a.shape), a.shape)

    infos = [None if a is None else info(f"in{i}", a) for i, a in enumerate(arrays)]
    gx = np.full_like(gy, np.nan)
    node = SimpleNamespace(op_type=f"{op}Grad", attrs=attrs, since_version=1, name=op,
                           label=f"{op}Grad")
    ctx = KernelContext(node, infos, [info("gx", gx)], [None] * len(arrays), "numpy")
    opdef = default_registry().lookup("ai.tr_onnx", f"{op}Grad", 1, "numpy")
    run = opdef.kernels["numpy"](ctx)
    ws = [np.empty(s, d) for s, d in ctx.workspace_requests]
    with np.errstate(all="ignore"):
        run(arrays, [gx], ws)
    return gx


@pytest.mark.parametrize("name", list(ROWS))
def test_a_padded_lane_gives_zero_except_for_sqrt(name):
    row = ROWS[name]
    zero = np.zeros(4, np.float32)
    gx = _run_kernel(row.op, _forward_attrs(row), zero, zero, zero)
    if row.op == "Sqrt":
        assert np.isnan(gx).all()
    else:
        np.testing.assert_array_equal(gx, zero)


def test_an_absent_input_the_formula_reads_is_a_named_error():
    gy = np.zeros(3, np.float32)
    with pytest.raises(tr_onnx.errors.UnsupportedModelError, match="input 2 .y. is absent"):
        _run_kernel("Sigmoid", {}, gy, gy, None)


def test_every_named_op_is_registered_with_a_table_row():
    registry = default_registry()
    named = {k.op_type for k in registry.keys()
             if k.domain == "ai.tr_onnx" and k.op_type.removesuffix("Grad") in UNARY_GRADS}
    assert named == {f"{op}Grad" for op in UNARY_GRADS}
    for op in named:
        key = next(k for k in registry.keys() if k.op_type == op and k.backend == "numpy")
        assert registry.source_of(key) == "tr_onnx.ops.unary"


def test_a_half_precision_gradient_runs_in_the_half_type():
    row = ROWS["Gelu"]
    x = np.linspace(-4, 4, 33).astype(np.float16)
    gy = np.ones_like(x)
    y, grads = vjp(_model(row, list(x.shape), np.float16), {"x": x}, ["x"], gy)
    assert grads["x"].dtype == np.float16
    np.testing.assert_array_equal(grads["x"], _run_chain(row, x, y, gy))
