"""Regenerate the tr_onnx model zoo: small PyTorch models exported to ONNX, deterministically.

Run ``python -m model_zoo.export_models [--out-dir DIR]``. It builds every model in ``MODELS``
with a fixed seed, exports it with the TorchScript exporter (``dynamo=False``) at the opsets
listed in ``EXPORTS``, derives an IR-3 "Caffe2-era" copy of the opset-9 ResNet, checks every
file (onnx checker, onnxruntime vs. torch at batch 2 and 5, byte-identical re-export) and
writes ``MANIFEST.json``.

torch, onnx and onnxruntime are imported inside functions only, so importing this module (for
``MODELS``/``EXPORTS`` metadata) works without them installed.

Two choices differ from a plain ``torch.onnx.export`` call and are worth knowing:

* ``training=TrainingMode.PRESERVE`` with the model in eval mode. It gives the same inference
  graph as the default ``TrainingMode.EVAL`` except that EVAL also runs the exporter's
  "eval peephole" pass, which folds every BatchNorm into the preceding Conv. A trainer needs
  the BatchNormalization nodes (and their running statistics) to stay in the graph, so we skip
  that fold. Constant folding stays on; it is safe because the model really is in eval mode.
* The multi-head-attention fast path is switched off while exporting, so the transformer is
  traced through the plain ``F.multi_head_attention_forward`` maths and the graph holds only
  default-domain ONNX ops.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import pathlib
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # only for annotations; torch stays optional at import time
    import onnx
    import torch

ZOO_DIR = pathlib.Path(__file__).resolve().parent
SEED = 0
DEFAULT_OPSET = 17
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
BATCH_DIM = "batch"
EXAMPLE_BATCH = 2  # batch used to trace the export; >1 so no size-1 special-casing gets baked in
VERIFY_BATCHES = (2, 5)
# onnxruntime must match torch within 1e-5 relative. The small absolute floor only matters for
# logits that are ~0, where a purely relative test would demand bit-exactness from float32 maths
# done in a different order.
RTOL = 1e-5
ATOL = 1e-6
BN_CALIBRATION_STEPS = 5
BN_CALIBRATION_BATCH = 16
MANIFEST_NAME = "MANIFEST.json"
IR3_STEM = "resnet_opset9_ir3"


class ModelSpec(NamedTuple):
    """Registry entry: a seed-free builder and the example input shape (batch first)."""

    builder: Callable[[], torch.nn.Module]
    example_shape: tuple[int, ...]


class ExportSpec(NamedTuple):
    """One file of the zoo: file stem, model name in ``MODELS``, ONNX opset and export mode.

    ``mode``: ``"eval"`` (inference export, BatchNorm kept), ``"train"``
    (``TrainingMode.TRAINING``: BatchNormalization with training_mode=1, Dropout active) or
    ``"fresh"`` (an eval export of the freshly initialised model, before BatchNorm
    calibration: the exporter then shares equal-valued initializers through Identity nodes).
    """

    stem: str
    model: str
    opset: int
    mode: str = "eval"


# --------------------------------------------------------------------------------------------
# torch building blocks (defined lazily so the module imports without torch)
# --------------------------------------------------------------------------------------------


@functools.cache
def _layers() -> types.SimpleNamespace:
    """Define the nn.Module classes used by the builders; cached so classes are created once."""
    import torch
    from torch import nn

    def torch_flatten(x):
        """``torch.flatten(x, 1)``; exported as a single ONNX Flatten(axis=1)."""
        return torch.flatten(x, 1)

    class LeNet(nn.Module):
        """LeNet-5 shrunk to 1x8x8 digit images (two conv/pool stages, three linears)."""

        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 6, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.classifier = nn.Sequential(
                nn.Linear(16 * 2 * 2, 120),
                nn.ReLU(),
                nn.Linear(120, 84),
                nn.ReLU(),
                nn.Linear(84, 10),
            )

        def forward(self, x):
            return self.classifier(torch_flatten(self.features(x)))

    class BasicBlock(nn.Module):
        """ResNet basic block; a 1x1 conv + BN shortcut when the shape changes."""

        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class SmallResNet(nn.Module):
        """Stem conv + two basic blocks (16->16, 16->32 stride 2) + GAP + linear, for 3x16x16."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
            )
            self.layer1 = BasicBlock(16, 16, stride=1)
            self.layer2 = BasicBlock(16, 32, stride=2)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = self.layer2(self.layer1(self.stem(x)))
            return self.fc(torch_flatten(self.pool(x)))

    def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
        """Conv (no bias, BN follows) + BatchNorm + ReLU6, the MobileNetV2 unit."""
        return nn.Sequential(
            nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(),
        )

    class InvertedResidual(nn.Module):
        """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection (+ residual)."""

        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            self.use_residual = stride == 1 and cin == cout
            self.conv = nn.Sequential(
                conv_bn_relu6(cin, hidden, 1),
                conv_bn_relu6(hidden, hidden, 3, stride=stride, groups=hidden),
                nn.Conv2d(hidden, cout, 1, bias=False),
                nn.BatchNorm2d(cout),
            )

        def forward(self, x):
            out = self.conv(x)
            return x + out if self.use_residual else out

    class SmallMobileNetV2(nn.Module):
        """MobileNetV2-style net for 3x16x16: s2 stem, three inverted residuals, 1x1 to 64."""

        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                conv_bn_relu6(3, 16, 3, stride=2),  # 16x16 -> 8x8
                InvertedResidual(16, 16, stride=1, expand=4),  # residual
                InvertedResidual(16, 24, stride=2, expand=4),  # 8x8 -> 4x4
                InvertedResidual(24, 24, stride=1, expand=4),  # residual
                conv_bn_relu6(24, 64, 1),
            )
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, 10))

        def forward(self, x):
            return self.classifier(torch_flatten(self.pool(self.features(x))))

    class TransformerClassifier(nn.Module):
        """Two post-norm GELU encoder layers, mean over the sequence, LayerNorm, linear head."""

        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(
                d_model=32,
                nhead=4,
                dim_feedforward=64,
                dropout=0.1,
                batch_first=True,
                activation="gelu",
            )
            # enable_nested_tensor=False: the nested-tensor path is another fast path that the
            # exporter cannot express with standard ONNX ops.
            self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(32)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.norm(self.encoder(x).mean(dim=1)))

    return types.SimpleNamespace(
        LeNet=LeNet,
        SmallResNet=SmallResNet,
        SmallMobileNetV2=SmallMobileNetV2,
        TransformerClassifier=TransformerClassifier,
    )


def _calibrate_batchnorm(model: torch.nn.Module, example_shape: tuple[int, ...]) -> None:
    """Give every BatchNorm non-trivial affine params and running stats, so eval BN != identity.

    Fresh BN layers have weight 1, bias 0, mean 0, var 1; a graph built from those would not
    catch an implementation that ignores them. Random affine params plus a few train-mode
    forward passes on shifted/scaled random data give each layer distinct statistics.
    """
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(SEED + 1)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for bn in norms:
            bn.weight.uniform_(0.5, 1.5, generator=gen)
            bn.bias.normal_(0.0, 0.2, generator=gen)
            # momentum=None: cumulative average, so a few steps give the real data statistics
            # instead of staying within a few percent of the (0, 1) initial values
            bn.momentum = None
        # the statistics are summed in float64 and rounded once to float32: float32 sums
        # depend on the CPU's vector width (AVX2 and AVX-512 builds of torch differ in the
        # last bit), which made the zoo files differ between machines
        model.double().train()
        shape = (BN_CALIBRATION_BATCH, *example_shape[1:])
        for _ in range(BN_CALIBRATION_STEPS):
            model((torch.randn(shape, generator=gen) * 1.5 + 0.3).double())
        model.float()
        for bn in norms:
            bn.momentum = 0.1  # back to the default; the exporter writes it as ONNX momentum 0.9
    model.eval()


def _perturb_transformer_defaults(model: torch.nn.Module) -> None:
    """Make the encoder layers differ and give LayerNorm/attention biases non-default values.

    nn.TransformerEncoder deep-copies its layer, so both layers would start with identical
    weights, and MultiheadAttention zero-initialises its biases; neither is a good test case.
    """
    import torch
    from torch import nn

    for layer in model.encoder.layers:
        for module in layer.modules():
            if isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()
            elif isinstance(module, nn.Linear):
                module.reset_parameters()
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
            elif isinstance(module, nn.MultiheadAttention):
                bias = module.in_proj_bias
                bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))


# --------------------------------------------------------------------------------------------
# builders (called under torch.manual_seed(SEED) by build_torch_model)
# --------------------------------------------------------------------------------------------


def _build_mlp() -> torch.nn.Module:
    """64 -> 128 -> 64 -> 10 MLP with ReLU."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def _build_lenet() -> torch.nn.Module:
    """LeNet-5 for [N, 1, 8, 8]."""
    return _layers().LeNet()


def _build_resnet() -> torch.nn.Module:
    """Small ResNet for [N, 3, 16, 16] with calibrated BatchNorm."""
    model = _layers().SmallResNet()
    _calibrate_batchnorm(model, MODELS["resnet"].example_shape)
    return model


def _build_mobilenet() -> torch.nn.Module:
    """Small MobileNetV2 for [N, 3, 16, 16] with calibrated BatchNorm."""
    model = _layers().SmallMobileNetV2()
    _calibrate_batchnorm(model, MODELS["mobilenet"].example_shape)
    return model


def _build_transformer() -> torch.nn.Module:
    """Two-layer transformer encoder classifier for [N, 8, 32]."""
    model = _layers().TransformerClassifier()
    _perturb_transformer_defaults(model)
    return model


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(_build_mlp, (EXAMPLE_BATCH, 64)),
    "lenet": ModelSpec(_build_lenet, (EXAMPLE_BATCH, 1, 8, 8)),
    "resnet": ModelSpec(_build_resnet, (EXAMPLE_BATCH, 3, 16, 16)),
    "mobilenet": ModelSpec(_build_mobilenet, (EXAMPLE_BATCH, 3, 16, 16)),
    "transformer": ModelSpec(_build_transformer, (EXAMPLE_BATCH, 8, 32)),
}

EXPORTS: tuple[ExportSpec, ...] = (
    *(ExportSpec(name, name, DEFAULT_OPSET) for name in MODELS),
    *(ExportSpec(f"{name}_opset13", name, 13) for name in ("mlp", "lenet", "resnet")),
    # "old converter" files; torch 2.13 still accepts opset 9 with dynamo=False
    *(ExportSpec(f"{name}_opset9", name, 9) for name in ("lenet", "resnet")),
    *(ExportSpec(f"{name}_train", name, DEFAULT_OPSET, "train")
      for name in ("mlp", "lenet", "resnet", "mobilenet")),
    ExportSpec("resnet_fresh", "resnet", DEFAULT_OPSET, "fresh"),
)


def build_torch_model(name: str, fresh: bool = False) -> torch.nn.Module:
    """Rebuild model ``name`` in eval mode with exactly the weights that were exported.

    ``fresh``: the freshly initialised module, before any BatchNorm calibration (the
    ``*_fresh`` files). The global torch RNG is seeded with ``SEED`` inside ``fork_rng`` so
    the caller's RNG state is left untouched.
    """
    import torch

    spec = MODELS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        if fresh:
            model = {"resnet": lambda: _layers().SmallResNet()}[name]()
        else:
            model = spec.builder()
    return model.eval()


def example_input(name: str, batch: int = EXAMPLE_BATCH) -> torch.Tensor:
    """Deterministic random input for model ``name`` with the given batch size."""
    import torch

    shape = (batch, *MODELS[name].example_shape[1:])
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 100 + batch))


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exporter_context() -> Iterator[None]:
    """Disable the MHA fast path and silence the exporter warnings we know are expected."""
    import torch

    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            # dynamo=False is deliberate (see module docstring); the deprecation notice and the
            # constant-folding advice for PRESERVE (aimed at models in *training* mode) are noise.
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", message=".*feature will be removed")
            warnings.filterwarnings("ignore", message=".*constant folding be turned off")
            # train-mode tracing: num_batches_tracked is not part of the ONNX graph
            warnings.filterwarnings("ignore", message=".*Removing mutation from node")
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def export_bytes(name: str, opset: int, mode: str = "eval") -> bytes:
    """Export model ``name`` at ``opset`` with the TorchScript exporter; return the file bytes.

    ``mode="train"`` traces a copy in train mode (tracing runs a forward pass that moves a
    module's BatchNorm running statistics; the copy keeps ``build_torch_model``'s intact).
    """
    import copy

    import torch

    model = build_torch_model(name, fresh=mode == "fresh")
    training = torch.onnx.TrainingMode.PRESERVE
    if mode == "train":
        model = copy.deepcopy(model).train()
        training = torch.onnx.TrainingMode.TRAINING
    buffer = io.BytesIO()
    with _exporter_context(), torch.no_grad():
        torch.onnx.export(
            model,
            (example_input(name),),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: BATCH_DIM}, OUTPUT_NAME: {0: BATCH_DIM}},
            # PRESERVE + eval model == EVAL minus the Conv+BN fold (see module docstring)
            training=training,
            do_constant_folding=mode != "train",
        )
    return buffer.getvalue()


def make_ir3_variant(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy imitating pre-IR-4 (Caffe2-era) files: ir_version 3, initializers as inputs.

    Before IR 4 every initializer also had to be declared as a graph input; the initializer
    then acts as the input's default value.
    """
    import onnx
    from onnx import helper

    old = onnx.ModelProto()
    old.CopyFrom(model)
    declared = {value.name for value in old.graph.input}
    for init in old.graph.initializer:
        if init.name not in declared:
            old.graph.input.append(
                helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    old.ir_version = 3
    onnx.checker.check_model(old, full_check=True)
    return old


def _write_if_changed(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` unless identical bytes are already there (keeps mtimes)."""
    if path.exists() and path.read_bytes() == data:
        return
    path.write_bytes(data)


def export_all(out_dir: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Export every file of the zoo plus ``MANIFEST.json`` into ``out_dir``.

    Returns file stem -> path of each ``.onnx`` file written.
    """
    import onnx

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, pathlib.Path] = {}
    for spec in EXPORTS:
        data = export_bytes(spec.model, spec.opset, spec.mode)
        paths[spec.stem] = out / f"{spec.stem}.onnx"
        _write_if_changed(paths[spec.stem], data)
        if spec.stem == "resnet_opset9":
            ir3 = make_ir3_variant(onnx.load_from_string(data))
            paths[IR3_STEM] = out / f"{IR3_STEM}.onnx"
            _write_if_changed(paths[IR3_STEM], ir3.SerializeToString(deterministic=True))
    manifest = build_manifest(paths)
    _write_if_changed(out / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
    return paths


# --------------------------------------------------------------------------------------------
# manifest and verification
# --------------------------------------------------------------------------------------------


def _stem_model(stem: str) -> str:
    """Model name (key of ``MODELS``) a zoo file stem was exported from."""
    return stem.split("_", 1)[0]


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    """Shape of a graph input/output, symbolic dims as their names."""
    return [
        dim.dim_param if dim.HasField("dim_param") else dim.dim_value
        for dim in value.type.tensor_type.shape.dim
    ]


def describe_file(path: pathlib.Path) -> dict[str, Any]:
    """Manifest entry for one ONNX file (derived from the file itself)."""
    import onnx

    data = path.read_bytes()
    model = onnx.load_from_string(data)
    initializers = {init.name for init in model.graph.initializer}
    real_inputs = [value for value in model.graph.input if value.name not in initializers]
    opset = next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))
    return {
        "file": path.name,
        "model": _stem_model(path.stem),
        "opset": opset,
        "ir_version": model.ir_version,
        "inputs": [{"name": v.name, "shape": _dims(v)} for v in real_inputs],
        "initializers_as_inputs": len(model.graph.input) > len(real_inputs),
        "outputs": [{"name": v.name, "shape": _dims(v)} for v in model.graph.output],
        "num_nodes": len(model.graph.node),
        "num_initializers": len(initializers),
        "op_types": sorted({node.op_type for node in model.graph.node}),
        "size_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def build_manifest(paths: dict[str, pathlib.Path]) -> dict[str, Any]:
    """MANIFEST.json content: generator versions and one entry per file, sorted by stem."""
    import onnx
    import torch

    return {
        "generator": "python -m model_zoo.export_models",
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "seed": SEED,
        "files": {stem: describe_file(paths[stem]) for stem in sorted(paths)},
    }


def verify_file(stem: str, path: pathlib.Path) -> dict[str, Any]:
    """Check one file: onnx checker, default-domain ops only, onnxruntime == torch at 2 and 5.

    Raises AssertionError on a mismatch; returns a summary row for the table.
    """
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    custom = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    assert not custom, f"{stem}: non-standard op domains {custom}"

    name = _stem_model(stem)
    mode = next((s.mode for s in EXPORTS if s.stem == stem), "eval")
    torch_model = build_torch_model(name, fresh=mode == "fresh")
    if mode == "train":
        # onnxruntime runs a training-mode export with batch statistics, as torch.train() does;
        # Dropout would draw different masks, so such a file is only checked by the checker
        if any(n.op_type == "Dropout" for n in model.graph.node):
            return {"file": path.name, "opset": describe_file(path)["opset"],
                    "ir": model.ir_version, "nodes": len(model.graph.node),
                    "kib": path.stat().st_size / 1024, "max_abs_err": float("nan"),
                    "tol_used": float("nan")}
        torch_model = _copy_in_train_mode(torch_model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst_abs = worst_ratio = 0.0
    for batch in VERIFY_BATCHES:
        x = example_input(name, batch)
        with torch.no_grad():
            expected = torch_model(x).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
        assert got.shape == expected.shape, f"{stem}: shape {got.shape} != {expected.shape}"
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=stem)
        diff = np.abs(got.astype(np.float64) - expected)
        worst_abs = max(worst_abs, float(diff.max()))
        # fraction of the allowed error used; <= 1 means within tolerance
        worst_ratio = max(worst_ratio, float((diff / (ATOL + RTOL * np.abs(expected))).max()))
    return {
        "file": path.name,
        "opset": describe_file(path)["opset"],
        "ir": model.ir_version,
        "nodes": len(model.graph.node),
        "kib": path.stat().st_size / 1024,
        "max_abs_err": worst_abs,
        "tol_used": worst_ratio,
    }


def _copy_in_train_mode(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).train()


def check_determinism(paths: dict[str, pathlib.Path]) -> list[str]:
    """Re-export everything into a temporary folder; return the stems whose bytes differ."""
    with tempfile.TemporaryDirectory() as tmp:
        again = export_all(tmp)
        return [stem for stem in paths if again[stem].read_bytes() != paths[stem].read_bytes()]


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the verification summary."""
    header = (
        f"{'file':<26} {'opset':>5} {'ir':>3} {'nodes':>5} {'KiB':>8} "
        f"{'max abs err':>12} {'tol used':>8}"
    )
    print(f"onnxruntime vs torch at batch {VERIFY_BATCHES}, tolerance {ATOL} + {RTOL} * |torch|")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['file']:<26} {row['opset']:>5} {row['ir']:>3} {row['nodes']:>5} "
            f"{row['kib']:>8.1f} {row['max_abs_err']:>12.2e} {row['tol_used']:>8.1%}"
        )
    total = sum(row["kib"] for row in rows)
    print(f"{'total':<26} {'':>5} {'':>3} {'':>5} {total:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: export, verify, check determinism."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=ZOO_DIR)
    parser.add_argument(
        "--no-verify", action="store_true", help="skip the onnxruntime and determinism checks"
    )
    args = parser.parse_args(argv)

    paths = export_all(args.out_dir)
    print(f"wrote {len(paths)} models and {MANIFEST_NAME} to {args.out_dir}")
    if args.no_verify:
        return 0
    print_table([verify_file(stem, paths[stem]) for stem in sorted(paths)])
    differing = check_determinism(paths)
    if differing:
        print(f"NOT deterministic: {', '.join(differing)}", file=sys.stderr)
        return 1
    print("re-export is byte-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
