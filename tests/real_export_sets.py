"""Every real-export model set the tests build, in one catalogue, for the tests that run them
all on another backend (tests/test_real_exports_cuda.py).

Each set stays where it is tested against PyTorch or TensorFlow (its module builds the model,
its batches and its export options); this module only names them: Hugging Face BERT,
DistilBERT, GPT-2, Llama and Swin from both torch exporters (real_exports.py), Llama and Qwen2
at opset 23 (test_attention_ops.py), the LSTM/GRU/RNN classifiers (test_recurrent.py), the UNet
(test_resize.py), the torchvision-shaped CNN, the MLP and the GPT-2-shaped tiny LM
(test_export_advice.py), the slice-assigning model (test_scatter_nd.py), the GELU MLP
(test_gelu_fusion.py) and the Keras CNNs through tf2onnx (test_keras_exports.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import real_exports as rx
import test_attention_ops as attention
import test_export_advice as advice
import test_gelu_fusion as gelu
import test_keras_exports as keras
import test_recurrent as recurrent
import test_resize as resize
import test_scatter_nd as scatter
import torch_parity as tp

import tr_onnx

Batch = tuple[dict[str, np.ndarray], np.ndarray]


@dataclass
class RealExport:
    """One exported model: ``write(folder)`` exports it there and returns the file;
    ``batches(k)`` is its k-th (inputs by ONNX name, labels) batch; ``lr`` the plain-SGD step
    its own tests train with; ``session_kwargs`` what its own tests give TrainingSession."""

    id: str
    write: Callable[[Path], Path]
    batches: Callable[[int], Batch]
    lr: float
    class_axis: int = 1
    session_kwargs: dict = field(default_factory=dict)

    def session(self, path: Path, **kwargs) -> tr_onnx.TrainingSession:
        loss = tr_onnx.LossSpec("cross_entropy", class_axis=self.class_axis)
        return tr_onnx.TrainingSession(path, loss=loss, optimizer=tr_onnx.optim.SGD(lr=self.lr),
                                       **self.session_kwargs, **kwargs)


def _parity(case: tp.ParityCase) -> RealExport:
    def write(folder: Path) -> Path:
        return tp.export(case, case.build().eval(), folder / f"{case.id}.onnx")

    return RealExport(case.id, write, case.batches, case.lr, case.class_axis,
                      dict(case.session_kwargs))


def _hugging_face(name: str, exporter: str) -> RealExport:
    def write(folder: Path) -> Path:
        module = rx.build(name, exporter)
        return rx.export(copy.deepcopy(module), name, exporter,
                         folder / f"hf-{name}-{exporter}.onnx")

    def batches(k: int) -> Batch:
        return rx.example_inputs(name, seed=k), rx.example_labels(name, seed=k)

    return RealExport(f"hf-{name}-{exporter}", write, batches, 0.1,
                      -1 if name in rx.LANGUAGE_MODELS else 1)


def _keras(case: str) -> RealExport:
    def write(folder: Path) -> Path:
        path = folder / f"keras-{case}.onnx"
        onnx.save(keras.exported(case), str(path))
        return path

    def batches(k: int) -> Batch:
        x, y = keras.batches(seed=k)[0]
        return {keras.exported(case).graph.input[0].name: x}, y

    return RealExport(f"keras-{case}", write, batches, keras.LR)


def _advice(name: str, exporter: str) -> RealExport:
    def feed(k: int) -> Batch:
        x, y = advice.example_batch(name, np.random.default_rng(k), 4)
        return {"input": x}, y

    return _parity(tp.ParityCase(
        f"{name}-{exporter}", lambda: advice.fresh_model(name), feed, exporter=exporter,
        lr=0.1, class_axis=-1 if name == "tiny_lm" else 1,
        dynamic_axes={"input": {0: "batch"}},
        export_kwargs={"do_constant_folding": False} if exporter == "classic" else {}))


def catalogue() -> dict[str, RealExport]:
    """Every set, by id."""
    cases = [_hugging_face(n, e) for n in rx.MODELS for e in rx.EXPORTERS]
    cases += [_parity(attention._case(n)) for n in attention.DECODERS]
    for cid, (kind, kw, exporter) in recurrent.MUST_SHOW.items():
        cases.append(_parity(tp.ParityCase(
            cid, lambda kind=kind, kw=kw: recurrent._Classifier(kind, **kw), recurrent._batches,
            exporter=exporter, dynamic_axes={"x": {0: "batch"}})))
    for exporter, (opset, kwargs) in resize.UNET_EXPORTS.items():
        cases.append(_parity(tp.ParityCase(
            f"unet-{exporter}", resize._unet, resize._pixels, exporter=exporter, opset=opset,
            dynamic_axes={"x": {0: "batch"}}, export_kwargs=kwargs,
            session_kwargs={"bn_running_var": "unbiased"})))
    cases += [_advice(n, e) for n in advice.MODELS for e in ("classic", "dynamo")]
    cases += [_parity(tp.ParityCase(f"slice_assign-{e}", scatter.SliceAssign,
                                    scatter._slice_batch, exporter=e, lr=0.2,
                                    dynamic_axes={"x": {0: "batch"}}))
              for e in ("classic", "dynamo")]
    cases += [_parity(tp.ParityCase(f"gelu-{e}", gelu._gelu_mlp, gelu._batch, exporter=e,
                                    dynamic_axes={"x": {0: "batch"}}))
              for e in ("classic", "dynamo")]
    cases += [_keras(c) for c in keras.EXPORTS]
    return {c.id: c for c in cases}


CATALOGUE = catalogue()
