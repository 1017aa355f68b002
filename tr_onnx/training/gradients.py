"""Gradients of a model's output without training: vector-Jacobian products for checks.

``vjp(model, feed, wrt, cotangent)`` returns the model's outputs and the gradient of
``sum(output * cotangent)`` w.r.t. the named inputs/initializers, computed by the autodiff pass
and the backend's kernels. Tests compare it with finite differences and PyTorch.
"""

from __future__ import annotations

import numpy as np

from .. import ir
from ..backends import backend_named
from ..compiler import compile_plan
from ..importer import import_model
from ..memory import read_host, write_host
from ..passes.autodiff import differentiate
from ..registry import default_registry
from .reserved import Reserved


def vjp(model, feed: dict[str, np.ndarray], wrt: list[str], cotangent: np.ndarray,
        output: str | None = None, channel_align: int | None = None, registry=None,
        absorb_flatten: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(output value, {name: d sum(output * cotangent) / d name}) for inputs/initializers."""
    registry = registry or default_registry()
    imported = import_model(model, registry, "numpy")
    output = output or imported.outputs[0].name
    shapes = {k: np.asarray(v).shape for k, v in feed.items()}

    def transform(graph: ir.Graph):
        out = graph.values[output]
        cot = ir.Value(Reserved.COTANGENT, tuple(out.shape), out.dtype, ir.INPUT)
        graph.values[cot.name] = cot
        graph.inputs.append(cot)
        graph.backward_start = len(graph.nodes)
        grads = differentiate(graph, out, [graph.values[n] for n in wrt], registry, "numpy",
                              seed=cot)
        graph.outputs = [out] + [grads[n] for n in wrt]
        return grads

    plan = compile_plan(imported, shapes, {}, "numpy",
                        channel_align or backend_named("numpy").channel_align, transform=transform,
                        absorb_flatten=absorb_flatten)
    tensors, arena = plan.memory.tensors, plan.executor.arena
    for name, value in {**feed, Reserved.COTANGENT: cotangent}.items():
        write_host(arena, tensors[name], np.asarray(value))
    plan.executor.run(check_pads=True)
    grads = {n: read_host(arena, tensors[plan.info[n].name]) for n in wrt}
    return read_host(arena, tensors[output]), grads
