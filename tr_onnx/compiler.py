"""Make a runnable plan for concrete input shapes: specialise -> dispatch -> layout -> kernels
-> MemoryPlan -> bound executor. Everything that is looked up or decided happens here, once.

A plan is made for one backend (a ``backends.Backend``) from that backend's kernels only:
dispatch looks every node up under the backend's registry key, and each node's kernel factory
(``backend.kernel_factory(opdef.kernels[backend.name])``) runs here and sizes its own scratch
(``KernelContext.workspace``). What a factory returns, the backend's executor runs
(``backend.executor(plan)``: the numpy backend replays the functions over a NumPy arena, the
cuda backend binds them to device calls once the arena exists). Nothing here names a backend:
what differs between them is the ``Backend``'s to say."""

from __future__ import annotations

import math
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from . import ir, subplan
from .backends import HOST_BACKEND, Backend, ExecutorAPI, backend_named
from .errors import ArenaSizeError, InputError
from .importer import ImportedModel
from .layouts import GatherRowsLayout, StridedLayout
from .memory import MemoryPlan, mirror_widening, plan_memory, span_elements
from .opdef import KernelContext, TensorInfo
from .ops.elementwise import shared_fills
from .passes import control_flow
from .passes.dispatch import dispatch
from .passes.fusions import fuse_erf_gelu
from .passes.layout import LayoutReport, assign_layouts


@dataclass
class CompiledPlan:
    graph: ir.Graph
    layout: LayoutReport
    memory: MemoryPlan
    executor: ExecutorAPI  # NumpyExecutor or CudaExecutor
    kernels: list[tuple[ir.Node, str]]  # executed nodes and the op set that provided the kernel
    backend: str  # the name of the Backend it was made for
    info: Any = None  # what the graph transform returned (training: parameters, phases...)
    bindings: list = field(default_factory=list, repr=False)
    """``(schedule index, node, run)`` of every node that runs, ``run`` what the node's kernel
    factory returned, for the backend's executor (``Backend.executor``)."""


DEFAULT_MAX_PLANS = 8
DEFAULT_MAX_PLAN_BYTES = 256 << 20


def plan_key(feed: dict[str, np.ndarray], const_feed_names) -> tuple[tuple, dict, dict]:
    """(cache key, input shapes, const-feed values) of a feed: a plan is made for the shapes
    of the data inputs and the values of the inputs that decide shapes (``const_feeds``:
    Reshape's shape, Resize's scales fed at run time), so those values are part of its key."""
    const = {k: v for k, v in feed.items() if k in const_feed_names}
    key = tuple((k, v.shape) for k, v in sorted(feed.items())) + tuple(
        (k, v.dtype.str, v.tobytes()) for k, v in sorted(const.items()))
    return key, {k: v.shape for k, v in feed.items() if k not in const}, const


def plan_bytes(plan: CompiledPlan) -> int:
    """The array memory ``plan`` keeps alive: its arena (host or device) and, where kernels run
    on the host (``Backend.host_arrays``), the arrays its bound kernels made for themselves at
    plan time (constant fills, index tables: a fifth more than the arena for the zoo MLP's
    training step; not the constant-fill buffers all plans share,
    ``elementwise.shared_fills``), found by walking each kernel's closure,
    ``functools.partial`` arguments and instance attributes. A view counts as its base, once.
    Python objects (a few hundred kB per plan) are bounded by ``max_plans`` instead."""
    bases: dict[int, int] = {}
    seen: set[int] = set()
    todo: list = backend_named(plan.backend).host_arrays(plan)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            obj = _owner(obj)
            bases[id(obj)] = obj.nbytes
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, types.FunctionType):
            todo.extend(_closure_values(obj))
            todo.extend(obj.__defaults__ or ())
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, partial):
            todo.extend((obj.func, obj.args, obj.keywords))
        else:
            todo.extend(getattr(obj, "__dict__", {}).values())
            todo.extend(getattr(obj, n, None) for n in getattr(type(obj), "__slots__", ()))
    arena = getattr(plan.executor, "arena", None)
    if isinstance(arena, np.ndarray):  # the steps' views of it were counted as their base
        bases.pop(id(_owner(arena)), None)
    for fill in shared_fills():  # the process's, read by every plan: no plan's to evict
        bases.pop(id(fill), None)
    return plan.memory.total_bytes + sum(bases.values())


def _owner(x: np.ndarray) -> np.ndarray:
    """The array that owns ``x``'s memory, through views and ``as_strided``'s wrapper objects."""
    while True:
        base = x.base
        if not isinstance(base, np.ndarray):
            base = getattr(base, "base", None)  # as_strided: an interface object over the array
        if not isinstance(base, np.ndarray):
            return x
        x = base


def _closure_values(fn: types.FunctionType) -> list:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a closure variable not assigned yet
            pass
    return values


class PlanCache(OrderedDict):
    """A session's compiled plans by key (input shapes), least recently used first. Each plan
    holds its whole arena and bound calls (64 batch sizes held 0.9 GB; 8 of the zoo MLP's
    training step, 203 MB), so ``evict()`` keeps the ``max_plans`` most
    recently used, and of those only as many, most recent first, as fit in ``max_bytes``
    (``plan_bytes``); the most recent (the current) plan stays whatever its size. An evicted
    plan is compiled again when needed."""

    def __init__(self, max_plans: int = DEFAULT_MAX_PLANS,
                 max_bytes: int | None = DEFAULT_MAX_PLAN_BYTES):
        super().__init__()
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise InputError(f"max_plans={max_plans!r}: must be an int >= 1 (compiled plans a "
                             f"session keeps; default {DEFAULT_MAX_PLANS})")
        if max_bytes is not None and (isinstance(max_bytes, bool) or
                                      not isinstance(max_bytes, int) or max_bytes < 0):
            raise InputError(f"max_plan_bytes={max_bytes!r}: must be a number of bytes >= 0, "
                             f"or None for no limit (default {DEFAULT_MAX_PLAN_BYTES})")
        self.max_plans, self.max_bytes = max_plans, max_bytes
        self.sizes: dict = {}  # key -> plan_bytes of its plan, measured once

    def __setitem__(self, key, plan: CompiledPlan) -> None:
        super().__setitem__(key, plan)
        self.sizes[key] = plan_bytes(plan)

    @property
    def nbytes(self) -> int:
        """The bytes the plans held keep alive (``plan_bytes`` summed)."""
        return sum(self.sizes[k] for k in self)

    def lookup(self, key) -> CompiledPlan | None:
        """The plan for ``key`` (now the most recently used), or None."""
        plan = self.get(key)
        if plan is not None:
            self.move_to_end(key)
        return plan

    def evict(self) -> list[CompiledPlan]:
        """Drop the least recently used plans beyond ``max_plans`` or ``max_bytes``, never the
        most recent one; returns them."""
        dropped = []
        while len(self) > self.max_plans or (
                len(self) > 1 and self.max_bytes is not None and self.nbytes > self.max_bytes):
            key, plan = self.popitem(last=False)
            self.sizes.pop(key, None)
            dropped.append(plan)
        return dropped


def tensor_info(v: ir.Value) -> TensorInfo:
    layout = v.get_layout()
    shape = layout.phys_shape if isinstance(layout, GatherRowsLayout) else tuple(v.shape)
    return TensorInfo(v.name, shape, v.dtype, layout, tuple(v.shape))


def kernel_context(node: ir.Node, backend: str) -> KernelContext:
    """What ``node``'s kernel factory sees at plan time. Parameters change during training: a
    kernel sees their values at plan time only where the op declares the input a plan-time
    constant (``OpDef.const_inputs``), which must then be known."""
    consts = [v.data if v is not None and (v.kind == ir.CONST or v.is_constant and i in
                                           node.opdef.const_inputs) else None
              for i, v in enumerate(node.inputs)]
    for i in node.opdef.const_inputs:
        if i < len(node.inputs) and node.inputs[i] is not None and consts[i] is None:
            raise imported_error(node, i)
    return KernelContext(node, [tensor_info(v) if v is not None else None for v in node.inputs],
                         [tensor_info(v) if v is not None else None for v in node.outputs],
                         consts, backend)


@ir.collector_paused()
def compile_plan(imported: ImportedModel, shapes: dict[str, tuple],
                 const_values: dict[str, np.ndarray], backend: Backend | str, align: int,
                 reuse: bool = True, transform: Callable[[ir.Graph], Any] | None = None,
                 absorb_flatten: bool = True, cuda_graphs: str = "fallback",
                 max_arena_bytes: int | None = None) -> CompiledPlan:
    """Specialise ``imported`` to ``shapes`` and compile it for ``backend`` (a ``Backend``, or
    a registered backend's name). ``transform(graph)`` runs after dispatch and the pattern
    fusions (``passes.fusions``): the training pass (train-mode ops, loss, backward,
    optimizer); what it returns is kept as ``plan.info``. ``cuda_graphs``: the capture mode of
    a backend that captures its steps (``"fallback"``, ``"require"``, ``"off"``);
    ``max_arena_bytes``: see ``check_arena_size``."""
    backend = backend_named(backend) if isinstance(backend, str) else backend
    registry = imported.registry
    graph = imported.specialize(shapes, const_values, control_flow.resolve,
                                subplan.Regions(registry, compile_region))
    dispatch(graph, registry, backend.name)
    fuse_erf_gelu(graph, registry, backend.name)
    info = transform(graph) if transform is not None else None
    return compile_graph(graph, registry, backend, align, reuse, absorb_flatten, info,
                         cuda_graphs, max_arena_bytes)


def compile_region(imported: ImportedModel, shapes: dict[str, tuple],
                   const_values: dict[str, np.ndarray], transform=None) -> CompiledPlan:
    """A data-dependent region's sub-plan (``subplan.Regions.compile``): on the host backend
    whatever the outer plan's (its kernel runs the sub-plan on the host), compact channels, no
    Flatten folded into a weight (a region's weights are the outer graph's values)."""
    return compile_plan(imported, shapes, const_values, HOST_BACKEND, 1, transform=transform,
                        absorb_flatten=False)


def compile_graph(graph: ir.Graph, registry, backend: Backend, align: int, reuse: bool = True,
                  absorb_flatten: bool = True, info: Any = None, cuda_graphs: str = "fallback",
                  max_arena_bytes: int | None = None) -> CompiledPlan:
    """Layout -> kernels -> MemoryPlan -> bound executor for a dispatched graph."""
    report = assign_layouts(graph, registry, backend.name, align, absorb_flatten=absorb_flatten)
    widen = mirror_widening(graph)
    for v in graph.values.values():
        if v.span_of is not None:
            v.shape = (span_elements(v.span_of, widen),)
            v.layout = StridedLayout.plain(v.shape)
    check_value_sizes(graph, backend, max_arena_bytes)
    schedule = list(graph.nodes)
    factories, workspace = [], {}
    for index, node in enumerate(schedule):
        if node.outputs and node.outputs[0] is not None and node.outputs[0].alias_of is not None:
            continue  # a zero-copy view: nothing to run
        ctx = kernel_context(node, backend.name)
        try:
            run = backend.kernel_factory(node.opdef.kernels[backend.name])(ctx)
        except MemoryError as exc:  # a kernel computing its constant output at plan time
            raise ArenaSizeError(f"{node.label}: building its kernel (output "
                                 f"{[list(v.shape) for v in node.outputs if v is not None]}) "
                                 f"needs more memory than this process has: {exc}") from None
        if ctx.workspace_requests:
            workspace[index] = ctx.workspace_requests
        factories.append((index, node, run))
    kernels = [(node, registry.source_of_node(node, backend.name)) for _, node, _ in factories]
    memory = plan_memory(graph, schedule, workspace, reuse=reuse,
                         min_workspace=backend.min_workspace_bytes(graph))
    check_arena_size(graph, memory, backend, max_arena_bytes)
    plan = CompiledPlan(graph, report, memory, None, kernels, backend.name, info, factories)
    plan.executor = backend.executor(plan, cuda_graphs)
    return plan


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def _arena_limit(backend: Backend, max_arena_bytes: int | None) -> tuple[int | None, str]:
    if max_arena_bytes is not None:
        return max_arena_bytes, f"max_arena_bytes={max_arena_bytes}"
    limit, name = backend.arena_limit()
    return limit, f"{name} ({_size(limit or 0)}; max_arena_bytes= sets another limit)"


def _made_by(graph: ir.Graph, name: str) -> str:
    v = graph.values.get(name)
    return f"made by {v.producer.label}" if v is not None and v.producer is not None \
        else "an input or initializer"


def _value_bytes(v: ir.Value) -> int:
    return math.prod(v.shape) * np.dtype(v.dtype).itemsize if v.is_static else 0


def check_value_sizes(graph: ir.Graph, backend: Backend, max_arena_bytes: int | None) -> None:
    """An ``ArenaSizeError`` before any kernel is built (a kernel may hold a buffer the size
    of its output) when one value alone is larger than the arena may be
    (``check_arena_size``'s limit): an input declared with 10^12 elements is refused here,
    naming it, not as a MemoryError from the first kernel that asks for its size."""
    limit, what = _arena_limit(backend, max_arena_bytes)
    largest = max(graph.values.values(), key=_value_bytes, default=None)
    if limit is None or largest is None or _value_bytes(largest) <= limit:
        return
    inputs = {v.name: list(v.shape) for v in graph.inputs}
    raise ArenaSizeError(
        f"the {backend.name} plan for inputs {inputs} holds {largest.name!r} "
        f"{list(largest.shape)} {largest.dtype} ({_size(_value_bytes(largest))}, "
        f"{_made_by(graph, largest.name)}), "
        f"more than {what} for the whole arena. Feed smaller inputs, or raise "
        "max_arena_bytes= if the machine has the memory")


def check_arena_size(graph: ir.Graph, memory: MemoryPlan, backend: Backend,
                     max_arena_bytes: int | None) -> None:
    """An ``ArenaSizeError`` before anything is allocated when the plan's arena is larger than
    ``max_arena_bytes`` (None: the backend's ``arena_limit``, for numpy the machine's physical
    memory; for cuda, no check here, the device says). It names the inputs, the largest values
    and the nodes making them."""
    limit, what = _arena_limit(backend, max_arena_bytes)
    if limit is None or memory.total_bytes <= limit:
        return
    owners = sorted((t for t in memory.tensors.values() if t.alias_of is None and not t.span),
                    key=lambda t: -t.slot_bytes)[:3]
    largest = "; ".join(f"{t.name!r} {list(t.shape)} {t.dtype} ({_size(t.slot_bytes)}) "
                        f"{_made_by(graph, t.name)}" for t in owners)
    inputs = {v.name: list(v.shape) for v in graph.inputs}
    raise ArenaSizeError(
        f"the {backend.name} plan for inputs {inputs} needs an arena of "
        f"{_size(memory.total_bytes)} ({memory.total_bytes} bytes), more than {what}; its "
        f"largest values: {largest}. Feed smaller inputs, or raise max_arena_bytes= if the "
        "machine has the memory")


def imported_error(node: ir.Node, index: int) -> Exception:
    from .errors import UnsupportedModelError

    name = node.inputs[index].name
    return UnsupportedModelError(
        f"{node.label}: input {index} ({name!r}) must be known when the plan is made, but it is "
        "computed at run time", [])
