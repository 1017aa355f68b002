"""``tr-onnx``: the command line. ``inspect`` shows how a model is laid out; ``ops`` lists the
registered ops."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict

import numpy as np

from .errors import TrOnnxError


def _parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        if not dims:
            raise TrOnnxError(f"--shape {item!r}: expected NAME=D0,D1,...")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return shapes


def _concrete_feed(imported, batch: int, shapes: dict[str, tuple[int, ...]]) -> dict:
    feed = {}
    for spec in imported.inputs:
        if spec.name in shapes:
            dims = shapes[spec.name]
        else:
            dims = tuple(d if isinstance(d, int) else batch if i == 0 else None
                         for i, d in enumerate(spec.shape))
            if None in dims:
                raise TrOnnxError(f"input {spec.name!r} has symbolic dims {list(spec.shape)}; "
                                  f"give them with --shape {spec.name}=...")
        feed[spec.name] = np.zeros(dims, spec.dtype)
    return feed


def inspect_model(path: str, batch: int = 1, channel_align: int | None = None,
                  shapes: dict | None = None, reuse: bool = True) -> dict:
    """Everything ``tr-onnx inspect`` prints, as a dict."""
    from .session import InferenceSession

    sess = InferenceSession(path, channel_align=channel_align, reuse_memory=reuse)
    imported = sess.imported
    feed = _concrete_feed(imported, batch, shapes or {})
    const_feeds = [n for n in imported.const_feeds if n in feed]
    if const_feeds:
        raise TrOnnxError(f"inputs {const_feeds} determine shapes; inspect needs them as constants")
    plan = sess.plan_for(feed)
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
                  "imported": next(o.version for o in imported.proto.opset_import
                                   if o.domain in ("", "ai.onnx"))},
        "inputs": {s.name: list(s.shape) for s in imported.inputs},
        "planned_for": {k: list(v.shape) for k, v in feed.items()},
        "backend": sess.backend,
        "channel_align": sess.channel_align,
        "nodes": len(plan.graph.nodes),
        "kernels": [{"domain": d, "op": o, "since_version": v, "count": c,
                     "kernel": f"{sources[(d, o, v)]} ({sess.backend})"}
                    for (d, o, v), c in sorted(ops.items())],
        "zero_copy_views": dict(aliased),
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
    }


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


def run_model(path: str, batch: int, inputs: str | None, channel_align: int | None,
              repeat: int, shapes: dict) -> dict:
    """Run ``path`` on an .npz of inputs (or seeded random data); outputs and timing."""
    import time

    from .session import InferenceSession

    sess = InferenceSession(path, channel_align=channel_align)
    if inputs:
        with np.load(inputs) as data:
            feed = {k: data[k] for k in data.files}
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


def list_ops() -> list[dict]:
    """Every registered (domain, op): versions, backends, differentiable, providing op set."""
    from .registry import default_registry

    registry = default_registry()
    rows: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"versions": set(), "backends": set(), "sources": set(), "differentiable": False})
    for key in registry.keys():
        row = rows[(key.domain, key.op_type)]
        row["versions"].add(key.since_version)
        row["backends"].add(key.backend)
        row["sources"].add(registry.source_of(key))
        opdef = registry.lookup(key.domain, key.op_type, key.since_version, key.backend)
        row["differentiable"] |= opdef.differentiable
    return [{"domain": d or "ai.onnx", "op": o, "versions": sorted(r["versions"]),
             "backends": sorted(r["backends"]), "differentiable": r["differentiable"],
             "source": sorted(r["sources"])} for (d, o), r in sorted(rows.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tr-onnx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="ops and kernels, layout decisions, memory plan")
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1, help="value for symbolic batch dims")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...")
    p.add_argument("--channel-align", type=int, default=None)
    p.add_argument("--no-reuse", action="store_true", help="turn MemoryPlan lifetime reuse off")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="list every non-plain layout")
    r = sub.add_parser("run", help="run a model on inputs from an .npz (or random data)")
    r.add_argument("model")
    r.add_argument("--inputs", help=".npz with one array per model input")
    r.add_argument("--batch", type=int, default=1, help="value for symbolic batch dims")
    r.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...")
    r.add_argument("--channel-align", type=int, default=None)
    r.add_argument("--repeat", type=int, default=10, help="timed runs after the first")
    o = sub.add_parser("ops", help="list registered ops")
    o.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect_model(args.model, args.batch, args.channel_align,
                                 _parse_shapes(args.shape), reuse=not args.no_reuse)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                _print_inspect(info, args.verbose)
        elif args.command == "run":
            info = run_model(args.model, args.batch, args.inputs, args.channel_align,
                             args.repeat, _parse_shapes(args.shape))
            for name, out in info["outputs"].items():
                print(f"{name}: shape {out['shape']} {out['dtype']}  first {out['first']}")
            print(f"plan + first run {info['plan_and_first_run_ms']:.1f} ms; median run "
                  f"{info['median_run_ms']:.2f} ms over {args.repeat}")
        elif args.command == "ops":
            rows = list_ops()
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for r in rows:
                    print(f"{r['op']:<28} {r['domain']:<12} versions {r['versions']} "
                          f"backends {r['backends']} "
                          f"{'differentiable' if r['differentiable'] else '-'}  "
                          f"{', '.join(r['source'])}")
                print(f"{len(rows)} ops")
    except TrOnnxError as exc:
        print(f"tr-onnx: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
