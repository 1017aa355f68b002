"""torchvision's model definitions beside the CPU build of torch 2.13.

The README's test command installs torchvision 0.28.0 (the release built for torch 2.13) with
``--no-deps --target .torchvision``: the only wheel the registries carry is the CUDA build,
whose C++ extension (detection ops: nms, roi_align, ...) links libtorch_cuda and does not load
beside the CPU torch. torchvision then imports without its ops, except that it registers fake
kernels for ``torchvision::nms`` and ``qnms`` unconditionally, which needs the two operator
schemas to exist. They are declared here (as torchvision's csrc declares them), without
kernels: the classification models the tests build never call them. The model code itself is
torchvision's, unchanged.

Kept out of site-packages so that nothing else (transformers, torch.onnx) finds a torchvision
that cannot run its ops.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TARGET = Path(__file__).resolve().parents[1] / ".torchvision"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY: list[torch.library.Library] = []  # held: a Library's definitions die with it


def models():
    """``torchvision.models``, importing torchvision from ``.torchvision`` on first use."""
    if "torchvision" not in sys.modules:
        if not (TARGET / "torchvision").is_dir():
            raise RuntimeError(f"no {TARGET}: the README's test command installs torchvision "
                               "0.28.0 there (pip install --no-deps --target .torchvision)")
        if not hasattr(torch.ops.torchvision, "nms"):
            library = torch.library.Library("torchvision", "DEF")
            for schema in _SCHEMAS:
                library.define(schema)
            _LIBRARY.append(library)
        sys.path.insert(0, str(TARGET))
    import torchvision.models

    return torchvision.models


def pretrained_like(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with random biases and norm (and layer) scales, and running statistics away
    from 0 and 1, as pretrained weights are: the dynamo exporter would drop or merge
    torchvision's initial zeros and ones, and the test would measure the exporter."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.ndim == 1 or "layer_scale" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p)).add_(0.05 * torch.randn_like(p))
        for name, b in module.named_buffers():
            if name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
            elif name.endswith("running_mean"):
                b.normal_(0, 0.1)
    return module
