"""torchvision's own models, exported by torch 2.13's dynamo exporter as users export them
(issue 31, items 5-7).

The classes are torchvision's (``tests/torchvision_models.py`` imports them), in small
configurations of the real architectures: Swin with 7x7 windows over a 16x16 token grid (the
windows pad, as swin_t's do at 64x64), ConvNeXt with its layer scales and LayerNorm2d,
DenseNet (BatchNorm after each concatenation), MobileNetV2 (ReLU6), a ViT. Oracles: PyTorch
training the same module (``torch_parity``), onnxruntime for the forward, and the module's
``named_parameters()`` for the trainable set.

Two kinds of weights: "pretrained-like" (every bias and norm scale random, as trained weights
are) and torchvision's own initialisation (zero biases, unit scales, 1e-6 layer scales), which
the dynamo exporter's optimizer changes: it merges equal-valued initializers (tr_onnx splits
them back per module), removes all-zero biases and fuses BatchNorm into the convolution before
it (no ONNX model can hold what was removed: ``tr-onnx inspect`` names each such layer).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch_parity import ParityCase, assert_parity, run_case
from torchvision_models import models, pretrained_like

import tr_onnx
from tr_onnx.export_advice import export_advice
from tr_onnx.torch_metadata import folded_from, module_of

CLASSES = 10
BATCH = 2


def _head_bias(module: torch.nn.Module) -> torch.nn.Module:
    """torchvision's initialisation, but the classifier's bias random: a zero classifier bias
    is removed by the exporter (its own advice), which would hide what the test looks at."""
    head = [m for m in module.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.bias.normal_()
    return module


def swin():
    return models().SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=[2, 2],
                                    num_heads=[3, 6], window_size=[7, 7],
                                    stochastic_depth_prob=0.0, num_classes=CLASSES)


def convnext():
    from torchvision.models.convnext import CNBlockConfig

    return models().convnext.ConvNeXt(
        [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], stochastic_depth_prob=0.0,
        num_classes=CLASSES)


def densenet():
    return models().DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16,
                             num_classes=CLASSES)


def mobilenet_v2():
    return models().mobilenet_v2(width_mult=0.25, dropout=0.0, num_classes=CLASSES)


def vit():
    return models().VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                      hidden_dim=32, mlp_dim=64, num_classes=CLASSES)


BATCHNORM = {"export_kwargs": {"optimize": False},
             "session_kwargs": {"bn_running_var": "unbiased"}}
SIZES = {swin: 64, convnext: 32, densenet: 32, mobilenet_v2: 32, vit: 32}


def case(arch, weights, **kwargs) -> ParityCase:
    size = SIZES[arch]

    def build():
        torch.manual_seed(0)
        return weights(arch())

    def batches(k):
        rng = np.random.default_rng(k)
        x = rng.standard_normal((BATCH, 3, size, size)).astype(np.float32)
        return {"x": x}, rng.integers(0, CLASSES, BATCH)

    return ParityCase(f"{arch.__name__}_{weights.__name__.strip('_')}", build, batches,
                      exporter="dynamo", lr=0.05, steps=3, dynamic_axes={"x": {0: "batch"}},
                      **kwargs)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export advice is asserted where it is the point
        yield


@pytest.mark.parametrize("arch,kwargs", [
    (swin, {}), (convnext, {}), (vit, {}),
    # BatchNorm nets keep their BatchNorm only unoptimised (docs/export.md), and
    # update running variances as PyTorch does with bn_running_var="unbiased". (Not the
    # MobileNetV2: its training is chaotic at this size, PyTorch's own float32 and float64
    # losses part by 0.06 within 4 steps even at lr 1e-3; its trainable set is tested below.)
    (densenet, BATCHNORM),
], ids=lambda a: getattr(a, "__name__", ""))
def test_pretrained_like_exports_train_as_pytorch(arch, kwargs, tmp_path):
    result = run_case(case(arch, pretrained_like, **kwargs), tmp_path)
    assert_parity(result)
    params = {n for n, _ in arch().named_parameters()}
    assert _trained_as_torch_names(result.session, result.path, params) == params


def test_swin_with_merged_biases_trains_as_pytorch(tmp_path):
    """Item 6: with torchvision's initialisation the exporter merges every zero bias of a
    stage into one initializer, read by LayerNorms and by the attention's two ``F.linear``
    calls (both scoped to the attention module). Splitting gave both linears the one name
    ``<attn>.bias`` (qkv's 72 values for proj's 24 outputs: a broadcast error in the first
    step); each now gets its layer's own bias, and the steps are PyTorch's."""
    result = run_case(case(swin, _head_bias), tmp_path)
    assert_parity(result)
    split = {n for readers in result.session.sharing.split.values() for n in readers.values()}
    assert {"features.1.0.attn.proj.bias", "features.1.1.attn.qkv.bias"} <= split
    assert split <= {n for n, _ in swin().named_parameters()}


def test_exporter_changes_are_named_by_the_advice(tmp_path):
    """Item 7: what the default dynamo export of torchvision-initialised nets changes, named
    layer by layer against the module: the BatchNorm layers that directly follow a conv in a
    DenseNet (fused into it), the zero conv biases of a ConvNeXt (removed). Training such a
    file drifts from PyTorch's train(), which is why the advice is given."""
    dense = run_case(case(densenet, _head_bias), tmp_path)
    (folded,) = [a for a in _advice(dense.path) if a.code == "folded-batchnorm"]
    after_conv = {name for name, m in densenet().named_modules()
                  if name.endswith(("norm0", "norm2"))}  # DenseNet's conv -> BatchNorm pairs
    nodes = _nodes(dense.path)
    assert {module_of(nodes[n]) for n in folded.names} == after_conv
    assert dense.loss_err > 1e-3, dense.loss_err

    nxt = run_case(case(convnext, _head_bias), tmp_path)
    (dropped,) = [a for a in _advice(nxt.path) if a.code == "dropped-biases"]
    module = convnext()
    zero_conv_biases = {f"{name}.bias" for name, m in module.named_modules()
                        if isinstance(m, torch.nn.Conv2d) and not m.bias.abs().max()}
    nodes = _nodes(nxt.path)
    assert {nodes[n].input[1].removesuffix(".weight") + ".bias" for n in dropped.names} == \
        zero_conv_biases
    assert nxt.loss_err > 1e-3, nxt.loss_err


def test_default_trainable_set_is_pytorchs_parameters(tmp_path):
    """Item 5: the default dynamo export of a MobileNetV2 (ReLU6 bounds become scalar
    initializers) and of a ViT (the attention scale): no exporter scalar trains, and the
    trainable set is the module's parameters (MobileNetV2's convolutions with the BatchNorm
    the exporter fused into them: their folded bias is the one initializer PyTorch lacks)."""
    for arch in (mobilenet_v2, vit):
        c = case(arch, pretrained_like)
        module = c.build().eval()
        path = _export(c, module, tmp_path)
        session = tr_onnx.TrainingSession(path, optimizer=tr_onnx.optim.SGD(lr=0.1),
                                          backend="numpy")
        roles = session.parameter_roles
        scalars = {i.name for i in onnx.load(path).graph.initializer
                   if int(np.prod(i.dims)) == 1 and i.name in roles}
        assert scalars and not {n for n in scalars if roles[n].trainable}, arch.__name__
        params = {n for n, _ in module.named_parameters()}
        names = _trained_as_torch_names(session, path, params)
        if arch is vit:
            assert names == params
        else:  # BatchNorm fused: its parameters are in the conv's weight and folded bias
            bn = {n for n in params if n.rsplit(".", 1)[0] in _batchnorms(module)}
            assert names == params - bn | {n for n in names if n.endswith(".weight_bias")}


def _export(c: ParityCase, module, folder: Path) -> Path:
    from torch_parity import export

    return export(c, module, folder / f"{c.id}.onnx")


def _batchnorms(module) -> set[str]:
    return {n for n, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}


def _advice(path):
    imported = tr_onnx.TrainingSession(path, optimizer=tr_onnx.optim.SGD(lr=0.1),
                                       backend="numpy").imported
    return export_advice(imported)


def _nodes(path) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in onnx.load(path).graph.node}


def _trained_as_torch_names(session, path, params: set[str]) -> set[str]:
    """The default trainable initializers as PyTorch names: by name (splits included), or
    the parameters an exporter-folded initializer was folded from (a transposed weight)."""
    folded = folded_from(onnx.load(path))
    names = set()
    for name, role in session.parameter_roles.items():
        if role.trainable:
            names.update(params & set(folded.get(name, ())) or {name})
    return names
