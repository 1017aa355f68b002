"""The cuda bindings of the attention family (backends/cuda/ops/attention.py,
kernels/attention.cu) checked without a GPU: single-node models on ``backend="cuda"`` through
the host emulator (the kernels' g++ build) against ``backend="numpy"``, gradients through
three SGD steps of small models on both, and a tiny opset-23 decoder (RMSNormalization,
RotaryEmbedding, grouped-head causal Attention, SiLU MLP) trained on both.

Tolerances, justified by where the arithmetic differs from NumPy's:

* RotaryEmbedding (and its inverse) and Swish in float32: the same products and sums in the
  same order, rounded as NumPy rounds them (--fmad=false / -ffp-contract=off), and the same
  overflow-free sigmoid: RotaryEmbedding bit-exact (in bfloat16 too: the kernel rounds each
  product to the storage type as NumPy does); Swish within libm's expf against NumPy's exp
  (1 ulp, which the sigmoid's division and the product carry to 2 ulp): rtol 4e-7. In
  float16 / bfloat16, NumPy rounds every intermediate of the sigmoid to the storage type where
  the kernel keeps float32 between its two roundings (alpha x and the sigmoid): one step of
  the storage type (2^-10 / 2^-7 relative).
* RMSNormalization and its gradient: the row sums (of x^2, of g xhat) are fp64 in the kernel,
  NumPy's float32 pairwise/einsum order: at most m ulp of float32 on rows of m <= 32 terms
  before the normalisation divides them, so rtol 2e-6 in float32; the scale's gradient sums
  rows x lanes terms of mixed signs: atol 1e-6 on O(1) values.
* Attention: every dot product (q.k over d lanes, P V over t keys) is fp64 in the kernel and
  float32 BLAS in NumPy (d, t <= 16: <= 16 ulp of the sum of magnitudes, about 1e-6 on O(1)
  values), the softmax's sum likewise, and libm's expf / tanhf differ by an ulp: rtol 1e-5,
  atol 2e-6 in float32. In float16 / bfloat16 the outputs are both rounded from float32
  values that agree to ~1e-6, so they are equal or one storage step apart (2^-10 / 2^-7
  relative; atol 2^-12 / 2^-9 for values near zero).
* training: losses and parameters after three SGD steps rtol 2e-5 / atol 1e-6 (the numbers
  above, three times, through the MatMuls, which run as their numpy kernels in the emulator).
  The decoder trains at lr 0.05: after one step of lr 0.5 its parameters agree to 2e-7, but
  that rate blows the embedding up (|emb| ~ 50 by step three) and amplifies any summation
  difference 1000-fold.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulated_cuda import launches_of, typed_outputs
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.dtypes import BFLOAT16
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.bool_): TensorProto.BOOL}
FLOATS = {"f32": np.float32, "f16": np.float16, "bf16": BFLOAT16}
CLOSE = {"f32": dict(rtol=1e-5, atol=2e-6), "f16": dict(rtol=2 ** -10, atol=2 ** -12),
         "bf16": dict(rtol=2 ** -7, atol=2 ** -9)}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("attention_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def single_node(op: str, feeds: dict, consts: dict, attrs: dict, outputs: list[str],
                opset: int, order: list[str] | None = None) -> onnx.ModelProto:
    """One ``op`` node over graph inputs ``feeds`` and initializers ``consts`` (inputs in
    ``order``, default feeds then consts; '' for an absent input or output)."""
    inputs = [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
              for k, v in feeds.items()]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    node = helper.make_node(op, order or [*feeds, *consts], outputs, **attrs)
    graph = helper.make_graph([node], op, inputs, [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return typed_outputs(model, outputs)


def run_both(model, feeds, device, signatures):
    """(numpy's outputs, cuda's outputs, the cuda plan's kernel names); the launches'
    arguments checked against the kernels' C signatures."""
    want = tr_onnx.InferenceSession(model).run(None, feeds)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, feeds)
    plan = sess.plan_for(feeds)
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    return want, got, [c.kernel.name for c in launches]


def assert_close(got, want, **tol):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **tol)


def data(shape, dt, seed=0, scale=1.0):
    x = scale * np.random.default_rng(seed).standard_normal(shape)
    return x.astype(FLOATS[dt] if dt in FLOATS else dt)


# ---- RMSNormalization, Swish, RotaryEmbedding -----------------------------------------------

RMS = [  # x shape, scale shape, axis
    ((3, 5, 8), (8,), -1),
    ((2, 3, 4, 6), (4, 6), -2),
    ((2, 3, 4, 6), (6,), 2),  # the scale repeats inside each row of 24
    ((4, 32), (1, 32), 1),
]


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("shape, sshape, axis", RMS,
                         ids=["last-axis", "two-axes", "scale-repeats", "scale-leading-one"])
def test_rms_normalization_equals_numpy(device, signatures, shape, sshape, axis, dt):
    x, scale = data(shape, dt), data(sshape, dt, seed=1)
    model = single_node("RMSNormalization", {"x": x, "s": scale}, {},
                        {"axis": axis, "epsilon": 1e-3}, ["y"], opset=23)
    want, got, names = run_both(model, {"x": x, "s": scale}, device, signatures)
    assert_close(got, want, **({"rtol": 2e-6, "atol": 1e-7} if dt == "f32" else CLOSE[dt]))
    assert names == [f"tr_rms_norm_fwd_{dt}"]


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("alpha", [1.0, 0.7], ids=["silu", "alpha"])
def test_swish_equals_numpy(device, signatures, alpha, dt):
    x = data((4, 7, 5), dt, scale=4.0)
    model = single_node("Swish", {"x": x}, {}, {"alpha": alpha}, ["y"], opset=24)
    want, got, names = run_both(model, {"x": x}, device, signatures)
    assert_close(got, want, **({"rtol": 4e-7, "atol": 0} if dt == "f32" else CLOSE[dt]))
    assert names == [f"tr_swish_{dt}"]


ROTARY = {  # x shape, attributes, with position_ids (True), or caches shared by the batch
    "4d": ((2, 3, 5, 8), {}, False),
    # the dynamo exporter's Llama: cos/sin [1, seq, rot / 2] caches broadcast over the batch
    "4d-caches-shared-by-the-batch": ((3, 2, 5, 8), {}, "shared"),
    "3d-caches-shared-by-the-batch": ((3, 5, 16), {"num_heads": 2}, "shared"),
    "4d-interleaved": ((2, 3, 5, 8), {"interleaved": 1}, False),
    "3d-heads-positions": ((2, 5, 24), {"num_heads": 3}, True),
    "partial-rotary-dim": ((2, 3, 5, 8), {"rotary_embedding_dim": 4}, True),
    "partial-interleaved-3d": ((2, 5, 16), {"num_heads": 2, "rotary_embedding_dim": 6,
                                            "interleaved": 1}, False),
}


def rotary_feeds(shape, attrs, positions, dt):
    heads = attrs.get("num_heads")
    d = shape[2] // heads if heads else shape[3]
    half = attrs.get("rotary_embedding_dim", d) // 2
    b, s = shape[0], shape[1] if heads else shape[2]
    x = data(shape, dt)
    if positions is True:
        angles = np.arange(10)[:, None] * 0.3 / (1 + np.arange(half))[None, :]
        pos = np.random.default_rng(2).integers(0, 10, (b, s))
        feeds = {"x": x, "cos": np.cos(angles).astype(x.dtype),
                 "sin": np.sin(angles).astype(x.dtype), "pos": pos}
    else:
        angles = np.random.default_rng(3).uniform(-3, 3, (1 if positions else b, s, half))
        feeds = {"x": x, "cos": np.cos(angles).astype(x.dtype),
                 "sin": np.sin(angles).astype(x.dtype)}
    return feeds


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("form", list(ROTARY))
def test_rotary_embedding_equals_numpy(device, signatures, form, dt):
    shape, attrs, positions = ROTARY[form]
    feeds = rotary_feeds(shape, attrs, positions, dt)
    model = single_node("RotaryEmbedding", feeds, {}, attrs, ["y"], opset=23)
    want, got, names = run_both(model, feeds, device, signatures)
    assert_close(got, want, rtol=0, atol=0)  # the same roundings in the same order
    assert names == [f"tr_rotary_{dt}"]


# ---- Attention ------------------------------------------------------------------------------

B, SQ, SKV, D = 2, 5, 6, 8
ATTENTION = {  # id: (Q, K, V shapes, attributes, extra inputs {name: array maker}, outputs)
    "4d": (((B, 4, SQ, D), (B, 4, SKV, D), (B, 4, SKV, 6)), {}, {}),
    "causal-3d": (((B, SQ, 32), (B, SKV, 32), (B, SKV, 32)),
                  {"is_causal": 1, "q_num_heads": 4, "kv_num_heads": 4}, {}),
    "bool-mask": (((B, 4, SQ, D), (B, 4, SKV, D), (B, 4, SKV, D)), {},
                  {"mask": lambda dt: np.random.default_rng(5).random((SQ, SKV)) > 0.3}),
    "bool-mask-dead-row": (((B, 2, SQ, D), (B, 2, SKV, D), (B, 2, SKV, D)), {},
                           {"mask": lambda dt: np.arange(SQ * SKV).reshape(SQ, SKV) % 7 > 0
                            & (np.arange(SQ) != 2)[:, None]}),
    "short-bool-mask": (((B, 2, SQ, D), (B, 2, SKV, D), (B, 2, SKV, D)), {},
                        {"mask": lambda dt: np.random.default_rng(6).random((B, 1, SQ, 4)) > .2}),
    "float-mask": (((B, 4, SQ, D), (B, 4, SKV, D), (B, 4, SKV, D)), {},
                   {"mask": lambda dt: data((B, 1, SQ, SKV), dt, seed=7)}),
    "gqa-3d": (((B, SQ, 32), (B, SKV, 16), (B, SKV, 8)),
               {"q_num_heads": 4, "kv_num_heads": 2}, {}),
    "gqa-causal-4d": (((B, 6, SQ, D), (B, 2, SKV, D), (B, 2, SKV, D)), {"is_causal": 1}, {}),
    "scale": (((B, 4, SQ, D), (B, 4, SKV, D), (B, 4, SKV, D)), {"scale": 0.3}, {}),
    "softcap": (((B, 4, SQ, D), (B, 4, SKV, D), (B, 4, SKV, D)),
                {"softcap": 1.5, "scale": 1.0}, {}),
    "past-causal": (((B, 2, SQ, D), (B, 2, SQ, D), (B, 2, SQ, D)), {"is_causal": 1},
                    {"past_key": lambda dt: data((B, 2, 3, D), dt, seed=8),
                     "past_value": lambda dt: data((B, 2, 3, D), dt, seed=9)}),
}


def attention_case(form, dt):
    shapes, attrs, extra = ATTENTION[form]
    feeds = {n: data(s, dt, seed=k, scale=1.5) for k, (n, s) in enumerate(zip("qkv", shapes))}
    feeds.update({n: make(dt) for n, make in extra.items()})
    order = ["q", "k", "v", "mask" if "mask" in feeds else "",
             *(["past_key", "past_value"] if "past_key" in feeds else [])]
    outputs = ["y", "present_key", "present_value"] if "past_key" in feeds else ["y"]
    return feeds, attrs, order, outputs


@pytest.mark.parametrize("dt", list(FLOATS))
@pytest.mark.parametrize("form", list(ATTENTION))
def test_attention_equals_numpy(device, signatures, form, dt):
    feeds, attrs, order, outputs = attention_case(form, dt)
    model = single_node("Attention", feeds, {}, attrs, outputs, opset=23, order=order)
    want, got, names = run_both(model, feeds, device, signatures)
    assert_close(got, want, **CLOSE[dt])
    present = [f"tr_attention_present_{dt}"] * 2 if len(outputs) == 3 else []
    assert names == [f"tr_attention_fwd_{dt}", *present]


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output_modes_equal_numpy(device, signatures, mode):
    feeds, attrs, order, _ = attention_case("float-mask", "f32")
    model = single_node("Attention", feeds, {},
                        {"softcap": 2.0, "is_causal": 1, "qk_matmul_output_mode": mode},
                        ["y", "", "", "qk"], opset=23, order=order)
    want, got, _ = run_both(model, feeds, device, signatures)
    got[1][np.isneginf(want[1]) & np.isneginf(got[1])] = 0  # hidden keys: -inf on both
    want[1][np.isneginf(want[1])] = 0
    assert_close(got, want, **CLOSE["f32"])


def test_attention_nonpad_kv_seqlen_equals_numpy(device, signatures):
    feeds, _, _, _ = attention_case("4d", "f32")
    feeds["nonpad"] = np.array([4, 6], np.int64)
    model = single_node("Attention", feeds, {}, {"is_causal": 1}, ["y"], opset=24,
                        order=["q", "k", "v", "", "", "", "nonpad"])
    want, got, _ = run_both(model, feeds, device, signatures)
    assert_close(got, want, **CLOSE["f32"])


@pytest.mark.parametrize("left, right", [(2, -1), (1, 1), (-1, 0)],
                         ids=["left-window-causal", "band", "right-bound-only"])
def test_attention_sliding_windows_of_opset_25_equal_numpy(device, signatures, left, right):
    feeds, _, order, _ = attention_case("past-causal", "f32")
    model = single_node("Attention", feeds, {},
                        {"is_causal": int(right < 0), "left_window_size": left,
                         "right_window_size": right}, ["y"], opset=25, order=order)
    want, got, _ = run_both(model, feeds, device, signatures)
    assert_close(got, want, **CLOSE["f32"])


# ---- gradients: three SGD steps of x -> projections -> op -> MSE ----------------------------

E, S = 16, 5


def _init(name, shape, seed, scale=0.3):
    return numpy_helper.from_array(data(shape, "f32", seed, scale), name)


def attention_model(form: str) -> onnx.ModelProto:
    """x [B, S, E] -> Q, K, V projections (3-D, heads by attribute) -> Attention(form) -> y.
    Trainable: the projections, and per form a float mask or the past key / value."""
    hq, hkv, d = 4, 2 if "gqa" in form else 4, 8 if "d8" in form else 4
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": int("causal" in form)}
    if "softcap" in form:
        attrs["softcap"] = 1.5
    inits = [_init("wq", (E, hq * d), 1), _init("wk", (E, hkv * d), 2),
             _init("wv", (E, hkv * d), 3)]
    ins = ["q", "k", "v"]
    if "float-mask" in form:
        inits.append(_init("mask", (S, S), 4, 1.0))
        ins.append("mask")
    elif "bool-mask" in form:
        mask = np.random.default_rng(4).random((B, 1, S, S)) > 0.3
        inits.append(numpy_helper.from_array(mask, "mask"))
        ins.append("mask")
    if "past" in form:
        ins += [""] * (4 - len(ins)) + ["past_key", "past_value"]
        inits += [_init("past_key", (B, hkv, 3, d), 5, 1.0),
                  _init("past_value", (B, hkv, 3, d), 6, 1.0)]
    nodes = [helper.make_node("MatMul", ["x", w], [o]) for w, o in
             (("wq", "q"), ("wk", "k"), ("wv", "v"))]
    outs = ["y", "present_key", "present_value"] if "past" in form else ["y"]
    if "qk-mode" in form:  # y + the qk_matmul_output summed over heads and keys, per query
        attrs["qk_matmul_output_mode"] = int(form[-1])
        outs = ["att", "", "", "qk"]
        inits += [numpy_helper.from_array(np.array([k]), f"axis{k}") for k in (1, 3)]
        nodes += [helper.make_node("ReduceSum", ["qk", "axis3"], ["qk_keys"], keepdims=0),
                  helper.make_node("ReduceSum", ["qk_keys", "axis1"], ["qk_sum"], keepdims=0),
                  helper.make_node("Unsqueeze", ["qk_sum", "last"], ["qk_col"]),
                  helper.make_node("Add", ["att", "qk_col"], ["y"])]
        inits.append(numpy_helper.from_array(np.array([2]), "last"))
    nodes.insert(3, helper.make_node("Attention", ins, outs, **attrs))
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [B, S, E])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [B, S, hq * d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def rms_rotary_model(form: str) -> onnx.ModelProto:
    """x [B, S, E] -> MatMul -> RMSNormalization (trainable scale) -> RotaryEmbedding (3-D, 4
    heads, positions) -> Swish -> y."""
    rot = {"interleaved": 1} if "interleaved" in form else {"rotary_embedding_dim": 2}
    angles = np.arange(8)[:, None] * 0.4 / (1 + np.arange(rot.get("rotary_embedding_dim", 4)
                                                       // 2))[None, :]
    inits = [_init("w", (E, E), 1), _init("scale", (E,), 2, 1.0),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
             numpy_helper.from_array(np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]), "pos")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("RMSNormalization", ["h", "scale"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("RotaryEmbedding", ["n", "cos", "sin", "pos"], ["r"], num_heads=4,
                              **rot),
             helper.make_node("Swish", ["r"], ["y"], alpha=0.8)]
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [B, S, E])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [B, S, E])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


GRAD_MODELS = {
    "plain": (attention_model, {"tr_attention_bwd_rows_f32", "tr_attention_bwd_kv_f32"}),
    "gqa-causal": (attention_model, {"tr_attention_bwd_rows_f32"}),
    "softcap-causal": (attention_model, {"tr_attention_bwd_rows_f32"}),
    "float-mask": (attention_model, {"tr_attention_bwd_mask_f32"}),
    "bool-mask-gqa": (attention_model, {"tr_attention_bwd_kv_f32"}),
    "past-gqa-causal": (attention_model, {"tr_attention_bwd_kv_f32"}),
    **{f"softcap-float-mask-qk-mode-{m}": (attention_model, {"tr_attention_bwd_mask_f32"})
       for m in range(4)},
    "rms-rotary-swish": (rms_rotary_model, {"tr_rms_norm_bwd_dx_f32",
                                            "tr_rms_norm_bwd_scale_f32", "tr_rotary_f32"}),
    "rms-rotary-interleaved": (rms_rotary_model, {"tr_rotary_f32", "tr_swish_f32"}),
}


def train(model, out_shape, backend, **kw):
    """Three SGD steps; every float initializer but the rotary caches trains (a float mask
    and past key / value are constants by default: Attention declares no parameter inputs)."""
    trainable = [t.name for t in model.graph.initializer
                 if t.data_type == TensorProto.FLOAT and t.name not in ("cos", "sin")]
    # the qk_matmul_output sums (heads x keys scores per query) take a small step
    lr = 0.005 if "qk-mode" in model.graph.name else 0.5
    sess = tr_onnx.TrainingSession(model, loss="mse", optimizer=SGD(lr=lr), backend=backend,
                                   trainable=trainable, **kw)
    rng = np.random.default_rng(11)
    losses = [float(sess.train_step({"x": rng.standard_normal((B, S, E)).astype(np.float32)},
                                    rng.standard_normal(out_shape).astype(np.float32)))
              for _ in range(3)]
    return sess, losses


def assert_trains_alike(model, out_shape, device, signatures, kernels):
    ref, want = train(model, out_shape, "numpy")
    sess, got = train(model, out_shape, CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys()
    for name in b:
        if name not in ("cos", "sin"):  # RotaryEmbedding's caches get no gradient
            assert not np.array_equal(b[name], model_init(model, name)), f"{name} is untrained"
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    assert kernels <= {c.kernel.name for c in launches}


def model_init(model, name):
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


@pytest.mark.parametrize("form", list(GRAD_MODELS))
def test_three_sgd_steps_on_cuda_equal_numpy(device, signatures, form):
    make, kernels = GRAD_MODELS[form]
    model = make(form)
    out = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert_trains_alike(model, out, device, signatures, kernels)


# ---- a tiny opset-23 decoder ----------------------------------------------------------------

VOCAB, HQ, HKV, HD = 11, 4, 2, 4


def tiny_decoder() -> onnx.ModelProto:
    """A Llama-shaped decoder block at opset 23, as torch's dynamo exporter writes one: token
    embedding (Gather) -> RMSNormalization -> Q/K/V projections -> RotaryEmbedding on Q and K
    (3-D, by position) -> causal Attention with grouped key/value heads -> output projection
    and residual -> RMSNormalization -> SiLU MLP (Sigmoid * x) -> residual -> y [B, S, E]."""
    angles = np.arange(S)[:, None] / (10.0 ** (np.arange(HD // 2) / 2))[None, :]
    inits = [_init("emb", (VOCAB, E), 1, 1.0), _init("n1", (E,), 2, 1.0),
             _init("n2", (E,), 3, 1.0), _init("wq", (E, HQ * HD), 4),
             _init("wk", (E, HKV * HD), 5), _init("wv", (E, HKV * HD), 6),
             _init("wo", (HQ * HD, E), 7), _init("w1", (E, 24), 8), _init("w2", (24, E), 9),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
             numpy_helper.from_array(np.tile(np.arange(S), (B, 1)), "pos")]
    n = helper.make_node
    nodes = [n("Gather", ["emb", "tokens"], ["h0"]),
             n("RMSNormalization", ["h0", "n1"], ["a"], axis=-1, epsilon=1e-5),
             n("MatMul", ["a", "wq"], ["q0"]), n("MatMul", ["a", "wk"], ["k0"]),
             n("MatMul", ["a", "wv"], ["v"]),
             n("RotaryEmbedding", ["q0", "cos", "sin", "pos"], ["q"], num_heads=HQ),
             n("RotaryEmbedding", ["k0", "cos", "sin", "pos"], ["k"], num_heads=HKV),
             n("Attention", ["q", "k", "v"], ["att"], is_causal=1, q_num_heads=HQ,
               kv_num_heads=HKV),
             n("MatMul", ["att", "wo"], ["o"]), n("Add", ["h0", "o"], ["h1"]),
             n("RMSNormalization", ["h1", "n2"], ["c"], axis=-1, epsilon=1e-5),
             n("MatMul", ["c", "w1"], ["u"]), n("Sigmoid", ["u"], ["su"]),
             n("Mul", ["u", "su"], ["g"]), n("MatMul", ["g", "w2"], ["m"]),
             n("Add", ["h1", "m"], ["y"])]
    graph = helper.make_graph(nodes, "tiny_decoder", [helper.make_tensor_value_info(
        "tokens", TensorProto.INT64, [B, S])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [B, S, E])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_a_tiny_opset_23_decoder_trains_three_sgd_steps_as_on_numpy(device, signatures):
    def run(backend, **kw):
        sess = tr_onnx.TrainingSession(tiny_decoder(), loss="mse", optimizer=SGD(lr=0.05),
                                       backend=backend, **kw)
        rng = np.random.default_rng(12)
        return sess, [float(sess.train_step({"tokens": rng.integers(0, VOCAB, (B, S))},
                                            rng.standard_normal((B, S, E)).astype(np.float32)))
                      for _ in range(3)]

    ref, want = run("numpy")
    sess, got = run(CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=2e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() and {"emb", "n1", "n2", "wq", "wk", "wv"} <= b.keys()
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=1e-6, err_msg=name)
    plan = sess._state.active
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    assert {"tr_attention_fwd_f32", "tr_attention_bwd_rows_f32", "tr_attention_bwd_kv_f32",
            "tr_rms_norm_fwd_f32", "tr_rms_norm_bwd_dx_f32", "tr_rms_norm_bwd_scale_f32",
            "tr_rotary_f32"} <= {c.kernel.name for c in launches}


# ---- MatMulBias (the inference fold of MatMul + Add) -----------------------------------------


@pytest.mark.parametrize("shape, path", [((6, 8), "cudnn"), ((2, 5, 8), "cudnn"),
                                         ((2, 3, 4, 8), "kernels")],
                         ids=["rank2-graph", "rank3-graph", "rank4-kernel-and-add"])
def test_matmul_bias_equals_numpy_by_graph_or_kernels(device, signatures, shape, path):
    """The fold makes one MatMulBias of MatMul(x, w) + bias: Gemm's cuDNN graph with the bias
    epilogue (run as the numpy kernel in the emulator), or, where no matmul graph describes
    it (rank 4), the batched kernel then the broadcast add: fp64 dot products against
    NumPy's float32 BLAS over 8 terms, rtol 1e-6."""
    x = data(shape, "f32")
    w, bias = data((8, 5), "f32", seed=1), data((5,), "f32", seed=2)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"],
                                                                         ["y"])],
        "matmul_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*shape[:-1], 5])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    want = tr_onnx.InferenceSession(model).run(None, {"x": x})
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, {"x": x})
    assert_close(got, want, rtol=1e-6, atol=1e-7)
    plan = sess.plan_for({"x": x})
    (bound,) = [bn for bn in plan.executor.bound if bn.node.op_type == "MatMulBias"]
    if path == "cudnn":
        (call,) = bound.calls
        assert call.desc.kind == "matmul" and call.desc.epilogue == ("bias",)
    else:
        assert [c.kernel.name for c in bound.calls] == ["tr_matmul_f32", "tr_bcast_binary_f32"]
    check_launch_arguments(launches_of(plan), plan, signatures)


# ---- cuDNN's SDPA graph (opt-in: TR_ONNX_CUDNN_SDPA=1) ----------------------------------------

SDPA_FORMS = {"causal-3d": True, "float-mask": True, "gqa-causal-4d": True, "scale": True,
              "4d": False, "gqa-3d": False, "softcap": False, "bool-mask": False,
              "past-causal": False}
"""Form -> whether cuDNN's SDPA computes it (bfloat16): head sizes multiples of 8 (4d's V has
6, gqa-3d's 4: cuDNN's validate refuses them), no softcap, boolean mask or past."""


@pytest.mark.parametrize("form", list(SDPA_FORMS))
def test_sdpa_is_chosen_per_node_where_asked_for_and_the_form_fits(device, signatures, form,
                                                                    monkeypatch):
    """With the opt-in, each node's bound calls say which path it took: one ``sdpa`` graph
    (emulated as the numpy kernel: this checks the description's tensors against the plan's
    slots and the wiring, not cuDNN's numbers) or the row kernel."""
    from tr_onnx.backends.cuda.bind import CudnnCall
    from tr_onnx.backends.cuda.ops.attention import SDPA_ENV

    monkeypatch.setenv(SDPA_ENV, "1")
    feeds, attrs, order, outputs = attention_case(form, "bf16")
    model = single_node("Attention", feeds, {}, attrs, outputs, opset=23, order=order)
    sess = tr_onnx.InferenceSession(model, backend=CudaBackend(device=device))
    got = sess.run(None, feeds)
    assert_close(got, tr_onnx.InferenceSession(model).run(None, feeds), **CLOSE["bf16"])
    plan = sess.plan_for(feeds)
    (bound,) = [bn for bn in plan.executor.bound if bn.node.op_type == "Attention"]
    if SDPA_FORMS[form]:
        (call,) = bound.calls
        assert isinstance(call, CudnnCall) and call.desc.kind == "sdpa"
        assert set(call.desc.inputs) == {"q", "k", "v"} | ({"bias"} if "mask" in feeds else set())
        assert call.desc.io_data_type == "BFLOAT16" and set(call.desc.outputs) == {"O"}
    else:
        assert bound.calls[0].kernel.name == "tr_attention_fwd_bf16"
    check_launch_arguments(launches_of(plan), plan, signatures)


@pytest.mark.parametrize("form", [f for f, fits in SDPA_FORMS.items() if fits])
def test_deviceless_cudnn_validates_the_sdpa_graph_and_declines_to_plan_it(form, monkeypatch):
    """The real cuDNN (an H200, deviceless) validates and lowers each SDPA graph; its
    heuristics then need the device, which is why the graph is opt-in (``SDPA_ENV``). Should
    a cuDNN plan it without one, this fails: then the default can change."""
    from tr_onnx.backends.cuda.bind import CudnnCall
    from tr_onnx.backends.cuda.cudnn_graphs import declare_pygraph
    from tr_onnx.backends.cuda.deviceless import device_properties, load_cudnn
    from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
    from tr_onnx.backends.cuda.ops.attention import SDPA_ENV
    from tr_onnx.testing.recorder import FakeRecorder

    monkeypatch.setenv(SDPA_ENV, "1")
    feeds, attrs, order, outputs = attention_case(form, "bf16")
    model = single_node("Attention", feeds, {}, attrs, outputs, opset=23, order=order)
    plan = tr_onnx.InferenceSession(model, backend=CudaBackend(device=lambda p: FakeRecorder(
        p.memory, policy=EXECUTOR_POLICY))).plan_for(feeds)
    (desc,) = [c.desc for bn in plan.executor.bound for c in bn.calls
               if isinstance(c, CudnnCall)]
    cudnn = load_cudnn()
    g = declare_pygraph(desc, cudnn, device_property=device_properties(cudnn)).graph
    g.validate()
    g.build_operation_graph()
    with pytest.raises(Exception, match="cuda_get_device"):
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])


SDPA_TRAIN = {"gqa-causal-d8": True, "float-mask-d8": True, "softcap-d8": False,
              "past-gqa-causal-d8": False}
"""Form -> whether cuDNN's SDPA graphs (forward with statistics, then backward) compute its
AttentionGrad (bfloat16, head size 8)."""


def sdpa_training_plan(form: str, device_factory):
    sess = tr_onnx.TrainingSession(attention_model(form), loss="mse", optimizer=SGD(lr=0.5),
                                   backend=CudaBackend(device=device_factory), precision="bf16",
                                   trainable=["wq", "wk", "wv"])
    return sess._train_plan({"x": np.zeros((B, S, E), np.float32)})


@pytest.mark.parametrize("form", list(SDPA_TRAIN))
def test_sdpa_backward_is_chosen_where_asked_for_and_its_graphs_decline_deviceless(
        form, monkeypatch):
    """With the opt-in, a bfloat16 training plan's AttentionGrad of a fitting form is two
    cuDNN graphs -- the forward writing O and the statistics into the node's scratch, then
    ``sdpa_backward`` -- and the real cuDNN (deviceless, an H200) validates and lowers both,
    then declines to plan them without the device; other forms keep the row kernels."""
    from tr_onnx.backends.cuda.cudnn_graphs import declare_pygraph
    from tr_onnx.backends.cuda.deviceless import device_properties, load_cudnn
    from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
    from tr_onnx.backends.cuda.ops.attention import SDPA_ENV
    from tr_onnx.testing.recorder import FakeRecorder

    monkeypatch.setenv(SDPA_ENV, "1")
    plan = sdpa_training_plan(form, lambda p: FakeRecorder(p.memory, policy=EXECUTOR_POLICY))
    (grad,) = [bn for bn in plan.executor.bound if bn.node.op_type == "AttentionGrad"]
    if not SDPA_TRAIN[form]:
        assert grad.calls[0].kernel.name == "tr_attention_bwd_rows_bf16"
        return
    assert [c.desc.kind for c in grad.calls] == ["sdpa", "sdpa_backward"]
    stats, backward = (c.desc for c in grad.calls)
    assert set(stats.outputs) == {"O", "Stats"} and stats.outputs["Stats"].data_type == "FLOAT"
    assert backward.inputs["o"].byte_offset == stats.outputs["O"].byte_offset
    assert set(backward.outputs) == {"dQ", "dK", "dV"}
    cudnn = load_cudnn()
    for desc in (stats, backward):
        g = declare_pygraph(desc, cudnn, device_property=device_properties(cudnn)).graph
        g.validate()
        g.build_operation_graph()
        with pytest.raises(Exception, match="cuda_get_device"):
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])


def test_sdpa_training_plan_runs_on_the_emulator_as_the_row_kernels(device, monkeypatch):
    """The two graphs' wiring (pointers inside the plan's slots, the node's scratch) on the
    emulator, where each graph runs as AttentionGrad's numpy kernel, against the same bfloat16
    plan on the row kernels (the numpy backend trains in float32 only): both compute in
    float32 and round to bfloat16, so gradients differ by at most one bfloat16 step (2^-8
    relative), the parameters after three steps of lr 0.5 by less than 2e-3 relative (here
    they agree exactly)."""
    from tr_onnx.backends.cuda.ops.attention import SDPA_ENV

    model = attention_model("gqa-causal-d8")

    def run(sdpa: bool):
        monkeypatch.setenv(SDPA_ENV, str(int(sdpa)))
        sess = tr_onnx.TrainingSession(model, loss="mse", optimizer=SGD(lr=0.5),
                                       backend=CudaBackend(device=device), precision="bf16",
                                       trainable=["wq", "wk", "wv"])
        rng = np.random.default_rng(13)
        losses = [float(sess.train_step(
            {"x": rng.standard_normal((B, S, E)).astype(np.float32)},
            rng.standard_normal((B, S, 32)).astype(np.float32))) for _ in range(3)]
        kinds = [c.desc.kind if hasattr(c, "desc") else c.kernel.name
                 for bn in sess._state.active.executor.bound for c in bn.calls
                 if bn.node.op_type in ("Attention", "AttentionGrad")]
        return sess.parameters(), losses, kinds

    params, got, kinds = run(True)
    ref, want, ref_kinds = run(False)
    assert kinds == ["sdpa", "sdpa", "sdpa_backward"]
    assert ref_kinds == ["tr_attention_fwd_bf16", "tr_attention_bwd_rows_bf16",
                         "tr_attention_bwd_kv_bf16"]
    np.testing.assert_allclose(got, want, rtol=2e-3)
    for name, w in ref.items():
        np.testing.assert_allclose(params[name], w, rtol=2e-3, atol=1e-4, err_msg=name)


def test_inspect_says_which_path_each_attention_node_takes(tmp_path, capsys):
    """``tr-onnx inspect --backend cuda`` names, per op, the path its nodes took: cuDNN graphs
    (the decoder's MatMuls) or tr_onnx's kernels, with why cuDNN's SDPA was not it."""
    import json

    from tr_onnx.cli import main as cli_main

    path = tmp_path / "decoder.onnx"
    onnx.save(tiny_decoder(), str(path))
    assert cli_main(["inspect", str(path), "--backend", "cuda", "--train", "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)["kernels"]}
    for op in ("Attention", "AttentionGrad"):
        (path_, count), = rows[op]["paths"].items()
        assert count == 1 and path_.startswith("tr_onnx kernels (cuDNN's SDPA instead where "
                                               "TR_ONNX_CUDNN_SDPA=1")
    assert rows["MatMul"]["paths"] == {"cuDNN matmul": rows["MatMul"]["count"]}
    assert cli_main(["inspect", str(path), "--backend", "cuda", "--train"]) == 0
    assert "x1 tr_onnx kernels (cuDNN's SDPA instead" in capsys.readouterr().out
