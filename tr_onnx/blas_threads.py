"""One pool of worker threads for the numpy backend: NumPy's OpenBLAS runs the jobs of its
parallel calls on libgomp's threads, the ones oneDNN's kernels run on.

Without this, a step alternates between two pools: OpenBLAS's own threads, which spin for a
while after each GEMM, and oneDNN's OpenMP threads. On 2 cores that is 3 busy threads for 2
cores, and a oneDNN kernel waits at its barrier for an OpenMP thread the scheduler has not run
yet: 3-22 ms stalls inside a step (oneDNN BatchNorm, batched MatMul), and oneDNN's threads had
to sleep between kernels (OMP_WAIT_POLICY=PASSIVE), paying a wake-up per call.

OpenBLAS (0.3.27 and newer, as in NumPy's wheels) takes a threads callback: ``blas_threads.c``,
built here once with the C compiler into the user's cache folder, runs a call's jobs in one
OpenMP parallel region. With the pool shared, libgomp keeps its default wait policy (a short
spin, then sleep). A forked child goes back to OpenBLAS's own threads: libgomp's workers
do not exist there, and a parallel region would wait for them forever (so would oneDNN's
kernels, as before this module: a forked child cannot run them). Where anything is
missing (no C compiler, another BLAS, an OpenBLAS without the callback,
``TR_ONNX_SEPARATE_POOLS=1``), the pools stay separate and oneDNN's threads sleep between
kernels, as before. ``shared()`` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from . import host_blas

SOURCE = Path(__file__).with_name("blas_threads.c")
# NumPy's wheels (scipy-openblas64) suffix their symbols; a plain OpenBLAS does not
_SETTERS = ("scipy_openblas_set_threads_callback_function64_",
            "openblas_set_threads_callback_function64_", "openblas_set_threads_callback_function")


def _private_folder() -> Path:
    """A folder only this user can write: the cache folder (``$XDG_CACHE_HOME`` or ~/.cache,
    then tr_onnx), else a fresh temporary one. A library loaded from a folder others can write
    to would run their code."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tr_onnx"
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = base.stat()
        if info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return base
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="tr_onnx_"))


def _build() -> Path | None:
    """The callback library, built once per source (its hash names it); None if the C compiler
    is missing or fails."""
    text = SOURCE.read_bytes()
    folder = _private_folder()
    lib = folder / f"libtr_onnx_blas_threads_{hashlib.sha256(text).hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    cc = os.environ.get("CC", "cc")
    tmp = folder / f"{lib.name}.{os.getpid()}"
    try:
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-fopenmp", "-o", str(tmp),
                               str(SOURCE)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, lib)  # atomic: a concurrent build finds a whole library or none
    for stale in folder.glob("libtr_onnx_blas_threads_*.so"):  # other versions' builds
        if stale != lib:
            stale.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    return lib


def _setter():
    lib = host_blas.openblas()
    for name in _SETTERS if lib is not None else ():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_void_p], None
            return fn
    return None


@cache
def prepared() -> Path | None:
    """The callback library, built and ready to share the pool (not loaded yet: loading it
    loads libgomp, which reads OMP_WAIT_POLICY then); None where the pools stay separate."""
    if os.environ.get("TR_ONNX_SEPARATE_POOLS") or _setter() is None:
        return None
    return _build()


_shared: ctypes.CDLL | None = None


def share() -> bool:
    """Route OpenBLAS's parallel jobs to libgomp's pool (once; True if they are)."""
    global _shared
    if _shared is None and prepared() is not None:
        try:
            lib = ctypes.CDLL(str(prepared()))
        except OSError:
            return False
        lib.tr_onnx_share_blas_threads.argtypes = [ctypes.c_void_p]
        if lib.tr_onnx_share_blas_threads(ctypes.cast(_setter(), ctypes.c_void_p)) != 0:
            return False
        _shared = lib
    return _shared is not None


def shared() -> bool:
    """Whether OpenBLAS's parallel jobs run on libgomp's pool in this process."""
    return _shared is not None


def parallel_calls() -> int:
    """How many parallel BLAS calls ran on libgomp's pool (0 where it is not shared)."""
    if _shared is None:
        return 0
    return ctypes.c_long.in_dll(_shared, "tr_onnx_blas_parallel_calls").value
