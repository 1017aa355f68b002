"""The numpy backend's SGDUpdate against torch.optim.SGD, bit for bit: each ``a + c*b`` is one
fused multiply-add (``host_blas.axpy``), as torch's ``add_(b, alpha=c)`` rounds it, over spans
of several update blocks with a tail that is no multiple of OpenBLAS's vector block; and the
NumPy fallback (no CBLAS symbol) within one rounding of it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tr_onnx import host_blas
from tr_onnx.layouts import StridedLayout
from tr_onnx.opdef import KernelContext, TensorInfo
from tr_onnx.ops import optimizers

CONFIGS = {  # id: torch.optim.SGD arguments besides lr
    "plain": {},
    "momentum_dampening_wd": {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
    "nesterov_wd": {"momentum": 0.8, "nesterov": True, "weight_decay": 5e-4},
    "momentum": {"momentum": 0.9},
}
LR = 0.05
N = 3 * (1 << 16) + 1001  # three 256 KiB update blocks and a tail of 1001 + 1024 * k


def _update_kernel(n, attrs):
    info = TensorInfo("p", (n,), np.dtype(np.float32), StridedLayout.plain((n,)), (n,))
    node = SimpleNamespace(attrs=attrs, since_version=1, name="update", label="update")
    ctx = KernelContext(node, [info], [], [], "numpy")
    run = optimizers.sgd_update_numpy(ctx)
    ws = [np.empty(s, d) for s, d in ctx.workspace_requests]
    return lambda p, g, buf, step: run(
        [p, g, buf, np.float32(LR).reshape(()), np.int64(step).reshape(())], [], ws)


def _attrs(config):
    return {"momentum": config.get("momentum", 0.0), "dampening": config.get("dampening", 0.0),
            "nesterov": int(config.get("nesterov", False)),
            "weight_decay": config.get("weight_decay", 0.0)}


def _run_both(config, steps=3):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(steps)]
    weight = torch.nn.Parameter(torch.tensor(p))
    opt = torch.optim.SGD([weight], lr=LR, foreach=False, **config)
    ours, buf = p.copy(), np.zeros(N, np.float32)
    update = _update_kernel(N, _attrs(config))
    for step, g in enumerate(grads, 1):
        weight.grad = torch.tensor(g)
        opt.step()
        update(ours, g, buf, step)
    state = opt.state[weight].get("momentum_buffer")
    return ours, buf, weight.detach().numpy(), None if state is None else state.numpy()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sgd_updates_equal_torch_bit_for_bit(config):
    ours, buf, want, want_buf = _run_both(CONFIGS[config])
    np.testing.assert_array_equal(ours, want)
    if want_buf is not None:
        np.testing.assert_array_equal(buf, want_buf)


def test_without_cblas_the_update_is_within_a_rounding(monkeypatch):
    """NumPy's product and sum round twice: within an ulp of the weights' scale."""
    monkeypatch.setattr(host_blas, "_axpy_symbol", lambda dtype: None)
    ours, buf, want, want_buf = _run_both(CONFIGS["momentum_dampening_wd"])
    assert not np.array_equal(ours, want)  # the fused path is what makes them equal
    np.testing.assert_allclose(ours, want, rtol=0, atol=4 * np.spacing(np.float32(4)))
    np.testing.assert_allclose(buf, want_buf, rtol=0, atol=4 * np.spacing(np.float32(4)))
