"""``tr-onnx train``'s fine-tuning options (issue 33): a new head of K classes
(``--num-classes``, ``--head``), what trains (``--train-only``) and when everything does
(``--unfreeze-after``), learning rates by group (``--lr-group``). ``cli_train`` adds them to its
parser and applies them to the model and the session's arguments; the work is
``tr_onnx.finetune``'s."""

from __future__ import annotations

import argparse


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 0")
    return n


def _lr_group(text: str) -> tuple[str, float]:
    pattern, sep, mult = text.rpartition("=")
    try:
        value = float(mult)
    except ValueError:
        value = -1.0
    if not sep or not pattern or not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be PATTERN=MULTIPLIER (a number >= 0)")
    return pattern, value


def add_arguments(group) -> None:
    """The fine-tuning flags, on ``group`` (a parser or an argument group)."""
    group.add_argument("--num-classes", type=_count, default=None, metavar="K",
                       help="replace the classifier (the last Gemm/MatMul/1x1 Conv before the "
                            "output) with a new one of K classes, initialised as torch's "
                            "nn.Linear")
    group.add_argument("--head", default=None, metavar="NODE",
                       help="with --num-classes: the classifier node to replace (default: "
                            "found from the output)")
    group.add_argument("--train-only", default=None, metavar="head|PATTERN",
                       help="train only the new head's weights, or the initializers matching "
                            "PATTERN (fnmatch; comma-separated for several); BatchNorms whose "
                            "parameters are all frozen run in inference mode")
    group.add_argument("--unfreeze-after", type=_count, default=None, metavar="N",
                       help="with --train-only: after N epochs every parameter trains")
    group.add_argument("--lr-group", type=_lr_group, action="append", default=[],
                       metavar="PATTERN=MULT",
                       help="initializers matching PATTERN (fnmatch) train with --lr times MULT "
                            "(repeatable; the first match wins; numpy backend, fp32)")


def apply(args, model_path: str):
    """``(model, session_kwargs, notes)``: the model to train (``model_path`` itself, or the
    ModelProto with its new head), ``TrainingSession`` keyword arguments, and lines to log."""
    from .errors import TrOnnxError
    from .finetune import finetune_options, replace_head

    notes: list[str] = []
    if args.head is not None and args.num_classes is None:
        raise TrOnnxError("--head needs --num-classes (the head it names is replaced)")
    if args.train_only is not None and getattr(args, "trainable", None):
        raise TrOnnxError("--train-only and --trainable both say what trains: give one")
    if args.unfreeze_after is not None and args.train_only is None:
        raise TrOnnxError("--unfreeze-after needs --train-only: nothing is frozen to unfreeze")
    model, choice = model_path, None
    if args.num_classes is not None:
        import onnx

        if args.num_classes < 1:
            raise TrOnnxError(f"--num-classes {args.num_classes}: must be >= 1")
        model, choice = replace_head(onnx.load(model_path), args.num_classes, head=args.head,
                                     seed=args.seed or 0)
        notes.append(f"new head: {choice.op_type} {choice.node!r} ({choice.in_features} -> "
                     f"{choice.num_classes} classes, was {choice.old_classes}; {choice.why})")
    kwargs: dict = {"lr_groups": dict(args.lr_group)} if args.lr_group else {}
    if args.train_only is None:
        return model, kwargs, notes
    if args.train_only == "head" and choice is None:
        raise TrOnnxError("--train-only head needs --num-classes (the new head)")
    train_only = (args.train_only if args.train_only == "head"
                  else [p for p in args.train_only.split(",") if p])
    kwargs.update(finetune_options(train_only, choice, args.unfreeze_after))
    notes.append(f"training only {kwargs['trainable']}"
                 + (f" for {args.unfreeze_after} epochs, then everything"
                    if args.unfreeze_after is not None else ""))
    return model, kwargs, notes
