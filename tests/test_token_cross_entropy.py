"""Token-level cross-entropy (issue 11, item 4): a language model's logits are [N, T, V] and its
labels [N, T]; ``LossSpec("cross_entropy", class_axis=-1)`` trains it as PyTorch's
``F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))`` does. The model is a tiny
embedding + linear head exported by torch 2.13 here; the oracle is PyTorch autograd + SGD on the
same weights and batches (losses and weights after 5 steps), with ignore_index padding too.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import onnx
import pytest
import torch

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.optim import SGD
from tr_onnx.testing.host_emulator import build_host_library, host_emulator
from tr_onnx.training.losses import LossSpec
from tr_onnx.training.records import count_correct

V, D, N, T = 11, 8, 4, 6


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    model = TinyLM()
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.zeros(N, T, dtype=torch.long),), buf, dynamo=False,
                      input_names=["tokens"], output_names=["logits"], opset_version=17)
    return model, onnx.load_from_string(buf.getvalue())


def _batches(steps, pad=False):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        tokens = rng.integers(0, V, (N, T))
        labels = rng.integers(0, V, (N, T))
        if pad:
            labels[:, -2:] = -100  # padded positions: ignored
        yield tokens, labels


def _torch_curve(model, steps, pad):
    model = copy.deepcopy(model)  # the exported weights, trained by PyTorch
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for tokens, labels in _batches(steps, pad):
        logits = model(torch.from_numpy(tokens))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V),
                                                 torch.from_numpy(labels).reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("pad", [False, True], ids=["dense", "ignore_index"])
def test_token_level_cross_entropy_trains_as_pytorch(exported, pad):
    model, proto = exported
    want_losses, want_weights = _torch_curve(model, 5, pad)
    spec = LossSpec("cross_entropy", class_axis=-1, ignore_index=-100 if pad else None)
    session = tr_onnx.TrainingSession(proto, loss=spec, optimizer=SGD(lr=0.5))
    got = [session.train_step({"tokens": t}, y) for t, y in _batches(5, pad)]
    np.testing.assert_allclose(got, want_losses, rtol=1e-5)
    params = session.parameters()
    # the classic exporter stores the head's weight transposed, as the MatMul's operand
    head = next(n.input[1] for n in proto.graph.node if n.op_type == "MatMul")
    pairs = {"embed.weight": want_weights["embed.weight"], "head.bias": want_weights["head.bias"],
             head: want_weights["head.weight"].T}
    for name, want in pairs.items():
        np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=1e-6, err_msg=name)


def test_labels_are_the_output_shape_without_the_class_axis(exported):
    _, proto = exported
    session = tr_onnx.TrainingSession(proto, loss=LossSpec("cross_entropy", class_axis=-1))
    tokens = np.zeros((N, T), np.int64)
    with pytest.raises(tr_onnx.errors.InputError, match=r"\[4, 6\]"):
        session.train_step({"tokens": tokens}, np.zeros(N, np.int64))
    with pytest.raises(ValueError, match="class_axis=3 for an output of rank 3"):
        tr_onnx.TrainingSession(proto, loss=LossSpec("cross_entropy", class_axis=3)).train_step(
            {"tokens": tokens}, np.zeros((N, T), np.int64))


def test_the_validation_loss_and_accuracy_read_the_class_axis(exported):
    _, proto = exported
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, V, (N, T))
    labels = rng.integers(0, V, (N, T))
    labels[0, :3] = -100
    spec = LossSpec("cross_entropy", class_axis=-1, ignore_index=-100)
    session = tr_onnx.TrainingSession(proto, loss=spec, backend="numpy")
    logits, got = session.run_loss({"tokens": tokens}, labels)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits).reshape(-1, V).double(),
                                             torch.from_numpy(labels).reshape(-1),
                                             ignore_index=-100).item()
    # the compiled loss is float32 (rel=1e-12 held for the float64 NumPy re-implementation)
    assert got == pytest.approx(want, rel=1e-6)
    correct, counted = count_correct("index", logits, labels, -100, class_axis=-1)
    keep = labels != -100
    assert counted == keep.sum() and correct == ((logits.argmax(-1) == labels) & keep).sum()


def test_token_level_cross_entropy_on_the_cuda_backend_equals_numpy(exported, tmp_path):
    """The [N*T, V] rows are what the cuda loss kernels read (the emulated device)."""
    _, proto = exported
    spec = LossSpec("cross_entropy", class_axis=-1, ignore_index=-100)
    device = host_emulator(build_host_library(tmp_path))
    ref = tr_onnx.TrainingSession(proto, loss=spec, optimizer=SGD(lr=0.5))
    cuda = tr_onnx.TrainingSession(proto, loss=spec, optimizer=SGD(lr=0.5),
                                   backend=CudaBackend(device=device))
    for tokens, labels in _batches(3, pad=True):
        np.testing.assert_allclose(cuda.train_step({"tokens": tokens}, labels),
                                   ref.train_step({"tokens": tokens}, labels), rtol=1e-5)
    for name, value in ref.parameters().items():
        np.testing.assert_allclose(cuda.parameters()[name], value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def _token_loss_model(label_dims=("N", "T")):
    """An ONNX loss model over symbolic [N, T, V] scores and [N, T] labels: mean token
    cross-entropy (SoftmaxCrossEntropyLoss over rows [N*T, V])."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Reshape", ["scores", "rows"], ["flat"]),
             helper.make_node("Reshape", ["labels", "all"], ["flat_labels"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["flat", "flat_labels"], ["loss"],
                              reduction="mean")]
    inits = [onnx.numpy_helper.from_array(np.array([-1, V], np.int64), "rows"),
             onnx.numpy_helper.from_array(np.array([-1], np.int64), "all")]
    graph = helper.make_graph(nodes, "token_loss", [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", "T", "V"]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, list(label_dims))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_onnx_loss_model_binds_its_symbolic_dims_by_name(exported):
    """Issue 11, item 4: the labels [N, T] of a loss model over [N, T, V] are [4, 6] here, not
    the batch size in every symbolic place ([4, 4] before)."""
    model, proto = exported
    want_losses, _ = _torch_curve(model, 3, pad=False)
    session = tr_onnx.TrainingSession(proto, loss=_token_loss_model(), optimizer=SGD(lr=0.5))
    got = [session.train_step({"tokens": t}, y) for t, y in _batches(3)]
    np.testing.assert_allclose(got, want_losses, rtol=1e-5)
    bad = tr_onnx.TrainingSession(proto, loss=_token_loss_model(("N", "S")))
    with pytest.raises(tr_onnx.errors.TrOnnxError, match=r"dimensions \['S'\].*'scores'"):
        bad.train_step({"tokens": np.zeros((N, T), np.int64)}, np.zeros((N, T), np.int64))
