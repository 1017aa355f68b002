"""``tr-onnx``: the command line. ``inspect`` shows how a model is laid out; ``run`` runs it;
``ops`` lists the registered ops; ``train`` trains it and exports the trained model.

Every error is one line on stderr and exit status 2 (argparse's usage errors too); warnings are
one line each, without the source line the warnings module adds; a closed stdout (``tr-onnx ops
--json | head``) ends the command quietly."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import warnings
import zipfile
from collections import Counter, defaultdict

import numpy as np

from .backends import backend_named
from .cli_finetune import add_arguments as add_finetune_arguments
from .cli_finetune import apply as apply_finetune
from .cli_finetune import tuned as finetune_tuned
from .cli_train import run_evaluate, run_train
from .cli_train_args import add_evaluate_parser, add_train_parser, count_type
from .errors import ExportAdviceWarning, InputError, TrOnnxError

DESCRIPTION = ("Train exported ONNX models: ONNX in, trained ONNX out. inspect shows how a "
               "model is laid out, run runs it, ops and plugins list what is registered, train "
               "trains it and exports the trained model, evaluate prints its loss and metrics.")


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
    """Zeros of each input's concrete shape (its symbolic dims from ``batch`` or ``shapes``),
    as read-only broadcast views: planning reads their shapes (and a shape-deciding input's
    zeros), so a declared input of any size costs no memory until the plan is checked
    against the machine."""
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
        feed[spec.name] = np.broadcast_to(np.zeros((), spec.dtype), dims)
    return feed


def inspect_model(path: str, batch: int = 1, channel_align: int | None = None,
                  shapes: dict | None = None, reuse: bool = True, backend: str = "numpy",
                  train: bool = False, precision: str = "fp32",
                  gpu_properties: str | None = None, finetune: tuple | None = None) -> dict:
    """Everything ``tr-onnx inspect`` prints, as a dict. ``backend="cuda"`` plans for the GPU
    without one (the cuda bindings over a recording device) and adds ``cudnn_graphs``: the
    real cuDNN library's deviceless check of every graph the plan declares, for the GPU that
    ``gpu_properties`` describes (default: the packaged H200). ``train``: the training plan
    (``precision`` fp32/fp16/bf16) instead of the inference one. ``finetune``: ``(model,
    session_kwargs, notes, lora)`` of ``cli_finetune.apply``: the training plan of that model
    (a new head, LoRA branches) with its trainable set, and ``finetune_cost``: what it trains
    and holds beside full fine-tuning of the model (planned too)."""
    from .export_advice import export_advice
    from .importer import default_opset
    from .session import InferenceSession
    from .testing.recorder import FakeRecorder

    # plans for the backend's device without one: a recorder binds the plan, runs nothing
    target = backend_named(backend).on_device(lambda plan: FakeRecorder(plan.memory))
    if train or finetune:
        from .training.session import TrainingSession

        def training_session(model, **kwargs):
            with warnings.catch_warnings():  # inspect prints the advice in its own section
                warnings.simplefilter("ignore", ExportAdviceWarning)
                return TrainingSession(model, backend=target, precision=precision,
                                       channel_align=channel_align, **kwargs)
        sess = training_session(*finetune[:1], **finetune[1]) if finetune else \
            training_session(path)
    else:
        sess = InferenceSession(path, backend=target, channel_align=channel_align,
                                reuse_memory=reuse)
    imported = sess.imported
    _check_declared_dims(imported)
    feed = _concrete_feed(imported, batch, shapes or {})
    const_feeds = [n for n in imported.const_feeds if n in feed]
    if const_feeds:
        raise TrOnnxError(f"inputs {const_feeds} determine shapes; inspect needs them as constants")
    plan = sess._train_plan(feed) if train or finetune else sess.plan_for(feed)
    cost = None
    if finetune:
        from .cli_finetune import plan_cost

        # full fine-tuning: the new head's model (the LoRA base is the file) training everything
        full = training_session(path if finetune[3] is not None else finetune[0])
        cost = {**plan_cost(sess, plan), "notes": finetune[2],
                "full": plan_cost(full, full._train_plan(feed))}
    report = target.plan_report(plan, gpu_properties)
    ops = Counter()
    sources = {}
    for node, source in plan.kernels:
        key = (node.domain or "ai.onnx", node.op_type, node.since_version)
        ops[key] += 1
        sources[key] = source
    paths = report.get("paths", {})
    aliased = Counter(n.op_type for n in plan.graph.nodes
                      if n.outputs and n.outputs[0] is not None and n.outputs[0].alias_of)
    mem = plan.memory
    return {
        "model": path if finetune else imported.source,
        "opset": {"original": imported.original_opset,
                  "imported": default_opset(imported.proto)},
        "inputs": {s.name: list(s.shape) for s in imported.inputs},
        "planned_for": {k: list(v.shape) for k, v in feed.items()},
        "backend": sess.backend,
        "channel_align": sess.channel_align,
        "nodes": len(plan.graph.nodes),
        "kernels": [{"domain": d, "op": o, "since_version": v, "count": c,
                     "kernel": f"{sources[(d, o, v)]} ({sess.backend})",
                     **({"paths": paths[(d, o, v)]} if (d, o, v) in paths else {})}
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
        **({"cudnn_graphs": report["cudnn_graphs"]} if "cudnn_graphs" in report else {}),
        **({"finetune_cost": cost} if cost is not None else {}),
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
        for path, n in k.get("paths", {}).items():
            if path != "tr_onnx kernels":
                print(f"      x{n} {path}")
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
    if "finetune_cost" in info:
        from .cli_finetune import print_cost

        print_cost(info["finetune_cost"])
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
        zeros = _concrete_feed(sess.imported, batch, shapes)
        sess.plan_for(zeros)  # an input too large for the machine is an ArenaSizeError here
        rng = np.random.default_rng(0)
        feed = {k: (rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f"
                    else v.copy()) for k, v in zeros.items()}
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
    (exit status 2), and "did you mean" for a mistyped option or command (difflib over the
    option strings of the command given, or the command names)."""

    def __init__(self, *args, **kwargs):
        # an abbreviation (--epoch for --epochs) that works today breaks when an option sharing
        # its prefix is added; a mistyped option gets "did you mean" instead
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        hint = self._did_you_mean(message)
        self.exit(2, f"{self.prog}: error: {message}{hint}; see {self.prog} --help\n")

    def _did_you_mean(self, message: str) -> str:
        import difflib

        commands = self._commands()
        if message.startswith("unrecognized arguments: "):
            argv = getattr(self, "_argv", [])
            command = next((a for a in argv if a in commands), None)
            parser = commands.get(command, self)
            options = [o for a in parser._actions for o in a.option_strings]
            hints = []
            for token in message.removeprefix("unrecognized arguments: ").split():
                if token.startswith("-"):
                    near = difflib.get_close_matches(token.partition("=")[0], options, n=2,
                                                    cutoff=0.75)
                    if near:
                        hints.append(f"{token}: did you mean {' or '.join(near)}?")
            return "; " + "; ".join(hints) if hints else ""
        if "invalid choice: " in message and "(choose from " in message:
            # argparse's "invalid choice: 'trian' (choose from 'inspect', 'run', ...)": a
            # command, or the value of an option with choices (--backend, --lr-schedule)
            given = message.split("invalid choice: ", 1)[1].split("'")[1]
            choices = message.split("(choose from ", 1)[1].split("'")[1::2]
            near = difflib.get_close_matches(given, choices, n=2)
            if near:
                return f"; did you mean {' or '.join(near)}?"
        return ""

    def _commands(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


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
                                help="one of inspect, run, plugins, ops, train, evaluate "
                                "(tr-onnx COMMAND --help for its options)")
    p = sub.add_parser("inspect", help="ops and kernels, layout decisions, memory plan")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("--batch", type=count_type(1), default=1,
                   help="size of symbolic batch (first) dimensions (default 1)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help=SHAPE_HELP)
    p.add_argument("--channel-align", type=count_type(1), default=None, metavar="K",
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
    tune = p.add_argument_group("fine-tuning (the training plan of tr-onnx train with these "
                                "flags, beside full fine-tuning's: what trains, what the "
                                "gradients and optimizer state take)")
    add_finetune_arguments(tune)
    tune.add_argument("--seed", type=int, default=0, help="seed of a new head or adapters")
    r = sub.add_parser("run", help="run a model on inputs from an .npz (or random data)")
    r.add_argument("model", help="the ONNX model")
    r.add_argument("--inputs", metavar="X.npz",
                   help=".npz with one array per model input, named after it (plain arrays: "
                   "nothing pickled is loaded); default: seeded random data")
    r.add_argument("--batch", type=count_type(1), default=1,
                   help="size of symbolic batch (first) dimensions of the random data "
                   "(default 1)")
    r.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help=SHAPE_HELP)
    r.add_argument("--channel-align", type=count_type(1), default=None, metavar="K",
                   help="pad feature-map channels to a multiple of K (default: the backend's)")
    r.add_argument("--repeat", type=count_type(1), default=10, metavar="N",
                   help="timed runs after the first (default 10)")
    pl = sub.add_parser("plugins", help="list loaded op-set plugins and their ops")
    pl.add_argument("--builtin", action="store_true", help="include tr_onnx's own op sets")
    pl.add_argument("--json", action="store_true", help="as JSON")
    o = sub.add_parser("ops", help="list registered ops")
    o.add_argument("--json", action="store_true", help="as JSON")
    add_train_parser(sub)
    add_evaluate_parser(sub)
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
            return run_train(args, shown)
        if args.command == "evaluate":
            return run_evaluate(args)
        if args.command == "inspect":
            tuned = finetune_tuned(args) or any(  # apply() checks how the flags combine
                (args.train_only, args.head, args.unfreeze_after, args.lr_group or None))
            info = inspect_model(args.model, args.batch, args.channel_align,
                                 _parse_shapes(args.shape), reuse=not args.no_reuse,
                                 backend=args.backend, train=args.train,
                                 precision=args.precision, gpu_properties=args.gpu_properties,
                                 finetune=apply_finetune(args, args.model) if tuned else None)
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
