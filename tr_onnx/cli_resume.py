"""``tr-onnx train --resume``: what a resumed run takes from its checkpoint and what it may
change. The model must be the one the checkpoint trains (or its trained export); the options
that decide what is trained (loss, optimizer, lr, schedule, accumulation, clipping, trainable
set, output) come from the checkpoint, and one given with another value is an error; the
Trainer's own options (checkpoints, metrics, validation, logs) apply from the resumed step on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .errors import InputError

# What --resume takes from the checkpoint: the training graph, the optimizer and its schedule.
# Given with --resume, one that differs from the checkpoint's is refused (changing it mid-run is
# a new run, not a resume; the same value, as when the first command is repeated with --resume,
# is fine); the options of the Trainer (checkpoints, metrics, validation, logs, plot) and the
# machine (--backend, --precision) are honoured from the resumed step on.
RESUMED_FROM_CHECKPOINT = ("loss", "loss_options", "optimizer", "lr", "lr_schedule",
                           "grad_accumulation", "clip_grad_norm", "weight_decay", "momentum",
                           "frozen", "trainable", "output")
# (--val-split is neither: it decides the training samples, which the resume checks are the
# checkpoint's)
HONOURED_ON_RESUME = ("checkpoint_every", "metrics_every", "val_data", "log_dir")


def _graph_digest(model) -> str:
    """SHA-256 of a model without its weights: opsets, nodes in order (op, domain, inputs,
    outputs, attributes), graph inputs and outputs with their types, initializer names, shapes
    and dtypes. Training changes none of them."""
    g = model.graph
    h = hashlib.sha256()

    def put(*parts) -> None:
        h.update(repr(parts).encode())

    for opset in sorted((o.domain, o.version) for o in model.opset_import):
        put("opset", *opset)
    for n in g.node:
        put("node", n.op_type, n.domain, list(n.input), list(n.output),
            [a.SerializeToString(deterministic=True)
             for a in sorted(n.attribute, key=lambda a: a.name)])
    for what, values in (("input", g.input), ("output", g.output)):
        for v in values:
            put(what, v.name, v.type.SerializeToString(deterministic=True))
    for i in sorted(g.initializer, key=lambda i: i.name):
        put("initializer", i.name, list(i.dims), i.data_type)
    return h.hexdigest()


def check_same_model(path: str, session, ckpt: Path, tuned=None) -> None:
    """``--resume``: MODEL must be the model the checkpoint trains, as given to the first run or
    as its trained export (weights and the export's inference form differ, nothing else);
    ``tuned``: the model the fine-tuning flags make of it (a new head, LoRA branches)."""
    from .importer import load_model

    model = tuned if tuned is not None else load_model(path)[0]
    digest = _graph_digest(model)
    if digest in (_graph_digest(session.imported.original),
                  _graph_digest(session.export_proto())):
        return
    theirs = session.imported.original.graph

    def outline(g) -> str:
        return f"{len(g.node)} nodes, inputs {[i.name for i in g.input]}"

    raise InputError(f"--resume: {path} ({outline(model.graph)}) is not the model {ckpt} trains "
                     f"({outline(theirs)}); give that model or its trained export, or train "
                     f"{path} without --resume")


def option_flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _checkpoint_value(session, key: str, given=None):
    """The value of train option ``key`` (an ``args`` name) that a resumed ``session`` has,
    in the form the command line gives it (``given``: the value given, for the options the
    checkpoint holds more of than was given)."""
    from .optim import OPTIMIZERS, SCHEDULES
    from .training.losses import LossSpec

    opt = session.optimizer
    if key == "loss":
        return session.loss.name if isinstance(session.loss, LossSpec) else "an ONNX loss model"
    if key == "loss_options":  # those the command line gives, as the checkpoint has them
        loss = session.loss
        return {k: getattr(loss, k) for k in given} if isinstance(loss, LossSpec) else None
    if key == "optimizer":
        return next((n for n, cls in OPTIMIZERS.items() if type(opt) is cls), type(opt).__name__)
    if key == "lr_schedule":
        return next((n for n, cls in SCHEDULES.items() if type(session.schedule) is cls),
                    type(session.schedule).__name__)
    if key in ("lr", "weight_decay", "momentum"):
        return getattr(opt, key, None)
    if key == "output":
        return session.output_name
    return session.options.recorded()[key]  # grad_accumulation, clip_grad_norm, trainable...


def _shown(value) -> str:
    """An option's value as the command line gives it (a repeated option: its values)."""
    if isinstance(value, list):
        return " ".join(value) if value else "none"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def check_resume_options(args, session) -> None:
    """``--resume``: an option given with a value other than the checkpoint's would change what
    it trains: an error naming each, with the checkpoint's value."""
    differ = []
    for key in RESUMED_FROM_CHECKPOINT:
        given = getattr(args, key)
        if given is None:
            continue
        theirs = _checkpoint_value(session, key, given)
        if isinstance(given, str) and isinstance(theirs, str):
            same = given.lower() == theirs.lower()
        else:
            same = given == theirs or key == "frozen" and not given and not theirs
        if not same:
            differ.append(f"{option_flag(key)} {_shown(given)} (the checkpoint's: "
                          f"{_shown(theirs)})")
    if differ:
        raise InputError(f"--resume continues the checkpoint's training, with its loss, "
                         f"optimizer, lr, schedule, accumulation, clipping, trainable set and "
                         f"output: {'; '.join(differ)}; drop "
                         f"{'it' if len(differ) == 1 else 'them'}, or train afresh without "
                         "--resume")


def honoured_on_resume(args) -> list[str]:
    """The lines saying which options given with ``--resume`` apply from the resumed step on."""
    return [f"--resume: {option_flag(k)} {getattr(args, k)} applies from the resumed step on"
            for k in HONOURED_ON_RESUME if getattr(args, k) is not None]
