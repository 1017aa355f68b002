"""The GPU check in stages: each stage one process (``scripts/gpu_check.sh`` runs them, each
under its own time limit), each appending JSON lines to ``$OUT/stages.jsonl`` as soon as it
has a result and rewriting ``$OUT/summary.md`` (stage, status, seconds, key numbers or the
error's first line). A failing stage does not stop the next; a stage killed at its limit still
leaves the lines it wrote, and a ``timeout`` line (``close``).

    python scripts/gpu_stages.py plan                      # "name limit_s env" per stage
    python scripts/gpu_stages.py run NAME [--dry-run] [--out DIR]
    python scripts/gpu_stages.py close NAME --rc RC --seconds S [--out DIR]

Lines: ``{"stage", "type": "result", ...numbers...}`` per check (``ok`` false on a check out of
tolerance makes the stage ``failed``) and one ``{"stage", "type": "stage", "status", "seconds",
"key", "error"}`` at the end. ``--dry-run``: the CPU, the cuda executor over the host emulator
where a stage can use it, else ``skipped: no GPU``; smaller cases, no timing.

Stages (see ``STAGES``): versions, kernels, capture, cudnn, models (TF32 as the machine has
it), models-tf32-off (NVIDIA_TF32_OVERRIDE=0, and replay with cuDNN's non-deterministic engines
deselected: TR_ONNX_CUDNN_DETERMINISTIC=1), convnets, precision-export, nccl (a world of 1
through data parallelism's NCCL all-reduce in the captured step), real-exports (models
exported here by scripts/export_real_sets.py, carried in .gpu-real), benchmark
(``gpu_check.run_benchmark``: results.json / results.md as before, for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "scripts")) if p not in sys.path]



class _GpuCheck:
    """scripts/gpu_check.py (parity functions, benchmark), imported on first use: ``plan`` and
    ``close`` (run by gpu_check.sh around every stage) stay free of tr_onnx's import time."""

    def __getattr__(self, name: str):
        import gpu_check as module  # scripts/ is on sys.path (above)

        return getattr(module, name)


gpu_check = _GpuCheck()

STATUSES = ("ok", "failed", "skipped", "timeout")


class Skip(Exception):
    """The stage cannot run here (``skipped: <reason>``)."""


@dataclass
class Stage:
    name: str
    limit_s: int  # on the H200; the dry run's whole budget is ~60 s
    run: Callable[[Context], str]  # returns the key numbers, one line
    env: dict[str, str] = field(default_factory=dict)
    what: str = ""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

class Context:
    """One stage's run: where its lines go, the device (None: the GPU; else the host
    emulator's factory), and whether this is the dry run."""

    def __init__(self, stage: Stage, out: Path, dry: bool):
        self.stage, self.out, self.dry = stage, out, dry
        self.start = time.perf_counter()
        self.failed: list[str] = []
        self._device = None

    @property
    def device(self):
        if self.dry and self._device is None:
            self._device = emulator()
        return self._device

    def result(self, **row) -> dict:
        """Append one result line now (a later kill keeps it); ``ok=False`` fails the stage."""
        row = {"stage": self.stage.name, "type": "result",
               "t": round(time.perf_counter() - self.start, 2), **row}
        if row.get("ok") is False:
            self.failed.append(str(row.get("name", "?")))
        append(self.out, row)
        gpu_check.log(f"[{self.stage.name}] {json.dumps(row, default=str)}")
        return row

    def check(self, name: str, fn: Callable[[], dict], tol: dict | None = None) -> dict:
        """Run ``fn`` (a dict of numbers); a failure is a result line with the error, not the
        end of the stage. ``tol``: key -> bound; ``ok`` says whether every bound holds."""
        t0 = time.perf_counter()
        try:
            got = fn()
        except (KeyboardInterrupt, Skip):
            raise
        except Exception as e:
            traceback.print_exc()
            return self.result(name=name, ok=False, error=first_line(e),
                               seconds=round(time.perf_counter() - t0, 2))
        if tol:
            got.setdefault("ok", all(got[k] <= v for k, v in tol.items() if k in got))
            got["tol"] = {k: v for k, v in tol.items() if k in got}
        return self.result(name=name, **got, seconds=round(time.perf_counter() - t0, 2))


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def append(out: Path, row: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stages.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    write_summary(out)


def records(out: Path) -> list[dict]:
    path = out / "stages.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return rows


def write_summary(out: Path) -> None:
    """``summary.md``: one row per stage of ``STAGES`` (its last ``stage`` line; a stage still
    running or never reached says so, with its result lines so far)."""
    rows = records(out)
    mode = "dry run (CPU)" if any(r.get("dry") for r in rows) else "GPU"
    lines = [f"# tr_onnx gpu_check stages ({mode})", "",
             "| stage | status | seconds | key numbers / first error line |",
             "|---|---|---|---|"]
    for st in STAGES:
        mine = [r for r in rows if r.get("stage") == st.name]
        final = [r for r in mine if r.get("type") == "stage"]
        results = [r for r in mine if r.get("type") == "result"]
        if final:
            f = final[-1]
            text = f.get("error") or f.get("key") or ""
            lines.append(f"| {st.name} | {f['status']} | {f.get('seconds', '-')} | "
                         f"{text.replace('|', '/')} |")
        else:
            state = "running" if results else "not run"
            lines.append(f"| {st.name} | {state} | - | {len(results)} result lines |")
    lines += ["", "Result lines: stages.jsonl; benchmark table: results.md."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def run_stage(name: str, out: Path, dry: bool) -> int:
    """Run stage ``name`` here; write its lines and its final line. 0 unless it failed."""
    stage = STAGE_BY_NAME[name]
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(stage, out, dry)
    final = {"stage": name, "type": "stage", "dry": dry}
    try:
        key = stage.run(ctx)
        status = "failed" if ctx.failed else "ok"
        final.update(key=key, **({"error": "failed: " + ", ".join(ctx.failed)}
                                 if ctx.failed else {}))
    except Skip as e:
        status = "skipped"
        final["key"] = f"skipped: {e}"
    except KeyboardInterrupt:  # gpu_check.sh's timeout sends SIGINT first
        status = "timeout"
        final["error"] = f"timeout after {time.perf_counter() - ctx.start:.0f}s (SIGINT)"
    except Exception as e:
        traceback.print_exc()
        status = "failed"
        final["error"] = first_line(e)
    final.update(status=status, seconds=round(time.perf_counter() - ctx.start, 1))
    append(out, final)
    return 1 if status in ("failed", "timeout") else 0


def close_stage(name: str, out: Path, rc: int, seconds: float, dry: bool) -> None:
    """After the stage's process ended: if it wrote no final line (killed, crashed), write
    one -- ``timeout`` for timeout's 124/137, else ``failed`` with the exit status."""
    if any(r.get("stage") == name and r.get("type") == "stage" for r in records(out)):
        write_summary(out)
        return
    timed_out = rc in (124, 137)
    append(out, {"stage": name, "type": "stage", "dry": dry,
                 "status": "timeout" if timed_out else "failed", "seconds": round(seconds, 1),
                 "error": (f"killed at the time limit (rc {rc})" if timed_out else
                           f"the stage's process exited with rc {rc} and no final line")})


# --------------------------------------------------------------------------------------------
# Devices and caches
# --------------------------------------------------------------------------------------------

def emulator():
    """The host emulator's device factory (the one import of host_emulator in scripts/,
    through gpu_check), over a host build cached by its source text across stage processes."""
    from tr_onnx.backends.cuda import sources

    he = gpu_check.host_emulator_module()
    text = "\n".join(s.text for s in sources.SOURCES.values())
    key = hashlib.sha256((text + " ".join(he.HOST_FLAGS)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TR_ONNX_GPU_CHECK_CACHE", "/tmp/tr_onnx_gpu_check_cache"))
    lib_path = cache / f"host_{key}" / "kernels.so"
    if lib_path.exists():
        import ctypes

        return he.host_emulator(ctypes.CDLL(str(lib_path)))
    return he.host_emulator(he.build_host_library(lib_path.parent))


def cache_cubins_on_disk() -> None:
    """NVRTC takes seconds per family and every stage is a new process: keep each family's
    cubin on disk (key: source text + NVRTC options), filled by the kernels stage. A
    script-side wrapper of ``device.kernel_image`` (tr_onnx has no disk cache of its own)."""
    from tr_onnx.backends.cuda import device, sources

    inner = device.kernel_image
    if getattr(inner, "disk_cached", False):
        return
    cache = Path(os.environ.get("TR_ONNX_GPU_CHECK_CACHE", "/tmp/tr_onnx_gpu_check_cache"))

    def kernel_image(family: str, arch: str, source: str | None = None) -> bytes:
        text = source if source is not None else sources.SOURCES[family].text
        key = hashlib.sha256((text + " ".join(sources.compile_options(arch))).encode())
        path = cache / f"{family.replace('/', '_').replace(':', '_')}-{arch}-" \
                       f"{key.hexdigest()[:16]}.cubin"
        if path.exists():
            return path.read_bytes()
        image = inner(family, arch, source)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image)
        return image

    kernel_image.disk_cached = True
    device.kernel_image = kernel_image


def need_gpu(ctx: Context) -> None:
    if ctx.dry:
        raise Skip("no GPU")
    from tr_onnx.backends.cuda.backend import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"no usable GPU: {reason}")
    cache_cubins_on_disk()


# --------------------------------------------------------------------------------------------
# 0 versions
# --------------------------------------------------------------------------------------------

def stage_versions(ctx: Context) -> str:
    """Driver, runtime, NVRTC, CuPy, cuDNN (library and frontend), torch, free memory."""
    v: dict = {}

    def get(key, fn):
        try:
            v[key] = fn()
        except Exception as e:
            v[key] = f"unavailable ({first_line(e)})"

    import cupy

    rt = cupy.cuda.runtime
    get("cupy", lambda: cupy.__version__)
    get("cuda_runtime", rt.runtimeGetVersion)
    get("nvrtc", lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion())))
    get("cudnn_frontend", lambda: __import__("cudnn").__version__)
    get("cudnn", lambda: __import__("cudnn").backend_version())
    get("torch", lambda: __import__("torch").__version__)
    get("numpy", lambda: np.__version__)
    get("cuda_include_dir", lambda: __import__(
        "tr_onnx.backends.cuda.sources", fromlist=["x"]).cuda_include_dir())
    if not ctx.dry:
        get("driver", rt.driverGetVersion)
        get("gpu", lambda: rt.getDeviceProperties(0)["name"].decode())
        get("compute_capability", lambda: cupy.cuda.Device(0).compute_capability)
        get("free_mib", lambda: rt.memGetInfo()[0] // 2**20)
        get("total_mib", lambda: rt.memGetInfo()[1] // 2**20)
    get("cuda", lambda: __import__("tr_onnx.backends.cuda.backend",
                                   fromlist=["x"]).cuda_unavailable_reason() or "usable")
    ctx.result(name="versions", **v)
    keys = ("gpu", "driver", "cudnn", "nvrtc", "cupy", "free_mib")
    return ", ".join(f"{k} {v[k]}" for k in keys if k in v)


# --------------------------------------------------------------------------------------------
# 1 kernels
# --------------------------------------------------------------------------------------------

def _one_node_model(op: str, inputs: list[np.ndarray], attrs: dict | None = None,
                    n_consts: int = 0, opset: int = 17):
    """``y = op(x, *consts)``: the first input fed, the rest initializers."""
    import onnx
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    names = ["x"] + [f"c{i}" for i in range(len(inputs) - 1)]
    inits = [numpy_helper.from_array(a, n) for a, n in zip(inputs[1:], names[1:])]
    node = helper.make_node(op, names, ["y"], **(attrs or {}))
    dtype = onnx.helper.np_dtype_to_tensor_dtype(inputs[0].dtype)

    def model(y_shape):
        graph = helper.make_graph(
            [node], op, [helper.make_tensor_value_info("x", dtype, list(inputs[0].shape))],
            [helper.make_tensor_value_info("y", dtype, y_shape)], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    # the output's shape (tr_onnx's loader wants one): what ONNX's reference evaluator gives
    y = ReferenceEvaluator(model(None)).run(None, {"x": inputs[0]})[0]
    return model(list(y.shape))


def kernel_cases() -> dict[str, tuple]:
    """A dozen one-node models over most kernel families: op, inputs, attrs, fp32 tolerance
    (max |a-b| / max |b|: libm-level for exp/tanh/softmax, exact for data movement)."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    img = r(2, 8, 6, 6)
    return {
        "Relu": ("Relu", [r(4, 33)], {}, 0.0),
        "Sigmoid": ("Sigmoid", [r(4, 33)], {}, 1e-6),
        "Tanh": ("Tanh", [r(4, 33)], {}, 1e-6),
        "Exp": ("Exp", [r(4, 33)], {}, 1e-6),
        "Add-broadcast": ("Add", [r(4, 33), r(33)], {}, 0.0),
        "Mul": ("Mul", [r(4, 33), r(4, 33)], {}, 0.0),
        "Softmax": ("Softmax", [r(4, 33)], {"axis": -1}, 1e-6),
        "ReduceMean": ("ReduceMean", [r(4, 33)], {"axes": [1], "keepdims": 1}, 1e-6),
        "Transpose": ("Transpose", [r(3, 4, 5)], {"perm": [2, 0, 1]}, 0.0),
        "MaxPool": ("MaxPool", [img], {"kernel_shape": [2, 2], "strides": [2, 2]}, 0.0),
        "GlobalAveragePool": ("GlobalAveragePool", [img], {}, 1e-6),
        "Concat": ("Concat", [r(2, 3), r(2, 5)], {"axis": 1}, 0.0),
    }


def stage_kernels(ctx: Context) -> str:
    """Every kernel family compiled by NVRTC (timed; the dry run: two, for sm_90), then a
    dozen one-node models through the cuda executor (its launches on CupyDevice, or the host
    emulator) against the numpy backend."""
    import tr_onnx
    from tr_onnx.backends.cuda import sources

    if not ctx.dry:
        need_gpu(ctx)
    from tr_onnx.backends.cuda import device as cuda_device

    arch = "sm_90"
    if not ctx.dry:
        import cupy

        cc = cupy.cuda.Device(0).compute_capability
        arch = f"sm_{cc}"
    families = ["amp", "matmul"] if ctx.dry else list(sources.SOURCES)
    compiled = 0
    for family in families:
        def compile_one(family=family):
            t0 = time.perf_counter()
            image = cuda_device.kernel_image(family, arch)
            missing = [k for k in sources.SOURCES[family].kernels
                       if k.encode() + b"\0" not in image]
            return {"compile_s": round(time.perf_counter() - t0, 2), "bytes": len(image),
                    "kernels": len(sources.SOURCES[family].kernels), "arch": arch,
                    "missing": missing, "ok": not missing}
        row = ctx.check(f"nvrtc {family}", compile_one)
        compiled += bool(row.get("ok"))
    passed = 0
    cases = kernel_cases()
    for name, (op, inputs, attrs, tol) in cases.items():
        def parity(op=op, inputs=inputs, attrs=attrs):
            model = _one_node_model(op, inputs, attrs).SerializeToString()
            feed = {"x": inputs[0]}
            want = tr_onnx.InferenceSession(model, backend="numpy").run(None, feed)[0]
            got = tr_onnx.InferenceSession(model, **gpu_check._cuda_kwargs(ctx.device)).run(
                None, feed)[0]
            return {"max_rel": gpu_check._maxrel(got, want), "shape": list(want.shape)}
        row = ctx.check(f"kernel {name}", parity, {"max_rel": tol})
        passed += bool(row.get("ok"))
    return (f"{compiled}/{len(families)} families compiled ({arch}), "
            f"{passed}/{len(cases)} one-node kernels match numpy")


# --------------------------------------------------------------------------------------------
# 2 capture
# --------------------------------------------------------------------------------------------

AXPY = r"""
#include "elementwise.cuh"
TR_KERNEL void gpu_check_axpy(const float* x, float* y, float a, long long n) {
    TR_GRID_STRIDE(i, n) { y[i] = a * x[i] + y[i]; }
}
"""


def stage_capture(ctx: Context) -> str:
    """Pinned buffers and their events, a kernel and a copy captured into a CUDA graph and
    replayed (against NumPy; replay time by CUDA events), and a capture invalidated on purpose
    (a synchronize inside it) that must end in CaptureError with the stream usable after."""
    need_gpu(ctx)
    from types import SimpleNamespace

    import cupy

    from tr_onnx.backends.cuda.capture import CaptureError, CaptureStep, capture_step
    from tr_onnx.backends.cuda.device import CupyDevice, KernelRef, launch_dims

    n = 1 << 16
    nbytes = 4 * n
    dev = CupyDevice(SimpleNamespace(total_bytes=2 * nbytes))
    x_dev, y_dev = dev.arena_base, dev.arena_base + nbytes
    ref = KernelRef("plugin:gpu_check/axpy", "gpu_check_axpy", source=AXPY)
    dev.prepare_kernel(ref)
    grid, block = launch_dims(n)
    pinned = dev.pinned_buffers(nbytes, 2)
    x_host, y_host = pinned[0].view(np.float32), pinned[1].view(np.float32)

    def upload(d):
        d.memcpy_async(x_dev, pinned[0], nbytes, "h2d")

    def axpy(d):
        d.launch(ref, grid, block, (np.uint64(x_dev), np.uint64(y_dev), np.float32(2.0),
                                    np.int64(n)))

    def zero_y() -> None:  # on the device's stream: the legacy stream does not order with it
        cupy.cuda.runtime.memsetAsync(y_dev, 0, nbytes, dev.stream.ptr)

    def read_y() -> np.ndarray:
        dev.memcpy_async(pinned[1], y_dev, nbytes, "d2h")
        dev.record_host_buffer(1)
        dev.wait_host_buffer(1)
        return y_host.copy()

    def pinned_round_trip():
        x_host[:] = np.arange(n, dtype=np.float32)
        upload(dev)
        dev.record_host_buffer(0)
        dev.wait_host_buffer(0)
        dev.memcpy_async(pinned[1], x_dev, nbytes, "d2h")
        dev.record_host_buffer(1)
        dev.wait_host_buffer(1)
        return {"max_abs": float(np.abs(y_host - x_host).max()), "bytes": nbytes,
                "ok": bool(np.array_equal(y_host, x_host))}
    ctx.check("pinned h2d/d2h with events", pinned_round_trip)

    def captured_replay():
        zero_y()
        x_host[:] = 1.0
        steps = [CaptureStep("upload", "forward", upload), CaptureStep("axpy", "forward", axpy)]
        graph = capture_step(steps, dev, warmup=1, allocation_guard=dev.allocation_guard)
        after_warmup = read_y()  # the warm-up ran once: y = 2
        x_host[:] = 3.0  # the graph's copy reads the pinned buffer at replay
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(dev.stream)
        for _ in range(10):
            dev.launch_graph(graph)
        end.record(dev.stream)
        end.synchronize()
        got = read_y()
        want = np.full(n, 2.0 + 10 * 6.0, np.float32)
        return {"warmup_max_abs": float(np.abs(after_warmup - 2.0).max()),
                "replay_max_abs": float(np.abs(got - want).max()), "replays": 10,
                "replay_us": round(cupy.cuda.get_elapsed_time(start, end) * 100, 2),
                "ok": bool(np.array_equal(got, want) and np.all(after_warmup == 2.0))}
    ctx.check("captured copy + kernel replayed", captured_replay)

    def invalidated():
        steps = [CaptureStep("axpy", "forward", axpy),
                 CaptureStep("sync inside capture", "forward", lambda d: d.stream.synchronize()),
                 CaptureStep("axpy again", "forward", axpy)]
        row: dict = {}
        try:
            capture_step(steps, dev, warmup=0, allocation_guard=dev.allocation_guard)
            row["raised"] = None
        except CaptureError as e:
            row["raised"] = type(e).__name__
            row["node"] = e.node
            row["reason"] = str(e.reason)[:200]
        except Exception as e:  # anything else is the finding
            row["raised"] = first_line(e)
        # the stream is usable: an eager launch and read-back work and are right
        try:
            capturing = dev.stream.is_capturing()
        except Exception as e:
            capturing = first_line(e)
        zero_y()
        x_host[:] = 1.0
        upload(dev)
        axpy(dev)
        got = read_y()
        row.update(capturing_after=capturing,
                   eager_after_max_abs=float(np.abs(got - 2.0).max()),
                   ok=row["raised"] == "CaptureError" and capturing is False
                   and bool(np.all(got == 2.0)))
        return row
    ctx.check("invalidated capture -> CaptureError, stream usable", invalidated)
    return "; ".join(f"{r['name']}: {'ok' if r.get('ok') else 'FAILED'}"
                     for r in records(ctx.out)
                     if r.get("stage") == ctx.stage.name and r.get("type") == "result")


# --------------------------------------------------------------------------------------------
# 3 cuDNN graphs
# --------------------------------------------------------------------------------------------

CUDNN_TOL = {"fp32": {"loss": 2e-3, "gradient": 5e-3}, "fp16": {"loss": 3e-2, "gradient": 5e-2},
             "bf16": {"loss": 6e-2, "gradient": 1e-1}}
"""One step of the conv model (``cudnn_model``) against the fp32 numpy backend. fp32 leaves
room for TF32; the half types are loose bounds on one step (the numbers are the evidence)."""


def cudnn_model() -> bytes:
    """Conv(+bias) -> BatchNormalization -> Relu -> Conv -> GlobalAveragePool -> Flatten ->
    Gemm: in training every cuDNN graph kind (conv fprop/dgrad/wgrad, batchnorm and its
    backward, matmul)."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    c, k = 3, 16

    def init(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32),
                                       name)
    inits = [init("w", k, c, 3, 3), init("b", k), init("w2", k, k, 3, 3, scale=0.1),
             init("fc_w", k, 10), init("fc_b", 10),
             numpy_helper.from_array(np.ones(k, np.float32), "g"),
             numpy_helper.from_array(np.zeros(k, np.float32), "beta"),
             numpy_helper.from_array(np.zeros(k, np.float32), "mean"),
             numpy_helper.from_array(np.ones(k, np.float32), "var")]
    nodes = [helper.make_node("Conv", ["input", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"])]
    graph = helper.make_graph(
        nodes, "cudnn_kinds",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, ["batch", c, 8, 8])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def stage_cudnn(ctx: Context) -> str:
    """Per dtype (fp32, fp16, bf16): the conv model's first training step on cuda (every cuDNN
    graph kind executed) against numpy fp32 -- loss and gradients -- then lr=0 steps captured
    and replayed, equal to the eager step bit for bit."""
    import tr_onnx
    from tr_onnx.backends.cuda.bind import CudnnCall
    from tr_onnx.optim import SGD

    if not ctx.dry:
        need_gpu(ctx)
    model = cudnn_model()
    rng = np.random.default_rng(1)
    feed = {"input": rng.standard_normal((8, 3, 8, 8)).astype(np.float32)}
    y = gpu_check._labels(8, 1)
    ok = 0
    for precision, tol in CUDNN_TOL.items():
        def one(precision=precision):
            def session(backend_kw, **kw):
                kw.setdefault("optimizer", SGD(lr=0.05, momentum=0.9))
                return tr_onnx.TrainingSession(model, channel_align=8, **backend_kw, **kw)
            ref = session({"backend": "numpy"}, grad_accumulation=2)
            # loss scale 1: the accumulators hold the gradients themselves, as numpy's
            scaling = {"loss_scale": {"init": 1.0}} if precision == "fp16" else {}
            cuda = session({**gpu_check._cuda_kwargs(ctx.device), "precision": precision,
                            **scaling}, grad_accumulation=2)
            want, got = ref.train_step(feed, y), cuda.train_step(feed, y)
            names = list(ref._state.active.info.grads.values())
            a, b = cuda.state_arrays(), ref.state_arrays()
            scale = max(float(np.abs(b[n]).max()) for n in names) or 1.0
            grad = max(float(np.abs(a[n].astype(np.float64) - b[n]).max()) for n in names)
            kinds = sorted({c.desc.kind for bn in cuda._state.active.executor.bound
                            for c in bn.calls if isinstance(c, CudnnCall)})
            rep = session({**gpu_check._cuda_kwargs(ctx.device), "precision": precision},
                          optimizer=SGD(lr=0.0))
            losses = [rep.train_step(feed, y) for _ in range(4)]
            return {"loss": abs(got - want) / max(abs(want), 1e-12), "gradient": grad / scale,
                    "kinds": kinds, "replay": max(abs(v - losses[0]) for v in losses),
                    "captured_graphs": list(rep._state.active.executor.graphs)}
        row = ctx.check(f"cudnn {precision}", one, {**tol, "replay": 0.0})
        ok += bool(row.get("ok"))
    return f"{ok}/{len(CUDNN_TOL)} dtypes: every kind vs numpy, replay == eager"


# --------------------------------------------------------------------------------------------
# 4, 5 models
# --------------------------------------------------------------------------------------------

def _parity(ctx: Context, stems: list[str], steps: int, checks: tuple[str, ...]) -> str:
    """``checks`` of gpu_check's parity functions per model, each its own result line."""
    fns = {"forward": lambda s: gpu_check.forward_parity(s, ctx.device),
           "gradient": lambda s: gpu_check.gradient_parity(s, ctx.device),
           "training": lambda s: gpu_check.training_parity(s, ctx.device, steps),
           "replay": lambda s: gpu_check.replay_parity(s, ctx.device)}
    if not ctx.dry:
        need_gpu(ctx)
    worst: dict[str, float] = {}
    for stem in stems:
        for check in checks:
            row = ctx.check(f"{stem} {check}", lambda c=check, s=stem: fns[c](s), gpu_check.TOL)
            for k in ("forward", "gradient", "loss", "weights", "replay"):
                if isinstance(row.get(k), float):
                    worst[k] = max(worst.get(k, 0.0), row[k])
    tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE", "default")
    return f"TF32 override {tf32}; worst " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items())


def stage_models(ctx: Context) -> str:
    """MLP, LeNet, transformer: forward, 5 SGD steps, replay == eager (TF32 as the machine
    has it)."""
    stems = ["mlp"] if ctx.dry else ["mlp", "lenet", "transformer"]
    return _parity(ctx, stems, 2 if ctx.dry else 5, ("forward", "training", "replay"))


def deterministic_cudnn() -> str:
    """Deselect cuDNN's non-deterministic engines in every graph this process plans
    (tr_onnx's ``TR_ONNX_CUDNN_DETERMINISTIC``)."""
    from tr_onnx.backends.cuda.cudnn_graphs import DETERMINISTIC_ENV

    os.environ[DETERMINISTIC_ENV] = "1"
    return f"non-deterministic engines deselected ({DETERMINISTIC_ENV}=1)"


def stage_models_tf32_off(ctx: Context) -> str:
    """The same fp32 parity with NVIDIA_TF32_OVERRIDE=0 (set in this stage's environment by
    gpu_check.sh): a layout bug stays, TF32 rounding goes. Replay with cuDNN's
    non-deterministic engines deselected."""
    note = deterministic_cudnn()
    ctx.result(name="settings", tf32_override=os.environ.get("NVIDIA_TF32_OVERRIDE"),
               cudnn=note)
    stems = ["mlp"] if ctx.dry else ["mlp", "lenet", "transformer"]
    return _parity(ctx, stems, 2 if ctx.dry else 5, ("forward", "training", "replay"))


def stage_convnets(ctx: Context) -> str:
    """ResNet and MobileNet: forward, gradients, 10 SGD steps, replay == eager; and MobileNet
    exported in training mode (its Dropout: the device's Philox masks against numpy's),
    gradients and SGD steps (an inference session refuses its training-mode Dropout)."""
    stems = ["resnet"] if ctx.dry else ["resnet", "mobilenet"]
    checks = ("forward", "training") if ctx.dry else ("forward", "gradient", "training",
                                                      "replay")
    steps = 2 if ctx.dry else 10
    summary = _parity(ctx, stems, steps, checks)
    dropout = _parity(ctx, ["mobilenet_train"], steps, ("gradient", "training"))
    return f"{summary}; with Dropout: {dropout.split('; worst ', 1)[-1]}"


def stage_precision_export(ctx: Context) -> str:
    """fp16 and bf16 training against the fp32 curve (``gpu_check.precision_parity``: the loss
    per step and the weights' drift against what rounding alone moves), and the model trained
    on cuda, exported and run by onnxruntime (``gpu_check.export_parity``)."""
    if not ctx.dry:
        need_gpu(ctx)
    stems = ["mlp"] if ctx.dry else ["mlp", "resnet", "transformer"]
    bad = 0
    for stem in stems:
        for precision in gpu_check.HALF_TOL:
            row = ctx.check(f"{stem} {precision} vs fp32",
                            lambda s=stem, p=precision: gpu_check.precision_parity(
                                s, ctx.device, p))
            bad += not row.get("ok", False)
        row = ctx.check(f"{stem} export", lambda s=stem: gpu_check.export_parity(s, ctx.device),
                        gpu_check.TOL)
        bad += not row.get("ok", False)
    return f"{len(stems)} models x (fp16, bf16, export): {bad} failing"


def real_exports_folder(ctx: Context) -> Path:
    """Where scripts/export_real_sets.py wrote the sets: ``$TR_ONNX_REAL_EXPORTS``, else
    ``.gpu-real`` (carried to the GPU machine, which cannot export them: no transformers or
    tf2onnx there). Without one, the dry run writes the zoo's MLP as a set (the plumbing, not
    an export: exporting takes the test extra and more than the stage's limit)."""
    folder = Path(os.environ.get("TR_ONNX_REAL_EXPORTS") or ROOT / ".gpu-real")
    if (folder / "sets.json").exists():
        return folder
    if not ctx.dry:
        raise Skip(f"no exported sets in {folder}: run `python scripts/export_real_sets.py "
                   ".gpu-real` on a machine with the test extra and carry .gpu-real")
    import export_real_sets  # scripts/ is on sys.path (above)

    folder = ctx.out / "real_exports"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def batches(k: int):
        return ({"input": rng.standard_normal((4, 64)).astype(np.float32)},
                rng.integers(0, 10, 4).astype(np.int64))

    row = export_real_sets.write_set(folder, "zoo-mlp", ROOT / "model_zoo" / "mlp.onnx",
                                     batches, 0.1)
    export_real_sets.write_index(folder, {"zoo-mlp": row})
    return folder


def stage_real_exports(ctx: Context) -> str:
    """Real exports (a torchvision-shaped CNN from the dynamo exporter, a Hugging Face BERT, a
    Llama at opset 23, a bidirectional LSTM: scripts/export_real_sets.py), three plain SGD
    steps on cuda against numpy on the same batches (``gpu_check.real_export_parity``)."""
    folder = real_exports_folder(ctx)
    if not ctx.dry:
        need_gpu(ctx)
    cases = list(json.loads((folder / "sets.json").read_text()))
    bad = 0
    for case in cases:
        row = ctx.check(f"{case} training", lambda c=case: gpu_check.real_export_parity(
            folder, c, ctx.device), {k: gpu_check.TOL[k] for k in ("loss", "weights")})
        bad += not row.get("ok", False)
    return f"{len(cases)} real exports x 3 SGD steps vs numpy: {bad} failing"


def stage_nccl(ctx: Context) -> str:
    """Data parallelism's NCCL path at a world of 1 (``gpu_check.nccl_parity``): the plan's
    GradAllReduce as one NCCL all-reduce captured in the step's graph (and, on the ResNet,
    BroadcastStats as NCCL broadcasts), the same losses and weights as without it, bit for bit
    (cuDNN's deterministic engines). The ResNet with ``sync_batchnorm=True`` too
    (``gpu_check.sync_batchnorm_parity``): BatchNorm's own kernels with NCCL sums between them in
    the captured step, against cuDNN's BatchNorm and numpy within ``gpu_check.TOL``. A real NCCL
    communicator of one rank; several ranks need a machine with several GPUs (one rank per GPU: NCCL
    refuses two ranks of a communicator on one device). Dry run: the host emulator,
    ``testing.host_nccl`` in place of ``cupy.cuda.nccl``."""
    note = deterministic_cudnn()
    if ctx.dry:
        from tr_onnx import distributed
        from tr_onnx.backends.cuda import nccl
        from tr_onnx.testing.host_nccl import HostNccl

        host = HostNccl(distributed.World())
        nccl.nccl_module = lambda: host
    else:
        need_gpu(ctx)

        def version() -> dict:
            from tr_onnx.backends.cuda.nccl import nccl_module

            return {"version": nccl_module().get_version(), "cudnn": note}

        ctx.check("nccl version", version)
    # resnet: BroadcastStats too; fp16: half GRAD buckets and the loss scale's step guard
    stems = [("mlp", {}), ("mlp", {"precision": "fp16"})] + ([] if ctx.dry else [("resnet", {})])
    worst = 0.0
    for stem, options in stems:
        label = " ".join([stem, *options.values()])
        row = ctx.check(f"{label} world of 1 via nccl",
                        lambda s=stem, o=options: gpu_check.nccl_parity(
                            s, ctx.device, 2 if ctx.dry else 5, **o))
        worst = max(worst, row.get("nccl", float("inf")))
    sync = ctx.check("resnet sync_batchnorm world of 1 via nccl",
                     lambda: gpu_check.sync_batchnorm_parity("resnet", ctx.device,
                                                             2 if ctx.dry else 5))
    return (f"{len(stems)} models, world of 1 through NCCL vs without: max diff {worst:g}; "
            f"sync_batchnorm vs cuDNN's and numpy's: loss {sync.get('loss', float('inf')):.2g}"
            f", weights {sync.get('weights', float('inf')):.2g}")


# --------------------------------------------------------------------------------------------
# 6 benchmark
# --------------------------------------------------------------------------------------------

def stage_benchmark(ctx: Context) -> str:
    """gpu_check's benchmark rows (ResNet-50 shaped first: tr_onnx fp32/fp16/bf16 against
    PyTorch AMP channels_last eager; torch.compile last), each row a result line and
    results.json / results.md rewritten after it, as ``gpu_check.py --benchmark`` does."""
    if not ctx.dry:
        need_gpu(ctx)
    results = {"mode": "dry run (CPU, host emulator, no timing)" if ctx.dry else "GPU",
               "env": gpu_check.environment(ctx.dry), "tolerances": gpu_check.TOL,
               "parity": [], "benchmark": []}
    rows = results["benchmark"]
    seen = [0]

    def save() -> None:
        (ctx.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (ctx.out / "results.md").write_text(gpu_check.markdown(results))
        for r in rows[seen[0]:]:
            note = r.get("note", "")
            ctx.result(name=f"{r['model']} {r['runner']}", **r,
                       **({"ok": False} if note.startswith("error") else {}))
        seen[0] = len(rows)

    # on the GPU the budget leaves the stage 40 s to write its table; the dry run exists to
    # run every runner's plumbing, which takes 15-20 s of this machine's CPU alone (more
    # under load, where a 15 s budget skipped the torch runners), so it uses all but 10 s
    margin = 10 if ctx.dry else 40
    budget = float(os.environ.get("GPU_CHECK_BENCH_BUDGET_S", ctx.stage.limit_s - margin))
    gpu_check.run_benchmark(ctx.device, ctx.dry, 64, 20, budget, False, rows, save,
                            models=["resnet50"] if ctx.dry else None, compile_last=True)
    save()
    base = {r["runner"]: r.get("images_s") for r in rows if r["model"] == "resnet50"}
    ref = base.get(gpu_check.RATIO_BASE)
    best = {p: base.get(f"tr_onnx cuda {p} (train_step)") for p in ("fp32", "fp16", "bf16")}
    if ctx.dry or not ref:
        return f"{len(rows)} rows (results.md)"
    return "resnet50 images/s vs torch AMP fp16 " + ", ".join(
        f"{p} {v / ref:.2f}x" for p, v in best.items() if v) + f" ({len(rows)} rows)"


STAGES = [
    Stage("0-versions", 30, stage_versions, what="driver, runtime, NVRTC, CuPy, cuDNN, memory"),
    Stage("1-kernels", 55, stage_kernels, what="NVRTC per family, 12 one-node kernels vs numpy"),
    Stage("2-capture", 30, stage_capture, what="pinned+events, captured replay, CaptureError"),
    Stage("3-cudnn", 45, stage_cudnn, what="every cuDNN kind x fp32/fp16/bf16, replay"),
    Stage("4-models", 55, stage_models, what="mlp, lenet, transformer (TF32 default)"),
    Stage("4b-models-tf32-off", 35, stage_models_tf32_off, {"NVIDIA_TF32_OVERRIDE": "0"},
          what="the same, TF32 off, deterministic cuDNN engines"),
    Stage("5-convnets", 60, stage_convnets,
          what="resnet, mobilenet training parity; mobilenet_train's Dropout"),
    Stage("5b-precision-export", 50, stage_precision_export,
          what="fp16/bf16 against the fp32 curve, onnxruntime runs the exported model"),
    Stage("5c-nccl", 20, stage_nccl, what="a world of 1 through NCCL in the captured step "
          "(fp32, fp16, sync_batchnorm)"),
    Stage("5d-real-exports", 45, stage_real_exports,
          what="a dynamo CNN, BERT, Llama opset 23, a BiLSTM: 3 SGD steps vs numpy"),
    Stage("6-benchmark", 55, stage_benchmark, what="ResNet-50 etc. vs torch (results.md)"),
]
STAGE_BY_NAME = {s.name: s for s in STAGES}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan", help="print 'name limit_s KEY=VALUE...' per stage")
    for cmd in ("run", "close"):
        s = sub.add_parser(cmd)
        s.add_argument("stage", choices=list(STAGE_BY_NAME))
        s.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
        s.add_argument("--dry-run", action="store_true")
        if cmd == "close":
            s.add_argument("--rc", type=int, required=True)
            s.add_argument("--seconds", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.cmd == "plan":
        for s in STAGES:
            print(s.name, s.limit_s, *(f"{k}={v}" for k, v in s.env.items()))
        return 0
    out = Path(args.out)
    # a process started with SIGINT ignored (a background job of a non-interactive shell)
    # would never see timeout's SIGINT: take it as KeyboardInterrupt, as an interactive run
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.cmd == "close":
        close_stage(args.stage, out, args.rc, args.seconds, args.dry_run)
        return 0
    return run_stage(args.stage, out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
