"""``tr-onnx``: the command line. ``inspect`` shows how a model is laid out; ``run`` runs it;
``ops`` lists the registered ops; ``train`` trains it and exports the trained model.

Every error is one line on stderr and exit status 2 (argparse's usage errors too); warnings are
one line each, without the source line the warnings module adds; a closed stdout (``tr-onnx ops
--json | head``) ends the command quietly."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import textwrap
import warnings
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from .errors import ExportAdviceWarning, InputError, TrOnnxError

DESCRIPTION = ("Train exported ONNX models: ONNX in, trained ONNX out. inspect shows how a "
               "model is laid out, run runs it, ops and plugins list what is registered, train "
               "trains it and exports the trained model.")


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            sizes = tuple(int(d) for d in dims.split(","))
        except ValueError:
            sizes = ()
        if not name or not sizes or min(sizes) < 0:
            raise InputError(f"--shape {item}: expected NAME=D0,D1,... (the model input NAME, "
                             "one integer size >= 0 per axis)")
        shapes[name] = sizes
    return shapes


def _check_declared_dims(imported) -> None:
    """A negative declared size (some exporters write -1 for "any") is no size: name it."""
    for spec in imported.inputs:
        bad = [i for i, d in enumerate(spec.shape) if isinstance(d, int) and d < 0]
        if bad:
            raise InputError(f"{imported.source}: model input {spec.name!r} declares shape "
                             f"{list(spec.shape)}, with size {spec.shape[bad[0]]} at axis "
                             f"{bad[0]}; sizes are >= 0: re-export the model with a named "
                             "(symbolic) dimension there")


def _concrete_feed(imported, batch: int, shapes: dict[str, tuple[int, ...]]) -> dict:
    names = [s.name for s in imported.inputs]
    for name, dims in shapes.items():
        if name not in names:
            raise InputError(f"--shape {name}={','.join(map(str, dims))}: {name!r} is not an "
                             f"input of the model; its inputs are {names}")
    feed = {}
    for spec in imported.inputs:
        if spec.name in shapes:
            dims = shapes[spec.name]
            given = f"--shape {spec.name}={','.join(map(str, dims))}"
            if len(dims) != len(spec.shape):
                raise InputError(f"{given}: {len(dims)} sizes, but input {spec.name!r} has rank "
                                 f"{len(spec.shape)} (shape {list(spec.shape)}); give one size "
                                 "per axis")
            fixed = [i for i, (d, g) in enumerate(zip(spec.shape, dims))
                     if isinstance(d, int) and d != g]
            if fixed:
                raise InputError(f"{given}: axis {fixed[0]} of input {spec.name!r} is fixed at "
                                 f"{spec.shape[fixed[0]]} (shape {list(spec.shape)})")
        else:
            dims = tuple(d if isinstance(d, int) else batch if i == 0 else None
                         for i, d in enumerate(spec.shape))
            if None in dims:
                raise TrOnnxError(f"input {spec.name!r} has symbolic dims {list(spec.shape)}; "
                                  f"give them with --shape {spec.name}=...")
        feed[spec.name] = np.zeros(dims, spec.dtype)
    return feed


def inspect_model(path: str, batch: int = 1, channel_align: int | None = None,
                  shapes: dict | None = None, reuse: bool = True, backend: str = "numpy",
                  train: bool = False, precision: str = "fp32",
                  gpu_properties: str | None = None) -> dict:
    """Everything ``tr-onnx inspect`` prints, as a dict. ``backend="cuda"`` plans for the GPU
    without one (the cuda bindings over a recording device) and adds ``cudnn_graphs``: the
    real cuDNN library's deviceless check of every graph the plan declares, for the GPU that
    ``gpu_properties`` describes (default: the packaged H200). ``train``: the training plan
    (``precision`` fp32/fp16/bf16) instead of the inference one."""
    from .export_advice import export_advice
    from .importer import default_opset
    from .session import InferenceSession

    device = None
    if backend == "cuda":
        from .testing.recorder import FakeRecorder

        def device(plan):  # binds the plan to arena addresses; runs nothing
            return FakeRecorder(plan.memory)
    if train:
        from .training.session import TrainingSession

        with warnings.catch_warnings():  # inspect prints the advice in its own section
            warnings.simplefilter("ignore", ExportAdviceWarning)
            sess = TrainingSession(path, backend=backend, device=device, precision=precision,
                                   channel_align=channel_align)
    else:
        sess = InferenceSession(path, backend=backend, channel_align=channel_align,
                                reuse_memory=reuse, device=device)
    imported = sess.imported
    _check_declared_dims(imported)
    feed = _concrete_feed(imported, batch, shapes or {})
    const_feeds = [n for n in imported.const_feeds if n in feed]
    if const_feeds:
        raise TrOnnxError(f"inputs {const_feeds} determine shapes; inspect needs them as constants")
    plan = sess._train_plan(feed) if train else sess.plan_for(feed)
    graphs = None
    if backend == "cuda":
        from dataclasses import asdict

        from .backends.cuda.deviceless import H200_PROPERTIES, check_plan

        graphs = {"target": str(gpu_properties or H200_PROPERTIES),
                  "graphs": [asdict(c) | {"ok": c.ok} for c in check_plan(plan,
                                                                            gpu_properties)]}
    ops = Counter()
    sources = {}
    for node, source in plan.kernels:
        key = (node.domain or "ai.onnx", node.op_type, node.since_version)
        ops[key] += 1
        sources[key] = source
    aliased = Counter(n.op_type for n in plan.graph.nodes
                      if n.outputs and n.outputs[0] is not None and n.outputs[0].alias_of)
    mem = plan.memory
    return {
        "model": imported.source,
        "opset": {"original": imported.original_opset,
                  "imported": default_opset(imported.proto)},
        "inputs": {s.name: list(s.shape) for s in imported.inputs},
        "planned_for": {k: list(v.shape) for k, v in feed.items()},
        "backend": sess.backend,
        "channel_align": sess.channel_align,
        "nodes": len(plan.graph.nodes),
        "kernels": [{"domain": d, "op": o, "since_version": v, "count": c,
                     "kernel": f"{sources[(d, o, v)]} ({sess.backend})"}
                    for (d, o, v), c in sorted(ops.items())],
        "zero_copy_views": dict(aliased),
        **(parameters := _parameters_info(imported)),
        # signs that the exporter changed the model (BatchNorm folded, biases dropped...)
        "export_advice": [{"code": a.code, "message": a.message, "names": list(a.names)}
                          for a in export_advice(imported, tied=parameters["tied"],
                                                 split=parameters["split"])],
        "layout": {
            "channels_last_values": plan.layout.channels_last,
            "transposes_inserted": len(plan.layout.transposes),
            "transpose_nodes": plan.layout.transposes,
            "flattens_absorbed": plan.layout.absorbed_flattens,
            "values": {v.name: v.get_layout().describe() for v in plan.graph.values.values()
                       if not v.get_layout().is_plain},
        },
        "memory": {
            "arena_bytes": mem.total_bytes,
            "naive_bytes": mem.naive_bytes,
            "regions": {r.name: {"offset": o, "bytes": b} for r, (o, b) in mem.regions.items()},
        },
        **({"cudnn_graphs": graphs} if graphs is not None else {}),
    }


def _parameters_info(imported) -> dict:
    """The default trainable set with the reason for each initializer, and what trains as
    one parameter (``training.parameters``)."""
    from .training.parameters import parameter_roles, parameter_sharing

    sharing = parameter_sharing(imported)
    roles = parameter_roles(imported, sharing)
    dims = {i.name: list(i.dims) for i in imported.proto.graph.initializer}
    return {
        "parameters": {name: {"trainable": r.trainable, "reason": r.reason,
                              "shape": dims.get(name, dims.get(sharing.identity.get(name)))}
                       for name, r in roles.items()},
        # exporters share equal-valued initializers through Identity nodes
        "shared_initializers": dict(sharing.identity),
        "untied": sorted(sharing.untie),
        "tied": {copy: {"source": s.source, "transposed": s.perm is not None}
                 for copy, s in sharing.tie.items()},
        # merged by the exporter, trained as one parameter per reading module
        "split": {name: sorted(readers.values()) for name, readers in sharing.split.items()},
    }


def _print_parameters(info: dict, verbose: bool) -> None:
    params = info["parameters"]
    trainable = {n: p for n, p in params.items() if p["trainable"]}
    frozen = {n: p for n, p in params.items() if not p["trainable"]}
    size = sum(int(np.prod(p["shape"] or [])) for p in trainable.values())
    print("\nparameters (the default trainable set; trainable=/frozen= override)")
    print(f"  trainable  {len(trainable)} initializers, {size:,d} elements")
    if verbose:
        for name, p in trainable.items():
            print(f"    {name:<40} {p['shape']}  {p['reason']}")
    print(f"  frozen     {len(frozen)}")
    for name, p in frozen.items():
        print(f"    {name:<40} {p['shape']}  {p['reason']}")
    if info["tied"]:
        print(f"  tied       {len(info['tied'])} (one parameter stored twice; "
              "tie_shared_initializers=False keeps them apart)")
        for copy, t in info["tied"].items():
            how = "the transpose of" if t["transposed"] else "equal to"
            print(f"    {copy:<40} {how} {t['source']}")
    if info["split"]:
        print(f"  split      {len(info['split'])} (constant-valued, merged by the exporter, read "
              "by several modules: one parameter per module)")
        for name, parts in info["split"].items():
            print(f"    {name:<40} also {', '.join(parts)}")
    shared = info["shared_initializers"]
    if shared:
        untied = set(info["untied"])
        print(f"  Identity copies {len(shared)}: {len(untied)} train as separate parameters "
              "(constant-filled or small: a fresh BatchNorm's weight and running variance), "
              f"{len(shared) - len(untied)} as one (tie_shared_initializers=True / False: all "
              "one / all separate)")
        if verbose:
            for copy, source in shared.items():
                print(f"    {copy} = {source}" + ("  (untied)" if copy in untied else ""))


def _print_inspect(info: dict, verbose: bool) -> None:
    print(f"model      {info['model']}")
    print(f"opset      {info['opset']['original']} (imported as {info['opset']['imported']})")
    print(f"inputs     {info['inputs']}  planned for {info['planned_for']}")
    print(f"backend    {info['backend']}, channel_align {info['channel_align']}, "
          f"{info['nodes']} nodes")
    print("\nops and kernels")
    for k in info["kernels"]:
        print(f"  {k['op']:<24} {k['domain']:<10} v{k['since_version']:<3} x{k['count']:<4} "
              f"{k['kernel']}")
    if info["zero_copy_views"]:
        views = ", ".join(f"{op} x{n}" for op, n in info["zero_copy_views"].items())
        print(f"  zero-copy views (no kernel): {views}")
    _print_parameters(info, verbose)
    lay = info["layout"]
    print("\nlayout")
    print(f"  channels-last values  {lay['channels_last_values']}")
    print(f"  transposes inserted   {lay['transposes_inserted']}"
          + (f"  {lay['transpose_nodes']}" if lay["transpose_nodes"] else ""))
    print(f"  flattens absorbed     {len(lay['flattens_absorbed'])}"
          + (f"  {lay['flattens_absorbed']}" if lay["flattens_absorbed"] else ""))
    if verbose:
        for name, desc in lay["values"].items():
            print(f"    {name:<40} {desc}")
    mem = info["memory"]
    print("\nmemory plan")
    for name, r in mem["regions"].items():
        print(f"  {name:<11} {r['bytes']:>14,d} B at {r['offset']:>14,d}")
    ratio = mem["arena_bytes"] / mem["naive_bytes"] if mem["naive_bytes"] else 1.0
    print(f"  arena {mem['arena_bytes']:,d} B vs naive sum {mem['naive_bytes']:,d} B "
          f"({ratio:.1%})")
    _print_advice(info["export_advice"])
    if "cudnn_graphs" in info:
        _print_cudnn_graphs(info["cudnn_graphs"])


def _print_advice(advice: list[dict]) -> None:
    print("\nexport advice" + ("" if advice else ": none (no sign that the exporter changed "
                                                 "the model)"))
    for a in advice:
        print(textwrap.fill(f"[{a['code']}] {a['message']}", 98, initial_indent="  ",
                            subsequent_indent="    "))


def _print_cudnn_graphs(graphs: dict) -> None:
    rows = graphs["graphs"]
    print(f"\ncuDNN graphs: {len(rows)}, checked by the cuDNN library without a GPU for the "
          f"target in {graphs['target']}")
    print(f"  {'kind':<19} {'io/compute':<15} {'dims':<18} {'engines':>7} {'fit':>4} "
          f"{'workspace':>10}  plan / why not")
    for r in rows:
        ws = "-" if r["workspace"] is None else f"{r['workspace']:,d}"
        what = r["plan"] if r["ok"] else f"FAILS: {r['error']}"
        print(f"  {r['kind']:<19} {r['dtypes']:<15} {str(list(r['dims'])):<18} "
              f"{r['engines']:>7} {r['within']:>4} {ws:>10}  {what}")
        if not r["ok"]:
            print(f"    at {r['node']}")
    failing = sum(not r["ok"] for r in rows)
    print(f"  {failing} failing" if failing else "  every graph plans on the target")


def run_model(path: str, batch: int, inputs: str | None, channel_align: int | None,
              repeat: int, shapes: dict) -> dict:
    """Run ``path`` on an .npz of inputs (or seeded random data); outputs and timing."""
    import time

    from .session import InferenceSession

    sess = InferenceSession(path, channel_align=channel_align)
    _check_declared_dims(sess.imported)
    if inputs:
        feed = _load_inputs(inputs)
    else:
        rng = np.random.default_rng(0)
        feed = {k: (rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f"
                    else v) for k, v in _concrete_feed(sess.imported, batch, shapes).items()}
    start = time.perf_counter()
    outputs = sess.run(None, feed)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    names = [o.name for o in sess.get_outputs()]
    return {"outputs": {n: {"shape": list(o.shape), "dtype": str(o.dtype),
                            "first": o.reshape(-1)[:5].tolist()} for n, o in zip(names, outputs)},
            "plan_and_first_run_ms": first * 1e3,
            "median_run_ms": float(np.median(times)) * 1e3 if times else None}


def _load_inputs(path: str) -> dict[str, np.ndarray]:
    """``--inputs``: the arrays of an .npz, loaded without unpickling anything (a pickle can run
    code)."""
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                return {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise InputError(f"--inputs {path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(f"--inputs {path}: not an .npz of plain arrays (numpy: "
                         f"{' '.join(str(exc).split())}); tr-onnx loads no pickled objects "
                         "(allow_pickle=False): save the arrays with np.savez") from None
    raise InputError(f"--inputs {path}: one array (.npy), not an .npz; save one array per "
                     "model input with np.savez(path, NAME=array, ...)")


def list_ops() -> list[dict]:
    """Every registered (domain, op): versions, backends (and the versions each runs),
    differentiable, providing op sets."""
    from .registry import default_registry

    registry = default_registry()
    rows: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"versions": defaultdict(set), "sources": set(), "differentiable": False})
    for key in registry.keys():
        row = rows[(key.domain, key.op_type)]
        row["versions"][key.backend].add(key.since_version)
        row["sources"].add(registry.source_of(key))
        opdef = registry.lookup(key.domain, key.op_type, key.since_version, key.backend)
        row["differentiable"] |= opdef.gradient is not None
    return [{"domain": d or "ai.onnx", "op": o,
             "versions": sorted(set().union(*r["versions"].values())),
             "backends": sorted(r["versions"]),
             "backend_versions": {b: sorted(v) for b, v in sorted(r["versions"].items())},
             "differentiable": r["differentiable"], "source": sorted(r["sources"])}
            for (d, o), r in sorted(rows.items())]


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
    from .training.trainer import plot_format

    for option, given, path in (("--out" if args.out else "--out (default)", out, out),
                                ("--plot", args.plot, args.plot),
                                ("--metrics", args.metrics, args.metrics),
                                ("--checkpoint-dir", args.checkpoint_dir, ckpt)):
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


def _check_same_model(path: str, session, ckpt: Path) -> None:
    """``--resume``: MODEL must be the model the checkpoint trains, as given to the first run or
    as its trained export (weights and the export's inference form differ, nothing else)."""
    from .importer import load_model

    model, _ = load_model(path)
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


def _write_plot(history: list[dict], plot: str, model: Path | None) -> None:
    from .training import trainer

    try:
        trainer.plot_history(history, plot)
    except (OSError, RuntimeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        kept = f"; the trained model was written to {model}" if model else ""
        raise TrOnnxError(f"--plot {plot}: not written ({why}){kept}") from None


def train_model(args, log=print, on_trainer=None) -> dict:
    """``tr-onnx train``: check every output path, load the data, train (or resume), export the
    model, then write the plot; where the files went. ``on_trainer(trainer)`` is called once
    the Trainer exists."""
    from .data import load_dataset, split
    from .errors import TrainingDiverged
    from .optim import make_optimizer
    from .training.session import TrainingSession
    from .training.trainer import CHECKPOINT_NAME, Trainer, label_kind

    if args.resume and not args.checkpoint_dir:
        raise TrOnnxError("--resume needs --checkpoint-dir (where last.ckpt.npz is)")
    ckpt = Path(args.checkpoint_dir) / CHECKPOINT_NAME if args.checkpoint_dir else None
    if args.resume and not ckpt.exists():
        raise TrOnnxError(f"--resume: no checkpoint {ckpt}")
    out = Path(args.out) if args.out else Path.cwd() / f"{Path(args.model).stem}_trained.onnx"
    _check_outputs(args, out, ckpt)
    if args.resume:
        # loss, optimizer, lr, schedule, accumulation and clipping come from the checkpoint
        overrides = {k: getattr(args, k) for k in ("backend", "precision")
                     if getattr(args, k) is not None}  # another machine may resume it
        session = _user_error(TrainingSession.from_checkpoint, ckpt, **overrides)
        _check_same_model(args.model, session, ckpt)
        extra = session.checkpoint_extra
        seed = extra.get("seed", 0) if args.seed is None else args.seed
        batch_size = extra.get("batch_size", 32) if args.batch_size is None else args.batch_size
    else:
        seed = 0 if args.seed is None else args.seed
        batch_size = 32 if args.batch_size is None else args.batch_size
        session = _user_error(
            TrainingSession, args.model, loss=args.loss,
            optimizer=_user_error(make_optimizer, args.optimizer, args.lr),
            grad_accumulation=args.grad_accumulation, clip_grad_norm=args.clip_grad_norm,
            seed=seed, backend=args.backend or "auto", precision=args.precision or "fp32")
    kind, dtype = label_kind(session)
    arrays, labels = load_dataset(args.data, session.imported.inputs, kind, dtype)
    # every label, at its position in the file, before the split and the first step
    session.check_class_labels(labels, {k: v[:batch_size] for k, v in arrays.items()},
                               f"{args.data}: 'labels'")
    if args.val_split > 0:
        train, val = _user_error(split, arrays, labels, args.val_split, seed)
    else:
        train, val = (arrays, labels), None
    options = {"epochs": args.epochs, "batch_size": batch_size, "seed": seed,
               "checkpoint_dir": args.checkpoint_dir, "metrics_path": args.metrics,
               "progress": not args.no_progress, "log": log,
               "checkpoint_every": args.checkpoint_every, "metrics_every": args.metrics_every}
    if args.resume:
        trainer = _user_error(Trainer.resume, options.pop("checkpoint_dir"), train, val,
                              session=session, **options)
    else:
        batches = -(-len(train[1]) // batch_size) * args.epochs
        session.schedule = _schedule(args.lr_schedule, -(-batches // args.grad_accumulation))
        trainer = _user_error(Trainer, session, train, val, **options)
    if on_trainer is not None:
        on_trainer(trainer)
    try:
        history = trainer.fit()
    except TrainingDiverged as exc:
        if trainer.history and args.plot:  # the epochs completed
            try:
                _write_plot(trainer.history, args.plot, None)
            except TrOnnxError as failed:
                exc.add_note(str(failed))
        raise
    session.export(out)  # before the plot: whatever fails after it, the model is kept
    if history and args.plot:
        _write_plot(history, args.plot, out)
    final = history[-1] if history else {}
    return {"val_acc": final.get("val_acc"), "val_loss": final.get("val_loss"),
            "train_loss": final.get("train_loss"),
            "epochs": trainer.epoch, "steps": session.step, "model": str(out),
            "checkpoint": str(ckpt) if ckpt else None,
            "metrics": args.metrics, "plot": args.plot if history and args.plot else None}


def _count(minimum: int):
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


def _add_train_parser(sub) -> None:
    from .optim import OPTIMIZERS, SCHEDULES
    from .training.losses import LOSSES

    t = sub.add_parser("train", help="train a model on an .npz or the digits data set, export it",
                       description="Train MODEL and export the trained model. Every output path "
                       "is checked before the first step; missing parent folders are created.")
    t.add_argument("model", help="the ONNX model to train (with --resume: the checkpoint's "
                   "model, or its trained export)")
    t.add_argument("--data", required=True, metavar="DATA.npz|digits",
                   help="an .npz with one array per model input (named after it, samples on "
                   "axis 0) plus 'labels', or 'digits' (scikit-learn's 8x8 digits)")
    t.add_argument("--loss", default="cross_entropy",
                   help=f"a builtin loss: {', '.join(LOSSES)} (default cross_entropy), or an "
                   "ONNX loss model (a path ending in .onnx) taking (model output, labels)")
    t.add_argument("--optimizer", default="adamw",
                   help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    defaults = ", ".join(f"{name} {cls().lr:g}" for name, cls in OPTIMIZERS.items())
    t.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: the optimizer's: {defaults})")
    t.add_argument("--epochs", type=_count(0), default=5,
                   help="total epochs (default 5; a resumed run continues to it)")
    t.add_argument("--batch-size", type=_count(1), default=None,
                   help="default 32; on --resume the checkpoint's")
    t.add_argument("--val-split", type=_fraction, default=0.2, metavar="F",
                   help="hold out this fraction of the samples (of the .npz or the digits) "
                   "for validation (default 0.2; 0: no validation)")
    t.add_argument("--seed", type=int, default=None,
                   help="data split and order, dropout (default 0; on --resume the checkpoint's)")
    t.add_argument("--out", help="trained model (default: ./<model stem>_trained.onnx)")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="last.ckpt.npz is written there each epoch")
    t.add_argument("--checkpoint-every", type=_count(1), default=None, metavar="N",
                   help="also checkpoint every N batches")
    t.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir (loss, optimizer, lr, schedule, "
                   "accumulation and clipping come from the checkpoint)")
    t.add_argument("--metrics", metavar="FILE.jsonl", help="JSON lines, one per epoch")
    t.add_argument("--metrics-every", type=_count(1), default=None, metavar="N",
                   help="also a metrics line every N batches")
    t.add_argument("--plot", metavar="FILE",
                   help="loss and accuracy per epoch, in the format the suffix names (.png, "
                   ".svg, .pdf...; no suffix: PNG); written after the model")
    t.add_argument("--backend", choices=["auto", "numpy", "cuda"], default=None,
                   help="default: auto (cuda when a GPU is usable); on --resume: the "
                   "checkpoint's")
    t.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=None,
                   help="fp16/bf16: mixed precision on cuda (default fp32; on --resume: the "
                   "checkpoint's)")
    t.add_argument("--grad-accumulation", type=_count(1), default=1, metavar="K",
                   help="one optimizer step every K batches, gradients averaged (default 1)")
    t.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the global gradient norm to X (default: no clipping)")
    t.add_argument("--lr-schedule", default="constant", choices=list(SCHEDULES),
                   help=f"one of {', '.join(SCHEDULES)} (default constant): cosine anneals to 0 "
                   "over the run, step multiplies the lr by 0.1 after each third of it, warmup "
                   "rises linearly over the first tenth")
    t.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


def _print_trained(info: dict) -> None:
    if info["val_acc"] is not None:
        print(f"final val accuracy {info['val_acc']:.4f} (val loss {info['val_loss']:.4f}) after "
              f"{info['epochs']} epochs, {info['steps']} steps")
    elif info["val_loss"] is not None:
        print(f"final val loss {info['val_loss']:.4f} after {_epochs(info['epochs'])}")
    elif info["train_loss"] is not None:
        print(f"final train loss {info['train_loss']:.4f} after {_epochs(info['epochs'])} "
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


def _train(args, shown: _WarningLines) -> int:
    """Exit codes: 0 trained; 2 bad input (one line on stderr); 1 training diverged (the last
    good checkpoint stays on disk); 130 interrupted."""
    from .errors import TrainingDiverged

    def on_trainer(trainer) -> None:
        shown.where = lambda: _position(trainer)

    try:
        info = train_model(args, on_trainer=on_trainer)
    except TrainingDiverged as exc:
        notes = "; ".join(getattr(exc, "__notes__", []))
        print(f"tr-onnx: training diverged: {exc}" + (f"; {notes}" if notes else ""),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = (f"; continue with --resume --checkpoint-dir {args.checkpoint_dir}"
                if args.checkpoint_dir else "")
        print(f"tr-onnx: interrupted{hint}", file=sys.stderr)
        return 130
    _print_trained(info)
    return 0


def list_plugins(include_builtin: bool = False) -> dict:
    """Loaded op-set plugins: origin (package and entry point, or module path), the ops each
    provides, and every deliberate override."""
    from .registry import default_registry

    registry = default_registry()
    plugins = {name: info for name, info in registry.plugins.items()
               if include_builtin or info["origin"] != "builtin"}
    return {"plugins": plugins, "overrides": list(registry.overrides)}


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error of the command line
    (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _WarningLines:
    """How the command line formats a warning (``warnings.formatwarning`` while ``main`` runs):
    one line, ``tr-onnx: warning: ...``, without the source file, line and code the warnings
    module adds (they point into tr_onnx, not at anything the user can change); ``where()``,
    when set, says where training was. Filters and ``catch_warnings(record=True)`` work as
    ever: only the text changes."""

    def __init__(self):
        self.where = None

    def format(self, message, category, filename, lineno, line=None) -> str:
        where = self.where() if self.where is not None else None
        text = " ".join(str(message).split())
        clear = "\r\x1b[K" if sys.stderr is not None and sys.stderr.isatty() else ""  # progress
        return f"{clear}tr-onnx: warning: {f'{where}: ' if where else ''}{text}\n"


SHAPE_HELP = ("the sizes of input NAME, one per axis (repeatable); needed for symbolic "
              "dimensions other than the batch axis")


def build_parser() -> argparse.ArgumentParser:
    """The ``tr-onnx`` argument parser."""
    from . import __version__

    parser = _Parser(prog="tr-onnx", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of inspect, run, plugins, ops, train "
                                "(tr-onnx COMMAND --help for its options)")
    p = sub.add_parser("inspect", help="ops and kernels, layout decisions, memory plan")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("--batch", type=_count(1), default=1,
                   help="size of symbolic batch (first) dimensions (default 1)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help=SHAPE_HELP)
    p.add_argument("--channel-align", type=_count(1), default=None, metavar="K",
                   help="pad feature-map channels to a multiple of K (default: the backend's)")
    p.add_argument("--no-reuse", action="store_true", help="turn MemoryPlan lifetime reuse off")
    p.add_argument("--json", action="store_true", help="everything as one JSON object")
    p.add_argument("-v", "--verbose", action="store_true", help="list every non-plain layout")
    p.add_argument("--backend", choices=("numpy", "cuda"), default="numpy",
                   help="cuda: plan for the GPU and check every cuDNN graph with the real "
                        "library, no GPU needed")
    p.add_argument("--train", action="store_true", help="the training plan (default: inference)")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="with --train --backend cuda")
    p.add_argument("--gpu-properties", metavar="FILE",
                   help="cuDNN device property list (JSON) of the target GPU (default: H200)")
    r = sub.add_parser("run", help="run a model on inputs from an .npz (or random data)")
    r.add_argument("model", help="the ONNX model")
    r.add_argument("--inputs", metavar="X.npz",
                   help=".npz with one array per model input, named after it (plain arrays: "
                   "nothing pickled is loaded); default: seeded random data")
    r.add_argument("--batch", type=_count(1), default=1,
                   help="size of symbolic batch (first) dimensions of the random data "
                   "(default 1)")
    r.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help=SHAPE_HELP)
    r.add_argument("--channel-align", type=_count(1), default=None, metavar="K",
                   help="pad feature-map channels to a multiple of K (default: the backend's)")
    r.add_argument("--repeat", type=_count(1), default=10, metavar="N",
                   help="timed runs after the first (default 10)")
    pl = sub.add_parser("plugins", help="list loaded op-set plugins and their ops")
    pl.add_argument("--builtin", action="store_true", help="include tr_onnx's own op sets")
    pl.add_argument("--json", action="store_true", help="as JSON")
    o = sub.add_parser("ops", help="list registered ops")
    o.add_argument("--json", action="store_true", help="as JSON")
    _add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``tr-onnx`` with ``argv`` (default: the process's arguments); the exit status."""
    parser = build_parser()
    shown = _WarningLines()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version or a usage error: argparse printed it
            return exc.code if isinstance(exc.code, int) else 0
        formatwarning, warnings.formatwarning = warnings.formatwarning, shown.format
        try:
            status = _command(args, shown)
        finally:
            warnings.formatwarning = formatwarning
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        # the reader went away (tr-onnx ops --json | head): the recipe of the Python docs
        # (signal module, "Note on SIGPIPE"): stdout to devnull, so that the flush at exit
        # cannot fail again, and exit status 1
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _command(args, shown: _WarningLines) -> int:
    try:
        if args.command == "train":
            return _train(args, shown)
        if args.command == "inspect":
            info = inspect_model(args.model, args.batch, args.channel_align,
                                 _parse_shapes(args.shape), reuse=not args.no_reuse,
                                 backend=args.backend, train=args.train,
                                 precision=args.precision, gpu_properties=args.gpu_properties)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                _print_inspect(info, args.verbose)
            graphs = info.get("cudnn_graphs", {}).get("graphs", [])
            return 1 if any(not g["ok"] for g in graphs) else 0
        elif args.command == "run":
            info = run_model(args.model, args.batch, args.inputs, args.channel_align,
                             args.repeat, _parse_shapes(args.shape))
            for name, out in info["outputs"].items():
                print(f"{name}: shape {out['shape']} {out['dtype']}  first {out['first']}")
            print(f"plan + first run {info['plan_and_first_run_ms']:.1f} ms; median run "
                  f"{info['median_run_ms']:.2f} ms over {args.repeat}")
        elif args.command == "plugins":
            info = list_plugins(args.builtin)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                for name, plugin in info["plugins"].items():
                    print(f"{name}: {plugin['origin']}")
                    for op in plugin["ops"]:
                        print(f"    {op}")
                if not info["plugins"]:
                    print("no op-set plugins loaded (entry-point group 'tr_onnx')")
                for line in info["overrides"]:
                    print(f"override: {line}")
        elif args.command == "ops":
            rows = list_ops()
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for r in rows:
                    backends = ", ".join(b if v == r["versions"] else f"{b} {v}"
                                         for b, v in r["backend_versions"].items())
                    print(f"{r['op']:<28} {r['domain']:<12} versions {r['versions']} "
                          f"backends [{backends}] "
                          f"{'differentiable' if r['differentiable'] else '-'}  "
                          f"{', '.join(r['source'])}")
                print(f"{len(rows)} ops")
    except TrOnnxError as exc:
        print(f"tr-onnx: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
