"""cuDNN without a GPU: the real library checks every graph a cuda plan declares.

cuDNN 9 describes a target GPU from a JSON list of its properties
(``cudnn.create_device_properties``); a ``pygraph(device_property=...)`` then goes through
``validate()``, lowering, the engine heuristics, the workspace cut and, for convolutions,
``build_plans()`` with no device. cuDNN loads the driver library when it starts: on a machine
without one, ``load_driver_stub`` builds (with the C compiler, once per user and source) and
loads a stand-in ``libcuda.so.1`` whose every entry point answers CUDA_ERROR_NO_DEVICE; where a
driver exists the stub is never loaded.

``check_plan(plan)`` gives one ``GraphCheck`` per cuDNN graph of a bound cuda plan (kind,
dtypes, dims, engine candidates, the first plan within the node's workspace, its workspace, or
why it fails); ``tr-onnx inspect MODEL --backend cuda`` prints them. The H200's properties are
packaged (``data/h200_device_properties.json``); ``properties=`` takes another GPU's file.

Needs ``nvidia-cudnn-cu13`` (or ``-cu12``), ``nvidia-cublas`` and ``nvidia-cudnn-frontend``;
imports them only when called. A deviceless pass is necessary, not sufficient: the GPU image's
cuDNN may list other engines, and matmul engines load kernels through the driver at plan build,
which deviceless mode cannot (their ``build_plans`` is left to the device).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import TrOnnxError
from .cudnn_graphs import CudnnGraphError, GraphDesc, declare_pygraph, named_errors, plan_pygraph

DATA = Path(__file__).with_name("data")
H200_PROPERTIES = DATA / "h200_device_properties.json"
STUB_SOURCE = DATA / "libcuda_stub.c"


class DevicelessError(TrOnnxError):
    """cuDNN's deviceless mode cannot start here (no cuDNN wheel, no C compiler for the stub)."""


_STUB: Path | None = None


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def load_driver_stub(cache_dir: str | Path | None = None) -> Path | None:
    """Load a stand-in ``libcuda.so.1`` before cuDNN does, unless a driver library loads (then
    None). The stub is built from ``data/libcuda_stub.c`` into ``cache_dir`` (default: a folder
    of the temp directory named by the source's hash), once."""
    global _STUB
    if _STUB is not None:
        return _STUB
    if _driver_present():
        return None
    text = STUB_SOURCE.read_bytes()
    folder = Path(cache_dir or Path(tempfile.gettempdir()) /
                  f"tr_onnx_libcuda_stub_{hashlib.sha256(text).hexdigest()[:12]}")
    lib = folder / "libcuda.so.1"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        tmp = folder / f"libcuda.so.1.{os.getpid()}"
        done = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1",
                               "-o", str(tmp), str(STUB_SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise DevicelessError(f"building the stand-in driver library with {cc!r} failed: "
                                  f"{done.stderr.strip()}")
        os.replace(tmp, lib)  # atomic: a concurrent build finds a whole library or none
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # cuDNN's dlopen("libcuda.so.1") finds it
    _STUB = lib
    return lib


def load_cudnn():
    """The frontend module with the stub in place (``DevicelessError`` naming what is
    missing)."""
    load_driver_stub()
    try:
        import cudnn
    except ImportError as e:
        raise DevicelessError(f"the cuDNN frontend is not importable ({e}); install "
                              "nvidia-cudnn-frontend, nvidia-cudnn-cu13 and nvidia-cublas") from e
    return cudnn


def device_properties(cudnn, properties: str | Path | None = None):
    """The target GPU for ``pygraph(device_property=...)``: a JSON file of cuDNN's device
    properties (default: the packaged H200's)."""
    path = Path(properties or H200_PROPERTIES)
    try:
        return cudnn.create_device_properties(path.read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise DevicelessError(f"{path}: not a cuDNN device property list ({e})") from e


@dataclass
class GraphCheck:
    """What deviceless cuDNN said of one node's graph: ``engines`` candidates from the
    heuristics, ``within`` of them within the node's workspace, ``plan`` the first of those,
    ``workspace`` its bytes (convolutions: built; else None), or ``error``."""

    node: str
    kind: str
    dtypes: str
    dims: tuple[int, ...]
    limit: int
    engines: int = 0
    within: int = 0
    plan: str = ""
    workspace: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.within > 0


def check_graph(desc: GraphDesc, cudnn, target) -> GraphCheck:
    """Declare ``desc`` for the ``target`` GPU, validate, lower, plan, cut by its workspace and,
    where deviceless mode can (``GraphDesc.builds_without_device``: convolutions), build the
    plans."""
    x = next(iter(desc.inputs.values()))
    check = GraphCheck(desc.node, desc.kind, f"{desc.io_data_type}/{desc.compute_data_type}",
                       x.dims, desc.workspace[1])
    try:
        with named_errors(desc):
            g = declare_pygraph(desc, cudnn, device_property=target).graph
            check.engines = plan_pygraph(g, desc, cudnn)
            check.within = int(g.get_execution_plan_count())
            if check.within:
                check.plan = str(g.get_plan_name_at_index(0))
            if desc.builds_without_device and check.within:
                g.build_plans()
                check.workspace = int(g.get_workspace_size())
    except CudnnGraphError as e:
        check.error = str(e).split(": ", 1)[-1]
    if check.error is None and not check.within:
        check.error = (f"none of the {check.engines} engine candidates fits the node's "
                       f"workspace of {check.limit} bytes")
    return check


def check_plan(plan, properties: str | Path | None = None) -> list[GraphCheck]:
    """One ``GraphCheck`` per cuDNN graph the bound cuda ``plan`` declares (its executor's
    ``CudnnCall``s; a conv with a fused activation counts once)."""
    from .bind import CudnnCall

    cudnn = load_cudnn()
    target = device_properties(cudnn, properties)
    descs = {id(c.desc): c.desc for bn in plan.executor.bound for c in bn.calls
             if isinstance(c, CudnnCall)}
    return [check_graph(desc, cudnn, target) for desc in descs.values()]
