"""LayerNormalization and LayerNormGrad in float32 through oneDNN's layer normalization
(``tr_onnx.onednn``): the numpy backend's fast path, with normalization.py's NumPy kernels as
the reference and the fallback (the caller has checked that every operand is a plain float32
tensor, so the arena's views are ``[outer, inner]`` rows as they lie).

NumPy needs ten-odd passes over the rows, half of them broadcasting a per-row value, whose
inner loops NumPy starts once per row: BERT's [512, 256] rows took 0.46 ms forward and 0.9 ms
backward inside a step. oneDNN makes one pass each (35 and 62 us alone; 2 threads,
2026-12-02). LayerNormGrad's node carries no statistics, so it runs the forward primitive
first for the mean and variance (its normalised output goes to a workspace), then the
backward one; a zero shift operand makes oneDNN sum gy into gbias as well.
"""

from __future__ import annotations

import math

import numpy as np

from .. import host_blas, onednn


def _vector(info, size: int) -> bool:
    return info is None or math.prod(info.shape) == size


def _step(ctx, primitives, args_of):
    """The step running ``primitives`` in order on the arena views (``host_blas.prepared_step``);
    ``args_of(ins, outs, ws)`` gives each primitive's arguments."""
    scratches = [onednn.scratchpad(ctx, p) for p in primitives]
    return host_blas.prepared_step(lambda ins, outs, ws: [
        onednn.bind(p, args, scratch, ws)
        for p, args, scratch in zip(primitives, args_of(ins, outs, ws), scratches)])


def _primitives(outer: int, inner: int, eps: float, flags: int, backward: bool):
    """(data md, stats md, vector md, [primitives]); None where oneDNN refuses or offers only
    its reference loop."""
    data = onednn.MemoryDesc.strided((outer, inner), (4 * inner, 4))
    stats = onednn.MemoryDesc.strided((outer,), (4,))
    vector = onednn.MemoryDesc.strided((inner,), (4,))
    try:
        forward = onednn.layer_normalization(data, stats, eps, flags)
        made = [forward, onednn.layer_normalization(data, stats, eps, flags, forward)] \
            if backward else [forward]
    except onednn.OneDnnError:
        return None
    if any(p.implementation.startswith("ref") for p in made):
        return None
    return data, stats, vector, made


def layer_norm_onednn(ctx, outer: int, inner: int, eps: float):
    """LayerNormalization (x, scale[, bias]) -> (y[, mean][, inv_std_dev]); None where oneDNN
    is not there or declines."""
    if not onednn.available() or 0 in (outer, inner) \
            or not all(_vector(ctx.inputs[i] if ctx.has_input(i) else None, inner)
                       for i in (1, 2)) \
            or not all(_vector(ctx.outputs[i] if ctx.has_output(i) else None, outer)
                       for i in (1, 2)):
        return None
    has_bias, has_mean, has_inv = ctx.has_input(2), ctx.has_output(1), ctx.has_output(2)
    made = _primitives(outer, inner, eps,
                       onednn.USE_SCALE | (onednn.USE_SHIFT if has_bias else 0), False)
    if made is None:
        return None
    data, stats, vector, (forward,) = made
    mean_ws, var_ws = (ctx.workspace((outer,), np.float32) for _ in range(2))

    def args_of(ins, outs, ws):
        args = [("src", data, onednn.reshaped(ins[0], (outer, inner))),
                ("dst", data, onednn.reshaped(outs[0], (outer, inner))),
                ("scale", vector, onednn.reshaped(ins[1], inner)),
                ("mean", stats, ws[mean_ws]), ("variance", stats, ws[var_ws])]
        if has_bias:
            args.append(("shift", vector, onednn.reshaped(ins[2], inner)))
        return [args]

    normalise = _step(ctx, [forward], args_of)

    def run(ins, outs, ws):
        normalise(ins, outs, ws)
        if has_mean:
            np.copyto(onednn.reshaped(outs[1], outer), ws[mean_ws])
        if has_inv:
            inv = ws[var_ws]
            np.add(inv, np.float32(eps), out=inv)
            np.sqrt(inv, out=inv)
            np.reciprocal(inv, out=inv)
            np.copyto(onednn.reshaped(outs[2], outer), inv)

    return run


def layer_norm_grad_onednn(ctx, outer: int, inner: int, eps: float):
    """LayerNormGrad (gy, x, scale) -> (gx, gscale, gbias), any of them absent; None where
    oneDNN is not there or declines."""
    if not onednn.available() or 0 in (outer, inner) or not _vector(ctx.inputs[2], inner) \
            or not all(_vector(ctx.outputs[i] if ctx.has_output(i) else None, inner)
                       for i in (1, 2)):
        return None
    made = _primitives(outer, inner, eps, onednn.USE_SCALE | onednn.USE_SHIFT, True)
    if made is None:
        return None
    data, stats, vector, (forward, backward) = made
    rows, f32 = (outer, inner), np.float32
    y_ws, mean_ws, var_ws = (ctx.workspace(rows, f32), ctx.workspace((outer,), f32),
                             ctx.workspace((outer,), f32))
    # absent outputs still need somewhere to go
    spare = {i: ctx.workspace(shape, f32) for i, shape in ((0, rows), (1, (inner,)),
                                                            (2, (inner,)))
             if not ctx.has_output(i)}
    zero_shift = np.zeros(inner, f32)  # read only: oneDNN's shift operand, 0 + x = x

    def args_of(ins, outs, ws):
        x, scale = onednn.reshaped(ins[1], rows), onednn.reshaped(ins[2], inner)
        gx, gs, gb = (ws[spare[i]] if i in spare else onednn.reshaped(outs[i], shape)
                      for i, shape in enumerate((rows, inner, inner)))
        mean, var = ws[mean_ws], ws[var_ws]
        return [[("src", data, x), ("dst", data, ws[y_ws]), ("scale", vector, scale),
                 ("shift", vector, zero_shift), ("mean", stats, mean),
                 ("variance", stats, var)],
                [("src", data, x), ("mean", stats, mean), ("variance", stats, var),
                 ("diff_dst", data, onednn.reshaped(ins[0], rows)), ("scale", vector, scale),
                 ("shift", vector, zero_shift), ("diff_src", data, gx),
                 ("diff_scale", vector, gs), ("diff_shift", vector, gb)]]

    return _step(ctx, [forward, backward], args_of)
