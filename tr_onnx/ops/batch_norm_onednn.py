"""BatchNormTraining and BatchNormGrad (training statistics) in float32 through oneDNN's batch
normalization (``tr_onnx.onednn``): the numpy backend's fast path, with normalization.py's
NumPy kernels as the reference and the fallback.

NumPy needs five passes over the map forward (the sum, x - mean, the centred squares, the
scale, the shift) and six backward, each a broadcast NumPy starts per row of pixels, plus some
twenty per-channel calls: the zoo ResNet's [32, 16, 16, 16] maps took 270 us forward and 320
us backward per call, ~100 us of it fixed cost (2 threads, 2026-12-02). oneDNN reads the
channels-last arena views as they lie (strided memory descriptors) in one jitted kernel each
way. What it does not compute stays here: the running statistics and 1 / sqrt(var + eps)
forward (normalization.py's ``_write_batch_statistics``), and the variance backward, which
the node does not carry: the backward primitive is made with epsilon 0 and given
var = 1 / inv_std^2, which it turns back into inv_std within an ulp or two (the node has no
epsilon either).

Not for synchronised BatchNorm (its sums span ranks), float16/float64, or layouts where
oneDNN offers only its reference loop (channels padded past the logical count).
"""

from __future__ import annotations

import numpy as np

from .. import host_blas, onednn
from .conv_onednn import strided

_FLAGS = onednn.USE_SCALE | onednn.USE_SHIFT


def _float32(*infos) -> bool:
    return all(i is None or np.dtype(i.dtype) == np.float32 for i in infos)


def _usable(x_info) -> bool:
    return onednn.available() and len(x_info.shape) >= 2 and 0 not in x_info.shape


def _jitted(*primitives) -> bool:
    return not any(p.implementation.startswith("ref") for p in primitives)


def training(ctx, eps: float):
    """(step, mean workspace, variance workspace): the step normalises input 0 into output 0
    with the batch's statistics, scale input 1 and shift input 2, and leaves the batch mean
    and biased variance in the two [C] workspaces. None where oneDNN is not there or
    declines."""
    x_info, y_info = ctx.inputs[0], ctx.outputs[0]
    if not _usable(x_info) or not _float32(x_info, y_info, ctx.inputs[1], ctx.inputs[2]):
        return None
    c = x_info.shape[1]
    try:
        src, dst = strided(x_info), strided(y_info)
        forward = onednn.batch_normalization(src, dst, eps, _FLAGS)
    except onednn.OneDnnError:
        return None
    if not _jitted(forward):
        return None
    vector = onednn.MemoryDesc.strided((c,), (4,))
    mean_ws, var_ws = ctx.workspace((c,), np.float32), ctx.workspace((c,), np.float32)
    scratch = onednn.scratchpad(ctx, forward)
    step = host_blas.prepared_step(lambda ins, outs, ws: [onednn.bind(forward, [
        ("src", src, ins[0]), ("dst", dst, outs[0]), ("scale", vector, ins[1]),
        ("shift", vector, ins[2]), ("mean", vector, ws[mean_ws]),
        ("variance", vector, ws[var_ws])], scratch, ws)])
    return step, mean_ws, var_ws


def grad(ctx):
    """BatchNormGrad(gy, x, scale, mean, inv_std) -> (gx, gscale, gbias) with the batch's own
    statistics (training=1), any output absent; None where oneDNN is not there or
    declines."""
    gy_info, x_info = ctx.inputs[0], ctx.inputs[1]
    outs_info = [ctx.outputs[i] if ctx.has_output(i) else None for i in range(3)]
    if not _usable(x_info) or not _float32(*ctx.inputs[:5], *outs_info):
        return None
    c = x_info.shape[1]
    gx_info = outs_info[0] or x_info
    try:
        src, diff_dst, diff_src = strided(x_info), strided(gy_info), strided(gx_info)
        hint = onednn.batch_normalization(src, src, 0.0, _FLAGS)
        backward = onednn.batch_normalization(src, diff_src, 0.0, _FLAGS, hint, diff_dst)
    except onednn.OneDnnError:
        return None
    if not _jitted(backward):
        return None
    vector = onednn.MemoryDesc.strided((c,), (4,))
    var_ws = ctx.workspace((c,), np.float32)
    # absent outputs still need somewhere to go (gx in x's layout: its descriptor)
    spare = {i: ctx.workspace((c,) if i else (max(diff_src.nbytes // 4, 1),), np.float32)
             for i in range(3) if outs_info[i] is None}
    scratch = onednn.scratchpad(ctx, backward)

    def make(ins, outs, ws):
        gx, gs, gb = (ws[spare[i]] if i in spare else outs[i] for i in range(3))
        var, inv = ws[var_ws], ins[4]
        run = onednn.bind(backward, [
            ("src", src, ins[1]), ("mean", vector, ins[3]), ("variance", vector, var),
            ("diff_dst", diff_dst, ins[0]), ("scale", vector, ins[2]),
            ("diff_src", diff_src, gx), ("diff_scale", vector, gs),
            ("diff_shift", vector, gb)], scratch, ws)

        def variance():  # 1 / sqrt(var + 0) is inv_std again
            np.multiply(inv, inv, out=var)
            np.reciprocal(var, out=var)

        return [variance, run]

    return host_blas.prepared_step(make)
