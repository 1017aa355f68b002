"""The cuda bindings of the ONNX training ops (``ai.onnx.preview.training`` Adam, Momentum,
Adagrad: backends/cuda/ops/optimizers.py), the random draws (backends/cuda/ops/random.py,
kernels/random.cu) and the quantization family (backends/cuda/ops/quantize.py,
kernels/quantize.cu), checked without a GPU: single-node models run on ``backend="cuda"``
through the host emulator (the kernels' g++ build) against ``backend="numpy"``, launch
arguments checked against the kernels' C signatures; then a QAT model trained three SGD steps
on both backends.

Tolerances, per kernel:

* Adam / Momentum / Adagrad: the numpy kernel's float32 sequence operation by operation (the
  Python scalars rounded to float32 as NumPy's weak scalars are; no FMA), so bit-exact; also
  equal to onnx.reference's ops (rtol 1e-6: it evaluates some steps in float64).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_cuda_executor_cpu import check_launch_arguments, kernel_signatures

import tr_onnx
from tr_onnx.backends.cuda.bind import Launch
from tr_onnx.testing.host_emulator import build_host_library, host_emulator

PREVIEW = "ai.onnx.preview.training"
ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
        np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
        np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.bool_): TensorProto.BOOL}


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    return host_emulator(build_host_library(tmp_path_factory.mktemp("misc_host")))


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def single_node(op: str, feeds: dict, consts: dict, attrs: dict, outputs, opset: int = 21,
                domain: str = "", order: list[str] | None = None,
                out_types: dict | None = None) -> onnx.ModelProto:
    """A model of one ``op`` node over graph inputs ``feeds`` and initializers ``consts``
    (inputs in ``order``, default feeds then consts; '' for an absent one); outputs typed by
    ``out_types`` ({name: (elem type, shape)}) or else by ONNX shape inference."""
    inputs = [helper.make_tensor_value_info(k, ELEM[np.dtype(v.dtype)], v.shape)
              for k, v in feeds.items()]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    node = helper.make_node(op, order or [*feeds, *consts], outputs, domain=domain, **attrs)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain
                                                 else [])
    if out_types is not None:
        outs = [helper.make_tensor_value_info(o, *out_types[o]) for o in outputs]
        graph = helper.make_graph([node], op, inputs, outs, inits)
        return helper.make_model(graph, opset_imports=opsets)
    graph = helper.make_graph([node], op, inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=opsets)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    typed = {vi.name: vi for vi in inferred.graph.value_info}
    del model.graph.output[:]
    model.graph.output.extend(typed[o] for o in outputs)
    return model


def launches_of(plan) -> list[Launch]:
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


def run_cuda(model, feeds, device, signatures, runs: int = 1):
    """(the cuda session's outputs of its last run, its plan's kernel names), the launches
    checked against the kernels' C signatures."""
    sess = tr_onnx.InferenceSession(model, backend="cuda", device=device)
    for _ in range(runs):
        got = sess.run(None, feeds)
    plan = sess.plan_for(feeds)
    launches = launches_of(plan)
    check_launch_arguments(launches, plan, signatures)
    return got, [c.kernel.name for c in launches]


def run_numpy(model, feeds, runs: int = 1):
    sess = tr_onnx.InferenceSession(model)
    for _ in range(runs):
        got = sess.run(None, feeds)
    return got


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def assert_bits_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(bits(g), bits(w))


# ---- ai.onnx.preview.training Adam / Momentum / Adagrad ------------------------------------

PREVIEW_OPS = [  # op, attributes, tensors per tuple (X, G, V[, H]), tuples, step T
    ("Adam", {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-7, "norm_coefficient": 0.01,
              "norm_coefficient_post": 0.02}, 4, 2, 3),
    ("Adam", {}, 4, 1, 0),
    ("Momentum", {"alpha": 0.9, "beta": 0.1, "norm_coefficient": 0.001, "mode": "standard"},
     3, 2, 2),
    ("Momentum", {"alpha": 0.95, "beta": 1.0, "norm_coefficient": 0.0, "mode": "nesterov"},
     3, 1, 5),
    ("Momentum", {"alpha": 0.5, "beta": 0.3, "norm_coefficient": 0.1, "mode": "standard"},
     3, 1, 0),
    ("Adagrad", {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.001}, 3, 3, 4),
    ("Adagrad", {}, 3, 1, 0),
]
PREVIEW_IDS = ["adam-2-tuples", "adam-defaults-t0", "momentum-2", "momentum-nesterov",
               "momentum-t0", "adagrad-3-tuples", "adagrad-defaults"]
SHAPES = [(5, 7), (33,), (2, 3, 4)]


def preview_case(op, attrs, per, count, step):
    rng = np.random.default_rng(7)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(step, np.int64)}
    names = "XGVH"[:per]
    for k, name in enumerate(names):
        for i in range(count):
            x = rng.standard_normal(SHAPES[i]).astype(np.float32)
            feeds[f"{name}{i}"] = np.abs(x) if name == "H" or (name == "V" and op == "Adagrad") \
                else x
    outs = [f"{name}{i}_new" for name in names if name != "G" for i in range(count)]
    types = {o: (TensorProto.FLOAT, feeds[o[:-4]].shape) for o in outs}
    model = single_node(op, feeds, {}, attrs, outs, domain=PREVIEW, out_types=types)
    return model, feeds


@pytest.mark.parametrize("op, attrs, per, count, step", PREVIEW_OPS, ids=PREVIEW_IDS)
def test_preview_training_op_equals_numpy_bit_for_bit(device, signatures, op, attrs, per,
                                                      count, step):
    model, feeds = preview_case(op, attrs, per, count, step)
    want = run_numpy(model, feeds)
    got, names = run_cuda(model, feeds, device, signatures)
    assert_bits_equal(got, want)
    assert names == [f"tr_preview_{op.lower()}_f32"] * count


@pytest.mark.parametrize("op, attrs, per, count, step",
                         [PREVIEW_OPS[0], PREVIEW_OPS[3], PREVIEW_OPS[5]],
                         ids=["adam", "momentum-nesterov", "adagrad"])
def test_preview_training_op_equals_onnx_reference(device, signatures, op, attrs, per, count,
                                                   step):
    from onnx.reference import ReferenceEvaluator

    model, feeds = preview_case(op, attrs, per, count, step)
    want = ReferenceEvaluator(model).run(None, feeds)
    got, _ = run_cuda(model, feeds, device, signatures)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
