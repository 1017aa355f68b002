"""The checks without a GPU, again with the library versions a lent GPU machine has.

The test extra installs the newest cuDNN (9.28+) and NVRTC (13.5); the GPU image pins what
torch 2.11 for CUDA 13 pins: cuDNN 9.19, NVRTC 13.0 with CUDA 13.0 headers
(tests/gpu_image_requirements.txt, installed by the README's test command into ``.gpu-image/``).
An engine list, a validation rule or a header can differ between those versions, so the
deviceless cuDNN checks of every graph the cuda backend declares and the NVRTC compile of every
kernel family (cubin and PTX) run here once more in a child process that loads those versions:
cuDNN and its sublibraries from ``LD_LIBRARY_PATH`` (the frontend looks there first), NVRTC
13.0 loaded before CuPy asks for it, the headers through ``CUDA_PATH``. The child's modules
assert the versions they loaded (``TR_ONNX_EXPECT_CUDNN``, ``TR_ONNX_EXPECT_NVRTC``), so a
run that silently loaded the newer libraries fails.

cuDNN 9.19 finds cuBLAS through ``RUNPATH`` entries relative to its own folder, which a
``--target`` install does not have: the child's ``LD_LIBRARY_PATH`` names the test extra's
cuBLAS folder too. Without it cuDNN 9.19 aborts the process at its first matmul plan
("Cannot load symbol cublasLtGetVersion"), as it would on a GPU machine whose cuBLAS it
cannot find.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = REPO / ".gpu-image" / "nvidia"
CUDNN_LIB = IMAGE / "cudnn" / "lib"
CU13 = IMAGE / "cu13"
EXPECT = {"TR_ONNX_EXPECT_CUDNN": "91900", "TR_ONNX_EXPECT_NVRTC": "13.0"}
MODULES = ("tests/test_cudnn_deviceless.py", "tests/test_cuda_kernels_cpu.py",
           "tests/test_cuda_ptx_args.py", "tests/test_cuda_attention_ops_cpu.py",
           "tests/test_real_exports_cuda.py")
SELECT = "deviceless or nvrtc or ptx or cudnn_takes_every_graph"
"""Every test of the deviceless and PTX modules (their names hold the words), the NVRTC ones
of the kernel tests, the attention family's deviceless SDPA checks, and every real export's
cuda training plan in fp32 and bf16 with each of its cuDNN graphs."""

CHILD = """
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # NVRTC 13.0 before CuPy loads one
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", sys.argv[2], *sys.argv[3:]]))
"""


def cublas_lib_dir() -> str:
    found = glob.glob(os.path.join(sysconfig.get_path("purelib"), "nvidia", "*", "lib",
                                   "libcublasLt.so.*"))
    assert found, "no cuBLAS in site-packages: install the test extra (nvidia-cublas)"
    return os.path.dirname(found[0])


def test_the_deviceless_cudnn_checks_and_nvrtc_compiles_pass_with_the_gpu_images_versions():
    assert CUDNN_LIB.is_dir() and (CU13 / "lib" / "libnvrtc.so.13").is_file(), (
        "no .gpu-image/: the README's test command installs tests/gpu_image_requirements.txt "
        "there")
    env = dict(os.environ, **EXPECT,
               LD_LIBRARY_PATH=os.pathsep.join([str(CUDNN_LIB), str(CU13 / "lib"),
                                                cublas_lib_dir()]),
               CUDA_PATH=str(CU13))
    done = subprocess.run([sys.executable, "-c", CHILD, str(CU13 / "lib" / "libnvrtc.so.13"),
                           SELECT, *MODULES], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and "failed" not in done.stdout, tail
