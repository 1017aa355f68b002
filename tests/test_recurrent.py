"""LSTM, GRU and RNN (tr_onnx.ops.recurrent): forward against onnxruntime for every feature
(onnx.reference where onnxruntime has none: ``layout`` 1), gradients against PyTorch's
autograd of torch.nn.LSTM/GRU/RNN in float64, and the must-show: PyTorch classifiers built on
them, exported and trained (tests/torch_parity.py), with a training graph of two nodes per
layer rather than an unrolled loop. Finite differences are in grad_cases_recurrent.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from allocation import PEAK_BOUND, step_allocation
from onnx import helper
from onnx.reference import ReferenceEvaluator
from oracles import ort_run
from torch_parity import ParityCase, assert_parity, run_case

import tr_onnx
from tr_onnx.backends.numpy_backend import KernelError
from tr_onnx.errors import UnsupportedModelError
from tr_onnx.ir import attribute_value
from tr_onnx.ops.recurrent import _spec
from tr_onnx.training.gradients import vjp

T, N, C, H = 5, 3, 4, 3
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _layer_model(op, dirs=1, *, attrs=None, lens=False, init=False, peep=False, layout=0,
                 opset=17, dtype=np.float32, seed=0, outputs=None, t=T, n=N):
    """A one-node model with every input a graph input, and its feed."""
    rng = np.random.default_rng(seed)
    g = GATES[op]
    state = (dirs, n, H) if layout == 0 else (n, dirs, H)
    feed = {"X": rng.standard_normal((t, n, C) if layout == 0 else (n, t, C)),
            "W": rng.standard_normal((dirs, g * H, C)) * 0.5,
            "R": rng.standard_normal((dirs, g * H, H)) * 0.5,
            "B": rng.standard_normal((dirs, 2 * g * H)) * 0.5}
    feed = {k: v.astype(dtype) for k, v in feed.items()}
    names = ["X", "W", "R", "B", "", ""]
    if lens:
        names[4] = "L"
        feed["L"] = np.array([t, 2, 4] + [t // 2] * (n - 3), np.int32)[:n]
    if init:
        names[5] = "h0"
        feed["h0"] = rng.standard_normal(state).astype(dtype)
    if op == "LSTM":
        names += ["c0" if init else "", "P" if peep else ""]
        if init:
            feed["c0"] = rng.standard_normal(state).astype(dtype)
        if peep:
            feed["P"] = rng.standard_normal((dirs, 3 * H)).astype(dtype)
    while names[-1] == "":
        names.pop()
    outs = outputs or ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    attrs = dict(attrs or {})
    if dirs == 2:
        attrs["direction"] = "bidirectional"
    if layout:
        attrs["layout"] = layout
    node = helper.make_node(op, names, outs, hidden_size=H, **attrs)
    inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feed.items()]
    graph = helper.make_graph([node], op, inputs, [helper.make_value_info(o, onnx.TypeProto())
                                                   for o in outs if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model), feed


# ---- forward ------------------------------------------------------------------------------------

BI = 2
FORWARD = [
    # (id, op, dirs, attrs, options)
    ("lstm_forward", "LSTM", 1, {}, {}),
    ("lstm_bidirectional_init_peepholes", "LSTM", BI, {}, {"init": True, "peep": True}),
    ("lstm_reverse_seq_lens", "LSTM", 1, {"direction": "reverse"}, {"lens": True, "init": True}),
    ("lstm_bidirectional_seq_lens", "LSTM", BI, {}, {"lens": True, "peep": True}),
    ("lstm_clip", "LSTM", 1, {"clip": 0.15}, {"init": True, "peep": True}),
    ("lstm_input_forget", "LSTM", 1, {"input_forget": 1}, {"init": True}),
    ("lstm_activations", "LSTM", 1, {"activations": ["HardSigmoid", "LeakyRelu", "Elu"],
                                     "activation_alpha": [0.3, 0.2, 0.9],
                                     "activation_beta": [0.4]}, {}),
    ("lstm_opset7", "LSTM", 1, {}, {"opset": 7, "init": True}),
    ("lstm_only_y_h", "LSTM", BI, {}, {"outputs": ["", "Y_h"], "lens": True}),
    ("gru_forward", "GRU", 1, {}, {}),
    ("gru_bidirectional_seq_lens", "GRU", BI, {}, {"lens": True, "init": True}),
    ("gru_linear_before_reset", "GRU", BI, {"linear_before_reset": 1}, {"lens": True}),
    ("gru_clip", "GRU", 1, {"clip": 0.15, "linear_before_reset": 1}, {"init": True}),
    ("gru_activations", "GRU", BI, {"activations": ["Sigmoid", "Softsign", "HardSigmoid",
                                                    "Tanh"]}, {}),
    ("rnn_forward", "RNN", 1, {}, {}),
    ("rnn_reverse_seq_lens", "RNN", 1, {"direction": "reverse"}, {"lens": True, "init": True}),
    ("rnn_bidirectional_clip", "RNN", BI, {"clip": 0.3}, {"init": True}),
    *((f"rnn_{a.lower()}", "RNN", 1, {"activations": [a], **extra}, {}) for a, extra in (
        ("Relu", {}), ("Sigmoid", {}), ("Affine", {"activation_alpha": [0.5],
                                                   "activation_beta": [0.1]}),
        ("LeakyRelu", {"activation_alpha": [0.2]}),
        ("ThresholdedRelu", {"activation_alpha": [0.1]}),
        ("ScaledTanh", {"activation_alpha": [0.7], "activation_beta": [1.3]}),
        ("HardSigmoid", {"activation_alpha": [0.3], "activation_beta": [0.4]}),
        ("Elu", {"activation_alpha": [0.8]}), ("Softsign", {}), ("Softplus", {}))),
]


@pytest.mark.parametrize("op,dirs,attrs,options", [c[1:] for c in FORWARD],
                         ids=[c[0] for c in FORWARD])
def test_forward_equals_onnxruntime(op, dirs, attrs, options):
    model, feed = _layer_model(op, dirs, attrs=attrs, **options)
    ours = tr_onnx.InferenceSession(model).run(None, feed)
    theirs = ort_run(model, feed)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout1_equals_onnx_reference(op):
    """onnxruntime's CPU kernels reject layout 1 (batch-major); onnx.reference has it (but
    ignores sequence_lens, so that is held by the layout-0 equality below)."""
    model, feed = _layer_model(op, BI, init=True, layout=1, dtype=np.float64)
    ours = tr_onnx.InferenceSession(model).run(None, feed)
    for a, b in zip(ours, ReferenceEvaluator(model).run(None, feed)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout1_with_seq_lens_equals_layout0_transposed(op):
    m0, f0 = _layer_model(op, BI, lens=True, init=True, dtype=np.float64)
    m1, _ = _layer_model(op, BI, lens=True, init=True, layout=1, dtype=np.float64)
    f1 = {k: (v.swapaxes(0, 1) if k in ("X", "h0", "c0") else v) for k, v in f0.items()}
    y0 = tr_onnx.InferenceSession(m0).run(None, f0)
    y1 = tr_onnx.InferenceSession(m1).run(None, f1)
    np.testing.assert_array_equal(y1[0], y0[0].transpose(2, 0, 1, 3))
    for a, b in zip(y1[1:], y0[1:]):
        np.testing.assert_array_equal(a, b.swapaxes(0, 1))


@pytest.mark.internal_ops
def test_the_training_variant_equals_the_op_and_types_its_saved_rows():
    """ai.tr_onnx GRUTraining as a node of its own (its shape rule types the outputs the
    model leaves symbolic): Y and Y_h equal GRU's, the saved rows are [D, T, N, 5H]."""
    model, feed = _layer_model("GRU", BI, lens=True, init=True, dtype=np.float64,
                               attrs={"linear_before_reset": 1})
    expected = tr_onnx.InferenceSession(model).run(None, feed)
    node = model.graph.node[0]
    attrs = _spec("GRU", {a.name: attribute_value(a) for a in node.attribute},
                  feed["R"].shape, node.name).attrs()
    outs = [("Y", 4), ("Y_h", 3), ("saved", 4)]
    graph = helper.make_graph(
        [helper.make_node("GRUTraining", list(node.input), [o for o, _ in outs],
                          domain="ai.tr_onnx", **attrs)], "g", list(model.graph.input),
        [helper.make_tensor_value_info(o, onnx.TensorProto.DOUBLE, [f"{o}{i}" for i in range(r)])
         for o, r in outs])
    training = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("ai.tr_onnx", 1)])
    y, y_h, saved = tr_onnx.InferenceSession(training).run(None, feed)
    np.testing.assert_array_equal(y, expected[0])
    np.testing.assert_array_equal(y_h, expected[1])
    assert saved.shape == (2, T, N, 5 * H)


def test_a_sequence_length_past_the_input_is_an_error_naming_the_node():
    model, feed = _layer_model("LSTM", BI, lens=True)
    feed["L"][1] = T + 1
    with pytest.raises(KernelError, match=r"LSTM_0.*sequence_lens \[5, 6, 4\] outside \[0, 5\]"):
        tr_onnx.InferenceSession(model).run(None, feed)


def test_an_unknown_activation_is_an_error_naming_the_node():
    model, feed = _layer_model("RNN", attrs={"activations": ["Gelu"]})
    with pytest.raises(UnsupportedModelError, match=r"'RNN_0'.*unknown activation 'Gelu'"):
        tr_onnx.InferenceSession(model).run(None, feed)


# ---- gradients against PyTorch autograd ----------------------------------------------------------
# PyTorch's gate order (LSTM i,f,g,o; GRU r,z,n) mapped to ONNX's (i,o,f,c; z,r,h). PyTorch's
# GRU applies the reset gate after the recurrent matmul: ONNX linear_before_reset=1.

ORDER = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}
TORCH = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN": torch.nn.RNN}


def _onnx_order(a: torch.Tensor, op: str) -> np.ndarray:
    chunks = np.split(a.detach().numpy(), GATES[op])
    return np.concatenate([chunks[i] for i in ORDER[op]])


def _torch_params(module, op, dirs):
    """ONNX W, R, B ([D, G*H, ...]) from PyTorch's one-layer module's parameters."""
    sfx = ["", "_reverse"][:dirs]
    w = np.stack([_onnx_order(getattr(module, f"weight_ih_l0{s}"), op) for s in sfx])
    r = np.stack([_onnx_order(getattr(module, f"weight_hh_l0{s}"), op) for s in sfx])
    b = np.stack([np.concatenate([_onnx_order(getattr(module, f"bias_ih_l0{s}"), op),
                                  _onnx_order(getattr(module, f"bias_hh_l0{s}"), op)])
                  for s in sfx])
    return w, r, b


TORCH_CASES = [(op, dirs, bf, out) for op in ("LSTM", "GRU", "RNN") for dirs, bf, out in
               ((1, False, "Y"), (2, True, "Y"), (2, False, "Y_h"))]


@pytest.mark.parametrize("op,dirs,batch_first,output", TORCH_CASES,
                         ids=[f"{o.lower()}-{d}dir-{'batch_first' if b else 'seq_first'}-{y}"
                              for o, d, b, y in TORCH_CASES])
def test_gradients_equal_pytorch_autograd(op, dirs, batch_first, output):
    """d sum(out * cot) / d (X, W, R, B, h0[, c0]) against torch.nn.LSTM/GRU/RNN's autograd,
    float64; batch_first maps to layout 1. The issue asks 1e-5; both compute the same sums in
    float64 (measured: 1.3e-15 of the gradients' scale), so 1e-9 is asserted."""
    torch.manual_seed(0)
    module = TORCH[op](C, H, bidirectional=dirs == 2, batch_first=batch_first).double()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, T, C) if batch_first else (T, N, C))
    h0 = rng.standard_normal((dirs, N, H))
    c0 = rng.standard_normal((dirs, N, H))
    tx, th0, tc0 = (torch.tensor(a, requires_grad=True) for a in (x, h0, c0))
    y, state = module(tx, (th0, tc0) if op == "LSTM" else th0)
    hn = state[0] if op == "LSTM" else state
    if output == "Y":  # PyTorch [T, N, D*H] / [N, T, D*H]; ONNX [T, D, N, H] / [N, T, D, H]
        ty = y.reshape(*y.shape[:2], dirs, H)
        ty = ty if batch_first else ty.permute(0, 2, 1, 3)
    else:  # PyTorch h_n [D, N, H]; ONNX Y_h layout 1 [N, D, H]
        ty = hn.transpose(0, 1) if batch_first else hn
    cot = np.random.default_rng(2).standard_normal(tuple(ty.shape))
    (ty * torch.from_numpy(cot)).sum().backward()

    layout = int(batch_first)
    model, _ = _layer_model(op, dirs, init=True, layout=layout, dtype=np.float64,
                            outputs=["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2])
    w, r, b = _torch_params(module, op, dirs)
    as_layout = (lambda a: a.swapaxes(0, 1)) if layout else (lambda a: a)
    feed = {"X": x, "W": w, "R": r, "B": b, "h0": as_layout(h0)}
    if op == "LSTM":
        feed["c0"] = as_layout(c0)
    attrs = {} if op != "GRU" else {"linear_before_reset": 1}
    for k, v in attrs.items():
        model.graph.node[0].attribute.append(helper.make_attribute(k, v))
    ours, grads = vjp(model, feed, list(feed), cot, output=output)
    np.testing.assert_allclose(ours, ty.detach().numpy(), rtol=0, atol=1e-12)
    gw, gr, gb = _torch_params(_Grads(module), op, dirs)
    expected = {"X": tx.grad.numpy(), "W": gw, "R": gr, "B": gb, "h0": as_layout(th0.grad.numpy())}
    if op == "LSTM":
        expected["c0"] = as_layout(tc0.grad.numpy())
    for name, g in expected.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-9, atol=1e-9 * np.abs(g).max(),
                                   err_msg=name)


class _Grads:
    """A module's parameters' .grad under their own names."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name).grad


# ---- must-show: PyTorch classifiers exported, trained, exported back ---------------------------


class _Classifier(torch.nn.Module):
    """Linear input projection -> recurrent layers (batch_first) -> last or mean -> Linear."""

    def __init__(self, kind, layers=2, bidirectional=True, pool="last"):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 8)
        self.rnn = TORCH[kind](8, 10, num_layers=layers, bidirectional=bidirectional,
                               batch_first=True)
        self.head = torch.nn.Linear(10 * (2 if bidirectional else 1), 4)
        self.pool = pool

    def forward(self, x):
        y, _ = self.rnn(self.proj(x))
        return self.head(y[:, -1] if self.pool == "last" else y.mean(1))


def _batches(k):
    rng = np.random.default_rng(k)
    return ({"x": rng.standard_normal((3, 7, 6)).astype(np.float32)},
            rng.integers(0, 4, 3).astype(np.int64))


MUST_SHOW = {
    "bilstm2-classic": ("LSTM", {}, "classic"),
    "bilstm2-mean-dynamo": ("LSTM", {"pool": "mean"}, "dynamo"),
    "gru-classic": ("GRU", {"layers": 1}, "classic"),
    "rnn-tanh-classic": ("RNN", {"layers": 2, "bidirectional": False}, "classic"),
}


@pytest.fixture(scope="module", params=list(MUST_SHOW))
def trained(request, tmp_path_factory):
    kind, kw, exporter = MUST_SHOW[request.param]
    case = ParityCase(request.param, lambda: _Classifier(kind, **kw), _batches,
                      exporter=exporter, dynamic_axes={"x": {0: "batch"}})
    return kind, kw, run_case(case, tmp_path_factory.mktemp(request.param))


def test_pytorch_recurrent_classifier_trains_as_in_pytorch(trained):
    """Forward 1e-5 vs onnxruntime, 5 SGD steps 1e-4 vs PyTorch, the trained export run by
    onnxruntime 1e-4 vs PyTorch trained alike (both exporters emit the ONNX ops)."""
    assert_parity(trained[2])


def test_training_graph_has_two_nodes_per_layer_and_trains_pytorchs_weights(trained):
    """No unrolling: each exported layer becomes one training forward and one backward node,
    and the exporter's W, R, B initializers (PyTorch's weights, gate-reordered) train."""
    kind, kw, result = trained
    layers = kw.get("layers", 2)
    plan = result.session._state.active
    ops = Counter(n.op_type for n in plan.graph.nodes)
    assert ops[f"{kind}Training"] == layers and ops[f"{kind}Grad"] == layers, ops
    assert len(plan.graph.nodes) < 60, ops
    trainable = set(plan.info.trainable)
    model = onnx.load(str(result.path))
    for node in model.graph.node:
        if node.op_type == kind:
            assert set(node.input[1:4]) <= trainable, (list(node.input), sorted(trainable))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_a_run_allocates_only_numpy_buffers(op):
    """Gathers and scatters go through np.take(out=) and index workspaces: X (24000 doubles
    here, 188 KB, more than the bound) is never copied per run."""
    model, feed = _layer_model(op, BI, lens=True, init=True, peep=True, layout=1,
                               dtype=np.float64, t=10, n=600)
    sess = tr_onnx.InferenceSession(model)
    sess.run(None, feed)
    assert step_allocation(sess.plan_for(feed).executor.run)[0] < PEAK_BOUND


def test_a_training_step_allocates_only_numpy_buffers(trained):
    assert step_allocation(trained[2].session._state.active.executor.run)[0] < PEAK_BOUND
