"""``tr-onnx train``: check every output path, load the data, train (or resume) with a
``Trainer``, export the trained model, write the plot. Under ``mpiexec``/``srun`` every rank runs
this same command: ``tr_onnx.distributed.init()`` decides the world, and only rank 0 prints and
writes files (``cli.py`` holds the other commands and the shared error handling,
``cli_train_args`` the command lines of train and evaluate, ``cli_resume`` what ``--resume``
takes from the checkpoint)."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from . import cli_finetune
from .cli_resume import check_resume_options, check_same_model, honoured_on_resume, option_flag
from .cli_train_args import DEFAULT_EPOCHS
from .errors import InputError, TrOnnxError


def _schedule(name: str, total_steps: int):
    """The ``--lr-schedule`` for a run of ``total_steps`` optimizer steps: cosine anneals to 0
    over the run, step multiplies the lr by 0.1 after each third of it, warmup rises linearly
    over the first tenth and then stays constant."""
    from .optim import Constant, Cosine, StepLR, Warmup

    total = max(total_steps, 1)
    return {"constant": lambda: Constant(),
            "cosine": lambda: Cosine(total_steps=total),
            "step": lambda: StepLR(step_size=max(total // 3, 1), gamma=0.1),
            "warmup": lambda: Warmup(warmup_steps=max(total // 10, 1))}[name]()


def _user_error(fn, *args, **kwargs):
    """Call ``fn``; a ValueError (an unknown loss/optimizer name, a bad option) becomes a
    TrOnnxError: one line and exit code 2."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        if isinstance(exc, TrOnnxError):
            raise
        raise TrOnnxError(str(exc)) from None


def _check_writable(option: str, given, path: Path) -> None:
    """Refuse, before training, an output file ``path`` (``option given``) that could not be
    written at the end: a folder, a path under a file, a folder where no file can be created
    (permissions, a read-only mount). Missing parent folders are fine: they are created when
    the file is written. Whether files can be created is tried, not guessed from permission
    bits (root passes those, a read-only mount does not); the probe file is removed."""
    head = f"{option} {given}"
    if path.is_dir():
        raise InputError(f"{head}: {path} is a folder; give a file name")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{head}: {folder} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tr-onnx-probe-", dir=folder)
    except OSError as exc:
        raise InputError(f"{head}: cannot create files in {folder} ({exc.strerror}); choose a "
                         "folder you can write to") from None
    os.close(fd)
    os.unlink(probe)
    if path.is_file() and not os.access(path, os.W_OK):  # the metrics file is rewritten in place
        raise InputError(f"{head}: {path} is read-only")


def _check_outputs(args, out: Path, ckpt: Path | None) -> None:
    """Every output of ``tr-onnx train`` checked before the first step, so that a path it
    cannot write fails now, not after the last epoch; and a plot format matplotlib writes."""
    from .training.plots import plot_format

    log_dir = Path(args.log_dir) / "events" if args.log_dir else None  # a file in it
    for option, given, path in (("--out" if args.out else "--out (default)", out, out),
                                ("--plot", args.plot, args.plot),
                                ("--metrics", args.metrics, args.metrics),
                                ("--checkpoint-dir", args.checkpoint_dir, ckpt),
                                ("--log-dir", args.log_dir, log_dir)):
        if given is not None:
            _check_writable(option, given, Path(path))
    if args.plot is not None:
        try:
            plot_format(args.plot)
        except ImportError:
            raise TrOnnxError(f"--plot {args.plot}: the plot needs matplotlib: pip install "
                              "'tr_onnx[train]'") from None
        except InputError as exc:
            raise InputError(f"--plot {exc}") from None


def _write_plot(history: list[dict], plot: str, model: Path | None,
                steps: list[dict] | None = None) -> None:
    from .training import plots

    try:
        plots.plot_history(history, plot, steps)
    except (OSError, RuntimeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        kept = f"; the trained model was written to {model}" if model else ""
        raise TrOnnxError(f"--plot {plot}: not written ({why}){kept}") from None




def _loss(args):
    """``--loss`` with ``--loss-options``: a builtin loss's name, or the dict of its options
    (``make_loss_spec``), or an ONNX loss model's path."""
    name = args.loss or "cross_entropy"
    options = getattr(args, "loss_options", None)
    if not options:
        return name
    if name.endswith(".onnx"):
        raise InputError(f"--loss-options {sorted(options)}: options of a builtin loss; "
                         f"{name} is an ONNX loss model, which has its own")
    return {"name": name, **options}


def _optimizer(args):
    """The optimizer ``--optimizer`` names with ``--lr``, ``--weight-decay`` and ``--momentum``;
    one it does not take is an error naming the optimizers that do."""
    from .optim import OPTIMIZERS, make_optimizer

    name = (args.optimizer or "adamw").lower()
    given = {k: getattr(args, k) for k in ("weight_decay", "momentum")
             if getattr(args, k) is not None}
    if name in OPTIMIZERS:
        for key in given:
            takes = [n for n, cls in OPTIMIZERS.items()
                     if key in {f.name for f in dataclasses.fields(cls) if f.init}]
            if name not in takes:
                raise InputError(f"{option_flag(key)}: optimizer {name} takes no {key}; "
                                 f"{', '.join(takes)} {'does' if len(takes) == 1 else 'do'}")
    return _user_error(make_optimizer, {"name": name, **given}, args.lr)


def _model_outputs(path: str) -> list[str] | None:
    """The graph outputs of the model file (None where it cannot be read: the session says
    why)."""
    import onnx

    try:
        return [o.name for o in onnx.load(path, load_external_data=False).graph.output]
    except Exception:  # the session's import names what is wrong with it
        return None


def _check_output(args) -> None:
    """``--output``: an output of the model; required where the model has several (the first
    one is a guess that trains the wrong head silently)."""
    outputs = _model_outputs(args.model)
    if outputs is None:
        return
    if args.output is not None and args.output not in outputs:
        raise InputError(f"--output {args.output}: not an output of {args.model}; its outputs "
                         f"are {', '.join(outputs)}")
    if args.output is None and len(outputs) > 1:
        raise InputError(f"{args.model} has {len(outputs)} outputs ({', '.join(outputs)}); "
                         "choose the one the loss trains with --output NAME")


def warn_softmax_output(session) -> None:
    """Warn when cross-entropy trains an output that a Softmax/LogSoftmax node computes: the
    loss applies log-softmax itself, so the model's own softmax is applied twice."""
    from .training.losses import LossSpec

    if not (isinstance(session.loss, LossSpec) and session.loss.name == "cross_entropy"):
        return
    producers = {o: n for n in session.imported.proto.graph.node for o in n.output}
    node = producers.get(session.output_name)
    while node is not None and node.op_type == "Identity":
        node = producers.get(node.input[0])
    if node is not None and node.op_type in ("Softmax", "LogSoftmax"):
        warnings.warn(f"output {session.output_name!r} of {session.imported.source} is computed "
                      f"by {node.op_type} node {node.name!r}: the model already applies "
                      f"softmax, and the cross_entropy loss applies log-softmax to it again "
                      f"(gradients shrink, training stalls); export the model without its "
                      f"final {node.op_type} so that it outputs logits", UserWarning,
                      stacklevel=2)


class _RecordSink:
    """A Trainer callback: every metrics record to the TensorBoard log (``--log-dir``, rank 0)
    and the step records to the list the plot draws."""

    def __init__(self, log, steps: list):
        self.log, self.steps = log, steps

    def on_record(self, trainer, record: dict) -> None:
        if record.get("kind") == "step":
            self.steps.append(record)
        if self.log is not None:
            self.log.write(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _follow_records(trainer, args, world) -> _RecordSink:
    """The callback taking the metrics records of ``trainer`` for ``--log-dir`` (rank 0) and
    the plot (its ``steps``)."""
    log = None
    if args.log_dir is not None and world.is_root:
        from .training.tensorboard import TensorBoardLog

        log = TensorBoardLog(args.log_dir)
    sink = _RecordSink(log, [])
    trainer.callbacks.append(sink)
    return sink


def _step_records(args, collected: list[dict]) -> list[dict] | None:
    """The step records the plot draws (``--metrics-every``): of the whole run, read back from
    ``--metrics`` (a resumed run's file holds those before the resume too), else this
    process's."""
    if not args.metrics_every:
        return None
    if args.metrics and Path(args.metrics).exists():
        import json

        records = [json.loads(line) for line in Path(args.metrics).read_text().splitlines()]
        return [r for r in records if r.get("kind") == "step"]
    return collected


def train_model(args, log=print, on_trainer=None, world=None) -> dict:
    """``tr-onnx train``: check every output path, load the data, train (or resume), export the
    model, then write the plot; where the files went. ``on_trainer(trainer)`` is called once
    the Trainer exists. ``world``: the ranks training together (default: ``init()``'s, from
    the launcher); every rank calls this, rank 0 alone logs, writes files and exports."""
    from .data import flag_options, load, read_spec, split, write_meta
    from .distributed import init
    from .errors import TrainingDiverged
    from .training.session import TrainingSession
    from .training.trainer import CHECKPOINT_NAME, Trainer, label_kind

    world = init(args.dist_timeout) if world is None else world
    if not world.is_root:
        log = None
    if args.resume and not args.checkpoint_dir:
        raise TrOnnxError("--resume needs --checkpoint-dir (where last.ckpt.npz is)")
    ckpt = Path(args.checkpoint_dir) / CHECKPOINT_NAME if args.checkpoint_dir else None
    if args.resume and world.is_root and not ckpt.exists():  # the other ranks get rank 0's
        raise TrOnnxError(f"--resume: no checkpoint {ckpt}")
    out = Path(args.out) if args.out else Path.cwd() / f"{Path(args.model).stem}_trained.onnx"
    _check_outputs(args, out, ckpt)
    honoured = honoured_on_resume(args) if args.resume else []
    if args.val_data is not None and args.val_split is not None:
        raise InputError(f"--val-data {args.val_data} and --val-split {args.val_split}: give "
                         "one (validation from another file, or held out of --data)")
    if args.resume:
        # loss, optimizer, lr, schedule, accumulation and clipping come from the checkpoint
        overrides = {k: getattr(args, k) for k in ("backend", "precision")
                     if getattr(args, k) is not None}  # another machine may resume it
        session = _user_error(TrainingSession.from_checkpoint, ckpt, distributed=world,
                              base=args.model, **overrides)  # a LoRA run's: MODEL is the base
        lora = None
        if cli_finetune.tuned(args):  # the checkpoint trains the model the flags make
            tuned_model, _, _, lora = cli_finetune.apply(args, args.model)
            cli_finetune.check_resumed_lora(session, lora, ckpt)
            check_same_model(args.model, session, ckpt, tuned_model)
        else:
            cli_finetune.check_resumed_lora(session, None, ckpt)
            check_same_model(args.model, session, ckpt)
        check_resume_options(args, session)
        extra = session.checkpoint_extra
        seed = extra.get("seed", 0) if args.seed is None else args.seed
        # the checkpoint's global batch, split over this run's ranks
        batch_size = _user_error(Trainer.resumed_batch_size, ckpt,
                                 {"batch_size": 32, **extra}, world, args.batch_size)
    else:
        seed = 0 if args.seed is None else args.seed
        batch_size = 32 if args.batch_size is None else args.batch_size
        _check_output(args)
        model, tuned, notes, lora = cli_finetune.apply(args, args.model)  # docs/finetune.md
        for note in notes if log else ():
            log(note)
        session = _user_error(
            TrainingSession, model, loss=_loss(args),
            optimizer=_optimizer(args), frozen=args.frozen or (),
            output_name=args.output, grad_accumulation=args.grad_accumulation or 1,
            clip_grad_norm=args.clip_grad_norm, seed=seed, backend=args.backend or "auto",
            precision=args.precision or "fp32", distributed=world,
            **{"trainable": args.trainable, **tuned})
        if world.is_root:
            warn_softmax_output(session)
    kind, dtype = label_kind(session)
    spec_file = getattr(args, "data_spec", None)
    options = flag_options(read_spec(spec_file) if spec_file else {}, args)
    loaded = load(args.data, session.imported.inputs, kind, dtype, options)
    for note in loaded.notes if log else ():
        log(note)
    arrays, labels = loaded.data
    # every label, at its position in the file, before the split and the first step
    session.check_class_labels(labels, {k: v[:batch_size] for k, v in arrays.items()},
                               f"{args.data}: 'labels'")
    val_split = 0.2 if args.val_split is None and args.val_data is None else args.val_split
    if val_split:
        train, val = _user_error(split, arrays, labels, val_split, seed)
    else:
        train, val = (arrays, labels), None
    if args.val_data is not None:
        val_loaded = load(args.val_data, session.imported.inputs, kind, dtype, options)
        _check_same_classes(f"--val-data {args.val_data}", val_loaded.meta,
                            f"--data {args.data}", loaded.meta)
        val = val_loaded.data
        session.check_class_labels(val[1], {k: v[:batch_size] for k, v in val[0].items()},
                                   f"--val-data {args.val_data}: 'labels'")
    epochs = DEFAULT_EPOCHS if args.epochs is None and not args.resume else args.epochs
    options = {"epochs": epochs, "batch_size": batch_size, "seed": seed,
               "checkpoint_dir": args.checkpoint_dir, "metrics_path": args.metrics,
               "progress": not args.no_progress, "log": log,
               "checkpoint_every": args.checkpoint_every, "metrics_every": args.metrics_every}
    if args.resume:
        if epochs is None:  # to the checkpoint's total
            del options["epochs"]
        trainer = _user_error(Trainer.resume, options.pop("checkpoint_dir"), train, val,
                              session=session, **options)
        for line in honoured:
            trainer.log(line)
    else:
        trainer = _user_error(Trainer, session, train, val, **options)
        batches = trainer.batches_per_epoch * epochs  # global batches
        session.schedule = _schedule(args.lr_schedule or "constant",
                                     -(-batches // (args.grad_accumulation or 1)))
    records = _follow_records(trainer, args, world)
    if on_trainer is not None:
        on_trainer(trainer)
    try:
        history = trainer.fit()
    except TrainingDiverged as exc:
        if trainer.history and args.plot and world.is_root:  # the epochs completed
            try:
                _write_plot(trainer.history, args.plot, None, _step_records(args, records.steps))
            except TrOnnxError as failed:
                exc.add_note(str(failed))
        raise
    finally:
        records.close()
    if world.is_root:
        if lora is not None:  # the base with the adapters merged in, and the adapters
            for path in cli_finetune.write_lora(session, lora, args.model, out)[1:]:
                if log:
                    log(f"LoRA adapters: {path}")
        else:
            session.export(out)  # before the plot: whatever fails after it, the model is kept
        write_meta(loaded, out)
        if history and args.plot:
            _write_plot(history, args.plot, out, _step_records(args, records.steps))
    final = history[-1] if history else {}
    return {"trained": bool(history),
            "validated": bool(history) and trainer.val_data is not None,
            "val_acc": final.get("val_acc"), "val_loss": final.get("val_loss"),
            "train_loss": final.get("train_loss"),
            "epochs": trainer.epoch, "steps": session.step, "model": str(out),
            "checkpoint": str(ckpt) if ckpt else None,
            "metrics": args.metrics, "plot": args.plot if history and args.plot else None,
            "rank": world.rank, "world_size": world.size}


def _check_same_classes(what: str, meta: dict, reference: str, reference_meta: dict) -> None:
    """Class names numbered per file (a table's sorted text labels, an image folder's
    subfolders) must be the reference's: a class missing from one file would shift the
    indices of the others, and the loss would score the wrong classes without a word."""
    ours, theirs = meta.get("classes"), reference_meta.get("classes")
    if ours is not None and theirs is not None and list(ours) != list(theirs):
        raise InputError(f"{what}: its classes {list(ours)} are not those of {reference} "
                         f"({list(theirs)}), so the same index would name another class; "
                         "give data with the same classes")


def evaluate_model(args) -> dict:
    """``tr-onnx evaluate``: the loss (and whatever metrics the Trainer's evaluation reports) of
    MODEL on DATA, in eval mode, as a dict."""
    from .data import flag_options, load, read_spec
    from .training.session import TrainingSession
    from .training.trainer import Trainer, label_kind

    _check_output(args)
    session = _user_error(TrainingSession, args.model, loss=_loss(args),
                          output_name=args.output, backend=args.backend or "auto")
    warn_softmax_output(session)
    kind, dtype = label_kind(session)
    options = flag_options(read_spec(args.data_spec) if args.data_spec else {}, args)
    loaded = load(args.data, session.imported.inputs, kind, dtype, options)
    for note in loaded.notes:
        print(note)
    beside = Path(args.model).with_suffix(".data.json")  # write_meta's, if it trained here
    if beside.is_file():
        import json

        _check_same_classes(f"--data {args.data}", loaded.meta, str(beside),
                            json.loads(beside.read_text()))
    data = loaded.data
    session.check_class_labels(data[1], {k: v[:args.batch_size] for k, v in data[0].items()},
                               f"{args.data}: 'labels'")
    trainer = _user_error(Trainer, session, data, batch_size=args.batch_size, progress=False,
                          log=None)
    result = trainer.evaluate(data)
    return {"model": args.model, "data": args.data, "samples": len(data[1]),
            **{k: v for k, v in result.items() if v is not None}}


def run_evaluate(args) -> int:
    """``tr-onnx evaluate``: print the result (exit 0), or one error line (exit 2)."""
    import json

    info = evaluate_model(args)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{info['model']} on {info['data']} ({info['samples']} samples)")
    for key, value in info.items():
        if key not in ("model", "data", "samples"):
            print(f"{key:<11}{value:.6g}" if isinstance(value, float) else f"{key:<11}{value}")
    return 0


def _epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


def _print_trained(info: dict) -> None:
    def loss(v):  # a record's loss is None where it was not finite (strict JSON has no NaN)
        return "not finite" if v is None else f"{v:.4f}"
    if info["validated"] and info["val_acc"] is not None:
        print(f"final val accuracy {info['val_acc']:.4f} (val loss {loss(info['val_loss'])}) "
              f"after {info['epochs']} epochs, {info['steps']} steps")
    elif info["validated"]:
        print(f"final val loss {loss(info['val_loss'])} after {_epochs(info['epochs'])}")
    elif info["trained"]:
        print(f"final train loss {loss(info['train_loss'])} after {_epochs(info['epochs'])} "
              "(no validation split)")
    for what in ("model", "checkpoint", "metrics", "plot"):
        if info[what]:
            print(f"{what:<11}{info[what]}")


def _position(trainer) -> str | None:
    """Where ``trainer`` is while it trains (a skipped step shares its step number with the next
    applied one; its batch is its own)."""
    if trainer.status != "running" or trainer.batch >= trainer.batches_per_epoch:
        return None
    return (f"epoch {trainer.epoch + 1}/{trainer.epochs}, batch {trainer.batch + 1}/"
            f"{trainer.batches_per_epoch}")


def run_train(args, shown) -> int:
    """``tr-onnx train`` with the parsed ``args``; ``shown`` (the command line's warning
    format) learns where training is. Exit codes: 0 trained; 2 bad input (one line on stderr);
    1 training diverged (the last good checkpoint stays on disk); 3 the ranks lost each other
    (a collective waited ``--dist-timeout`` seconds: the last complete checkpoint resumes, on
    any number of ranks); 130 interrupted.

    Under ``mpiexec``/``srun`` a rank's error line names the rank, and a rank that fails ends
    the whole run (``MPI_Abort``) rather than leave the others waiting for it."""
    from .distributed import init
    from .errors import DistributedError, TrainingDiverged

    world = init(args.dist_timeout)
    rank = f"rank {world.rank} of {world.size}: " if world.size > 1 else ""

    started = []

    def on_trainer(trainer) -> None:
        started.append(trainer)
        shown.where = lambda: _position(trainer)

    try:
        info = train_model(args, on_trainer=on_trainer, world=world)
    except TrainingDiverged as exc:
        notes = "; ".join(getattr(exc, "__notes__", []))
        return _fail(world, f"tr-onnx: {rank}training diverged: {exc}"
                     + (f"; {notes}" if notes else ""), 1)
    except KeyboardInterrupt:
        return _fail(world, f"tr-onnx: {rank}{_interrupted(args, started)}", 130)
    except TrOnnxError as exc:
        lost = _cause(exc, DistributedError)  # a backend may chain it under its own error
        if lost is not None:  # its message names this rank and what it waited for
            return _fail(world, f"tr-onnx: error: {lost}", 3)
        if world.size == 1:
            raise  # the command line's one error line
        return _fail(world, f"tr-onnx: error: {rank}{exc}", 2)
    except Exception:
        if world.size == 1:
            raise
        traceback.print_exc()
        return _fail(world, f"tr-onnx: {rank}failed (traceback above)", 1)
    if world.is_root:
        _print_trained(info)
    return 0


def _interrupted(args, started: list) -> str:
    """What a Ctrl-C during ``tr-onnx train`` lost, and how to go on."""
    if not started:
        return "interrupted before training started"
    steps = started[0].session.step
    done = f"interrupted after {steps} step{'' if steps == 1 else 's'}"
    if args.checkpoint_dir:
        return f"{done}; continue with --resume --checkpoint-dir {args.checkpoint_dir}"
    return f"{done}; nothing saved: use --checkpoint-dir to resume"


def _cause(exc: BaseException, kind: type) -> BaseException | None:
    """``exc`` or the first exception of type ``kind`` it was raised from."""
    while exc is not None and not isinstance(exc, kind):
        exc = exc.__cause__
    return exc


def _fail(world, message: str, status: int) -> int:
    """Print ``message``; on several ranks also end every rank with ``status``: the others
    would otherwise wait ``--dist-timeout`` in their next exchange for this one."""
    print(message, file=sys.stderr, flush=True)
    if world.size > 1:
        # mpiexec forwards a rank's output through its proxy, which MPI_Abort ends at once: a
        # line written just before it was seen lost; half a second lets it through
        time.sleep(0.5)
        world.comm.Abort(status)
    return status
