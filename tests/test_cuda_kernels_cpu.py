"""The cuda backend's own kernels, checked without a GPU (tr_onnx/backends/cuda/kernels).

1. Every registered source compiles with NVRTC for sm_90 (CuPy's low-level NVRTC binding needs
   no driver) and the cubin defines every kernel the registry names; each family's text
   defines exactly its table's kernels, no kernel twice across families, no helper in two
   files.
2. The same sources, compiled by the host C++ compiler (``elementwise.cuh`` makes a kernel a
   plain function whose grid-stride loop one "thread" runs to the end), are called through
   ctypes and compared with the NumPy kernels: unary ops through ``InferenceSession`` and
   their backward through ``tr_onnx.training.gradients.vjp``, the optimizer updates through
   the numpy kernels of ops/optimizers.py, the losses through ops/losses.py, NHWC pad/unpad
   against ``StridedLayout.channels_last(shape, 8)``, loss scaling against torch's kernels.

Tolerances. fp32: plain arithmetic (+ - * /, sqrt) is correctly rounded on both sides and done
in the same order with contraction off, so binary ops, layouts, conversions, optimizer updates
and the piecewise-linear activations must match bit for bit. Formulas with a libm call (exp,
tanh, expm1, log1p) differ by the two libraries' errors (glibc here, CUDA's <= 1-2 ulp on the
device; NumPy's SIMD float32 exp/log/tanh): 4 ulp allowed (3 seen); Gelu 8 (NumPy's float64
Gelu is itself 4 ulp off near x = -5). Where a formula cancels (1 + tanh(u), 1 + erf(u) in the
negative tails), a few ulp of the terms before the cancellation are many ulp of the small
result, so there the bound is absolute: that many ulp of the cancelled terms' size (the
``scale`` column). fp16 / bf16 storage (compute in fp32): within 1 ulp of NumPy's fp32 result
on the same upcast inputs, rounded to the storage type (or within the fp32 absolute bound
where that applies). A backward in fp16/bf16 reads the rounded forward output, which NumPy's
fp32 backward never sees, so it must equal the host fp32 kernel on the same rounded inputs,
rounded: that checks the storage path, the fp32 comparison the math.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import tr_onnx
from tr_onnx.backends.cuda import sources
from tr_onnx.backends.cuda.ops import elementwise as cuda_elementwise
from tr_onnx.backends.cuda.ops import layout_convert as cuda_layout
from tr_onnx.backends.cuda.ops import normalization as cuda_norm
from tr_onnx.backends.cuda.ops import optimizers as cuda_optim
from tr_onnx.backends.cuda.ops import unary as cuda_unary
from tr_onnx.errors import TrOnnxError
from tr_onnx.layouts import StridedLayout
from tr_onnx.opdef import KernelContext, TensorInfo
from tr_onnx.ops import batch_norm as np_norm
from tr_onnx.ops import optimizers as np_optim
from tr_onnx.testing.host_emulator import build_host_library, host_compiler
from tr_onnx.training.gradients import vjp

F32_EPS = float(np.finfo(np.float32).eps)

# ---- 1. NVRTC ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(sources.SOURCES))
def test_source_compiles_with_nvrtc_for_sm90(family):
    start = time.perf_counter()
    cubin = sources.compile_nvrtc(family, "sm_90")
    elapsed = time.perf_counter() - start
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF", family
    missing = [k for k in sources.SOURCES[family].kernels if k.encode() + b"\0" not in cubin]
    assert not missing, f"{family}: the cubin lacks {missing}"
    assert elapsed < 20, f"{family}: NVRTC took {elapsed:.1f} s"


def test_nvrtc_is_the_version_the_tests_meant():
    """The test extra's NVRTC (13.x), or the one tests/test_gpu_image_versions.py loaded for
    this run (``TR_ONNX_EXPECT_NVRTC``): the GPU image's 13.0."""
    from cupy.cuda import nvrtc

    major, minor = nvrtc.getVersion()
    expected = os.environ.get("TR_ONNX_EXPECT_NVRTC")
    if expected:
        assert f"{major}.{minor}" == expected
    else:
        assert major == 13


def test_compile_all_nvrtc_covers_every_family():
    # ptx for compute_90 exercises the other output path (on the family holding Cast)
    ptx = sources.compile_nvrtc("elementwise", "compute_90")
    assert b".entry tr_convert_f32_f16" in ptx
    assert set(sources.SOURCES) == {"unary", "elementwise", "tensor", "indexing", "matmul",
                                    "pool", "normalization", "reduce", "losses", "optimizers",
                                    "layout_convert", "amp", "resize", "recurrent",
                                    "spatial_transform", "lrn", "random", "quantize",
                                    "attention", "dynamic"}


def test_kernel_names_are_unique_and_suffixed():
    names = [k for s in sources.SOURCES.values() for k in s.kernels]
    assert len(names) == len(set(names))
    assert all(k.startswith("tr_") for k in names)


def _defined_kernels(text: str) -> list[str]:
    """The ``extern "C"`` kernels ``text`` defines once the host preprocessor has expanded it."""
    done = subprocess.run([host_compiler(), "-E", "-P", "-x", "c++", "-std=c++17",
                           f"-I{sources.KERNEL_DIR}", "-"], input=text, capture_output=True,
                          text=True, check=True)
    return re.findall(r'extern "C" void (tr_\w+)\s*\(', done.stdout)


@pytest.mark.parametrize("family", list(sources.SOURCES))
def test_family_text_defines_exactly_the_kernels_its_table_names(family):
    src = sources.SOURCES[family]
    defined = Counter(_defined_kernels(src.text))
    assert not [k for k, n in defined.items() if n > 1], f"{family}: defined twice"
    assert sorted(defined) == sorted(src.kernels), family


def test_every_kernel_is_defined_by_exactly_one_family():
    names = Counter(k for s in sources.SOURCES.values() for k in s.kernels)
    assert not [k for k, n in names.items() if n > 1]
    defined = _defined_kernels("\n".join(s.text for s in sources.SOURCES.values()))
    assert sorted(defined) == sorted(names)
    assert all(sources.family_of(k) in sources.SOURCES for k in names)


def test_kernel_folder_holds_one_file_per_family_and_the_shared_headers():
    files = {p.name for p in sources.KERNEL_DIR.iterdir() if p.suffix in (".cu", ".cuh")}
    assert files == {s.file for s in sources.SOURCES.values()} | set(sources.HEADERS)
    assert all(s.file == f"{name}.cu" for name, s in sources.SOURCES.items())


_HELPER = re.compile(r"^(?:#define\s+(\w+)|(?:template\s*<[^>]*>\s*)?TR_HD\b[^(=]*?\b(\w+)\s*\()",
                     re.M)


def test_no_helper_is_defined_in_two_kernel_files():
    """A macro or device helper lives in one file: shared ones in a header (HEADERS)."""
    where: dict[str, set[str]] = {}
    for path in sorted(sources.KERNEL_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            for m in _HELPER.finditer(path.read_text()):
                where.setdefault(m.group(1) or m.group(2), set()).add(path.name)
    assert "tr_strided_offset" in where and "TR_UNARY_FWD" in where  # it finds both kinds
    assert {k: f for k, f in where.items() if len(f) > 1} == {}


def test_nvrtc_rejection_is_a_tr_onnx_error_with_the_log():
    assert issubclass(sources.KernelCompileError, TrOnnxError)
    bad = '#include "elementwise.cuh"\nTR_KERNEL void tr_bad(float* y) { *y = no_such_name; }\n'
    with pytest.raises(sources.KernelCompileError, match="no_such_name"):
        sources.nvrtc_compile(bad, "bad.cu", sources.compile_options(), "bad.cu")


# ---- 2. the host build ----------------------------------------------------------------------

class HostKernels:
    """The whole registry compiled into one shared library (``build_host_library``, the
    emulator's build, with ``-O2 -Wall -Werror``); ``call(name, *args)`` with numpy arrays
    (passed as pointers), None (a null pointer) and ctypes scalars."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def __call__(self, name, *args):
        cargs = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray)
                 else ctypes.c_void_p(None) if a is None else a for a in args]
        fn = getattr(self.lib, name)
        fn.argtypes = [type(a) for a in cargs]
        fn.restype = None
        fn(*cargs)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return HostKernels(build_host_library(tmp_path_factory.mktemp("cuda_host"),
                                          extra_flags=("-O2", "-Wall", "-Werror")))


LL, F32, F64, I32 = ctypes.c_longlong, ctypes.c_float, ctypes.c_double, ctypes.c_int


# storage helpers: bf16 as uint16 bits (numpy has no bfloat16); torch rounds it for us
def to_bf16(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _to_f16(x) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as intended
        return np.asarray(x, np.float32).astype(np.float16)


STORAGE = {  # dt: (numpy storage dtype, fp32 -> storage, storage -> fp32)
    "f32": (np.float32, lambda x: np.asarray(x, np.float32), lambda s: s),
    "f16": (np.float16, lambda x: _to_f16(x), lambda s: s.astype(np.float32)),
    "bf16": (np.uint16, to_bf16, from_bf16),
}


def poisoned(shape, dt) -> np.ndarray:
    """An output buffer full of NaN: an element a kernel forgets to write shows."""
    return STORAGE[dt][1](np.full(shape, np.nan, np.float32))


def ordered(x: np.ndarray) -> np.ndarray:
    """Floats (as fp32) mapped to integers in value order, consecutive floats 1 apart;
    +0 and -0 both map to 0."""
    i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_close_f32(got, want, ulps=0, scale=None, what=""):
    """|got - want| within ``ulps`` ulp of want, or within ``ulps`` ulp of ``scale`` (the
    magnitude of the intermediates a cancelling formula subtracts); NaN where NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    dist = np.abs(ordered(got) - ordered(want))
    ok = dist <= ulps
    if scale is not None:
        bound = ulps * F32_EPS * np.maximum(np.abs(np.asarray(scale, np.float64)), 1e-30)
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf: equal already
            ok |= np.abs(got.astype(np.float64) - want) <= bound
    ok |= nan
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (f"{what}: {bad.size} elements off by more than {ulps} ulp, e.g. "
                           f"index {bad[:5]}: got {got.flat[bad[:5]]} want {want.flat[bad[:5]]}"
                           f" ({dist.flat[bad[:5]]} ulp)")


def assert_storage_within_1ulp(got, want_f32, dt, what="", abs_bound=None):
    """``got`` (storage ``dt``) within 1 ulp of ``want_f32`` rounded to ``dt``; or, where the
    fp32 reference is only accurate to ``abs_bound`` (a cancelling formula), within that."""
    want = STORAGE[dt][1](want_f32)
    as_f32 = STORAGE[dt][2]
    nan = np.isnan(as_f32(want))
    np.testing.assert_array_equal(np.isnan(as_f32(got)), nan, err_msg=f"{what}: NaN positions")
    dist = np.where(nan, 0, _storage_dist(got, want, dt))
    if abs_bound is not None:
        with np.errstate(invalid="ignore"):
            close = np.abs(as_f32(got).astype(np.float64) - want_f32) <= abs_bound
        dist = np.where(close, 0, dist)
    assert dist.max(initial=0) <= 1, (f"{what}: {dt} off by {dist.max()} ulp at "
                                      f"{np.flatnonzero(dist > 1)[:5]}")


def _storage_dist(a, b, dt):
    """ulp distance between two arrays of 16-bit storage (as their bit patterns) or fp32."""
    if dt == "f32":
        return np.abs(ordered(a) - ordered(b))
    ia, ib = (v.view(np.int16).astype(np.int64) for v in (a, b))
    ia, ib = (np.where(v < 0, -(v & 0x7FFF), v) for v in (ia, ib))
    return np.abs(ia - ib)


# ---- unary ops --------------------------------------------------------------------------------

def _single_node(op, x, attrs=None, consts=(), opset=20):
    """A one-node model y = op(x, *consts)."""
    inits = [numpy_helper.from_array(np.asarray(c, np.float32), f"c{i}")
             for i, c in enumerate(consts)]
    node = helper.make_node(op, ["x"] + [t.name for t in inits], ["y"], **(attrs or {}))
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(x.shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _grid(domain: str) -> np.ndarray:
    """float32 inputs: a dense grid, exact breakpoints (0, +-3), tails, and a few specials."""
    dense = np.linspace(-12, 12, 4801, dtype=np.float32)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 3.0, -3.0, 0.5, -0.5, 20, -20,
                        40, -40, 87, -87, 100, -100, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([dense, special])
    if domain == "positive":
        x = np.concatenate([np.abs(x), np.geomspace(1e-30, 1e30, 601, dtype=np.float32),
                            np.array([-1.0], np.float32)])
    return x


class Unary:
    """A table row: ONNX op and attrs, kernel stem, (a, b), the fp32 tolerance in ulp (0:
    exact) and for formulas that cancel, ``scale(x, y)``: the magnitude of the cancelled
    terms (forward; ``bscale(x, y, gy)`` for the backward)."""

    def __init__(self, op, stem, attrs=None, ab=(0.0, 0.0), ulps=0, scale=None, bulps=None,
                 bscale=None, domain="real", consts=(), opset=20):
        self.op, self.stem, self.attrs, self.ab = op, stem, attrs or {}, ab
        self.ulps, self.scale = ulps, scale
        self.bulps = ulps if bulps is None else bulps
        self.bscale, self.domain, self.consts, self.opset = bscale, domain, consts, opset


def _one_plus(x, y):  # gelu-type: x/2 (1 + ...) cancels to y; the terms are ~|x|
    with np.errstate(invalid="ignore"):
        return np.abs(np.asarray(x, np.float64)) + 1


def _grad_terms(x, y, gy):
    return np.abs(gy) * (np.abs(x.astype(np.float64)) + 1) ** 2


LIBM = 4  # glibc vs NumPy's SIMD float32 exp/log/tanh (observed <= 3)
GELU = 8  # NumPy's float64 Gelu is itself 4 ulp off near x = -5, ours 3 (see the test below)

UNARY = {
    "Relu": Unary("Relu", "relu"),
    "LeakyRelu": Unary("LeakyRelu", "leaky_relu", {"alpha": 0.1}, (np.float32(0.1), 0.0)),
    "Elu": Unary("Elu", "elu", {"alpha": 1.3}, (np.float32(1.3), 0.0), ulps=LIBM,
                 bscale=lambda x, y, gy: np.abs(gy) * 2.3),
    "Sigmoid": Unary("Sigmoid", "sigmoid", ulps=LIBM, bscale=lambda x, y, gy: np.abs(gy)),
    "HardSigmoid": Unary("HardSigmoid", "hardsigmoid", {"alpha": 0.3, "beta": 0.4},
                         (np.float32(0.3), np.float32(0.4))),
    "HardSwish": Unary("HardSwish", "hardswish"),
    "Tanh": Unary("Tanh", "tanh", ulps=LIBM, bscale=lambda x, y, gy: np.abs(gy)),
    "Gelu": Unary("Gelu", "gelu", ulps=GELU, scale=_one_plus, bscale=_grad_terms),
    "GeluTanh": Unary("Gelu", "gelu_tanh", {"approximate": "tanh"}, ulps=GELU, scale=_one_plus,
                      bscale=_grad_terms),
    "Softplus": Unary("Softplus", "softplus", ulps=LIBM, bscale=lambda x, y, gy: np.abs(gy)),
    "Exp": Unary("Exp", "exp", ulps=LIBM, bulps=0),
    "Log": Unary("Log", "log", ulps=LIBM, bulps=0, domain="positive"),
    "Sqrt": Unary("Sqrt", "sqrt", domain="positive"),
    "Neg": Unary("Neg", "neg"),
    "Abs": Unary("Abs", "abs"),
    "Sign": Unary("Sign", "sign", opset=13),
    "Clip": Unary("Clip", "clip", ab=(np.float32(-1.5), np.float32(2.25)),
                  consts=(np.float32(-1.5), np.float32(2.25)), opset=13),
    # the forward-only ops (their gradients are chains of standard nodes); tolerances in
    # tests/test_cuda_elementwise_ops_cpu.py's docstring
    **{op: Unary(op, op.lower(), ulps=LIBM, opset=22) for op in (
        "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")},
    **{op: Unary(op, op.lower(), opset=22) for op in ("Reciprocal", "Floor", "Ceil", "Round",
                                                      "Softsign")},
    "Celu": Unary("Celu", "celu", {"alpha": 0.7}, (np.float32(0.7), 0.0), ulps=LIBM),
    "Selu": Unary("Selu", "selu", {"alpha": 1.5, "gamma": 1.2},
                  (np.float32(1.5), np.float32(1.2)), ulps=LIBM),
    "Mish": Unary("Mish", "mish", ulps=LIBM),
    "Shrink": Unary("Shrink", "shrink", {"bias": 0.25, "lambd": 0.5},
                    (np.float32(0.25), np.float32(0.5)), opset=9),
    "ThresholdedRelu": Unary("ThresholdedRelu", "thresholded_relu", {"alpha": 0.3},
                             (np.float32(0.3), 0.0), opset=22),
}


def test_unary_table_covers_the_registry():
    assert {u.stem for u in UNARY.values()} == set(cuda_unary.UNARY_OPS)
    assert {op for op in cuda_unary.ONNX_UNARY} <= {u.op for u in UNARY.values()}


def _numpy_forward(u: Unary, x: np.ndarray) -> np.ndarray:
    model = _single_node(u.op, x, u.attrs, u.consts, u.opset)
    return tr_onnx.InferenceSession(model).run(["y"], {"x": x})[0]


def _numpy_backward(u: Unary, x: np.ndarray, gy: np.ndarray):
    model = _single_node(u.op, x, u.attrs, u.consts, u.opset)
    y, grads = vjp(model, {"x": x}, ["x"], gy)
    return y, grads["x"]


def _host_unary_fwd(host, stem, dt, x32, ab):
    xs = STORAGE[dt][1](x32)
    ys = poisoned(xs.shape, dt)
    host(f"tr_{stem}_fwd_{dt}", xs, ys, LL(xs.size), F32(ab[0]), F32(ab[1]))
    return xs, ys


def _host_unary_bwd(host, stem, dt, x, y, gy, ab):
    gx = np.empty_like(gy)
    host(f"tr_{stem}_bwd_{dt}", x, y, gy, gx, LL(gy.size), F32(ab[0]), F32(ab[1]))
    return gx


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_forward_fp32_matches_numpy(host, name):
    u = UNARY[name]
    x = _grid(u.domain)
    want = _numpy_forward(u, x)
    _, got = _host_unary_fwd(host, u.stem, "f32", x, u.ab)
    scale = u.scale(x, want) if u.scale else None
    assert_close_f32(got, want, u.ulps, scale, f"{name} forward")


def test_gelu_is_accurate_in_the_negative_tail(host):
    """Ours is x erfc(-x/sqrt 2)/2 with the argument's rounding put back: within 4 ulp of the
    float64 value down to x = -12, where NumPy's 1 + erf(z) (float64) has cancelled to 0
    below x = -8 (hence the absolute bound of the comparison with NumPy)."""
    x = np.linspace(-12, 12, 24001, dtype=np.float32)
    want = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.tolist()], np.float32)
    _, got = _host_unary_fwd(host, "gelu", "f32", x, (0.0, 0.0))
    assert_close_f32(got, want, 4, what="gelu vs float64 erfc")


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_forward_low_precision_within_1ulp(host, name, dt):
    u = UNARY[name]
    xs = np.unique(STORAGE[dt][1](_grid(u.domain)))  # representable inputs
    x32 = STORAGE[dt][2](xs)
    want = _numpy_forward(u, x32)
    _, got = _host_unary_fwd(host, u.stem, dt, x32, u.ab)
    bound = u.ulps * F32_EPS * u.scale(x32, want) if u.scale else None
    assert_storage_within_1ulp(got, want, dt, f"{name} {dt} forward", bound)


BACKWARD = [name for name, u in UNARY.items() if u.stem in cuda_unary.GRAD_STEMS]
"""The ops with a backward kernel (a named <Op>Grad node launches it)."""


def test_backward_kernels_are_exactly_those_the_named_backward_ops_launch():
    """No compiled backward entry point goes unlaunched: each stem of GRAD_STEMS is the one
    bind_unary_grad picks for some <Op>Grad (Gelu in both its forms), and no other."""
    from types import SimpleNamespace

    from tr_onnx.ops.unary import UNARY_GRADS

    launched = {cuda_unary.kernel_args(SimpleNamespace(op_type=f"{op}Grad", attrs=attrs),
                                       op)[0]
                for op in UNARY_GRADS for attrs in ({}, {"approximate": "tanh"})}
    assert launched == set(cuda_unary.GRAD_STEMS)


@pytest.mark.parametrize("name", BACKWARD)
def test_unary_backward_fp32_matches_numpy(host, name):
    u = UNARY[name]
    x = _grid(u.domain)
    x = x[np.isfinite(x)]  # the numpy backward of inf/NaN is not what this checks
    gy = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    y, want = _numpy_backward(u, x, gy)
    got = _host_unary_bwd(host, u.stem, "f32", x, y, gy, u.ab)
    scale = u.bscale(x, y, gy) if u.bscale else None
    assert_close_f32(got, want, u.bulps, scale, f"{name} backward")


@pytest.mark.parametrize("dt", ["f16", "bf16"])
@pytest.mark.parametrize("name", BACKWARD)
def test_unary_backward_low_precision_is_the_rounded_fp32_kernel(host, name, dt):
    u = UNARY[name]
    _, store, load = STORAGE[dt]
    x = np.unique(store(_grid(u.domain)))
    xs, ys = _host_unary_fwd(host, u.stem, dt, load(x), u.ab)
    gys = store(np.random.default_rng(1).standard_normal(xs.shape))
    got = _host_unary_bwd(host, u.stem, dt, xs, ys, gys, u.ab)
    want32 = _host_unary_bwd(host, u.stem, "f32", load(xs), load(ys), load(gys), u.ab)
    np.testing.assert_array_equal(load(got), load(store(want32)), err_msg=f"{name} {dt}")


def test_unary_backward_accepts_null_inputs(host):
    # relu's gradient reads y only, leaky_relu's x only: the other pointer may be null
    x = np.linspace(-2, 2, 9, dtype=np.float32)
    gy = np.ones_like(x)
    np.testing.assert_array_equal(_host_unary_bwd(host, "relu", "f32", None, np.maximum(x, 0),
                                                  gy, (0, 0)), (x > 0).astype(np.float32))
    np.testing.assert_array_equal(_host_unary_bwd(host, "leaky_relu", "f32", x, None, gy,
                                                  (0.5, 0)), np.where(x > 0, 1, 0.5))


# ---- binary ops -------------------------------------------------------------------------------

BINARY_ONNX = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}
# id: (shape of a, shape of b) in the physical NHWC layout: per-channel vector, scalar, same
BROADCASTS = {"same": ((2, 3, 4, 16), (2, 3, 4, 16)), "channel": ((2, 3, 4, 16), (16,)),
              "scalar": ((2, 3, 4, 16), (1,)), "channel_first": ((16,), (2, 3, 4, 16))}


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("bcast", list(BROADCASTS))
@pytest.mark.parametrize("op", cuda_elementwise.BINARY_OPS)
def test_binary_broadcast_matches_numpy(host, op, bcast, dt):
    shape_a, shape_b = BROADCASTS[bcast]
    rng = np.random.default_rng(2)
    _, store, load = STORAGE[dt]
    a, b = store(rng.standard_normal(shape_a) * 3), store(rng.standard_normal(shape_b) * 3)
    out_shape = np.broadcast_shapes(shape_a, shape_b)
    n = int(np.prod(out_shape))
    y = np.empty(out_shape, a.dtype)
    host(f"tr_{op}_{dt}", a, b, y, LL(n), LL(a.size), LL(b.size))
    a32, b32 = load(a), load(b)
    graph = helper.make_graph(
        [helper.make_node(BINARY_ONNX[op], ["a", "b"], ["y"])], op,
        [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, list(v.shape))
         for k, v in (("a", a32), ("b", b32))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(out_shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = tr_onnx.InferenceSession(model).run(["y"], {"a": a32, "b": b32})[0]
    # fp16/bf16: (a op b) rounded once from fp32 is the correctly rounded result (24 >= 2p + 2)
    np.testing.assert_array_equal(load(y), load(store(want)))


# ---- NHWC pad / unpad -------------------------------------------------------------------------

LAYOUT_SHAPES = {"nchw": (2, 3, 4, 5), "c8": (1, 8, 2, 2), "ncl": (2, 13, 3), "nc": (3, 5),
                 "ncdhw": (2, 17, 2, 3, 2)}


def _padded_reference(x: np.ndarray) -> tuple[StridedLayout, np.ndarray]:
    layout = StridedLayout.channels_last(x.shape, 8)
    buf = np.zeros(layout.nbytes(x.dtype.itemsize), np.uint8)
    layout.kernel_view(buf, 0, x.dtype)[...] = x
    return layout, layout.physical_view(buf, 0, x.dtype)


@pytest.mark.parametrize("pair", cuda_layout.STORAGE_PAIRS, ids="_".join)
@pytest.mark.parametrize("shape", list(LAYOUT_SHAPES))
def test_pad_unpad_nhwc_match_channels_last_layout(host, shape, pair):
    src, dst = pair
    shape = LAYOUT_SHAPES[shape]
    n, c, s = shape[0], shape[1], int(np.prod(shape[2:], dtype=np.int64))
    x32 = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape) * 0.37 - 5
    xs = STORAGE[src][1](x32)  # compact NCHW, source storage
    layout, want = _padded_reference(STORAGE[dst][1](STORAGE[src][2](xs)))
    cp = layout.padded_channels
    got = poisoned(layout.phys_shape, dst)
    host(f"tr_pad_nhwc_{src}_{dst}", xs, got, LL(got.size), LL(c), LL(s), LL(cp))
    np.testing.assert_array_equal(STORAGE[dst][2](got), STORAGE[dst][2](want))
    assert not STORAGE[dst][2](got)[layout.pad_mask()].any(), "pad lanes must be written zero"
    # unpad from a padded buffer whose pad lanes hold garbage
    phys = STORAGE[src][1](STORAGE[src][2](_padded_reference(xs)[1]))
    phys[StridedLayout.channels_last(shape, 8).pad_mask()] = phys.flat[0]
    back = np.empty(shape, STORAGE[dst][0])
    host(f"tr_unpad_nhwc_{src}_{dst}", phys, back, LL(back.size), LL(c), LL(s), LL(cp))
    np.testing.assert_array_equal(STORAGE[dst][2](back),
                                  STORAGE[dst][2](STORAGE[dst][1](STORAGE[src][2](xs))))
    assert n * c * s == back.size


# ---- conversions ------------------------------------------------------------------------------

def _conversion_inputs() -> np.ndarray:
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 70000, -70000, 6e-8, 3e-8,
               1e-40, 3.4e38, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8]
    return np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-8, 8, 4000),
                           special]).astype(np.float32)


@pytest.mark.parametrize("pair", cuda_elementwise.CONVERT_PAIRS, ids="_".join)
def test_convert_rounds_to_nearest_even(host, pair):
    src, dst = pair
    x = STORAGE[src][1](_conversion_inputs())
    y = np.empty(x.shape, STORAGE[dst][0])
    host(f"tr_convert_{src}_{dst}", x, y, LL(x.size))
    want = STORAGE[dst][1](STORAGE[src][2](x))  # numpy float16 / torch bfloat16 rounding
    np.testing.assert_array_equal(STORAGE[dst][2](y), STORAGE[dst][2](want))


# ---- optimizers -------------------------------------------------------------------------------

def _numpy_update(factory, attrs, p, g, states, lr, step):
    """Run an ``ai.tr_onnx`` update kernel of ops/optimizers.py on float32 arrays in place."""
    info = TensorInfo("p", p.shape, p.dtype, StridedLayout.plain(p.shape), p.shape)
    node = SimpleNamespace(attrs=attrs, since_version=1, name="update", label="update")
    ctx = KernelContext(node, [info], [], [], "numpy")
    run = factory(ctx)
    ws = [np.empty(s, d) for s, d in ctx.workspace_requests]
    run([p, g, *states, np.float32(lr).reshape(()), np.int64(step).reshape(())], [], ws)


# id: (numpy factory, attrs, host kernel stem, host scalar args, number of states)
OPTIMIZERS = {
    "sgd": (np_optim.sgd_update_numpy,
            {"momentum": 0.0, "dampening": 0.0, "nesterov": 0, "weight_decay": 0.0}, "sgd", 1),
    "sgd_momentum_dampening_wd": (np_optim.sgd_update_numpy,
                                  {"momentum": 0.9, "dampening": 0.1, "nesterov": 0,
                                   "weight_decay": 1e-2}, "sgd", 1),
    "sgd_nesterov_wd": (np_optim.sgd_update_numpy,
                        {"momentum": 0.8, "dampening": 0.0, "nesterov": 1,
                         "weight_decay": 5e-4}, "sgd", 1),
    "adam": (np_optim.adam_update_numpy,
             {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0,
              "decoupled": 0}, "adam", 2),
    "adam_l2": (np_optim.adam_update_numpy,
                {"beta1": 0.85, "beta2": 0.99, "epsilon": 1e-6, "weight_decay": 1e-2,
                 "decoupled": 0}, "adam", 2),
    "adamw": (np_optim.adam_update_numpy,
              {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 1e-2,
               "decoupled": 1}, "adam", 2),
    "adagrad": (np_optim.adagrad_update_numpy,
                {"lr_decay": 0.01, "weight_decay": 1e-3, "epsilon": 1e-10}, "adagrad", 1),
}


def _host_scalars(stem, a):
    if stem == "sgd":
        return (F64(a["momentum"]), F64(a["dampening"]), I32(a["nesterov"]),
                F64(a["weight_decay"]))
    if stem == "adam":
        return (F64(a["beta1"]), F64(a["beta2"]), F64(a["epsilon"]), F64(a["weight_decay"]),
                I32(a["decoupled"]))
    return F64(a["lr_decay"]), F64(a["weight_decay"]), F64(a["epsilon"])


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_update_is_bitwise_numpy(host, name, dt):
    factory, attrs, stem, n_states = OPTIMIZERS[name]
    rng = np.random.default_rng(4)
    n = 1000
    p = rng.standard_normal(n).astype(np.float32)
    states = [np.zeros(n, np.float32) for _ in range(n_states)]
    p_ref, states_ref = p.copy(), [s.copy() for s in states]
    copy = np.zeros(n, STORAGE[dt][0])
    lr = np.array([0.05], np.float32)
    for step in (1, 2, 3, 10):
        g = STORAGE[dt][1](rng.standard_normal(n) * 0.3)  # grads in the storage type
        g[:3] = 0  # padded lanes and alignment gaps: zero in, zero out
        p[:3], p_ref[:3] = 0, 0
        _numpy_update(factory, attrs, p_ref, STORAGE[dt][2](g), states_ref, lr[0], step)
        buffers = [p, g, *states, copy]
        host(f"tr_{stem}_{dt}", *buffers, LL(n), lr, np.array([step], np.int64), None,
             *_host_scalars(stem, attrs))
        np.testing.assert_array_equal(p, p_ref, err_msg=f"{name} step {step}: weights")
        for s, s_ref in zip(states, states_ref):
            np.testing.assert_array_equal(s, s_ref, err_msg=f"{name} step {step}: state")
        np.testing.assert_array_equal(copy, STORAGE[dt][1](p), err_msg="the low-precision copy")
        assert not p[:3].any() and not any(s[:3].any() for s in states)


CLIP_CASES = {  # id: (n, scale, max_norm as a fraction of the scaled norm; 0: no clipping)
    "one_chunk_no_clip": (1000, 1.0, 0.0),
    "one_chunk_scaled_clipped": (1000, 0.5, 0.25),
    "many_chunks_scaled_below_max": (300_001, 0.25, 2.0),
    "many_chunks_clipped": (300_001, 1.0, 0.5),
}


@pytest.mark.parametrize("n", [1, 255, 2048, 2049, 300_001, 25_557_032, 10**9])
def test_clip_chunks_cover_the_span_in_whole_lanes(n):
    parts, chunk = cuda_optim.clip_chunks(n)
    assert chunk % 256 == 0 and 1 <= parts <= cuda_optim.CLIP_PARTS
    assert (parts - 1) * chunk < n <= parts * chunk


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_scale_clip_norm_matches_a_float64_norm(host, case, dt):
    """ScaleClipGrad's three kernels as the binding launches them: the scaled gradient as
    NumPy's fp32 multiply, each chunk's sum of squares (one block each) and the norm from the
    float64 sums, the clipped gradient as g * float32(max_norm / (norm + 1e-6))."""
    n, scale, frac = CLIP_CASES[case]
    rng = np.random.default_rng(11)
    g = STORAGE[dt][1](rng.standard_normal(n) * 0.3)
    scaled = STORAGE[dt][2](STORAGE[dt][1](STORAGE[dt][2](g) * np.float32(scale)))
    sq = scaled.astype(np.float64) ** 2
    norm64 = math.sqrt(sq.sum())
    max_norm = frac * norm64
    parts, chunk = cuda_optim.clip_chunks(n)
    assert (parts > 1) == (n > 2048), "the large cases must span several blocks"
    partial, norm, coef = poisoned(parts, "f32").astype(np.float64), np.zeros(1, np.float32), \
        np.zeros(1, np.float32)
    host(f"tr_scale_clip_norm_{dt}", g, LL(n), np.array([scale], np.float32), partial,
         LL(parts), LL(chunk))
    np.testing.assert_array_equal(STORAGE[dt][2](g), scaled)
    want_parts = np.add.reduceat(sq, np.arange(0, n, chunk))
    np.testing.assert_allclose(partial, want_parts, rtol=1e-13)
    host("tr_scale_clip_norm_total", partial, LL(parts), norm, coef, F64(max_norm))
    assert_close_f32(norm, np.float32(norm64), 1, what=f"{case} norm")
    c = max_norm / (norm64 + 1e-6) if max_norm > 0 else 1.0
    want_coef = np.float32(min(c, 1.0))
    assert_close_f32(coef, want_coef, 1, what=f"{case} coefficient")
    host(f"tr_scale_clip_norm_apply_{dt}", g, LL(n), coef)
    want = scaled * coef[0] if coef[0] != 1.0 else scaled
    if dt == "f32":
        np.testing.assert_array_equal(g, want)
    else:
        assert_storage_within_1ulp(g, want, dt, f"{case} clipped")


def test_optimizer_skips_the_step_on_found_inf(host):
    p = np.ones(8, np.float32)
    m, v = np.zeros(8, np.float32), np.zeros(8, np.float32)
    g = np.full(8, np.inf, np.float32)
    host("tr_adam_f32", p, g, m, v, None, LL(8), np.array([0.1], np.float32),
         np.array([1], np.int64), np.array([1.0], np.float32), F64(0.9), F64(0.999),
         F64(1e-8), F64(0.0), I32(0))
    assert (p == 1).all() and not m.any() and not v.any()


def test_optimizer_without_momentum_needs_no_buffer(host):
    p, g = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    host("tr_sgd_f32", p, g, None, None, LL(4), np.array([0.25], np.float32),
         np.array([1], np.int64), None, F64(0.0), F64(0.0), I32(0), F64(0.0))
    np.testing.assert_array_equal(p, np.full(4, 0.5, np.float32))


# ---- dynamic loss scaling -----------------------------------------------------------------------

@pytest.mark.parametrize("dt", list(STORAGE))
def test_unscale_check_matches_torch(host, dt):
    rng = np.random.default_rng(5)
    g = STORAGE[dt][1](rng.standard_normal(100) * 1000)
    inv = np.array([2.0 ** -10], np.float32)
    found = np.zeros(1, np.float32)
    want = STORAGE[dt][2](g).copy()
    host(f"tr_unscale_check_{dt}", g, LL(g.size), inv, found)
    tg = [torch.from_numpy(want)]
    tfound = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(tg, tfound, torch.from_numpy(inv))
    np.testing.assert_array_equal(STORAGE[dt][2](g), STORAGE[dt][2](STORAGE[dt][1](tg[0])))
    assert found[0] == tfound.item() == 0
    g[17] = STORAGE[dt][1](np.array([np.nan]))[0]
    host(f"tr_unscale_check_{dt}", g, LL(g.size), inv, found)
    assert found[0] == 1


@pytest.mark.parametrize("dt", list(STORAGE))
def test_unscale_check_without_a_scale_only_checks(host, dt):
    """A null inv_scale: the cuda executor's all_finite (the tensor is not written)."""
    g = STORAGE[dt][1](np.linspace(-3e4, 3e4, 77))
    found = np.zeros(1, np.float32)
    before = g.copy()
    host(f"tr_unscale_check_{dt}", g, LL(g.size), None, found)
    assert found[0] == 0 and g.tobytes() == before.tobytes()
    g[40] = STORAGE[dt][1](np.array([np.inf]))[0]
    host(f"tr_unscale_check_{dt}", g, LL(g.size), None, found)
    assert found[0] == 1
    host("tr_zero_lanes_b4", found, LL(1), LL(0), LL(1))  # the executor's clear
    assert found[0] == 0


def test_loss_scale_update_follows_torch_sequence(host):
    scale, inv = np.array([65536.0], np.float32), np.zeros(1, np.float32)
    tracker, found, step = np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros(1, np.int64)
    t_scale, t_tracker = torch.tensor([65536.0]), torch.zeros(1, dtype=torch.int32)
    t_steps = 0
    pattern = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    for bad in pattern:
        found[0] = bad
        host("tr_step_advance", step, found)
        t_steps += 0 if bad else 1
        host("tr_loss_scale_update", scale, inv, tracker, found, F64(2.0), F64(0.5), I32(3),
             None)
        torch._amp_update_scale_(t_scale, t_tracker, torch.tensor([float(bad)]), 2.0, 0.5, 3)
        assert scale[0] == t_scale.item() and tracker[0] == t_tracker.item()
        assert inv[0] == np.float32(1.0 / float(scale[0])) and found[0] == bad  # left set
        assert step[0] == t_steps


def test_step_guard_kernels(host):
    """The one-graph step's guard (amp.cu): conditional copy and zeroing on a float32 flag,
    the flag OR, and the 16-byte report (null pointers read 0)."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 2**32, 37, dtype=np.uint32)
    flag = np.zeros(1, np.float32)
    dst = np.zeros(37, np.uint32)
    host("tr_copy_unless_b4", dst, src, LL(37), flag)
    np.testing.assert_array_equal(dst, src)
    flag[0] = 1.0
    host("tr_copy_unless_b4", dst, np.zeros(37, np.uint32), LL(37), flag)
    np.testing.assert_array_equal(dst, src)  # kept
    host("tr_copy_unless_b4", dst, np.zeros(37, np.uint32), LL(37), None)  # no flag: copies
    assert not dst.any()
    dst[...] = src
    flag[0] = 0.0
    host("tr_zero_if_b4", dst, LL(37), flag)
    np.testing.assert_array_equal(dst, src)
    flag[0] = 1.0
    host("tr_zero_if_b4", dst, LL(37), flag)
    assert not dst.any()
    found = np.zeros(1, np.float32)
    host("tr_flag_or", found, np.zeros(1, np.float32))
    assert found[0] == 0.0
    host("tr_flag_or", found, flag)
    assert found[0] == 1.0
    host("tr_flag_or", found, np.zeros(1, np.float32))  # OR: stays set
    assert found[0] == 1.0
    out = np.full(5, np.nan, np.float32)
    loss, norm = np.array([2.5], np.float32), np.array([0.75], np.float32)
    host("tr_step_report", loss, flag, None, norm, None, out)
    np.testing.assert_array_equal(out, [2.5, 1.0, 0.0, 0.75, 0.0])
    # a step launched on the assumption that the previous one was applied
    step, applied = np.array([8], np.int64), np.array([7], np.int64)
    reject, bad = np.full(1, np.nan, np.float32), np.zeros(1, np.float32)
    host("tr_step_check", step, applied, reject, bad)
    assert reject[0] == 0.0 and bad[0] == 0.0
    applied[0] = 6  # the previous step was skipped
    host("tr_step_check", step, applied, reject, bad)
    assert reject[0] == 1.0 and bad[0] == 1.0
    # a rejected step leaves the loss scale alone
    scale, inv = np.array([1024.0], np.float32), np.zeros(1, np.float32)
    tracker = np.array([1], np.int32)
    host("tr_loss_scale_update", scale, inv, tracker, np.ones(1, np.float32), F64(2.0),
         F64(0.5), I32(3), reject)
    assert scale[0] == 1024.0 and tracker[0] == 1 and inv[0] == 0.0


# ---- losses -------------------------------------------------------------------------------------

# id: (scores shape NCHW-style, reduction, ignore_index, class weights?)
SCE_CASES = {"NC_mean": ((7, 10), "mean", None, False), "NC_sum_w": ((7, 10), "sum", None, True),
             "NC_none_ii": ((9, 5), "none", 2, False),
             "NCd_mean_w_ii": ((2, 11, 3), "mean", 4, True)}
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _sce_model(x, labels, weights, reduction, ignore):
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    names, inits = ["x", "t"], []
    if weights is not None:
        inits.append(numpy_helper.from_array(weights, "w"))
        names.append("w")
    loss_shape = [] if reduction != "none" else list(labels.shape)
    graph = helper.make_graph(
        [helper.make_node("SoftmaxCrossEntropyLoss", names, ["y"], **attrs)], "sce",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape)),
         helper.make_tensor_value_info("t", onnx.TensorProto.INT64, list(labels.shape))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, loss_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("case", list(SCE_CASES))
def test_softmax_cross_entropy_rows_match_numpy(host, case, dt):
    shape, reduction, ignore, weighted = SCE_CASES[case]
    rng = np.random.default_rng(6)
    n, c, *rest = shape
    x = STORAGE[dt][2](STORAGE[dt][1](rng.standard_normal(shape) * 4))
    labels = rng.integers(0, c, (n, *rest)).astype(np.int64)
    if ignore is not None:
        labels.flat[::3] = ignore
    weights = rng.uniform(0.5, 2, c).astype(np.float32) if weighted else None
    model = _sce_model(x, labels, weights, reduction, ignore)
    want_loss = tr_onnx.InferenceSession(model).run(["y"], {"x": x, "t": labels})[0]
    gloss = (rng.standard_normal(labels.shape) if reduction == "none"
             else np.array(1.7)).astype(np.float32)
    _, grads = vjp(model, {"x": x, "t": labels}, ["x"], gloss)
    want_gx = grads["x"]

    # device layout: class-last rows, channels padded to 8 (pad lanes hold garbage on input)
    x_cl = np.moveaxis(x, 1, -1).reshape(-1, c)
    rows, cp = x_cl.shape[0], -(-c // 8) * 8
    xs = np.full((rows, cp), 7.0, np.float32)
    xs[:, :c] = x_cl
    xs = STORAGE[dt][1](xs)
    flat_labels = labels.reshape(-1)
    row_loss, row_w = np.empty(rows, np.float32), np.empty(rows, np.float32)
    common = (LL(ignore if ignore is not None else -100), I32(ignore is not None))
    rows_geometry = (LL(rows), LL(c), LL(1), LL(cp), LL(0), LL(1))  # class-last rows of cp
    host(f"tr_sce_fwd_{dt}", xs, flat_labels, weights, row_loss, row_w, *rows_geometry,
         *common)
    loss, denom = np.empty(1, np.float32), np.empty(1, np.float32)
    host("tr_sce_reduce", row_loss, row_w, LL(rows), I32(REDUCTIONS[reduction]),
         I32(weighted or ignore is not None), loss, denom)
    got_loss = row_loss.reshape(labels.shape) if reduction == "none" else loss[0]
    # the row sums (and numpy's pairwise class sums) add in another order: a few ulp
    np.testing.assert_allclose(got_loss, want_loss, rtol=8 * F32_EPS, atol=8 * F32_EPS)

    gx = np.full((rows, cp), 7.0, np.float32)
    gx = STORAGE[dt][1](gx)
    host(f"tr_sce_bwd_{dt}", xs, flat_labels, weights, gloss.reshape(-1), denom, gx,
         *rows_geometry, LL(cp), *common, I32(REDUCTIONS[reduction]))
    got_gx = STORAGE[dt][2](gx)
    assert not got_gx[:, c:].any(), "pad lanes of the gradient must be zero"
    want_cl = np.moveaxis(want_gx, 1, -1).reshape(-1, c)
    if dt == "f32":
        tol = 8 * F32_EPS * np.abs(gloss).max() * (weights.max() if weighted else 1.0)
        np.testing.assert_allclose(got_gx[:, :c], want_cl, rtol=8 * F32_EPS, atol=tol)
    else:
        assert_storage_within_1ulp(gx[:, :c], want_cl, dt, f"sce {case} {dt} backward")



# ---- pools, softmax, layer norm, data movement (pool.cu, reduce.cu, normalization.cu, ...) -----

def _model(op, inputs, outputs, attrs=None, inits=(), opset=17, domain_ops=()):
    """A one-node model: ``inputs``/``outputs`` as {name: array or shape}; ``inits`` arrays."""
    def info(name, a, elem=onnx.TensorProto.FLOAT):
        shape = list(a.shape) if hasattr(a, "shape") else list(a)
        if hasattr(a, "dtype") and a.dtype == np.int64:
            elem = onnx.TensorProto.INT64
        return helper.make_tensor_value_info(name, elem, shape)

    node = helper.make_node(op, list(inputs) + [n for n, _ in inits], list(outputs),
                            **(attrs or {}))
    graph = helper.make_graph([node], op, [info(k, v) for k, v in inputs.items()],
                              [info(k, v) for k, v in outputs.items()],
                              [numpy_helper.from_array(a, n) for n, a in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _nhwc_padded(x, dt, fill=7.0):
    """NCHW float32 -> [N, H, W, Cp] storage ``dt`` with garbage in the pad lanes."""
    cp = -(-x.shape[1] // 8) * 8
    out = np.full((x.shape[0], *x.shape[2:], cp), fill, np.float32)
    out[..., :x.shape[1]] = np.moveaxis(x, 1, -1)
    return STORAGE[dt][1](out)


def _from_nhwc(y, c, dt):
    return np.moveaxis(STORAGE[dt][2](y)[..., :c], -1, 1)


POOLS = {  # id: (op, x shape, attrs)
    "max2x2": ("MaxPool", (2, 6, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "max3x3_pad_ceil": ("MaxPool", (2, 11, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2],
                                                  "pads": [1, 0, 1, 1], "ceil_mode": 1}),
    "max_dil": ("MaxPool", (1, 3, 9, 9), {"kernel_shape": [2, 3], "dilations": [2, 1],
                                         "pads": [1, 1, 0, 1]}),
    "max1d": ("MaxPool", (2, 5, 10), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    # overlapping windows (stride < kernel): several outputs share each tap, ties included
    "max3x3_s2_resnet_stem": ("MaxPool", (2, 12, 14, 15), {"kernel_shape": [3, 3],
                                                          "strides": [2, 2],
                                                          "pads": [1, 1, 1, 1]}),
    "max3x3_s1_overlap": ("MaxPool", (1, 9, 10, 11), {"kernel_shape": [3, 3],
                                                     "pads": [1, 1, 1, 1]}),
    "avg_pad": ("AveragePool", (2, 6, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2],
                                             "pads": [1, 1, 1, 1]}),
    "avg_pad_incl_ceil": ("AveragePool", (2, 9, 8, 7), {"kernel_shape": [3, 2],
                                                       "strides": [2, 2], "pads": [1, 0, 0, 1],
                                                       "count_include_pad": 1,
                                                       "ceil_mode": 1}),
}


def _pool_args(op, shape, attrs):
    from tr_onnx.ops.conv_window import Window

    spatial = shape[2:]
    win = Window.resolve({**attrs, "auto_pad": "NOTSET"}, spatial, attrs["kernel_shape"],
                         bool(attrs.get("ceil_mode", 0)))
    one = len(spatial) == 1

    def pick(v, default):
        return (default, v[0]) if one else tuple(v)

    H, W = pick(spatial, 1)
    OH, OW = pick(win.out_shape, 1)
    kh, kw = pick(win.kernel, 1)
    sh, sw = pick(win.strides, 1)
    ph, pw = pick(win.pads_begin, 0)
    eh, ew = pick(win.pads_end, 0)
    dh, dw = pick(win.dilations, 1)
    cp_ = -(-shape[1] // 8) * 8
    window = [H, W, OH, OW, shape[1], cp_, cp_, kh, kw, sh, sw, ph, pw, dh, dw]
    bounds = [-ph, H + eh, -pw, W + ew] if attrs.get("count_include_pad") else [0, H, 0, W]
    return win.out_shape, window, bounds


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("case", list(POOLS))
def test_pools_and_their_gradients_match_numpy(host, case, dt):
    op, shape, attrs = POOLS[case]
    rng = np.random.default_rng(8)
    x = STORAGE[dt][2](STORAGE[dt][1](rng.standard_normal(shape)))
    if op == "MaxPool":
        x.flat[::7] = x.flat[1]  # ties: the first maximum in scan order takes the gradient
    out_sp, window, bounds = _pool_args(op, shape, attrs)
    y_shape = (*shape[:2], *out_sp)
    model = _model(op, {"x": x}, {"y": y_shape}, attrs, opset=19)
    want = tr_onnx.InferenceSession(model).run(["y"], {"x": x})[0]
    gy = STORAGE[dt][2](STORAGE[dt][1](rng.standard_normal(y_shape)))
    _, grads = vjp(model, {"x": x}, ["x"], gy)

    stem = "maxpool" if op == "MaxPool" else "avgpool"
    extra = [] if op == "MaxPool" else bounds
    xs, gys = _nhwc_padded(x, dt), _nhwc_padded(gy, dt)
    ys = poisoned(gys.shape, dt)
    host(f"tr_{stem}_fwd_{dt}", xs, ys, LL(ys.size), *[LL(v) for v in window + extra])
    c = shape[1]
    assert not STORAGE[dt][2](ys)[..., c:].any(), "pad lanes must be written zero"
    gxs = poisoned(xs.shape, dt)
    if op == "MaxPool":
        outputs = math.prod(y_shape)
        arg = np.full(outputs, -1, np.int32)
        host(f"tr_maxpool_argmax_{dt}", xs, arg, LL(outputs), *[LL(v) for v in window])
        host(f"tr_maxpool_bwd_{dt}", gys, arg, gxs, LL(gxs.size), *[LL(v) for v in window])
    else:
        host(f"tr_avgpool_bwd_{dt}", gys, gxs, LL(gxs.size), *[LL(v) for v in window + extra])
    assert not STORAGE[dt][2](gxs)[..., c:].any(), "pad lanes of gx must be written zero"
    got_y, got_gx = _from_nhwc(ys, c, dt), _from_nhwc(gxs, c, dt)
    if dt == "f32":  # same taps in the same order: bit for bit
        np.testing.assert_array_equal(got_y, want)
        np.testing.assert_array_equal(got_gx, grads["x"])
    else:
        assert_storage_within_1ulp(STORAGE[dt][1](got_y), want, dt, f"{case} forward")
        assert_storage_within_1ulp(STORAGE[dt][1](got_gx), grads["x"], dt, f"{case} grad")


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_rows_match_numpy(host, op, dt):
    rng = np.random.default_rng(9)
    x = STORAGE[dt][2](STORAGE[dt][1](rng.standard_normal((3, 5, 17)) * 4))
    model = _model(op, {"x": x}, {"y": x.shape}, {"axis": -1}, opset=13)
    want = tr_onnx.InferenceSession(model).run(["y"], {"x": x})[0]
    y = poisoned(x.shape, dt)
    host(f"tr_softmax_{dt}", STORAGE[dt][1](x), y, LL(15), LL(17), LL(17),
         I32(op == "LogSoftmax"))
    if dt == "f32":
        np.testing.assert_allclose(y, want, rtol=8 * F32_EPS, atol=8 * F32_EPS)
    else:
        assert_storage_within_1ulp(y, want, dt, f"{op} {dt}", abs_bound=8 * F32_EPS)


BN_RUNNING = {  # id: (x shape NCHW, unbiased (PyTorch's count / (count - 1) factor))
    "one_chunk_3_channels": ((2, 3, 4, 5), False),
    "chunks_and_two_tiles": ((4, 40, 24, 24), False),  # 2304 rows: 36 chunks x 2 tiles
    "ragged_last_chunk_unbiased": ((2, 33, 23, 25), True),  # 1150 rows, 18 chunks
}


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("case", list(BN_RUNNING))
def test_bn_running_statistics_match_a_float64_variance(host, case, dt):
    """The two running-statistics kernels as BatchNormTraining launches them: each (chunk,
    channel) sum of (x - mean)^2 (fp32 difference, as the kernel reads x), the biased variance
    from their float64 total, and the momentum blend as NumPy's float32 arithmetic."""
    shape, unbiased = BN_RUNNING[case]
    rng = np.random.default_rng(12)
    x = STORAGE[dt][2](STORAGE[dt][1](rng.standard_normal(shape) * 1.5 + 0.75))
    c = shape[1]
    xs = _nhwc_padded(x, dt)  # garbage (7.0) in the pad lanes
    ld = xs.shape[-1]
    rows = xs.size // ld
    x_rows = STORAGE[dt][2](xs).reshape(rows, ld)[:, :c]
    mean = x_rows.astype(np.float64).mean(axis=0).astype(np.float32)
    sq = (x_rows - mean).astype(np.float64) ** 2
    chunks, chunk_rows = cuda_norm.bn_chunks(rows, c)
    assert (chunks > 1) == (rows > 64)
    partial = np.full((chunks, c), np.nan)
    host(f"tr_bn_running_{dt}", xs, mean, partial, LL(rows), LL(c), LL(ld), LL(chunks),
         LL(chunk_rows))
    np.testing.assert_allclose(partial, np.add.reduceat(sq, np.arange(0, rows, chunk_rows)),
                               rtol=1e-13)
    momentum = np.float32(0.9)
    coef = np.float32(1 - 0.9)
    var_coef = np.float32((1 - 0.9) * rows / (rows - 1)) if unbiased else coef
    rm, rv = rng.standard_normal(c).astype(np.float32), rng.random(c).astype(np.float32)
    new_rm, new_rv = np.full(c, np.nan, np.float32), np.full(c, np.nan, np.float32)
    host("tr_bn_running_finish", partial, mean, rm, rv, new_rm, new_rv, LL(rows), LL(c),
         LL(chunks), F32(momentum), F32(coef), F32(var_coef))
    var = (sq.sum(axis=0) / rows).astype(np.float32)
    np.testing.assert_array_equal(new_rm, rm * momentum + mean * coef)
    assert_close_f32(new_rv, rv * momentum + var * var_coef, 1, what=f"{case} running var")


def _numpy_batch_norm(factory, attrs, ins, out_shapes):
    """A BatchNorm kernel of ops/batch_norm.py (``factory``) on plain NCHW float32 arrays,
    one process (no ``world``): the reference a synchronised BatchNorm's ranks together equal."""
    def info(name, a):
        return TensorInfo(name, a.shape, a.dtype, StridedLayout.plain(a.shape), a.shape)

    outs = [np.full(shape, np.nan, np.float32) for shape in out_shapes]
    node = SimpleNamespace(attrs=attrs, since_version=1, name="bn", label="bn",
                           op_type="BatchNorm")
    ctx = KernelContext(node, [info(f"in{k}", a) for k, a in enumerate(ins)],
                        [info(f"out{k}", a) for k, a in enumerate(outs)], [], "numpy")
    run = factory(ctx)
    run(ins, outs, [np.zeros(shape, dtype) for shape, dtype in ctx.workspace_requests])
    return outs


def _nccl_sum(buffers):
    """What NCCL's in-place all-reduce (sum) leaves in every rank's buffer."""
    total = np.sum(buffers, axis=0)
    for buf in buffers:
        buf[...] = total


SYNC_BN = {  # id: (x shape NCHW, two ranks' halves along N; unbiased running variance)
    "12_of_16_lanes": ((4, 12, 5, 7), False),  # 35 rows a rank: one chunk, padded lanes
    "37_of_40_lanes_two_tiles_chunks_unbiased": ((4, 37, 12, 12), True),  # 288 rows: 5 chunks
}


@pytest.mark.parametrize("dt", list(STORAGE))
@pytest.mark.parametrize("case", list(SYNC_BN))
def test_sync_batch_norm_kernels_on_two_ranks_equal_numpy_on_the_whole_batch(host, case, dt):
    """Synchronised BatchNorm's kernels as its bindings launch them, each rank on its half of
    the batch (channels-last, garbage in the pad lanes), the NCCL all-reduces between them done
    by hand: every rank's statistics, y and gx equal the NumPy kernels' over the whole batch
    in one process; gscale / gbias are each rank's own (the NumPy kernels' on its half)."""
    shape, unbiased = SYNC_BN[case]
    rng = np.random.default_rng(13)
    _, store, load = STORAGE[dt]
    x, gy = (load(store(rng.standard_normal(shape) * 1.5 + 0.75)) for _ in range(2))
    c, half = shape[1], shape[0] // 2
    scale, bias, rm = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    rv = rng.random(c).astype(np.float32) + 0.5
    ranks = [slice(0, half), slice(half, None)]
    xs, gys = ([_nhwc_padded(a[r], dt) for r in ranks] for a in (x, gy))
    ld = xs[0].shape[-1]
    rows = xs[0].size // ld
    chunks, chunk_rows = cuda_norm.bn_chunks(rows, c)
    geom = (LL(rows), LL(c), LL(ld), LL(chunks), LL(chunk_rows))
    partial = [np.full((chunks, 2 * c), np.nan) for _ in ranks]
    sums, sq, grad = ([np.full(n, np.nan) for _ in ranks] for n in (c + 1, c, 2 * c + 1))
    mean, inv, new_rm, new_rv, gscale, gbias = (
        [np.full(c, np.nan, np.float32) for _ in ranks] for _ in range(6))
    ys, gxs = ([poisoned(xs[0].shape, dt) for _ in ranks] for _ in range(2))
    for k in (0, 1):  # forward: [sum x | rows], all-reduced
        host(f"tr_bn_sums_{dt}", xs[k], partial[k], *geom)
        host("tr_bn_sum_chunks", partial[k], sums[k], LL(c), LL(chunks), LL(c + 1), LL(rows))
    assert [s[c] for s in sums] == [rows, rows]
    _nccl_sum(sums)
    for k in (0, 1):  # the mean; the sums of squares, all-reduced
        host("tr_bn_sync_mean", sums[k], mean[k], LL(c))
        host(f"tr_bn_running_{dt}", xs[k], mean[k], partial[k], *geom)
        host("tr_bn_sum_chunks", partial[k], sq[k], LL(c), LL(chunks), LL(c), LL(rows))
    _nccl_sum(sq)
    for k in (0, 1):
        host("tr_bn_sync_finish", sums[k], sq[k], mean[k], rm, rv, inv[k], new_rm[k],
             new_rv[k], LL(c), F32(0.9), F32(1.0 - 0.9), F64(1.0 - 0.9), I32(unbiased),
             F32(1e-5))
        host(f"tr_bn_normalize_{dt}", xs[k], scale, bias, mean[k], inv[k], ys[k],
             LL(xs[k].size), LL(c), LL(ld))
    for stat in (mean, inv, new_rm, new_rv):  # every rank the same statistics
        np.testing.assert_array_equal(stat[0], stat[1])
    want = _numpy_batch_norm(
        np_norm.batch_norm_training_numpy,
        {"epsilon": 1e-5, "momentum": 0.9, "unbiased_running_var": int(unbiased)},
        [x, scale, bias, rm, rv], [shape] + [(c,)] * 4)
    y = np.concatenate([_from_nhwc(v, c, dt) for v in ys])
    for k in (0, 1):  # backward: this rank's gscale, gbias; gx from the all-reduced sums
        assert not STORAGE[dt][2](ys[k])[..., c:].any(), "pad lanes must be written zero"
        host(f"tr_bn_grad_sums_{dt}", gys[k], xs[k], mean[k], partial[k], *geom)
        host("tr_bn_sum_chunks", partial[k], grad[k], LL(2 * c), LL(chunks), LL(2 * c + 1),
             LL(rows))
        host("tr_bn_grad_params", grad[k], inv[k], gscale[k], gbias[k], LL(c))
    _nccl_sum(grad)
    for k in (0, 1):
        host(f"tr_bn_grad_dx_{dt}", gys[k], xs[k], scale, mean[k], inv[k], grad[k], gxs[k],
             LL(xs[k].size), LL(c), LL(ld))
        assert not STORAGE[dt][2](gxs[k])[..., c:].any(), "pad lanes must be written zero"
    gx = np.concatenate([_from_nhwc(v, c, dt) for v in gxs])
    grad_ins = [gy, x, scale, mean[0], inv[0]]  # both sides read the kernels' statistics
    want_gx = _numpy_batch_norm(np_norm.batch_norm_grad_numpy, {"training": 1}, grad_ins,
                                [shape, (c,), (c,)])
    own = [_numpy_batch_norm(np_norm.batch_norm_grad_numpy, {"training": 1},
                             [a[r] for a in grad_ins[:2]] + grad_ins[2:],
                             [x[r].shape, (c,), (c,)]) for r in ranks]
    got = {"mean": mean[0], "inv_std": inv[0], "running_mean": new_rm[0],
           "running_var": new_rv[0], "gscale": np.stack(gscale), "gbias": np.stack(gbias)}
    ref = {"mean": want[1], "inv_std": want[2], "running_mean": want[3],
           "running_var": want[4], "gscale": np.stack([o[1] for o in own]),
           "gbias": np.stack([o[2] for o in own])}
    maps = {"y": (y, ys, want[0]), "gx": (gx, gxs, want_gx[0])}
    if dt == "f32":
        got.update({name: m[0] for name, m in maps.items()})
        ref.update({name: m[2] for name, m in maps.items()})
    else:  # the maps as stored: within 1 ulp of the reference rounded to the storage type
        for name, (_, stored, w) in maps.items():
            assert_storage_within_1ulp(np.concatenate([v[..., :c] for v in stored]),
                                       np.concatenate([np.moveaxis(w[r], 1, -1) for r in ranks]),
                                       dt, f"{case} {name}")
    # fp64 sums against NumPy's float32 ones: within 32 ulp of the largest value (1.1e-6 seen)
    for name in got:
        np.testing.assert_allclose(got[name], ref[name], rtol=0,
                                   atol=32 * F32_EPS * np.abs(ref[name]).max(), err_msg=name)


@pytest.mark.parametrize("dt", list(STORAGE))
def test_layer_norm_and_its_gradient_match_numpy(host, dt):
    rng = np.random.default_rng(10)
    rows, m = 12, 40
    _, store, load = STORAGE[dt]
    x, scale, bias, gy = (load(store(rng.standard_normal(s) * 2 + 0.5))
                          for s in ((3, 4, m), (m,), (m,), (3, 4, m)))
    model = _model("LayerNormalization", {"x": x}, {"y": x.shape, "mean": (3, 4, 1),
                                                     "inv": (3, 4, 1)},
                   {"axis": -1, "epsilon": 1e-5}, [("scale", scale), ("bias", bias)])
    want_y, want_mean, want_inv = tr_onnx.InferenceSession(model).run(
        ["y", "mean", "inv"], {"x": x})
    y = poisoned(x.shape, dt)
    mean, inv = np.empty(rows, np.float32), np.empty(rows, np.float32)
    host(f"tr_layernorm_fwd_{dt}", store(x), store(scale), store(bias), y, mean, inv, LL(rows),
         LL(m), F32(1e-5))
    np.testing.assert_allclose(mean, want_mean.reshape(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv, want_inv.reshape(-1), rtol=1e-6)
    if dt == "f32":
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    else:
        assert_storage_within_1ulp(y, want_y, dt, "layer norm", abs_bound=1e-5)

    grad_model = _model("LayerNormalization", {"x": x}, {"y": x.shape},
                        {"axis": -1, "epsilon": 1e-5}, [("scale", scale), ("bias", bias)])
    _, grads = vjp(grad_model, {"x": x}, ["x", "scale", "bias"], gy)
    gx, gscale, gbias = poisoned(x.shape, dt), poisoned((m,), dt), poisoned((m,), dt)
    host(f"tr_layernorm_bwd_dx_{dt}", store(gy), store(x), store(scale), gx, mean, inv,
         LL(rows), LL(m), F32(1e-5))
    host(f"tr_layernorm_bwd_params_{dt}", store(gy), store(x), mean, inv, gscale, gbias,
         LL(rows), LL(m))
    for got, name in ((gx, "x"), (gscale, "scale"), (gbias, "bias")):
        want = grads[name]
        bound = 1e-5 * np.abs(want).max()
        if dt == "f32":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=bound, err_msg=name)
        else:
            assert_storage_within_1ulp(got, want, dt, f"layer norm grad {name}", bound)


def test_data_movement_kernels_match_numpy(host):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    # Transpose through the strided copy (dims padded to 6 on the left)
    perm = (2, 0, 3, 1)
    want = np.ascontiguousarray(np.transpose(x, perm))
    xs = np.array(x.strides) // 4
    y = np.full(want.shape, np.nan, np.float32)
    dims = [1, 1, *want.shape]
    sx = [0, 0, *[int(xs[p]) for p in perm]]
    sy = [0, 0, *[int(s) for s in np.array(want.strides) // 4]]
    host("tr_strided_copy_b4", x, y, LL(y.size), LL(0), LL(0),
         *[LL(v) for v in dims + sx + sy])
    np.testing.assert_array_equal(y, want)
    # Gather along axis 1 with a negative index, and GatherGrad with a repeated one
    idx = np.array([2, -1, 0, 2], np.int64)
    g = np.full((2, 4, 4, 5), np.nan, np.float32)
    host("tr_gather_b4", x, idx, g, LL(g.size), LL(4), LL(3), LL(20))
    np.testing.assert_array_equal(g, np.take(x, idx, axis=1))
    gy = rng.standard_normal(g.shape).astype(np.float32)
    gx = np.full(x.shape, np.nan, np.float32)
    host("tr_gather_grad_f32", gy, idx, gx, LL(gx.size), LL(4), LL(3), LL(20))
    want_gx = np.zeros_like(x)
    np.add.at(want_gx, (slice(None), idx), gy)
    np.testing.assert_array_equal(gx, want_gx)
    # a broadcast Sub of [2, 3, 4, 1] from [2, 3, 4, 5] (the softmax gradient's)
    b = rng.standard_normal((2, 3, 4, 1)).astype(np.float32)
    y = np.full(x.shape, np.nan, np.float32)
    host("tr_bcast_binary_f32", x, b, y, LL(x.size), I32(1), F32(0.0),
         *[LL(v) for v in [1, 1, 1, 1, 24, 5] + [0] * 4 + [5, 1] + [0] * 4 + [1, 0]
           + [0] * 4 + [5, 1]])
    np.testing.assert_array_equal(y, x - b)
    # ReduceMean over the middle axis, batched MatMul with a broadcast right operand
    r = np.full((2, 20), np.nan, np.float32)
    host("tr_reduce_mid_f32", x, r, LL(2), LL(3), LL(20), I32(1))
    np.testing.assert_allclose(r, x.reshape(2, 3, 20).mean(axis=1), rtol=1e-6, atol=1e-7)
    w = rng.standard_normal((5, 7)).astype(np.float32)
    mm = np.full((2, 3, 4, 7), np.nan, np.float32)
    host("tr_matmul_f32", x, w, mm, LL(6), LL(4), LL(5), LL(7), LL(20), LL(5), LL(1), LL(0),
         LL(7), LL(1))
    np.testing.assert_allclose(mm, x @ w, rtol=1e-5, atol=1e-6)
    e = np.full(x.shape, np.nan, np.float32)
    host("tr_erf_f32", x, e, LL(x.size))
    want_erf = np.array([math.erf(v) for v in x.reshape(-1).tolist()]).reshape(x.shape)
    np.testing.assert_allclose(e, want_erf, rtol=4 * F32_EPS, atol=F32_EPS)
