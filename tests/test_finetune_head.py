"""A new classifier head (issue 33, item 1; ``tr_onnx.finetune.replace_head``).

Oracles: the torch module with its head swapped for an ``nn.Linear`` / ``nn.Conv2d`` of K
outputs holding the values tr_onnx chose, run by PyTorch, against the rewritten export run by
onnxruntime (both exporters' forms: classic Gemm transB=1, dynamo Gemm, dynamo MatMul+Add
with the folded transposed ``val_*`` weight or an unfolded Transpose, a 1x1 Conv head), and
``onnx.checker`` with full shape inference.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx
import pytest
import torch
from oracles import ort_run

from tr_onnx.errors import TrOnnxError
from tr_onnx.finetune import replace_head
from tr_onnx.torch_metadata import folded_from

K = 5


class Pooled(torch.nn.Module):
    """Conv, pool, flatten, Linear: a CNN classifier (Gemm in both exporters)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3)
        self.fc = torch.nn.Linear(6, 10)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(x)).mean((2, 3), keepdim=True), 1))


class Tokens(torch.nn.Module):
    """A token classifier on [N, T, C]: MatMul + Add in the dynamo export."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return torch.softmax(self.fc(torch.relu(self.a(x))), -1)


class ConvHead(torch.nn.Module):
    """SqueezeNet's kind of head: a 1x1 Conv on pooled features, then Flatten."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3)
        self.fc = torch.nn.Conv2d(6, 10, 1)

    def forward(self, x):
        return torch.flatten(self.fc(torch.relu(self.conv(x)).mean((2, 3), keepdim=True)), 1)


class Pairs(torch.nn.Module):
    """Scores reshaped after the classifier, the class count baked into the shape constant."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 10)

    def forward(self, x):
        return self.fc(x).reshape(-1, 2, self.fc.out_features)


CASES = {  # id: module, input shape, exporter, dynamo's optimize
    "gemm-classic": (Pooled, (2, 3, 8, 8), "classic", True),
    "gemm-dynamo": (Pooled, (2, 3, 8, 8), "dynamo", True),
    "matmul-folded-dynamo": (Tokens, (2, 3, 6), "dynamo", True),
    "matmul-transpose-dynamo": (Tokens, (2, 3, 6), "dynamo", False),
    "matmul-classic": (Tokens, (2, 3, 6), "classic", True),
    "conv1x1-classic": (ConvHead, (2, 3, 8, 8), "classic", True),
    "reshape-constant-classic": (Pairs, (4, 6), "classic", True),
    "reshape-initializer-dynamo": (Pairs, (4, 6), "dynamo", True),
}


def _export(module, shape, exporter, optimize) -> onnx.ModelProto:
    x = torch.randn(*shape)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "classic":
            buf = io.BytesIO()
            torch.onnx.export(module, (x,), buf, dynamo=False, input_names=["x"],
                              output_names=["y"], opset_version=17,
                              dynamic_axes={"x": {0: "n"}}, do_constant_folding=False)
            return onnx.load_from_string(buf.getvalue())
        program = torch.onnx.export(module, (x,), dynamo=True, optimize=optimize,
                                    input_names=["x"], output_names=["y"],
                                    dynamic_shapes={"x": {0: torch.export.Dim("n")}})
        return program.model_proto


def _torch_head(module: torch.nn.Module, model: onnx.ModelProto, choice) -> None:
    """Swap ``module.fc`` for a K-output layer holding the values ``replace_head`` wrote."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    w, b = inits[choice.weight], inits[choice.bias]
    old = module.fc
    if isinstance(old, torch.nn.Conv2d):
        new = torch.nn.Conv2d(old.in_channels, K, 1)
    else:
        new = torch.nn.Linear(old.in_features, K)
        if w.shape != (K, old.in_features):  # stored [in, out] (MatMul)
            w = w.T
    with torch.no_grad():
        new.weight.copy_(torch.from_numpy(np.array(w)).reshape(new.weight.shape))
        new.bias.copy_(torch.from_numpy(np.array(b)))
    module.fc = new


@pytest.mark.parametrize("case", list(CASES))
def test_new_head_runs_in_onnxruntime_as_torch_with_that_head(case):
    cls, shape, exporter, optimize = CASES[case]
    torch.manual_seed(0)
    module = cls().eval()
    model = _export(module, shape, exporter, optimize)
    new, choice = replace_head(model, K, seed=3)
    onnx.checker.check_model(new, full_check=True)
    assert (choice.old_classes, choice.num_classes, choice.op_type) == (
        10, K, "Conv" if cls is ConvHead else ("MatMul" if cls is Tokens else "Gemm"))
    old_inits = {i.name: i for i in model.graph.initializer}
    new_inits = {i.name: i for i in new.graph.initializer}
    assert list(old_inits) == list(new_inits)  # names and order kept
    assert [n.name for n in model.graph.node] == [n.name for n in new.graph.node]
    old_dims = list(old_inits[choice.weight].dims)
    assert list(new_inits[choice.weight].dims) == [K if d == 10 else d for d in old_dims]
    dims = new.graph.output[0].type.tensor_type.shape.dim
    assert dims[-1].dim_value == K or dims[-1].dim_param  # the classic Reshape's is a name
    _torch_head(module, new, choice)
    x = np.random.default_rng(1).standard_normal((shape[0] + 2, *shape[1:])).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    got = ort_run(new, {"x": x})[0]
    assert got.shape == want.shape and got.shape[-1] == K
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if case == "matmul-folded-dynamo":  # the folded weight is still the module's weight's
        assert folded_from(new)[choice.weight] == ["fc.weight"]
        assert choice.weight.startswith("val_")


def test_new_weights_follow_torch_linear_init_and_the_seed(tmp_path):
    """nn.Linear's init: every weight and bias in U(-1/sqrt(fan_in), 1/sqrt(fan_in)), so a
    uniform's std, bound/sqrt(3); the oracle is torch's own init of the same shape."""
    torch.manual_seed(0)
    model = _export(Pooled().eval(), (2, 3, 8, 8), "classic", True)
    fan_in, k = 6, 4000
    new, choice = replace_head(model, k, seed=7)
    w = onnx.numpy_helper.to_array(next(i for i in new.graph.initializer
                                        if i.name == choice.weight))
    ref = torch.nn.Linear(fan_in, k).weight.detach().numpy()
    bound = 1 / math.sqrt(fan_in)
    assert np.abs(w).max() <= bound and np.abs(ref).max() <= bound
    assert abs(w.std() - ref.std()) < 0.02 * bound
    again, _ = replace_head(model, k, seed=7)
    other, _ = replace_head(model, k, seed=8)
    onnx.save(model, tmp_path / "m.onnx")
    from_path, _ = replace_head(tmp_path / "m.onnx", k, seed=7)
    assert from_path.SerializeToString() == new.SerializeToString()
    assert again.SerializeToString() == new.SerializeToString()
    assert other.SerializeToString() != new.SerializeToString()


def test_head_by_name_and_a_bad_name_lists_the_candidates():
    torch.manual_seed(0)
    model = _export(Tokens().eval(), (2, 3, 6), "dynamo", True)
    _, choice = replace_head(model, K)
    with pytest.raises(TrOnnxError, match="candidates: .*node_MatMul_1.*node_MatMul_3"):
        replace_head(model, K, head="nope")
    _, default = replace_head(model, K, head=choice.node)
    assert default.node == choice.node == "node_MatMul_3"
    with pytest.raises(TrOnnxError, match="node_MatMul_1: with the new class count the model's "
                       "shapes disagree"):  # a hidden layer: the next one wants 8 features
        replace_head(model, K, head="node_MatMul_1")
    with pytest.raises(TrOnnxError, match="num_classes"):
        replace_head(model, 0)
