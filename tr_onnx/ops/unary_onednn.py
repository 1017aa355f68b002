"""oneDNN's eltwise kernels for unary ops in float32 (ops/unary.py asks these first): Gelu and
GeluGrad, and Elu, Selu and Mish on runs whose input is finite. Each returns a prepared step
over the arena views, or None where oneDNN cannot do better than the NumPy body.
"""

from __future__ import annotations

from functools import cache, partial

import numpy as np

from .. import host_blas, onednn
from ..layouts import compact_strides


def onednn_gelu(ctx, infos):
    """Gelu (``infos`` x, y) or GeluGrad (gy, x, gx) in float32 through oneDNN's gelu_erf or
    gelu_tanh primitive (vectorised, on OpenMP threads), on the arena views as they are laid
    out; None where oneDNN is not there, for other dtypes, operands laid out differently from
    each other, or where oneDNN offers only its reference loop. NumPy has no erf: ops/erf.py's
    pieces take ~10 ms per Erf on [8, 64, 1024] (BERT's feed-forward), oneDNN 0.34 ms forward
    and 0.49 ms backward (2 threads, 2026-12-01). Against float64 x Phi(x) its error is that of
    the chain of float32 nodes a Gelu is exported as (|error| < 4e-7 for |x| < 12, NaN for
    -inf, as the chain: ``tests/test_gelu_fusion.py``)."""
    first = infos[0]
    strides = first.layout.view_strides(4)
    if first.dtype != np.float32 or not 1 <= len(first.shape) <= onednn.MAX_DIMS \
            or any(i.dtype != first.dtype or i.shape != first.shape
                   or i.layout.view_strides(4) != strides for i in infos) \
            or 0 in first.shape or not onednn.available():
        return None
    alg = (onednn.ELTWISE_GELU_TANH if ctx.attrs.get("approximate", "none") == "tanh"
           else onednn.ELTWISE_GELU_ERF)
    md = onednn.MemoryDesc.strided(first.shape, strides)
    try:
        forward = onednn.eltwise(alg, md)
        primitive = forward if ctx.node.op_type == "Gelu" else onednn.eltwise(alg, md, forward)
    except onednn.OneDnnError:
        return None
    if primitive.implementation.startswith("ref"):
        return None
    names = ("src", "dst") if primitive is forward else ("diff_dst", "src", "diff_src")
    scratch = onednn.scratchpad(ctx, primitive)
    keep_inf = primitive is forward and _gelu_loses_inf(alg)

    def make(ins, outs, ws):
        views = [*ins[:len(names) - 1], outs[0]]
        bound = onednn.bind(primitive, [(n, md, v) for n, v in zip(names, views)], scratch, ws)
        if keep_inf:
            return [partial(_gelu_keeping_inf, bound, ins[0], outs[0])]
        return [bound]

    return host_blas.prepared_step(make)


@cache
def _gelu_loses_inf(alg: int) -> bool:
    """Whether oneDNN's forward ``alg`` gives NaN for +inf, where x * Phi(x) (and the chain of
    nodes exporters emit) is +inf: its AVX-512 gelu_erf does, its AVX2 gelu_erf and its
    gelu_tanh do not (oneDNN 3.2; AMD EPYC with AVX-512, 2026-12-02). Asked of the library
    once per process, on full vectors and a tail."""
    x = np.full(67, np.inf, np.float32)
    y = np.empty_like(x)
    md = onednn.MemoryDesc.strided(x.shape, x.strides)
    try:
        onednn.execute_once(onednn.eltwise(alg, md), [("src", md, x), ("dst", md, y)])
    except onednn.OneDnnError:
        return True  # not asked: the kernel then restores +inf whatever the library does
    return not bool(np.all(y == np.inf))


def _gelu_keeping_inf(gelu, x: np.ndarray, y: np.ndarray) -> None:
    """``gelu()`` (oneDNN, x -> y), then +inf where x was +inf. One max over x finds out
    first (y may be x's own memory); only a run whose x holds +inf or NaN pays for the mask
    (allocated then: a step with an infinite activation is rare, and its update is skipped)."""
    top = np.maximum.reduce(x, axis=None)
    where = x == np.inf if not top < np.inf else None
    gelu()
    if where is not None:
        y[where] = np.inf


# float32 Elu, Selu (Elu, then times gamma) and Mish through oneDNN's eltwise kernels: NumPy's
# expm1 and log1p are scalar libm loops (~20 ns per value). Session runs on [8, 64, 32, 32]:
# Elu 10.6 -> 1.05 ms, Selu 14.4 -> 3.6, Mish 12.8 -> 0.96 (onnxruntime 1.2, 1.7, 8.2; 2
# threads, Zen 3, 2026-12-02); within the op tests' float32 tolerance of float64 for
# |x| < 1e19. What they make of NaN and infinities is the ISA's
# kernel's (AVX2 keeps them; AVX-512's gelu_erf made +inf NaN, ``_gelu_loses_inf``), so a run
# whose input is not finite takes the NumPy body. (oneDNN's soft_relu is log(1 + e^x) as
# written: 0.5% off at x = -8.5; Softplus stays in NumPy.)
_ONEDNN_FINITE = {"Elu": onednn.ELTWISE_ELU, "Selu": onednn.ELTWISE_ELU,
                  "Mish": onednn.ELTWISE_MISH}


def onednn_finite_eltwise(ctx, a, exact):
    """The step for a ``_ONEDNN_FINITE`` node: oneDNN's kernel on runs whose input is finite
    (the sum of its squares, one BLAS dot, is below inf: every |x| below ~1.8e19), ``exact``
    (the NumPy body's run) on the others. None where oneDNN is not there, for other dtypes,
    for x and y laid out differently or with gaps (padded channels: the dot needs the values
    as one vector), or where oneDNN offers only its reference loop or asks for scratch."""
    alg = _ONEDNN_FINITE.get(ctx.node.op_type)
    x, y = ctx.inputs[0], ctx.outputs[0]
    if alg is None or x.dtype != np.float32 or y.dtype != np.float32 or x.shape != y.shape \
            or not 1 <= len(x.shape) <= onednn.MAX_DIMS or 0 in x.shape \
            or not onednn.available():
        return None
    strides = x.layout.view_strides(4)
    order = sorted(range(len(strides)), key=lambda i: -strides[i])  # memory order
    if y.layout.view_strides(4) != strides or [strides[i] for i in order] != list(
            compact_strides(tuple(x.shape[i] for i in order), 4)):
        return None
    md = onednn.MemoryDesc.strided(x.shape, strides)
    alpha = a.alpha_f if ctx.node.op_type in ("Elu", "Selu") else 0.0
    try:
        primitive = onednn.eltwise(alg, md, alpha=alpha)
    except onednn.OneDnnError:
        return None
    if primitive.implementation.startswith("ref") or primitive.md("scratchpad").nbytes:
        return None
    gamma = a.gamma if ctx.node.op_type == "Selu" else None

    def make(ins, outs, ws):
        bound = onednn.bind(primitive, [("src", md, ins[0]), ("dst", md, outs[0])], None, ws)
        flat = onednn.reshaped(ins[0].transpose(order), (-1,))
        return [partial(_finite_or_exact, flat, bound, gamma, outs[0],
                        partial(exact, ins, outs, ws))]

    return host_blas.prepared_step(make)


def _finite_or_exact(flat, fast, gamma, y, exact) -> None:
    if onednn.finite(flat):  # else the NumPy body
        fast()
        if gamma is not None:
            np.multiply(y, gamma, out=y)
    else:
        exact()
