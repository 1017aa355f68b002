"""The cuda backend's planning, checked without a GPU.

* cuDNN graph descriptors (tr_onnx.backends.cuda.cudnn_graphs) of the model_zoo ResNet and
  MobileNet, planned with channel_align=8, agree with the MemoryPlan's DTensors: NCHW dims with
  padded channels, NHWC/OHWI strides, 256-aligned offsets, byte spans inside the slots, group
  counts; build_pygraph issues a consistent cuDNN frontend call sequence (a fake module), and
  the real frontend (where installed) accepts the declarations up to the first driver call.
* Capture discipline (tr_onnx.backends.cuda.capture): a fake step built from a real numpy
  MemoryPlan captures cleanly under the FakeRecorder; allocations, syncs, synchronous copies,
  stray pointers and writes to the wrong region are caught with the node named.
"""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

import tr_onnx
import tr_onnx.session as session_module
from tr_onnx.backends.cuda.capture import (
    WRITE_POLICY,
    AllocationDuringCapture,
    AllocationGuard,
    CaptureError,
    CaptureStep,
    DeviceBuffer,
    PointerOutsideArena,
    RegionViolation,
    SyncDuringCapture,
    capture_step,
)
from tr_onnx.backends.cuda.cudnn_graphs import (
    CudnnGraphError,
    build_pygraph,
    declare_pygraph,
    describe_graph,
    describe_node,
)
from tr_onnx.memory import ALIGN, Region
from tr_onnx.passes import fusions
from tr_onnx.testing.recorder import FakeRecorder, RecordedGraph
from tr_onnx.training import pipeline

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
ALIGN_CH = 8
CUDNN_OP_TYPES = {"Conv", "ConvGradData", "ConvGradFilter", "BatchNormTraining", "BatchNormGrad"}
STEMS = ["resnet", "mobilenet"]
MODES = ["inference", "training"]


def _feed(stem):
    shape = (4, 1, 8, 8) if stem == "lenet" else (4, 3, 16, 16)
    return {"input": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


_PLANS = {}


def compiled_plan(stem, mode, align=ALIGN_CH):
    """(CompiledPlan) of the model: InferenceSession.plan_for, or a TrainingSession's active plan
    after one step. Cached: the plans are pure and the tests only read them. Training plans keep
    their GRAD accumulators as the cuda backend's do (numpy alone computes gradients straight
    into GRAD: ``train_pass.fold_accumulators``)."""
    key = (stem, mode, align)
    if key not in _PLANS:
        if mode == "inference":
            with pytest.MonkeyPatch.context() as patch:  # numpy-only, as _fast_gelu below
                patch.setattr(session_module, "finite_rewrites", lambda *args: None)
                _PLANS[key] = tr_onnx.InferenceSession(
                    ZOO / f"{stem}.onnx", channel_align=align).plan_for(_feed(stem))
        else:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(pipeline, "fold_accumulators", lambda *args: False)
                patch.setattr(fusions, "_fast_gelu", lambda *args: False)  # as the cuda plan
                session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=align)
                session.train_step(_feed(stem), np.arange(4) % 10)
            _PLANS[key] = session._state.active
    return _PLANS[key]


def descriptors(stem, mode):
    plan = compiled_plan(stem, mode)
    descs, skipped = describe_graph(plan.graph, plan.memory)
    return plan, descs, skipped


# --------------------------------------------------------------------------------------------
# Independent expectations (from the DTensor's physical shape, not from the module under test)
# --------------------------------------------------------------------------------------------

def channels_last_strides(phys):
    """Element strides, NCHW order, of a channels-last buffer ``[N, *S, Cp]`` (or OHWI)."""
    n_stride = math.prod(phys[1:])
    spatial = [math.prod(phys[2 + i:]) for i in range(len(phys) - 2)]
    return (n_stride, 1, *spatial)


def owner_slot(memory, t):
    by_id = {o.id: o for o in memory.all_tensors()}
    owner = by_id[t.alias_of] if t.alias_of is not None else t
    return owner.offset, owner.slot_bytes


def check_tensor(memory, port, td):
    t = memory.tensors[td.name]
    assert td.byte_offset == t.offset, port
    assert td.byte_offset % ALIGN == 0 and td.alignment == ALIGN, port
    start, slot = owner_slot(memory, t)
    assert start <= td.byte_offset and td.byte_offset + td.span_bytes <= start + slot, (
        f"{port} {td.name}: {td.span_bytes} bytes at {td.byte_offset} leave slot {start}+{slot}")
    assert td.itemsize == t.dtype.itemsize
    assert td.data_type == {"float32": "FLOAT", "float16": "HALF"}[t.dtype.name]
    return t


def check_feature_map(memory, port, td, padded):
    t = check_tensor(memory, port, td)
    assert t.layout.kind in ("channels_last", "conv_weight"), (port, t.layout.describe())
    phys = t.layout.phys_shape
    assert td.strides == channels_last_strides(phys), (port, td.strides, phys)
    assert td.dims[0] == (phys[0] if padded else t.shape[0])
    assert td.dims[2:] == tuple(phys[1:-1]) == tuple(t.shape[2:])
    assert td.dims[1] == (phys[-1] if padded else t.shape[1])
    if t.layout.kind == "channels_last":
        assert phys[-1] % ALIGN_CH == 0, (port, phys)  # padded channels in memory


def check_vector(memory, port, td, channels, rank):
    check_tensor(memory, port, td)
    assert td.dims == (1, channels) + (1,) * (rank - 2)
    assert td.strides == (channels, 1) + (channels,) * (rank - 2)


# --------------------------------------------------------------------------------------------
# Descriptors vs the MemoryPlan
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stem", STEMS)
def test_every_cudnn_node_gets_a_descriptor(stem, mode):
    plan, descs, skipped = descriptors(stem, mode)
    assert not skipped
    wanted = [n for n in plan.graph.nodes if n.op_type in CUDNN_OP_TYPES]
    assert wanted
    missing = [n.name for n in wanted if n.name not in descs]
    assert not missing
    kinds = {descs[n.name].kind for n in wanted}
    assert {"conv_fprop"} <= kinds
    if mode == "training":
        assert kinds == {"conv_fprop", "conv_dgrad", "conv_wgrad", "batchnorm",
                         "batchnorm_backward"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stem", STEMS)
def test_conv_descriptors_agree_with_dtensors(stem, mode):
    plan, descs, _ = descriptors(stem, mode)
    memory = plan.memory
    convs = [n for n in plan.graph.nodes
             if n.op_type in ("Conv", "ConvGradData", "ConvGradFilter")]
    for node in convs:
        d = descs[node.name]
        padded = d.channels == "padded"
        x = d.inputs.get("image") or d.outputs.get("DX")
        w = d.inputs.get("weight") or d.inputs.get("filter") or d.outputs.get("DW")
        y = d.outputs.get("Y") or d.inputs["loss"]
        for port, td in d.tensors().items():
            if port == "bias":
                check_vector(memory, port, td, y.dims[1], len(y.dims))
            elif td is w and memory.tensors[td.name].layout.is_plain:
                t = check_tensor(memory, port, td)  # a ConvGradFilter output left OIHW
                assert td.dims == t.shape
                assert td.strides == tuple(s // t.dtype.itemsize for s in t.host_strides)
            else:
                check_feature_map(memory, port, td, padded)
        # cuDNN infers groups from the dims: C_x = G * C_w, and K % G == 0
        group = int(node.attrs["group"])
        assert x.dims[1] == d.groups * w.dims[1] and w.dims[0] % d.groups == 0
        assert y.dims[1] == w.dims[0]
        assert d.groups == group or (padded and d.groups * w.dims[1] == x.dims[1])
        if group > 1:
            assert w.dims[1] == memory.tensors[node.inputs[0].name].shape[1] // group
        # the window: the node's attributes, and the output extent cuDNN will compute
        nd = len(x.dims) - 2
        attrs = node.attrs
        assert d.params["stride"] == list(attrs.get("strides") or [1] * nd)
        assert d.params["dilation"] == list(attrs.get("dilations") or [1] * nd)
        assert d.params["pre_padding"] + d.params["post_padding"] == list(
            attrs.get("pads") or [0] * 2 * nd)
        for i in range(nd):
            eff = (w.dims[2 + i] - 1) * d.params["dilation"][i] + 1
            span = x.dims[2 + i] + d.params["pre_padding"][i] + d.params["post_padding"][i]
            assert (span - eff) // d.params["stride"][i] + 1 == y.dims[2 + i]


@pytest.mark.parametrize("stem", STEMS)
def test_batchnorm_descriptors_agree_with_dtensors(stem):
    plan, descs, _ = descriptors(stem, "training")
    memory = plan.memory
    nodes = [n for n in plan.graph.nodes if n.op_type in ("BatchNormTraining", "BatchNormGrad")]
    assert nodes
    for node in nodes:
        d = descs[node.name]
        x = d.inputs["input"]
        rank, c = len(x.dims), x.dims[1]
        assert c == memory.tensors[x.name].padded_channels and c % ALIGN_CH == 0
        for port, td in d.tensors().items():
            if td.dims[0] == 1 and rank > 2 and td.dims[2:] == (1,) * (rank - 2):
                check_vector(memory, port, td, c, rank)
            else:
                check_feature_map(memory, port, td, True)
        if d.kind == "batchnorm":
            assert set(d.outputs) >= {"Y", "mean", "inv_var"}
            assert d.scalars["momentum"].value == pytest.approx(1 - node.attrs["momentum"])
            # frontend 1.32 requires the running statistics in the graph (issue 10, finding 1);
            # ONNX's biased running variance is not what cuDNN computes: the notes say the
            # backend rewrites it after the graph
            assert {"in_running_mean", "in_running_var"} <= set(d.inputs) and d.notes
        else:
            assert set(d.outputs) == {"DX", "DScale", "DBias"}


def test_unbiased_running_statistics_run_in_the_graph():
    """PyTorch's running variance (unbiased) is what cuDNN computes: then the graph updates the
    running statistics too, reading the PARAM vectors and writing the new ones."""
    session = tr_onnx.TrainingSession(ZOO / "resnet.onnx", channel_align=ALIGN_CH,
                                      bn_running_var="unbiased")
    session.train_step(_feed("resnet"), np.arange(4))
    plan = session._state.active
    descs, _ = describe_graph(plan.graph, plan.memory)
    bns = [(n, descs[n.name]) for n in plan.graph.nodes if n.op_type == "BatchNormTraining"]
    assert bns
    for node, d in bns:
        c, rank = d.inputs["input"].dims[1], len(d.inputs["input"].dims)
        assert not d.notes
        for port, i in (("in_running_mean", 3), ("in_running_var", 4)):
            assert d.inputs[port].name == node.inputs[i].name
            assert plan.memory.tensors[node.inputs[i].name].region == Region.PARAM
        for port, i in (("next_running_mean", 3), ("next_running_var", 4)):
            assert d.outputs[port].name == node.outputs[i].name
            check_vector(plan.memory, port, d.outputs[port], c, rank)
        built = build_pygraph(d, FakeCudnn(), handle=None)
        bn_call = next(e for e in built.graph.log if e[0] == "batchnorm")
        assert {"in_running_mean", "in_running_var"} <= set(bn_call[2])


def test_unpadded_weight_gradient_falls_back_to_logical_channels():
    """The stem conv reads 3 channels padded to 8, and ConvGradFilter's output is plain OIHW
    [16, 3, 3, 3]: padded dims cannot describe it, so its wgrad uses logical channels over the
    padded strides, and says so."""
    _, descs, _ = descriptors("resnet", "training")
    logical = {name: d for name, d in descs.items() if d.channels == "logical"}
    assert [d.kind for d in logical.values()] == ["conv_wgrad"]
    (d,) = logical.values()
    assert d.inputs["image"].dims[1] == 3 and d.inputs["image"].strides[-1] == 8
    assert d.outputs["DW"].dims == (16, 3, 3, 3) and "do not line up" in d.notes[0]


def test_depthwise_convs_keep_their_groups():
    plan, descs, _ = descriptors("mobilenet", "training")
    depthwise = [n for n in plan.graph.nodes if n.op_type in ("Conv", "ConvGradData",
                                                              "ConvGradFilter")
                 and int(n.attrs["group"]) > 1]
    assert len(depthwise) >= 6
    for node in depthwise:
        d = descs[node.name]
        w = d.inputs.get("weight") or d.inputs.get("filter") or d.outputs["DW"]
        assert w.dims[1] == 1 and d.groups == int(node.attrs["group"])


def test_conv_relu_fuses_in_inference_and_not_in_training():
    plan = compiled_plan("lenet", "inference")
    descs, _ = describe_graph(plan.graph, plan.memory)
    fused = [d for d in descs.values() if "relu" in d.epilogue]
    assert fused and all(d.epilogue == ("bias", "relu") for d in fused)
    relu_outputs = {n.outputs[0].name for n in plan.graph.nodes if n.op_type == "Relu"}
    assert all(d.outputs["Y"].name in relu_outputs for d in fused)
    _, train_descs, _ = descriptors("resnet", "training")
    assert not any("relu" in d.epilogue for d in train_descs.values())


def test_matmul_descriptor_transposes_by_strides():
    plan, descs, _ = descriptors("resnet", "inference")
    (gemm,) = [n for n in plan.graph.nodes if n.op_type == "Gemm"]
    d = descs[gemm.name]
    a, b, y = d.inputs["A"], d.inputs["B"], d.outputs["Y"]
    w = plan.memory.tensors[gemm.inputs[1].name]  # [N, K] with transB=1
    assert b.dims == (1, w.shape[1], w.shape[0]) and b.strides[1:] == (1, w.shape[1])
    assert a.dims[2] == b.dims[1] and y.dims == (1, a.dims[1], b.dims[2])
    assert d.epilogue == ("bias",) and d.inputs["bias"].dims == (1, 1, w.shape[0])


def test_nodes_without_a_cudnn_graph_are_named():
    plan = compiled_plan("resnet", "training")
    relu = next(n for n in plan.graph.nodes if n.op_type == "Relu")
    with pytest.raises(CudnnGraphError, match=r"Relu.*cuDNN graphs: .*BatchNormGrad"):
        describe_node(relu, plan.memory)
    bn_grad = next(n for n in plan.graph.nodes if n.op_type == "BatchNormGrad")
    fixed = dataclasses.replace(bn_grad, attrs={**bn_grad.attrs, "training": 0})
    with pytest.raises(CudnnGraphError, match="training=0"):
        describe_node(fixed, plan.memory)


# --------------------------------------------------------------------------------------------
# build_pygraph against a fake cudnn module
# --------------------------------------------------------------------------------------------

class FakeTensor:
    def __init__(self, log, name, dim=None, stride=None, data_type=None, virtual=True):
        self.log, self.name, self.dim, self.stride = log, name, dim, stride
        self.data_type, self.virtual, self.output = data_type, virtual, False

    def _set(self, what, value):
        self.log.append((what, self.name, value))
        setattr(self, what, value)
        return self

    def set_output(self, v):
        return self._set("output", v)

    def set_data_type(self, v):
        return self._set("data_type", v)

    def set_dim(self, v):
        return self._set("dim", list(v))

    def set_stride(self, v):
        return self._set("stride", list(v))


N_OUTPUTS = {"batchnorm": 5, "batchnorm_backward": 3}


class FakeGraph:
    def __init__(self, log, workspace, **kw):
        self.log, self.workspace = log, workspace
        log.append(("pygraph", kw))

    def tensor(self, name, dim, stride, data_type, is_pass_by_value=False):
        self.log.append(("tensor", name, list(dim), list(stride), data_type, is_pass_by_value))
        return FakeTensor(self.log, name, list(dim), list(stride), data_type, virtual=False)

    def tensor_scalar(self, value, kind, name):
        self.log.append(("tensor_scalar", name, value, kind))
        return FakeTensor(self.log, name, [1, 1, 1, 1], [1, 1, 1, 1], "FLOAT", virtual=False)

    def get_workspace_size(self):
        self.log.append(("get_workspace_size",))
        return self.workspace

    def get_execution_plan_count(self):
        self.log.append(("get_execution_plan_count",))
        return 1

    def __getattr__(self, op):
        def call(*args, **kwargs):
            self.log.append((op, args, kwargs))
            if op in ("validate", "build_operation_graph", "create_execution_plans",
                      "check_support", "build_plans"):
                return None
            outs = [FakeTensor(self.log, f"{op}:{i}") for i in range(N_OUTPUTS.get(op, 1))]
            if op == "batchnorm" and "in_running_mean" not in kwargs:
                outs[3] = outs[4] = None
            return outs if len(outs) > 1 else outs[0]
        return call


class FakeCudnn:
    class data_type:
        FLOAT, HALF, BFLOAT16 = "FLOAT", "HALF", "BFLOAT16"

    class heur_mode:
        A, B, FALLBACK = "A", "B", "FALLBACK"

    class scalar_type:
        RUNTIME_PARAM = "RUNTIME_PARAM"

    def __init__(self, workspace=0):
        self.log, self.workspace = [], workspace

    def pygraph(self, **kw):
        return FakeGraph(self.log, self.workspace, **kw)


BUILD_ORDER = ["validate", "build_operation_graph", "create_execution_plans",
               "get_execution_plan_count", "deselect_workspace_greater_than", "check_support",
               "build_plans", "get_workspace_size"]


def one_per_kind():
    _, descs, _ = descriptors("resnet", "training")
    by_kind = {}
    for d in descs.values():
        by_kind.setdefault((d.kind, d.channels), d)
    lenet = compiled_plan("lenet", "inference")
    for d in describe_graph(lenet.graph, lenet.memory)[0].values():
        if "relu" in d.epilogue:
            by_kind[("conv_fprop+bias+relu", d.channels)] = d
    return by_kind


@pytest.mark.parametrize("kind", ["conv_fprop", "conv_fprop+bias+relu", "conv_dgrad", "conv_wgrad",
                                  "batchnorm", "batchnorm_backward", "matmul"])
def test_build_pygraph_call_sequence(kind):
    desc = one_per_kind()[(kind, "padded")]
    fake = FakeCudnn(workspace=0)
    built = build_pygraph(desc, fake, handle="H")
    log = fake.log
    assert log[0] == ("pygraph", {"io_data_type": "FLOAT", "intermediate_data_type": "FLOAT",
                                  "compute_data_type": "FLOAT", "handle": "H"})
    declared = {e[1]: e for e in log if e[0] == "tensor"}
    for port, td in desc.inputs.items():
        assert declared[port][2:5] == (list(td.dims), list(td.strides), td.data_type)
    # scalars are runtime parameters of the graph, never in the variant pack: NumPy arrays
    # there fail the frontend's __dlpack__(stream=-1) at execute() (issue 10, finding 2)
    scalars = {e[1]: e for e in log if e[0] == "tensor_scalar"}
    for name, s in desc.scalars.items():
        assert scalars[name][2:] == (pytest.approx(s.value), "RUNTIME_PARAM")
        assert built.scalars[name] not in built.variant_pack(0)
    ops = [e for e in log if e[0] not in ("tensor", "tensor_scalar", "pygraph", "output",
                                          "data_type", "dim", "stride")
           and e[0] not in BUILD_ORDER]
    expected_ops = {"conv_fprop": ["conv_fprop"], "conv_fprop+bias+relu":
                    ["conv_fprop", "bias", "relu"], "conv_dgrad": ["conv_dgrad"],
                    "conv_wgrad": ["conv_wgrad"], "batchnorm": ["batchnorm"],
                    "batchnorm_backward": ["batchnorm_backward"], "matmul": ["matmul", "bias"]}
    assert [e[0] for e in ops] == expected_ops[kind]
    if desc.kind.startswith("conv"):
        assert ops[0][2]["pre_padding"] == desc.params["pre_padding"]
        assert ops[0][2]["stride"] == desc.params["stride"]
    for port, td in desc.outputs.items():
        t = built.tensors[port]
        assert t.output is True and t.dim == list(td.dims) and t.stride == list(td.strides)
        assert t.data_type == td.data_type
    # every output is marked before the build starts, and the build runs in the documented order
    last_mark = max(i for i, e in enumerate(log) if e[0] in ("output", "dim", "stride"))
    build = [(i, e[0]) for i, e in enumerate(log) if e[0] in BUILD_ORDER]
    assert [op for _, op in build] == BUILD_ORDER and build[0][0] > last_mark
    heur = next(e for e in log if e[0] == "create_execution_plans")
    assert heur[1] == (["A", "FALLBACK"],)
    limit = next(e for e in log if e[0] == "deselect_workspace_greater_than")
    assert limit[1] == (desc.workspace[1],) and desc.workspace[1] > 0  # the WORKSPACE region
    assert built.workspace_bytes == 0
    pointers = built.pointers(1 << 40)
    assert pointers == {p: (1 << 40) + t.byte_offset for p, t in desc.tensors().items()}


def test_build_pygraph_refuses_a_workspace_the_plan_lacks():
    desc = one_per_kind()[("conv_fprop", "padded")]
    too_big = desc.workspace[1] + 1
    with pytest.raises(CudnnGraphError, match=f"{too_big} bytes.*re-plan"):
        build_pygraph(desc, FakeCudnn(workspace=too_big), handle=None)


@pytest.mark.parametrize("stem", STEMS)
def test_real_cudnn_frontend_declares_every_graph(stem):
    """nvidia-cudnn-frontend needs the driver only from validate() on: the declarations (tensor
    dims/strides/types, ops, marked outputs) are the frontend's own objects here."""
    import cudnn  # installed by the README's test command (nvidia-cudnn-frontend, --no-deps)
    _, descs, _ = descriptors(stem, "training")
    for desc in {id(d): d for d in descs.values()}.values():
        built = declare_pygraph(desc, cudnn)
        for port, td in desc.outputs.items():
            t = built.tensors[port]
            assert list(t.get_dim()) == list(td.dims) and list(t.get_stride()) == list(td.strides)
            assert t.get_data_type() == getattr(cudnn.data_type, td.data_type)
            assert not t.get_is_virtual()


# --------------------------------------------------------------------------------------------
# Capture discipline with the FakeRecorder
# --------------------------------------------------------------------------------------------

BASE = 1 << 40


def _extent(view: np.ndarray) -> int:
    if view.size == 0:
        return 0
    return sum((d - 1) * s for d, s in zip(view.shape, view.strides)) + view.itemsize


def fake_steps(plan, cudnn_descs=None):
    """CaptureSteps that stand for the plan's BoundSteps: one launch per step whose pointers are
    BASE + (the view's address - the arena's), named with the DTensor they view; nodes with a
    cuDNN descriptor issue cudnn_execute with BASE + the descriptor's offsets instead."""
    executor, memory = plan.executor, plan.memory
    arena_addr = executor.arena.ctypes.data
    nodes = [n for n in plan.graph.nodes
             if not (n.outputs and n.outputs[0] is not None and n.outputs[0].alias_of is not None)]
    assert [n.label for n in nodes] == [s.label for s in executor.steps]
    ws_start = memory.regions[Region.WORKSPACE][0]
    steps = []
    for node, bound in zip(nodes, executor.steps):
        desc = (cudnn_descs or {}).get(node.name)
        if desc is not None:
            def run(dev, desc=desc):
                dev.cudnn_execute(desc, {p: BASE + t.byte_offset
                                         for p, t in desc.tensors().items()}, BASE + ws_start)
        else:
            updates = set(node.opdef.updates_inputs)
            args = []
            for i, (v, view) in enumerate(zip(node.inputs, bound.ins)):
                if view is not None:
                    args.append(DeviceBuffer(BASE + view.ctypes.data - arena_addr, _extent(view),
                                             i in updates, v.name))
            for v, view in zip(node.outputs, bound.outs):
                if view is not None:
                    args.append(DeviceBuffer(BASE + view.ctypes.data - arena_addr, _extent(view),
                                             True, v.name))
            for view in bound.ws:
                args.append(DeviceBuffer(BASE + view.ctypes.data - arena_addr, _extent(view),
                                         True))

            def run(dev, op=node.op_type, args=tuple(args)):
                dev.launch(op, (1, 1, 1), (256, 1, 1), args)
        steps.append(CaptureStep(bound.label, bound.phase, run))
    return steps


@pytest.mark.parametrize("align", [1, ALIGN_CH])
def test_resnet_training_step_captures_cleanly(align):
    plan = compiled_plan("resnet", "training", align)
    steps = fake_steps(plan)
    device = FakeRecorder(plan.memory, BASE)
    graph = capture_step(steps, device, warmup=1)
    assert isinstance(graph, RecordedGraph)
    assert [c.op for c in graph.calls] == ["launch"] * len(steps)
    assert {c.phase for c in graph.calls} == {"compute", "commit", "apply"}
    assert all(c.capturing for c in graph.calls)
    ops = [c.op for c in device.calls]
    assert ops.count("launch") == 2 * len(steps)  # warm-up + capture
    assert ops[len(steps):len(steps) + 2] == ["synchronize", "begin_capture"]
    assert "allocate" not in ops and ops[-1] == "end_capture"
    # the writes the real plan makes are the ones WRITE_POLICY allows, and each policy is used
    written = {(c.phase, device.region_of(a.ptr, a.nbytes)) for c in graph.calls
               for a in c.args["args"] if a.writes}
    assert {(p, r) for p, r in written} <= {(p, r) for p, rs in WRITE_POLICY.items() for r in rs}
    assert ("commit", Region.PARAM) in written and ("apply", Region.OPT_STATE) in written


def test_cudnn_steps_pass_pointers_from_the_descriptors():
    plan = compiled_plan("resnet", "training")
    descs, _ = describe_graph(plan.graph, plan.memory)
    device = FakeRecorder(plan.memory, BASE)
    graph = capture_step(fake_steps(plan, descs), device)
    executes = [c for c in graph.calls if c.op == "cudnn_execute"]
    assert len(executes) == len({id(d) for d in descs.values()})
    assert {c.args["kind"] for c in executes} >= {"conv_fprop", "conv_wgrad", "batchnorm"}


def _bad(kind):
    """A step body that breaks one capture rule (for the node it replaces)."""
    def run(dev):
        if kind == "allocation":
            dev.allocate(4096)
        elif kind == "synchronize":
            dev.synchronize()
        elif kind == "sync_copy":
            dev.memcpy(BASE, np.zeros(4, np.float32), 16, "h2d")
        elif kind == "outside_arena":
            dev.launch("k", (1,), (1,), [DeviceBuffer(BASE + dev.plan.total_bytes, 256, True)])
        elif kind == "below_arena":
            dev.launch("k", (1,), (1,), [DeviceBuffer(BASE - 256, 256, False)])
        elif kind == "param_write_in_compute":
            dev.launch("k", (1,), (1,), [DeviceBuffer(BASE, 256, True)])
        elif kind == "wrong_offset":
            name = next(n for n, t in dev.plan.tensors.items() if t.region == Region.SAVED)
            t = dev.plan.tensors[name]
            dev.launch("k", (1,), (1,), [DeviceBuffer(BASE + t.offset + 256, 16, False, name)])
        elif kind == "async_copy_outside":
            dev.memcpy_async(BASE - 1024, np.zeros(4, np.float32), 16, "h2d")
    return run


@pytest.mark.parametrize("kind,error", [
    ("allocation", AllocationDuringCapture),
    ("synchronize", SyncDuringCapture),
    ("sync_copy", SyncDuringCapture),
    ("outside_arena", PointerOutsideArena),
    ("below_arena", PointerOutsideArena),
    ("async_copy_outside", PointerOutsideArena),
    ("param_write_in_compute", RegionViolation),
    ("wrong_offset", RegionViolation),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_bad_step_is_caught_with_the_node_named(kind, error):
    plan = compiled_plan("resnet", "training", 1)
    steps = fake_steps(plan)
    victim = next(i for i, s in enumerate(steps) if "ConvGradFilter" in s.label)
    label = steps[victim].label
    bad = _bad(kind)

    def run(dev, good=steps[victim].run):
        good(dev)
        if dev.capturing:  # warm-up may allocate and sync; the captured step may not
            bad(dev)

    steps[victim] = CaptureStep(label, steps[victim].phase, run)
    device = FakeRecorder(plan.memory, BASE)
    with pytest.raises(error) as info:
        capture_step(steps, device)
    err = info.value
    assert isinstance(err, CaptureError) and err.node == label and err.eager_fallback
    assert label in str(err) and "eager" in str(err)
    assert device.calls[-1].op == "abort_capture" and not device.capturing


def test_warmup_may_allocate_and_capture_then_must_not():
    plan = compiled_plan("resnet", "training", 1)
    cache = {}

    def lazy(dev):  # allocates once, on first use (like a kernel module cache), then reuses
        if "buf" not in cache:
            cache["buf"] = dev.allocate(1024)

    steps = [CaptureStep("node 'lazy' (Fake, v1)", "compute", lazy)]
    graph = capture_step(steps, FakeRecorder(plan.memory, BASE), warmup=1)
    assert graph.calls == []


def test_any_other_error_while_capturing_is_named_and_aborts():
    plan = compiled_plan("resnet", "training", 1)

    def boom(dev):
        if dev.capturing:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")

    device = FakeRecorder(plan.memory, BASE)
    with pytest.raises(CaptureError, match=r"node 'x'.*RuntimeError.*eager") as info:
        capture_step([CaptureStep("node 'x' (Foo, v1)", "compute", boom)], device)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert device.calls[-1].op == "abort_capture" and not device.capturing


def test_allocation_guard_restores_the_allocator():
    installed = ["pool"]
    guard = AllocationGuard(lambda: "node 'n' (Conv, ai.onnx v11)",
                            set_allocator=lambda f: installed.append(f),
                            get_allocator=lambda: installed[-1])
    with guard, pytest.raises(AllocationDuringCapture, match=r"node 'n'.*512 bytes"):
        installed[-1](512)
    assert installed[-1] == "pool"


def test_capture_step_installs_the_allocation_guard():
    plan = compiled_plan("resnet", "training", 1)
    allocator = ["pool"]

    def make_guard(label):
        return AllocationGuard(label, set_allocator=allocator.append,
                               get_allocator=lambda: allocator[-1])

    def temporary(dev):  # in effect, a CuPy reduction taking scratch from the pool
        if dev.capturing:
            allocator[-1](128)

    steps = [CaptureStep("node 'ok' (Relu, ai.onnx v14)", "compute", lambda dev: None),
             CaptureStep("node 'sum' (ReduceSum, ai.onnx v13)", "compute", temporary)]
    device = FakeRecorder(plan.memory, BASE)
    with pytest.raises(AllocationDuringCapture, match=r"node 'sum'.*128 bytes") as info:
        capture_step(steps, device, allocation_guard=make_guard)
    assert info.value.node == "node 'sum' (ReduceSum, ai.onnx v13)"
    assert allocator[-1] == "pool" and device.calls[-1].op == "abort_capture"


def test_allocation_guard_hooks_cupy_allocations():
    import cupy  # the test extra installs cupy-cuda13x
    before = cupy.cuda.get_allocator()
    guard = AllocationGuard(lambda: "node 'n' (ReduceSum, ai.onnx v13)")
    with guard, pytest.raises(AllocationDuringCapture, match="node 'n'"):
        cupy.cuda.alloc(1024)  # raises before touching a device, so no GPU is needed
    assert cupy.cuda.get_allocator() is before


def test_deterministic_switch_deselects_non_deterministic_engines(monkeypatch):
    """TR_ONNX_CUDNN_DETERMINISTIC=1 (replay-equals-eager on a GPU, issue 10 finding 10): the
    plans leave out cuDNN's non-deterministic engines, before the workspace cut."""
    from tr_onnx.backends.cuda.cudnn_graphs import DETERMINISTIC_ENV

    desc = one_per_kind()[("conv_wgrad", "padded")]
    fake = FakeCudnn()
    fake.numerical_note = type("numerical_note", (), {"NONDETERMINISTIC": "NONDET"})
    build_pygraph(desc, fake, handle=None)
    assert not any(e[0] == "deselect_numeric_notes" for e in fake.log)
    monkeypatch.setenv(DETERMINISTIC_ENV, "1")
    fake = FakeCudnn()
    fake.numerical_note = type("numerical_note", (), {"NONDETERMINISTIC": "NONDET"})
    build_pygraph(desc, fake, handle=None)
    ops = [e[0] for e in fake.log]
    assert ops.index("deselect_numeric_notes") < ops.index("deselect_workspace_greater_than")
    assert next(e for e in fake.log if e[0] == "deselect_numeric_notes")[1] == (["NONDET"],)
