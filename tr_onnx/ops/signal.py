"""Signal processing: the window generators (HannWindow, HammingWindow, BlackmanWindow), the
Fourier transforms (DFT, STFT) and MelWeightMatrix.

A transform is a product with a plan-time DFT matrix in float64 (no FFT: ``np.fft`` allocates
its result each call, a matrix product writes into workspace): complex values are the last
axis's (real, imaginary) pair, so ``y = W x`` is ``(A xr - B xi, A xi + B xr)`` with
``W = A + iB``. Windows are pure functions of their plan-time size, computed in float64 in the
factory and cast once (as onnx.reference does, in the output type); ``run`` copies them into
the arena slot, which other values may reuse between steps. None of them is differentiable.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

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


def _dft_matrices(n_in: int, length: int, inverse: bool, onesided: bool):
    """(A, B), each (n_in, n_out): ``y[k] = sum_n x[n] (A + iB)[n, k]`` over the first ``n_in``
    inputs of a length-``length`` transform (an input shorter than ``length`` is zero-padded,
    which adds nothing). Forward: ``n_out`` is ``length`` or ``length // 2 + 1`` when
    ``onesided``. Inverse ``onesided`` (irfft) reads the ``n_in <= length // 2 + 1`` lower bins
    and writes ``length`` real samples: each inner bin stands for itself and its conjugate."""
    n_out = length // 2 + 1 if onesided and not inverse else length
    n, k = np.arange(n_in)[:, None], np.arange(n_out)[None, :]
    theta = 2 * np.pi * ((n * k) % length) / length  # mod first: exact angles for large n*k
    if not inverse:
        return np.cos(theta), -np.sin(theta)
    weight = np.ones((n_in, 1))
    if onesided:  # bins 1 .. ceil(length/2)-1 have a conjugate twin in the full spectrum
        weight[1:(length + 1) // 2] = 2
    return weight * np.cos(theta) / length, weight * np.sin(theta) / length


def _complex_matmul(xr, xi, a, b, yr, yi, tmp):
    """``(yr, yi) = (xr, xi) @ (a + ib)`` over the last axis; ``xi`` None is a real input,
    ``yi`` None keeps only the real part."""
    np.matmul(xr, a, out=yr)
    if xi is not None:
        np.matmul(xi, b, out=tmp)
        np.subtract(yr, tmp, out=yr)
    if yi is not None:
        np.matmul(xr, b, out=yi)
        if xi is not None:
            np.matmul(xi, a, out=tmp)
            np.add(yi, tmp, out=yi)


def _complex_parts(a: np.ndarray):
    """(real, imaginary or None) views of a tensor whose last axis is 1 (real) or 2."""
    return a[..., 0], (a[..., 1] if a.shape[-1] == 2 else None)


def dft_numpy(ctx):
    """DFT (17: ``axis`` attribute; 20: ``axis`` input): along ``axis`` of the signal axes (the
    last axis holds real or (real, imaginary)), length ``dft_length`` (default: the axis's
    size, or ``2 (size - 1)`` for an inverse onesided transform), in float64."""
    x_info, y_info = ctx.inputs[0], ctx.outputs[0]
    rank = len(x_info.shape)
    if ctx.since_version >= 20:
        axis_value = ctx.const(2) if ctx.has_input(2) else None
        axis = int(np.asarray(axis_value).reshape(())) if axis_value is not None else -2
    else:
        axis = int(ctx.attrs.get("axis", 1))
    axis %= rank
    if axis == rank - 1:
        raise ctx.error("axis is the (real, imaginary) axis, not a signal axis")
    inverse, onesided = bool(ctx.attrs.get("inverse", 0)), bool(ctx.attrs.get("onesided", 0))
    size = x_info.shape[axis]
    length_value = ctx.const(1) if ctx.has_input(1) else None
    if length_value is not None:
        length = int(np.asarray(length_value).reshape(()))
    else:
        length = 2 * (size - 1) if inverse and onesided else size
    n_in = min(size, length // 2 + 1 if inverse and onesided else length)
    a, b = _dft_matrices(n_in, length, inverse, onesided)
    moved = tuple(np.delete(np.array(x_info.shape[:-1]), axis))
    x_ws = [ctx.workspace(moved + (n_in,), np.float64) for _ in range(x_info.shape[-1])]
    y_ws = [ctx.workspace(moved + (a.shape[1],), np.float64) for _ in range(y_info.shape[-1])]
    tmp = ctx.workspace(moved + (a.shape[1],), np.float64)

    def along_last(t):
        return np.moveaxis(t, axis, -1)

    def run(ins, outs, ws):
        x_parts = [ws[i] for i in x_ws]
        for part, src in zip(x_parts, _complex_parts(ins[0])):
            np.copyto(part, along_last(src)[..., :n_in])
        y_parts = [ws[i] for i in y_ws]
        _complex_matmul(x_parts[0], x_parts[1] if len(x_parts) == 2 else None, a, b,
                        y_parts[0], y_parts[1] if len(y_parts) == 2 else None, ws[tmp])
        for part, dst in zip(y_parts, _complex_parts(outs[0])):
            np.copyto(along_last(dst), part)

    return run


def stft_numpy(ctx):
    """STFT: frames of ``frame_length`` samples every ``frame_step`` along the signal axis,
    weighted by ``window`` (a run-time input, ones when absent), each transformed forward
    (onesided by default) in float64. Output ``[batch, frames, bins, 2]``."""
    batch, signal_len, parts = ctx.inputs[0].shape
    step = int(np.asarray(ctx.const(1)).reshape(()))
    if ctx.has_input(3) and ctx.const(3) is not None:
        frame_length = int(np.asarray(ctx.const(3)).reshape(()))
    elif ctx.has_input(2):
        frame_length = ctx.inputs[2].shape[0]
    else:
        frame_length = signal_len
    has_window = ctx.has_input(2)
    frames = 1 + (signal_len - frame_length) // step
    a, b = _dft_matrices(frame_length, frame_length, False, bool(ctx.attrs.get("onesided", 1)))
    x_ws = [ctx.workspace((batch, signal_len), np.float64) for _ in range(parts)]
    framed_ws = [ctx.workspace((batch, frames, frame_length), np.float64) for _ in range(parts)]
    y_ws = [ctx.workspace((batch, frames, a.shape[1]), np.float64) for _ in range(2)]
    tmp = ctx.workspace((batch, frames, a.shape[1]), np.float64)

    def run(ins, outs, ws):
        framed = []
        for x_part, f_part, src in zip(x_ws, framed_ws, _complex_parts(ins[0])):
            signal = ws[x_part]
            np.copyto(signal, src)
            s0, s1 = signal.strides
            view = as_strided(signal, (batch, frames, frame_length), (s0, s1 * step, s1),
                              writeable=False)
            if has_window:
                np.multiply(view, ins[2], out=ws[f_part])
            else:
                np.copyto(ws[f_part], view)
            framed.append(ws[f_part])
        _complex_matmul(framed[0], framed[1] if parts == 2 else None, a, b,
                        ws[y_ws[0]], ws[y_ws[1]], ws[tmp])
        np.copyto(outs[0][..., 0], ws[y_ws[0]])
        np.copyto(outs[0][..., 1], ws[y_ws[1]])

    return run


def mel_weight_matrix_value(ctx) -> np.ndarray:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters, as onnx.reference builds them:
    mel edges 2595 log10(1 + f / 700) spaced by (high - low) / (num_mel_bins + 2), their
    spectrogram bins floor((dft_length + 1) f / sample_rate)."""
    mel_bins, dft_length, sample_rate = (int(np.asarray(ctx.const(i)).reshape(()))
                                         for i in range(3))
    low, high = (2595 * np.log10(1 + float(np.asarray(ctx.const(i)).reshape(())) / 700)
                 for i in (3, 4))
    mels = low + np.arange(mel_bins + 2) * (high - low) / (mel_bins + 2)
    edges = ((dft_length + 1) * (700 * (10 ** (mels / 2595) - 1)) // sample_rate).astype(int)
    out = np.zeros((dft_length // 2 + 1, mel_bins))
    for i in range(mel_bins):
        left, center, right = edges[i:i + 3]
        if center == left:
            out[center, i] = 1
        else:
            out[left:center + 1, i] = (np.arange(left, center + 1) - left) / (center - left)
        if right > center:
            out[center:right, i] = (right - np.arange(center, right)) / (right - center)
    return out.astype(ctx.outputs[0].dtype)


def mel_weight_matrix_numpy(ctx):
    value = mel_weight_matrix_value(ctx)

    def run(ins, outs, ws):
        np.copyto(outs[0], value)

    return run


@hookimpl
def tr_onnx_op_definitions():
    windows = [OpDef(op, (17,), {"numpy": window_numpy(formula)}, const_inputs=(0,),
                     differentiable=False)
               for op, formula in (("HannWindow", hann), ("HammingWindow", hamming),
                                   ("BlackmanWindow", blackman))]
    return windows + [
        OpDef("DFT", (17, 20), {"numpy": dft_numpy}, const_inputs=(1, 2), differentiable=False),
        OpDef("MelWeightMatrix", (17,), {"numpy": mel_weight_matrix_numpy},
              const_inputs=(0, 1, 2, 3, 4), differentiable=False),
        OpDef("STFT", (17,), {"numpy": stft_numpy}, const_inputs=(1, 3), differentiable=False),
    ]
