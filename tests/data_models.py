"""Small PyTorch models exported as a user would (the classic exporter, a free batch axis), for
the data-source tests that train them end to end."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch


def mlp(features: int, outputs: int, hidden: int = 16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, outputs)).eval()


def export_mlp(path: Path, features: int, outputs: int, input_name: str = "x",
               hidden: int = 16, seed: int = 0) -> Path:
    """An MLP ``[N, features] -> [N, outputs]`` (input ``input_name``, output ``logits``)."""
    module = mlp(features, outputs, hidden, seed)
    x = torch.from_numpy(np.zeros((2, features), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=[input_name],
                          output_names=["logits"], opset_version=17,
                          dynamic_axes={input_name: {0: "batch"}, "logits": {0: "batch"}})
    return path


def initializers(path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
