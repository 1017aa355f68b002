"""NumPy's OpenBLAS runs its parallel jobs on libgomp's pool, oneDNN's (``tr_onnx.blas_threads``):
the jobs do run there, every product is bit for bit the one OpenBLAS's own threads compute (the
same jobs, other threads), concurrent callers and a team OpenMP cannot give stay correct, and
where the pool cannot be shared (no C compiler, opted out) the pools stay separate.

On Linux x86-64 the test extra installs oneDNN, NumPy's wheel carries OpenBLAS with the
threads callback and the machine has a C compiler: there the sharing is required, not skipped.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from onednn_kernels import EXPECTED

from tr_onnx import blas_threads, onednn

# big enough that OpenBLAS splits them into jobs (2 threads); odd sizes; a GEMV (level 2)
SHAPES = [((512, 256), (256, 1024), np.float32), ((300, 517), (517, 211), np.float32),
          ((400, 300), (300, 500), np.float64), ((2048, 2048), (2048,), np.float32)]


@pytest.fixture(scope="module")
def shared():
    if not onednn.available() or not blas_threads.shared():
        if EXPECTED:
            pytest.fail("the pool is not shared: oneDNN (onednn-cpu-gomp), NumPy's OpenBLAS "
                        "and a C compiler are expected here")
        pytest.skip("oneDNN or OpenBLAS's threads callback is not available here")
    return True


def _operands(a_shape, b_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)


def _with_own_pool(fn):
    """``fn()`` with OpenBLAS's own threads (the callback taken away, then put back)."""
    setter = blas_threads._setter()
    setter(None)
    try:
        return fn()
    finally:
        setter(blas_threads._shared.tr_onnx_run_blas_jobs)


@pytest.mark.parametrize("a_shape, b_shape, dtype", SHAPES,
                         ids=["f32_gemm", "f32_odd", "f64_gemm", "f32_gemv"])
def test_jobs_run_on_the_shared_pool_bit_for_bit(a_shape, b_shape, dtype, shared):
    a, b = _operands(a_shape, b_shape, dtype)
    before = blas_threads.parallel_calls()
    got = a @ b
    assert blas_threads.parallel_calls() > before  # the call went through the callback
    own = _with_own_pool(lambda: a @ b)
    np.testing.assert_array_equal(got, own)
    # and a product at all: float32 sums of up to 2048 unit-normal products (values ~45) carry
    # ~1e-4 relative rounding against float64; float64 sums ~1e-13
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64),
                               rtol=1e-4 if dtype == np.float32 else 1e-12,
                               atol=1e-3 if dtype == np.float32 else 1e-10)


def test_concurrent_callers_each_get_their_own_product(shared):
    """NumPy releases the GIL around BLAS: four threads multiply at once (the callback runs
    one call's jobs at a time, since OpenBLAS gives job i the buffer of thread i)."""
    pairs = [_operands((384, 256), (256, 384), np.float32, seed) for seed in range(4)]
    want = [_with_own_pool(lambda a=a, b=b: a @ b) for a, b in pairs]
    got = [[] for _ in pairs]

    def work(i):
        a, b = pairs[i]
        for _ in range(20):
            got[i].append(a @ b)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, products in enumerate(got):
        assert len(products) == 20
        for product in products:
            np.testing.assert_array_equal(product, want[i])


_CHILD = """
import numpy as np
from tr_onnx import blas_threads, onednn
onednn.library()
rng = np.random.default_rng(0)
a, b = rng.standard_normal((512, 256), np.float32), rng.standard_normal((256, 1024), np.float32)
before = blas_threads.parallel_calls()
got = a @ b
calls = blas_threads.parallel_calls() - before
want = a.astype(np.float64) @ b.astype(np.float64)
print(blas_threads.shared(), calls, float(np.abs(got - want).max()))
"""


def _child(env: dict) -> tuple[str, int, float]:
    done = subprocess.run([sys.executable, "-c", _CHILD], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    shared, calls, err = done.stdout.split()
    return shared, int(calls), float(err)


def test_a_team_openmp_cannot_give_runs_on_threads_of_its_own(shared, tmp_path):
    """OMP_THREAD_LIMIT=1: OpenMP gives one thread for OpenBLAS's two jobs, which wait for
    each other, so the callback starts a thread for the second (it must not hang)."""
    shared_there, calls, err = _child({"OMP_THREAD_LIMIT": "1", "XDG_CACHE_HOME": str(tmp_path)})
    assert (shared_there, calls) == ("True", 1) and err < 1e-3


@pytest.mark.parametrize("env", [{"CC": "/nonexistent/cc"}, {"TR_ONNX_SEPARATE_POOLS": "1"}],
                         ids=["no_compiler", "opted_out"])
def test_pools_stay_separate_where_they_cannot_be_shared(env, shared, tmp_path):
    shared_there, calls, err = _child({**env, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert (shared_there, calls) == ("False", 0) and err < 1e-3
    assert not list((tmp_path / "cache").glob("tr_onnx/*.so"))  # nothing was built


def test_the_library_is_built_only_in_a_folder_others_cannot_write(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert blas_threads._private_folder() == tmp_path / "tr_onnx"
    assert stat.S_IMODE((tmp_path / "tr_onnx").stat().st_mode) == 0o700
    (tmp_path / "tr_onnx").chmod(0o777)
    elsewhere = blas_threads._private_folder()
    assert elsewhere != tmp_path / "tr_onnx" and Path(elsewhere).is_dir()
    assert stat.S_IMODE(Path(elsewhere).stat().st_mode) == 0o700


def test_a_forked_child_multiplies_on_openblas_own_threads(shared):
    """libgomp's workers do not exist in a forked child: there OpenBLAS runs on its own
    threads again (without that, the child's first parallel GEMM waited forever)."""
    a, b = _operands((512, 256), (256, 1024), np.float32)
    want = a @ b
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        try:
            calls = blas_threads.parallel_calls()
            ok = np.array_equal(a @ b, want) and blas_threads.parallel_calls() == calls
            os.write(write, b"ok" if ok else b"wrong")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's GEMM did not finish in 60 s")
        time.sleep(0.05)
    assert os.read(read, 16) == b"ok"
    os.close(read)
