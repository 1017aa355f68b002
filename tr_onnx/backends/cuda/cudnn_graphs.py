"""cuDNN frontend graphs of the cuda backend, described from the MemoryPlan alone: the generic
machinery. Which op has which graph is declared beside its cuda binding: an op's
``kernels["cuda"]`` is a ``CudnnGraph`` (``backends/cuda/ops/conv.py``, ``normalization.py``,
``matmul.py``; a plugin's OpDef or KernelDef the same way), as a ``CudaKernel`` declares CUDA C++.

Two halves, so that everything but the last call can be checked without a GPU:

* ``describe_node(node, plan) -> GraphDesc``: a pure description of the graph one IR node
  needs, by the ``describe`` of the node's ``CudnnGraph`` -- tensors (NCHW-ordered dims, element
  strides of the padded channels-last buffer, data type, byte offset in the arena: ``PlanIndex``,
  ``feature_map``, ``channel_vector``), the op's parameters and scalars, and ``build``, the
  frontend calls that make it. It reads only DTensors and node attributes, and raises
  ``CudnnGraphError`` naming the node for what cuDNN cannot do.
* ``build_pygraph(desc, cudnn, handle) -> BuiltGraph``: issues the ``cudnn.pygraph`` calls
  (nvidia-cudnn-frontend, module ``cudnn``), builds the plan and asks for its workspace size.
  ``declare_pygraph`` stops before ``validate()``, which is the first call that needs the
  driver: with the frontend wheel installed, the declaration runs on a CPU-only machine.

Conventions (cuDNN's): dims are always in NCHW order (NCDHW, NCL), channels-last memory is
expressed through strides ``[H*W*Cp, 1, W*Cp, Cp]``; conv weights OHWI are
``[Op, Ip, kh, kw]`` with strides ``[kh*kw*Ip, 1, kw*Ip, Ip]``; per-channel vectors are
``[1, Cp, 1, 1]``. Where the plan padded channels (channel_align 8 for Tensor Cores) the dims
carry the padded count: the padded lanes hold zeros (weights, BN scale and bias included), so
the padded problem computes the logical one exactly and writes zeros into padded outputs.
Where padding does not line up (a ConvGradFilter output the layout pass left unpadded, a
grouped conv whose groups do not divide the padded channels) the graph uses the logical
channel counts over the same padded strides; ``GraphDesc.channels`` says which, and
``GraphDesc.notes`` why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import TrOnnxError
from ...layouts import GatherRowsLayout, StridedLayout
from ...memory import ALIGN, DTensor, MemoryPlan, Region
from ...registry import default_registry

# numpy dtype name -> cudnn.data_type member
CUDNN_DATA_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT"}
# what build_pygraph asks cuDNN's heuristics for, in order
HEURISTICS = ("A", "FALLBACK")
DETERMINISTIC_ENV = "TR_ONNX_CUDNN_DETERMINISTIC"
"""Set to 1: plans leave out cuDNN's non-deterministic engines (bitwise-repeatable steps, as
``torch.backends.cudnn.deterministic``); read when a plan is made."""


class CudnnGraphError(TrOnnxError):
    """A node has no cuDNN graph (or the plan's layouts do not fit one); names the node."""


# --------------------------------------------------------------------------------------------
# Descriptors
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorDesc:
    """One cuDNN tensor over arena memory.

    ``dims`` are NCHW-ordered (channels = padded count where the graph is padded), ``strides``
    element strides of the buffer, ``byte_offset`` the tensor's offset in the arena,
    ``alignment`` the largest power of two (at most 256) dividing that offset, ``slot_bytes``
    the bytes the plan reserved there (the owner's slot for a view) -- every element the dims
    and strides address lies inside it. ``virtual`` tensors (fused intermediates) have no memory.
    """

    name: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    data_type: str
    byte_offset: int
    alignment: int
    itemsize: int
    slot_bytes: int
    region: str
    virtual: bool = False

    @property
    def span_bytes(self) -> int:
        """Bytes from the first to one past the last element the dims and strides address."""
        if not self.dims or min(self.dims) == 0:
            return 0
        return (1 + sum((d - 1) * s for d, s in zip(self.dims, self.strides))) * self.itemsize

    @property
    def padded_channels(self) -> int | None:
        """The channel count the memory is laid out for (the stride of the axis before C)."""
        if len(self.dims) < 3 or self.strides[1] != 1:
            return None
        return self.strides[-1]


@dataclass(frozen=True)
class ScalarDesc:
    """A pass-by-value scalar (BatchNorm epsilon, momentum): host value, not arena memory."""

    name: str
    value: float
    data_type: str = "FLOAT"


@dataclass
class GraphDesc:
    """The cuDNN graph of one node.

    ``kind`` names the graph (the frontend op: ``conv_fprop``, ``conv_dgrad``, ``conv_wgrad``,
    ``batchnorm``, ``batchnorm_backward``, ``matmul``, ``sdpa``...); ``inputs``/``outputs`` map
    the op's port names to tensors (outputs are what ``set_output(True)`` marks); ``params`` are
    the op's keyword attributes (``pre_padding``, ``post_padding``, ``stride``, ``dilation``);
    ``epilogue`` the fused pointwise ops after it (``bias``, ``relu``) with ``relu_clip``
    (lower, upper) for a clipped ReLU; ``workspace`` the arena range (offset, bytes) the plan
    reserves for per-node scratch, which the graph's workspace must fit. ``node_inputs``: which
    of the node's inputs the graph computes with, where it leaves some to a kernel of its own (a
    ConvTranspose's bias); None: all of them (what the host emulator runs as the node's numpy
    kernel). ``build``: the frontend calls of the graph, from the family that describes it:
    ``(g, desc, ins, scalars) -> {output port: frontend tensor}``, ``ins`` the declared input
    tensors and ``scalars`` the runtime scalars by name. ``builds_without_device``: cuDNN's
    deviceless mode can run ``build_plans()`` for it (convolutions; matmul and normalization
    engines load kernels through the driver at plan build).
    """

    kind: str
    node: str  # the node's label, for errors
    io_data_type: str
    inputs: dict[str, TensorDesc]
    outputs: dict[str, TensorDesc]
    scalars: dict[str, ScalarDesc] = field(default_factory=dict)
    params: dict[str, list[int]] = field(default_factory=dict)
    epilogue: tuple[str, ...] = ()
    relu_clip: tuple[float | None, float | None] | None = None
    channels: str = "padded"  # "padded" | "logical"
    groups: int = 1
    workspace: tuple[int, int] = (0, 0)
    notes: tuple[str, ...] = ()
    intermediate_data_type: str = "FLOAT"
    compute_data_type: str = "FLOAT"
    node_inputs: tuple[int, ...] | None = None
    build: Callable[..., dict] | None = None
    builds_without_device: bool = False

    def tensors(self) -> dict[str, TensorDesc]:
        return {**self.inputs, **self.outputs}


# --------------------------------------------------------------------------------------------
# DTensor -> TensorDesc
# --------------------------------------------------------------------------------------------

def cudnn_data_type(dtype: np.dtype, what: str) -> str:
    name = np.dtype(dtype).name
    try:
        return CUDNN_DATA_TYPES[name]
    except KeyError:
        raise CudnnGraphError(f"{what}: dtype {name} has no cuDNN graph here; supported: "
                              f"{', '.join(CUDNN_DATA_TYPES)}") from None


def _alignment(offset: int) -> int:
    return min(ALIGN, offset & -offset) if offset else ALIGN


class PlanIndex:
    """Owner lookup for views: a view may address its owner's whole slot."""

    def __init__(self, plan: MemoryPlan):
        self.plan = plan
        self.by_id = {t.id: t for t in plan.all_tensors()}

    def slot(self, t: DTensor) -> tuple[int, int]:
        owner = self.by_id[t.alias_of] if t.alias_of is not None else t
        return owner.offset, owner.slot_bytes

    def tensor(self, t: DTensor, port: str, dims, strides, label: str) -> TensorDesc:
        slot_start, slot_bytes = self.slot(t)
        desc = TensorDesc(t.name, tuple(int(d) for d in dims), tuple(int(s) for s in strides),
                          cudnn_data_type(t.dtype, f"{label}: {port} {t.name!r}"), t.offset,
                          _alignment(t.offset), t.dtype.itemsize,
                          slot_start + slot_bytes - t.offset, t.region.name)
        if desc.span_bytes > desc.slot_bytes:
            raise CudnnGraphError(
                f"{label}: {port} {t.name!r} as dims {list(desc.dims)} strides "
                f"{list(desc.strides)} spans {desc.span_bytes} bytes, but its slot at "
                f"{t.offset} holds {desc.slot_bytes}")
        return desc


def element_strides(t: DTensor) -> tuple[int, ...]:
    """Element strides of ``t``'s arena view in logical axis order (physical for gathered rows)."""
    return tuple(s // t.dtype.itemsize for s in t.device_strides)


def strided_dims(t: DTensor, padded: bool) -> tuple[int, ...]:
    """``t``'s logical dims, with every padded axis at its padded extent when ``padded``."""
    layout = t.layout
    if isinstance(layout, GatherRowsLayout):
        return tuple(layout.phys_shape)
    dims = list(t.shape)
    if padded:
        for i, axis in enumerate(layout.perm):
            dims[axis] = layout.phys_shape[i]
    return tuple(dims)


def channel_vector(index: PlanIndex, t: DTensor, port: str, rank: int, channels: int,
                   label: str) -> TensorDesc:
    """A per-channel vector (``[C]`` or ``[Cp]`` in memory) as ``[1, channels, 1, ...]``."""
    if len(t.shape) != 1:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} has shape {list(t.shape)}; a "
                              "per-channel vector was expected")
    dims = (1, channels) + (1,) * (rank - 2)
    strides = (channels, 1) + (channels,) * (rank - 2)
    return index.tensor(t, port, dims, strides, label)


def feature_map(index: PlanIndex, t: DTensor, port: str, padded: bool,
                label: str) -> TensorDesc:
    """A strided feature map of rank >= 3 as NCHW-ordered dims over its buffer's strides
    (``padded``: the channel dim at its padded count)."""
    layout = t.layout
    if not isinstance(layout, StridedLayout) or len(t.shape) < 3:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} must be a strided feature map of "
                              f"rank >= 3, got {layout.describe()} {list(t.shape)}")
    return index.tensor(t, port, strided_dims(t, padded), element_strides(t), label)


def one_data_type(desc: GraphDesc) -> GraphDesc:
    """``desc``, checked to read and write one data type, as our conv and matmul graphs
    declare them (one ``io_data_type``, fp32 compute): a half-precision plan that left one
    operand float32 would otherwise reach cuDNN as a mixed-type graph no engine takes."""
    types = {port: t.data_type for port, t in {**desc.inputs, **desc.outputs}.items()}
    if len(set(types.values())) > 1:
        raise CudnnGraphError(f"{desc.node}: a {desc.kind} graph reads and writes one data "
                              "type; got " + ", ".join(f"{p} {d}" for p, d in types.items()))
    return desc


# --------------------------------------------------------------------------------------------
# Which node has a graph: the op's declaration
# --------------------------------------------------------------------------------------------

Describe = Callable[..., GraphDesc]
"""``describe(node, plan, workspace, activation=None) -> GraphDesc``: the graph of one node
from the MemoryPlan; ``workspace`` the arena range (offset, bytes) reserved for its scratch."""


@dataclass(frozen=True)
class CudnnGraph:
    """An op's cuda kernel that is a cuDNN frontend graph: ``kernels["cuda"]`` of an OpDef, or
    the kernel of a ``KernelDef(op, "cuda", ...)`` (the builtin families'), the way a
    ``CudaKernel`` declares CUDA C++.

    ``describe(node, plan, workspace) -> GraphDesc`` (``Describe``) describes a node's graph,
    with its ``build``; it raises ``CudnnGraphError`` for a form the graph cannot take.
    ``workspace_bytes(ctx)``: the scratch the graph may use where more than the default
    (``bind.CUDNN_WORKSPACE``). ``activation(node, graph)``: the activation after the node
    that the graph takes in as its epilogue (Conv's Relu), handed to ``describe`` as
    ``activation=``; None: nothing fuses. ``binding``: the kernel factory where the node's
    calls are more than the graph (kernels after it, a fallback kernel, a fused activation);
    None: ``bind.cudnn_binding`` of the graph alone.
    """

    describe: Describe
    workspace_bytes: Callable | None = None
    activation: Callable | None = None
    binding: Callable | None = None


def graph_of(node) -> CudnnGraph | None:
    """The ``CudnnGraph`` that ``node``'s op declares as its cuda kernel, or None."""
    kernel = node.opdef.kernels.get("cuda") if node.opdef is not None else None
    return kernel if isinstance(kernel, CudnnGraph) else None


def graph_ops(registry=None) -> list[str]:
    """The op types whose cuda kernel is a cuDNN graph in ``registry`` (the default one)."""
    registry = registry or default_registry()
    return sorted({k.op_type for k in registry.keys() if k.backend == "cuda" and isinstance(
        registry.lookup(*k).kernels.get("cuda"), CudnnGraph)})


def describe_node(node, plan: MemoryPlan, activation=None,
                  workspace: tuple[int, int] | None = None) -> GraphDesc:
    """The cuDNN graph of ``node`` from ``plan``'s DTensors and the node's attributes, by its
    op's ``CudnnGraph``.

    ``activation``: what the graph's ``activation(node, graph)`` returned, to fuse it into the
    graph's epilogue (a Conv's Relu/ReLU6: its output becomes the graph's Y). ``workspace``:
    the arena range (offset, bytes) the node's binding reserved for the graph (default: the
    whole WORKSPACE region). Raises ``CudnnGraphError`` for ops with no cuDNN graph (listing
    those that have one) and for layouts that do not fit.
    """
    graph = graph_of(node)
    if graph is None:
        raise CudnnGraphError(f"{node.label}: no cuDNN graph for this op (cuDNN graphs: "
                              f"{', '.join(graph_ops())})")
    workspace = plan.regions[Region.WORKSPACE] if workspace is None else workspace
    extra = {} if activation is None else {"activation": activation}
    desc = graph.describe(node, plan, workspace, **extra)
    desc.workspace = workspace
    return desc


def describe_graph(graph, plan: MemoryPlan, fuse: bool = True
                   ) -> tuple[dict[str, GraphDesc], dict[str, str]]:
    """Descriptors for the nodes of ``graph`` that cuDNN runs, keyed by node name, and the
    nodes of those op types it does not (name -> reason: a kernel of the backend runs them).

    With ``fuse``, a node whose graph takes in the activation after it (a Conv followed only
    by a Relu/ReLU6) does; the activation node is then listed under its own name with the same
    (shared) descriptor.
    """
    descs: dict[str, GraphDesc] = {}
    skipped: dict[str, str] = {}
    for node in graph.nodes:
        declared = graph_of(node)
        if declared is None or node.name in descs:
            continue
        activation = declared.activation(node, graph) if fuse and declared.activation else None
        try:
            descs[node.name] = describe_node(node, plan, activation)
        except CudnnGraphError as e:
            skipped[node.name] = str(e)
            continue
        if activation is not None:
            descs[activation[0].name] = descs[node.name]
    return descs, skipped


# --------------------------------------------------------------------------------------------
# Issuing the frontend calls
# --------------------------------------------------------------------------------------------

@dataclass
class BuiltGraph:
    """A built ``cudnn.pygraph`` and its tensors by port name; ``workspace_bytes`` is what the
    selected plan asked for (it must fit ``desc.workspace``)."""

    desc: GraphDesc
    graph: Any
    tensors: dict[str, Any]
    scalars: dict[str, Any]
    workspace_bytes: int = 0

    def pointers(self, arena_base: int) -> dict[str, int]:
        """Device address of every non-virtual tensor: arena base + its plan offset."""
        return {port: arena_base + t.byte_offset for port, t in self.desc.tensors().items()
                if not t.virtual}

    def variant_pack(self, arena_base: int) -> dict[Any, Any]:
        """What ``graph.execute`` takes: frontend tensor -> device pointer. The scalars are
        runtime parameters of the graph, not in the pack (NumPy arrays there fail the
        frontend's ``__dlpack__(stream=-1)``)."""
        return {self.tensors[p]: ptr for p, ptr in self.pointers(arena_base).items()}


def _dt(cudnn, name: str):
    return getattr(cudnn.data_type, name)


def _declare_tensor(g, cudnn, port: str, t: TensorDesc):
    return g.tensor(name=port, dim=list(t.dims), stride=list(t.strides),
                    data_type=_dt(cudnn, t.data_type))


def _mark(out, cudnn, t: TensorDesc):
    """Outputs get their dims, strides and type from the plan, never from inference."""
    out.set_output(True)
    out.set_data_type(_dt(cudnn, t.data_type))
    out.set_dim(list(t.dims))
    out.set_stride(list(t.strides))
    return out


def declare_pygraph(desc: GraphDesc, cudnn, handle=None, device_property=None,
                    kernel_cache=None) -> BuiltGraph:
    """Create the ``cudnn.pygraph`` for ``desc``: tensors, op, epilogue, marked outputs.

    Needs no driver (with nvidia-cudnn-frontend 1.32 the first call that does is
    ``validate()``), so it runs in CPU tests; ``build_pygraph`` finishes the job on a GPU.
    ``device_property`` (``cudnn.create_device_properties``) instead of a ``handle``: the
    graph describes that target GPU and the real library checks it without one
    (``deviceless.check_graph``). Scalars (BatchNorm's epsilon, momentum) are runtime
    parameters of the graph (``tensor_scalar``): they stay out of the variant pack.
    """
    target = {"handle": handle} if device_property is None else \
        {"device_property": device_property}
    if kernel_cache is not None:
        target["kernel_cache"] = kernel_cache
    g = cudnn.pygraph(io_data_type=_dt(cudnn, desc.io_data_type),
                      intermediate_data_type=_dt(cudnn, desc.intermediate_data_type),
                      compute_data_type=_dt(cudnn, desc.compute_data_type), **target)
    ins = {port: _declare_tensor(g, cudnn, port, t) for port, t in desc.inputs.items()}
    scalars = {name: g.tensor_scalar(s.value, cudnn.scalar_type.RUNTIME_PARAM, name=name)
               for name, s in desc.scalars.items()}
    if desc.build is None:
        raise CudnnGraphError(f"{desc.node}: the {desc.kind} graph has no build (the frontend "
                              "calls its describe gives)")
    produced = desc.build(g, desc, ins, scalars)
    outs = {}
    for port, t in desc.outputs.items():
        if produced.get(port) is None:
            raise CudnnGraphError(f"{desc.node}: the {desc.kind} graph has no output {port!r}")
        outs[port] = _mark(produced[port], cudnn, t)
    return BuiltGraph(desc, g, {**ins, **outs}, scalars)


def plan_pygraph(g, desc: GraphDesc, cudnn) -> int:
    """Validate and lower a declared graph, ask the heuristics for engine candidates and keep
    those whose workspace fits the node's (``desc.workspace``) -- and, with
    ``TR_ONNX_CUDNN_DETERMINISTIC=1``, only deterministic ones: ``build_plans`` then takes the
    best-ranked of those instead of failing on the first choice's workspace. Returns how many
    candidates the heuristics gave (before the cuts)."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([getattr(cudnn.heur_mode, h) for h in HEURISTICS])
    engines = int(g.get_execution_plan_count())
    if os.environ.get(DETERMINISTIC_ENV, "") not in ("", "0"):
        g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
    g.deselect_workspace_greater_than(desc.workspace[1])
    return engines


class named_errors:
    """Turns any error of the cuDNN calls inside into a ``CudnnGraphError`` naming the node
    (cuDNN's own error types differ by version; the cause is chained)."""

    def __init__(self, desc: GraphDesc):
        self.desc = desc

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, CudnnGraphError):
            return False
        d = self.desc
        raise CudnnGraphError(f"{d.node}: cuDNN has no engine for the {d.kind} graph (channels "
                              f"{d.channels}; {'; '.join(d.notes) or 'no notes'}): {exc}") from exc


def build_pygraph(desc: GraphDesc, cudnn, handle, kernel_cache=None) -> BuiltGraph:
    """Declare, validate and build the graph on ``handle``'s device; record its workspace size.

    Plans needing more scratch than the MemoryPlan's WORKSPACE region are deselected first.
    Raises ``CudnnGraphError`` (naming the node) when no engine supports the graph, or when
    the one selected still needs more workspace than the region holds.
    """
    built = declare_pygraph(desc, cudnn, handle, kernel_cache=kernel_cache)
    g = built.graph
    with named_errors(desc):
        plan_pygraph(g, desc, cudnn)
        g.check_support()
        g.build_plans()
    built.workspace_bytes = int(g.get_workspace_size())
    if built.workspace_bytes > desc.workspace[1]:
        raise CudnnGraphError(f"{desc.node}: the {desc.kind} plan needs a workspace of "
                              f"{built.workspace_bytes} bytes, the plan reserved "
                              f"{desc.workspace[1]}; re-plan with that request")
    return built


__all__ = ["BuiltGraph", "CudnnGraph", "CudnnGraphError", "GraphDesc", "PlanIndex", "ScalarDesc",
           "TensorDesc", "build_pygraph", "channel_vector", "declare_pygraph", "describe_graph",
           "describe_node", "feature_map", "graph_of", "graph_ops", "one_data_type"]
