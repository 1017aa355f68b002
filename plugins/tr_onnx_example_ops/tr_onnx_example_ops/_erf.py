"""erf in float64 with NumPy ufuncs and caller-owned scratch (NumPy has no erf).

Below |z| = 2 the series erf(z) = 2/sqrt(pi) exp(-z^2) z sum_n (2 z^2)^n / (2n+1)!! (all terms
positive, no cancellation); above it erfc's continued fraction
erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + (2/2)/(z + ...))). Both reach a few float64 ulps.
"""

from __future__ import annotations

import math

import numpy as np

SPLIT = 2.0
SERIES = tuple(2.0 ** n / math.prod(range(1, 2 * n + 2, 2)) for n in range(30))
CF_TERMS = 40


def erf_into(x, out, scale, z, u, p, small) -> None:
    """``out = erf(scale * x)``; ``out, z, u, p`` float64 and ``small`` bool, shaped like x."""
    np.multiply(x, scale, out=z)
    np.abs(z, out=z)
    np.less(z, SPLIT, out=small)
    np.maximum(z, SPLIT, out=u)  # continued fraction on max(z, split), from the bottom up
    np.copyto(p, u)
    for n in range(CF_TERMS, 0, -1):
        np.divide(n / 2.0, p, out=p)
        p += u
    np.square(u, out=out)
    np.negative(out, out=out)
    np.exp(out, out=out)
    out /= p
    out *= -1.0 / math.sqrt(math.pi)
    out += 1.0
    np.minimum(z, SPLIT, out=z)  # series on min(z, split), Horner in u = z^2
    np.square(z, out=u)
    p.fill(SERIES[-1])
    for c in SERIES[-2::-1]:
        p *= u
        p += c
    p *= z
    np.negative(u, out=u)
    np.exp(u, out=u)
    p *= u
    p *= 2.0 / math.sqrt(math.pi)
    np.copyto(out, p, where=small)
    np.copysign(out, x, out=out)
