"""erf in float64, which NumPy lacks, for the Erf and Gelu bodies and GeluGrad (ops/unary.py):
to a few float64 ulps (a series and erfc's continued fraction) for float64 results, or to
4.4e-11 (piecewise polynomials, no exp and no division) for float32 and float16 ones. Scratch
buffers are the caller's (``ERF_SCRATCH``), reserved at plan time, so a run allocates nothing.
"""

from __future__ import annotations

import math

import numpy as np

from ..host_math import negate

_ERF_SPLIT = 2.0  # series below, continued fraction above (both reach float64 precision there)
# (series terms, continued-fraction terms) for float64 results: errors below 2e-16, measured
# against the C library's erf
_ERF_TERMS = (30, 40)
# erf(z) = 2/sqrt(pi) exp(-z^2) z sum_n (2 z^2)^n / (2n+1)!!  (all terms positive: no
# cancellation); the coefficients for Horner's scheme in u = z^2:
_ERF_SERIES = tuple(2.0 ** n / math.prod(range(1, 2 * n + 2, 2)) for n in range(30))
ERF_SCRATCH = ("f8", "f8", "f8", "f8", "?", "i8")

# float32 and float16 results need erf to ~1e-9, not to float64 precision: erf(z)/z on
# [0, _ERF_TOP] in _ERF_PIECES pieces, a polynomial of degree _ERF_DEGREE in each, interpolated
# at Chebyshev nodes. Measured against math.erf on 2e6 points of [-6, 6], 1e6 normal ones
# (sd 2) and 1e4 from 1e-30 to 1: relative error at most 4.4e-11 for |x| <= 3.9 (the series
# and continued fraction of 22 and 12 terms this replaces: 1.1e-9), 1.5e-8 above, where the
# result, erf(4) at most, rounds to +-1 in float32 and float16 as erf does there. No exp, no
# division: with chunking (ops/elementwise.py Chunked), 5x faster than those series on
# [8,64,1024] float32 (75 -> 15 ms per call, best of 15 on a busy machine).
_ERF_TOP = 4.0
_ERF_PIECES = 32
_ERF_DEGREE = 5


def _erf_piece_columns() -> tuple[np.ndarray, ...]:
    """The pieces' coefficients by power (lowest first), each a column over the pieces, in
    ``s = z / width - piece`` in [0, 1]."""
    width, rows = _ERF_TOP / _ERF_PIECES, []
    for k in range(_ERF_PIECES):
        fit = np.polynomial.Chebyshev.interpolate(
            lambda s, k=k: np.array([math.erf(z) / z for z in (k + s) * width]), _ERF_DEGREE,
            domain=[0.0, 1.0])  # first-kind nodes: interior, z is never 0
        rows.append(fit.convert(kind=np.polynomial.Polynomial).coef)
    return tuple(np.ascontiguousarray(c) for c in np.array(rows).T)


_ERF_COLUMNS = _erf_piece_columns()
_ERF_LAST = np.nextafter(float(_ERF_PIECES), 0.0)  # the top, still in the last piece


def erf_float64(x, t, scale=1.0, exact=True):
    """``erf(scale * x)`` into ``t[1]`` (float64), using ``t[0], t[2], t[3]`` (float64),
    ``t[4]`` (bool) and ``t[5]`` (intp) as scratch (``ERF_SCRATCH``). NumPy has no erf.
    ``exact``: to a few float64 ulps, for float64 results: the series above for |z| < 2 and,
    above, erfc's continued fraction erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + (2/2)/(z +
    (3/2)/(z + ...)))). Otherwise to 4.4e-11 (``_ERF_PIECES``), for float32 and float16."""
    if not exact:
        _erf_pieces(x, t, scale)
        return
    z, r, u, p, small, _ = t
    n_series, n_cf = _ERF_TERMS
    np.abs(x, out=z)
    if scale != 1.0:
        z *= scale
    np.less(z, _ERF_SPLIT, out=small)
    # continued fraction on max(z, split), evaluated from the bottom up
    np.maximum(z, _ERF_SPLIT, out=u)
    np.copyto(p, u)
    for n in range(n_cf, 0, -1):
        np.divide(n / 2.0, p, out=p)
        p += u
    np.square(u, out=r)
    negate(r, r)
    np.exp(r, out=r)
    r /= p
    r *= -1.0 / math.sqrt(math.pi)
    r += 1.0
    # series on min(z, split)
    np.minimum(z, _ERF_SPLIT, out=z)
    np.square(z, out=u)
    p.fill(_ERF_SERIES[n_series - 1])
    for c in _ERF_SERIES[n_series - 2::-1]:
        p *= u
        p += c
    p *= z
    negate(u, u)
    np.exp(u, out=u)
    p *= u
    p *= 2.0 / math.sqrt(math.pi)
    np.copyto(r, p, where=small)
    np.copysign(r, x, out=r)


def _erf_pieces(x, t, scale):
    """erf(scale * x) = clip(scale * x, +-top) * p_k(s), with piece k and s from |scale * x|."""
    z, r, s, c, _, k = t
    np.abs(x, out=z)
    z *= scale * _ERF_PIECES / _ERF_TOP  # in pieces
    np.fmin(z, _ERF_LAST, out=z)  # NaN and inf too: x brings them back below
    np.floor(z, out=s)
    np.copyto(k, s, casting="unsafe")
    np.subtract(z, s, out=s)
    # mode="clip": with the default "raise", take buffers ``out`` in a new array every call
    np.take(_ERF_COLUMNS[-1], k, out=r, mode="clip")
    for column in _ERF_COLUMNS[-2::-1]:
        r *= s
        np.take(column, k, out=c, mode="clip")
        r += c
    np.multiply(x, np.float64(scale), out=s)  # in float64 (a Python float would keep x's dtype)
    np.clip(s, -_ERF_TOP, _ERF_TOP, out=s)
    r *= s
