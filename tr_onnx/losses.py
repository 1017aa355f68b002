"""Losses written as PyTorch functions, made into ONNX loss models that ``TrainingSession``
(``loss=``), ``tr_onnx.fit`` and ``tr-onnx train --loss FILE.onnx`` take. The builtin losses
and their options are ``tr_onnx.LossSpec`` (``training.losses``)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping

from .errors import TrOnnxError


def from_torch(fn: Callable, example_output, example_labels, *,
               dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
               opset: int = 17):
    """An ONNX loss model computing ``fn(output, labels)`` (a scalar), exported with
    ``torch.onnx.export``: its inputs are ``output`` (the model output) and ``labels``, its
    output ``loss``. Returns a ``onnx.ModelProto`` (``onnx.save`` it for the command line).

    ``example_output``, ``example_labels``: arrays or tensors of the shapes and dtypes the
    loss will see (class indices as int64). ``dynamic_axes``: the symbolic axes by input, as
    ``torch.onnx.export`` takes them; default axis 0 of both, named ``batch``. A labels axis
    must be named after an ``output`` axis (or be fixed): a language model's loss over logits
    [N, T, V] and labels [N, T] takes ``{"output": {0: "n", 1: "t"}, "labels": {0: "n", 1:
    "t"}}``. Needs PyTorch (``TrOnnxError`` without it)."""
    try:
        import torch
    except ImportError:
        raise TrOnnxError("tr_onnx.losses.from_torch exports a PyTorch loss function: it needs "
                          "PyTorch (pip install torch)") from None
    import onnx

    class Loss(torch.nn.Module):
        def forward(self, output, labels):
            return fn(output, labels)

    def tensor(x):
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    axes = {"output": {0: "batch"}, "labels": {0: "batch"}} if dynamic_axes is None \
        else {k: dict(v) for k, v in dynamic_axes.items()}
    buf = io.BytesIO()
    with warnings.catch_warnings():  # the exporter's notes on tracing
        warnings.simplefilter("ignore")
        torch.onnx.export(Loss(), (tensor(example_output), tensor(example_labels)), buf,
                          dynamo=False, input_names=["output", "labels"],
                          output_names=["loss"], opset_version=opset, dynamic_axes=axes)
    return onnx.load_from_string(buf.getvalue())
