"""Table-driven gradient checks: float64 finite differences against our autodiff.

A ``GradCase`` is one node (op, attrs, inputs). ``check_case`` builds the single-node model,
computes ``d sum(y * cot) / d x`` with tr_onnx's autodiff + kernels (``tr_onnx.training.
gradients.vjp``), and compares, along random directions d, with central differences
``(f(x + h d) - f(x - h d)) / 2h`` of ``f = sum(y * cot)`` evaluated by ``onnx.reference`` (an
implementation nobody here wrote; ``fd_oracle="ours"`` uses our forward where the reference
is wrong for an op, and the case must say why). Plugin ops name their ``onnx.reference``
implementations in ``reference_ops`` (``ReferenceEvaluator(new_ops=...)``); a straight-through
estimator, whose gradient is the derivative of a surrogate forward rather than of the op's own,
names that surrogate in ``fd_reference_ops`` (used for the finite differences only, ahead of
``reference_ops``).

Each op family keeps its table in ``tests/grad_cases_<family>.py`` as ``CASES``;
``tests/test_gradients.py`` runs them all and checks every differentiable op has a case.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tr_onnx
from tr_onnx.dtypes import onnx_elem_type
from tr_onnx.registry import default_registry
from tr_onnx.training.gradients import vjp


@dataclass
class GradCase:
    """``inputs``: arrays (graph inputs) or ``Const(array)`` (initializers, never differentiated);
    ``None`` for an absent optional input. ``wrt``: indices to differentiate (default: every
    floating-point graph input). ``output``: which output's VJP is checked."""

    id: str
    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)
    wrt: tuple[int, ...] | None = None
    output: int = 0
    n_outputs: int = 1
    opset: int = 17
    domain: str = ""
    domain_version: int = 1
    fd_oracle: str = "reference"
    rtol: float = 1e-6
    step: float = 1e-6
    output_shapes: list[tuple[int, ...]] | None = None  # where ONNX inference cannot type them
    reference_ops: tuple = ()  # OpRun classes: plugin ops for onnx.reference
    fd_reference_ops: tuple = ()  # OpRun classes replacing ops for the finite differences only
    # graph inputs the node does not list, read by name from its subgraphs (If's branches):
    # named o0, o1...; differentiated like the node's float inputs
    outer: list = field(default_factory=list)


@dataclass
class Const:
    value: np.ndarray


def _name(i: int) -> str:
    return f"x{i}"


def build_model(case: GradCase, registry=None) -> onnx.ModelProto:
    ins, inits, names = [], [], []
    for i, x in enumerate(case.inputs):
        if x is None:
            names.append("")
            continue
        names.append(_name(i))
        if isinstance(x, Const):
            inits.append(numpy_helper.from_array(np.asarray(x.value), _name(i)))
        else:
            x = np.asarray(x)
            ins.append(helper.make_tensor_value_info(_name(i), onnx_elem_type(x.dtype), x.shape))
    for i, x in enumerate(case.outer):
        x = np.asarray(x)
        ins.append(helper.make_tensor_value_info(f"o{i}", onnx_elem_type(x.dtype), x.shape))
    outs = [f"y{k}" for k in range(case.n_outputs)]
    node = helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs)
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, case.domain_version))
    graph = helper.make_graph([node], case.id, ins, [helper.make_value_info(o, onnx.TypeProto())
                                                      for o in outs], inits)
    model = helper.make_model(graph, opset_imports=opsets)
    if case.output_shapes is not None:
        dtype = onnx_elem_type(np.asarray(case.inputs[0]).dtype)
        del model.graph.output[:]
        model.graph.output.extend(helper.make_tensor_value_info(o, dtype, list(shape))
                                  for o, shape in zip(outs, case.output_shapes))
    elif case.domain in ("", "ai.onnx"):
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {vi.name: vi for vi in inferred.graph.value_info}
        typed = [known.get(o, inferred.graph.output[k]) for k, o in enumerate(outs)]
        del model.graph.output[:]
        model.graph.output.extend(typed)
    else:  # ONNX does not know the op: its OpDef's shape rule types the outputs
        del model.graph.output[:]
        opdef = (registry or default_registry()).lookup(case.domain, case.op,
                                                        case.domain_version, "numpy")
        arrays = [None if x is None else np.asarray(getattr(x, "value", x)) for x in case.inputs]
        results = opdef.shape(node, [None if a is None else a.shape for a in arrays],
                              [None if a is None else a.dtype for a in arrays])
        model.graph.output.extend(helper.make_tensor_value_info(o, onnx_elem_type(d), list(s))
                                  for o, (s, d) in zip(outs, results))
    return model


def _feed(case: GradCase) -> dict[str, np.ndarray]:
    return {_name(i): np.asarray(x) for i, x in enumerate(case.inputs)
            if x is not None and not isinstance(x, Const)} | {
        f"o{i}": np.asarray(x) for i, x in enumerate(case.outer)}


def wrt_names(case: GradCase) -> list[str]:
    if case.wrt is not None:
        return [_name(i) for i in case.wrt]
    return [_name(i) for i, x in enumerate(case.inputs) if x is not None
            and not isinstance(x, Const) and np.asarray(x).dtype.kind == "f"] + [
        f"o{i}" for i, x in enumerate(case.outer) if np.asarray(x).dtype.kind == "f"]


def check_case(case: GradCase, channel_align: int | None = None, directions: int = 3,
               plugins=()) -> None:
    registry = tr_onnx.registry.build_registry(plugins) if plugins else None
    model = build_model(case, registry) if registry is not None else build_model(case)
    feed = _feed(case)
    out_name = f"y{case.output}"
    if case.fd_oracle == "reference":
        ref = ReferenceEvaluator(model, new_ops=list(case.reference_ops) or None)
        fd_ref = ref if not case.fd_reference_ops else ReferenceEvaluator(
            model, new_ops=[*case.fd_reference_ops, *case.reference_ops])

        def forward(f, ev=ref):
            return np.asarray(ev.run([out_name], f)[0])

        def fd_forward(f):
            return forward(f, fd_ref)
    else:
        sess = tr_onnx.InferenceSession(model, plugins=plugins)

        def forward(f):
            return sess.run([out_name], f)[0]

        fd_forward = forward

    y_ref = forward(feed)
    # zlib.crc32, not hash(): str hashes change from process to process (PYTHONHASHSEED), which
    # would give every run other directions and cotangents
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    cot = rng.standard_normal(y_ref.shape).astype(y_ref.dtype)
    y, grads = vjp(model, feed, wrt_names(case), cot, output=out_name,
                   channel_align=channel_align, registry=registry)
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12,
                               err_msg=f"{case.id}: forward differs from the oracle")
    for name, g in grads.items():
        x = feed[name]
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        for _ in range(directions):
            d = rng.standard_normal(x.shape).astype(x.dtype)
            hi = fd_forward({**feed, name: x + case.step * d})
            lo = fd_forward({**feed, name: x - case.step * d})
            fd = float(np.sum((hi - lo) * cot)) / (2 * case.step)
            analytic = float(np.sum(g * d))
            scale = abs(fd) + abs(analytic) + 1e-8
            assert abs(fd - analytic) <= case.rtol * scale + 1e-9, (
                f"{case.id}: d/d{name} along a random direction: finite differences {fd!r}, "
                f"autodiff {analytic!r}")
