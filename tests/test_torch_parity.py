"""The parity harness itself (torch_parity.py), on a small conv net both exporters handle: if
this fails, a must-show failure elsewhere is the harness's, not the op's."""

import numpy as np
import pytest
import torch
from torch_parity import ParityCase, assert_parity, run_case


def _build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def _batch(k):
    rng = np.random.default_rng(k)
    return ({"x": rng.standard_normal((4, 3, 6, 6)).astype(np.float32)},
            rng.integers(0, 5, 4).astype(np.int64))


@pytest.mark.parametrize("exporter", ["classic", "dynamo"])
def test_the_harness_sees_a_small_convnet_train_alike(exporter, tmp_path):
    result = run_case(ParityCase(f"convnet-{exporter}", _build, _batch, exporter=exporter,
                                 dynamic_axes={"x": {0: "batch"}}), tmp_path)
    assert_parity(result)
    assert len(result.losses) == 5


def test_the_harness_fails_when_pytorch_trains_differently(tmp_path):
    case = ParityCase("convnet-lr", _build, _batch)
    result = run_case(case, tmp_path)
    result.torch_losses[-1] += 1e-3  # a drift the harness must catch
    with pytest.raises(AssertionError):
        assert_parity(result)
