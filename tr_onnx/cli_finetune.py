"""``tr-onnx train``'s fine-tuning options (issue 33): a new head of K classes
(``--num-classes``, ``--head``), what trains (``--train-only``) and when everything does
(``--unfreeze-after``), learning rates by group (``--lr-group``), LoRA adapters (``--lora``).
``cli_train`` adds them to its parser, applies them to the model and the session's arguments,
and writes a LoRA run's exports (``write_lora``); the work is ``tr_onnx.finetune``'s."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


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


def _lora(text: str) -> dict:
    from .errors import TrOnnxError
    from .finetune.lora import parse_lora

    try:
        return parse_lora(text)
    except TrOnnxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    group.add_argument("--lora", type=_lora, default=None,
                       metavar="rank=8,alpha=16,dropout=0,targets=REGEX",
                       help="train LoRA adapters beside the targeted MatMul/Gemm/1x1 Conv "
                            "weights (frozen); the trained model is the base with the adapters "
                            "merged in, and beside it the adapters alone (.lora.npz) and, for "
                            "onnxruntime's LoRA serving, <out>.onnx_adapter with the base model "
                            "taking them (<out>.adapter_model.onnx); docs/lora.md")


def apply(args, model_path: str):
    """``(model, session_kwargs, notes, lora)``: the model to train (``model_path`` itself, or
    the ModelProto with its new head or LoRA branches), ``TrainingSession`` keyword arguments,
    lines to log, and the ``LoraInfo`` of ``--lora`` (else None). The same arguments give the
    same model (seeded): ``--resume`` rebuilds it to check the checkpoint against."""
    from .errors import TrOnnxError
    from .finetune import finetune_options, replace_head

    notes: list[str] = []
    lora_spec = getattr(args, "lora", None)
    if lora_spec is not None and (args.train_only is not None or getattr(args, "trainable", None)
                                  or args.num_classes is not None or args.lr_group):
        raise TrOnnxError("--lora trains the adapters (and its train_also=): it does not "
                          "combine with --num-classes, --train-only, --trainable or --lr-group")
    if args.head is not None and args.num_classes is None:
        raise TrOnnxError("--head needs --num-classes (the head it names is replaced)")
    if args.train_only is not None and getattr(args, "trainable", None):
        raise TrOnnxError("--train-only and --trainable both say what trains: give one")
    if args.unfreeze_after is not None and args.train_only is None:
        raise TrOnnxError("--unfreeze-after needs --train-only: nothing is frozen to unfreeze")
    model, choice = model_path, None
    if args.num_classes is not None:
        if args.num_classes < 1:
            raise TrOnnxError(f"--num-classes {args.num_classes}: must be >= 1")
        model, choice = replace_head(model_path, args.num_classes, head=args.head,
                                     seed=args.seed or 0)
        notes.append(f"new head: {choice.op_type} {choice.node!r} ({choice.in_features} -> "
                     f"{choice.num_classes} classes, was {choice.old_classes}; {choice.why})")
    kwargs: dict = {"lr_groups": dict(args.lr_group)} if args.lr_group else {}
    if lora_spec is not None:
        from .finetune.lora import add_lora

        model, lora = add_lora(model_path, **{"seed": args.seed or 0, **lora_spec})
        notes.append(f"LoRA rank {lora.rank}, alpha {lora.alpha:g}: adapters beside "
                     f"{len(lora.adapters)} weights ({', '.join(t.name for t in lora.adapters[:3])}"
                     f"{' ...' if len(lora.adapters) > 3 else ''}); training "
                     f"{len(lora.trainable)} tensors, the base frozen")
        return model, {"trainable": lora.trainable, "lora": lora}, notes, lora
    if args.train_only is None:
        return model, kwargs, notes, None
    if args.train_only == "head" and choice is None:
        raise TrOnnxError("--train-only head needs --num-classes (the new head)")
    train_only = (args.train_only if args.train_only == "head"
                  else [p for p in args.train_only.split(",") if p])
    kwargs.update(finetune_options(train_only, choice, args.unfreeze_after))
    notes.append(f"training only {kwargs['trainable']}"
                 + (f" for {args.unfreeze_after} epochs, then everything"
                    if args.unfreeze_after is not None else ""))
    return model, kwargs, notes, None


# what a --lora run trains with; the seed only drew the initial A, which a resume replaces
RESUMED_LORA_SETTINGS = ("rank", "alpha", "dropout", "targets", "base_dtype", "train_also")


def check_resumed_lora(session, lora, ckpt: Path) -> None:
    """``--resume`` of a ``--lora`` run's checkpoint (``session.lora``, the LoRA settings it
    holds): ``lora``, what this command's ``--lora`` makes, must have the same settings, or
    the exports would fold the adapters in with other ones; an error names each difference."""
    from .errors import InputError

    theirs = session.lora
    if theirs is None:  # a full checkpoint: cli_train checks its model against MODEL
        return
    shown = ",".join(f"{k}={getattr(theirs, k)}" for k in RESUMED_LORA_SETTINGS
                     if getattr(theirs, k) is not None)
    if lora is None:
        raise InputError(f"--resume: {ckpt} is a --lora run's ({shown}): give MODEL the base "
                         "and the same --lora")
    differ = [f"{k}={getattr(lora, k)} (the checkpoint's: {getattr(theirs, k)})"
              for k in RESUMED_LORA_SETTINGS if getattr(lora, k) != getattr(theirs, k)]
    if differ:
        raise InputError(f"--resume: --lora {', '.join(differ)}; {ckpt} continues with its "
                         f"own ({shown}): give the same --lora, or train afresh")


def tuned(args) -> bool:
    """Whether the arguments change the model itself (a new head, LoRA branches)."""
    return args.num_classes is not None or getattr(args, "lora", None) is not None


def write_lora(session, lora, base_path: str, out: Path) -> list[Path]:
    """A LoRA run's exports: ``out`` the base model with the trained adapters merged in (the
    base's nodes and names, nothing added), ``<out>.lora.npz`` the adapters alone (with the
    base's hash: ``finetune.lora.apply_lora`` puts them back on it), ``<out>.onnx_adapter``
    and ``<out>.adapter_model.onnx`` for onnxruntime's LoRA serving. Each written whole
    (a temporary file renamed), the merged model first."""
    import onnx

    from .finetune.lora import adapter_model, merge_lora, save_adapters, write_adapter

    trained = session.export_proto()
    stem = out.with_suffix("")
    written = []

    def atomically(path: Path, write) -> None:
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        tmp.replace(path)
        written.append(path)

    atomically(out, lambda p: onnx.save(merge_lora(base_path, trained, lora), p))
    atomically(Path(f"{stem}.lora.npz"), lambda p: save_adapters(p, trained, lora))
    atomically(Path(f"{stem}.adapter_model.onnx"),
               lambda p: onnx.save(adapter_model(base_path, lora), p))
    atomically(Path(f"{stem}.onnx_adapter"), lambda p: write_adapter(p, trained, lora))
    return written


def plan_cost(session, plan) -> dict:
    """What a training plan trains and holds for it: the trainable tensors (count, elements),
    the parameters that would train by default but are frozen here, and the bytes of the
    GRAD and OPT_STATE regions (which hold the trainable tensors' gradients and optimizer
    state only) and of the whole arena. ``tr-onnx inspect`` with the fine-tuning flags."""
    from .memory import Region

    mem = plan.memory
    trainable = set(plan.info.trainable)
    frozen = [n for n, r in session.parameter_roles.items() if r.trainable and n not in trainable
              and n in mem.tensors]

    def elements(names) -> int:
        return sum(math.prod(mem.tensors[n].shape) for n in names)

    return {"trainable": len(trainable), "trainable_elements": elements(trainable),
            "frozen": len(frozen), "frozen_elements": elements(frozen),
            "grad_bytes": mem.regions.get(Region.GRAD, (0, 0))[1],
            "opt_state_bytes": mem.regions.get(Region.OPT_STATE, (0, 0))[1],
            "arena_bytes": mem.total_bytes}


def print_cost(cost: dict) -> None:
    """``plan_cost`` of the fine-tuning plan beside that of full fine-tuning (``cost["full"]``,
    planned the same way: every parameter of the model that trains by default)."""
    full = cost["full"]

    def vs(key: str) -> str:
        share = cost[key] / full[key] if full[key] else 1.0
        return f"{cost[key]:>14,d} B vs {full[key]:>14,d} B full fine-tuning ({share:.1%})"

    import textwrap

    print("\nfine-tuning cost (vs full fine-tuning: every parameter that trains by default, "
          "planned too)")
    for note in cost["notes"]:
        print(textwrap.fill(note, 98, initial_indent="  ", subsequent_indent="    "))
    print(f"  trainable  {cost['trainable']} tensors, {cost['trainable_elements']:,d} elements "
          f"(full fine-tuning: {full['trainable']}, {full['trainable_elements']:,d})")
    print(f"  frozen     {cost['frozen']} parameters, {cost['frozen_elements']:,d} elements: "
          "no gradient buffer, no optimizer state")
    print(f"  GRAD       {vs('grad_bytes')}")
    print(f"  OPT_STATE  {vs('opt_state_bytes')}")
    print(f"  arena      {vs('arena_bytes')}")
    print(f"  GRAD and OPT_STATE hold the {cost['trainable']} trainable tensors only")
