"""One harness for "a PyTorch module exported as users export it trains in tr_onnx as it
trains in PyTorch" (issue 13's must-show, one case per model family).

``ParityCase`` names a module builder, example batches and the export settings; ``run_case``
exports it, runs the eval forward against onnxruntime, trains ``steps`` SGD steps in tr_onnx
and in PyTorch from the same weights on the same batches, exports the trained file and runs it
with onnxruntime against the PyTorch module trained alongside. The result holds the measured
errors; the tests assert them against the issue's tolerances (forward 1e-5 vs onnxruntime,
losses 1e-4 vs PyTorch, trained export 1e-4 vs PyTorch).

Batches are ``(inputs, labels)`` with ``inputs`` a dict by ONNX input name (the module's forward
takes them in that order). The loss is cross-entropy over the class axis (``class_axis``: 1 for
[N, C] and [N, C, H, W] logits, -1 for a language model's [N, T, V]).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from oracles import ort_run

import tr_onnx

FORWARD_ATOL = 1e-5
LOSS_ATOL = 1e-4
EXPORT_ATOL = 1e-4


@dataclass
class ParityCase:
    """``build()`` returns a fresh module (eval mode, seeded weights); ``batches(k)`` the k-th
    (inputs, labels) batch. ``exporter``: "classic" (``dynamo=False``) or "dynamo".
    ``dynamic_axes``: {input name: {axis: name}} for the classic exporter; the dynamo export
    uses the same axes as ``torch.export.Dim``s. ``session_kwargs`` go to TrainingSession;
    ``export_kwargs`` to ``torch.onnx.export`` (a BatchNorm model keeps its BatchNorm with
    ``do_constant_folding=False``, as the README's recipe says). ``ort_optimize=False`` runs
    onnxruntime without its graph optimizations (``ort_run``): a QDQ model's must, or
    onnxruntime computes its fused integer kernels instead of the graph (2.5e-3 from PyTorch
    on tests/test_quantize.py's QAT CNN, 3.6e-7 without them)."""

    id: str
    build: Callable[[], torch.nn.Module]
    batches: Callable[[int], tuple[dict[str, np.ndarray], np.ndarray]]
    exporter: str = "classic"
    opset: int = 17
    lr: float = 0.1
    steps: int = 5
    class_axis: int = 1
    dynamic_axes: dict[str, dict[int, str]] | None = None
    session_kwargs: dict = field(default_factory=dict)
    export_kwargs: dict = field(default_factory=dict)
    ort_optimize: bool = True


@dataclass
class ParityResult:
    path: Path
    forward_err: float  # eval forward, tr_onnx vs onnxruntime, max |diff|
    losses: list[float]
    torch_losses: list[float]
    export_err: float  # trained export run by onnxruntime vs the PyTorch module trained alike
    moved: float  # how far training moved PyTorch's outputs: what the export check can see
    session: tr_onnx.TrainingSession

    @property
    def loss_err(self) -> float:
        return float(np.max(np.abs(np.subtract(self.losses, self.torch_losses))))


def export(case: ParityCase, module: torch.nn.Module, path: Path) -> Path:
    """Export as a user would: the classic exporter with ``dynamic_axes``, or the dynamo
    exporter with ``dynamic_shapes`` and the weights inside the file."""
    feed, _ = case.batches(0)
    names = list(feed)
    args = tuple(torch.from_numpy(x) for x in feed.values())
    axes = case.dynamic_axes or {}
    with warnings.catch_warnings():  # the exporters' notes on Python control flow, axis names
        warnings.simplefilter("ignore")
        if case.exporter == "classic":
            torch.onnx.export(module, args, str(path), dynamo=False, input_names=names,
                              output_names=["logits"], opset_version=case.opset,
                              dynamic_axes=axes or None, **case.export_kwargs)
        elif case.exporter == "dynamo":
            # positional (the module's argument names need not be the ONNX input names)
            # one Dim per axis name, so inputs sharing "batch" share the symbol
            dims = {d: torch.export.Dim(d, min=1, max=1024)
                    for a in axes.values() for d in a.values()}
            shapes = tuple({a: dims[d] for a, d in axes.get(n, {}).items()} or None
                           for n in names)
            torch.onnx.export(module, args, str(path), dynamo=True, input_names=names,
                              output_names=["logits"], opset_version=case.opset,
                              dynamic_shapes=shapes if axes else None, external_data=False,
                              **case.export_kwargs)
        else:
            raise ValueError(f"unknown exporter {case.exporter!r}; valid: classic, dynamo")
    return path


def torch_forward(module: torch.nn.Module, feed: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return module(*(torch.from_numpy(x) for x in feed.values())).numpy()


def sgd_losses(module: torch.nn.Module, batches, lr: float, class_axis: int = 1,
               by_name: bool = False) -> list[float]:
    """PyTorch's per-step losses of plain SGD in ``train()`` mode on ``batches`` ((inputs by
    ONNX name, labels) pairs), cross-entropy over ``class_axis`` (-1: a language model's
    [N, T, V] logits flattened to [N*T, V]); ``module`` trains in place and ends in eval mode.
    ``by_name``: the module takes its inputs as keywords (a Hugging Face model's)."""
    module.train()
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for feed, labels in batches:
        tensors = {k: torch.from_numpy(x) for k, x in feed.items()}
        logits = module(**tensors) if by_name else module(*tensors.values())
        y = torch.from_numpy(labels)
        if class_axis == -1:
            logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    module.eval()
    return losses


def torch_sgd(module: torch.nn.Module, case: ParityCase) -> list[float]:
    """PyTorch's losses for ``case``'s batches and learning rate (``sgd_losses``)."""
    return sgd_losses(module, (case.batches(k) for k in range(case.steps)), case.lr,
                      case.class_axis)


def run_case(case: ParityCase, folder: Path) -> ParityResult:
    module = case.build().eval()
    path = export(case, copy.deepcopy(module), folder / f"{case.id}.onnx")
    loss = tr_onnx.LossSpec("cross_entropy", class_axis=case.class_axis)
    session = tr_onnx.TrainingSession(path, loss=loss, optimizer=tr_onnx.optim.SGD(lr=case.lr),
                                      backend="numpy", **case.session_kwargs)
    feed, _ = case.batches(0)
    (ours,) = session.run(["logits"], feed)
    (theirs,) = ort_run(str(path), feed, optimize=case.ort_optimize)
    forward_err = float(np.max(np.abs(ours - theirs)))
    losses = [float(session.train_step(*case.batches(k))) for k in range(case.steps)]
    trained = copy.deepcopy(module)
    torch_losses = torch_sgd(trained, case)
    out = session.export(folder / f"{case.id}_trained.onnx")
    (exported,) = ort_run(str(out), feed, optimize=case.ort_optimize)
    after = torch_forward(trained, feed)
    export_err = float(np.max(np.abs(exported - after)))
    moved = float(np.max(np.abs(after - torch_forward(module, feed))))
    return ParityResult(path, forward_err, losses, torch_losses, export_err, moved, session)


def assert_parity(result: ParityResult) -> None:
    """The issue's tolerances, with the measured numbers in the message."""
    assert result.forward_err <= FORWARD_ATOL, f"forward vs onnxruntime {result.forward_err:.3g}"
    assert result.loss_err <= LOSS_ATOL, (result.losses, result.torch_losses)
    assert result.export_err <= EXPORT_ATOL, f"trained export vs PyTorch {result.export_err:.3g}"
    # the steps must move the outputs well past the export tolerance, or that check is blind
    assert result.moved > 10 * EXPORT_ATOL, f"training moved the outputs only {result.moved:.3g}"
