"""Make a runnable plan for concrete input shapes: specialise -> dispatch -> layout -> kernels
-> MemoryPlan -> bound executor. Everything that is looked up or decided happens here, once.

A plan is made for one backend from that backend's kernels only: dispatch looks every node up
under the backend's registry key, and each node's kernel factory (``opdef.kernels[backend]``)
runs here and sizes its own scratch (``KernelContext.workspace``). A numpy factory returns the
function the step calls (``NumpyExecutor`` replays them over a NumPy arena); a cuda factory
returns the binding that ``CudaExecutor`` turns into device calls once the arena exists
(``backends.cuda.bind``), over a ``CupyDevice`` by default. The cuda package is imported only
here, only for ``cuda``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import ir
from .backends import ExecutorAPI, numpy_backend
from .importer import ImportedModel
from .layouts import GatherRowsLayout, StridedLayout
from .memory import MemoryPlan, mirror_widening, plan_memory, span_elements
from .opdef import KernelContext, TensorInfo
from .passes.dispatch import dispatch
from .passes.layout import LayoutReport, assign_layouts


@dataclass
class CompiledPlan:
    graph: ir.Graph
    layout: LayoutReport
    memory: MemoryPlan
    executor: ExecutorAPI  # NumpyExecutor or CudaExecutor
    kernels: list[tuple[ir.Node, str]]  # executed nodes and the op set that provided the kernel
    backend: str
    info: Any = None  # what the graph transform returned (training: parameters, phases...)
    bindings: list = field(default_factory=list, repr=False)
    """cuda: ``(schedule index, node, bind)`` of every node that runs, ``bind`` what the node's
    cuda kernel factory returned; ``CudaExecutor`` binds them to a device."""


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


DeviceFactory = Callable[["CompiledPlan"], Any]


def compile_plan(imported: ImportedModel, shapes: dict[str, tuple],
                 const_values: dict[str, np.ndarray], backend: str, align: int,
                 reuse: bool = True, transform: Callable[[ir.Graph], Any] | None = None,
                 absorb_flatten: bool = True, device: DeviceFactory | None = None,
                 cuda_graphs: str = "fallback") -> CompiledPlan:
    """Specialise ``imported`` to ``shapes`` and compile it. ``transform(graph)`` runs after
    dispatch (the training pass: train-mode ops, loss, backward, optimizer); what it returns is
    kept as ``plan.info``. ``device`` (cuda only): ``device(plan) -> DeviceAPI`` instead of a
    ``CupyDevice`` -- the test hook that runs the cuda executor over a fake device on a CPU;
    ``cuda_graphs``: ``CudaExecutor``'s capture mode (``"fallback"``, ``"require"``, ``"off"``)."""
    registry = imported.registry
    graph = imported.specialize(shapes, const_values)
    dispatch(graph, registry, backend)
    info = transform(graph) if transform is not None else None
    return compile_graph(graph, registry, backend, align, reuse, absorb_flatten, info, device,
                         cuda_graphs)


def compile_graph(graph: ir.Graph, registry, backend: str, align: int, reuse: bool = True,
                  absorb_flatten: bool = True, info: Any = None,
                  device: DeviceFactory | None = None, cuda_graphs: str = "fallback"
                  ) -> CompiledPlan:
    """Layout -> kernels -> MemoryPlan -> bound executor for a dispatched graph."""
    report = assign_layouts(graph, registry, backend, align, absorb_flatten=absorb_flatten)
    factory_of = _factory_of(backend)
    widen = mirror_widening(graph)
    for v in graph.values.values():
        if v.span_of is not None:
            v.shape = (span_elements(v.span_of, widen),)
            v.layout = StridedLayout.plain(v.shape)
    schedule = list(graph.nodes)
    factories, workspace = [], {}
    for index, node in enumerate(schedule):
        if node.outputs and node.outputs[0] is not None and node.outputs[0].alias_of is not None:
            continue  # a zero-copy view: nothing to run
        ctx = kernel_context(node, backend)
        run = factory_of(node.opdef.kernels[backend])(ctx)
        if ctx.workspace_requests:
            workspace[index] = ctx.workspace_requests
        factories.append((index, node, run))
    kernels = [(node, registry.source_of_node(node, backend)) for _, node, _ in factories]
    if backend == "cuda":
        from .backends.cuda.transfers import staging_bytes

        memory = plan_memory(graph, schedule, workspace, reuse=reuse,
                             min_workspace=staging_bytes(graph))
        plan = CompiledPlan(graph, report, memory, None, kernels, backend, info, factories)
        plan.executor = cuda_executor(plan, device, cuda_graphs)
        return plan
    if device is not None:
        raise ValueError(f"device= is for the cuda backend, not {backend!r}")
    memory = plan_memory(graph, schedule, workspace, reuse=reuse)
    steps = [(node.label, run, [v.name if v is not None else None for v in node.inputs],
              [v.name if v is not None else None for v in node.outputs],
              memory.workspaces.get(index, []), node.phase) for index, node, run in factories]
    plan = CompiledPlan(graph, report, memory, None, kernels, backend, info)
    plan.executor = numpy_backend.NumpyExecutor(memory, steps)
    plan.executor.load_constants({v.name: v.data for v in graph.values.values()
                                  if v.data is not None and v.span_of is None})
    return plan


def _factory_of(backend: str) -> Callable:
    """How a registry kernel of ``backend`` becomes a factory (a plugin's ``CudaKernel`` is a
    source, made a binding by the cuda package)."""
    if backend == "cuda":
        from .backends.cuda.bind import kernel_factory

        return kernel_factory
    return lambda factory: factory


def cuda_executor(plan: CompiledPlan, device: DeviceFactory | None = None,
                  cuda_graphs: str = "fallback"):
    """A ``CudaExecutor`` bound to ``device(plan)`` (default: a ``CupyDevice`` holding the
    plan's arena), with the plan's initial contents uploaded. Raises ``CudaUnsupported``
    listing every op the cuda backend cannot run; nothing falls back to NumPy."""
    from .backends.cuda.executor import CudaExecutor

    if device is None:
        from .backends.cuda.device import CupyDevice

        dev = CupyDevice(plan.memory)
    else:
        dev = device(plan)
    executor = CudaExecutor(plan, dev, cuda_graphs)
    executor.load_constants()
    return executor


def imported_error(node: ir.Node, index: int) -> Exception:
    from .errors import UnsupportedModelError

    name = node.inputs[index].name
    return UnsupportedModelError(
        f"{node.label}: input {index} ({name!r}) must be known when the plan is made, but it is "
        "computed at run time", [])
