"""The benchmark models that are not in model_zoo: torchvision-shaped ResNet-18 and MobileNetV2
at 64x64 and a BERT-shaped encoder (Hugging Face ``BertForSequenceClassification``), built with
random weights from a fixed seed and exported as users export them (the classic exporter, opset
17, eval mode, a dynamic batch axis).

Every peer rebuilds the module with ``build(name)``: same seed, same weights as the file (the
step-1 losses in ``train.py``'s table check it). torchvision is not a dependency: its two
architectures are written out here layer for layer (torchvision 0.28's ``resnet18`` and
``mobilenet_v2``, 10 classes, MobileNetV2 without its Dropout, which the exported eval graph
would drop anyway).

    python benchmarks/bench_models.py OUT_DIR [NAME ...]   # writes OUT_DIR/<name>.onnx
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

CLASSES = 10
SEED = 0
# per model: the input shape without the batch axis
SHAPES = {"resnet18": (3, 64, 64), "mobilenetv2": (3, 64, 64), "bert": (64, 256)}
BERT = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "intermediate_size": 1024, "max_position_embeddings": 128}


def _resnet18():
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            skip = x if self.downsample is None else self.downsample(x)
            y = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(y)) + skip)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


def _mobilenetv2():
    from torch import nn

    def conv_bn_relu6(cin, cout, kernel, stride=1, groups=1):
        return [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups,
                          bias=False), nn.BatchNorm2d(cout), nn.ReLU6()]

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            layers = conv_bn_relu6(cin, hidden, 1) if expand != 1 else []
            layers += conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden)
            layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
            self.conv = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.conv(x) if self.residual else self.conv(x)

    layers = conv_bn_relu6(3, 32, 3, 2)
    cin = 32
    for expand, cout, repeat, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2),
                                         (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                                         (6, 320, 1, 1)):
        for i in range(repeat):
            layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    layers += conv_bn_relu6(cin, 1280, 1)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, CLASSES)]
    return nn.Sequential(*layers)


def _bert():
    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=1000, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=CLASSES,
                                     attn_implementation="eager", **BERT)
    model = transformers.BertForSequenceClassification(config)

    class EmbeddedText(torch.nn.Module):
        """Token embeddings in (float [N, T, hidden]: the benchmark feeds one float input),
        class logits out; positions, LayerNorm, 4 encoder layers, pooler and head are BERT's."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(inputs_embeds=x, return_dict=False)[0]

    return EmbeddedText()


BUILDERS = {"resnet18": _resnet18, "mobilenetv2": _mobilenetv2, "bert": _bert}


def build(name: str):
    """The model with this module's seeded random weights, in eval mode (train it with
    ``.train()``). BatchNorm statistics and LayerNorm/bias parameters are randomised too, so
    the file carries every parameter PyTorch trains and no layer starts as an identity."""
    import torch

    torch.manual_seed(SEED)
    model = BUILDERS[name]()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm scales/shifts and biases: off their 1 / 0 defaults
                p.add_(0.05 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn_like(m.running_mean))
                m.running_var.copy_(1 + 0.1 * torch.rand_like(m.running_var))
    return model.eval()


def export(name: str, path: Path) -> Path:
    """Write model ``name`` to ``path`` (classic exporter, opset 17, dynamic batch)."""
    import torch

    model = build(name)
    example = torch.zeros((2, *SHAPES[name]))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # exporter deprecation and tracer notes
        # PRESERVE keeps BatchNorm as a node (eval mode alone folds it into the Conv weights:
        # tr_onnx would then train another function than PyTorch's train())
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for stem in sys.argv[2:] or SHAPES:
        print(export(stem, out / f"{stem}.onnx"))
