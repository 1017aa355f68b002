"""How planning time grows with the graph: seconds per phase of ``InferenceSession`` on long
chains. Planning should grow as n log n in nodes; a phase whose time grows faster than its
row's node count is a regression (issue 12: 20,000 Relus took 108 s).

Models: ``relu``, a chain of Relus on [batch, 8]; ``mixed``, blocks of Conv 3x3 -> Relu -> Add
(the block's input) -> Reshape to [N, C*H*W] -> Reshape back by the Shape of the block's
input (folded once the batch is known), planned with ``channel_align=8`` so feature maps are
padded NHWC and every Reshape of one gets a LayoutTranspose.

Phases: ``import`` (load, checker, shape inference, folding: once per model), then the plan
for one batch size: ``specialize`` (the IR for concrete shapes: ONNX shape inference and
folding again), ``dispatch``, ``layout``, ``kernels`` (every node's kernel factory and the
rest of ``compile_graph``), ``memory`` (the MemoryPlan), ``executor`` (arena and bound calls).

    python benchmarks/plan_scaling.py [--nodes 1000 10000 100000] [--models relu mixed]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tr_onnx

PHASES = ("import", "specialize", "dispatch", "layout", "kernels", "memory", "executor")


def relu_chain(n: int):
    """x [batch, 8] -> n Relus -> y."""
    from onnx import TensorProto, helper

    names = ["x"] + [f"v{i}" for i in range(1, n)] + ["y"]
    nodes = [helper.make_node("Relu", [a], [b], name=f"relu{i}")
             for i, (a, b) in enumerate(zip(names, names[1:]))]
    graph = helper.make_graph(
        nodes, "relu_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mixed_chain(n: int, c: int = 3, hw: int = 4):
    """About ``n`` nodes: blocks of Conv -> Relu -> Add -> Reshape -> Shape -> Reshape."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, h = [], [numpy_helper.from_array(np.array([0, -1], np.int64), "flat")], "x"
    for i in range(max(1, n // 6)):
        w = numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32),
                                    f"w{i}")
        b = numpy_helper.from_array(np.zeros(c, np.float32), f"b{i}")
        inits += [w, b]
        nodes += [helper.make_node("Conv", [h, w.name, b.name], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
                  helper.make_node("Add", [f"r{i}", h], [f"a{i}"]),
                  helper.make_node("Reshape", [f"a{i}", "flat"], [f"f{i}"]),
                  helper.make_node("Shape", [h], [f"s{i}"]),
                  helper.make_node("Reshape", [f"f{i}", f"s{i}"], [f"h{i}"])]
        h = f"h{i}"
    nodes[-1].output[0] = "y"
    shape = ["batch", c, hw, hw]
    graph = helper.make_graph(
        nodes, "mixed_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {"relu": (relu_chain, (4, 8), 1), "mixed": (mixed_chain, (2, 3, 4, 4), 8)}


@contextmanager
def phase_timers(times: dict[str, float]):
    """Wrap the functions ``compile_plan`` calls so each phase's seconds add up in ``times``."""
    from tr_onnx import compiler, importer

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times[phase] += time.process_time() - start
        return wrapper

    patched = [(compiler, "dispatch", "dispatch"), (compiler, "assign_layouts", "layout"),
               (compiler, "plan_memory", "memory"), (compiler.numpy_backend, "NumpyExecutor",
                                                     "executor"),
               (compiler, "compile_graph", "compile_graph"),
               (importer.ImportedModel, "specialize", "specialize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, phase in patched:
        setattr(owner, name, timed(phase, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def measure(model_name: str, n: int) -> dict[str, float]:
    import numpy as np

    import tr_onnx

    make, shape, align = MODELS[model_name]
    model = make(n)
    times: dict[str, float] = defaultdict(float)
    wall, start = time.perf_counter(), time.process_time()
    session = tr_onnx.InferenceSession(model, channel_align=align)
    times["import"] = time.process_time() - start
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    with phase_timers(times):
        start = time.process_time()
        session.plan_for({"x": x})
        times["plan"] = time.process_time() - start
    times["wall"] = time.perf_counter() - wall
    inner = times["memory"] + times["executor"] + times["layout"]
    times["kernels"] = times.pop("compile_graph") - inner
    times["nodes"] = len(model.graph.node)
    y = session.run(None, {"x": x})[0]  # the plan runs
    assert y.shape == x.shape
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    import tr_onnx

    tr_onnx.InferenceSession(relu_chain(2))  # the registry, outside the timings
    print(f"CPU seconds of this process (planning is single-threaded; the wall clock of a busy "
          f"machine is longer); load average {os.getloadavg()[0]:.2f}\n")
    print("| model | nodes | " + " | ".join(PHASES) + " | plan (all but import) | total | wall |")
    print("|---|---|" + "---|" * (len(PHASES) + 3))
    for model_name in args.models:
        for n in args.nodes:
            t = measure(model_name, n)
            cells = " | ".join(f"{t[p]:.2f}" for p in PHASES)
            print(f"| {model_name} | {t['nodes']} | {cells} | {t['plan']:.2f} | "
                  f"{t['import'] + t['plan']:.2f} | {t['wall']:.2f} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
