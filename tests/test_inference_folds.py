"""Inference plans fold Conv -> BatchNormalization into one Conv (passes.inference_folds): the
outputs still match onnxruntime, the BatchNormalization kernels are gone, and nothing is
folded where it must not be (a Conv output read twice, statistics fed at run time, a training
session's plans); and their parameters become constants (``freeze_parameters``), a training
session's stay parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx import ir

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def _ops(session) -> list[str]:
    (plan,) = session._plans.values()
    return [step.label.split("(")[1].split(",")[0] for step in plan.executor.steps]


def _ort(model_or_path, feed):
    source = model_or_path if isinstance(model_or_path, str) else \
        model_or_path.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("stem", ["resnet", "mobilenet"])
def test_zoo_models_fold_every_batchnorm_and_match_onnxruntime(stem):
    path = str(ZOO / f"{stem}.onnx")
    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 16, 16), np.float32)}
    session = tr_onnx.InferenceSession(path)
    ours = session.run(None, feed)
    assert "BatchNormalization" not in _ops(session)
    assert "Conv" in _ops(session)
    np.testing.assert_allclose(ours[0], _ort(path, feed)[0], rtol=1e-4, atol=1e-5)


def _conv_bn(extra_consumer: bool, stats_as_inputs: bool):
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    stats = {"scale": rng.uniform(0.5, 2, 4), "bias": rng.standard_normal(4),
             "mean": rng.standard_normal(4), "var": rng.uniform(0.5, 2, 4)}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])]
    for name, value in stats.items():
        if stats_as_inputs:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [4]))
        else:
            inits.append(numpy_helper.from_array(value.astype(np.float32), name))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", *stats], ["y"], epsilon=1e-3)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])]
    if extra_consumer:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 4, 6, 6]))
    graph = helper.make_graph(nodes, "conv_bn", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": rng.standard_normal((2, 3, 6, 6)).astype(np.float32)}
    if stats_as_inputs:
        feed.update({k: v.astype(np.float32) for k, v in stats.items()})
    return model, feed


@pytest.mark.parametrize("extra_consumer, stats_as_inputs, folded",
                         [(False, False, True), (True, False, False), (False, True, False)],
                         ids=["folded", "conv_read_twice", "statistics_fed"])
def test_fold_only_what_is_constant_and_read_once(extra_consumer, stats_as_inputs, folded):
    model, feed = _conv_bn(extra_consumer, stats_as_inputs)
    session = tr_onnx.InferenceSession(model)
    ours = session.run(None, feed)
    assert ("BatchNormalization" not in _ops(session)) == folded
    for a, b in zip(ours, _ort(model, feed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_training_session_plans_keep_batchnorm():
    session = tr_onnx.TrainingSession(str(ZOO / "resnet.onnx"), loss="cross_entropy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.01))
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16), np.float32)
    session.train_step({"input": x}, np.array([1, 2]))
    ops = [s.label for s in session._state.active.executor.steps]
    assert any("BatchNorm" in label for label in ops)


def _kinds(plan) -> set[str]:
    return {v.kind for v in plan.graph.values.values()}


def test_inference_parameters_are_constants_and_training_ones_are_not():
    path = str(ZOO / "lenet.onnx")
    x = np.random.default_rng(3).standard_normal((2, 1, 8, 8), np.float32)
    session = tr_onnx.InferenceSession(path)
    ours = session.run(None, {"input": x})
    (plan,) = session._plans.values()
    assert ir.PARAM not in _kinds(plan) and ir.CONST in _kinds(plan)
    np.testing.assert_allclose(ours[0], _ort(path, {"input": x})[0], rtol=1e-5, atol=1e-5)
    training = tr_onnx.TrainingSession(path, loss="cross_entropy",
                                       optimizer=tr_onnx.optim.SGD(lr=0.01))
    training.train_step({"input": x}, np.array([1, 2]))
    assert ir.PARAM in _kinds(training._state.active)
