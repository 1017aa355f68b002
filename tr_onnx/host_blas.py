"""Direct GEMM calls into the BLAS that NumPy itself runs on (the OpenBLAS of the numpy wheel),
for what ``np.matmul`` cannot say: ``C += A @ B`` (beta = 1), and matrices whose rows are
further apart than their length (a row offset into a padded feature map, a column block of a
wider matrix, one kernel tap of an OHWI weight) without copying them first.

A kernel prepares each call once (``prepared_gemm``) on the arena views it always gets, so a
step pays one ctypes call (~2 µs) per GEMM and NumPy's own thread pool does the work. Where no
CBLAS symbol is found (another BLAS vendor, a NumPy built differently) or a view's strides are
not a BLAS matrix, the prepared call is NumPy (``np.matmul`` into a buffer made when it is
prepared, then an add), the same arithmetic up to summation order.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable
from functools import cache, partial

import numpy as np

ROW_MAJOR, COL_MAJOR = 101, 102
NO_TRANS, TRANS = 111, 112
# NumPy's wheels ship OpenBLAS with a symbol suffix and 64-bit integers (scipy-openblas64);
# older wheels used ``cblas_sgemm64_``; a NumPy linked against a system BLAS exports neither
_SYMBOLS = {np.dtype(np.float32): ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
            np.dtype(np.float64): ("scipy_cblas_dgemm64_", "cblas_dgemm64_")}


@cache
def openblas() -> ctypes.CDLL | None:
    """The OpenBLAS library NumPy has loaded (the same handle: its thread pool is NumPy's), or
    None for a NumPy built on another BLAS."""
    libs = os.path.join(os.path.dirname(np.__file__) + ".libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _library() -> ctypes.CDLL | None:
    if os.environ.get("TR_ONNX_NO_CBLAS"):  # the NumPy path, for tests and comparisons
        return None
    return openblas()


@cache
def _gemm_symbol(dtype: np.dtype):
    lib = _library()
    if lib is None or dtype not in _SYMBOLS:
        return None
    for name in _SYMBOLS[dtype]:
        fn = getattr(lib, name, None)
        if fn is not None:
            i, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
            scalar = ctypes.c_float if dtype == np.float32 else ctypes.c_double
            fn.argtypes = [i, i, i, i64, i64, i64, scalar, ptr, i64, ptr, i64, scalar, ptr, i64]
            fn.restype = None
            return fn
    return None


def available(dtype) -> bool:
    """Whether GEMMs in ``dtype`` go straight to BLAS (else ``prepared_gemm`` uses NumPy)."""
    return _gemm_symbol(np.dtype(dtype)) is not None


def _matrix(a: np.ndarray) -> tuple[bool, int] | None:
    """(row_major, leading dimension) of a 2-D view as BLAS reads it, or None when its strides
    are not a BLAS matrix (no unit stride, negative or unaligned strides)."""
    rows, cols = a.shape
    item = a.itemsize
    s0, s1 = a.strides
    if (s1 == item or cols == 1) and s0 % item == 0 and s0 >= 0:
        ld = s0 // item if rows > 1 else cols
        if ld >= max(cols, 1):
            return True, ld
    if (s0 == item or rows == 1) and s1 % item == 0 and s1 >= 0:
        ld = s1 // item if cols > 1 else rows
        if ld >= max(rows, 1):
            return False, ld
    return None


def prepared_gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray,
                  accumulate: bool = False) -> Callable[[], None]:
    """A call that computes ``c = a @ b`` (``c += a @ b`` when ``accumulate``) on these very
    views, every time it is called. ``a`` [M, K], ``b`` [K, N], ``c`` [M, N], one float dtype;
    any of them may be a transposed or strided view."""
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or c.shape != (m, n):
        raise ValueError(f"GEMM shapes {a.shape} @ {b.shape} -> {c.shape} do not fit")
    fn = _gemm_symbol(c.dtype) if a.dtype == b.dtype == c.dtype else None
    layout = [_matrix(x) for x in (a, b, c)]
    if fn is None or None in layout or min(m, n, k) == 0:
        return _numpy_gemm(a, b, c, accumulate)
    (a_row, lda), (b_row, ldb), (c_row, ldc) = layout
    one = 1.0
    beta = 1.0 if accumulate else 0.0
    if c_row:
        return partial(fn, ROW_MAJOR, NO_TRANS if a_row else TRANS,
                       NO_TRANS if b_row else TRANS, m, n, k, one, a.ctypes.data, lda,
                       b.ctypes.data, ldb, beta, c.ctypes.data, ldc)
    return partial(fn, COL_MAJOR, TRANS if a_row else NO_TRANS, TRANS if b_row else NO_TRANS,
                   m, n, k, one, a.ctypes.data, lda, b.ctypes.data, ldb, beta, c.ctypes.data,
                   ldc)


def _numpy_gemm(a, b, c, accumulate: bool) -> Callable[[], None]:
    if not accumulate:
        return partial(np.matmul, a, b, out=c)
    product = np.empty(c.shape, c.dtype)  # made once, when the kernel is prepared

    def run():
        np.matmul(a, b, out=product)
        np.add(c, product, out=c)

    return run


class PreparedCalls:
    """The prepared GEMMs of one kernel, made on its first call and made again only if it is
    called on other arrays. ``make(ins, outs, ws)`` returns the list of calls; they keep the
    views they point into. A call may offer ``execute``, the same call returning a status
    (nonzero: failed, then ``failed(status)`` raises), which skips a Python frame per call
    (a bound oneDNN primitive: 0.25 us, a tenth of a small matmul).

    A bound step passes the same three lists every step and never changes them
    (``NumpyExecutor``): those very lists are the fast check (0.1 us; comparing every view
    took 0.5 us per call, a tenth of a small GEMM). Other lists are compared view by view."""

    __slots__ = ("make", "lists", "key", "calls", "fast")

    def __init__(self, make: Callable[[list, list, list], list]):
        self.make, self.lists, self.key, self.calls, self.fast = \
            make, (None, None, None), None, [], []

    def get(self, ins: list, outs: list, ws: list) -> list:
        lists = self.lists
        if ins is lists[0] and outs is lists[1] and ws is lists[2]:
            return self.calls
        key = (*ins, *outs, *ws)
        if self.key is None or len(key) != len(self.key) or \
                any(x is not y for x, y in zip(key, self.key)):
            self.calls = self.make(ins, outs, ws)
            self.fast = [getattr(call, "execute", call) for call in self.calls]
            self.key = key
        self.lists = (ins, outs, ws)
        return self.calls

    def failed(self, call, status) -> None:
        self.calls[self.fast.index(call)].failed(status)


def prepared_step(make):
    """A kernel's step: the calls ``make(ins, outs, ws)`` prepares on the arena views (made on
    the first call, again only if the views change: ``PreparedCalls``), run in order."""
    bound = PreparedCalls(make)

    def run(ins, outs, ws):
        bound.get(ins, outs, ws)
        for call in bound.fast:
            status = call()
            if type(status) is int and status:  # other calls return None or their output
                bound.failed(call, status)

    return run
