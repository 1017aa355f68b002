"""Fine-tuning on the cuda backend, through the host emulator (the kernels' g++ build): a new
head trained alone with the frozen BatchNorm in inference mode, then everything after
``unfreeze``, equals the numpy backend (issue 33)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.finetune import finetune_options, replace_head
from tr_onnx.testing.host_emulator import HostEmulator, build_host_library


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_host_library(tmp_path_factory.mktemp("finetune_host"))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_head_then_everything_on_cuda_equals_numpy(lib):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().eval(), (torch.randn(4, 3, 8, 8),), buf, dynamo=False,
                          input_names=["x"], output_names=["y"], opset_version=17,
                          do_constant_folding=False)
    model, head = replace_head(onnx.load_from_string(buf.getvalue()), 5)
    rng = np.random.default_rng(0)
    batches = [({"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)},
                rng.integers(0, 5, 4)) for _ in range(4)]

    def run(backend, **kw):
        session = tr_onnx.TrainingSession(
            model, optimizer=tr_onnx.optim.SGD(lr=0.1, momentum=0.9), backend=backend,
            **finetune_options("head", head), **kw)
        losses = [float(session.train_step(*b)) for b in batches[:2]]
        assert session._state.active.info.running_stats == []  # the frozen BatchNorm: eval mode
        session.unfreeze()
        losses += [float(session.train_step(*b)) for b in batches[2:]]
        return session, losses

    ref, want = run("numpy")
    got_session, got = run(CudaBackend(device=lambda plan: HostEmulator(plan, lib)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    ours, theirs = got_session.parameters(), ref.parameters()
    assert not np.array_equal(theirs["bn.running_mean"], Net().bn.running_mean.numpy())
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
