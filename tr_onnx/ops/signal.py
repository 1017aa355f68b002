"""Signal processing: the window generators (HannWindow, HammingWindow, BlackmanWindow).

Windows are pure functions of their plan-time size, computed in float64 in the factory and cast
once (as onnx.reference does, in the output type); ``run`` copies them into the arena slot,
which other values may reuse between steps. None of them is differentiable.
"""

from __future__ import annotations

import numpy as np

from ..hookspecs import hookimpl
from ..opdef import OpDef


def _window_positions(ctx) -> tuple[np.ndarray, int]:
    """(n = 0..size-1 in float64, the period: size when ``periodic``, else size - 1)."""
    size = int(np.asarray(ctx.const(0)).reshape(()))
    period = size if int(ctx.attrs.get("periodic", 1)) else size - 1
    return np.arange(size, dtype=np.float64), period


def hann(n, period):
    return np.sin(n * np.pi / period) ** 2


def hamming(n, period):
    alpha = 25.0 / 46.0  # ONNX's (and PyTorch's exact) Hamming coefficient, not 0.54
    return alpha - np.cos(n * 2 * np.pi / period) * (1 - alpha)


def blackman(n, period):
    return 0.42 - 0.5 * np.cos(n * 2 * np.pi / period) + 0.08 * np.cos(n * 4 * np.pi / period)


def window_numpy(formula):
    def factory(ctx):
        value = formula(*_window_positions(ctx)).astype(ctx.outputs[0].dtype)

        def run(ins, outs, ws):
            np.copyto(outs[0], value)

        return run

    return factory


@hookimpl
def tr_onnx_op_definitions():
    return [OpDef(op, (17,), {"numpy": window_numpy(formula)}, const_inputs=(0,),
                  differentiable=False)
            for op, formula in (("HannWindow", hann), ("HammingWindow", hamming),
                                ("BlackmanWindow", blackman))]
