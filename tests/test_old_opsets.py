"""Models of opset 1-9, as old model zoos and exporters wrote them (IR 3, initializers listed as
graph inputs, ``consumed_inputs``, ``is_test``, legacy ``broadcast``/``axis`` Adds, opset <= 6
per-channel PRelu slopes, opset 7-9 Dropout masks in x's type), import, run and train.

Oracles: onnxruntime on the same network written in opset 7's spelling (slope and bias as
[C, 1, 1], no broadcast attributes; onnxruntime runs nothing older than opset 7), and PyTorch
training the same network from the same weights (3 SGD steps, batch statistics)."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from oracles import assert_close_relative, ort_run

import tr_onnx

C, CLASSES = 4, 5
RNG = np.random.default_rng(0)
WEIGHTS = {"w": RNG.standard_normal((C, 3, 3, 3)), "s": 1 + 0.1 * RNG.standard_normal(C),
           "b": RNG.standard_normal(C), "m": 0.1 * RNG.standard_normal(C),
           "v": 0.5 + np.abs(RNG.standard_normal(C)), "slope": 0.25 * RNG.standard_normal(C),
           "bias4": RNG.standard_normal(C), "fw": 0.2 * RNG.standard_normal((CLASSES, 64)),
           "fb": RNG.standard_normal(CLASSES)}
WEIGHTS = {k: v.astype(np.float32) for k, v in WEIGHTS.items()}


def _legacy(opset: int, ratio: float = 0.3, mask_output: bool = False):
    """The network as an opset-``opset`` file would spell it."""
    old = opset < 7
    bn = {"epsilon": 1e-5, **({"is_test": 1} if old else {}),
          **({"consumed_inputs": [0, 0, 0, 1, 1]} if opset < 6 else {})}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], **bn),
             helper.make_node("PRelu", ["bn", "slope"], ["p"],
                              **({"consumed_inputs": [0, 0]} if opset < 6 else {})),
             helper.make_node("Dropout", ["p"], ["d", "mask"], ratio=ratio,
                              **({"is_test": 1} if old else {})),
             helper.make_node("Add", ["d", "bias4"], ["a"],
                              **({"broadcast": 1, "axis": 1} if old else {})),
             helper.make_node("MaxPool", ["a"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["mp"], ["f"], shape=[-1, 64]) if opset < 5 else
             helper.make_node("Flatten", ["mp"], ["f"]),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1,
                              **({"broadcast": 1} if old else {}))]
    weights = dict(WEIGHTS)
    if not old:  # opset 7's numpy broadcasting needs the channel axis spelled out
        weights["slope"] = weights["slope"].reshape(C, 1, 1)
        weights["bias4"] = weights["bias4"].reshape(C, 1, 1)
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, CLASSES])]
    if mask_output:
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, C, 8, 8]))
    graph = helper.make_graph(
        nodes, f"opset{opset}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])]
        + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits],
        outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 3
    return model


def _x(seed=1):
    return np.random.default_rng(seed).standard_normal((2, 3, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("opset", [1, 6, 7, 8, 9])
def test_a_legacy_file_runs_as_its_opset7_spelling_runs_in_onnxruntime(opset):
    session = tr_onnx.TrainingSession(_legacy(opset), backend="numpy")
    (y,) = session.run(["y"], {"x": _x()})
    (expected,) = ort_run(_legacy(7), {"x": _x()})
    assert_close_relative(y, expected, rel=1e-5)


def _torch_net():
    conv = torch.nn.Conv2d(3, C, 3, padding=1, bias=False)
    bn = torch.nn.BatchNorm2d(C, eps=1e-5, momentum=0.1)
    prelu = torch.nn.PReLU(C)
    bias4 = torch.nn.Parameter(torch.from_numpy(WEIGHTS["bias4"].reshape(C, 1, 1)).clone())
    fc = torch.nn.Linear(64, CLASSES)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(WEIGHTS["w"]))
        bn.weight.copy_(torch.from_numpy(WEIGHTS["s"]))
        bn.bias.copy_(torch.from_numpy(WEIGHTS["b"]))
        bn.running_mean.copy_(torch.from_numpy(WEIGHTS["m"]))
        bn.running_var.copy_(torch.from_numpy(WEIGHTS["v"]))
        prelu.weight.copy_(torch.from_numpy(WEIGHTS["slope"]))
        fc.weight.copy_(torch.from_numpy(WEIGHTS["fw"]))
        fc.bias.copy_(torch.from_numpy(WEIGHTS["fb"]))
    params = [conv.weight, bn.weight, bn.bias, prelu.weight, bias4, fc.weight, fc.bias]

    def forward(x):
        h = torch.nn.functional.max_pool2d(prelu(bn(conv(x))) + bias4, 2)
        return fc(h.flatten(1))
    return forward, params, bn


@pytest.mark.parametrize("opset", [1, 6, 9])
def test_a_legacy_file_trains_as_pytorch_trains_the_same_network(opset):
    """Dropout ratio 0 (a dropout draw is no oracle's); the rest in training mode: batch
    statistics, running statistics updated with ONNX's momentum 0.9 = PyTorch's 0.1."""
    session = tr_onnx.TrainingSession(_legacy(opset, ratio=0.0), backend="numpy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.1),
                                      bn_running_var="unbiased")
    forward, params, bn = _torch_net()
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(3):
        x, labels = _x(step), np.array([step % CLASSES, (step + 2) % CLASSES])
        ours = float(session.train_step({"x": x}, labels))
        loss = torch.nn.functional.cross_entropy(forward(torch.from_numpy(x)),
                                                 torch.from_numpy(labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(ours - loss.item()) < 1e-5, (step, ours, loss.item())
    trained = session.parameters()
    shape = (C,) if opset < 7 else (C, 1, 1)  # each initializer keeps the file's shape
    assert trained["slope"].shape == trained["bias4"].shape == shape
    np.testing.assert_allclose(trained["slope"].reshape(C), params[3].detach().numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(trained["bias4"].reshape(C), params[4].detach().numpy()
                               .reshape(C), atol=1e-5)
    np.testing.assert_allclose(trained["m"], bn.running_mean.numpy(), atol=1e-5)


def test_an_opset7_dropout_mask_in_xs_type_is_given_in_training_too():
    session = tr_onnx.TrainingSession(_legacy(7, ratio=0.5, mask_output=True), backend="numpy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.1),
                                      output_name="y")
    session.train_step({"x": _x()}, np.array([0, 1]))
    mask = session.last_outputs()["mask"]
    assert mask.dtype == np.float32 and set(np.unique(mask)) == {0.0, 1.0}
    assert 0.3 < mask.mean() < 0.7
    (eval_mask,) = session.run(["mask"], {"x": _x()})
    assert (eval_mask == 1.0).all()  # inference: nothing dropped


@pytest.mark.parametrize("opset", [1, 9])
def test_a_trained_legacy_file_exports_in_its_own_opset(opset, tmp_path):
    session = tr_onnx.TrainingSession(_legacy(opset), backend="numpy",
                                      optimizer=tr_onnx.optim.SGD(lr=0.1))
    session.train_step({"x": _x()}, np.array([0, 1]))
    exported = tr_onnx.TrainingSession(session.export(tmp_path / "trained.onnx"),
                                       backend="numpy")
    assert exported.imported.original_opset == opset
    (y,) = session.run(["y"], {"x": _x(7)})
    np.testing.assert_array_equal(exported.run(["y"], {"x": _x(7)})[0], y)
    if opset >= 7:
        assert_close_relative(ort_run(str(tmp_path / "trained.onnx"), {"x": _x(7)})[0], y)
