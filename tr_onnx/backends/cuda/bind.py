"""The vocabulary of the cuda bindings: what a node turns into, and what a binding may use.

A cuda binding is the ``"cuda"`` kernel of an op in the registry (``backends/cuda/ops/<family>.py``
registers them beside nothing else, the way ``ops/<family>.py`` registers the NumPy kernels).
Like a NumPy kernel factory it runs once, when the plan is made: ``factory(ctx: KernelContext)``
reads shapes and attributes and reserves the node's own scratch with ``ctx.workspace`` (the
MemoryPlan lays it out in WORKSPACE), and returns ``bind(b: BindContext, node) -> [calls]``,
which the ``CudaExecutor`` calls once the arena exists: it turns the node into prepared calls --

* ``Launch``: one of tr_onnx's kernels (named: ``b.launch("tr_relu_fwd_f32", n, args)``) or a
  plugin's ``CudaKernel``, with grid, block and arguments (``DeviceBuffer`` pointers into the
  arena, NumPy scalars of the kernel's C types);
* ``CudnnCall``: a cuDNN frontend graph described from the MemoryPlan (``cudnn_graphs``), built
  on the device when bound;
* ``Copy``: a device-to-device ``memcpy_async``.

A binding that cannot take its node as planned (a layout or dtype its kernels do not read)
raises ``Unbound`` with the reason; the executor collects every such node into one
``CudaUnsupported``. Nothing here imports CuPy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import ir
from ...errors import UnsupportedModelError, unsupported_message
from ...layouts import GatherRowsLayout
from ...memory import DTensor, MemoryPlan
from ...opdef import CudaKernel, KernelContext
from . import sources
from .capture import DeviceBuffer
from .cudnn_graphs import CudnnGraph, CudnnGraphError, Describe, describe_node
from .device import BLOCK, KernelRef, launch_dims

DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # dtype -> kernel storage
TO_PADDED, TO_COMPACT = -1, -2  # operand specs that change layout (kernels/elementwise.cu)


class Unbound(Exception):
    """Raised by a binding: this node, as planned, has no cuda binding (the message says why)."""


class CudaUnsupported(UnsupportedModelError):
    """Nodes the cuda executor cannot bind. ``missing`` lists every ``(domain, op_type,
    since_version, [node names])``; ``reasons`` maps node labels to why."""

    def __init__(self, missing: list[tuple[str, str, int, list[str]]], reasons: dict[str, str]):
        super().__init__(unsupported_message(missing, "cuda", reasons=reasons), missing)
        self.reasons = reasons


# --------------------------------------------------------------------------------------------
# Prepared calls
# --------------------------------------------------------------------------------------------

@dataclass
class Launch:
    kernel: KernelRef
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple

    def issue(self, device) -> None:
        device.launch(self.kernel, self.grid, self.block, self.args)


@dataclass
class CudnnCall:
    desc: Any  # cudnn_graphs.GraphDesc
    graph: Any  # what device.build_cudnn returned (a BuiltGraph on the GPU)
    pointers: dict[str, int]
    workspace: int

    def issue(self, device) -> None:
        device.cudnn_execute(self.graph, self.pointers, self.workspace)


@dataclass
class Copy:
    dst: DeviceBuffer
    src: DeviceBuffer

    def issue(self, device) -> None:
        device.memcpy_async(self.dst, self.src, self.dst.nbytes, "d2d")


@dataclass
class BoundNode:
    """One node's prepared calls; ``fused_into``: the label of the node whose call does its
    work (a Relu in a Conv's cuDNN epilogue), then ``calls`` is empty."""

    node: ir.Node
    calls: list = field(default_factory=list)
    fused_into: str | None = None

    @property
    def label(self) -> str:
        return self.node.label

    @property
    def phase(self) -> str:
        return self.node.phase

    def run(self, device) -> None:
        for call in self.calls:
            call.issue(device)


# --------------------------------------------------------------------------------------------
# Geometry: how a DTensor's elements sit in memory, for the flat kernels
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """``flat``: elements in logical (row-major) order, ``n`` of them (1-D vectors padded to
    a channel multiple count their logical length: the pad lanes are never touched);
    ``channels_last``: ``[N', *S, Cp]`` physical (``n`` = every physical element, pads
    included), ``c`` logical channels, ``s`` spatial size, ``m`` logical elements."""

    kind: str
    n: int
    shape: tuple[int, ...]
    phys: tuple[int, ...] = ()
    c: int = 0
    s: int = 1
    cp: int = 0
    m: int = 0
    padded: bool = False


def geometry(t: DTensor) -> Geometry | None:
    layout = t.layout
    numel = math.prod(t.shape)
    if isinstance(layout, GatherRowsLayout):
        return Geometry("flat", numel, t.shape) if layout.is_identity else None
    if layout.is_plain or len(t.shape) <= 1:
        return Geometry("flat", numel, t.shape)
    if layout.kind in ("channels_last", "conv_weight") and layout.perm == (
            0, *range(2, len(t.shape)), 1):
        return Geometry("channels_last", math.prod(layout.phys_shape), t.shape,
                        layout.phys_shape, t.shape[1], math.prod(t.shape[2:]),
                        layout.phys_shape[-1], numel, layout.is_padded)
    return None


def operand_spec(a: DTensor, ga: Geometry | None, out: Geometry) -> int | None:
    """How operand ``a`` is indexed by the output's elements (``kernels/elementwise.cu``):
    a period (``out.n`` = same layout, 1 = scalar, a suffix length = trailing broadcast),
    ``TO_PADDED`` / ``TO_COMPACT`` for a layout change, or None."""
    if math.prod(a.shape) == 1:
        return 1
    if ga is None:
        return None
    if ga.kind == out.kind and tuple(a.shape) == tuple(out.shape) and (
            ga.kind == "flat" or ga.phys == out.phys):
        return out.n
    if tuple(a.shape) == tuple(out.shape):
        if out.kind == "channels_last" and ga.kind == "flat":
            return TO_PADDED
        if out.kind == "flat" and ga.kind == "channels_last":
            return TO_COMPACT
    if out.kind == "flat" and ga.kind == "flat":
        shape = tuple(a.shape)
        while shape and shape[0] == 1:
            shape = shape[1:]
        if shape and tuple(out.shape[len(out.shape) - len(shape):]) == shape:
            return math.prod(shape)
    return None


# kernel scalar arguments, typed as the kernels' C parameters
def f32(x) -> np.float32:
    return np.float32(x)


def f64(x) -> np.float64:
    return np.float64(x)


def i64(x) -> np.int64:
    return np.int64(x)


def i32(x) -> np.int32:
    return np.int32(x)


# --------------------------------------------------------------------------------------------
# The bind context
# --------------------------------------------------------------------------------------------

class BindContext:
    """What a binding may use when its node is bound: arena pointers of the plan's tensors,
    the node's own scratch (``ws``), kernel references and launches, cuDNN graphs.

    One per plan (``BindContext(plan, device)``); ``at(node, workspaces)`` is the view a
    binding receives, carrying the node's scratch buffers in the order it asked for them.
    """

    def __init__(self, plan, device):
        self.plan, self.device = plan, device
        self.memory: MemoryPlan = plan.memory
        self.graph: ir.Graph = plan.graph
        self.base = int(device.arena_base)
        self.tensors = self.memory.tensors
        self.node: ir.Node | None = None
        self.workspaces: Sequence[DTensor] = ()
        self.fused: dict[int, str] = {}  # id(node) -> label of the node that does its work

    def at(self, node: ir.Node, workspaces: Sequence[DTensor]) -> BindContext:
        view = copy.copy(self)
        view.node, view.workspaces = node, tuple(workspaces)
        return view

    # -- pointers ----------------------------------------------------------------------------
    def t(self, v: ir.Value) -> DTensor:
        return self.tensors[v.name]

    def buf(self, v: ir.Value | None, writes: bool = False) -> DeviceBuffer | None:
        if v is None:
            return None
        t = self.t(v)
        return DeviceBuffer(self.base + t.offset, t.nbytes, writes, t.name)

    def tensor_buf(self, t: DTensor, writes: bool = False, nbytes: int | None = None
                   ) -> DeviceBuffer:
        return DeviceBuffer(self.base + t.offset, t.nbytes if nbytes is None else nbytes,
                            writes, t.name)

    def ws(self, k: int, writes: bool = True) -> DeviceBuffer:
        """The node's scratch buffer ``k`` (the ``k``-th its factory asked for)."""
        t = self.workspaces[k]
        return DeviceBuffer(self.base + t.offset, t.nbytes, writes, t.name)

    # -- kernels -----------------------------------------------------------------------------
    def dt(self, v: ir.Value, what: str = "") -> str:
        name = np.dtype(self.t(v).dtype).name
        if name not in DT:
            raise Unbound(f"{what or v.name!r} has dtype {name}; the cuda kernels store "
                          f"{', '.join(DT)}")
        return DT[name]

    def kernel(self, name: str, family: sources.KernelSource | None = None) -> KernelRef:
        """Kernel ``name`` of tr_onnx's sources, or of ``family`` when a binding brings its
        own source (a plugin's op set); prepared on the device (compiled, looked up)."""
        ref = KernelRef(sources.family_of(name), name) if family is None else \
            KernelRef(family.name, name, family.text)
        self.device.prepare_kernel(ref)
        return ref

    def launch(self, name: str, n: int, args: Sequence, block: int = BLOCK,
               single_block: bool = False, family: sources.KernelSource | None = None
               ) -> Launch:
        grid, blk = launch_dims(n, block)
        if single_block:
            grid = (1, 1, 1)
        return Launch(self.kernel(name, family), grid, blk, tuple(args))

    def zero_lanes(self, v: ir.Value, g: Geometry) -> Launch:
        t = self.t(v)
        rows = g.n // g.cp
        if t.dtype.itemsize not in (1, 2, 4):
            raise Unbound(f"cannot zero the padded lanes of {t.name!r} ({t.dtype})")
        return self.launch(f"tr_zero_lanes_b{t.dtype.itemsize}", g.n,
                           [self.buf(v, True), i64(rows), i64(g.c), i64(g.cp)])

    def cudnn(self, node: ir.Node, workspace: int, activation=None,
              describe: Describe | None = None) -> list:
        """The node's cuDNN graph over its scratch buffer ``workspace`` (the limit its plans
        are deselected above); ``activation``: a Relu to fuse into a conv's epilogue.
        ``describe``: a description of the node's graph (``cudnn_graphs.Describe``) other than
        the one its op's ``CudnnGraph`` declares (``cudnn_graphs.describe_node``)."""
        ws = self.workspaces[workspace]
        try:
            desc = (describe_node(node, self.memory, activation, (ws.offset, ws.nbytes))
                    if describe is None else describe(node, self.memory, (ws.offset, ws.nbytes)))
            # a graph cuDNN cannot build on this device is the node's binding refusing it:
            # MatMul then takes its own kernel, other ops are listed with every node that
            # cannot run (never a crash of the session)
            built = self.device.build_cudnn(desc)
        except CudnnGraphError as e:
            raise Unbound(str(e).split(": ", 1)[-1]) from None
        pointers = {port: self.base + t.byte_offset for port, t in desc.tensors().items()
                    if not t.virtual}
        return [CudnnCall(desc, built, pointers, self.base + ws.offset)]


# --------------------------------------------------------------------------------------------
# Bindings as registry kernels
# --------------------------------------------------------------------------------------------

Bind = Callable[[BindContext, ir.Node], list]


def binding(bind: Bind) -> Callable[[KernelContext], Bind]:
    """The kernel factory of a binding that needs no scratch of its own."""

    def factory(ctx: KernelContext) -> Bind:
        return bind

    factory.__name__ = factory.__qualname__ = bind.__name__
    factory.__doc__ = bind.__doc__
    return factory


CUDNN_WORKSPACE = 32 << 20
"""The least scratch a cuDNN graph may use (cuBLAS recommends 32 MiB on Hopper); plans that
need more are deselected. Convolutions get at least their im2col matrix's size."""


def cudnn_workspace(ctx: KernelContext, need: int = 0) -> int:
    """Reserve the scratch a node's cuDNN graph may use (``CUDNN_WORKSPACE``, or ``need`` bytes
    when larger); returns its index for ``BindContext.cudnn``."""
    return ctx.workspace((max(CUDNN_WORKSPACE, need),), np.uint8)


def cudnn_binding(workspace_bytes: Callable[[KernelContext], int] | None = None,
                  describe: Describe | None = None) -> Callable[[KernelContext], Bind]:
    """The factory of a node cuDNN runs: reserves the graph's workspace (``CUDNN_WORKSPACE``,
    or ``workspace_bytes(ctx)`` when larger) and binds the graph (``describe``: the family's
    description of it, see ``BindContext.cudnn``)."""

    def factory(ctx: KernelContext) -> Bind:
        k = cudnn_workspace(ctx, workspace_bytes(ctx) if workspace_bytes else 0)

        def bind(b: BindContext, node: ir.Node) -> list:
            return b.cudnn(node, k, describe=describe)

        return bind

    return factory


def kernel_factory(kernel) -> Callable[[KernelContext], Bind]:
    """The cuda factory of an OpDef's ``kernels["cuda"]``: a binding factory as it is, a
    plugin's ``CudaKernel`` through ``plugin_binding``, a ``CudnnGraph`` through its own
    binding or, where it declares none, ``cudnn_binding`` of the graph alone."""
    if isinstance(kernel, CudaKernel):
        return binding(plugin_binding(kernel))
    if isinstance(kernel, CudnnGraph):
        return kernel.binding or cudnn_binding(kernel.workspace_bytes)
    return kernel


def plugin_binding(kernel: CudaKernel) -> Bind:
    """A plugin op's ``CudaKernel``: ``elementwise`` / ``bias_last_axis`` launches of its own
    source (family ``plugin:<domain>/<op>``)."""

    def bind(b: BindContext, node: ir.Node) -> list:
        ins = [v for v in node.inputs if v is not None]
        outs = [v for v in node.outputs if v is not None]
        out = out_geometry(b, outs[0])
        dt = b.dt(outs[0])
        if dt not in ("f32", "f16"):
            raise Unbound(f"plugin kernels have _f32 and _f16 entry points, not _{dt}")
        same = [v for v in ins + outs if operand_spec(b.t(v), geometry(b.t(v)), out) == out.n]
        extra: list = []
        if kernel.launch == "elementwise":
            if len(same) != len(ins) + len(outs):
                raise Unbound("a plugin elementwise kernel needs every operand in one layout")
        elif kernel.launch == "bias_last_axis":
            if out.kind != "flat" or len(same) != len(ins) + len(outs) - 1:
                raise Unbound("bias_last_axis kernels take compact operands and one bias")
            extra = [i64(math.prod(b.t(ins[1]).shape))]
        else:
            raise Unbound(f"launch {kernel.launch!r} is not one the executor knows")
        ref = KernelRef(f"plugin:{node.domain or 'ai.onnx'}/{node.op_type}",
                        f"{kernel.function}_{dt}", kernel.source)
        b.device.prepare_kernel(ref)
        grid, block = launch_dims(out.n)
        args = [b.buf(v) for v in ins] + [b.buf(v, True) for v in outs] + [i64(out.n)] + \
            extra + [f32(float(node.attrs.get(k, 0.0))) for k in kernel.scalar_attrs]
        calls: list = [Launch(ref, grid, block, tuple(args))]
        if out.padded:
            calls += [b.zero_lanes(v, out) for v in outs]
        return calls

    bind.__name__ = f"bind_{kernel.function}"
    return bind


# --------------------------------------------------------------------------------------------
# Helpers several families share
# --------------------------------------------------------------------------------------------

def out_geometry(b: BindContext, v: ir.Value) -> Geometry:
    g = geometry(b.t(v))
    if g is None:
        raise Unbound(f"output {v.name!r} has layout {b.t(v).layout.describe()}, which the "
                      "flat kernels cannot index")
    return g


def operand_specs(b: BindContext, operands: list[ir.Value], out: Geometry):
    """Each operand's spec and the (m, c, s, cp) the layout-changing ones share."""
    specs, shape_args = [], None
    for v in operands:
        t = b.t(v)
        g = geometry(t)
        spec = operand_spec(t, g, out)
        if spec is None:
            raise Unbound(f"operand {v.name!r} ({t.layout.describe()} {list(t.shape)}) does "
                          f"not map onto the output's elements ({out.kind} {list(out.shape)})")
        if spec in (TO_PADDED, TO_COMPACT):
            src = out if spec == TO_PADDED else g
            args = (src.m, src.c, src.s, src.cp)
            if shape_args not in (None, args):
                raise Unbound("operands change layout with different channel paddings")
            shape_args = args
        specs.append(spec)
    return specs, shape_args or (out.n, 1, 1, 1)


def keeps_pads_zero(specs, out: Geometry) -> bool:
    return all(s in (out.n, TO_PADDED, TO_COMPACT) for s in specs)


def same_layout(b: BindContext, x: ir.Value, y: ir.Value) -> Geometry:
    """The output's geometry, when ``x`` is laid out exactly as ``y``."""
    gx, gy = geometry(b.t(x)), out_geometry(b, y)
    if gx is None or operand_spec(b.t(x), gx, gy) != gy.n:
        raise Unbound(f"input {x.name!r} and output {y.name!r} are in different layouts")
    return gy


def is_compact(b: BindContext, v: ir.Value) -> bool:
    """Elements in logical row-major order (plain, or a 1-D vector read up to its length)."""
    g = geometry(b.t(v))
    return g is not None and g.kind == "flat"


def need_compact(b: BindContext, *vs) -> None:
    for v in vs:
        if v is not None and not is_compact(b, v):
            raise Unbound(f"{v.name!r} is {b.t(v).layout.describe()}; this kernel reads "
                          "compact (row-major) tensors")


def float_dt(b: BindContext, *vs) -> str:
    dts = {b.dt(v) for v in vs if v is not None}
    if len(dts) != 1:
        raise Unbound("operands of different dtypes")
    return dts.pop()


def move_kernel(b: BindContext, v: ir.Value) -> str:
    """The bit-pattern suffix (``b<bytes>``) of the data-movement kernels for ``v``."""
    size = b.t(v).dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise Unbound(f"elements of {size} bytes")
    return f"b{size}"


def copy_of(b: BindContext, x: ir.Value, y: ir.Value) -> Copy:
    """``y``'s bytes from ``x``'s (same dtype and layout)."""
    tx, ty = b.t(x), b.t(y)
    return Copy(b.buf(y, True), DeviceBuffer(b.base + tx.offset, ty.nbytes, False, tx.name))


MAX_DIMS = 6  # the collapsed rank the strided kernels take


def contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return strides[::-1]


def collapse(dims, stride_sets) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 axes and merge neighbours every stride set walks contiguously, then pad on
    the left to MAX_DIMS (dims 1, strides 0)."""
    keep = [k for k, d in enumerate(dims) if d != 1]
    dims = [int(dims[k]) for k in keep]
    sets = [[int(s[k]) for k in keep] for s in stride_sets]
    k = len(dims) - 2
    while k >= 0:
        if all(s[k] == s[k + 1] * dims[k + 1] for s in sets):
            dims[k:k + 2] = [dims[k] * dims[k + 1]]
            for s in sets:
                s[k:k + 2] = [s[k + 1]]
        k -= 1
    if len(dims) > MAX_DIMS:
        raise Unbound(f"{len(dims)} axes after collapsing; the strided kernels take {MAX_DIMS}")
    pad = MAX_DIMS - len(dims)
    return [1] * pad + dims, [[0] * pad + s for s in sets]


def logical_strides(b: BindContext, v: ir.Value) -> list[int]:
    """Element strides of ``v``'s logical axes in its physical layout: row-major for a compact
    tensor, ``[N, *S, Cp]`` order for a channels-last one (the strided kernels: copies,
    broadcasting elementwise ops)."""
    t = b.t(v)
    g = geometry(t)
    if g is not None and g.kind == "flat":
        return contiguous_strides(t.shape)
    if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last":
        phys = contiguous_strides(t.layout.phys_shape)  # [N, *S, Cp]
        return [phys[0], phys[-1], *phys[1:-1]]
    raise Unbound(f"{v.name!r} is {t.layout.describe()}; the strided kernels read compact or "
                  "channels-last tensors")


def const_ints(v: ir.Value | None, what: str) -> list[int] | None:
    if v is None:
        return None
    if v.data is None:
        raise Unbound(f"{what} computed at run time")
    return [int(a) for a in np.asarray(v.data).reshape(-1)]


def row_split(node, shape, softmax: bool) -> tuple[int, int]:
    """(rows, row length) of a softmax / layer norm over the trailing axes from ``axis``."""
    rank = len(shape)
    axis = int(node.attrs.get("axis", -1 if softmax else -1)) % max(rank, 1)
    if softmax and node.since_version >= 13 and axis != rank - 1:
        raise Unbound(f"softmax over axis {axis} of a rank-{rank} tensor; the row kernel "
                       "takes the last axis")
    return math.prod(shape[:axis]), math.prod(shape[axis:])


__all__ = ["BindContext", "BoundNode", "Copy", "CudaUnsupported", "CudnnCall", "Geometry",
           "Launch", "Unbound", "binding", "cudnn_binding", "geometry", "kernel_factory"]
