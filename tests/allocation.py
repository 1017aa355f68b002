"""How the tests measure what a step allocates: tracemalloc around repeated runs of a bound
step, after warm-up runs that fill numpy's dispatch caches."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

PEAK_BOUND = 160 * 1024  # numpy's own ufunc buffers; the zoo ResNet's arena is ~7 MB
LEFT_BOUND = 16 * 1024  # nothing accumulates from step to step (numpy's small cycles aside)


def step_allocation(run: Callable[[], None], steps: int = 10, warm: int = 3) -> tuple[int, int]:
    """(peak bytes above the start, bytes still held after a collection) over ``steps`` calls
    of ``run`` that follow ``warm`` calls."""
    for _ in range(warm):
        run()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(steps):
            run()
        peak = tracemalloc.get_traced_memory()[1]
        gc.collect()  # numpy's axis helpers leave small reference cycles behind (~50 B each)
        current = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return peak - base, current - base
