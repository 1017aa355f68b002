"""Adding an op family touches only its own files: NumPy kernel, CUDA kernel and gradient rule.

The family is the test double in ``tests/scaled_square_family`` (``ai.tr_onnx.test``
ScaledSquare, y = alpha * x * x, and its named backward op ScaledSquareGrad), laid out as a
builtin family: ``ops.py`` (OpDefs with NumPy kernels and the gradient rule), ``cuda.py``
(KernelDefs whose binding factories reserve their own scratch and launch the family's kernels)
and ``scaled_square.cu``. Sessions take the two op sets as ``plugins=[ops, cuda]``; nothing in
tr_onnx/ names the family. Checked here:

* the registry (and ``tr-onnx ops``) shows numpy and cuda kernels for both ops;
* the cuda plan's scratch is exactly what the cuda factories asked for, node by node, and the
  NumPy kernel's distinctive (x.size, 3) float64 scratch is nowhere in it;
* a binding gets its scratch buffers at bind time in the order its factory asked for them;
* three SGD steps on the cuda backend (host emulator: the family's source compiled for the CPU
  on first use) equal the numpy backend's; ScaledSquare's gradient matches float64 finite
  differences of an ``onnx.reference`` implementation;
* the emulator compiles a source a kernel brings once per process, and a source that is not
  host C++ is an error naming its family.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from gradcheck import GradCase, check_case
from onnx import helper, numpy_helper
from onnx.reference.op_run import OpRun
from scaled_square_family import cuda as family_cuda
from scaled_square_family import ops as family_ops

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import kernel_factory
from tr_onnx.backends.cuda.device import KernelRef, compile_text_nvrtc
from tr_onnx.backends.cuda.sources import compile_options, nvrtc_compile
from tr_onnx.cli import list_ops
from tr_onnx.compiler import kernel_context
from tr_onnx.opdef import KernelDef
from tr_onnx.optim import SGD
from tr_onnx.registry import OpKey, build_registry
from tr_onnx.testing import host_emulator as emulator
from tr_onnx.testing.host_emulator import HostCompileError, build_host_library

FAMILY = [family_ops, family_cuda]
DOMAIN = family_ops.DOMAIN
OPS = ("ScaledSquare", "ScaledSquareGrad")
BATCH, N_IN, HIDDEN, CLASSES = 4, 6, 5, 3
ALPHA = 0.75


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The device of the sessions' ``CudaBackend``: the host emulator over tr_onnx's kernels
    built for the CPU."""
    return emulator.host_emulator(build_host_library(tmp_path_factory.mktemp("host_kernels")))


def mlp(alpha: float = ALPHA) -> onnx.ModelProto:
    """input -> Gemm -> ScaledSquare(alpha) -> Gemm -> scores [BATCH, CLASSES], float32."""
    rng = np.random.default_rng(0)
    weights = {"w1": (N_IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, CLASSES), "b2": (CLASSES,)}
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n)
             for n, s in weights.items()]
    nodes = [helper.make_node("Gemm", ["input", "w1", "b1"], ["h"]),
             helper.make_node("ScaledSquare", ["h"], ["s"], domain=DOMAIN, alpha=alpha),
             helper.make_node("Gemm", ["s", "w2", "b2"], ["scores"])]
    graph = helper.make_graph(
        nodes, "scaled_square_mlp",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [BATCH, N_IN])],
        [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, [BATCH, CLASSES])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(DOMAIN, 1)])


def batch(seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    x = rng.standard_normal((BATCH, N_IN)).astype(np.float32)
    return {"input": x}, rng.integers(0, CLASSES, BATCH)


def train(steps: int, **kw) -> tuple[tr_onnx.TrainingSession, list[float]]:
    sess = tr_onnx.TrainingSession(mlp(), optimizer=SGD(lr=0.1, momentum=0.9), plugins=FAMILY,
                                   **kw)
    return sess, [sess.train_step(*batch(i)) for i in range(steps)]


def node_of(plan, op_type: str) -> tuple[int, object]:
    """(schedule index, node) of the plan's only ``op_type`` node."""
    (found,) = [(i, n) for i, n in enumerate(plan.graph.nodes) if n.op_type == op_type]
    return found


def requests(node, backend: str) -> list[tuple[tuple[int, ...], np.dtype]]:
    """The scratch ``node``'s ``backend`` kernel factory asks for (run again: the oracle)."""
    ctx = kernel_context(node, backend)
    factory = node.opdef.kernels[backend]
    (kernel_factory(factory) if backend == "cuda" else factory)(ctx)
    return ctx.workspace_requests


def described(scratch) -> list[tuple[tuple[int, ...], np.dtype, int]]:
    return [(tuple(t.shape), t.dtype, t.nbytes) for t in scratch]


def nbytes_of(reqs) -> list[tuple[tuple[int, ...], np.dtype, int]]:
    return [(shape, dtype, math.prod(shape) * dtype.itemsize) for shape, dtype in reqs]


# ---- the registry ----------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_the_registry_has_a_numpy_and_a_cuda_kernel_for_each_op_of_the_family(op):
    registry = build_registry(FAMILY, autoload=False)
    keys = {k for k in registry.keys() if k.domain == DOMAIN and k.op_type == op}
    assert keys == {OpKey(DOMAIN, op, 1, "numpy"), OpKey(DOMAIN, op, 1, "cuda")}
    assert registry.source_of(OpKey(DOMAIN, op, 1, "numpy")) == family_ops.__name__
    assert registry.source_of(OpKey(DOMAIN, op, 1, "cuda")) == family_cuda.__name__
    numpy_def = registry.lookup(DOMAIN, op, 1, "numpy")
    cuda_def = registry.lookup(DOMAIN, op, 1, "cuda")
    assert numpy_def is cuda_def  # one OpDef: its rules and both kernels
    assert set(numpy_def.kernels) == {"numpy", "cuda"}
    factory = {"ScaledSquare": family_cuda.scaled_square_factory,
               "ScaledSquareGrad": family_cuda.scaled_square_grad_factory}[op]
    assert numpy_def.kernels["cuda"] is factory
    assert (numpy_def.gradient is not None) == (op == "ScaledSquare")
    assert registry.plugins[family_cuda.__name__]["ops"] == [
        f"cuda kernel of {DOMAIN}.{name}" for name in OPS]


def test_tr_onnx_ops_lists_both_backends_for_the_family(monkeypatch):
    monkeypatch.setattr(tr_onnx.registry, "_default", build_registry(FAMILY, autoload=False))
    rows = {r["op"]: r for r in list_ops() if r["domain"] == DOMAIN}
    assert set(rows) == set(OPS)
    for op, row in rows.items():
        assert row["backend_versions"] == {"cuda": [1], "numpy": [1]}, op
        assert row["source"] == sorted([family_ops.__name__, family_cuda.__name__]), op
    assert rows["ScaledSquare"]["differentiable"] and not rows["ScaledSquareGrad"]["differentiable"]


# ---- the plans' scratch ----------------------------------------------------------------------

def test_the_numpy_plan_carries_the_numpy_kernels_scratch():
    """The control: on numpy, ScaledSquare's scratch is the NumPy kernel's (x.size, 3) float64
    block, so its absence from the cuda plan below means something."""
    sess, _ = train(1, backend="numpy")
    plan = sess._state.active
    index, node = node_of(plan, "ScaledSquare")
    want = nbytes_of(requests(node, "numpy"))
    assert want == [((BATCH * HIDDEN, 3), np.dtype(np.float64), BATCH * HIDDEN * 3 * 8)]
    assert described(plan.memory.workspaces[index]) == want


def test_the_cuda_plan_has_the_cuda_factories_scratch_and_no_numpy_scratch(device):
    sess, _ = train(1, backend=CudaBackend(device=device))
    plan = sess._state.active
    assert plan.backend == "cuda"
    for op in OPS:
        index, node = node_of(plan, op)
        want = nbytes_of(requests(node, "cuda"))
        assert want == [((BATCH * HIDDEN,), np.dtype(np.float32), BATCH * HIDDEN * 4)], op
        assert described(plan.memory.workspaces[index]) == want, op
    # every node that runs: its scratch is what its cuda factory asked for, nothing else
    for index, node, _ in plan.bindings:
        assert described(plan.memory.workspaces.get(index, [])) == nbytes_of(
            requests(node, "cuda")), node.label
    _, forward = node_of(plan, "ScaledSquare")
    numpy_scratch = {(shape, dtype) for shape, dtype in requests(forward, "numpy")}
    everywhere = {(tuple(t.shape), t.dtype) for ws in plan.memory.workspaces.values() for t in ws}
    assert numpy_scratch and not numpy_scratch & everywhere


class OrderSpy:
    """An op set overriding ScaledSquare's cuda kernel with the family's factory plus two more
    scratch buffers (sizes out of order: 80, 6 and 800 bytes), recording what ``b.ws(k)``
    returns at bind time."""

    EXTRA = (((3,), np.float16), ((100,), np.float64))

    def __init__(self):
        self.requests, self.seen = [], []

    @tr_onnx.hookimpl
    def tr_onnx_op_definitions(self):
        def factory(ctx):
            bind = family_cuda.scaled_square_factory(ctx)  # its scratch is buffer 0
            for shape, dtype in self.EXTRA:
                ctx.workspace(shape, dtype)
            self.requests = list(ctx.workspace_requests)

            def spy(b, node):
                self.seen = [b.ws(k) for k in range(len(self.requests))]
                return bind(b, node)

            return spy

        return [KernelDef("ScaledSquare", "cuda", factory, domain=DOMAIN, overrides=True)]


def test_a_binding_gets_its_scratch_buffers_in_the_order_it_asked_for_them(device):
    spy = OrderSpy()
    sess = tr_onnx.InferenceSession(mlp(), backend=CudaBackend(device=device),
                                    plugins=[*FAMILY, spy])
    feed, _ = batch(0)
    plan = sess.plan_for(feed)
    index, _ = node_of(plan, "ScaledSquare")
    scratch = plan.memory.workspaces[index]
    assert described(scratch) == nbytes_of(spy.requests)
    assert [t.nbytes for t in scratch] == [BATCH * HIDDEN * 4, 6, 800]
    base = plan.executor.device.arena_base
    assert [(buf.ptr, buf.nbytes, buf.writes) for buf in spy.seen] == [
        (base + t.offset, t.nbytes, True) for t in scratch]
    assert len({buf.ptr for buf in spy.seen}) == 3
    # the family's binding still reads its buffer 0: the outputs are the numpy backend's
    want = tr_onnx.InferenceSession(mlp(), plugins=FAMILY).run(None, feed)[0]
    np.testing.assert_allclose(sess.run(None, feed)[0], want, rtol=1e-5, atol=1e-6)


# ---- training and the gradient ---------------------------------------------------------------

def test_three_sgd_steps_on_cuda_equal_numpy(device):
    """The forward differs by at most an ulp per element (NumPy rounds alpha * x * x once from
    float64, the kernels round x * x and then the product in float32); everything else is the
    same arithmetic, so rtol 1e-5 holds for losses and parameters."""
    ref, want = train(3, backend="numpy")
    sess, got = train(3, backend=CudaBackend(device=device))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    a, b = sess.parameters(), ref.parameters()
    assert a.keys() == b.keys() == {"w1", "b1", "w2", "b2"}
    for name in b:
        assert not np.array_equal(b[name], mlp_initializer(name)), name  # it trained
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)
    dev = sess._state.active.executor.device
    launched = {c.args["kernel"] for c in dev.calls if c.op == "launch"}
    assert {(k.family, k.name) for k in launched if k.family == family_cuda.SOURCE.name} == {
        (family_cuda.SOURCE.name, f"tr_scaled_square_{k}_f32") for k in ("mul", "scale")}


def mlp_initializer(name: str) -> np.ndarray:
    (init,) = [t for t in mlp().graph.initializer if t.name == name]
    return numpy_helper.to_array(init)


class ScaledSquare(OpRun):
    """The ``onnx.reference`` oracle: y = alpha * x**2, written apart from the family
    (``new_ops`` matches it by class name and ``op_domain``)."""

    op_domain = DOMAIN
    op_schema = None

    def _run(self, x, alpha=None):
        alpha = family_ops.ALPHA if alpha is None else alpha
        return ((alpha * x ** 2).astype(x.dtype),)


@pytest.mark.parametrize("alpha, shape", [(ALPHA, (3, 4)), (-1.5, (2, 3, 5)), (None, (7,))],
                         ids=["alpha-0.75", "alpha-neg-1.5-rank3", "alpha-default"])
def test_scaled_square_gradient_matches_finite_differences(alpha, shape):
    x = np.random.default_rng(1).standard_normal(shape)
    case = GradCase(f"scaled_square-{alpha}-{len(shape)}", "ScaledSquare", [x],
                    attrs={} if alpha is None else {"alpha": alpha}, domain=DOMAIN,
                    reference_ops=(ScaledSquare,))
    check_case(case, plugins=FAMILY)


# ---- the emulator's builds of sources that kernels bring -------------------------------------

def test_a_family_source_is_compiled_once_per_process(device, monkeypatch):
    monkeypatch.setattr(emulator, "_FAMILY_LIBS", {})
    built = []
    compile_host = emulator.compile_host

    def counting(text, *args, **kw):
        built.append(text)
        return compile_host(text, *args, **kw)

    monkeypatch.setattr(emulator, "compile_host", counting)
    feed, _ = batch(0)
    for _ in range(2):  # two sessions, two plans (forward, and training with the backward)
        tr_onnx.InferenceSession(mlp(), backend=CudaBackend(device=device), plugins=FAMILY).run(
            None, feed)
        train(1, backend=CudaBackend(device=device))
    assert built == [family_cuda.SOURCE.text]


def test_a_source_that_is_not_host_cxx_is_an_error_naming_its_family(device):
    """The example plugin's Swish is NVRTC-only (``__global__``, ``__device__``, PTX ``asm``,
    ``__expf``): no host build, and the message says whose source it is, with the compiler's
    log."""
    from tr_onnx_example_ops import swish  # installed by the test command
    sess = tr_onnx.InferenceSession(mlp(), backend=CudaBackend(device=device), plugins=FAMILY)
    dev = sess.plan_for(batch(0)[0]).executor.device
    family = "plugin:com.example/Swish"
    ref = KernelRef(family, "swish_f32", swish.SWISH_CUDA.source)
    with pytest.raises(HostCompileError,
                       match=rf"kernel family '{family}'(.|\n)*__global__") as info:
        dev.prepare_kernel(ref)
    assert isinstance(info.value, tr_onnx.TrOnnxError)
    missing = KernelRef(family_cuda.SOURCE.name, "tr_no_such_kernel", family_cuda.SOURCE.text)
    with pytest.raises(AttributeError, match="family 'scaled_square' has no kernel"):
        dev.prepare_kernel(missing)


# ---- the same source on the device -----------------------------------------------------------

def test_the_family_source_compiles_with_nvrtc_as_the_builtin_families_do():
    image = nvrtc_compile(family_cuda.SOURCE.text, "scaled_square.cu", compile_options(),
                          family_cuda.SOURCE.name)
    assert all(name.encode() in image for name in family_cuda.SOURCE.kernels)


def test_the_device_compiles_a_family_source_the_way_it_compiles_builtin_ones():
    """CupyDevice compiles a source an op set brings with the builtin families' options
    (kernels/ and the CUDA headers on the include path, --fmad=false)."""
    cubin = compile_text_nvrtc(family_cuda.SOURCE.text, family_cuda.SOURCE.name, "sm_90")
    assert all(k.encode() + b"\0" in cubin for k in family_cuda.SOURCE.kernels)
