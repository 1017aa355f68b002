"""cuda bindings of ``ops/conv.py``: Conv and its backward ops ConvGradData / ConvGradFilter,
and ConvTranspose, each one cuDNN graph over the padded channels-last buffers: their
``CudnnGraph`` declarations and the graphs' descriptions (``conv_desc``: tensors, window and
epilogue from the MemoryPlan; ``build_conv``: the frontend calls), over ``cudnn_graphs``'
generic machinery.

ConvTranspose is the data gradient of its adjoint Conv
(``ops.conv.conv_transpose_adjoint_attrs``: the same weight, its pads those of the uncropped
frame): one ``conv_dgrad`` graph, described here (``describe_conv_transpose``), and the bias
added by the broadcasting add kernel. Its own gradient ops are a Conv and a ConvGradFilter.

An inference Conv whose output only a Relu (or ReLU6) reads takes the activation into the
graph's epilogue; the activation node then has no calls of its own. A convolution may use as
much cuDNN workspace as its explicit im2col matrix would take (``bind.CUDNN_WORKSPACE`` at
least): engines that need more are deselected before the plan is built.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ....domains import INTERNAL_DOMAIN, ONNX_DOMAINS
from ....errors import UnsupportedModelError
from ....hookspecs import hookimpl
from ....ir import Phase
from ....memory import DTensor, MemoryPlan
from ....opdef import KernelContext, KernelDef
from ....ops.conv import conv_transpose_adjoint_attrs
from ....ops.conv_window import Window
from ..bind import (
    BindContext,
    Unbound,
    collapse,
    cudnn_workspace,
    f32,
    float_dt,
    geometry,
    i32,
    i64,
)
from ..cudnn_graphs import (
    CudnnGraph,
    CudnnGraphError,
    GraphDesc,
    PlanIndex,
    TensorDesc,
    channel_vector,
    element_strides,
    feature_map,
    one_data_type,
    strided_dims,
)
from .elementwise import BCAST_FLOAT

# op -> (index of the weight-shaped tensor, index of the output-sized feature map), as
# ("in"|"out", position)
_ROLES = {"Conv": (("in", 1), ("out", 0)), "ConvGradData": (("in", 1), ("in", 0)),
          "ConvGradFilter": (("out", 0), ("in", 1)), "ConvTranspose": (("in", 1), ("in", 0))}


# ---- cuDNN graphs: conv_fprop, conv_dgrad, conv_wgrad ------------------------------------------

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
    """Whether the padded dims still describe the logical conv (``cudnn_graphs``' docstring).

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
    gradient of its adjoint Conv, ``describe_conv_transpose``). ``bias`` is added to the
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
        return feature_map(index, t, port, padded, node.label)

    ins = {port: desc(role, port) for port, role in inputs.items()}
    outs = {port: desc(role, port) for port, role in outputs.items()}
    epilogue: tuple[str, ...] = ()
    if bias is not None:
        channels = next(iter(outs.values())).dims[1]
        ins["bias"] = channel_vector(index, bias, "bias", len(y.shape), channels, node.label)
        epilogue += ("bias",)
    if epilogue_out is not None:
        out = feature_map(index, epilogue_out, "Y", padded, node.label)
        if out.dims != outs["Y"].dims:
            raise CudnnGraphError(f"{node.label}: fused activation output {epilogue_out.name!r} "
                                  f"has dims {list(out.dims)}, the conv {list(outs['Y'].dims)}")
        outs["Y"] = out
        epilogue += ("relu",)
    x_desc = ins.get("image") or outs.get("DX")
    w_desc = ins.get("weight") or ins.get("filter") or outs.get("DW")
    return one_data_type(GraphDesc(
        kind, node.label, x_desc.data_type, ins, outs, params=_conv_params(win),
        epilogue=epilogue, relu_clip=relu_clip, channels="padded" if padded else "logical",
        groups=x_desc.dims[1] // w_desc.dims[1], notes=(note,) if note else (),
        build=build_conv, builds_without_device=True))


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
    if act.domain not in ONNX_DOMAINS:
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


# op -> (graph kind, input ports, output ports): ports map to the conv's roles x -> y over w
_GRAPHS = {"Conv": ("conv_fprop", {"image": "x", "weight": "w"}, {"Y": "y"}),
           "ConvGradData": ("conv_dgrad", {"loss": "y", "filter": "w"}, {"DX": "x"}),
           "ConvGradFilter": ("conv_wgrad", {"image": "x", "loss": "y"}, {"DW": "w"})}


def describe_conv(node, plan: MemoryPlan, workspace: tuple[int, int],
                  activation=None) -> GraphDesc:
    """Conv(x, w[, b]) -> y (the bias and a fused ``activation`` in the epilogue),
    ConvGradData(gy, w) -> gx and ConvGradFilter(x, gy) -> gw, each its conv graph."""
    kind, ins, outs = _GRAPHS[node.op_type]
    t = plan.tensors
    a, b, c = t[node.inputs[0].name], t[node.inputs[1].name], t[node.outputs[0].name]
    if kind == "conv_dgrad":
        return conv_desc(node, plan, kind, c, b, a, ins, outs)
    if kind == "conv_wgrad":
        return conv_desc(node, plan, kind, a, c, b, ins, outs)
    bias = (t[node.inputs[2].name] if len(node.inputs) > 2 and node.inputs[2] is not None
            else None)
    act_out, clip = None, None
    if activation is not None:
        act, clip = activation
        act_out = t[act.outputs[0].name]
    return conv_desc(node, plan, kind, a, b, c, ins, outs, bias=bias, epilogue_out=act_out,
                     relu_clip=clip)


def build_conv(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    """The frontend calls of a conv graph: its ``kind``'s op, then the epilogue."""
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


def im2col_bytes(ctx: KernelContext) -> int:
    """Bytes of the im2col matrix of this convolution: (N * output pixels) x (C/g * kernel)."""
    (wk, wi), (fk, fi) = _ROLES[ctx.node.op_type]
    w = (ctx.inputs if wk == "in" else ctx.outputs)[wi]
    fm = (ctx.inputs if fk == "in" else ctx.outputs)[fi]
    return fm.shape[0] * math.prod(fm.shape[2:]) * math.prod(w.shape[1:]) * fm.dtype.itemsize


def conv_factory(ctx: KernelContext):
    k = cudnn_workspace(ctx, im2col_bytes(ctx))

    def bind(b: BindContext, node) -> list:
        if node.phase == Phase.FORWARD:
            activation = fusable_activation(node, b.graph)
            if activation is not None:
                b.fused[id(activation[0])] = node.label
                return b.cudnn(node, k, activation)
        return b.cudnn(node, k)

    return bind


def describe_conv_transpose(node, plan: MemoryPlan, workspace: tuple[int, int]) -> GraphDesc:
    """ConvTranspose(x, w[, b]) -> y as the ``conv_dgrad`` graph of its adjoint Conv y -> x:
    loss = x, filter = w (ONNX's [C_in, C_out / group, *k] is that Conv's [O, I / group, *k]),
    DX = y. The bias is not in the graph: a dgrad with a bias epilogue takes runtime-fusion
    engines only, which compile through the driver when built (and so cannot be checked
    without a GPU); ``conv_transpose_factory`` adds it after."""
    t = plan.tensors
    x, w, y = (t[v.name] for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
    try:
        attrs = conv_transpose_adjoint_attrs(node)
    except UnsupportedModelError as e:
        raise CudnnGraphError(str(e)) from None
    desc = conv_desc(node, plan, "conv_dgrad", y, w, x, {"loss": "y", "filter": "w"},
                     {"DX": "x"}, attrs=attrs)
    desc.node_inputs = (0, 1)
    return desc


def conv_transpose_factory(ctx: KernelContext):
    """The adjoint's dgrad graph, then y += b over y's padded channels-last rows: the bias is
    read over the padded channel count from its slot (a half plan's bias is a compact cast
    whose slot lanes past the channels hold anything), and y's pad lanes are zeroed after."""
    k = cudnn_workspace(ctx, im2col_bytes(ctx))

    def bind(b: BindContext, node) -> list:
        calls = b.cudnn(node, k)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is None:
            return calls
        y = node.outputs[0]
        g, tb = geometry(b.t(y)), b.t(bias)
        row_bytes = g.cp * tb.dtype.itemsize if g is not None else 0
        if g is None or g.kind != "channels_last" or geometry(tb) is None or \
                len(tb.shape) != 1 or max(tb.slot_bytes, tb.nbytes) < row_bytes:
            raise Unbound(f"the bias add reads {y.name!r} channels-last and {bias.name!r} as "
                          "a vector over its padded channels")
        # rows x padded channels: y (read and written) walks both, the bias only the channels
        dims, (sy, sb, sy_out) = collapse([g.n // g.cp, g.cp], [[g.cp, 1], [0, 1], [g.cp, 1]])
        calls.append(b.launch(f"tr_bcast_binary_{float_dt(b, y, bias)}", g.n, [
            b.buf(y), b.tensor_buf(tb, nbytes=row_bytes), b.buf(y, True), i64(g.n),
            i32(BCAST_FLOAT["Add"]), f32(0)] + [i64(v) for v in dims + sy + sb + sy_out]))
        return calls + ([b.zero_lanes(y, g)] if g.padded else [])

    return bind


@hookimpl
def tr_onnx_op_definitions():
    grads = CudnnGraph(describe_conv, workspace_bytes=im2col_bytes)
    return [KernelDef("Conv", "cuda", CudnnGraph(describe_conv, activation=fusable_activation,
                                                 binding=conv_factory)),
            KernelDef("ConvTranspose", "cuda", CudnnGraph(describe_conv_transpose,
                                                          binding=conv_transpose_factory)),
            KernelDef("ConvGradData", "cuda", grads, domain=INTERNAL_DOMAIN),
            KernelDef("ConvGradFilter", "cuda", grads, domain=INTERNAL_DOMAIN)]
