"""The cuda executor (tr_onnx.backends.cuda.executor), checked without a GPU.

The training plans of the model zoo (channel_align=8; cuda plans made from the cuda bindings,
compared with the numpy plan of the same graph) are bound to a FakeDevice built on
tr_onnx.testing.recorder.FakeRecorder, which checks every pointer against the MemoryPlan and
every write against the phase's regions.

* Binding: every node binds, or one CudaUnsupported names exactly the unbound ops.
* Launches: every kernel exists in the compiled sources, and its arguments match the kernel's
  C signature (parsed from the host-preprocessed source): pointers where it takes pointers,
  to tensors of the element type it reads, scalars of its C types.
* Capture: first run eager, second captured (no allocation, no sync) and launched, then
  replayed; the apply phase touches only the PARAM/GRAD/OPT_STATE spans and scalars; the
  fused optimizer covers the PARAM span once.
* Emulation: the same launches run on the CPU through tr_onnx.testing.host_emulator
  (the kernels' g++ host build), cuDNN calls through the numpy kernels of their nodes, on a
  NumPy arena: three captured training steps equal the numpy backend's, and the host
  transfers (pad/unpad through WORKSPACE) equal memory.write_host / read_host.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tr_onnx
from tr_onnx.backends.cuda import sources
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import CudnnCall, Launch
from tr_onnx.backends.cuda.capture import CaptureError, DeviceBuffer
from tr_onnx.backends.cuda.device import BLOCK, CupyDevice, KernelRef, cuda_available, launch_dims
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY, CudaExecutor, CudaUnsupported
from tr_onnx.backends.numpy_backend import allocate_arena
from tr_onnx.memory import Region, pad_lanes_are_zero, read_host, write_host
from tr_onnx.passes import fusions
from tr_onnx.testing.host_emulator import HostEmulator, build_host_library, host_compiler
from tr_onnx.testing.recorder import FakeRecorder
from tr_onnx.training import pipeline

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
BASE = 1 << 40
SHAPES = {"mlp": (4, 64), "lenet": (4, 1, 8, 8), "resnet": (4, 3, 16, 16),
          "mobilenet": (4, 3, 16, 16), "transformer": (4, 8, 32)}
BINDABLE = ["mlp", "resnet", "mobilenet", "lenet", "transformer"]
PHASES = ("compute", "commit", "apply")
_PLANS, _CUDA_PLANS = {}, {}


def training_plan(stem):
    """A TrainingSession's active plan after one numpy step (cached; tests copy what they
    change): the reference. Its gradients go through GRAD accumulators as the cuda plan's do
    (numpy alone computes them straight into GRAD: ``train_pass.fold_accumulators``), so both
    plans are one graph."""
    if stem not in _PLANS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline, "fold_accumulators", lambda *args: False)
            patch.setattr(fusions, "_fast_gelu", lambda *args: False)  # as the cuda plan
            session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=8)
            x = np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)
            session.train_step({"input": x}, np.arange(4) % 10)
        _PLANS[stem] = session._state.active
    return _PLANS[stem]


def cuda_plan(stem):
    """The cuda plan of the same training step (cached), made from the cuda bindings over a
    recording device; without the session's step guard, so its phases run one by one as the
    numpy plan's do. Its arena matches the numpy plan's up to WORKSPACE (the same graph), which
    the emulation tests rely on."""
    if stem not in _CUDA_PLANS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline, "add_step_guard", lambda *args, **kwargs: None)
            session = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", channel_align=8,
                                              backend=CudaBackend(device=FakeDevice))
            x = np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)
            plan = session._train_plan({"input": x})
        ref = training_plan(stem)
        for region in Region:
            if region != Region.WORKSPACE:
                assert plan.memory.regions[region] == ref.memory.regions[region], region
        _CUDA_PLANS[stem] = plan
    return _CUDA_PLANS[stem]


class FakeDevice(FakeRecorder):
    """FakeRecorder with the executor's transfer phases and a graph launch that records."""

    def __init__(self, plan):
        super().__init__(plan.memory, BASE, policy=EXECUTOR_POLICY)
        self.prepared, self.built = [], []

    def prepare_kernel(self, ref):
        self.prepared.append(ref)

    def build_cudnn(self, desc):  # the declaration, as the real device would build it
        self.built.append(desc)
        return desc

    def launch_graph(self, graph):
        self._record("launch_graph", calls=len(graph.calls))
        for call in graph.calls:
            self.replay(call)

    def replay(self, call):
        pass


def executor(stem, device_cls=FakeDevice):
    plan = cuda_plan(stem)
    device = device_cls(plan)
    return plan, device, CudaExecutor(plan, device)


def run_steps(ex, steps=3):
    for _ in range(steps):
        for phase in PHASES:
            ex.run(phase)


# --------------------------------------------------------------------------------------------
# Binding
# --------------------------------------------------------------------------------------------

UNBOUND = {"mlp": set(), "resnet": set(), "mobilenet": set(), "lenet": set(),
           "transformer": set()}


@pytest.mark.parametrize("stem", list(UNBOUND))
def test_every_node_binds_or_the_unbound_ops_are_named(stem):
    plan = cuda_plan(stem)
    if not UNBOUND[stem]:
        ex = CudaExecutor(plan, FakeDevice(plan))
        ran = [n for n in plan.graph.nodes if not (n.outputs and n.outputs[0] is not None
                                                   and n.outputs[0].alias_of is not None)]
        assert [b.node for b in ex.bound] == ran
        assert all(b.calls for b in ex.bound)
        return
    with pytest.raises(CudaUnsupported) as info:
        CudaExecutor(plan, FakeDevice(plan))
    err = info.value
    assert {(d, o, v) for d, o, v, _ in err.missing} == UNBOUND[stem]
    for _, o, _, names in err.missing:
        assert sorted(names) == sorted(n.name for n in plan.graph.nodes if n.op_type == o)
        assert all(repr(n) in str(err) for n in names)
    assert "backend='numpy'" in str(err) and "CudaKernel" in str(err)


def test_cudnn_nodes_get_their_graphs_built_at_bind_time():
    plan, device, ex = executor("resnet")
    cudnn_nodes = [b for b in ex.bound if any(isinstance(c, CudnnCall) for c in b.calls)]
    assert {b.node.op_type for b in cudnn_nodes} == {
        "Conv", "ConvGradData", "ConvGradFilter", "BatchNormTraining", "BatchNormGrad", "Gemm"}
    assert len(device.built) == len(cudnn_nodes)
    assert not any(c.op != "allocate" for c in device.calls)  # binding issues no device work


def test_onnx_running_statistics_get_their_own_kernel():
    """cuDNN's running update uses the unbiased variance: ONNX's biased one is kernels (the
    per-chunk sums, one block per chunk and 32 channels, then their per-channel total)."""
    plan, _, ex = executor("resnet")
    for b in ex.bound:
        if b.node.op_type == "BatchNormTraining":
            names = [c.kernel.name for c in b.calls if isinstance(c, Launch)]
            assert names == ["tr_bn_running_f32", "tr_bn_running_finish"]


# --------------------------------------------------------------------------------------------
# Launch arguments against the kernels' C signatures
# --------------------------------------------------------------------------------------------

C_SCALARS = {"long long": np.int64, "float": np.float32, "double": np.float64, "int": np.int32}
C_POINTEES = {"float": "float32", "tr_f16": "float16", "long long": "int64",
              "unsigned char": "bool"}


def kernel_signatures() -> dict[str, list[tuple[bool, str]]]:
    """kernel name -> [(is_pointer, base C type)], from the preprocessed host sources."""
    text = "\n".join(s.text for s in sources.SOURCES.values())
    done = subprocess.run([host_compiler(), "-E", "-P", "-x", "c++", "-std=c++17",
                           f"-I{sources.KERNEL_DIR}", "-"], input=text, capture_output=True,
                          text=True, check=True)
    sigs = {}
    for name, params in re.findall(r'extern "C" void (tr_\w+)\s*\(([^)]*)\)', done.stdout):
        parsed = []
        for p in params.split(","):
            p = " ".join(p.replace("const", "").split())
            pointer = "*" in p
            ctype = p.split("*")[0].strip() if pointer else p.rsplit(" ", 1)[0]
            parsed.append((pointer, ctype))
        sigs[name] = parsed
    return sigs


@pytest.fixture(scope="module")
def signatures():
    return kernel_signatures()


def check_launch_arguments(launches: list, plan, signatures) -> None:
    """Each launch's kernel is its family's, its arguments as many as the kernel's C
    parameters and of their types (a plan tensor's dtype for a pointer where the C type
    names one)."""
    families = {name: fam for fam, src in sources.SOURCES.items() for name in src.kernels}
    for launch in launches:
        ref = launch.kernel
        assert families.get(ref.name) == ref.family, ref
        sig = signatures[ref.name]
        assert len(sig) == len(launch.args), (ref.name, len(sig), len(launch.args))
        for (pointer, ctype), arg in zip(sig, launch.args):
            if pointer:
                assert arg is None or isinstance(arg, DeviceBuffer), (ref.name, ctype, arg)
                if isinstance(arg, DeviceBuffer) and arg.name in plan.memory.tensors \
                        and ctype in C_POINTEES:
                    got = plan.memory.tensors[arg.name].dtype.name
                    assert got == C_POINTEES[ctype], (ref.name, arg.name, got, ctype)
            else:
                assert type(arg) is C_SCALARS[ctype], (ref.name, ctype, type(arg))


@pytest.mark.parametrize("stem", BINDABLE)
def test_launch_arguments_match_the_kernel_signatures(stem, signatures):
    plan, device, ex = executor(stem)
    launches = [c for b in ex.bound for c in b.calls if isinstance(c, Launch)]
    assert launches
    check_launch_arguments(launches, plan, signatures)
    assert set(device.prepared) >= {c.kernel for c in launches}


def test_launch_dims_cover_the_elements():
    assert launch_dims(0) == ((1, 1, 1), (BLOCK, 1, 1))
    assert launch_dims(BLOCK + 1) == ((2, 1, 1), (BLOCK, 1, 1))
    grid, block = launch_dims(10 ** 12)
    assert grid[0] * block[0] < 10 ** 12  # grid-stride loops cover the rest


# --------------------------------------------------------------------------------------------
# Capture discipline, pointers, the apply phase
# --------------------------------------------------------------------------------------------

def _arena_range(device):
    return device.arena_base, device.arena_base + device.plan.total_bytes


@pytest.mark.parametrize("stem", BINDABLE)
def test_first_run_eager_second_captured_then_replayed(stem):
    plan, device, ex = executor(stem)
    run_steps(ex, 3)
    ops = [c.op for c in device.calls]
    assert "allocate" not in ops and "memcpy" not in ops
    assert ops.count("begin_capture") == ops.count("end_capture") == len(ex.phases)
    assert ops.count("launch_graph") == 2 * len(ex.phases)  # steps 2 and 3
    captured = [c for c in device.calls if c.capturing]
    assert captured and all(c.op in ("launch", "cudnn_execute", "memcpy_async")
                            for c in captured)
    assert not any(c.op == "synchronize" and c.capturing for c in device.calls)
    # the captured calls of a phase are the eager ones, in order
    for phase in ex.phases:
        eager = [(c.op, c.node) for c in device.calls
                 if c.phase == phase and not c.capturing and c.op != "end_capture"
                 and c.op in ("launch", "cudnn_execute", "memcpy_async")]
        capt = [(c.op, c.node) for c in captured if c.phase == phase]
        assert eager == capt


@pytest.mark.parametrize("stem", BINDABLE)
def test_every_pointer_lies_in_the_arena_at_its_tensors_offset(stem):
    plan, device, ex = executor(stem)
    run_steps(ex, 1)
    lo, hi = _arena_range(device)
    tensors = {t.name: t for t in plan.memory.all_tensors()}
    seen = 0
    for c in device.calls:
        bufs = [a for a in c.args.get("args", ()) if isinstance(a, DeviceBuffer)]
        bufs += [a for a in (c.args.get("dst"), c.args.get("src")) if isinstance(a, DeviceBuffer)]
        for a in bufs:
            assert lo <= a.ptr and a.ptr + a.nbytes <= hi, (c.node, a)
            if a.name is not None:
                assert a.ptr == lo + tensors[a.name].offset, (c.node, a.name)
            seen += 1
        for ptr in c.args.get("pointers", {}).values():
            assert lo <= ptr < hi
    assert seen > 10


@pytest.mark.parametrize("stem", BINDABLE)
def test_apply_touches_only_the_spans_and_scalars(stem):
    plan, device, ex = executor(stem)
    run_steps(ex, 1)
    tensors = plan.memory.tensors
    # a node's own scratch (ScaleClipGrad's per-chunk sums of squares) is its business
    scratch = {t.name for ws in plan.memory.workspaces.values() for t in ws}
    apply = [c for c in device.calls if c.phase == "apply" and c.op == "launch"]
    assert apply
    for c in apply:
        for a in c.args["args"]:
            if isinstance(a, DeviceBuffer) and a.name not in scratch:
                t = tensors[a.name]
                assert (t.span and t.region in (Region.PARAM, Region.GRAD, Region.OPT_STATE)) \
                    or math.prod(t.shape) == 1, (c.node, a.name)


@pytest.mark.parametrize("stem", BINDABLE)
def test_fused_optimizer_covers_the_param_span_once(stem):
    plan, device, ex = executor(stem)
    run_steps(ex, 1)
    updates = [c for c in device.calls if c.op == "launch"
               and c.args["kernel"].family == "optimizers"
               and not c.args["kernel"].name.startswith("tr_scale_clip_norm_")]  # ScaleClipGrad
    assert len(updates) == 1
    (upd,) = updates
    span = plan.memory.tensors["__params"]
    p, n = upd.args["args"][0], int(upd.args["args"][5 if "adam" in upd.args["kernel"].name
                                                    else 4])
    assert p.name == "__params" and p.ptr == BASE + span.offset and n == math.prod(span.shape)
    grid, block = upd.args["grid"], upd.args["block"]
    assert grid[0] * block[0] >= min(n, grid[0] * block[0])
    for name in plan.info.trainable:
        t = plan.memory.tensors[name]
        assert span.offset <= t.offset and t.offset + t.nbytes <= span.offset + span.nbytes


def test_a_capture_error_is_named_and_falls_back_unless_capture_is_required():
    plan = cuda_plan("mlp")

    class Syncing(FakeDevice):
        def launch(self, kernel, grid, block, args):
            super().launch(kernel, grid, block, args)
            if self.capturing and kernel.name.startswith("tr_scale_clip"):
                self.synchronize()

    ex = CudaExecutor(plan, Syncing(plan), cuda_graphs="require")
    ex.run("apply")
    with pytest.raises(CaptureError, match=r"ScaleClipGrad.*cuda_graphs='fallback'") as info:
        ex.run("apply")
    assert not info.value.eager_fallback
    with pytest.raises(ValueError, match="cuda_graphs='sometimes'; valid: fallback, require"):
        CudaExecutor(plan, Syncing(plan), cuda_graphs="sometimes")
    off = CudaExecutor(plan, Syncing(plan), cuda_graphs="off")
    for _ in range(3):
        off.run("apply")
    assert "begin_capture" not in [c.op for c in off.device.calls] and not off.graphs
    ex = CudaExecutor(plan, Syncing(plan))
    ex.run("apply")
    with pytest.warns(RuntimeWarning, match=r"ScaleClipGrad.*falls back to eager"):
        ex.run("apply")
    assert ex.eager_phases == {"apply"}
    ex.run("apply")  # eager from now on, no new capture
    assert [c.op for c in ex.device.calls].count("begin_capture") == 1


# --------------------------------------------------------------------------------------------
# Emulation: the launches on the CPU through the kernels' host build
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("cuda_exec_host"))


def emulating_device(lib, plan, reference=None):
    """A HostEmulator of cuda ``plan`` whose arena starts as the numpy ``reference`` plan's
    arena (the same offsets up to WORKSPACE, the cuda plan's own scratch after)."""
    arena = allocate_arena(plan.memory.total_bytes)
    if reference is not None:
        end = reference.memory.regions[Region.WORKSPACE][0]
        assert end == plan.memory.regions[Region.WORKSPACE][0]
        arena[:end] = reference.executor.arena[:end]
    return HostEmulator(plan, lib, arena=arena)


REGIONS = (Region.PARAM, Region.GRAD, Region.OPT_STATE)


@pytest.mark.parametrize("stem", BINDABLE)
def test_emulated_gradients_equal_the_numpy_backend(stem, host_lib):
    """One compute phase: every gradient accumulator, within float32 rounding of the largest
    gradient (sums run in another order; MobileNet's BN biases before a BN have gradients
    that cancel to ~0, so relative errors there mean nothing)."""
    plan = training_plan(stem)
    start = plan.executor.arena.copy()
    device = emulating_device(host_lib, cuda_plan(stem), plan)
    CudaExecutor(cuda_plan(stem), device).run("compute")
    plan.executor.arena[...] = start
    plan.executor.run(phase="compute")
    lo, size = plan.memory.regions[Region.GRAD]
    want = plan.executor.arena[lo:lo + size].view(np.float32)
    got = device.arena[lo:lo + size].view(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    plan.executor.arena[...] = start


@pytest.mark.parametrize("stem", ["mlp", "resnet", "lenet"])
def test_emulated_captured_steps_equal_the_numpy_backend(stem, host_lib):
    """Three steps (eager, captured + launched, replayed) of the whole training step."""
    plan = training_plan(stem)
    start = plan.executor.arena.copy()
    device = emulating_device(host_lib, cuda_plan(stem), plan)
    ex = CudaExecutor(cuda_plan(stem), device)
    run_steps(ex, 3)  # eager, captured + launched, replayed
    plan.executor.arena[...] = start
    for _ in range(3):
        for phase in PHASES:
            plan.executor.run(phase=phase)
    want, got = plan.executor.arena, device.arena
    for region in REGIONS:
        lo, size = plan.memory.regions[region]
        w = want[lo:lo + size].view(np.float32)
        g = got[lo:lo + size].view(np.float32)
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=region.name)
    for name in (plan.info.loss, plan.info.grad_norm):
        t = plan.memory.tensors[name]
        np.testing.assert_allclose(read_host(got, t), read_host(want, t), rtol=1e-5)
    # padded lanes are zero after the steps (every kernel writes them, as zero; the cuDNN
    # calls run here as numpy kernels, which may leave them as they were)
    emulated = {v.name for bn in ex.bound if any(isinstance(c, CudnnCall) for c in bn.calls)
                for v in bn.node.outputs if v is not None}
    for t in plan.memory.tensors.values():
        if t.alias_of is None and not t.span and t.layout.is_padded and t.name not in emulated:
            assert pad_lanes_are_zero(got, t), t.name
    plan.executor.arena[...] = start


@pytest.mark.parametrize("stem", BINDABLE)
def test_emulated_inference_plan_equals_the_numpy_backend(stem, host_lib):
    """An inference plan is one phase, ``forward``, captured on its second run."""
    x = np.random.default_rng(2).standard_normal(SHAPES[stem]).astype(np.float32)
    plan = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=8).plan_for(
        {"input": x})
    cplan = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=8,
                                     backend=CudaBackend(device=FakeDevice)).plan_for({"input": x})
    device = emulating_device(host_lib, cplan)  # a fresh device arena: zeros; the executor
    ex = CudaExecutor(cplan, device)            # uploads the initial contents
    ex.load_constants()
    assert list(ex.phases) == ["forward"]
    outputs = []
    for _ in range(3):
        ex.write_input("input", x)
        ex.run()
        outputs.append(ex.read_output(plan.graph.outputs[0].name))
    assert [c.op for c in device.calls].count("begin_capture") == 1
    write_host(plan.executor.arena, plan.memory.tensors["input"], x)
    plan.executor.run()
    want = read_host(plan.executor.arena, plan.memory.tensors[plan.graph.outputs[0].name])
    for got in outputs:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_host_transfers_pad_and_unpad_on_the_device(host_lib):
    plan = cuda_plan("resnet")
    device = emulating_device(host_lib, plan)
    ex = CudaExecutor(plan, device)
    t = plan.memory.tensors["input"]
    assert t.layout.is_padded
    x = np.random.default_rng(1).standard_normal(t.shape).astype(np.float32)
    device.arena[t.offset:t.offset + t.nbytes] = 7  # garbage in the pad lanes too
    ex.write_input("input", x)
    want = np.zeros_like(device.arena)
    write_host(want, t, x)
    np.testing.assert_array_equal(device.arena[t.offset:t.offset + t.nbytes],
                                  want[t.offset:t.offset + t.nbytes])
    kinds = [(c.op, c.phase) for c in device.calls]
    assert ("memcpy_async", "upload") in kinds and ("launch", "upload") in kinds
    pad = next(c for c in device.calls if c.op == "launch" and c.phase == "upload")
    assert pad.args["kernel"] == KernelRef("layout_convert", "tr_pad_nhwc_f32_f32")
    np.testing.assert_array_equal(ex.read_output("input"), x)
    np.testing.assert_array_equal(ex.read_output("input", "nhwc"), np.moveaxis(x, 1, -1))
    labels = np.arange(4) % 10
    ex.write_input("labels", labels)
    np.testing.assert_array_equal(ex.read_output("labels"), labels)
    ex.write_input("__lr", np.float32(0.5))
    assert ex.read_output("__lr") == np.float32(0.5)
    with pytest.raises(tr_onnx.errors.InputError, match="expected shape"):
        ex.write_input("input", x[:2])
    with pytest.raises(tr_onnx.errors.InputError, match="not an input"):
        ex.write_input("logits", np.zeros((4, 10), np.float32))


def test_inputs_alternate_between_two_host_buffers():
    plan, device, ex = executor("mlp")
    x = np.zeros(SHAPES["mlp"], np.float32)
    srcs = []
    for _ in range(3):
        ex.write_input("input", x)
        srcs.append(device.calls[-1].args["src"].ctypes.data)
        run_steps(ex, 1)
    assert srcs[0] != srcs[1] and srcs[0] == srcs[2]


# --------------------------------------------------------------------------------------------
# The real device: importable everywhere, usable only with a GPU
# --------------------------------------------------------------------------------------------

def test_no_cupy_import_until_the_cuda_backend_is_asked_for():
    code = ("import sys, tr_onnx, tr_onnx.backends.cuda.executor, tr_onnx.backends.cuda.device;"
            "print('cupy' in sys.modules, 'cudnn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_cuda_available_never_raises_and_the_device_says_why():
    plan = training_plan("mlp")
    if not cuda_available():  # CI: no driver; CupyDevice refuses with the reason
        with pytest.raises(RuntimeError, match="usable GPU"):
            CupyDevice(plan.memory)
    else:  # a GPU machine: one aligned arena of the plan's size
        device = CupyDevice(plan.memory)
        assert device.arena_base % 256 == 0 and device.arena.nbytes == plan.memory.total_bytes


def test_emulated_transformer_steps_equal_the_numpy_backend(host_lib):
    """Three captured transformer steps (batched MatMul, Softmax, LayerNorm(Grad), Gather(Grad),
    Transpose, Erf, broadcast Sub, ReduceMean on matmul.cu, reduce.cu, normalization.cu,
    indexing.cu, tensor.cu, unary.cu, elementwise.cu). The attention's key bias has a
    gradient that cancels to rounding noise (softmax ignores a per-row shift), which Adam
    normalises into full steps of either sign: those parameters (and the span's zero
    alignment gaps) are left out."""
    plan = training_plan("transformer")
    start = plan.executor.arena.copy()
    plan.executor.run(phase="compute")
    lo, size = plan.memory.regions[Region.GRAD]
    g0 = plan.executor.arena[lo:lo + size].view(np.float32).copy()
    noise = np.abs(g0) <= 1e-6 * np.abs(g0).max()
    plan.executor.arena[...] = start
    device = emulating_device(host_lib, cuda_plan("transformer"), plan)
    run_steps(CudaExecutor(cuda_plan("transformer"), device), 3)
    plan.executor.arena[...] = start
    for _ in range(3):
        for phase in PHASES:
            plan.executor.run(phase=phase)
    want, got = plan.executor.arena, device.arena
    plo, psize = plan.memory.regions[Region.PARAM]
    assert psize == size and 0 < noise.sum() < 0.05 * noise.size  # with alignment gaps
    w = want[plo:plo + psize].view(np.float32)[~noise]
    g = got[plo:plo + psize].view(np.float32)[~noise]
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)
    for name in (plan.info.loss, plan.info.grad_norm):
        t = plan.memory.tensors[name]
        np.testing.assert_allclose(read_host(got, t), read_host(want, t), rtol=1e-5)
    plan.executor.arena[...] = start


def test_emulated_data_movement_and_pool_ops_equal_the_numpy_backend(host_lib):
    """Slice, Concat, Transpose, Gather, LogSoftmax, a rank-4 MatMul and AveragePool /
    MaxPool (channels-last) of a small inference plan."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("starts", [1, 0]), ("ends", [5, 8]), ("axes", [2, 3]), ("steps", [1, 2]),
        ("idx", [2, 0]))] + [numpy_helper.from_array(
            rng.standard_normal((4, 4)).astype(np.float32), "w")]
    nodes = [
        helper.make_node("AveragePool", ["input"], ["ap"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], count_include_pad=1, ceil_mode=1),
        helper.make_node("MaxPool", ["input"], ["mp"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], ceil_mode=1),
        helper.make_node("Concat", ["ap", "mp"], ["cat"], axis=1),
        helper.make_node("Slice", ["cat", "starts", "ends", "axes", "steps"], ["sl"]),
        helper.make_node("Transpose", ["sl"], ["tr"], perm=[0, 1, 3, 2]),
        helper.make_node("Gather", ["tr", "idx"], ["ga"], axis=1),
        helper.make_node("MatMul", ["ga", "w"], ["mm"]),
        helper.make_node("LogSoftmax", ["mm"], ["logits"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "moves", [helper.make_tensor_value_info(
        "input", TensorProto.FLOAT, [2, 3, 8, 8])], [helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT, [2, 2, 3, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    plan = tr_onnx.InferenceSession(model, channel_align=8).plan_for({"input": x})
    cplan = tr_onnx.InferenceSession(model, channel_align=8,
                                     backend=CudaBackend(device=FakeDevice)).plan_for({"input": x})
    device = emulating_device(host_lib, cplan)
    ex = CudaExecutor(cplan, device)
    ex.load_constants()
    ex.write_input("input", x)
    ex.run()
    got = ex.read_output("logits")
    write_host(plan.executor.arena, plan.memory.tensors["input"], x)
    plan.executor.run()
    want = read_host(plan.executor.arena, plan.memory.tensors["logits"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    kernels = {c.kernel.name for b in ex.bound for c in b.calls if isinstance(c, Launch)}
    assert {"tr_avgpool_fwd_f32", "tr_maxpool_fwd_f32", "tr_strided_copy_b4", "tr_gather_b4",
            "tr_matmul_f32", "tr_softmax_f32"} <= kernels
