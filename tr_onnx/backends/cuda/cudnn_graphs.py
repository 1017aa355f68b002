"""cuDNN frontend graphs of the cuda backend, described from the MemoryPlan alone.

Two halves, so that everything but the last call can be checked without a GPU:

* ``describe_node(node, plan) -> GraphDesc``: a pure description of the graph one IR node
  needs -- tensors (NCHW-ordered dims, element strides of the padded channels-last buffer,
  data type, byte offset in the arena), the op's window (from ``ops.conv.Window``, the same
  arithmetic the numpy kernels use) and its scalars. It reads only DTensors and node
  attributes, and raises ``CudnnGraphError`` naming the node for what cuDNN cannot do.
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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import TrOnnxError
from ...layouts import GatherRowsLayout, StridedLayout, compact_strides
from ...memory import ALIGN, DTensor, MemoryPlan, Region
from ...ops.conv import Window

INTERNAL_DOMAIN = "ai.tr_onnx"

# numpy dtype name -> cudnn.data_type member
CUDNN_DATA_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT"}
# what build_pygraph asks cuDNN's heuristics for, in order
HEURISTICS = ("A", "FALLBACK")
DETERMINISTIC_ENV = "TR_ONNX_CUDNN_DETERMINISTIC"
"""Set to 1: plans leave out cuDNN's non-deterministic engines (bitwise-repeatable steps, as
``torch.backends.cudnn.deterministic``); read when a plan is made."""

# (domain, op_type) -> GraphDesc.kind
CUDNN_OPS = {
    ("", "Conv"): "conv_fprop",
    (INTERNAL_DOMAIN, "ConvGradData"): "conv_dgrad",
    (INTERNAL_DOMAIN, "ConvGradFilter"): "conv_wgrad",
    (INTERNAL_DOMAIN, "BatchNormTraining"): "batchnorm",
    (INTERNAL_DOMAIN, "BatchNormGrad"): "batchnorm_backward",
    ("", "Gemm"): "matmul",
    ("", "MatMul"): "matmul",
}


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

    ``kind`` is the frontend op (``conv_fprop``, ``conv_dgrad``, ``conv_wgrad``, ``batchnorm``,
    ``batchnorm_backward``, ``matmul``); ``inputs``/``outputs`` map the op's port names to
    tensors (outputs are what ``set_output(True)`` marks); ``params`` are the op's keyword
    attributes (``pre_padding``, ``post_padding``, ``stride``, ``dilation``); ``epilogue``
    the fused pointwise ops after it (``bias``, ``relu``) with ``relu_clip`` (lower, upper)
    for a clipped ReLU; ``workspace`` the arena range (offset, bytes) the plan reserves for
    per-node scratch, which the graph's workspace must fit. ``node_inputs``: which of the
    node's inputs the graph computes with, where it leaves some to a kernel of its own (a
    ConvTranspose's bias); None: all of them (what the host emulator runs as the node's numpy
    kernel). ``build``: the frontend calls of a graph a family describes in its own module
    (``(g, desc, ins, scalars) -> {output port: tensor}``, as the builders here); None: this
    module's builder of ``kind``.
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


def _vector(index: PlanIndex, t: DTensor, port: str, rank: int, channels: int,
            label: str) -> TensorDesc:
    """A per-channel vector (``[C]`` or ``[Cp]`` in memory) as ``[1, channels, 1, ...]``."""
    if len(t.shape) != 1:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} has shape {list(t.shape)}; a "
                              "per-channel vector was expected")
    dims = (1, channels) + (1,) * (rank - 2)
    strides = (channels, 1) + (channels,) * (rank - 2)
    return index.tensor(t, port, dims, strides, label)


def _feature_map(index: PlanIndex, t: DTensor, port: str, padded: bool,
                 label: str) -> TensorDesc:
    layout = t.layout
    if not isinstance(layout, StridedLayout) or len(t.shape) < 3:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} must be a strided feature map of "
                              f"rank >= 3, got {layout.describe()} {list(t.shape)}")
    return index.tensor(t, port, strided_dims(t, padded), element_strides(t), label)


# --------------------------------------------------------------------------------------------
# Convolutions
# --------------------------------------------------------------------------------------------

def _window(node, x_spatial, kernel, y_spatial, attrs=None) -> Window:
    try:
        win = Window.resolve(node.attrs if attrs is None else attrs, x_spatial, kernel)
    except ValueError as e:
        raise CudnnGraphError(f"{node.label}: {e}") from None
    if tuple(win.out_shape) != tuple(y_spatial):
        raise CudnnGraphError(f"{node.label}: window arithmetic gives spatial output "
                              f"{list(win.out_shape)} but the plan has {list(y_spatial)}")
    return win


def _conv_params(win: Window) -> dict[str, list[int]]:
    return {"pre_padding": list(win.pads_begin), "post_padding": list(win.pads_end),
            "stride": list(win.strides), "dilation": list(win.dilations)}


def _padded_groups(x: DTensor, w: DTensor, y: DTensor, group: int) -> tuple[bool, str]:
    """Whether the padded dims still describe the logical conv (see the module docstring).

    cuDNN infers the group count from the dims: G = C_x / C_w. With padded dims G' = Xc / Wi
    groups of Wo / G' outputs; the first ``group`` of them must be the logical groups and the
    rest read and write only padded (zero) lanes.
    """
    xc, yc = strided_dims(x, True)[1], strided_dims(y, True)[1]
    wo, wi = strided_dims(w, True)[:2]
    o, cg = w.shape[:2]
    og = o // group
    if wi == 0 or xc % wi or wo % (xc // wi) or yc != wo:
        return False, (f"padded channels do not line up (x {xc}, w [{wo}, {wi}], y {yc}): "
                       "logical channel dims over padded strides")
    g_padded = xc // wi
    if (group == 1 and g_padded != 1) or (group > 1 and (wi != cg or wo // g_padded != og)):
        return False, (f"group={group} does not survive padding (x {xc} channels, w [{wo}, "
                       f"{wi}]): logical channel dims over padded strides")
    return True, ""


def conv_desc(node, plan: MemoryPlan, kind: str, x: DTensor, w: DTensor, y: DTensor,
              inputs: dict[str, str], outputs: dict[str, str], bias: DTensor | None = None,
              epilogue_out: DTensor | None = None, relu_clip=None,
              attrs: dict | None = None) -> GraphDesc:
    """The ``kind`` graph (conv_fprop, conv_dgrad, conv_wgrad) of the convolution x -> y with
    weight w; ``inputs``/``outputs`` map ports to the roles 'x', 'w', 'y'. ``attrs``: the
    convolution's attributes when they are not the node's own (ConvTranspose runs as the data
    gradient of its adjoint Conv, ``backends/cuda/ops/conv.py``). ``bias`` is added to the
    graph's output in its epilogue."""
    attrs = node.attrs if attrs is None else attrs
    index = PlanIndex(plan)
    group = int(attrs.get("group", 1))
    kernel = tuple(int(k) for k in (attrs.get("kernel_shape") or w.shape[2:]))
    if tuple(w.shape[2:]) != kernel or w.shape[1] * group != x.shape[1] or w.shape[0] % group:
        raise CudnnGraphError(f"{node.label}: weight {list(w.shape)} does not fit input "
                              f"{list(x.shape)} with group={group}, kernel_shape={list(kernel)}")
    win = _window(node, x.shape[2:], kernel, y.shape[2:], attrs)
    padded, note = _padded_groups(x, w, y, group)
    roles = {"x": x, "w": w, "y": y}

    def desc(role: str, port: str) -> TensorDesc:
        t = roles[role]
        if role == "w":
            return index.tensor(t, port, strided_dims(t, padded), element_strides(t), node.label)
        return _feature_map(index, t, port, padded, node.label)

    ins = {port: desc(role, port) for port, role in inputs.items()}
    outs = {port: desc(role, port) for port, role in outputs.items()}
    epilogue: tuple[str, ...] = ()
    if bias is not None:
        channels = next(iter(outs.values())).dims[1]
        ins["bias"] = _vector(index, bias, "bias", len(y.shape), channels, node.label)
        epilogue += ("bias",)
    if epilogue_out is not None:
        out = _feature_map(index, epilogue_out, "Y", padded, node.label)
        if out.dims != outs["Y"].dims:
            raise CudnnGraphError(f"{node.label}: fused activation output {epilogue_out.name!r} "
                                  f"has dims {list(out.dims)}, the conv {list(outs['Y'].dims)}")
        outs["Y"] = out
        epilogue += ("relu",)
    x_desc = ins.get("image") or outs.get("DX")
    w_desc = ins.get("weight") or ins.get("filter") or outs.get("DW")
    return _one_data_type(GraphDesc(
        kind, node.label, x_desc.data_type, ins, outs, params=_conv_params(win),
        epilogue=epilogue, relu_clip=relu_clip, channels="padded" if padded else "logical",
        groups=x_desc.dims[1] // w_desc.dims[1], notes=(note,) if note else ()))


def _one_data_type(desc: GraphDesc) -> GraphDesc:
    """``desc``, checked to read and write one data type, as our conv and matmul graphs
    declare them (one ``io_data_type``, fp32 compute): a half-precision plan that left one
    operand float32 would otherwise reach cuDNN as a mixed-type graph no engine takes."""
    types = {port: t.data_type for port, t in {**desc.inputs, **desc.outputs}.items()}
    if len(set(types.values())) > 1:
        raise CudnnGraphError(f"{desc.node}: a {desc.kind} graph reads and writes one data "
                              "type; got " + ", ".join(f"{p} {d}" for p, d in types.items()))
    return desc


def fusable_activation(node, graph) -> tuple[Any, tuple[float | None, float | None]] | None:
    """The Relu (or Clip(0, max) -- ReLU6) a Conv's output feeds alone, for a fused epilogue.

    Returns ``(activation node, (lower, upper clip))`` or None. Only when the conv output has
    no other reader and is not a graph output: a training graph's conv output is saved for
    backward, so it does not fuse there.
    """
    y = node.outputs[0]
    if y is None or y in graph.outputs or len(y.consumers) != 1:
        return None
    act = y.consumers[0]
    if act.domain not in ("", "ai.onnx"):
        return None
    if act.op_type == "Relu":
        return act, (None, None)
    if act.op_type == "Clip":
        bounds = []
        for i, key in ((1, "min"), (2, "max")):
            v = act.inputs[i] if i < len(act.inputs) else None
            if v is not None and v.data is None:
                return None
            bounds.append(float(np.asarray(v.data).reshape(())) if v is not None
                          else act.attrs.get(key))
        lower, upper = bounds
        if lower is None or lower != 0.0:
            return None
        return act, (None, None if upper is None else float(upper))
    return None


# --------------------------------------------------------------------------------------------
# BatchNorm
# --------------------------------------------------------------------------------------------

def _batchnorm_desc(node, plan: MemoryPlan) -> GraphDesc:
    """BatchNormTraining(x, scale, bias, running_mean, running_var) -> (y, saved_mean,
    saved_inv_std, new_running_mean, new_running_var).

    cuDNN's running update is ``next = (1 - m) * prev + m * batch`` with the unbiased batch
    variance; ONNX's momentum is the weight of the old value (so m = 1 - momentum) and its
    variance is the biased one. The graph always declares the running statistics (the
    frontend requires them); where the node asks for ONNX's biased variance the backend then
    rewrites the next running statistics from x, saved_mean and the old values with its own
    kernel (``notes`` says so); PyTorch's unbiased convention is cuDNN's own.
    """
    index = PlanIndex(plan)
    t = plan.tensors
    x, scale, bias = (t[v.name] for v in node.inputs[:3])
    y = t[node.outputs[0].name]
    rank = len(x.shape)
    xd = _feature_map(index, x, "input", True, node.label)
    c = xd.dims[1]
    ins = {"input": xd,
           "scale": _vector(index, scale, "scale", rank, c, node.label),
           "bias": _vector(index, bias, "bias", rank, c, node.label)}
    outs = {"Y": _feature_map(index, y, "Y", True, node.label)}
    for port, i in (("mean", 1), ("inv_var", 2)):
        if node.outputs[i] is not None:
            outs[port] = _vector(index, t[node.outputs[i].name], port, rank, c, node.label)
    momentum = float(node.attrs.get("momentum", 0.9))
    unbiased = bool(node.attrs.get("unbiased_running_var", 0))
    scalars = {"epsilon": ScalarDesc("epsilon", float(node.attrs.get("epsilon", 1e-5))),
               "momentum": ScalarDesc("momentum", 1.0 - momentum)}
    # frontend 1.32's batchnorm() requires the running statistics (omitting them is a
    # TypeError at validate()); its update uses the unbiased batch variance
    for port, i in (("in_running_mean", 3), ("in_running_var", 4)):
        ins[port] = _vector(index, t[node.inputs[i].name], port, rank, c, node.label)
    for port, i in (("next_running_mean", 3), ("next_running_var", 4)):
        if node.outputs[i] is not None:
            outs[port] = _vector(index, t[node.outputs[i].name], port, rank, c, node.label)
    notes = []
    if not unbiased:
        notes.append("running statistics use the biased batch variance (ONNX): the backend "
                     "rewrites cuDNN's (unbiased) update from saved_mean and the old values")
    if xd.dims != outs["Y"].dims:
        raise CudnnGraphError(f"{node.label}: x dims {list(xd.dims)} and y dims "
                              f"{list(outs['Y'].dims)} differ")
    return GraphDesc("batchnorm", node.label, xd.data_type, ins, outs, scalars=scalars,
                     notes=tuple(notes))


def _batchnorm_backward_desc(node, plan: MemoryPlan) -> GraphDesc:
    """BatchNormGrad(gy, x, scale, mean, inv_std) -> (gx, gscale, gbias), training=1 only:
    with fixed running statistics (training=0) gx is a per-channel scale, an elementwise kernel."""
    if not int(node.attrs.get("training", 1)):
        raise CudnnGraphError(f"{node.label}: training=0 (fixed statistics) is a per-channel "
                              "scale of gy; it has no cuDNN batchnorm_backward graph")
    index = PlanIndex(plan)
    t = plan.tensors
    gy, x, scale, mean, inv_std = (t[v.name] for v in node.inputs[:5])
    rank = len(x.shape)
    xd = _feature_map(index, x, "input", True, node.label)
    c = xd.dims[1]
    ins = {"grad": _feature_map(index, gy, "grad", True, node.label), "input": xd,
           "scale": _vector(index, scale, "scale", rank, c, node.label),
           "mean": _vector(index, mean, "mean", rank, c, node.label),
           "inv_variance": _vector(index, inv_std, "inv_variance", rank, c, node.label)}
    outs = {}
    for port, i in (("DX", 0), ("DScale", 1), ("DBias", 2)):
        v = node.outputs[i] if i < len(node.outputs) else None
        if v is None:
            continue
        outs[port] = (_feature_map(index, t[v.name], port, True, node.label) if i == 0
                      else _vector(index, t[v.name], port, rank, c, node.label))
    if ins["grad"].dims != xd.dims or ("DX" in outs and outs["DX"].dims != xd.dims):
        raise CudnnGraphError(f"{node.label}: gy, x and gx dims differ")
    return GraphDesc("batchnorm_backward", node.label, xd.data_type, ins, outs)


# --------------------------------------------------------------------------------------------
# MatMul / Gemm
# --------------------------------------------------------------------------------------------

def _matrix(index: PlanIndex, t: DTensor, port: str, trans: bool, label: str) -> TensorDesc:
    """A rank-2 or rank-3 tensor as cuDNN's ``[batch, rows, cols]`` (transposed by strides)."""
    dims, strides = list(strided_dims(t, True)), list(element_strides(t))
    if len(dims) == 2:
        dims, strides = [1] + dims, [dims[0] * strides[0]] + strides
    if len(dims) != 3:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} has rank {len(t.shape)}; cuDNN "
                              "matmul graphs here take rank 2 or 3")
    if trans:
        dims[1], dims[2], strides[1], strides[2] = dims[2], dims[1], strides[2], strides[1]
    return index.tensor(t, port, dims, strides, label)


def _matmul_desc(node, plan: MemoryPlan) -> GraphDesc:
    """Gemm (alpha = 1, beta = 1 or no C) and MatMul of rank 2/3: ``Y = A @ B (+ C)``."""
    index = PlanIndex(plan)
    t = plan.tensors
    a, b = t[node.inputs[0].name], t[node.inputs[1].name]
    y = t[node.outputs[0].name]
    trans_a = trans_b = False
    c = None
    if node.op_type == "Gemm":
        trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
        has_c = len(node.inputs) > 2 and node.inputs[2] is not None
        if float(node.attrs.get("alpha", 1.0)) != 1.0 or (
                has_c and float(node.attrs.get("beta", 1.0)) != 1.0):
            raise CudnnGraphError(f"{node.label}: alpha != 1 or beta != 1 has no fused cuDNN "
                                  "matmul graph here (scale the inputs with a kernel)")
        c = t[node.inputs[2].name] if has_c else None
    ad = _matrix(index, a, "A", trans_a, node.label)
    bd = _matrix(index, b, "B", trans_b, node.label)
    yd = _matrix(index, y, "Y", False, node.label)
    if bd.dims[0] == 1 and ad.dims[0] > 1:
        # a B shared by every batch: declared with a batch stride of 0 (some engines reject an
        # implicitly broadcast batch dimension)
        bd = replace(bd, dims=(ad.dims[0], *bd.dims[1:]), strides=(0, *bd.strides[1:]))
    if ad.dims[2] != bd.dims[1] or (ad.dims[1], bd.dims[2]) != yd.dims[1:] or \
            bd.dims[0] != ad.dims[0] or yd.dims[0] != ad.dims[0]:
        raise CudnnGraphError(f"{node.label}: A {list(ad.dims)} @ B {list(bd.dims)} does not "
                              f"give Y {list(yd.dims)}")
    ins = {"A": ad, "B": bd}
    epilogue: tuple[str, ...] = ()
    if c is not None:
        if not c.layout.is_plain or len(c.shape) > 2:
            raise CudnnGraphError(f"{node.label}: C {c.name!r} must be a compact vector or "
                                  f"matrix, got {c.layout.describe()} {list(c.shape)}")
        dims = (1,) * (3 - len(c.shape)) + tuple(c.shape)
        strides = tuple(s // c.dtype.itemsize for s in compact_strides(dims, c.dtype.itemsize))
        ins["bias"] = index.tensor(c, "bias", dims, strides, node.label)
        epilogue = ("bias",)
    return _one_data_type(GraphDesc("matmul", node.label, ad.data_type, ins, {"Y": yd},
                                    epilogue=epilogue))


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def describe_node(node, plan: MemoryPlan, activation=None,
                  workspace: tuple[int, int] | None = None) -> GraphDesc:
    """The cuDNN graph of ``node`` from ``plan``'s DTensors and the node's attributes.

    ``activation``: what ``fusable_activation(node, graph)`` returned, to fuse a Relu/ReLU6
    into a Conv's epilogue (the activation's output becomes the graph's Y). ``workspace``:
    the arena range (offset, bytes) the node's binding reserved for the graph (default: the
    whole WORKSPACE region). Raises
    ``CudnnGraphError`` for ops with no cuDNN graph (listing those that have one) and for
    layouts that do not fit.
    """
    key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
    kind = CUDNN_OPS.get(key)
    if kind is None:
        known = ", ".join(sorted(op for _, op in CUDNN_OPS))
        raise CudnnGraphError(f"{node.label}: no cuDNN graph for this op (cuDNN graphs: {known})")
    t = plan.tensors
    if kind == "conv_fprop":
        x, w, y = t[node.inputs[0].name], t[node.inputs[1].name], t[node.outputs[0].name]
        bias = (t[node.inputs[2].name] if len(node.inputs) > 2 and node.inputs[2] is not None
                else None)
        act_out, clip = None, None
        if activation is not None:
            act, clip = activation
            act_out = t[act.outputs[0].name]
        desc = conv_desc(node, plan, kind, x, w, y, {"image": "x", "weight": "w"},
                          {"Y": "y"}, bias=bias, epilogue_out=act_out, relu_clip=clip)
    elif kind == "conv_dgrad":
        gy, w, gx = t[node.inputs[0].name], t[node.inputs[1].name], t[node.outputs[0].name]
        desc = conv_desc(node, plan, kind, gx, w, gy, {"loss": "y", "filter": "w"},
                          {"DX": "x"})
    elif kind == "conv_wgrad":
        x, gy, gw = t[node.inputs[0].name], t[node.inputs[1].name], t[node.outputs[0].name]
        desc = conv_desc(node, plan, kind, x, gw, gy, {"image": "x", "loss": "y"},
                          {"DW": "w"})
    elif kind == "batchnorm":
        desc = _batchnorm_desc(node, plan)
    elif kind == "batchnorm_backward":
        desc = _batchnorm_backward_desc(node, plan)
    else:
        desc = _matmul_desc(node, plan)
    desc.workspace = plan.regions[Region.WORKSPACE] if workspace is None else workspace
    return desc


def describe_graph(graph, plan: MemoryPlan, fuse: bool = True
                   ) -> tuple[dict[str, GraphDesc], dict[str, str]]:
    """Descriptors for the nodes of ``graph`` that cuDNN runs, keyed by node name, and the
    nodes of those op types it does not (name -> reason: a kernel of the backend runs them).

    With ``fuse``, a Conv followed only by a Relu/ReLU6 takes it as its epilogue; the
    activation node is then listed under its own name with the same (shared) descriptor.
    """
    descs: dict[str, GraphDesc] = {}
    skipped: dict[str, str] = {}
    for node in graph.nodes:
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        if key not in CUDNN_OPS or node.name in descs:
            continue
        activation = fusable_activation(node, graph) if fuse and key == ("", "Conv") else None
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


def _op_conv(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    p = desc.params
    kw = {k: p[k] for k in ("pre_padding", "post_padding", "stride", "dilation")}
    if desc.kind == "conv_dgrad":
        port = "DX"
        y = g.conv_dgrad(loss=ins["loss"], filter=ins["filter"], name="dgrad", **kw)
    elif desc.kind == "conv_wgrad":
        port = "DW"
        y = g.conv_wgrad(image=ins["image"], loss=ins["loss"], name="wgrad", **kw)
    else:
        port = "Y"
        y = g.conv_fprop(image=ins["image"], weight=ins["weight"], name="fprop", **kw)
    if "bias" in desc.epilogue:
        y = g.bias(input=y, bias=ins["bias"], name="bias")
    if "relu" in desc.epilogue:
        lower, upper = desc.relu_clip or (None, None)
        clips = {k: v for k, v in (("lower_clip", lower), ("upper_clip", upper)) if v is not None}
        y = g.relu(input=y, name="relu", **clips)
    return {port: y}


def _op_batchnorm(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    running = {k: ins[k] for k in ("in_running_mean", "in_running_var") if k in ins}
    y, mean, inv_var, next_mean, next_var = g.batchnorm(
        input=ins["input"], scale=ins["scale"], bias=ins["bias"], epsilon=scalars["epsilon"],
        momentum=scalars["momentum"], peer_stats=[], name="bn", **running)
    return {"Y": y, "mean": mean, "inv_var": inv_var, "next_running_mean": next_mean,
            "next_running_var": next_var}


def _op_batchnorm_backward(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    dx, dscale, dbias = g.batchnorm_backward(
        grad=ins["grad"], input=ins["input"], scale=ins["scale"], mean=ins["mean"],
        inv_variance=ins["inv_variance"], peer_stats=[], name="dbn")
    return {"DX": dx, "DScale": dscale, "DBias": dbias}


def _op_matmul(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    y = g.matmul(ins["A"], ins["B"], name="matmul")
    if "bias" in desc.epilogue:
        y = g.bias(input=y, bias=ins["bias"], name="bias")
    return {"Y": y}


_BUILDERS = {"conv_fprop": _op_conv, "conv_dgrad": _op_conv, "conv_wgrad": _op_conv,
             "batchnorm": _op_batchnorm, "batchnorm_backward": _op_batchnorm_backward,
             "matmul": _op_matmul}


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
    produced = (desc.build or _BUILDERS[desc.kind])(g, desc, ins, scalars)
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


__all__ = ["CUDNN_OPS", "BuiltGraph", "CudnnGraphError", "GraphDesc", "ScalarDesc", "TensorDesc",
           "build_pygraph", "conv_desc", "declare_pygraph", "describe_graph", "describe_node",
           "fusable_activation"]
