"""Contractions: Gemm, MatMul and Einsum.

Gemm and MatMul may read a feature map flattened in its physical (h, w, c) order: the layout
pass then stores the weight's rows in the same order, so the kernel is a plain matmul over
whatever matrices it is handed (``ctx.inputs[i].shape`` is the physical shape then). Einsum
reads logical views of any layout.

``np.matmul`` is a gufunc with optional core dimensions, so 1-D operands, batch broadcasting
and integer types all go through one ``np.matmul(a, b, out=y)`` with no temporary.

bfloat16 and float8 operands are contracted in float32 and rounded once at the output
(``dtypes.compute_wide``), as GPUs and PyTorch's CPU bf16 matmul do; NumPy's einsum has no loop
for them at all.

Gradient rules emit Gemm/MatMul/Transpose nodes, and one Einsum per operand for Einsum.
Training graphs never absorb flattens (``absorb_flatten=False``), so the operands a rule sees
are logical matrices.
"""

import math
import string
from functools import partial

import numpy as np

from .. import host_blas, onednn
from ..domains import INTERNAL_DOMAIN
from ..dtypes import compute_wide
from ..hookspecs import hookimpl
from ..opdef import BATCHNORM_FOLDS_INTO, LINEAR, MATMUL, OpDef
from .tensor import reshape_to


def gemm_numpy(ctx):
    """``y = alpha * op(A) @ op(B) + beta * C``; C (optional from v11) broadcasts to ``y``."""
    alpha, beta = float(ctx.attrs["alpha"]), float(ctx.attrs["beta"])
    trans_a, trans_b = bool(ctx.attrs["transA"]), bool(ctx.attrs["transB"])
    a_shape, b_shape = ctx.inputs[0].logical_shape, ctx.inputs[1].logical_shape
    if len(a_shape) != 2 or len(b_shape) != 2 or \
            a_shape[0 if trans_a else 1] != b_shape[1 if trans_b else 0]:
        # ONNX's Gemm shape rule checks this only from opset 13
        raise ctx.error(f"A {list(a_shape)} (transA={int(trans_a)}) and B {list(b_shape)} "
                        f"(transB={int(trans_b)}) are not matrices whose product is defined")
    has_c = ctx.has_input(2) and beta != 0.0
    if alpha == 1.0 and (not has_c or beta == 1.0):
        fast = _onednn_product(ctx, [(ctx.inputs[0], trans_a), (ctx.inputs[1], trans_b),
                                     (ctx.outputs[0], False)], need_own_kernel=True,
                               bias=ctx.inputs[2] if has_c else None)
        if fast is not None:
            return fast
    dtype = ctx.outputs[0].dtype
    alpha_t, beta_t = dtype.type(alpha), dtype.type(beta)
    scaled_c = ctx.workspace(ctx.inputs[2].shape, dtype) if has_c and beta != 1.0 else None

    def run(ins, outs, ws):
        a, b, y = ins[0], ins[1], outs[0]
        np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=y)
        if alpha != 1.0:
            np.multiply(y, alpha_t, out=y)
        if has_c:
            c = ins[2]
            if scaled_c is not None:
                c = np.multiply(c, beta_t, out=ws[scaled_c])
            np.add(y, c, out=y)

    return run


_ONEDNN_MATRIX_MACS = 32 ** 3


def _matrices(shape, strides, trans: bool, fold: bool):
    """(dims, element strides) of a float32 operand as oneDNN's matmul reads it: the last two
    axes swapped for ``trans``; ``fold``: a stack of matrices whose rows lie evenly apart read
    as one matrix of all the rows, where its strides allow."""
    shape, strides = [int(n) for n in shape], [int(s) // 4 for s in strides]
    if trans:
        shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    if fold and len(shape) > 2 and all(strides[i] == strides[i + 1] * shape[i + 1]
                                       for i in range(len(shape) - 2)):
        shape, strides = [math.prod(shape[:-1]), shape[-1]], strides[-2:]
    return shape, strides


def _product_geometry(operands, fold: bool) -> list[tuple[tuple, tuple]]:
    """(dims, element strides) of the source, weights, destination (and bias) given as
    (shape, byte strides, transposed): with ``fold`` (a stack times one matrix), the source's
    and destination's rows as one matrix where both allow it; then leading axes of size 1
    added up to the longest (an operand broadcast over the others' stack)."""
    mats = [_matrices(shape, strides, trans, False) for shape, strides, trans in operands]
    if fold:
        folded = [_matrices(*operands[i], True) for i in (0, 2)]
        if all(len(d) == 2 for d, _ in folded):
            mats[0], mats[2] = folded
    rank = max(len(d) for d, _ in mats)
    return [(tuple([1] * (rank - len(d)) + d),
             tuple([math.prod(d)] * (rank - len(d)) + s)) for d, s in mats]


def own_kernel(implementation: str) -> bool:
    """Whether oneDNN runs a matmul on its own blocked kernels ("brg...": AVX-512 and newer),
    not its generic GEMM ("gemm:jit")."""
    return implementation.startswith("brg")


def _onednn_product(ctx, operands, need_own_kernel: bool, bias=None):
    """A float32 matrix product as one oneDNN matmul: ``operands`` are the (ctx info,
    transposed) of the source, weights and destination, ``bias`` the info of a tensor
    broadcast onto the destination and added (Gemm's C). A 2-D weight under a stacked source
    (a transformer's x @ W) is one GEMM over the stack's rows where the strides allow. None
    where oneDNN is not installed, the operands are not float32, the products are below
    32x32x32 (NumPy's call costs less), oneDNN refuses them or offers only its reference
    loop, or (``need_own_kernel``) offers only its generic GEMM.

    Its own blocked kernels ("brg", on AVX-512 machines) ran GEMMs 2x faster than NumPy's
    OpenBLAS under this machine's OPENBLAS_CORETYPE=Haswell and 1.1-1.2x without it ([512,
    256] @ [256, 1024]: 638 vs 1208 / 681 us; [32, 64] @ [64, 128] with a bias: 3.7 vs 7.9
    us; 2 threads, AMD EPYC with AVX-512, 2026-12-02). Held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2)
    it picks its generic "gemm:jit", as fast as OpenBLAS on large products and slower on
    small ones ([32, 128] @ [128, 64]: 8.4 vs 7.9 us). So a single product takes oneDNN only
    with its own kernels; stacks of matrices take it either way (NumPy calls BLAS once per
    matrix)."""
    infos = [info for info, _ in operands] + ([bias] if bias is not None else [])
    if any(i.dtype != np.float32 or 0 in i.shape for i in infos) or not onednn.available():
        return None
    fold = len(operands[1][0].shape) == 2
    trans = [t for _, t in operands] + [False]
    geometry = _product_geometry(
        [(i.shape, i.layout.view_strides(4), t) for i, t in zip(infos, trans)], fold)
    if len(geometry[0][0]) > onednn.MAX_DIMS:
        return None
    (a_dims, _), (b_dims, _), *_ = geometry
    if a_dims[-2] * a_dims[-1] * b_dims[-1] < _ONEDNN_MATRIX_MACS:
        return None
    mds = [onednn.MemoryDesc.strided(dims, [s * 4 for s in strides])
           for dims, strides in geometry]
    try:
        primitive = onednn.matmul(*mds[:3], bias=mds[3] if bias is not None else None)
    except onednn.OneDnnError:
        return None
    implementation = primitive.implementation
    if implementation.startswith("ref") or (need_own_kernel and
                                            not own_kernel(implementation)):
        return None
    scratch = onednn.scratchpad(ctx, primitive)
    names = ("src", "weights", "dst", "bias")

    def make(ins, outs, ws):
        views = [ins[0], ins[1], outs[0]] + ([ins[2]] if bias is not None else [])
        got = _product_geometry([(v.shape, v.strides, t) for v, t in zip(views, trans)], fold)
        if got != geometry:  # the executor hands a kernel the views the plan described
            raise ctx.error(f"oneDNN matmul planned for {geometry}, given {got}")
        return [onednn.bind(primitive, list(zip(names, mds, views)), scratch, ws)]

    return host_blas.prepared_step(make)


def _onednn_matmul(ctx):
    """MatMul in float32 through oneDNN (``_onednn_product``): stacked matrix products with
    the same leading axes (attention's Q @ K^T and P @ V) are one call whose threads split the
    stack, where np.matmul calls BLAS once per matrix (BERT's [8, 4, 64, 64] @ [8, 4, 64, 64]:
    32 GEMMs of 64x64x64, 0.30-0.34 ms; oneDNN 0.18 ms; 2 threads, 2026-12-02); below
    32x32x32 products per matrix NumPy's loop is as fast or faster ([32, 4, 8, 8] 36 vs 75 us,
    [8, 4, 16, 16] 21 vs 26 us; [8, 4, 32, 32] 80 vs 46 us). A 2-D product or a stack times
    one matrix (one GEMM over the rows) takes oneDNN only where it has its own kernels."""
    a, b, y = ctx.inputs[0], ctx.inputs[1], ctx.outputs[0]
    if len(a.shape) < 2 or len(b.shape) < 2:
        return None
    stacked_alike = len(a.shape) == len(b.shape) >= 3 and a.shape[:-2] == b.shape[:-2]
    if not stacked_alike and (len(a.shape) != len(y.shape) or len(b.shape) != 2):
        return None
    return _onednn_product(ctx, [(a, False), (b, False), (y, False)],
                           need_own_kernel=not stacked_alike)


def matmul_numpy(ctx):
    """A stack of matrices times one matrix (a transformer's ``x @ W``, x [N, T, K]) is one
    GEMM over the stack's rows when x and y are contiguous: np.matmul would call BLAS once per
    matrix of the stack ([8, 64, 256] @ [256, 1024]: 2.85 ms as 8 GEMMs, 2.25 ms as one)."""
    fast = _onednn_matmul(ctx)
    if fast is not None:
        return fast
    stacked = len(ctx.inputs[0].shape) >= 3 and len(ctx.inputs[1].shape) == 2

    def run(ins, outs, ws):
        a, y = ins[0], outs[0]
        if stacked and a.flags.c_contiguous and y.flags.c_contiguous:
            np.matmul(a.reshape(-1, a.shape[-1]), ins[1], out=y.reshape(-1, y.shape[-1]))
        else:
            np.matmul(a, ins[1], out=y)

    return run


def matmul_bias_numpy(ctx):
    """MatMulBias (an inference plan's MatMul then Add of a per-column bias,
    ``passes.inference_folds.fuse_matmul_bias``): y = a @ w + bias, w a 2-D constant, bias
    broadcast along the rows. oneDNN adds the bias inside its own kernels where it has them;
    else the bias is copied into y and BLAS adds the product to it (beta = 1), one GEMM over the
    rows of a stack: no second pass over y. BERT's [512, 256] @ [256, 1024] + bias 2.85 ->
    2.42 ms, [512, 1024] @ [1024, 256] 2.80 -> 2.55 (OpenBLAS, 2 threads, Zen 3, 2026-12-02).
    Operands whose rows are not one matrix take np.matmul, then the add."""
    a, w, bias, y = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2], ctx.outputs[0]
    fast = _onednn_product(ctx, [(a, False), (w, False), (y, False)], need_own_kernel=True,
                           bias=bias)
    if fast is not None:
        return fast

    def make(ins, outs, ws):
        a, w, bias, y = ins[0], ins[1], ins[2], outs[0]
        try:
            rows = [x if x.ndim == 2 else onednn.reshaped(x, (-1, x.shape[-1])) for x in (a, y)]
        except AttributeError:  # rows not evenly apart: not one matrix
            return [partial(_product_then_add, a, w, bias, y)]
        return [partial(np.copyto, y, bias),
                host_blas.prepared_gemm(rows[0], w, rows[1], accumulate=True)]

    return host_blas.prepared_step(make)


def _product_then_add(a, w, bias, y) -> None:
    np.matmul(a, w, out=y)
    np.add(y, bias, out=y)


def einsum_numpy(ctx):
    equation = ctx.attrs["equation"].replace(" ", "")

    def run(ins, outs, ws):
        np.einsum(equation, *ins, out=outs[0])

    return run


# ---- gradients ------------------------------------------------------------------------------


def gemm_vjp(b, node, gys, needed):
    """``y = alpha * op(A) @ op(B) + beta * C``: each matrix gradient is one Gemm whose
    transpose flags absorb op(); C's is ``beta * gy`` summed down to C's shape."""
    gy = gys[0]
    a, w = node.inputs[0], node.inputs[1]
    alpha, beta = float(node.attrs["alpha"]), float(node.attrs["beta"])
    ta, tb = int(node.attrs["transA"]), int(node.attrs["transB"])
    grads = [None] * len(node.inputs)
    if needed[0]:
        # dA' = alpha * gy @ B'^T; with transA, dA = dA'^T = alpha * B' @ gy^T
        grads[0] = (b.op("Gemm", [gy, w], {"alpha": alpha, "transB": 1 - tb}, like=a)
                    if not ta else
                    b.op("Gemm", [w, gy], {"alpha": alpha, "transA": tb, "transB": 1}, like=a))
    if needed[1]:
        # dB' = alpha * A'^T @ gy; with transB, dB = dB'^T = alpha * gy^T @ A'
        grads[1] = (b.op("Gemm", [a, gy], {"alpha": alpha, "transA": 1 - ta}, like=w)
                    if not tb else
                    b.op("Gemm", [gy, a], {"alpha": alpha, "transA": 1, "transB": ta}, like=w))
    if len(node.inputs) > 2 and needed[2] and beta != 0.0:
        c = node.inputs[2]
        gc = b.unbroadcast(gy, c.shape)  # reduce first: the scaling then runs on C's size
        grads[2] = gc if beta == 1.0 else b.mul(gc, b.scalar_like(beta, gc))
    return grads


def _swap_last(b, v):
    perm = list(range(v.rank - 2)) + [v.rank - 1, v.rank - 2]
    return b.op("Transpose", [v], {"perm": perm},
                shapes=[(tuple(v.shape[p] for p in perm), v.dtype)])


def matmul_vjp(b, node, gys, needed):
    """numpy ``matmul`` semantics: a 1-D operand is promoted to a matrix (and the added axis
    removed from ``y``); batch axes broadcast, so each gradient is summed down to its operand's
    batch shape. 2-D operands take one Gemm; a batched activation times a 2-D weight folds the
    batch into the rows of one Gemm (the usual ``x @ W`` of a transformer)."""
    gy = gys[0]
    a, w = node.inputs
    if a.rank == 1 and w.rank == 1:  # dot product: y is a scalar
        return [b.mul(gy, w) if needed[0] else None, b.mul(gy, a) if needed[1] else None]
    a2 = reshape_to(b, a, (1,) + a.shape) if a.rank == 1 else a
    w2 = reshape_to(b, w, w.shape + (1,)) if w.rank == 1 else w
    m, k, n = a2.shape[-2], a2.shape[-1], w2.shape[-1]
    batch = _batch(a2, w2)
    gy2 = reshape_to(b, gy, batch + (m, n))
    grads = [None, None]
    if w2.rank == 2:
        # Batch axes come from A alone: fold them into the rows of one Gemm per gradient.
        rows = math.prod(a2.shape[:-1])
        gy_rows = reshape_to(b, gy2, (rows, n))
        if needed[0]:
            ga = b.op("Gemm", [gy_rows, w2], {"transB": 1}, shapes=[((rows, k), a.dtype)])
            grads[0] = reshape_to(b, ga, a.shape)
        if needed[1]:
            a_rows = reshape_to(b, a2, (rows, k))
            gw = b.op("Gemm", [a_rows, gy_rows], {"transA": 1}, like=w2)
            grads[1] = reshape_to(b, gw, w.shape)
        return grads
    if needed[0]:
        ga = b.op("MatMul", [gy2, _swap_last(b, w2)], shapes=[(batch + (m, k), a.dtype)])
        grads[0] = reshape_to(b, b.unbroadcast(ga, a2.shape), a.shape)
    if needed[1]:
        gw = b.op("MatMul", [_swap_last(b, a2), gy2], shapes=[(batch + (k, n), w.dtype)])
        grads[1] = reshape_to(b, b.unbroadcast(gw, w2.shape), w.shape)
    return grads


def _batch(a, w) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(tuple(a.shape[:-2]), tuple(w.shape[:-2])))


def einsum_terms(equation: str, shapes) -> tuple[list[str], str, list[str]]:
    """Einsum's operand and output subscripts with ``...`` spelled out as letters (right-
    aligned, as numpy broadcasts them), the implicit output made explicit, and the letters
    still free."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    free = [c for c in string.ascii_letters if c not in equation]
    counts = [len(s) - (len(t) - 3) if "..." in t else 0 for t, s in zip(terms, shapes)]
    ell = "".join(free[:max(counts, default=0)])
    free = free[len(ell):]
    spelled = [t.replace("...", ell[len(ell) - k:] if k else "") for t, k in zip(terms, counts)]
    if arrow:
        out = rhs.replace("...", ell)
    else:  # implicit: the broadcast axes, then the letters used once, sorted
        once = [c for c in sorted(set(lhs)) if c.isalpha() and lhs.count(c) == 1]
        out = ell + "".join(once)
    return spelled, out, free


def einsum_vjp(b, node, gys, needed):
    """One Einsum per operand: gy and the other operands contracted to the operand's
    subscripts. Letters the result cannot produce come from small constants in the same
    Einsum: an identity for a repeated letter (a diagonal), ones for a letter only this operand
    has (a broadcast of gy) or an axis it broadcasts (size 1 against a longer one)."""
    gy, xs = gys[0], node.inputs
    spelled, out, free = einsum_terms(node.attrs["equation"], [x.shape for x in xs])
    sizes: dict[str, int] = {}
    for term, x in zip(spelled, xs):
        for c, n in zip(term, x.shape):
            sizes[c] = max(sizes.get(c, 1), n)
    grads = []
    for i, x in enumerate(xs):
        if not needed[i]:
            grads.append(None)
            continue
        fresh = iter(free)
        others = [t for j, t in enumerate(spelled) if j != i]
        elsewhere = set(out).union(*others)
        term, result, extra = spelled[i], [], []
        for c, n in zip(term, x.shape):
            if c in result:  # a repeated letter: place gy on the diagonal
                f = next(fresh)
                extra.append((c + f, np.eye(n, dtype=x.dtype)))
                result.append(f)
            elif n == 1 and sizes[c] != 1:  # broadcast: sum over the longer axis
                f = next(fresh)
                extra.append((f, np.ones(1, x.dtype)))
                result.append(f)
            else:
                result.append(c)
                if c not in elsewhere and term.count(c) == 1:
                    extra.append((c, np.ones(n, x.dtype)))
        equation = ",".join([out, *others, *(t for t, _ in extra)]) + "->" + "".join(result)
        inputs = [gy, *(v for j, v in enumerate(xs) if j != i), *(b.const(a) for _, a in extra)]
        grads.append(b.op("Einsum", inputs, {"equation": equation}, like=x))
    return grads


def det_numpy(ctx):
    """Det of each [..., M, M] matrix: LAPACK's LU in float64 (a temporary per call), rounded
    once."""

    def run(ins, outs, ws):
        np.copyto(outs[0], np.linalg.det(ins[0].astype(np.float64)))

    return run


def gemm_value_bound(node, bound, stats) -> float | None:
    """A constant 2-D B: |y| <= |a| * |alpha| * max_j sum_k |B_kj| + |beta| * |c|."""
    a, w = bound(node.inputs[0]), node.inputs[1]
    data = stats.data(w)
    if a is None or data is None or data.ndim != 2 or int(node.attrs.get("transA", 0)):
        return None
    # the sums over the input axis, per output column: axis 1 of B^T, axis 0 of B
    sums = stats.largest_sum(w, 1 if int(node.attrs.get("transB", 0)) else 0)
    alpha, beta = abs(float(node.attrs.get("alpha", 1.0))), abs(float(node.attrs.get("beta", 1.0)))
    c = node.inputs[2] if len(node.inputs) > 2 else None
    c_bound = 0.0 if c is None else bound(c)
    if c_bound is None:
        return None
    return a * (alpha * sums) + beta * c_bound


def matmul_value_bound(node, bound, stats) -> float | None:
    """A constant 2-D B: |y| <= |a| * max_j sum_k |B_kj|."""
    a, w = bound(node.inputs[0]), node.inputs[1]
    data = stats.data(w)
    if a is None or data is None or data.ndim != 2:
        return None
    return a * stats.largest_sum(w, 0)


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Det", (11, 22), {"numpy": det_numpy}, differentiable=False),
        OpDef("Gemm", (1, 6, 7, 9, 11, 13), {"numpy": compute_wide(gemm_numpy)}, layout=MATMUL,
              differentiable=True, gradient=gemm_vjp, param_inputs=(0, 1, 2),
              value_bounds=gemm_value_bound,
              traits=frozenset({LINEAR, BATCHNORM_FOLDS_INTO})),
        OpDef("MatMul", (1, 9, 13), {"numpy": compute_wide(matmul_numpy)}, layout=MATMUL,
              differentiable=True, gradient=matmul_vjp, param_inputs=(0, 1),
              value_bounds=matmul_value_bound, traits=frozenset({LINEAR})),
        OpDef("MatMulBias", (1,), {"numpy": matmul_bias_numpy}, domain=INTERNAL_DOMAIN,
              layout=MATMUL, doc="MatMul by a 2-D constant, then Add of a per-column bias "
              "(inference plans)"),
        OpDef("Einsum", (12, 28), {"numpy": compute_wide(einsum_numpy)}, differentiable=True,
              gradient=einsum_vjp, param_inputs="all"),
    ]
