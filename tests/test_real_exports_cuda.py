"""Every real-export set of the tests (tests/real_export_sets.py) on the cuda backend, without a
GPU: each plans for cuda training in fp32 and bf16 with every node bound and every cuDNN graph
accepted by the real cuDNN in deviceless mode (an H200), and each trains three SGD steps on the
host emulator (the kernels' host build, cuDNN graphs as the numpy kernels) like the numpy
backend.

The oracle of the emulated steps is the numpy backend, itself held against PyTorch and
TensorFlow by each set's own module. Tolerances (float32): the losses and parameters within
2e-4 relative / 2e-5 absolute after three steps. The cuda kernels sum in other orders than
NumPy's pairwise sums and BLAS (a matmul's dot products in k order, reductions by rows), each
a few ulp of a sum of n terms, about n * 6e-8 relative for the widest sums here (n <= 300:
2e-5); three SGD steps carry that into the parameters, which the learning rates here move by
1e-2 to 1; the bounds hold that with a 10x margin.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from real_export_sets import CATALOGUE, RealExport

from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.backends.cuda.bind import CudaUnsupported
from tr_onnx.backends.cuda.deviceless import check_plan
from tr_onnx.backends.cuda.executor import EXECUTOR_POLICY
from tr_onnx.testing.host_emulator import build_host_library, emulated_cuda
from tr_onnx.testing.recorder import FakeRecorder

CASES = list(CATALOGUE)
STEPS = 3
RTOL, ATOL = 2e-4, 2e-5


def recorder(plan) -> FakeRecorder:
    return FakeRecorder(plan.memory, policy=EXECUTOR_POLICY)


class Files:
    """Each set exported once per module, on first use (an export failure is kept and reported
    by every test of the set)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._paths: dict[str, Path | Exception] = {}

    def __getitem__(self, case: str) -> tuple[RealExport, Path]:
        if case not in self._paths:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    self._paths[case] = CATALOGUE[case].write(self.folder)
                except Exception as e:  # reported by each test of the set
                    self._paths[case] = e
        found = self._paths[case]
        if isinstance(found, Exception):
            raise AssertionError(f"{case}: the export failed: {found!r}") from found
        return CATALOGUE[case], found


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    return Files(tmp_path_factory.mktemp("real_exports_cuda"))


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("host_kernels"))


def unbound_words(e: CudaUnsupported) -> str:
    return "; ".join(f"{op} v{v} ({len(nodes)} nodes)" for _, op, v, nodes in e.missing)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_each_real_export_plans_for_cuda_training_and_cudnn_takes_every_graph(files, case,
                                                                               precision):
    export, path = files[case]
    feed, _ = export.batches(0)
    session = export.session(path, backend=CudaBackend(device=recorder), precision=precision)
    try:
        plan = session._train_plan(feed)
    except CudaUnsupported as e:
        pytest.fail(f"{case} ({precision}): unbound: {unbound_words(e)}", pytrace=False)
    failing = [(r.node, r.kind, r.error) for r in check_plan(plan) if not r.ok]
    assert not failing


@pytest.mark.parametrize("case", CASES)
def test_three_sgd_steps_on_the_host_emulator_equal_the_numpy_backends(files, host_lib, case):
    export, path = files[case]
    numpy_session = export.session(path, backend="numpy")
    cuda_session = export.session(path, backend=emulated_cuda(host_lib))
    for k in range(STEPS):
        feed, labels = export.batches(k)
        want = float(numpy_session.train_step(feed, labels))
        got = float(cuda_session.train_step(feed, labels))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"step {k}")
    want, got = numpy_session.parameters(), cuda_session.parameters()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_a_compact_x_beside_a_channels_last_dx_reaches_cudnn_as_a_channels_last_copy(
        files, host_lib, monkeypatch):
    """tf2onnx without its optimizer leaves BatchNorm's x compact (NCHW between Transposes)
    while its gradient arrives channels-last; cuDNN's backward graph takes x, dy and dx in one
    layout, so the binding pads x into scratch first. The emulator runs cuDNN graphs as the
    numpy kernel on the node's own inputs, so here the graph's input port itself is read, when
    the graph runs: it must hold x, element for element, in dx's layout."""
    from tr_onnx.testing.host_emulator import HostEmulator

    export, path = files["keras-tf_keras-bn-no_optimizers"]
    seen = []
    original = HostEmulator.cudnn_execute

    def cudnn_execute(self, graph, pointers, workspace):
        original(self, graph, pointers, workspace)
        port = graph.inputs.get("input")
        if graph.kind == "batchnorm_backward" and port.region == "WORKSPACE":
            node = self.nodes[graph.node]
            x = self.plan.tensors[node.inputs[1].name].kernel_view(self.arena)
            got = np.lib.stride_tricks.as_strided(
                self.arena[port.byte_offset:].view(np.float32), port.dims,
                [s * 4 for s in port.strides])
            seen.append((np.array(got[:, :x.shape[1]]), np.array(x)))

    monkeypatch.setattr(HostEmulator, "cudnn_execute", cudnn_execute)
    cuda_session = export.session(path, backend=emulated_cuda(host_lib))
    cuda_session.train_step(*export.batches(0))
    assert seen
    for got, want in seen:
        assert got.shape == want.shape and want.ndim == 4
        np.testing.assert_array_equal(got, want)
