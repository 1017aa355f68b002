"""What exporters do to a model, and the advice tr_onnx gives about it (issue 11, item 6).

The export recipes (README "Train your own model", docs/export.md) are run from those pages
on three small torch models (a torchvision-shaped BatchNorm CNN, an MLP with zero-initialised
biases, a tied-embedding language model): the files keep BatchNorm, biases and ties, get no
advice, and train 3 SGD steps as PyTorch's ``train()`` does. The exporters' defaults get the
matching advice, as a warning from ``TrainingSession`` and in ``tr-onnx inspect``. Then the
detectors' thresholds on hand-built graphs, and silence on the model zoo.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import re
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import tr_onnx
from tr_onnx.cli import main as cli_main
from tr_onnx.export_advice import MIN_CONVS_FOLDED, export_advice
from tr_onnx.optim import SGD

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "model_zoo"
VOCAB, SEQ = 50, 7
# the dynamo exporter logs a warning per torchvision op it cannot register
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


class ConvNet(nn.Module):
    """torchvision-shaped: (conv 3x3 without bias, BatchNorm, ReLU) x4, global pool, a
    two-layer classifier whose biases are zero-initialised (as timm and Hugging Face heads)."""

    def __init__(self):
        super().__init__()
        layers, cin = [], 3
        for cout, stride in ((8, 1), (8, 1), (16, 2), (16, 1)):
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU()]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        for layer in self.classifier:
            if isinstance(layer, nn.Linear):
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class MLP(nn.Module):
    """Linear layers with zero-initialised biases, as a Hugging Face model initialises them."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 10))
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.net(x)


class TinyLM(nn.Module):
    """GPT-2's shape in miniature: an embedding table tied to the output projection, a
    LayerNorm and a zero-bias Linear in a residual block."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        nn.init.zeros_(self.fc.bias)
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        h = self.wte(ids)
        return self.lm_head(h + torch.relu(self.fc(self.ln(h))))


MODELS = {"convnet": ConvNet, "mlp": MLP, "tiny_lm": TinyLM}
BATCH_NORMS = {"convnet": 4, "mlp": 0, "tiny_lm": 0}
LINEARS_2D = {"convnet": 2, "mlp": 3, "tiny_lm": 0}  # Gemm nodes


def example_batch(name: str, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    if name == "tiny_lm":
        return rng.integers(0, VOCAB, (n, SEQ)), rng.integers(0, VOCAB, (n, SEQ))
    shape = (n, 3, 8, 8) if name == "convnet" else (n, 32)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, n)


def fresh_model(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


RECIPE_PAGES = ("README.md", "docs/export.md")  # the user guide's two, the training-mode one


def export_recipes() -> dict[str, str]:
    """Every export recipe of the user docs, by name; a name on two pages is an error (one
    recipe, one home)."""
    found = [match for page in RECIPE_PAGES for match in re.findall(
        r"<!-- export-recipe:(\S+) -->\n```python\n(.*?)```\n<!-- /export-recipe:\1 -->",
        (ROOT / page).read_text(), re.DOTALL)]
    names = [name for name, _ in found]
    assert len(set(names)) == len(names), f"a recipe is on two pages: {names}"
    return dict(found)


def export_with_recipe(code: str, model, x, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and train-mode notes
        exec(code, {"model": model, "x": torch.from_numpy(x), "path": str(path)})
    return path


DEFAULTS = {  # the exporters' defaults, with the names and batch axis a trainer needs
    "classic": """
import torch
torch.onnx.export(model, (x,), path, dynamo=False, input_names=["input"],
                  output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
""",
    "dynamo": """
import torch
torch.onnx.export(model, (x,), path, dynamo=True, input_names=["input"], output_names=["logits"],
                  dynamic_shapes=({0: torch.export.Dim("batch")},))
""",
}


def session(path, name: str, **kw):
    loss = tr_onnx.LossSpec("cross_entropy", class_axis=-1) if name == "tiny_lm" \
        else "cross_entropy"
    return tr_onnx.TrainingSession(path, loss=loss, optimizer=SGD(lr=0.01), backend="numpy",
                                   **kw)


def torch_losses(model, name: str, batches) -> np.ndarray:
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for x, y in batches:
        out = model(torch.from_numpy(x))
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                           torch.from_numpy(y).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return np.array(losses)


def advice_codes(path) -> tuple[list[str], list[str]]:
    """The advice codes of ``path`` as TrainingSession warns them and as inspect lists them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr_onnx.TrainingSession(path, backend="numpy")
    warned = [re.search(r"\[([a-z-]+)\]", str(w.message)).group(1) for w in caught
              if issubclass(w.category, tr_onnx.ExportAdviceWarning)]
    return sorted(warned), sorted(inspect_json(path)["export_advice_codes"])


def inspect_json(path) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["inspect", str(path), "--batch", "2", "--json"]) == 0
    info = json.loads(out.getvalue())
    info["export_advice_codes"] = [a["code"] for a in info["export_advice"]]
    return info


def test_the_docs_have_the_three_recipes():
    assert set(export_recipes()) == {"classic", "classic-training", "dynamo"}


RECIPE_CASES = [  # (export recipe, model, advice expected); the MLP only where exports are cheap
    ("classic", "convnet", []), ("classic", "mlp", []), ("classic", "tiny_lm", []),
    ("dynamo", "convnet", []), ("dynamo", "tiny_lm", []),
    ("classic-training", "convnet", []), ("classic-training", "mlp", []),
    # a training-mode classic export still folds the tied Transpose into a copy; training ties
    # it back (equal values, >= 256 elements), so it trains as PyTorch's one weight
    ("classic-training", "tiny_lm", []),
]


@pytest.mark.parametrize("recipe, name, expected", RECIPE_CASES,
                         ids=[f"{r}-{m}" for r, m, _ in RECIPE_CASES])
def test_export_recipe_keeps_the_model_and_trains_like_pytorch(tmp_path, recipe, name,
                                                               expected):
    model = fresh_model(name)
    rng = np.random.default_rng(0)
    x, _ = example_batch(name, rng, 2)
    path = export_with_recipe(export_recipes()[recipe], model, x, tmp_path / "model.onnx")
    proto = onnx.load(path)
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["BatchNormalization"] == BATCH_NORMS[name]
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == LINEARS_2D[name] and all(len(n.input) == 3 and n.input[2]
                                                  for n in gemms)  # zero biases kept
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = session(path, name)
    assert sorted(re.search(r"\[([a-z-]+)\]", str(w.message)).group(1) for w in caught
                  if issubclass(w.category, tr_onnx.ExportAdviceWarning)) == expected
    batches = [example_batch(name, rng, 8) for _ in range(3)]
    losses = [ours.train_step({"input": x}, y) for x, y in batches]
    np.testing.assert_allclose(losses, torch_losses(model, name, batches), rtol=0, atol=1e-5)


DEFAULT_CASES = [  # (exporter, model, advice expected from its default export)
    ("classic", "convnet", ["folded-batchnorm"]),
    # BatchNorm folded, the folded (zero) conv biases and the zero classifier biases dropped
    ("dynamo", "convnet", ["dropped-biases", "folded-batchnorm"]),
    ("classic", "mlp", []),  # zero biases shared through Identity; training unties them
    # the untied output weight is tied back by training (no advice; inspect lists the tie)
    ("classic", "tiny_lm", []),
    # the zero fc bias merged with the LayerNorm's zero bias: training splits it back by the
    # readers' modules (training.parameters), so there is nothing to advise
    ("dynamo", "tiny_lm", []),
]


@pytest.mark.parametrize("exporter, name, expected", DEFAULT_CASES,
                         ids=[f"{e}-{m}" for e, m, _ in DEFAULT_CASES])
def test_default_exports_get_the_advice_as_warning_and_in_inspect(tmp_path, exporter, name,
                                                                  expected):
    model = fresh_model(name).eval()
    x, _ = example_batch(name, np.random.default_rng(0), 2)
    path = export_with_recipe(DEFAULTS[exporter], model, x, tmp_path / "model.onnx")
    warned, inspected = advice_codes(path)
    assert warned == inspected == expected


def test_folded_batchnorm_advice_is_warranted_and_says_what_to_do(tmp_path):
    """The default classic export of the CNN trains, but not as PyTorch's train() does."""
    model = fresh_model("convnet").eval()
    rng = np.random.default_rng(0)
    x, _ = example_batch("convnet", rng, 2)
    path = export_with_recipe(DEFAULTS["classic"], model, x, tmp_path / "model.onnx")
    with pytest.warns(tr_onnx.ExportAdviceWarning, match=r"model\.onnx: \[folded-batchnorm\] "
                      r"4 convolutions .*do_constant_folding=False.*optimize=False") as caught:
        ours = session(path, "convnet")
    assert len(caught) == 1
    batches = [example_batch("convnet", rng, 8) for _ in range(3)]
    losses = np.array([ours.train_step({"input": x}, y) for x, y in batches])
    theirs = torch_losses(model, "convnet", batches)
    assert np.abs(losses - theirs).max() > 1e-2 * np.abs(theirs).max()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["inspect", str(path), "--batch", "2", "--train"]) == 0
    assert not [w for w in caught if issubclass(w.category, tr_onnx.ExportAdviceWarning)]
    text = out.getvalue()  # inspect prints the advice in its section, it does not warn it
    assert "\nexport advice\n  [folded-batchnorm] 4 convolutions" in text


def test_advice_warnings_can_be_filtered(tmp_path):
    model = fresh_model("convnet").eval()
    x, _ = example_batch("convnet", np.random.default_rng(0), 2)
    path = export_with_recipe(DEFAULTS["classic"], model, x, tmp_path / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=tr_onnx.ExportAdviceWarning)
        tr_onnx.TrainingSession(path, backend="numpy")


@pytest.mark.parametrize("path", sorted(ZOO.glob("*.onnx")), ids=lambda p: p.stem)
def test_the_model_zoo_gets_no_advice(path):
    """Eval exports with BatchNorm kept, training-mode exports (convs without bias, then BN),
    the fresh ResNet whose equal initializers are shared through Identity, LeNet's 2 convs
    without normalization, the transformer's MatMul layers."""
    assert export_advice(tr_onnx.TrainingSession(path, backend="numpy").imported) == []


# ---- the detectors' thresholds, on hand-built graphs ------------------------------------------

def _init(name, shape, value=None, seed=0):
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) \
        if value is None else np.full(shape, value, np.float32)
    return numpy_helper.from_array(data, name)


def _abs_init(name, shape, seed):
    return numpy_helper.from_array(np.abs(numpy_helper.to_array(_init(name, shape, seed=seed)))
                                   + 0.5, name)


def _conv_chain(n: int, bias: bool, norm: str | None = None, pre_norm: bool = False):
    nodes, inits, x = [], [], "x"
    for i in range(n):
        inits.append(_init(f"w{i}", (4, 4, 3, 3), seed=i))
        ins = [x, f"w{i}"] + ([f"b{i}"] if bias else [])
        if bias:
            inits.append(_init(f"b{i}", (4,), seed=10 + i))
        if norm and pre_norm:  # pre-activation: BatchNorm, then the bias-less conv
            inits += [_abs_init(f"s{i}", (4,), 20 + i), _init(f"m{i}", (4,), seed=30 + i)]
            nodes.append(helper.make_node(norm, [x, f"s{i}", f"m{i}", f"m{i}", f"s{i}"],
                                          [f"n{i}"], name=f"bn{i}"))
            ins[0] = f"n{i}"
        nodes.append(helper.make_node("Conv", ins, [f"c{i}"], name=f"conv{i}", pads=[1] * 4))
        x = f"c{i}"
        if norm and not pre_norm:
            inits += [_abs_init(f"s{i}", (4,), 20 + i), _init(f"m{i}", (4,), seed=30 + i)]
            nodes.append(helper.make_node(norm, [x, f"s{i}", f"m{i}", f"m{i}", f"s{i}"],
                                          [f"n{i}"], name=f"bn{i}"))
            x = f"n{i}"
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
        x = f"r{i}"
    return nodes, inits, x, [4, 4, 6, 6]


def _gemms(biases: list[bool]):
    nodes, inits, x = [], [], "x"
    for i, bias in enumerate(biases):
        inits.append(_init(f"w{i}", (8, 8), seed=i))
        if bias:
            inits.append(_init(f"b{i}", (8,), seed=10 + i))
        nodes.append(helper.make_node("Gemm", [x, f"w{i}"] + ([f"b{i}"] if bias else []),
                                      [f"y{i}"], name=f"fc{i}", transB=1))
        x = f"y{i}"
    return nodes, inits, x, [2, 8]


def _matmuls(n: int):  # LLaMA-style bias-less projections
    nodes, inits, x = [], [], "x"
    for i in range(n):
        inits.append(_init(f"w{i}", (8, 8), seed=i))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"], name=f"proj{i}"))
        x = f"y{i}"
    return nodes, inits, x, [2, 3, 8]


def _lm(untied: str | None):
    """Gather from an embedding table; the output projection reads the table through a
    Transpose (tied), or a separate equal initializer (``"matmul"``: the transposed copy a
    folding exporter writes; ``"gemm"``: a Gemm transB=1 copy), or a different one."""
    table = _init("wte", (10, 4))
    inits = [table]
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["h"], name="embed")]
    if untied is None:
        nodes += [helper.make_node("Transpose", ["wte"], ["wt"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "wt"], ["y"], name="head")]
    elif untied == "gemm":
        inits.append(numpy_helper.from_array(numpy_helper.to_array(table).copy(), "head_w"))
        nodes += [helper.make_node("Reshape", ["h", "flat"], ["h2"]),
                  helper.make_node("Gemm", ["h2", "head_w"], ["y"], name="head", transB=1)]
        inits.append(numpy_helper.from_array(np.array([-1, 4], np.int64), "flat"))
    else:
        value = numpy_helper.to_array(table).T.copy()
        if untied == "different":
            value[0, 0] += 1.0
        inits.append(numpy_helper.from_array(value, "head_w"))
        nodes.append(helper.make_node("MatMul", ["h", "head_w"], ["y"], name="head"))
    return nodes, inits


def _model(nodes, inits, out, in_shape, in_type=TensorProto.FLOAT):
    name = "x" if in_type == TensorProto.FLOAT else "ids"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, in_type,
                                                                         in_shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


GRAPH_CASES = {  # id -> (model, advice codes expected)
    "4 biased convs, no norm": (lambda: _model(*_conv_chain(MIN_CONVS_FOLDED, True)),
                                ["folded-batchnorm"]),
    "3 biased convs, no norm (LeNet-sized)": (lambda: _model(*_conv_chain(3, True)), []),
    "4 bias-less convs, no norm (folded, zero biases dropped)": (
        lambda: _model(*_conv_chain(4, False)), ["folded-batchnorm"]),
    "4 convs then BatchNorm": (
        lambda: _model(*_conv_chain(4, False, "BatchNormalization")), []),
    "4 convs after BatchNorm (pre-activation)": (
        lambda: _model(*_conv_chain(4, False, "BatchNormalization", pre_norm=True)), []),
    "3 bias-less convs, no norm": (lambda: _model(*_conv_chain(3, False)), ["dropped-biases"]),
    "Gemm x3 without C": (lambda: _model(*_gemms([False] * 3)), ["dropped-biases"]),
    "Gemm x1 without C (a probe)": (lambda: _model(*_gemms([False])), []),
    "Gemm x3, one with C": (lambda: _model(*_gemms([False, True, False])), []),
    "MatMul x3 without Add (LLaMA)": (lambda: _model(*_matmuls(3)), []),
    "tied through Transpose": (
        lambda: _model(*_lm(None), "y", [2, 3], TensorProto.INT64), []),
    "untied transposed copy": (
        lambda: _model(*_lm("matmul"), "y", [2, 3], TensorProto.INT64), ["untied-weights"]),
    "untied Gemm transB copy": (
        lambda: _model(*_lm("gemm"), "y", [2, 3], TensorProto.INT64), ["untied-weights"]),
    "different output weight": (
        lambda: _model(*_lm("different"), "y", [2, 3], TensorProto.INT64), []),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_detector_thresholds(case):
    build, expected = GRAPH_CASES[case]
    assert sorted(a.code for a in export_advice(build())) == expected


def test_merged_initializers_are_found_but_identity_sharing_is_not():
    """One all-ones scale read by two LayerNorms (dynamo's merge) is advice; the same shared
    through Identity nodes (the classic exporter's way, which training unties) is not."""
    ones, zeros = _init("scale", (8,), 1.0), _init("bias", (8,), 0.0)
    merged = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["a"], name="ln1"),
              helper.make_node("LayerNormalization", ["a", "scale", "bias"], ["y"], name="ln2")]
    shared = [helper.make_node("Identity", ["scale"], ["scale2"]),
              helper.make_node("Identity", ["bias"], ["bias2"]),
              helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["a"], name="ln1"),
              helper.make_node("LayerNormalization", ["a", "scale2", "bias2"], ["y"],
                               name="ln2")]
    (advice,) = export_advice(_model(merged, [ones, zeros], "y", [2, 8]))
    assert advice.code == "merged-initializers" and advice.names == ("bias", "scale")
    assert "'bias' by 2 nodes; 'scale' by 2 nodes" in advice.message
    assert export_advice(_model(shared, [ones, zeros], "y", [2, 8])) == []


def test_a_per_channel_scale_shared_by_a_quantize_dequantize_pair_is_no_advice():
    """A QAT export's Q and DQ read one scale (and zero point) by design: equal values there
    are a symmetric observer's, not the dynamo exporter's merge."""
    scale = _init("scale", (8,), 0.05)
    zero = numpy_helper.from_array(np.zeros(8, np.int8), "zp")
    qdq = [helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], axis=1),
           helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], axis=1)]
    assert export_advice(_model(qdq, [scale, zero], "y", [2, 8])) == []


def test_advice_names_the_first_nodes_and_counts_the_rest():
    (advice,) = export_advice(_model(*_gemms([False] * 5)))
    assert advice.names == ("fc0", "fc1", "fc2", "fc3", "fc4")
    assert "5 Gemm layers ('fc0', 'fc1', 'fc2' and 2 more) have no bias" in advice.message
    assert str(advice).startswith("[dropped-biases] ")


def test_deepcopy_keeps_the_module_unchanged_by_a_training_mode_export(tmp_path):
    """Why docs/export.md's classic training-mode recipe exports a copy: the export moves the
    module's BatchNorm running statistics."""
    model = fresh_model("convnet").eval()
    before = copy.deepcopy(model.state_dict())
    x, _ = example_batch("convnet", np.random.default_rng(0), 2)
    code = export_recipes()["classic-training"]
    export_with_recipe(code.replace("copy.deepcopy(model)", "model"), model, x,
                       tmp_path / "moved.onnx")
    assert not torch.equal(before["features.1.running_mean"],
                           model.state_dict()["features.1.running_mean"])
    model.load_state_dict(before)
    export_with_recipe(code, model, x, tmp_path / "kept.onnx")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
