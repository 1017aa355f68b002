"""Tiny Hugging Face models, built and exported to ONNX the way users export them.

Each model comes from ``transformers`` with a tiny config and random weights (fixed seed),
dropout probabilities 0 so that PyTorch's ``train()`` mode is deterministic, and is exported
with both torch exporters: the classic TorchScript one (``dynamo=False``, opset 17,
``dynamic_axes``) and the dynamo one (``dynamo=True``, ``dynamic_shapes``, weights inside the
file). ``tests/test_real_exports.py`` trains the files and compares with PyTorch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import transformers
from torch_parity import sgd_losses

# GPT-2's tied embedding is one initializer in a dynamo export only while the onnxscript
# optimizer leaves it alone: it folds Transpose(weight) into a second, transposed initializer for
# weights of at most 8192 elements (DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT), which unties a
# 100 x 32 embedding. Real vocabularies are far above the limit; 300 x 32 is too.
VOCAB = 300
HIDDEN = 32
LAYERS = 2
HEADS = 2
CLASSES = 5
BATCH = 3
SEQ = 7
IMAGE = 16  # Swin: 16x16 pixels, 2x2 patches -> 8x8 tokens, then 4x4 after patch merging
PATCH = 2
WINDOW = 2  # smaller than both stages' resolutions, so every odd block shifts its windows
CHANNELS = 3
EXPORTERS = ("classic", "dynamo")
MODELS = ("bert", "distilbert", "gpt2", "llama", "swin")
LANGUAGE_MODELS = ("gpt2", "llama", "qwen2")  # logits [N, T, V], labels [N, T]: class_axis=-1


class TextLogits(torch.nn.Module):
    """What a user wraps a Hugging Face text model in to export it: tensors in, logits out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          return_dict=False)[0]


class ImageLogits(torch.nn.Module):
    """The same for an image model."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values, return_dict=False)[0]


def _config(name: str, exporter: str) -> transformers.PretrainedConfig:
    if name == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=2 * HIDDEN, max_position_embeddings=16,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES)
    if name == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * HIDDEN,
            max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
            seq_classif_dropout=0.0, num_labels=CLASSES)
    if name == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
            # tied embedding and lm_head (the default): the classic exporter's constant folding
            # writes the lm_head weight as a transposed copy, which training ties back
            # (training.parameters); the dynamo export keeps one initializer (a test checks it)
    if name == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    if name == "qwen2":  # the Qwen2 block: biased q/k/v projections, grouped key/value heads
        return transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    if name == "swin":
        return transformers.SwinConfig(
            image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, embed_dim=16,
            depths=[2, 2], num_heads=[2, 2], window_size=WINDOW, mlp_ratio=2.0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
            num_labels=CLASSES,
            # The dynamo exporter cannot export Swin's default SDPA attention (torch 2.13:
            # "Failed to decompose the FX graph", a view of a transposed attention output,
            # with static shapes too); a user switches to eager attention, which exports.
            attn_implementation="eager" if exporter == "dynamo" else "sdpa")
    raise ValueError(f"unknown model {name!r}; valid: {MODELS}")


_CLASSES = {"bert": transformers.BertForSequenceClassification,
            "distilbert": transformers.DistilBertForSequenceClassification,
            "gpt2": transformers.GPT2LMHeadModel,
            "llama": transformers.LlamaForCausalLM,
            "qwen2": transformers.Qwen2ForCausalLM,
            "swin": transformers.SwinForImageClassification}


def build(name: str, exporter: str) -> torch.nn.Module:
    """The wrapped model, in eval mode, with every parameter randomised (seeded)."""
    torch.manual_seed(0)
    model = _CLASSES[name](_config(name, exporter))
    # Fresh biases are all zero and fresh LayerNorm weights all one; the dynamo exporter drops
    # all-zero biases (PEERS.md), so the file would not be the PyTorch model. Random values
    # everywhere make the exported graph carry every parameter PyTorch trains.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return (ImageLogits if name == "swin" else TextLogits)(model).eval()


def example_inputs(name: str, seed: int = 0, batch: int = BATCH,
                   seq: int = SEQ) -> dict[str, np.ndarray]:
    """One batch of inputs, by ONNX input name (int64 ids and a mask with padding for text;
    float32 pixels for Swin)."""
    rng = np.random.default_rng(seed)
    if name == "swin":
        return {"pixel_values": rng.standard_normal(
            (batch, CHANNELS, IMAGE, IMAGE)).astype(np.float32)}
    ids = rng.integers(0, VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1:, seq - 2:] = 0  # right padding on all rows but the first
    return {"input_ids": ids, "attention_mask": mask}


def example_labels(name: str, seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> np.ndarray:
    """Labels for ``example_inputs``: classes [N], or next tokens [N, T] for a language model."""
    rng = np.random.default_rng(seed + 1000)
    if name in LANGUAGE_MODELS:
        return rng.integers(0, VOCAB, (batch, seq), dtype=np.int64)
    return rng.integers(0, CLASSES, (batch,), dtype=np.int64)


def export(module: torch.nn.Module, name: str, exporter: str, path: Path) -> Path:
    """Export as a user would: the classic exporter with ``dynamic_axes`` at opset 17, or the
    dynamo exporter with ``dynamic_shapes`` and the weights inside the file."""
    feed = example_inputs(name)
    input_names = list(feed)
    args = tuple(torch.from_numpy(x) for x in feed.values())
    axes = {0: "batch"} if name == "swin" else {0: "batch", 1: "seq"}
    with warnings.catch_warnings():  # notes on the models' Python control flow, axis names
        warnings.simplefilter("ignore")
        _export(module, args, input_names, axes, exporter, path)
    return path


def _export(module, args, input_names, axes, exporter, path) -> None:
    if exporter == "classic":
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=input_names,
                          output_names=["logits"], opset_version=17,
                          dynamic_axes={n: axes for n in input_names})
    elif exporter == "dynamo":
        dims = {i: torch.export.Dim(axis, min=1, max=64) for i, axis in axes.items()}
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=input_names,
                          output_names=["logits"], dynamic_shapes={n: dims for n in input_names},
                          external_data=False)
    else:
        raise ValueError(f"unknown exporter {exporter!r}; valid: {EXPORTERS}")


def logits(module: torch.nn.Module, feed: dict[str, np.ndarray]) -> np.ndarray:
    """PyTorch's output for ``feed`` (by ONNX input name), without autograd."""
    with torch.no_grad():
        return module(**{k: torch.from_numpy(x) for k, x in feed.items()}).numpy()


def torch_train(module: torch.nn.Module, batches, lr: float) -> list[float]:
    """PyTorch's per-step losses of plain SGD on ``batches`` ((inputs, labels) pairs), in
    ``train()`` mode, with ``cross_entropy`` over the last axis (a language model's logits
    [N, T, V] flattened to [N*T, V], its labels to [N*T]); ``module`` is trained in place."""
    return sgd_losses(module, batches, lr, class_axis=-1, by_name=True)
