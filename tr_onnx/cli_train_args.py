"""The command lines of ``tr-onnx train`` and ``tr-onnx evaluate``: their options, and the
argparse types that check a value where it is given (a count, a fraction, seconds, a builtin
loss's ``--loss-options``)."""

from __future__ import annotations

import argparse
import difflib

from . import cli_finetune

DEFAULT_EPOCHS = 5


# --loss-options KEY=VALUE,...: a builtin loss's options (LossSpec's fields), as torch's
LOSS_OPTIONS = {"class_axis": int, "ignore_index": int, "label_smoothing": float,
                "reduction": str, "beta": float,
                "weights": lambda v: tuple(float(w) for w in v.split(":"))}


def _loss_options(text: str) -> dict:
    options = {}
    for part in (p for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in LOSS_OPTIONS:
            near = difflib.get_close_matches(key, list(LOSS_OPTIONS), 1)
            raise argparse.ArgumentTypeError(
                f"{part!r}: KEY=VALUE with KEY one of {', '.join(LOSS_OPTIONS)}"
                + (f" (did you mean {near[0]}?)" if near else ""))
        try:
            options[key] = LOSS_OPTIONS[key](value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: {value.strip()!r} is not a valid "
                                             f"{key}") from None
    return options


def count_type(minimum: int):
    """An argparse ``type``: an integer of at least ``minimum`` (a usage error otherwise)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") \
                from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return count


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text}")
    return value


def _epochs_count(text: str) -> int:
    value = count_type(0)(text)
    if value == 0:  # it would export the untrained weights as the trained model
        raise argparse.ArgumentTypeError("0 epochs would train nothing; give 1 or more")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def add_train_parser(sub) -> None:
    """Add the ``train`` command and its options to the subparsers ``sub``."""
    from .data import add_arguments as add_data_arguments
    from .optim import OPTIMIZERS, SCHEDULES
    from .training.losses import LOSSES

    t = sub.add_parser("train", help="train a model on an .npz or the digits data set, export it",
                       description="Train MODEL and export the trained model. Every output path "
                       "is checked before the first step; missing parent folders are created.")
    t.add_argument("model", help="the ONNX model to train (with --resume: the checkpoint's "
                   "model, or its trained export)")
    t.add_argument("--data", required=True, metavar="DATA",
                   help="an .npz with one array per model input (named after it, samples on "
                   "axis 0) plus 'labels', a folder of such .npy files, a CSV or Parquet table, "
                   "or 'digits' (scikit-learn's 8x8 digits); docs/data.md")
    t.add_argument("--data-spec", metavar="FILE.toml",
                   help="what --data cannot say itself: kind = ..., and a [section] per kind "
                        "(docs/data.md)")
    add_data_arguments(t.add_argument_group("data sources (docs/data.md)"))
    cli_finetune.add_arguments(t.add_argument_group("fine-tuning (docs/finetune.md)"))
    t.add_argument("--loss", default=None,
                   help=f"a builtin loss: {', '.join(LOSSES)} (default cross_entropy), or an "
                   "ONNX loss model (a path ending in .onnx) taking (model output, labels)")
    t.add_argument("--loss-options", type=_loss_options, default=None, metavar="KEY=VALUE,...",
                   help="a builtin loss's options, as torch's: class_axis (-1 for a language "
                   "model's [N, T, V] logits), ignore_index (-100: the text source's padding), "
                   "label_smoothing, reduction (mean|sum), weights (per class, colon-separated), "
                   "beta (smooth_l1)")
    t.add_argument("--optimizer", default=None,
                   help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    t.add_argument("--weight-decay", type=float, default=None, metavar="X",
                   help="the optimizer's weight decay (default: the optimizer's: adamw 0.01, "
                   "the others 0); adamw decouples it, sgd/adam/adagrad add it to the gradient")
    t.add_argument("--momentum", type=float, default=None, metavar="X",
                   help="sgd's momentum (default 0); other optimizers take none")
    defaults = ", ".join(f"{name} {cls().lr:g}" for name, cls in OPTIMIZERS.items())
    t.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: the optimizer's: {defaults})")
    t.add_argument("--epochs", type=_epochs_count, default=None,
                   help=f"total epochs, >= 1 (default {DEFAULT_EPOCHS}; a resumed run continues "
                   "to it, by default to the checkpoint's)")
    t.add_argument("--batch-size", type=count_type(1), default=None,
                   help="per rank under mpiexec (default 32; on --resume the checkpoint's "
                   "global batch over this run's ranks)")
    t.add_argument("--val-split", type=_fraction, default=None, metavar="F",
                   help="hold out this fraction of the samples of --data for validation "
                   "(default 0.2, or none with --val-data; 0: no validation)")
    t.add_argument("--val-data", metavar="DATA",
                   help="validate on this data (any form --data takes, read with the same "
                   "--data-spec) instead of a part of --data")
    t.add_argument("--output", metavar="NAME",
                   help="the model output the loss trains (needed when the model has several)")
    t.add_argument("--trainable", action="append", default=None, metavar="PATTERN",
                   help="train only the initializers whose names match PATTERN (fnmatch: "
                   "'classifier.*'; repeatable; default: the model's parameters, as `tr-onnx "
                   "inspect` lists them)")
    t.add_argument("--frozen", action="append", default=None, metavar="PATTERN",
                   help="do not train the initializers whose names match PATTERN (repeatable); "
                   "a pattern that matches no initializer is an error")
    t.add_argument("--seed", type=int, default=None,
                   help="data split and order, dropout (default 0; on --resume the checkpoint's)")
    t.add_argument("--out", help="trained model (default: ./<model stem>_trained.onnx)")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="last.ckpt.npz is written there each epoch")
    t.add_argument("--checkpoint-every", type=count_type(1), default=None, metavar="N",
                   help="also checkpoint every N batches")
    t.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir: the loss, optimizer, lr, schedule, "
                   "accumulation, clipping, trainable set and output come from the checkpoint "
                   "(one given with another value is an error); --epochs defaults to the "
                   "checkpoint's")
    t.add_argument("--metrics", metavar="FILE.jsonl", help="JSON lines, one per epoch")
    t.add_argument("--metrics-every", type=count_type(1), default=None, metavar="N",
                   help="also a metrics line every N batches")
    t.add_argument("--plot", metavar="FILE",
                   help="the loss and each metric per epoch (and per step with --metrics-every), "
                   "in the format the suffix names (.png, .svg, .pdf...; no suffix: PNG); "
                   "written after the model")
    t.add_argument("--log-dir", metavar="DIR",
                   help="write TensorBoard event files there (tensorboardX): the metrics per "
                   "epoch, and per step with --metrics-every")
    t.add_argument("--backend", choices=["auto", "numpy", "cuda"], default=None,
                   help="default: auto (cuda when a GPU is usable); on --resume: the "
                   "checkpoint's")
    t.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None,
                   help="fp16/bf16: mixed precision on cuda (default fp32; on --resume: the "
                   "checkpoint's)")
    t.add_argument("--grad-accumulation", type=count_type(1), default=None, metavar="K",
                   help="one optimizer step every K batches, gradients averaged (default 1)")
    t.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the global gradient norm to X (default: no clipping)")
    t.add_argument("--lr-schedule", default=None, choices=list(SCHEDULES),
                   help=f"one of {', '.join(SCHEDULES)} (default constant): cosine anneals to 0 "
                   "over the run, step multiplies the lr by 0.1 after each third of it, warmup "
                   "rises linearly over the first tenth")
    t.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    t.add_argument("--dist-timeout", type=_seconds, default=300.0, metavar="S",
                   help="under mpiexec/srun: a rank that waits this many seconds for the others "
                   "in one exchange fails the run (default 300)")


def add_evaluate_parser(sub) -> None:
    """Add the ``evaluate`` command to the subparsers ``sub``."""
    from .data import add_arguments as add_data_arguments
    from .training.losses import LOSSES

    e = sub.add_parser("evaluate", help="the loss and metrics of a model on data",
                       description="Evaluate MODEL (in eval mode: dropout off, BatchNorm's "
                       "running statistics) on DATA and print the loss and metrics.")
    e.add_argument("model", help="the ONNX model (a trained export, or any model)")
    e.add_argument("--data", required=True, metavar="DATA",
                   help="the data, in any form `tr-onnx train --data` takes")
    e.add_argument("--data-spec", metavar="FILE.toml", help="as for train")
    add_data_arguments(e.add_argument_group("data sources (docs/data.md)"))
    e.add_argument("--loss", default=None,
                   help=f"a builtin loss: {', '.join(LOSSES)} (default cross_entropy), or an "
                   "ONNX loss model")
    e.add_argument("--loss-options", type=_loss_options, default=None, metavar="KEY=VALUE,...",
                   help="as for train")
    e.add_argument("--output", metavar="NAME",
                   help="the model output to evaluate (needed when the model has several)")
    e.add_argument("--batch-size", type=count_type(1), default=32,
                   help="samples per run (default 32)")
    e.add_argument("--backend", choices=["auto", "numpy", "cuda"], default=None,
                   help="default: auto (cuda when a GPU is usable)")
    e.add_argument("--json", action="store_true", help="the result as one JSON object")
