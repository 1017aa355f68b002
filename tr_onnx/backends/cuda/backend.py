"""The cuda backend as a ``Backend`` (``BACKEND``): a registry kernel is a binding factory (a
plugin's ``CudaKernel`` made one by ``bind.kernel_factory``), WORKSPACE holds at least the
host transfers' staging area, and the executor is a ``CudaExecutor`` over a device.

``device`` (a factory ``device(plan) -> capture.DeviceAPI``) is the device the executor runs
on: None, the builtin's, is a ``CupyDevice`` on the GPU (CuPy imported only then); the tests
make the same backend over the host emulator or a recorder
(``testing.host_emulator.emulated_cuda``), which needs no GPU."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import Backend
from . import device as cuda_device
from .bind import CudnnCall, kernel_factory
from .deviceless import H200_PROPERTIES, check_plan
from .executor import CudaExecutor
from .transfers import staging_bytes

CUDA_EXTRA = "pip install 'tr_onnx[cu13]'  (CUDA 12 drivers: 'tr_onnx[cu12]')"


def cuda_unavailable_reason() -> str | None:
    """Why the cuda backend cannot run here (None when it can). Never raises; imports CuPy only
    inside ``device.cuda_available``."""
    if cuda_device.cuda_available():
        return None
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy whose CUDA libraries do not load
        return f"CuPy is not importable ({type(exc).__name__}: {exc}); install {CUDA_EXTRA}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, or a driver too old for CuPy
        return (f"CuPy is installed but no CUDA driver/GPU is usable ({exc}); the cuda backend "
                f"needs an NVIDIA GPU with a driver matching the CuPy build ({CUDA_EXTRA})")
    return f"CuPy sees {count} usable GPU(s) but cupy.cuda.is_available() is False"


@dataclass(frozen=True)
class CudaBackend(Backend):
    device: Callable[[Any], Any] | None = None
    name = "cuda"
    channel_align = 8
    decides_steps = True

    def unavailable_reason(self) -> str | None:
        return None if self.device is not None else cuda_unavailable_reason()

    def usable(self) -> bool:  # no reason needed: CuPy is imported only where a driver loads
        return self.device is not None or cuda_device.cuda_available()

    def on_device(self, device: Callable[[Any], Any]) -> CudaBackend:
        return dataclasses.replace(self, device=device)

    def plan_report(self, plan, target=None) -> dict:
        """``paths``: per node, the cuDNN graphs its binding chose (``cuDNN <kind>``) or
        tr_onnx's own kernels, or the node whose graph computes it (a Relu in a convolution's
        epilogue); where an op's family could take another path, the reason it did not
        (``PATH_NOTES`` of its bindings' module, e.g. attention's SDPA opt-in).
        ``cudnn_graphs``: the real cuDNN library's deviceless check of every graph the plan
        declares, for the GPU ``target`` describes (default: the packaged H200)."""
        sources = {id(node): source for node, source in plan.kernels}
        paths: dict = {}
        for bn in plan.executor.bound:
            node = bn.node
            kinds = sorted({c.desc.kind for c in bn.calls if isinstance(c, CudnnCall)})
            path = (f"cuDNN {' + '.join(kinds)}" if kinds else
                    "fused into a cuDNN graph" if bn.fused_into else "tr_onnx kernels")
            source = sources.get(id(node)) or ""
            note = (getattr(importlib.import_module(source), "PATH_NOTES", {}).get(node.op_type)
                    if source.startswith("tr_onnx.") and not kinds else None)
            if note:
                path += f" ({note})"
            key = (node.domain or "ai.onnx", node.op_type, node.since_version)
            paths.setdefault(key, Counter())[path] += 1
        graphs = {"target": str(target or H200_PROPERTIES),
                  "graphs": [dataclasses.asdict(c) | {"ok": c.ok}
                             for c in check_plan(plan, target)]}
        return {"paths": {k: dict(v) for k, v in paths.items()}, "cudnn_graphs": graphs}

    def kernel_factory(self, kernel):
        return kernel_factory(kernel)

    def min_workspace_bytes(self, graph) -> int:
        return staging_bytes(graph)

    def executor(self, plan, cuda_graphs: str = "fallback") -> CudaExecutor:
        """A ``CudaExecutor`` bound to ``device(plan)`` (default: a ``CupyDevice`` holding the
        plan's arena), with the plan's initial contents uploaded. Raises ``CudaUnsupported``
        listing every op the cuda backend cannot run; nothing falls back to NumPy."""
        if self.device is None:
            # data parallel: one GPU per rank of a machine (NCCL refuses two ranks on one device)
            world = getattr(plan.info, "world", None)
            dev = cuda_device.CupyDevice(plan.memory, world.local_rank if world is not None else 0)
        else:
            dev = self.device(plan)
        executor = CudaExecutor(plan, dev, cuda_graphs)
        executor.load_constants()
        return executor


BACKEND = CudaBackend()
