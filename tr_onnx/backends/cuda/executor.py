"""The cuda executor: every scheduled node of a compiled plan bound, once, to device calls on
arena pointers; each training phase captured into its own CUDA Graph and replayed.

Binding (``CudaExecutor.__init__``) turns each node into a ``BoundNode``: a list of prepared
calls -- ``Launch`` (a kernel of ``sources.SOURCES`` or a plugin's ``CudaKernel``, with grid,
block and arguments: arena base + DTensor offsets as ``DeviceBuffer``, element counts and
scalar attributes as NumPy scalars of the kernel's C types), ``CudnnCall`` (a cuDNN frontend
graph from ``cudnn_graphs.describe_node``, built on the device at bind time) or ``Copy``
(a device-to-device ``memcpy_async``). Nothing is looked up, compiled or allocated in a step.

A node with no cuda binding is collected; after the walk one ``CudaUnsupported`` lists every
such (domain, op, version) with its nodes and why. There is no per-node fallback to NumPy: the
message says what to do (run on ``backend="numpy"``, or give the op a cuda kernel).

Phases: a training plan's ``compute``, ``commit`` and ``apply`` nodes are separate step lists;
an inference plan has one, ``forward``. ``run(phase)``: the first call runs eagerly (the
warm-up: modules are loaded and cuDNN plans built by then, caches filled on the capture
stream), the second captures (``capture.capture_step``) and launches the graph, later calls
launch it; ``run("a+b")`` does that for phases a and b as one graph. A session's training
plan carries the step guard's flag (``__bad_batch``): ``run_step`` then runs the whole step --
compute, the guard, commit, discard, apply, report (``_guard_phases``) -- as one graph, so
whether a batch is kept is decided on the device (the running statistics' copies and the
optimizer update skip themselves on the flag), and the host reads 16 bytes back after one
synchronize. ``cuda_graphs``: ``"fallback"`` (default) -- a step that cannot be captured
warns, naming the node, and runs eagerly from then on; ``"require"`` -- the ``CaptureError``
propagates; ``"off"`` -- nothing is captured (every call eager: for debugging, profiling).

Host transfers use the DTensor layouts: ``write_input`` copies a compact (NCHW) host array
through one of two pinned buffers (the host fills one while the other's copy may be in
flight) into the arena; a padded channels-last input is uploaded compact into the WORKSPACE
region (dead between steps) and padded on the device by ``tr_pad_nhwc``; ``read_output``
the reverse with ``tr_unpad_nhwc``. Where WORKSPACE is too small the host pads instead.
``all_finite`` reduces a tensor on the device to a flag in the first 4 bytes of WORKSPACE and
reads back only the flag.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import ir
from ...errors import InputError, UnsupportedModelError
from ...layouts import GatherRowsLayout
from ...memory import DTensor, MemoryPlan, Region
from .. import APPLIED, BAD_BATCH, REJECT, HostTransfers, StepReport, check_cuda_graphs
from . import sources
from .capture import WRITE_POLICY, CaptureError, CaptureStep, DeviceBuffer, capture_step
from .cudnn_graphs import CUDNN_OPS, CudnnGraphError, describe_node, fusable_activation
from .device import BLOCK, KernelRef, launch_dims

INTERNAL = "ai.tr_onnx"

REPORT_BYTES = 32
"""What a step run as one graph reads back: loss, bad-batch flag, overflow flag, grad norm,
reject flag (five float32, padded)."""

EXECUTOR_POLICY = {**WRITE_POLICY,
                   "guard": frozenset({Region.WORKSPACE, Region.OPT_STATE, Region.GRAD}),
                   "report": frozenset({Region.WORKSPACE}),
                   "upload": frozenset({Region.INPUT, Region.WORKSPACE}),
                   "download": frozenset({Region.WORKSPACE}),
                   "check": frozenset({Region.WORKSPACE})}
"""``capture.WRITE_POLICY`` plus the executor's transfers, issued outside the captured step:
``upload`` (the batch and per-step scalars into INPUT, staged through WORKSPACE),
``download`` (unpadding an output into WORKSPACE before the copy to the host) and ``check``
(``all_finite``'s flag, the first 4 bytes of WORKSPACE)."""

DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # dtype -> kernel storage
HALF_INPUTS = ("float16", "bfloat16")  # inputs a float32 host batch is rounded to on the device
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Sum": "add"}
COPY_OPS = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"}
OPTIMIZERS = {"SGDUpdate", "AdamUpdate", "AdagradUpdate"}
TO_PADDED, TO_COMPACT = -1, -2  # operand specs that change layout (kernels/extra.cu)


class CudaUnsupported(UnsupportedModelError):
    """Nodes the cuda executor cannot bind. ``missing`` lists every ``(domain, op_type,
    since_version, [node names])``; ``reasons`` maps node labels to why."""

    def __init__(self, missing: list[tuple[str, str, int, list[str]]], reasons: dict[str, str]):
        lines = [f"the cuda backend cannot run {sum(len(n) for *_, n in missing)} node(s) of "
                 "this plan:"]
        for domain, op, version, names in missing:
            shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
            lines.append(f"  {domain or 'ai.onnx'} {op} v{version}: {shown}")
        detail = list(dict.fromkeys(f"    {label.split(' (', 1)[1].rstrip(')')}: {why}"
                                    for label, why in reasons.items()))[:12]
        lines += ["  why:"] + detail if detail else []
        lines.append("  No node falls back to NumPy on its own. Train this model with "
                     "backend='numpy', or give these ops a cuda kernel (OpDef.kernels['cuda'] = "
                     "CudaKernel(...) in a plugin, or a binding in "
                     "tr_onnx/backends/cuda/executor.py).")
        super().__init__("\n".join(lines), missing)
        self.reasons = reasons


class _Unbound(Exception):
    """Raised inside a binder: this node has no cuda binding (the reason)."""


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


def _spec(a: DTensor, ga: Geometry | None, out: Geometry) -> int | None:
    """How operand ``a`` is indexed by the output's elements (module docstring of extra.cu):
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


# --------------------------------------------------------------------------------------------
# The binder
# --------------------------------------------------------------------------------------------

def _f32(x) -> np.float32:
    return np.float32(x)


def _i64(x) -> np.int64:
    return np.int64(x)


def _int(x) -> np.int32:
    return np.int32(x)


def _f64(x) -> np.float64:
    return np.float64(x)


class _Binder:
    """Per-plan helpers the op binders share: pointers, dtypes, launches."""

    def __init__(self, plan, device):
        self.plan, self.device = plan, device
        self.memory: MemoryPlan = plan.memory
        self.base = int(device.arena_base)
        self.tensors = self.memory.tensors
        ws_start, ws_bytes = self.memory.regions[Region.WORKSPACE]
        self.workspace = (self.base + ws_start, ws_bytes)
        # the step guard's flag (training plans of a session: CudaExecutor.run_step)
        self.bad = BAD_BATCH if BAD_BATCH in self.tensors else None

    # -- pointers ----------------------------------------------------------------------------
    def t(self, v: ir.Value) -> DTensor:
        return self.tensors[v.name]

    def buf(self, v: ir.Value | None, writes: bool = False) -> DeviceBuffer | None:
        if v is None:
            return None
        t = self.t(v)
        return DeviceBuffer(self.base + t.offset, t.nbytes, writes, t.name)

    def ws(self, index: int, k: int, nbytes: int, what: str) -> DeviceBuffer:
        """Workspace ``k`` of node ``index`` (what the numpy kernel asked for), at least
        ``nbytes`` long."""
        bufs = self.memory.workspaces.get(index, [])
        if k >= len(bufs) or bufs[k].nbytes < nbytes:
            raise _Unbound(f"needs {nbytes} bytes of scratch for {what} (workspace {k}); the "
                           "plan reserved none that large")
        t = bufs[k]
        return DeviceBuffer(self.base + t.offset, t.nbytes, True, t.name)

    def named_scalar(self, name: str, dtype, writes: bool = True) -> DeviceBuffer:
        """A pointer to the arena scalar ``name`` of ``dtype`` (loss scaling, the step
        guard)."""
        t = self.tensors.get(name)
        if t is None or t.dtype != np.dtype(dtype) or math.prod(t.shape) != 1:
            raise _Unbound(f"needs the {np.dtype(dtype)} scalar {name!r} in the arena")
        return DeviceBuffer(self.base + t.offset, t.nbytes, writes, t.name)

    # -- kernels -----------------------------------------------------------------------------
    def dt(self, v: ir.Value, what: str = "") -> str:
        name = np.dtype(self.t(v).dtype).name
        if name not in DT:
            raise _Unbound(f"{what or v.name!r} has dtype {name}; the cuda kernels store "
                           f"{', '.join(DT)}")
        return DT[name]

    def kernel(self, name: str) -> KernelRef:
        """Kernel ``name`` of tr_onnx's sources (its family is looked up: bindings name kernels,
        not the files that hold them)."""
        ref = KernelRef(sources.family_of(name), name)
        prepare = getattr(self.device, "prepare_kernel", None)
        if prepare is not None:
            prepare(ref)
        return ref

    def launch(self, name: str, n: int, args: Sequence, block: int = BLOCK,
               single_block: bool = False) -> Launch:
        grid, blk = launch_dims(n, block)
        if single_block:
            grid = (1, 1, 1)
        return Launch(self.kernel(name), grid, blk, tuple(args))

    def zero_lanes(self, v: ir.Value, g: Geometry) -> Launch:
        t = self.t(v)
        rows = g.n // g.cp
        name = f"tr_zero_lanes_b{t.dtype.itemsize}"
        if t.dtype.itemsize not in (1, 2, 4):
            raise _Unbound(f"cannot zero the padded lanes of {t.name!r} ({t.dtype})")
        return self.launch(name, g.n, [self.buf(v, True), _i64(rows), _i64(g.c),
                                                  _i64(g.cp)])


# -- elementwise -----------------------------------------------------------------------------

def _zero_preserving_unary(stem: str, a: float, b: float) -> bool:
    """f(+0) is +0 bit for bit, so the kernel keeps padded lanes zero by itself."""
    if stem in ("relu", "hardswish", "tanh", "gelu", "gelu_tanh", "sqrt", "abs"):
        return True
    if stem in ("leaky_relu", "elu"):
        return a >= 0
    if stem == "clip":
        return a <= 0 <= b
    return False


def _const_scalar(v: ir.Value | None) -> float | None:
    if v is None or v.data is None:
        return None
    arr = np.asarray(v.data)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def _out_geometry(b: _Binder, v: ir.Value) -> Geometry:
    g = geometry(b.t(v))
    if g is None:
        raise _Unbound(f"output {v.name!r} has layout {b.t(v).layout.describe()}, which the "
                       "flat kernels cannot index")
    return g


def _specs(b: _Binder, operands: list[ir.Value], out: Geometry):
    """Each operand's spec and the (m, c, s, cp) the layout-changing ones share."""
    specs, shape_args = [], None
    for v in operands:
        t = b.t(v)
        g = geometry(t)
        spec = _spec(t, g, out)
        if spec is None:
            raise _Unbound(f"operand {v.name!r} ({t.layout.describe()} {list(t.shape)}) does "
                           f"not map onto the output's elements ({out.kind} "
                           f"{list(out.shape)})")
        if spec in (TO_PADDED, TO_COMPACT):
            src = out if spec == TO_PADDED else g
            args = (src.m, src.c, src.s, src.cp)
            if shape_args not in (None, args):
                raise _Unbound("operands change layout with different channel paddings")
            shape_args = args
        specs.append(spec)
    return specs, shape_args or (out.n, 1, 1, 1)


def _keeps_pads_zero(specs, out: Geometry) -> bool:
    return all(s in (out.n, TO_PADDED, TO_COMPACT) for s in specs)


def bind_binary(b: _Binder, node: ir.Node, index: int) -> list:
    op = BINARY[node.op_type]
    ins = [v for v in node.inputs if v is not None]
    if len(ins) < 2:
        raise _Unbound("a one-input Sum is a copy; the fan-in sums have a binding")
    y = node.outputs[0]
    dt = b.dt(y)
    for v in ins:
        if b.dt(v) != dt:
            raise _Unbound(f"mixed dtypes ({b.t(v).dtype} and {b.t(y).dtype})")
    out = _out_geometry(b, y)
    calls = []
    acc = ins[0]
    for other in ins[1:]:
        specs, (m, c, s, cp) = _specs(b, [acc, other], out)
        a_buf, b_buf, y_buf = b.buf(acc), b.buf(other), b.buf(y, True)
        if all(isinstance(p, int) and p > 0 for p in specs):
            calls.append(b.launch(f"tr_{op}_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, _i64(out.n), _i64(specs[0]),
                                   _i64(specs[1])]))
        else:
            calls.append(b.launch(f"tr_{op}_mixed_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, _i64(out.n), _i64(specs[0]),
                                   _i64(specs[1]), _i64(m), _i64(c), _i64(s), _i64(cp)]))
        acc = y  # Sum of more inputs: y = y + next
        if out.padded and not (op != "div" and _keeps_pads_zero(specs, out)):
            calls.append(b.zero_lanes(y, out))
    return calls


def bind_accumulate(b: _Binder, node: ir.Node, index: int) -> list:
    """acc += g, in place (ins[0] is both read and written)."""
    acc, g = node.inputs[0], node.inputs[1]
    dt = b.dt(acc)
    if b.dt(g) != dt:
        raise _Unbound(f"accumulator {b.t(acc).dtype}, gradient {b.t(g).dtype}")
    out = _out_geometry(b, acc)
    specs, (m, c, s, cp) = _specs(b, [acc, g], out)
    if specs[1] == 1 and out.n != 1:
        raise _Unbound("a scalar gradient broadcast into an accumulator")
    return [b.launch(f"tr_add_mixed_{dt}", out.n,
                     [b.buf(acc, True), b.buf(g), b.buf(acc, True), _i64(out.n),
                      _i64(specs[0]), _i64(specs[1]), _i64(m), _i64(c), _i64(s), _i64(cp)])]


def bind_unary(b: _Binder, node: ir.Node, index: int) -> list:
    stem, attr_names = sources.ONNX_UNARY[node.op_type]
    x, y = node.inputs[0], node.outputs[0]
    if node.op_type == "Gelu" and node.attrs.get("approximate", "none") == "tanh":
        stem = "gelu_tanh"
    if node.op_type == "Clip":
        lo, hi = -np.inf, np.inf
        for i, key in ((1, "min"), (2, "max")):
            v = node.inputs[i] if i < len(node.inputs) else None
            if v is not None:
                value = _const_scalar(v)
                if value is None:
                    raise _Unbound(f"Clip bound {v.name!r} is computed at run time")
                lo, hi = (value, hi) if i == 1 else (lo, value)
            elif node.attrs.get(key) is not None:
                lo, hi = (float(node.attrs[key]), hi) if i == 1 else (lo, float(node.attrs[key]))
        a, c = lo, hi
    else:
        vals = [float(node.attrs.get(k, 0.0)) for k in attr_names] + [0.0, 0.0]
        a, c = vals[0], vals[1]
    dt = b.dt(x)
    gx, gy = geometry(b.t(x)), _out_geometry(b, y)
    if gx is None or _spec(b.t(x), gx, gy) != gy.n:
        raise _Unbound(f"input {x.name!r} and output {y.name!r} are in different layouts")
    calls = [b.launch(f"tr_{stem}_fwd_{dt}", gy.n,
                      [b.buf(x), b.buf(y, True), _i64(gy.n), _f32(a), _f32(c)])]
    if gy.padded and not _zero_preserving_unary(stem, a, c):
        calls.append(b.zero_lanes(y, gy))
    return calls


COMPARE = {"Greater": "greater", "Less": "less", "Equal": "equal"}


def bind_compare(b: _Binder, node: ir.Node, index: int) -> list:
    """Greater / Less / Equal of float operands into a bool (one byte) output."""
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    dt = b.dt(a)
    if b.dt(c) != dt or b.t(y).dtype != np.bool_:
        raise _Unbound("operands of different dtypes")
    out = _out_geometry(b, y)
    specs, (m, ch, s, cp) = _specs(b, [a, c], out)
    calls = [b.launch(f"tr_{COMPARE[node.op_type]}_{dt}", out.n,
                      [b.buf(a), b.buf(c), b.buf(y, True), _i64(out.n), _i64(specs[0]),
                       _i64(specs[1]), _i64(m), _i64(ch), _i64(s), _i64(cp)])]
    if out.padded and not _keeps_pads_zero(specs, out):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_where(b: _Binder, node: ir.Node, index: int) -> list:
    cond, a, c = node.inputs[:3]
    y = node.outputs[0]
    dt = b.dt(y)
    if b.t(cond).dtype != np.bool_ or b.dt(a) != dt or b.dt(c) != dt:
        raise _Unbound("Where needs a bool condition and two operands of the output's dtype")
    out = _out_geometry(b, y)
    specs, (m, ch, s, cp) = _specs(b, [cond, a, c], out)
    calls = [b.launch(f"tr_where_{dt}", out.n,
                      [b.buf(cond), b.buf(a), b.buf(c), b.buf(y, True), _i64(out.n)]
                      + [_i64(p) for p in specs] + [_i64(m), _i64(ch), _i64(s), _i64(cp)])]
    # a padded lane reads cond = false (pads of a same-layout cond are zero), so it takes c
    zero_c = specs[2] == 1 and c.data is not None and not np.asarray(c.data).reshape(
        -1).view(np.uint8).any()
    if out.padded and not (specs[0] != 1 and (zero_c or specs[2] in (out.n, TO_PADDED))):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_expand(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    if geometry(tx) is None or geometry(ty) is None or \
            (len(tx.shape) > 1 and not tx.layout.is_plain) or not ty.layout.is_plain:
        raise _Unbound("Expand is bound for compact (plain) tensors only")
    shape_in = (1,) * (len(ty.shape) - len(tx.shape)) + tuple(tx.shape)
    bcast = [i for i, (a, o) in enumerate(zip(shape_in, ty.shape)) if a != o]
    if any(shape_in[i] != 1 for i in bcast):
        raise _Unbound(f"cannot expand {list(tx.shape)} to {list(ty.shape)}")
    if not bcast:
        return [Copy(b.buf(y, True), DeviceBuffer(b.base + tx.offset, ty.nbytes, False, tx.name))]
    lo, hi = bcast[0], bcast[-1] + 1
    if any(shape_in[i] != 1 for i in range(lo, hi)):
        raise _Unbound(f"expanding {list(tx.shape)} to {list(ty.shape)} broadcasts two "
                       "separate runs of axes; one run is bound")
    inner, repeat = math.prod(ty.shape[hi:]), math.prod(ty.shape[lo:hi])
    n = math.prod(ty.shape)
    dt = b.dt(y)
    return [b.launch(f"tr_expand_{dt}", n,
                     [b.buf(x), b.buf(y, True), _i64(n), _i64(inner), _i64(repeat)])]


def bind_global_average_pool(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    gx, gy = geometry(b.t(x)), geometry(b.t(y))
    dt = b.dt(x)
    tx = b.t(x)
    n, s = tx.shape[0], math.prod(tx.shape[2:])
    if gx is not None and gy is not None and gx.kind == gy.kind == "channels_last" \
            and gx.cp == gy.cp and tx.layout.phys_shape[0] == n:
        cp, sstride, cstride = gx.cp, gx.cp, 1
    elif gx is not None and gy is not None and gx.kind == gy.kind == "flat":
        cp, sstride, cstride = tx.shape[1], 1, s
    else:
        raise _Unbound("input and output of GlobalAveragePool must share the layout kind")
    total = n * cp
    return [b.launch(f"tr_gap_{dt}", total,
                     [b.buf(x), b.buf(y, True), _i64(total), _i64(s), _i64(cp), _i64(sstride),
                      _i64(cstride)])]


def _reduce_axes(node: ir.Node, rank: int) -> list[int] | None:
    v = node.inputs[1] if len(node.inputs) > 1 else None
    if v is not None:
        if v.data is None:
            return None
        axes = [int(a) for a in np.asarray(v.data).reshape(-1)]
    else:
        axes = list(node.attrs.get("axes") or [])
    if not axes:
        return [] if int(node.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted(a % rank for a in axes)


def bind_reduce_sum(b: _Binder, node: ir.Node, index: int) -> list:
    """Sums over leading axes of a compact tensor, or over every axis but the channels of a
    channels-last one (the bias gradients of Gemm and Conv): column sums."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    rank = len(tx.shape)
    axes = _reduce_axes(node, rank)
    gx, gy = geometry(tx), geometry(ty)
    dt = b.dt(x)
    if axes is None or gx is None or gy is None:
        raise _Unbound("axes computed at run time, or a layout the column sum cannot read")
    if gx.kind == "flat" and axes == list(range(len(axes))):
        rows = math.prod(tx.shape[:len(axes)])
        cols = ld = math.prod(tx.shape[len(axes):])
    elif gx.kind == "channels_last" and tx.layout.kind == "channels_last" and \
            axes == [0, *range(2, rank)]:
        rows, ld = gx.n // gx.cp, gx.cp
        cols = gy.cp if gy.kind == "channels_last" else tx.shape[1]
    else:
        raise _Unbound(f"ReduceSum over axes {axes} of a {tx.layout.describe()} tensor: only "
                       "leading axes (compact) or all but the channels (channels-last) are "
                       "bound")
    return [b.launch(f"tr_sum_rows_{dt}", cols,
                     [b.buf(x), b.buf(y, True), _i64(rows), _i64(cols), _i64(ld)])]


def bind_layout_transpose(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    gx, gy = geometry(tx), geometry(ty)
    dt_x, dt_y = b.dt(x), b.dt(y)
    if gx is None or gy is None or tuple(tx.shape) != tuple(ty.shape):
        raise _Unbound(f"{tx.layout.describe()} -> {ty.layout.describe()} has no kernel")
    if gx.kind == "channels_last" and gy.kind == "flat" and tx.layout.kind == "channels_last":
        return [b.launch(f"tr_unpad_nhwc_{dt_x}_{dt_y}", gx.m,
                         [b.buf(x), b.buf(y, True), _i64(gx.m), _i64(gx.c), _i64(gx.s),
                          _i64(gx.cp)])]
    if gx.kind == "flat" and gy.kind == "channels_last" and ty.layout.kind == "channels_last":
        return [b.launch(f"tr_pad_nhwc_{dt_x}_{dt_y}", gy.n,
                         [b.buf(x), b.buf(y, True), _i64(gy.n), _i64(gy.c), _i64(gy.s),
                          _i64(gy.cp)])]
    raise _Unbound(f"{tx.layout.describe()} -> {ty.layout.describe()} has no kernel")


def bind_copy(b: _Binder, node: ir.Node, index: int) -> list:
    """Identity/Reshape/... that could not alias: a device copy when the bytes are the same."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    if not (tx.layout.is_plain and ty.layout.is_plain) or tx.dtype != ty.dtype:
        raise _Unbound(f"a copy from {tx.layout.describe()} to {ty.layout.describe()}")
    return [Copy(b.buf(y, True), DeviceBuffer(b.base + tx.offset, ty.nbytes, False, tx.name))]


def bind_assign(b: _Binder, node: ir.Node, index: int) -> list:
    target, value = node.inputs[0], node.inputs[1]
    tt, tv = b.t(target), b.t(value)
    gt, gv = geometry(tt), geometry(tv)
    if gt is None or gv is None or tt.dtype != tv.dtype or _spec(tv, gv, gt) != gt.n:
        raise _Unbound(f"assigning {tv.layout.describe()} {tv.dtype} to "
                       f"{tt.layout.describe()} {tt.dtype}")
    nbytes = gt.n * tt.dtype.itemsize
    dst = DeviceBuffer(b.base + tt.offset, nbytes, True, tt.name)
    src = DeviceBuffer(b.base + tv.offset, nbytes, False, tv.name)
    if b.bad is None:
        return [Copy(dst, src)]
    if nbytes % 4:
        raise _Unbound(f"a guarded assignment copies 4-byte words, not {nbytes} bytes")
    # a step run as one graph: the copy is skipped on the device when the batch is bad
    flag = b.named_scalar(BAD_BATCH, np.float32, writes=False)
    return [b.launch("tr_copy_unless_b4", nbytes // 4,
                     [dst, src, _i64(nbytes // 4), flag])]


def bind_zero_fill(b: _Binder, node: ir.Node, index: int) -> list:
    v = node.inputs[0]
    t = b.t(v)
    width = 4 if t.nbytes % 4 == 0 else 1
    words = t.nbytes // width
    return [b.launch(f"tr_zero_lanes_b{width}", words,
                     [DeviceBuffer(b.base + t.offset, t.nbytes, True, t.name), _i64(1), _i64(0),
                      _i64(words)])]


def bind_scale_clip_grad(b: _Binder, node: ir.Node, index: int) -> list:
    g, scale = node.inputs[0], node.inputs[1]
    norm = node.outputs[0] if node.outputs else None
    if norm is None or b.t(norm).dtype != np.float32 or b.t(scale).dtype != np.float32:
        raise _Unbound("needs a float32 scale input and a float32 norm output")
    dt = b.dt(g)
    n = math.prod(b.t(g).shape)
    calls = []
    unscale = node.attrs.get("unscale")
    if unscale:  # dynamic loss scaling: clear the flag, unscale and check GRAD (amp.cu)
        inv = b.named_scalar(unscale["inv_scale"], np.float32, writes=False)
        found = b.named_scalar(unscale["found_inf"], np.float32)
        if b.bad is None:  # else the step guard cleared it (and set it for a bad batch)
            calls.append(b.launch("tr_zero_lanes_b4", 1,
                                  [found, _i64(1), _i64(0), _i64(1)]))
        calls.append(b.launch(f"tr_unscale_check_{dt}", n,
                              [b.buf(g, True), _i64(n), inv, found]))
    return calls + [b.launch(f"tr_scale_clip_norm_{dt}", n,
                             [b.buf(g, True), _i64(n), b.buf(scale), b.buf(norm, True),
                              _f64(float(node.attrs.get("max_norm", 0.0)))], single_block=True)]


def bind_optimizer(b: _Binder, node: ir.Node, index: int) -> list:
    """The fused update over the whole PARAM span and its GRAD / OPT_STATE mirrors."""
    a = node.attrs
    ins = list(node.inputs)
    p, g = ins[0], ins[1]
    tp = b.t(p)
    if tp.dtype != np.float32:
        raise _Unbound(f"parameters must be float32 master weights, got {tp.dtype}")
    gdt = b.dt(g)
    n = math.prod(tp.shape)
    for v in ins[:-2]:
        if v is not None and math.prod(b.t(v).shape) != n:
            raise _Unbound(f"{v.name!r} does not mirror the parameter span")
    if node.op_type == "SGDUpdate":
        stem, states, lr, step = "sgd", [ins[2]], ins[3], ins[4]
        scalars = [_f64(a["momentum"]), _f64(a["dampening"]), _int(int(a["nesterov"])),
                   _f64(a["weight_decay"])]
    elif node.op_type == "AdamUpdate":
        stem, states, lr, step = "adam", ins[2:4], ins[4], ins[5]
        scalars = [_f64(a["beta1"]), _f64(a["beta2"]), _f64(a["epsilon"]),
                   _f64(a["weight_decay"]), _int(int(a["decoupled"]))]
    else:
        stem, states, lr, step = "adagrad", [ins[2]], ins[3], ins[4]
        scalars = [_f64(a["lr_decay"]), _f64(a["weight_decay"]), _f64(a["epsilon"])]
    if b.t(lr).dtype != np.float32 or b.t(step).dtype != np.int64:
        raise _Unbound("lr must be float32 and step int64 in the arena")
    copy = None
    if a.get("weight_copy"):  # mixed precision: the half weights the compute phase reads
        t = b.tensors.get(a["weight_copy"])
        if t is None or t.shape != tp.shape or DT.get(t.dtype.name) != gdt:
            raise _Unbound(f"weight copy {a['weight_copy']!r} must be a {gdt} span mirroring "
                           "the parameters")
        copy = DeviceBuffer(b.base + t.offset, t.nbytes, True, t.name)
    ls = a.get("loss_scale")
    # the update skips itself on this flag: loss scaling's overflow flag (which the step
    # guard also sets for a bad batch), else the guard's own
    found = b.named_scalar(ls["found_inf"], np.float32, writes=False) if ls else \
        None if b.bad is None else b.named_scalar(BAD_BATCH, np.float32, writes=False)
    args = [b.buf(p, True), b.buf(g)] + [b.buf(s, True) for s in states] + [
        copy, _i64(n), b.buf(lr), b.buf(step), found] + scalars
    calls = [b.launch(f"tr_{stem}_{gdt}", n, args)]
    reject = None
    if b.bad is not None:  # the step guard's applied-steps counter follows the update
        reject = b.named_scalar(REJECT, np.float32, writes=False)
        calls.append(b.launch("tr_step_advance", 1, [b.named_scalar(APPLIED, np.int64),
                                                            found], single_block=True))
    if ls:  # dynamic loss scaling: backoff or growth after the (maybe skipped) update
        calls.append(b.launch("tr_loss_scale_update", 1, [
            b.named_scalar(ls["scale"], np.float32), b.named_scalar(ls["inv_scale"], np.float32),
            b.named_scalar(ls["growth_tracker"], np.int32),
            found, _f64(ls["growth_factor"]),
            _f64(ls["backoff_factor"]), _int(ls["growth_interval"]), reject],
            single_block=True))
    return calls


def _sce_geometry(b: _Binder, x: ir.Value, labels: ir.Value):
    tx = b.t(x)
    g = geometry(tx)
    if b.t(labels).dtype != np.int64:
        raise _Unbound("labels must be int64")
    if g is None or tx.dtype.name not in DT:
        raise _Unbound(f"scores {x.name!r} in a layout the row kernels cannot read")
    if g.kind == "flat" and len(tx.shape) == 2:
        return tx.shape[0], tx.shape[1], tx.shape[1]
    if g.kind == "channels_last" and tx.layout.kind == "channels_last":
        return g.n // g.cp, g.c, g.cp
    raise _Unbound("scores of rank > 2 must be channels-last (class-last rows)")


def _sce_common(node: ir.Node):
    reduction = {"none": 0, "sum": 1, "mean": 2}[node.attrs["reduction"]]
    ignore = node.attrs.get("ignore_index")
    return reduction, [_i64(ignore if ignore is not None else -100), _int(ignore is not None)]


def bind_sce(b: _Binder, node: ir.Node, index: int) -> list:
    x, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    out = node.outputs[0]
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        raise _Unbound("the log_prob output has no kernel")
    if b.t(out).dtype != np.float32:
        raise _Unbound("the loss kernels write a float32 loss")
    rows, c, ld = _sce_geometry(b, x, labels)
    dt = b.dt(x)
    reduction, common = _sce_common(node)
    weighted = weights is not None or node.attrs.get("ignore_index") is not None
    row_w = b.ws(index, 1, 4 * rows, "per-row weights")
    row_loss = b.buf(out, True) if reduction == 0 else b.ws(index, 5, 4 * rows, "per-row loss")
    calls = [b.launch(f"tr_sce_fwd_{dt}", rows,
                      [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w, _i64(rows),
                       _i64(c), _i64(ld)] + common)]
    if reduction:
        denom = b.ws(index, 3, 4, "the mean's denominator")
        calls.append(b.launch("tr_sce_reduce", 1,
                              [row_loss, row_w, _i64(rows), _int(reduction), _int(weighted),
                               b.buf(out, True), denom], single_block=True))
    return calls


def bind_sce_grad(b: _Binder, node: ir.Node, index: int) -> list:
    gloss, x, labels = node.inputs[:3]
    weights = node.inputs[3] if len(node.inputs) > 3 else None
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        raise _Unbound("a log_prob gradient input has no kernel")
    gx = node.outputs[0]
    rows, c, ld = _sce_geometry(b, x, labels)
    if _sce_geometry(b, gx, labels)[2] != ld:
        raise _Unbound("scores and their gradient in different layouts")
    dt = b.dt(x)
    if b.dt(gx) != dt or b.t(gloss).dtype != np.float32:
        raise _Unbound("gradient dtype differs from the scores', or a non-float32 loss gradient")
    reduction, common = _sce_common(node)
    weighted = weights is not None or node.attrs.get("ignore_index") is not None
    denom = b.ws(index, 3, 4, "the mean's denominator")
    calls = []
    if reduction == 2:  # the mean's denominator: the forward's row weights, summed
        row_w = b.ws(index, 1, 4 * rows, "per-row weights")
        row_loss = b.ws(index, 5, 4 * rows, "per-row loss")
        loss = b.ws(index, 6, 4, "the recomputed loss")
        calls += [b.launch(f"tr_sce_fwd_{dt}", rows,
                           [b.buf(x), b.buf(labels), b.buf(weights), row_loss, row_w, _i64(rows),
                            _i64(c), _i64(ld)] + common),
                  b.launch("tr_sce_reduce", 1,
                           [row_loss, row_w, _i64(rows), _int(reduction), _int(weighted), loss,
                            denom], single_block=True)]
    calls.append(b.launch(f"tr_sce_bwd_{dt}", rows,
                          [b.buf(x), b.buf(labels), b.buf(weights), b.buf(gloss), denom,
                           b.buf(gx, True), _i64(rows), _i64(c), _i64(ld)] + common
                          + [_int(reduction)]))
    return calls


def bind_cudnn(b: _Binder, node: ir.Node, index: int, activation=None) -> list:
    try:
        desc = describe_node(node, b.memory, activation)
    except CudnnGraphError as e:
        raise _Unbound(str(e).split(": ", 1)[-1]) from None
    build = getattr(b.device, "build_cudnn", None)
    graph = build(desc) if build is not None else desc
    pointers = {port: b.base + t.byte_offset for port, t in desc.tensors().items()
                if not t.virtual}
    calls = [CudnnCall(desc, graph, pointers, b.workspace[0])]
    if desc.kind == "batchnorm" and desc.notes:
        calls += _bn_running(b, node)
    return calls


def _bn_running(b: _Binder, node: ir.Node) -> list:
    """ONNX's running statistics (biased variance) after cuDNN's batchnorm, from x and the
    batch mean cuDNN saved."""
    outs = node.outputs
    if not any(i < len(outs) and outs[i] is not None for i in (3, 4)):
        return []
    if any(i >= len(outs) or outs[i] is None for i in (1, 3, 4)):
        raise _Unbound("running statistics need the saved mean and both running outputs")
    x = node.inputs[0]
    gx = geometry(b.t(x))
    if gx is None or gx.kind != "channels_last":
        raise _Unbound("the running-statistics kernel reads a channels-last x")
    for v in (node.inputs[3], node.inputs[4], outs[1], outs[3], outs[4]):
        if b.t(v).dtype != np.float32:
            raise _Unbound(f"{v.name!r} must be float32")
    momentum = float(node.attrs.get("momentum", 0.9))
    return [b.launch(f"tr_bn_running_{b.dt(x)}", gx.c,
                     [b.buf(x), b.buf(outs[1]), b.buf(node.inputs[3]), b.buf(node.inputs[4]),
                      b.buf(outs[3], True), b.buf(outs[4], True), _i64(gx.n // gx.cp),
                      _i64(gx.c), _i64(gx.cp), _f32(momentum), _f32(1.0 - momentum),
                      _f32(1.0 - momentum)])]


def bind_cast(b: _Binder, node: ir.Node, index: int) -> list:
    """Cast between float storage types in one layout (``convert.cu``): the float16 copy of a
    float32 BatchNorm parameter gradient in a half-precision plan."""
    x, y = node.inputs[0], node.outputs[0]
    pair = (b.dt(x), b.dt(y))
    if pair not in sources.CONVERT_PAIRS:
        raise _Unbound(f"Cast {pair[0]} -> {pair[1]}: the conversion kernels are "
                       f"{', '.join(f'{s}->{d}' for s, d in sources.CONVERT_PAIRS)}")
    gy = _out_geometry(b, y)
    if _spec(b.t(x), geometry(b.t(x)), gy) != gy.n:
        raise _Unbound("input and output in different layouts")
    return [b.launch(f"tr_convert_{pair[0]}_{pair[1]}", gy.n,
                     [b.buf(x), b.buf(y, True), _i64(gy.n)])]


def bind_batch_norm_inference(b: _Binder, node: ir.Node, index: int) -> list:
    """BatchNormalization with fixed statistics (inference; training mode is the training
    pass's BatchNormTraining, a cuDNN graph)."""
    outs = [v for v in node.outputs[1:] if v is not None]
    if outs or int(node.attrs.get("training_mode", 0)):
        raise _Unbound("training-mode BatchNormalization outside a training plan")
    x, y = node.inputs[0], node.outputs[0]
    gx, gy = geometry(b.t(x)), _out_geometry(b, y)
    if gx is None or _spec(b.t(x), gx, gy) != gy.n:
        raise _Unbound("input and output in different layouts")
    if gy.kind == "channels_last" and b.t(y).layout.kind == "channels_last":
        c, ld = gy.c, gy.cp
    elif gy.kind == "flat" and len(gy.shape) == 2:
        c = ld = gy.shape[1]
    else:
        raise _Unbound(f"a {b.t(x).layout.describe()} rank-{len(gy.shape)} input; channels-last "
                       "feature maps and [N, C] are bound")
    params = node.inputs[1:5]
    if any(b.t(v).dtype != np.float32 for v in params):
        raise _Unbound("scale, bias, mean and var must be float32")
    return [b.launch(f"tr_bn_infer_{b.dt(x)}", gy.n,
                     [b.buf(x)] + [b.buf(v) for v in params] + [
                         b.buf(y, True), _i64(gy.n), _i64(c), _i64(ld),
                         _f32(float(node.attrs.get("epsilon", 1e-5)))])]


def bind_plugin(b: _Binder, node: ir.Node, index: int) -> list:
    """A plugin op's ``CudaKernel``: ``elementwise`` / ``bias_last_axis`` launches."""
    kernel = node.opdef.kernels["cuda"]
    ins = [v for v in node.inputs if v is not None]
    outs = [v for v in node.outputs if v is not None]
    out = _out_geometry(b, outs[0])
    dt = b.dt(outs[0])
    if dt not in ("f32", "f16"):
        raise _Unbound(f"plugin kernels have _f32 and _f16 entry points, not _{dt}")
    same = [v for v in ins + outs if _spec(b.t(v), geometry(b.t(v)), out) == out.n]
    extra: list = []
    if kernel.launch == "elementwise":
        if len(same) != len(ins) + len(outs):
            raise _Unbound("a plugin elementwise kernel needs every operand in one layout")
    elif kernel.launch == "bias_last_axis":
        if out.kind != "flat" or len(same) != len(ins) + len(outs) - 1:
            raise _Unbound("bias_last_axis kernels take compact operands and one bias")
        extra = [_i64(math.prod(b.t(ins[1]).shape))]
    else:
        raise _Unbound(f"launch {kernel.launch!r} is not one the executor knows")
    family = f"plugin:{node.domain or 'ai.onnx'}/{node.op_type}"
    ref = KernelRef(family, f"{kernel.function}_{dt}", kernel.source)
    prepare = getattr(b.device, "prepare_kernel", None)
    if prepare is not None:
        prepare(ref)
    grid, block = launch_dims(out.n)
    args = [b.buf(v) for v in ins] + [b.buf(v, True) for v in outs] + [_i64(out.n)] + extra + [
        _f32(float(node.attrs.get(k, 0.0))) for k in kernel.scalar_attrs]
    calls: list = [Launch(ref, grid, block, tuple(args))]
    if out.padded:
        calls += [b.zero_lanes(v, out) for v in outs]
    return calls


BINDERS: dict[tuple[str, str], Callable] = {
    **{("", op): bind_binary for op in BINARY},
    **{("", op): bind_unary for op in sources.ONNX_UNARY},
    **{("", op): bind_copy for op in COPY_OPS},
    **{("", op): bind_compare for op in COMPARE},
    ("", "Where"): bind_where,
    ("", "Expand"): bind_expand,
    ("", "GlobalAveragePool"): bind_global_average_pool,
    ("", "BatchNormalization"): bind_batch_norm_inference,
    ("", "Cast"): bind_cast,
    ("", "ReduceSum"): bind_reduce_sum,
    ("", "SoftmaxCrossEntropyLoss"): bind_sce,
    (INTERNAL, "SoftmaxCrossEntropyLossGrad"): bind_sce_grad,
    (INTERNAL, "LayoutTranspose"): bind_layout_transpose,
    (INTERNAL, "Accumulate"): bind_accumulate,
    (INTERNAL, "Assign"): bind_assign,
    (INTERNAL, "ZeroFill"): bind_zero_fill,
    (INTERNAL, "ScaleClipGrad"): bind_scale_clip_grad,
    **{(INTERNAL, op): bind_optimizer for op in OPTIMIZERS},
    **{key: bind_cudnn for key in CUDNN_OPS},
}
"""(domain, op_type) -> binder(binder_ctx, node, schedule index) -> prepared calls."""


# -- pools, row normalisations, data movement (kernels/pool_norm.cu) ---------------------------

MAX_DIMS = 6  # the collapsed rank the strided kernels take


def _compact(b: _Binder, v: ir.Value) -> bool:
    """Elements in logical row-major order (plain, or a 1-D vector read up to its length)."""
    g = geometry(b.t(v))
    return g is not None and g.kind == "flat"


def _need_compact(b: _Binder, *vs) -> None:
    for v in vs:
        if v is not None and not _compact(b, v):
            raise _Unbound(f"{v.name!r} is {b.t(v).layout.describe()}; this kernel reads "
                           "compact (row-major) tensors")


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return strides[::-1]


def _collapse(dims, stride_sets) -> tuple[list[int], list[list[int]]]:
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
        raise _Unbound(f"{len(dims)} axes after collapsing; the strided kernels take "
                       f"{MAX_DIMS}")
    pad = MAX_DIMS - len(dims)
    return [1] * pad + dims, [[0] * pad + s for s in sets]


def _logical_strides(b: _Binder, v: ir.Value) -> list[int]:
    """Element strides of ``v``'s logical axes in its physical layout: row-major for a compact
    tensor, ``[N, *S, Cp]`` order for a channels-last one."""
    t = b.t(v)
    g = geometry(t)
    if g is not None and g.kind == "flat":
        return _contiguous_strides(t.shape)
    if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last":
        phys = _contiguous_strides(t.layout.phys_shape)  # [N, *S, Cp]
        return [phys[0], phys[-1], *phys[1:-1]]
    raise _Unbound(f"{v.name!r} is {t.layout.describe()}; the strided kernels read compact or "
                   "channels-last tensors")


def _pads_after(b: _Binder, y: ir.Value) -> list:
    g = geometry(b.t(y))
    return [b.zero_lanes(y, g)] if g is not None and g.padded else []


def _move_kernel(b: _Binder, v: ir.Value) -> str:
    size = b.t(v).dtype.itemsize
    if size not in (1, 2, 4, 8):
        raise _Unbound(f"elements of {size} bytes")
    return f"b{size}"


def _strided_copy(b: _Binder, x: ir.Value, y: ir.Value, dims, xs, ys, xo: int = 0,
                  yo: int = 0) -> Launch:
    d, (sx, sy) = _collapse(dims, [xs, ys])
    n = math.prod(d)
    return b.launch(f"tr_strided_copy_{_move_kernel(b, y)}", n,
                    [b.buf(x), b.buf(y, True), _i64(n), _i64(xo), _i64(yo)]
                    + [_i64(v) for v in d + sx + sy])


def _pool_geometry(b: _Binder, node: ir.Node, x: ir.Value, y: ir.Value):
    """(window scalars as kernel args, (lo_h, hi_h, lo_w, hi_w) for count_include_pad on
    and off, x's and y's channels-last geometry): x the tensor the windows slide over, y the
    pooled one."""
    from ...ops.conv import Window

    tx, ty = b.t(x), b.t(y)
    gx, gy = geometry(tx), geometry(ty)
    for t, g in ((tx, gx), (ty, gy)):
        if g is None or g.kind != "channels_last" or t.layout.kind != "channels_last" or \
                t.layout.phys_shape[0] != t.shape[0]:
            raise _Unbound(f"{t.name!r} is {t.layout.describe()}; the pool kernels read "
                           "channels-last feature maps")
    spatial = tuple(tx.shape[2:])
    if len(spatial) not in (1, 2):
        raise _Unbound(f"a {len(spatial)}-D pool; the kernels pool 1-D and 2-D windows")
    attrs = {**node.attrs, "auto_pad": node.attrs.get("auto_pad", "NOTSET")}
    try:
        win = Window.resolve(attrs, spatial, node.attrs["kernel_shape"],
                             bool(node.attrs.get("ceil_mode", 0)))
    except ValueError as e:
        raise _Unbound(str(e)) from None
    if tuple(win.out_shape) != tuple(ty.shape[2:]):
        raise _Unbound(f"window output {list(win.out_shape)} != {list(ty.shape[2:])}")
    one = len(spatial) == 1
    H, W = (1, spatial[0]) if one else spatial
    OH, OW = (1, win.out_shape[0]) if one else win.out_shape
    kh, kw = (1, win.kernel[0]) if one else win.kernel
    sh, sw = (1, win.strides[0]) if one else win.strides
    ph, pw = (0, win.pads_begin[0]) if one else win.pads_begin
    pe_h, pe_w = (0, win.pads_end[0]) if one else win.pads_end
    dh, dw = (1, win.dilations[0]) if one else win.dilations
    window = [H, W, OH, OW, tx.shape[1], gx.cp, gy.cp, kh, kw, sh, sw, ph, pw, dh, dw]
    include = [-ph, H + pe_h, -pw, W + pe_w]
    exclude = [0, H, 0, W]
    return window, include, exclude, gx, gy


def _float_dt(b: _Binder, *vs) -> str:
    dts = {b.dt(v) for v in vs if v is not None}
    if len(dts) != 1:
        raise _Unbound("operands of different dtypes")
    return dts.pop()


def bind_max_pool(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    if len(node.outputs) > 1 and node.outputs[1] is not None:
        raise _Unbound("the Indices output has no kernel")
    window, _, _, _, gy = _pool_geometry(b, node, x, y)
    dt = _float_dt(b, x, y)
    return [b.launch(f"tr_maxpool_fwd_{dt}", gy.n,
                     [b.buf(x), b.buf(y, True), _i64(gy.n)] + [_i64(v) for v in window])]


def bind_max_pool_grad(b: _Binder, node: ir.Node, index: int) -> list:
    gy, x = node.inputs[0], node.inputs[1]
    gx = node.outputs[0]
    window, _, _, g_x, g_y = _pool_geometry(b, node, x, gy)
    if geometry(b.t(gx)) != g_x:
        raise _Unbound("gx and x in different layouts")
    dt = _float_dt(b, gy, x, gx)
    return [b.launch(f"tr_maxpool_bwd_{dt}", g_x.n,
                     [b.buf(gy), b.buf(x), b.buf(gx, True), _i64(g_x.n)]
                     + [_i64(v) for v in window])]


def bind_average_pool(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    window, include, exclude, _, gy = _pool_geometry(b, node, x, y)
    bounds = include if int(node.attrs.get("count_include_pad", 0)) else exclude
    dt = _float_dt(b, x, y)
    return [b.launch(f"tr_avgpool_fwd_{dt}", gy.n,
                     [b.buf(x), b.buf(y, True), _i64(gy.n)]
                     + [_i64(v) for v in window + bounds])]


def bind_average_pool_grad(b: _Binder, node: ir.Node, index: int) -> list:
    gy, gx = node.inputs[0], node.outputs[0]
    window, include, exclude, g_x, _ = _pool_geometry(b, node, gx, gy)
    bounds = include if int(node.attrs.get("count_include_pad", 0)) else exclude
    dt = _float_dt(b, gy, gx)
    return [b.launch(f"tr_avgpool_bwd_{dt}", g_x.n,
                     [b.buf(gy), b.buf(gx, True), _i64(g_x.n)]
                     + [_i64(v) for v in window + bounds])]


def _row_split(node: ir.Node, shape, softmax: bool) -> tuple[int, int]:
    """(rows, row length) of a softmax / layer norm over the trailing axes from ``axis``."""
    rank = len(shape)
    axis = int(node.attrs.get("axis", -1 if softmax else -1)) % max(rank, 1)
    if softmax and node.since_version >= 13 and axis != rank - 1:
        raise _Unbound(f"softmax over axis {axis} of a rank-{rank} tensor; the row kernel "
                       "takes the last axis")
    return math.prod(shape[:axis]), math.prod(shape[axis:])


def bind_softmax(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    _need_compact(b, x, y)
    rows, c = _row_split(node, b.t(x).shape, True)
    dt = _float_dt(b, x, y)
    return [b.launch(f"tr_softmax_{dt}", rows,
                     [b.buf(x), b.buf(y, True), _i64(rows), _i64(c), _i64(c),
                      _int(node.op_type == "LogSoftmax")])]


def bind_layer_norm(b: _Binder, node: ir.Node, index: int) -> list:
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    outs = list(node.outputs) + [None, None]
    y, mean, inv = outs[0], outs[1], outs[2]
    _need_compact(b, x, scale, bias, y, mean, inv)
    rows, m = _row_split(node, b.t(x).shape, False)
    for v in (scale, bias):
        if v is not None and math.prod(b.t(v).shape) != m:
            raise _Unbound("a scale or bias that broadcasts over the normalised axes")
    for v in (mean, inv):
        if v is not None and b.t(v).dtype != np.float32:
            raise _Unbound("Mean / InvStdDev outputs must be float32")
    dt = _float_dt(b, x, scale, bias, y)
    return [b.launch(f"tr_layernorm_fwd_{dt}", rows,
                     [b.buf(x), b.buf(scale), b.buf(bias), b.buf(y, True), b.buf(mean, True),
                      b.buf(inv, True), _i64(rows), _i64(m),
                      _f32(float(node.attrs.get("epsilon", 1e-5)))])]


def bind_layer_norm_grad(b: _Binder, node: ir.Node, index: int) -> list:
    gy, x, scale = node.inputs[:3]
    outs = list(node.outputs) + [None, None]
    gx, gscale, gbias = outs[0], outs[1], outs[2]
    _need_compact(b, gy, x, scale, gx, gscale, gbias)
    shape = b.t(x).shape
    axis = int(node.attrs["axis"]) % len(shape)
    rows, m = math.prod(shape[:axis]), math.prod(shape[axis:])
    dt = _float_dt(b, gy, x, scale, gx, gscale, gbias)
    mean = b.ws(index, 3, 4 * rows, "the rows' means")
    inv = b.ws(index, 4, 4 * rows, "the rows' inverse deviations")
    calls = [b.launch(f"tr_layernorm_bwd_dx_{dt}", rows,
                      [b.buf(gy), b.buf(x), b.buf(scale), b.buf(gx, True), mean, inv,
                       _i64(rows), _i64(m), _f32(float(node.attrs["epsilon"]))])]
    if gscale is not None or gbias is not None:
        calls.append(b.launch(f"tr_layernorm_bwd_params_{dt}", m,
                              [b.buf(gy), b.buf(x), DeviceBuffer(mean.ptr, mean.nbytes, False,
                                                                 mean.name),
                               DeviceBuffer(inv.ptr, inv.nbytes, False, inv.name),
                               b.buf(gscale, True), b.buf(gbias, True), _i64(rows), _i64(m)]))
    return calls


def bind_erf(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    gx, gy = geometry(b.t(x)), _out_geometry(b, y)
    if gx is None or _spec(b.t(x), gx, gy) != gy.n:
        raise _Unbound(f"input {x.name!r} and output {y.name!r} are in different layouts")
    dt = _float_dt(b, x, y)  # erf(+0) = +0: padded lanes stay zero
    return [b.launch(f"tr_erf_{dt}", gy.n,
                     [b.buf(x), b.buf(y, True), _i64(gy.n)])]


def bind_reduce_run(b: _Binder, node: ir.Node, index: int) -> list:
    """ReduceSum / ReduceMean over one run of consecutive axes of a compact tensor:
    ``[outer, r, inner]`` -> ``[outer, inner]``."""
    x, y = node.inputs[0], node.outputs[0]
    if node.op_type == "ReduceSum":
        try:
            return bind_reduce_sum(b, node, index)
        except _Unbound:
            pass
    _need_compact(b, x, y)
    shape = b.t(x).shape
    axes = _reduce_axes(node, len(shape))
    if axes is None:
        raise _Unbound("axes computed at run time")
    dt = _float_dt(b, x, y)
    if not axes:
        return [Copy(b.buf(y, True), DeviceBuffer(b.base + b.t(x).offset, b.t(y).nbytes, False,
                                                  b.t(x).name))]
    if axes != list(range(axes[0], axes[-1] + 1)):
        raise _Unbound(f"axes {axes} are not one run of consecutive axes")
    outer = math.prod(shape[:axes[0]])
    r = math.prod(shape[axes[0]:axes[-1] + 1])
    inner = math.prod(shape[axes[-1] + 1:])
    return [b.launch(f"tr_reduce_mid_{dt}", outer * inner,
                     [b.buf(x), b.buf(y, True), _i64(outer), _i64(r), _i64(inner),
                      _int(node.op_type == "ReduceMean")])]


def bind_matmul(b: _Binder, node: ir.Node, index: int) -> list:
    """A cuDNN matmul graph where one describes the node; else the batched kernel (batch dims
    equal, or one operand's all 1)."""
    try:
        return bind_cudnn(b, node, index)
    except _Unbound as e:
        why = str(e)
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    _need_compact(b, a, c, y)
    sa, sc, sy = b.t(a).shape, b.t(c).shape, b.t(y).shape
    if len(sa) < 2 or len(sc) < 2:
        raise _Unbound(f"{why}; the batched kernel takes operands of rank >= 2")
    M, K, N = sa[-2], sa[-1], sc[-1]
    batch = math.prod(sy[:-2])
    strides = []
    for shape in (sa, sc):
        lead = tuple(shape[:-2])
        full = (1,) * (len(sy) - 2 - len(lead)) + lead
        if math.prod(lead) == 1:
            strides.append(0)
        elif full == tuple(sy[:-2]):
            strides.append(shape[-2] * shape[-1])
        else:
            raise _Unbound(f"{why}; batch dims {list(lead)} broadcast partly against "
                           f"{list(sy[:-2])}")
    dt = _float_dt(b, a, c, y)
    return [b.launch(f"tr_matmul_{dt}", batch * M * N,
                     [b.buf(a), b.buf(c), b.buf(y, True), _i64(batch), _i64(M), _i64(K),
                      _i64(N), _i64(strides[0]), _i64(K), _i64(1), _i64(strides[1]), _i64(N),
                      _i64(1)])]


BCAST_OPS = {"Add": 0, "Sum": 0, "Sub": 1, "Mul": 2, "Div": 3}


def bind_binary_any(b: _Binder, node: ir.Node, index: int) -> list:
    """``bind_binary``; where its operand specs cannot express the broadcast (compact
    tensors), the general strided one."""
    try:
        return bind_binary(b, node, index)
    except _Unbound as e:
        why = str(e)
    ins = [v for v in node.inputs if v is not None]
    y = node.outputs[0]
    if len(ins) < 2:
        raise _Unbound(why)
    try:
        _need_compact(b, *ins, y)
    except _Unbound as e:
        raise _Unbound(f"{why}; {e}") from None
    dt = _float_dt(b, *ins, y)
    shape = tuple(b.t(y).shape)
    rank = len(shape)
    calls, acc = [], ins[0]
    for other in ins[1:]:
        sets = []
        for v in (acc, other):
            s = tuple(b.t(v).shape)
            s = (1,) * (rank - len(s)) + s
            st = _contiguous_strides(s)
            sets.append([0 if s[k] == 1 and shape[k] != 1 else st[k] for k in range(rank)])
        d, (sa, sb, _) = _collapse(shape, sets + [_contiguous_strides(shape)])
        n = math.prod(shape)
        calls.append(b.launch(f"tr_bcast_binary_{dt}", n,
                              [b.buf(acc), b.buf(other), b.buf(y, True), _i64(n),
                               _int(BCAST_OPS[node.op_type])] + [_i64(v) for v in d + sa + sb]))
        acc = y
    return calls


def bind_transpose(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    perm = [int(p) for p in node.attrs.get("perm") or reversed(range(len(shape)))]
    xs = _logical_strides(b, x)
    out = tuple(b.t(y).shape)
    return [_strided_copy(b, x, y, out, [xs[p] for p in perm], _logical_strides(b, y))] + \
        _pads_after(b, y)


def bind_gather(b: _Binder, node: ir.Node, index: int) -> list:
    x, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
    _need_compact(b, x, idx, y)
    if b.t(idx).dtype != np.int64:
        raise _Unbound("indices must be int64")
    shape = b.t(x).shape
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    n, nidx = math.prod(b.t(y).shape), math.prod(b.t(idx).shape)
    return [b.launch(f"tr_gather_{_move_kernel(b, y)}", n,
                     [b.buf(x), b.buf(idx), b.buf(y, True), _i64(n), _i64(nidx),
                      _i64(shape[axis]), _i64(math.prod(shape[axis + 1:]))])]


def bind_gather_grad(b: _Binder, node: ir.Node, index: int) -> list:
    gy, idx, gx = node.inputs[0], node.inputs[1], node.outputs[0]
    _need_compact(b, gy, idx, gx)
    if b.t(idx).dtype != np.int64:
        raise _Unbound("indices must be int64")
    shape = b.t(gx).shape
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    n, nidx = math.prod(shape), math.prod(b.t(idx).shape)
    dt = _float_dt(b, gy, gx)
    return [b.launch(f"tr_gather_grad_{dt}", n,
                     [b.buf(gy), b.buf(idx), b.buf(gx, True), _i64(n), _i64(nidx),
                      _i64(shape[axis]), _i64(math.prod(shape[axis + 1:]))])]


def _const_ints(v: ir.Value | None, what: str) -> list[int] | None:
    if v is None:
        return None
    if v.data is None:
        raise _Unbound(f"{what} computed at run time")
    return [int(a) for a in np.asarray(v.data).reshape(-1)]


def bind_slice(b: _Binder, node: ir.Node, index: int) -> list:
    x, y = node.inputs[0], node.outputs[0]
    shape = tuple(b.t(x).shape)
    rank = len(shape)
    if node.since_version < 10:
        starts, ends = node.attrs["starts"], node.attrs["ends"]
        axes, steps = node.attrs.get("axes"), None
    else:
        ins = list(node.inputs) + [None] * 5
        starts, ends = _const_ints(ins[1], "starts"), _const_ints(ins[2], "ends")
        axes, steps = _const_ints(ins[3], "axes"), _const_ints(ins[4], "steps")
    axes = [int(a) % rank for a in (axes if axes is not None else range(len(starts)))]
    steps = steps or [1] * len(axes)
    begin, step, count = [0] * rank, [1] * rank, list(shape)
    for a, s, e, st in zip(axes, starts, ends, steps):
        r = range(*slice(int(s), int(e), int(st)).indices(shape[a]))
        begin[a], step[a], count[a] = r.start, r.step, len(r)
    if tuple(count) != tuple(b.t(y).shape):
        raise _Unbound(f"slice gives {count}, the output is {list(b.t(y).shape)}")
    xs = _logical_strides(b, x)
    xo = sum(bg * s for bg, s in zip(begin, xs))
    return [_strided_copy(b, x, y, count, [st * s for st, s in zip(step, xs)],
                          _logical_strides(b, y), xo=xo)] + _pads_after(b, y)


def bind_concat(b: _Binder, node: ir.Node, index: int) -> list:
    y = node.outputs[0]
    ins = [v for v in node.inputs if v is not None]
    out = tuple(b.t(y).shape)
    axis = int(node.attrs.get("axis", 1)) % len(out)
    ys = _logical_strides(b, y)
    calls, at = [], 0
    for v in ins:
        shape = tuple(b.t(v).shape)
        if math.prod(shape):
            calls.append(_strided_copy(b, v, y, shape, _logical_strides(b, v), ys,
                                       yo=at * ys[axis]))
        at += shape[axis]
    return calls + _pads_after(b, y)


BINDERS.update({
    ("", "MaxPool"): bind_max_pool,
    (INTERNAL, "MaxPoolGrad"): bind_max_pool_grad,
    ("", "AveragePool"): bind_average_pool,
    (INTERNAL, "AveragePoolGrad"): bind_average_pool_grad,
    ("", "Softmax"): bind_softmax,
    ("", "LogSoftmax"): bind_softmax,
    ("", "LayerNormalization"): bind_layer_norm,
    (INTERNAL, "LayerNormGrad"): bind_layer_norm_grad,
    ("", "Erf"): bind_erf,
    ("", "ReduceSum"): bind_reduce_run,
    ("", "ReduceMean"): bind_reduce_run,
    ("", "MatMul"): bind_matmul,
    **{("", op): bind_binary_any for op in BINARY},
    ("", "Transpose"): bind_transpose,
    ("", "Gather"): bind_gather,
    (INTERNAL, "GatherGrad"): bind_gather_grad,
    ("", "Slice"): bind_slice,
    ("", "Concat"): bind_concat,
})


def _key(node: ir.Node) -> tuple[str, str]:
    return ("" if node.domain in ("", "ai.onnx") else node.domain, node.op_type)


def _is_alias(node: ir.Node) -> bool:
    return bool(node.outputs) and node.outputs[0] is not None and \
        node.outputs[0].alias_of is not None


# --------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------

class CudaExecutor(HostTransfers):
    """Binds ``plan`` (a ``compiler.CompiledPlan``) to ``device`` and runs its phases.

    ``device`` implements ``capture.DeviceAPI`` (``CupyDevice`` on a GPU, a recorder in the
    tests); optional device methods the executor uses when present: ``prepare_kernel``,
    ``build_cudnn``, ``pinned_buffers``/``record_host_buffer``/``wait_host_buffer``,
    ``launch_graph`` and an ``allocation_guard`` factory for capture. A fresh device arena
    is zero: call ``load_constants()`` once before the first step.
    """

    def __init__(self, plan, device, cuda_graphs: str = "fallback"):
        self.plan, self.device = plan, device
        self.memory: MemoryPlan = plan.memory
        self.cuda_graphs = check_cuda_graphs(cuda_graphs)
        nodes = list(plan.graph.nodes)
        if len(nodes) != self.memory.schedule_length:
            raise UnsupportedModelError(f"the plan's graph has {len(nodes)} nodes but its "
                                        f"MemoryPlan was made for {self.memory.schedule_length}",
                                        [])
        self._b = _Binder(plan, device)
        self.bound: list[BoundNode] = self._bind(nodes)
        self.phases: dict[str, list[BoundNode]] = {}
        for bn in self.bound:
            self.phases.setdefault(bn.phase, []).append(bn)
        if self._b.bad is not None and self._b.workspace[1] >= REPORT_BYTES:
            try:
                self.phases.update(self._guard_phases())
            except _Unbound as e:
                raise UnsupportedModelError(f"the cuda step guard: {e}", []) from None
        self.graphs: dict[str, Any] = {}
        self.eager_phases: set[str] = set()
        self._runs: dict[str, int] = {}
        self._first_phase = "forward" if "forward" in self.phases else "compute"
        self._init_transfers()

    # -- binding -----------------------------------------------------------------------------
    def _bind(self, nodes: list[ir.Node]) -> list[BoundNode]:
        missing: dict[tuple[str, str, int], list[str]] = {}
        reasons: dict[str, str] = {}
        bound: list[BoundNode] = []
        fused: dict[int, str] = {}
        for index, node in enumerate(nodes):
            if _is_alias(node):
                continue
            if id(node) in fused:
                bound.append(BoundNode(node, [], fused[id(node)]))
                continue
            try:
                calls = self._bind_node(node, index, fused)
            except _Unbound as e:
                key = (node.domain if node.domain != "ai.onnx" else "", node.op_type,
                       node.since_version)
                missing.setdefault(key, []).append(node.name)
                reasons[node.label] = str(e)
                continue
            bound.append(BoundNode(node, calls))
        if missing:
            raise CudaUnsupported([(d, o, v, n) for (d, o, v), n in missing.items()], reasons)
        return bound

    def _bind_node(self, node: ir.Node, index: int, fused: dict[int, str]) -> list:
        opdef_kernels = getattr(node.opdef, "kernels", {}) or {}
        if "cuda" in opdef_kernels and not callable(opdef_kernels["cuda"]):
            return bind_plugin(self._b, node, index)
        binder = BINDERS.get(_key(node))
        if binder is None:
            raise _Unbound("no cuda kernel or cuDNN graph for this op")
        if _key(node) == ("", "Conv") and node.phase == "forward":
            activation = fusable_activation(node, self.plan.graph)
            if activation is not None:
                fused[id(activation[0])] = node.label
                return bind_cudnn(self._b, node, index, activation)
        return binder(self._b, node, index)

    def _guard_phases(self) -> dict[str, list[BoundNode]]:
        """The step guard's work, as three pseudo-phases ``run_step`` puts around the plan's
        own (``amp.cu``): ``guard`` after ``compute`` (clear ``__bad_batch``, set it when the
        loss -- without loss scaling, also a gradient -- is not finite; with loss scaling clear
        its overflow flag and set it for a bad batch, so the update skips itself and the scale
        backs off, as GradScaler's check of the then non-finite gradients does), ``discard``
        after ``commit`` (zero the GRAD span of a bad batch, dropping the micro-batches
        accumulated since the last step) and ``report`` last (loss, flags and gradient norm
        into the first 16 bytes of WORKSPACE, for one small read-back)."""
        b, info = self._b, self.plan.info
        bad = b.named_scalar(BAD_BATCH, np.float32)
        loss = b.named_scalar(info.loss, np.float32, writes=False)
        grads = b.tensors["__grads"]
        found = next((bn.node.attrs["loss_scale"]["found_inf"] for bn in self.bound
                      if bn.node.attrs.get("loss_scale")), None)
        clear = [bad, _i64(1), _i64(0), _i64(1)]
        guard = [b.launch("tr_zero_lanes_b4", 1, clear),
                 b.launch("tr_unscale_check_f32", 1, [loss, _i64(1), None, bad])]
        if found is None:
            n = math.prod(grads.shape)
            guard.append(b.launch(f"tr_unscale_check_{DT[grads.dtype.name]}", n, [
                DeviceBuffer(b.base + grads.offset, grads.nbytes, False, grads.name), _i64(n),
                None, bad]))
        reject = b.named_scalar(REJECT, np.float32)
        update = next(bn.node for bn in self.bound if bn.node.op_type in OPTIMIZERS)
        guard.append(b.launch("tr_step_check", 1, [
            b.named_scalar(update.inputs[-1].name, np.int64, writes=False),  # the step number
            b.named_scalar(APPLIED, np.int64, writes=False), reject, bad], single_block=True))
        if found is not None:
            flag = b.named_scalar(found, np.float32)
            guard += [b.launch("tr_zero_lanes_b4", 1, [flag, _i64(1), _i64(0), _i64(1)]),
                      b.launch("tr_flag_or", 1, [flag, bad], single_block=True)]
        if grads.nbytes % 4:
            raise _Unbound(f"the GRAD span is {grads.nbytes} bytes, not whole 4-byte words")
        words = grads.nbytes // 4
        discard = [b.launch("tr_zero_if_b4", words, [
            DeviceBuffer(b.base + grads.offset, grads.nbytes, True, grads.name), _i64(words),
            b.named_scalar(BAD_BATCH, np.float32, writes=False)])]
        ws_ptr, _ = b.workspace
        report = [b.launch("tr_step_report", 1, [
            loss, b.named_scalar(BAD_BATCH, np.float32, writes=False),
            None if found is None else b.named_scalar(found, np.float32, writes=False),
            b.named_scalar(info.grad_norm, np.float32, writes=False),
            b.named_scalar(REJECT, np.float32, writes=False),
            DeviceBuffer(ws_ptr, REPORT_BYTES, True)], single_block=True)]

        def pseudo(name: str, phase: str, calls: list) -> list[BoundNode]:
            return [BoundNode(ir.Node(f"<{name}>", name, INTERNAL, 1, [], [], phase=phase),
                              calls)]

        return {"guard": pseudo("step guard", "guard", guard),
                "discard": pseudo("discard a bad batch", "guard", discard),
                "report": pseudo("step report", "report", report)}

    # -- the step ----------------------------------------------------------------------------
    def steps(self, phase: str) -> list[CaptureStep]:
        return [CaptureStep(bn.label, bn.phase, bn.run)
                for p in phase.split("+") for bn in self.phases.get(p, [])]

    def run(self, phase: str | None = None) -> None:
        """Run ``phase`` (default: the plan's only or first phase; ``"a+b"``: phases ``a``
        and ``b`` as one): eagerly the first time, captured into one graph the second,
        replayed after."""
        phase = phase or self._first_phase
        if not any(p in self.phases for p in phase.split("+")):
            return
        count = self._runs.get(phase, 0)
        self._runs[phase] = count + 1
        if phase.split("+")[0] == self._first_phase:
            self._flip_host_buffers()
        if count == 0 or phase in self.eager_phases or self.cuda_graphs == "off":
            self._run_eager(phase)
            return
        graph = self.graphs.get(phase)
        if graph is None:
            guard = getattr(self.device, "allocation_guard", None)
            try:
                graph = capture_step(self.steps(phase), self.device, warmup=0,
                                     allocation_guard=guard)
            except CaptureError as e:
                if self.cuda_graphs == "require":
                    raise type(e)(e.node, e.reason + " (cuda_graphs='fallback' runs this step "
                                  "eagerly instead)", False) from e
                warnings.warn(str(e), RuntimeWarning, stacklevel=2)
                self.eager_phases.add(phase)
                self._run_eager(phase)
                return
            self.graphs[phase] = graph
        self.device.launch_graph(graph)

    def _run_eager(self, phase: str) -> None:
        for step in self.steps(phase):
            self.device.begin_node(step.label, step.phase)
            step.run(self.device)

    @staticmethod
    def step_phases(apply: bool = True) -> str:
        """The ``run`` key of a guarded training step: one graph of all its phases."""
        return "+".join(("compute", "guard", "commit", "discard")
                        + (("apply",) if apply else ()) + ("report",))

    @property
    def can_launch_steps(self) -> bool:
        """Whether ``launch_step`` / ``finish_step`` work (a plan with the step guard)."""
        return "guard" in self.phases

    def run_step(self, loss: str, grad_norm: str, apply: bool,
                 found_inf: str | None = None) -> StepReport:
        """A training step as one CUDA graph (``ExecutorAPI.run_step``): ``launch_step`` then
        ``finish_step``. A plan without the step guard takes the host-decided path."""
        if not self.can_launch_steps:
            return super().run_step(loss, grad_norm, apply, found_inf)
        return self.finish_step(self.launch_step(apply), apply)

    def launch_step(self, apply: bool, outputs: Sequence[str] = ()) -> int:
        """Launch a training step without waiting for it: compute, the step guard, commit,
        discard, apply (when ``apply``) and the report, captured together (one graph per
        ``apply`` value) and launched once, then its report and the model ``outputs`` asked
        for (those a plain copy reads, ``step_outputs``) copied (async) into the pinned buffer
        this step's batch came up through, behind that buffer's event. Returns the token
        ``finish_step`` takes (the buffer's index)."""
        self.run(self.step_phases(apply))
        k = 1 - self._k  # run() flipped to the other buffer for the next step's uploads
        self.device.begin_node("<step report>", "download")
        self.device.memcpy_async(self._host[k][self._report:self._report + REPORT_BYTES],
                                 DeviceBuffer(self._b.workspace[0], REPORT_BYTES, False),
                                 REPORT_BYTES, "d2h")
        for name in outputs:
            t, off = self.memory.tensors[name], self._outputs[name]
            self.device.memcpy_async(self._host[k][off:off + t.nbytes], DeviceBuffer(
                self._b.base + t.offset, t.nbytes, False, t.name), t.nbytes, "d2h")
        record = getattr(self.device, "record_host_buffer", None)
        if record is not None:
            record(k)
        return k

    @property
    def step_outputs(self) -> frozenset[str]:
        """The model outputs ``launch_step`` can read back with the step."""
        return frozenset(self._outputs)

    def step_output(self, token: int, name: str) -> np.ndarray:
        """A copy of output ``name`` as ``launch_step(..., outputs=[name])`` read it back
        (call after ``finish_step(token, ...)``)."""
        t, off = self.memory.tensors[name], self._outputs[name]
        return np.ndarray(t.shape, t.dtype, self._host[token], off).copy()

    def finish_step(self, token: int, apply: bool) -> StepReport:
        """Wait for the step ``launch_step`` returned ``token`` for (its buffer's event: the
        step and its report copy) and read its report."""
        wait = getattr(self.device, "wait_host_buffer", None)
        if wait is not None:
            wait(token)
        else:
            self.device.synchronize()
        fields = np.ndarray(5, np.float32, self._host[token], self._report)  # REPORT_BYTES
        value, bad, found, norm, reject = (float(x) for x in fields)
        bad = bad != 0.0
        return StepReport(value, bad=bad, overflow=found != 0.0 and not bad,
                          grad_norm=norm if apply and not bad else None, rejected=reject != 0.0)

    # -- host transfers ----------------------------------------------------------------------
    def _init_transfers(self) -> None:
        start, size = self.memory.regions[Region.INPUT]
        self._input_start = start
        # a half-precision input comes from the host as float32 and is rounded on the device
        # (layout.cu / convert.cu): its float32 staging area follows the INPUT mirror
        self._wide: dict[str, int] = {}
        end = size
        for t in self.memory.tensors.values():
            if t.region == Region.INPUT and t.dtype.name in HALF_INPUTS:
                self._wide[t.name] = end
                end += -(-math.prod(t.shape) * 4 // 256) * 256
        self._report = end  # the report of the step whose batch came up through the buffer
        end += REPORT_BYTES
        # and its model outputs (a training plan's, where a plain copy reads them: [N, C]
        # scores), so they can be read after the next step was launched over them
        self._outputs: dict[str, int] = {}
        for name in getattr(getattr(self.plan, "info", None), "outputs", None) or ():
            t = self.memory.tensors.get(name)
            g = geometry(t) if t is not None else None
            if g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
                end = -(-end // 256) * 256
                self._outputs[name] = end
                end += t.nbytes
        largest = max([t.nbytes for t in self.memory.tensors.values()] + [end, 1])
        make = getattr(self.device, "pinned_buffers", None)
        if make is not None:
            self._host = make(largest, 3)
        else:
            self._host = [np.zeros(largest, np.uint8) for _ in range(3)]
        self._k, self._k_ready = 0, False

    def _flip_host_buffers(self) -> None:
        record = getattr(self.device, "record_host_buffer", None)
        if record is not None:
            record(self._k)
        self._k, self._k_ready = 1 - self._k, False

    def _host_buffer(self) -> np.ndarray:
        if not self._k_ready:
            wait = getattr(self.device, "wait_host_buffer", None)
            if wait is not None:
                wait(self._k)
            self._k_ready = True
        return self._host[self._k]

    def write_input(self, name: str, array, host_layout: str = "nchw") -> None:
        """Upload a graph input (or a per-step scalar: ``__lr``, ``__step``...) from a compact
        host array (logical NCHW; ``host_layout='nhwc'`` for channels-last host data)."""
        t = self.memory.tensors.get(name)
        if t is None or t.region != Region.INPUT:
            inputs = sorted(n for n, x in self.memory.tensors.items() if x.region == Region.INPUT)
            raise InputError(f"{name!r} is not an input of this plan; inputs: {inputs}")
        src = np.asarray(array)
        if host_layout == "nhwc" and src.ndim >= 3:
            src = np.moveaxis(src, -1, 1)
        if src.shape != tuple(t.shape):
            raise InputError(f"{name!r}: expected shape {list(t.shape)}, got {list(src.shape)}")
        host = self._host_buffer()
        g = geometry(t)
        self.device.begin_node(f"<upload {name}>", "upload")
        slot = DeviceBuffer(self._b.base + t.offset, t.nbytes, True, t.name)
        ws_ptr, ws_bytes = self._b.workspace
        # a float batch for a half input goes up as float32 and is rounded on the device: NumPy
        # takes ~30 ms to round a 64x3x224x224 batch to fp16 on one core, the kernel microseconds
        wide = name in self._wide and src.dtype.kind == "f" and g is not None and (
            g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout)
            or g.kind == "channels_last" and t.layout.kind == "channels_last")
        stage_dtype = np.dtype(np.float32) if wide else t.dtype
        array = np.asarray(src, dtype=stage_dtype)
        compact = array.nbytes
        off = self._wide[name] if wide else t.offset - self._input_start
        if wide and compact > ws_bytes:
            wide, array = False, np.asarray(src, dtype=t.dtype)  # no room: the host rounds
            compact, off = array.nbytes, t.offset - self._input_start
        dt = DT.get(t.dtype.name)
        src_dt = "f32" if wide else dt
        if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last" \
                and compact <= ws_bytes:
            np.copyto(np.ndarray(t.shape, array.dtype, host, off), array)
            staging = DeviceBuffer(ws_ptr, compact, True)
            self.device.memcpy_async(staging, host[off:off + compact], compact, "h2d")
            grid, block = launch_dims(g.n)
            self.device.launch(self._b.kernel(f"tr_pad_nhwc_{src_dt}_{dt}"), grid,
                               block, (DeviceBuffer(ws_ptr, compact, False), slot, _i64(g.n),
                                       _i64(g.c), _i64(g.s), _i64(g.cp)))
        elif wide:  # flat: up as float32 into WORKSPACE, rounded into the slot
            np.copyto(np.ndarray(t.shape, array.dtype, host, off), array)
            self.device.memcpy_async(DeviceBuffer(ws_ptr, compact, True),
                                     host[off:off + compact], compact, "h2d")
            grid, block = launch_dims(g.n)
            self.device.launch(self._b.kernel(f"tr_convert_f32_{dt}"), grid, block,
                               (DeviceBuffer(ws_ptr, compact, False), slot, _i64(g.n)))
        elif g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
            np.copyto(np.ndarray(t.shape, t.dtype, host, off), array)
            self.device.memcpy_async(slot, host[off:off + compact], compact, "h2d")
        else:  # the host lays the data out (GatherRows, or no room to stage in WORKSPACE)
            view = host[off:off + t.nbytes]
            view[...] = 0
            if isinstance(t.layout, GatherRowsLayout):
                t.layout.physical_view(view, 0, t.dtype)[...] = t.layout.to_physical(array)
            else:
                t.layout.kernel_view(view, 0, t.dtype)[...] = array
            self.device.memcpy_async(slot, view, t.nbytes, "h2d")

    def write_scalar(self, name: str, value) -> None:
        """A per-step scalar (lr, step count...) of INPUT goes up with the batch, through the
        pinned buffer and an async copy; any other through ``write_tensor`` (synchronous)."""
        t = self.memory.tensors.get(name)
        if t is not None and t.region == Region.INPUT:
            self.write_input(name, np.full(t.shape, value, t.dtype))
        else:
            super().write_scalar(name, value)

    def read_output(self, name: str, host_layout: str = "nchw") -> np.ndarray:
        """A compact host copy of any tensor of the plan (waits for the stream)."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        host = self._host[2]
        g = geometry(t)
        compact = math.prod(t.shape) * t.dtype.itemsize
        src = DeviceBuffer(self._b.base + t.offset, t.nbytes, False, t.name)
        self.device.begin_node(f"<download {name}>", "download")
        ws_ptr, ws_bytes = self._b.workspace
        if g is not None and g.kind == "channels_last" and t.layout.kind == "channels_last" \
                and compact <= ws_bytes:
            dt = DT[t.dtype.name]
            grid, block = launch_dims(g.m)
            self.device.launch(self._b.kernel(f"tr_unpad_nhwc_{dt}_{dt}"), grid, block,
                               (src, DeviceBuffer(ws_ptr, compact, True), _i64(g.m), _i64(g.c),
                                _i64(g.s), _i64(g.cp)))
            self.device.memcpy_async(host[:compact], DeviceBuffer(ws_ptr, compact, False),
                                     compact, "d2h")
            self.device.synchronize()
            out = np.ndarray(t.shape, t.dtype, host).copy()
        elif g is not None and g.kind == "flat" and not isinstance(t.layout, GatherRowsLayout):
            self.device.memcpy_async(host[:compact], src, compact, "d2h")
            self.device.synchronize()
            out = np.ndarray(t.shape, t.dtype, host).copy()
        else:
            self.device.memcpy_async(host[:t.nbytes], src, t.nbytes, "d2h")
            self.device.synchronize()
            if isinstance(t.layout, GatherRowsLayout):
                out = t.layout.to_logical(t.layout.physical_view(host, 0, t.dtype))
            else:
                out = np.array(t.layout.kernel_view(host, 0, t.dtype), order="C")
        if host_layout == "nhwc" and out.ndim >= 3:
            out = np.ascontiguousarray(np.moveaxis(out, 1, -1))
        return out

    def all_finite(self, name: str) -> bool:
        """No NaN/Inf in tensor ``name``, decided on the device: ``tr_zero_lanes_b4`` clears a
        float32 flag in the first 4 bytes of WORKSPACE (per-node scratch, dead between phases,
        so free outside the captured step), ``tr_unscale_check_<dt>`` with a null inv_scale
        sets it to 1 on a non-finite element (the tensor is not written), and only those 4
        bytes come back to the host. A tensor the flat kernel cannot index (a non-plain
        layout, GatherRows, a dtype without kernels) or a plan with no WORKSPACE takes the
        host round trip of ``HostTransfers.all_finite``."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        g = geometry(t)
        ws_ptr, ws_bytes = self._b.workspace
        if g is None or g.kind != "flat" or isinstance(t.layout, GatherRowsLayout) or \
                t.dtype.name not in DT or ws_bytes < 4:
            return super().all_finite(name)
        flag = DeviceBuffer(ws_ptr, 4, True)
        self.device.begin_node(f"<all_finite {name}>", "check")
        self.device.launch(self._b.kernel("tr_zero_lanes_b4"), (1, 1, 1), (1, 1, 1),
                           (flag, _i64(1), _i64(0), _i64(1)))
        grid, block = launch_dims(g.n)
        self.device.launch(self._b.kernel(f"tr_unscale_check_{DT[t.dtype.name]}"), grid,
                           block, (DeviceBuffer(self._b.base + t.offset, t.nbytes, False, t.name),
                                   _i64(g.n), None, flag))
        host = self._host[2]
        self.device.memcpy_async(host[:4], DeviceBuffer(ws_ptr, 4, False), 4, "d2h")
        self.device.synchronize()
        return bool(host[:4].view(np.float32)[0] == 0.0)

    def load_constants(self) -> None:
        """Upload the plan's initial contents (parameters, constants, optimizer state) once,
        through the host buffer, before the first step (a synchronous setup)."""
        graph = self.plan.graph
        for v in graph.values.values():
            if v.data is None or v.span_of is not None or v.alias_of is not None:
                continue
            t = self.memory.tensors[v.name]
            host = np.zeros(t.nbytes, np.uint8)
            if isinstance(t.layout, GatherRowsLayout):
                t.layout.physical_view(host, 0, t.dtype)[...] = t.layout.to_physical(v.data)
            else:
                t.layout.kernel_view(host, 0, t.dtype)[...] = v.data
            self.device.memcpy(DeviceBuffer(self._b.base + t.offset, t.nbytes, True, t.name),
                               host, t.nbytes, "h2d")

    def write_tensor(self, name: str, array) -> None:
        """Overwrite any tensor of the plan (parameters, optimizer state) from a compact host
        array, synchronously, between steps (``ExecutorAPI``; its other state helpers come
        from ``HostTransfers`` on top of this and ``read_output``)."""
        t = self.memory.tensors.get(name)
        if t is None:
            raise InputError(f"{name!r} is not a tensor of this plan")
        array = np.asarray(array, dtype=t.dtype)
        if array.shape != tuple(t.shape):
            raise InputError(f"{name!r}: expected shape {list(t.shape)}, got {list(array.shape)}")
        host = np.zeros(t.nbytes, np.uint8)
        if isinstance(t.layout, GatherRowsLayout):
            t.layout.physical_view(host, 0, t.dtype)[...] = t.layout.to_physical(array)
        else:
            t.layout.kernel_view(host, 0, t.dtype)[...] = array
        self.device.memcpy(DeviceBuffer(self._b.base + t.offset, t.nbytes, True, t.name), host,
                           t.nbytes, "h2d")


__all__ = ["EXECUTOR_POLICY", "BoundNode", "Copy", "CudaExecutor", "CudaUnsupported",
           "CudnnCall", "Geometry", "Launch", "geometry"]
