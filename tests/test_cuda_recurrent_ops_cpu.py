"""The cuda bindings of the recurrent family (backends/cuda/ops/recurrent.py,
kernels/recurrent.cu), checked without a GPU: LSTM, GRU and RNN as single-node models, their
training variants with their backward ops (``ai.tr_onnx`` ``<cell>Training`` + ``<cell>Grad``
as a two-node model), run on ``backend="cuda"`` through the host emulator (the kernels' g++
build) against ``backend="numpy"`` (LSTM with one hidden unit and several rows against
onnxruntime: NumPy miscomputes it, see that test); then LSTM and GRU classifiers (built with
onnx.helper, and a torch.nn.LSTM one from the classic exporter) trained three SGD steps on
both.

Tolerances. The products (``X W^T``, ``H_{t-1} R^T``, the weight gradients) run on
``tr_matmul`` (fp64 accumulation, rounded once) where NumPy calls float32 BLAS (blocked sums,
each partial rounded); the pointwise kernels compute NumPy's formulas in its order, but
``exp``/``tanh``/``expm1``/``log1p`` are glibc's, not NumPy's SIMD ones (a few ulp). The
recurrence carries these differences through every step, so results are compared as
``|cuda - numpy| <= rtol * |numpy| + atol * max|numpy|`` per output, with

* float32: rtol 1e-5, atol 1e-6 (measured: beyond rtol, at most 1e-8 of an output's largest
  value forwards, 9e-8 backwards, over these cases);
* float16 / bfloat16: 8 ulp of the storage type at each output's largest value (2**-10 * 8,
  2**-7 * 8; measured 3.3 and 2 ulp): NumPy rounds every operation to the storage type where
  the kernels round once per stored value, and the backward reads the forward's rounded rows;
* training: losses and parameters after three SGD steps rtol 1e-5, atol 1e-6 (the cells above
  plus the model's other ops, whose numpy kernels the emulator runs for cuDNN's Gemm).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of
from onnx import TensorProto, helper, numpy_helper
from oracles import ort_run
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.ops.recurrent import ACTIVATION_CODES
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.ops.recurrent import _ACTIVATIONS, _spec
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

pytestmark = pytest.mark.internal_ops  # models of its internal ops, to test their kernels

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int32): TensorProto.INT32}
TOL = {np.dtype(np.float32): (1e-5, 1e-6), np.dtype(np.float16): (0.0, 2.0 ** -10 * 8),
       BFLOAT16: (0.0, 2.0 ** -7 * 8)}  # (rtol, atol in units of an output's largest value)


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("recurrent_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


# ---- the layers ---------------------------------------------------------------------------------


def layer_inputs(op, direction, *, bias=True, init=False, lens=None, peep=False, hidden=3,
                 batch=3, steps=5, size=4, layout=0, dtype=np.float32, seed=0):
    """(input names in the op's order, '' for an absent one; the feed) of one layer."""
    rng = np.random.default_rng(seed)
    dirs, g = 2 if direction == "bidirectional" else 1, GATES[op]
    state = (dirs, batch, hidden) if layout == 0 else (batch, dirs, hidden)
    feed = {"X": rng.standard_normal((steps, batch, size) if layout == 0 else
                                     (batch, steps, size)),
            "W": rng.standard_normal((dirs, g * hidden, size)) * 0.5,
            "R": rng.standard_normal((dirs, g * hidden, hidden)) * 0.5}
    names = ["X", "W", "R", "", "", ""]
    if bias:
        names[3], feed["B"] = "B", rng.standard_normal((dirs, 2 * g * hidden)) * 0.5
    if init:
        names[5], feed["h0"] = "h0", rng.standard_normal(state)
    if op == "LSTM":
        names += ["", ""]
        if init:
            names[6], feed["c0"] = "c0", rng.standard_normal(state)
        if peep:
            names[7], feed["P"] = "P", rng.standard_normal((dirs, 3 * hidden))
    feed = {k: v.astype(dtype) for k, v in feed.items()}
    if lens is not None:
        names[4], feed["L"] = "L", np.array(lens, np.int32)
    while names[-1] == "":
        names.pop()
    return names, feed


def value_info(name: str, a: np.ndarray | tuple, dtype=None):
    shape = a.shape if isinstance(a, np.ndarray) else a
    elem = ELEM[np.dtype(dtype if dtype is not None else a.dtype)]
    return helper.make_tensor_value_info(name, elem, list(shape))


def forward_model(op, direction, attrs, names, feed):
    """One standard LSTM/GRU/RNN node, every input a graph input, outputs typed by ONNX."""
    outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    hidden = feed["R"].shape[-1]
    node = helper.make_node(op, names, outs, hidden_size=hidden, direction=direction, **attrs)
    graph = helper.make_graph([node], op, [value_info(k, v) for k, v in feed.items()],
                              [helper.make_value_info(o, onnx.TypeProto()) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return onnx.shape_inference.infer_shapes(model)


def training_model(op, direction, attrs, names, feed, flows):
    """``<op>Training`` and ``<op>Grad`` (ai.tr_onnx) as a model: the forward outputs and the
    gradient of every present input, the cotangents of the outputs in ``flows`` fed."""
    x, r = feed["X"], feed["R"]
    dirs, hidden, layout = r.shape[0], r.shape[-1], attrs.get("layout", 0)
    t, n = (x.shape[0], x.shape[1]) if layout == 0 else (x.shape[1], x.shape[0])
    sp = _spec(op, {"direction": direction, **attrs}, r.shape, op)
    state = (dirs, n, hidden) if layout == 0 else (n, dirs, hidden)
    y = (t, dirs, n, hidden) if layout == 0 else (n, t, dirs, hidden)
    outs = {"Y": y, "Y_h": state, "Y_c": state}
    outs = {k: outs[k] for k in ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]}
    padded = names + [""] * ((8 if op == "LSTM" else 6) - len(names))
    grads = {"gX": "X", "gW": "W", "gR": "R", "gB": "B", "gh0": "h0", "gc0": "c0", "gP": "P"}
    grads = dict(list(grads.items())[:7 if op == "LSTM" else 5])
    grad_outs = [g if src in feed else "" for g, src in grads.items()]
    cots = {f"g{k}": shape for k, shape in outs.items() if k in flows}
    nodes = [helper.make_node(f"{op}Training", padded, [*outs, "saved"], domain="ai.tr_onnx",
                              **sp.attrs()),
             helper.make_node(f"{op}Grad", padded + ["saved"] + [f"g{k}" if k in flows else ""
                                                                 for k in outs],
                              grad_outs, domain="ai.tr_onnx", **sp.attrs())]
    inputs = [value_info(k, v) for k, v in feed.items()]
    inputs += [value_info(k, s, x.dtype) for k, s in cots.items()]
    outputs = [value_info(k, s, x.dtype) for k, s in outs.items()]
    outputs += [value_info(g, feed[src].shape, x.dtype) for g, src in grads.items()
                if src in feed]
    graph = helper.make_graph(nodes, f"{op}_bptt", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14),
                                                    helper.make_opsetid("ai.tr_onnx", 1)])
    rng = np.random.default_rng(7)
    return model, {k: rng.standard_normal(s).astype(x.dtype) for k, s in cots.items()}


def run_both(model, feed, device, signatures):
    """(numpy's outputs, cuda's outputs, the cuda plan's kernel names); the launches'
    arguments checked against the kernels' C signatures."""
    want = tr_onnx.InferenceSession(model).run(None, feed)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, feed)
    plan = sess.plan_for(feed)
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    return want, got, {c.kernel.name for c in launches}


def assert_close(got, want, names):
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        rtol, atol = TOL[w.dtype]
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        scale = max(float(np.abs(w64).max()), 1e-30)
        np.testing.assert_allclose(g64, w64, rtol=rtol, atol=atol * scale, err_msg=name)


# (id, op, direction, attrs, layer options)
CASES = [
    ("lstm-forward", "LSTM", "forward", {}, {}),
    ("lstm-no-bias-hidden1-batch1", "LSTM", "forward", {}, {"bias": False, "hidden": 1,
                                                           "batch": 1}),
    ("lstm-reverse-lens-init", "LSTM", "reverse", {}, {"lens": [5, 2, 4], "init": True}),
    ("lstm-bidirectional-lens-init-peepholes", "LSTM", "bidirectional", {},
     {"lens": [5, 0, 3, 1], "batch": 4, "init": True, "peep": True}),
    ("lstm-bidirectional-layout1-hidden2", "LSTM", "bidirectional", {"layout": 1},
     {"layout": 1, "init": True, "hidden": 2}),
    ("lstm-clip-input-forget-peepholes", "LSTM", "forward", {"clip": 0.5, "input_forget": 1},
     {"init": True, "peep": True}),
    ("lstm-activations", "LSTM", "reverse",
     {"activations": ["HardSigmoid", "LeakyRelu", "Elu"], "activation_alpha": [0.3, 0.2, 0.9],
      "activation_beta": [0.4]}, {"init": True}),
    ("gru-forward", "GRU", "forward", {}, {}),
    ("gru-no-bias-hidden1-batch1-lens", "GRU", "forward", {}, {"bias": False, "hidden": 1,
                                                              "batch": 1, "lens": [3]}),
    ("gru-bidirectional-hidden1-lens", "GRU", "bidirectional", {}, {"hidden": 1,
                                                                    "lens": [5, 2, 4]}),
    ("gru-reverse-lens-init", "GRU", "reverse", {}, {"lens": [5, 2, 4], "init": True}),
    ("gru-bidirectional-linear-before-reset-lens", "GRU", "bidirectional",
     {"linear_before_reset": 1}, {"lens": [5, 0, 3, 1], "batch": 4, "init": True}),
    ("gru-bidirectional-layout1-no-bias", "GRU", "bidirectional", {"layout": 1},
     {"layout": 1, "init": True, "bias": False}),
    ("gru-clip-linear-before-reset", "GRU", "forward", {"clip": 0.4, "linear_before_reset": 1},
     {"init": True}),
    ("gru-activations", "GRU", "bidirectional",
     {"activations": ["Sigmoid", "Softsign", "HardSigmoid", "ScaledTanh"],
      "activation_alpha": [0.3, 0.7], "activation_beta": [0.4, 1.3]}, {}),
    ("rnn-forward", "RNN", "forward", {}, {}),
    ("rnn-no-bias-hidden1-batch1", "RNN", "forward", {}, {"bias": False, "hidden": 1,
                                                         "batch": 1}),
    ("rnn-hidden1-init", "RNN", "forward", {}, {"hidden": 1, "init": True}),
    ("rnn-reverse-lens-init", "RNN", "reverse", {}, {"lens": [5, 2, 4], "init": True}),
    ("rnn-bidirectional-layout1-lens-clip", "RNN", "bidirectional", {"layout": 1, "clip": 0.3},
     {"layout": 1, "lens": [5, 0, 3], "init": True}),
    *((f"rnn-{a.lower()}", "RNN", "forward", {"activations": [a], **extra}, {"init": True})
      for a, extra in (("Relu", {}), ("Sigmoid", {}),
                       ("Affine", {"activation_alpha": [0.5], "activation_beta": [0.1]}),
                       ("ThresholdedRelu", {"activation_alpha": [0.1]}),
                       ("Softplus", {}))),
]
IDS = [c[0] for c in CASES]


def test_every_activation_has_a_kernel_code():
    assert ACTIVATION_CODES.keys() == _ACTIVATIONS.keys()
    assert sorted(ACTIVATION_CODES.values()) == list(range(len(ACTIVATION_CODES)))


@pytest.mark.parametrize("op, direction, attrs, options", [c[1:] for c in CASES], ids=IDS)
def test_forward_equals_numpy(device, signatures, op, direction, attrs, options):
    names, feed = layer_inputs(op, direction, **options)
    model = forward_model(op, direction, attrs, names, feed)
    want, got, kernels = run_both(model, feed, device, signatures)
    assert_close(got, want, ["Y", "Y_h", "Y_c"][:len(want)])
    cell = {"LSTM": ["tr_lstm_fwd_f32"], "GRU": ["tr_gru_fwd_gates_f32", "tr_gru_fwd_state_f32"],
            "RNN": ["tr_rnn_fwd_f32"]}[op]
    assert {*cell, "tr_matmul_f32", "tr_recurrent_gather_f32",
            "tr_recurrent_scatter_f32"} <= kernels


@pytest.mark.parametrize("op, direction, attrs, options", [c[1:] for c in CASES], ids=IDS)
def test_backward_through_time_equals_numpy(device, signatures, op, direction, attrs, options):
    names, feed = layer_inputs(op, direction, **options)
    model, cots = training_model(op, direction, attrs, names, feed, ("Y", "Y_h", "Y_c"))
    want, got, kernels = run_both(model, {**feed, **cots}, device, signatures)
    assert_close(got, want, [o.name for o in model.graph.output])
    assert {f"tr_{op.lower()}_bwd_f32" if op != "GRU" else "tr_gru_bwd_gates_f32",
            "tr_recurrent_carry_dh_f32"} <= kernels
    assert ("tr_recurrent_col_sum_f32" in kernels) == ("B" in feed)  # gB: the bias' gradient


def test_lstm_with_one_hidden_unit_and_several_rows_equals_onnxruntime(device, signatures):
    """LSTM with hidden_size 1 and batch > 1 is checked against onnxruntime, not the numpy
    backend: with NumPy 2.4.6 a float32 unary ufunc whose input and ``out`` are both ``[n, 1]``
    column views of wider arrays (the NumPy kernel's gate columns when H = 1) reads the input
    as if contiguous (``np.negative(g[:, 0:1], out=o[:, 0:1])`` writes ``-g.flat[:3]``), so
    the numpy backend's LSTM is wrong there (GRU and RNN pass, see CASES)."""
    names, feed = layer_inputs("LSTM", "bidirectional", init=True, peep=True, hidden=1,
                               lens=[5, 2, 4])
    model = forward_model("LSTM", "bidirectional", {}, names, feed)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, feed)
    check_launch_arguments(launches_of(sess.plan_for(feed)), sess.plan_for(feed), signatures)
    assert_close(got, ort_run(model, feed), ["Y", "Y_h", "Y_c"])


FLOWS = [  # (id, op, direction, attrs, options, outputs whose gradient flows)
    ("lstm-only-y_h", "LSTM", "bidirectional", {}, {"lens": [5, 2, 4], "peep": True}, ("Y_h",)),
    ("lstm-only-y_c", "LSTM", "forward", {}, {"init": True}, ("Y_c",)),
    ("gru-only-y", "GRU", "bidirectional", {}, {"lens": [5, 2, 4], "init": True}, ("Y",)),
    ("rnn-only-y_h-layout1", "RNN", "reverse", {"layout": 1}, {"layout": 1, "init": True},
     ("Y_h",)),
]


@pytest.mark.parametrize("op, direction, attrs, options, flows", [c[1:] for c in FLOWS],
                         ids=[c[0] for c in FLOWS])
def test_backward_with_some_output_gradients_absent(device, signatures, op, direction, attrs,
                                                    options, flows):
    names, feed = layer_inputs(op, direction, **options)
    model, cots = training_model(op, direction, attrs, names, feed, flows)
    want, got, _ = run_both(model, {**feed, **cots}, device, signatures)
    assert_close(got, want, [o.name for o in model.graph.output])


HALF = [c for c in CASES if c[0] in ("lstm-bidirectional-lens-init-peepholes",
                                     "lstm-clip-input-forget-peepholes",
                                     "gru-bidirectional-linear-before-reset-lens",
                                     "gru-clip-linear-before-reset", "rnn-reverse-lens-init")]


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("op, direction, attrs, options", [c[1:] for c in HALF],
                         ids=[c[0] for c in HALF])
def test_half_storage_forward_and_backward(device, signatures, op, direction, attrs, options,
                                           dt):
    """float16 / bfloat16 storage, fp32 compute; with clip, a value clipped to the bound
    rounded to the storage type stays outside the derivative's mask, as NumPy's."""
    dtype = {"f16": np.float16, "bf16": BFLOAT16}[dt]
    names, feed = layer_inputs(op, direction, dtype=dtype, **options)
    want, got, kernels = run_both(forward_model(op, direction, attrs, names, feed), feed,
                                  device, signatures)
    assert_close(got, want, ["Y", "Y_h", "Y_c"][:len(want)])
    assert f"tr_matmul_{dt}" in kernels
    model, cots = training_model(op, direction, attrs, names, feed, ("Y", "Y_h", "Y_c"))
    want, got, _ = run_both(model, {**feed, **cots}, device, signatures)
    assert_close(got, want, [o.name for o in model.graph.output])


# ---- training: classifiers, three SGD steps on cuda (emulated) against numpy ---------------------

N, T, F, H, K = 4, 6, 5, 7, 3


def classifier(op: str, direction: str, attrs: dict) -> onnx.ModelProto:
    """x [T, N, F] -> ``op`` (hidden H, every weight an initializer) -> Y_h [D, N, H] ->
    Transpose, Flatten [N, D*H] -> Gemm -> scores [N, K]."""
    rng = np.random.default_rng(11)
    dirs, g = 2 if direction == "bidirectional" else 1, GATES[op]
    inits = {"W": rng.standard_normal((dirs, g * H, F)) * 0.4,
             "R": rng.standard_normal((dirs, g * H, H)) * 0.4,
             "B": rng.standard_normal((dirs, 2 * g * H)) * 0.1,
             "fc": rng.standard_normal((dirs * H, K)) * 0.4, "fc_b": np.zeros(K)}
    nodes = [helper.make_node(op, ["x", "W", "R", "B"], ["Y", "Y_h"], hidden_size=H,
                              direction=direction, **attrs),
             helper.make_node("Transpose", ["Y_h"], ["h_t"], perm=[1, 0, 2]),
             helper.make_node("Flatten", ["h_t"], ["h"], axis=1),
             helper.make_node("Gemm", ["h", "fc", "fc_b"], ["scores"])]
    graph = helper.make_graph(
        nodes, f"{op.lower()}_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, N, F])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [N, K])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def torch_bilstm() -> onnx.ModelProto:
    """torch.nn.LSTM (bidirectional, batch_first) -> the last step -> Linear, exported with
    the classic exporter: the LSTM node's initial states come from Shape/Expand chains, its
    output through Transpose/Reshape/Gather."""
    import io

    import torch

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.rnn = torch.nn.LSTM(F, H, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(2 * H, K)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y[:, -1])

    f = io.BytesIO()
    torch.onnx.export(Classifier(), torch.zeros(N, T, F), f, dynamo=False, input_names=["x"],
                      output_names=["scores"])
    return onnx.load_from_string(f.getvalue())


TRAIN = {  # case: (model factory, the shape of x, the cell)
    "lstm-bidirectional": (lambda: classifier("LSTM", "bidirectional", {}), (T, N, F), "lstm"),
    "gru-linear-before-reset": (lambda: classifier("GRU", "forward",
                                                   {"linear_before_reset": 1}), (T, N, F),
                                "gru"),
    "torch-bilstm-classic-export": (torch_bilstm, (N, T, F), "lstm"),
}


def train(case: str, backend: str, **kw):
    make, shape, _ = TRAIN[case]
    rng = np.random.default_rng(12)
    batches = [({"x": rng.standard_normal(shape).astype(np.float32)}, rng.integers(0, K, N))
               for _ in range(3)]
    sess = tr_onnx.TrainingSession(make(), loss="cross_entropy", optimizer=SGD(lr=0.1),
                                   backend=backend, **kw)
    return sess, [sess.train_step(*b) for b in batches]


@pytest.mark.parametrize("case", list(TRAIN))
def test_a_classifier_trains_three_sgd_steps_on_cuda_as_on_numpy(device, signatures, case):
    ref, want = train(case, "numpy")
    sess, got = train(case, CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() and len(b) == 5  # W, R, B and the head's weight and bias
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    op = TRAIN[case][-1]
    names = {c.kernel.name for c in launches}
    assert {f"tr_{op}_fwd_gates_f32" if op == "gru" else f"tr_{op}_fwd_f32",
            f"tr_{op}_bwd_gates_f32" if op == "gru" else f"tr_{op}_bwd_f32"} <= names
