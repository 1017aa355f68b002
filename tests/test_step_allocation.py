"""A run after warm-up allocates (almost) nothing: kernels write into arena views and take their
scratch from the plan's WORKSPACE region. What remains is numpy's bounded internal buffering
(ufunc casting/strided buffers of at most ~64-100 KB, whatever the tensor sizes)."""

import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import tr_onnx

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
SHAPES = {"mlp": (32, 64), "lenet": (32, 1, 8, 8), "resnet": (32, 3, 16, 16),
          "mobilenet": (32, 3, 16, 16), "transformer": (32, 8, 32)}
PEAK_BOUND = 160 * 1024  # numpy's own ufunc buffers; the ResNet's arena is ~7 MB


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("stem", sorted(SHAPES))
def test_ten_steps_allocate_only_numpy_buffers(stem, align):
    sess = tr_onnx.InferenceSession(ZOO / f"{stem}.onnx", channel_align=align)
    feed = {"input": np.random.default_rng(0).standard_normal(SHAPES[stem]).astype(np.float32)}
    sess.run(None, feed)
    executor = sess.plan_for(feed).executor
    for _ in range(3):
        executor.run()  # warm numpy's dispatch caches
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            executor.run()
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()  # numpy's axis helpers leave small reference cycles behind (~50 B each)
        current = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert peak - base < PEAK_BOUND
    assert current - base < 16 * 1024  # nothing accumulates from step to step
