"""A run after warm-up allocates (almost) nothing: kernels write into arena views and take their
scratch from the plan's WORKSPACE region. What remains is numpy's bounded internal buffering
(ufunc casting/strided buffers of at most ~64-100 KB, whatever the tensor sizes)."""

from pathlib import Path

import numpy as np
import pytest
from allocation import LEFT_BOUND, PEAK_BOUND, step_allocation

import tr_onnx

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (32, 64), "lenet": (32, 1, 8, 8), "resnet": (32, 3, 16, 16),
          "mobilenet": (32, 3, 16, 16), "transformer": (32, 8, 32)}


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("stem", sorted(SHAPES))
def test_ten_steps_allocate_only_numpy_buffers(stem, align):
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=align)
    feed = {"input": np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)}
    sess.run(None, feed)
    peak, left = step_allocation(sess.plan_for(feed).executor.run)
    assert peak < PEAK_BOUND
    assert left < LEFT_BOUND


@pytest.mark.parametrize("stem", ["transformer", "resnet"])
def test_training_steps_allocate_only_numpy_buffers(stem):
    """The training step's kernels too: GatherGrad's one-hot GEMM (the transformer's position
    and token tables) and the convolutions' backward ops take their buffers from the plan."""
    sess = tr_onnx.TrainingSession(ZOO / f"{stem}.onnx", loss="cross_entropy",
                                   optimizer=tr_onnx.optim.SGD(lr=0.01))
    batch = SHAPES[stem][0]
    x = np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)
    sess.train_step({"input": x}, np.arange(batch) % 10)
    peak, left = step_allocation(sess._state.active.executor.run, steps=3, warm=2)
    assert peak < PEAK_BOUND
    assert left < LEFT_BOUND
