"""cuda bindings of ``ops/matmul.py``: Gemm and MatMul as cuDNN matmul graphs (bias fused as the
epilogue; ``describe_matmul``), MatMul that no graph describes (rank > 3, batch dims broadcast)
on the batched kernel of ``kernels/matmul.cu``, and Einsum (forward, and the Einsums its
gradient emits) on that file's strided contraction kernel. MatMulBias (an inference plan's
MatMul + Add fold) is Gemm's graph with the bias epilogue, or the batched kernel and a broadcast
add."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....layouts import compact_strides
from ....memory import DTensor, MemoryPlan
from ....opdef import KernelContext, KernelDef
from ....ops.matmul import einsum_terms
from ..bind import (
    BindContext,
    Unbound,
    binding,
    collapse,
    cudnn_workspace,
    f32,
    float_dt,
    i32,
    i64,
    logical_strides,
    need_compact,
)
from ..cudnn_graphs import (
    CudnnGraph,
    CudnnGraphError,
    GraphDesc,
    PlanIndex,
    TensorDesc,
    element_strides,
    one_data_type,
    strided_dims,
)
from ..sources import STORAGE, KernelSource, instantiate, kernel_source
from .elementwise import BCAST_FLOAT

# ---- kernels/matmul.cu: the family's name table -------------------------------------------------

def matmul_source() -> KernelSource:
    """kernels/matmul.cu: the batched MatMul where no cuDNN matmul graph is bound, and
    Einsum."""
    return kernel_source("matmul", instantiate("TR_MATMUL({T}, {dt})", "tr_matmul_{dt}", STORAGE),
                         instantiate("TR_EINSUM({T}, {dt})", "tr_einsum_{dt}", STORAGE))


KERNELS = matmul_source()


# ---- cuDNN graphs: matmul ----------------------------------------------------------------------

def _matrix(index: PlanIndex, t: DTensor, port: str, trans: bool, label: str) -> TensorDesc:
    """A rank-2 or rank-3 tensor as cuDNN's ``[batch, rows, cols]`` (transposed by strides)."""
    dims, strides = list(strided_dims(t, True)), list(element_strides(t))
    if len(dims) == 2:
        dims, strides = [1] + dims, [dims[0] * strides[0]] + strides
    if len(dims) != 3:
        raise CudnnGraphError(f"{label}: {port} {t.name!r} has rank {len(t.shape)}; cuDNN "
                              "matmul graphs here take rank 2 or 3")
    if trans:
        dims[1], dims[2], strides[1], strides[2] = dims[2], dims[1], strides[2], strides[1]
    return index.tensor(t, port, dims, strides, label)


def describe_matmul(node, plan: MemoryPlan, workspace: tuple[int, int]) -> GraphDesc:
    """Gemm (alpha = 1, beta = 1 or no C) and MatMul of rank 2/3: ``Y = A @ B (+ C)``."""
    index = PlanIndex(plan)
    t = plan.tensors
    a, b = t[node.inputs[0].name], t[node.inputs[1].name]
    y = t[node.outputs[0].name]
    trans_a = trans_b = False
    c = None
    if node.op_type == "Gemm":
        trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
        has_c = len(node.inputs) > 2 and node.inputs[2] is not None
        if float(node.attrs.get("alpha", 1.0)) != 1.0 or (
                has_c and float(node.attrs.get("beta", 1.0)) != 1.0):
            raise CudnnGraphError(f"{node.label}: alpha != 1 or beta != 1 has no fused cuDNN "
                                  "matmul graph here (scale the inputs with a kernel)")
        c = t[node.inputs[2].name] if has_c else None
    ad = _matrix(index, a, "A", trans_a, node.label)
    bd = _matrix(index, b, "B", trans_b, node.label)
    yd = _matrix(index, y, "Y", False, node.label)
    if bd.dims[0] == 1 and ad.dims[0] > 1:
        # a B shared by every batch: declared with a batch stride of 0 (some engines reject an
        # implicitly broadcast batch dimension)
        bd = replace(bd, dims=(ad.dims[0], *bd.dims[1:]), strides=(0, *bd.strides[1:]))
    if ad.dims[2] != bd.dims[1] or (ad.dims[1], bd.dims[2]) != yd.dims[1:] or \
            bd.dims[0] != ad.dims[0] or yd.dims[0] != ad.dims[0]:
        raise CudnnGraphError(f"{node.label}: A {list(ad.dims)} @ B {list(bd.dims)} does not "
                              f"give Y {list(yd.dims)}")
    ins = {"A": ad, "B": bd}
    epilogue: tuple[str, ...] = ()
    if c is not None:
        if not c.layout.is_plain or len(c.shape) > 2:
            raise CudnnGraphError(f"{node.label}: C {c.name!r} must be a compact vector or "
                                  f"matrix, got {c.layout.describe()} {list(c.shape)}")
        dims = (1,) * (3 - len(c.shape)) + tuple(c.shape)
        strides = tuple(s // c.dtype.itemsize for s in compact_strides(dims, c.dtype.itemsize))
        ins["bias"] = index.tensor(c, "bias", dims, strides, node.label)
        epilogue = ("bias",)
    return one_data_type(GraphDesc("matmul", node.label, ad.data_type, ins, {"Y": yd},
                                   epilogue=epilogue, build=build_matmul))


def build_matmul(g, desc: GraphDesc, ins: dict, scalars: dict) -> dict:
    """The frontend calls of the ``matmul`` graph (the bias epilogue after it)."""
    y = g.matmul(ins["A"], ins["B"], name="matmul")
    if "bias" in desc.epilogue:
        y = g.bias(input=y, bias=ins["bias"], name="bias")
    return {"Y": y}


def batched_matmul(b: BindContext, node, why: str) -> list:
    """The batched kernel: batch dims equal, or one operand's all 1 (stride 0)."""
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    need_compact(b, a, c, y)
    sa, sc, sy = b.t(a).shape, b.t(c).shape, b.t(y).shape
    if len(sa) < 2 or len(sc) < 2:
        raise Unbound(f"{why}; the batched kernel takes operands of rank >= 2")
    M, K, N = sa[-2], sa[-1], sc[-1]
    batch = math.prod(sy[:-2])
    strides = []
    for shape in (sa, sc):
        lead = tuple(shape[:-2])
        full = (1,) * (len(sy) - 2 - len(lead)) + lead
        if math.prod(lead) == 1:
            strides.append(0)
        elif full == tuple(sy[:-2]):
            strides.append(shape[-2] * shape[-1])
        else:
            raise Unbound(f"{why}; batch dims {list(lead)} broadcast partly against "
                          f"{list(sy[:-2])}")
    dt = float_dt(b, a, c, y)
    return [b.launch(f"tr_matmul_{dt}", batch * M * N,
                     [b.buf(a), b.buf(c), b.buf(y, True), i64(batch), i64(M), i64(K), i64(N),
                      i64(strides[0]), i64(K), i64(1), i64(strides[1]), i64(N), i64(1)])]


def matmul_factory(ctx: KernelContext):
    """MatMul: a cuDNN graph where one describes the node, else the batched kernel."""
    k = cudnn_workspace(ctx)

    def bind(b: BindContext, node) -> list:
        try:
            return b.cudnn(node, k)
        except Unbound as e:
            return batched_matmul(b, node, str(e))

    return bind


EINSUM_OPERANDS = 4
"""Operands the contraction kernel reads: a two-operand Einsum's gradient has gy, the other
operand and at most two constants (a diagonal's identity, ones for a broadcast)."""


def bind_einsum(b: BindContext, node) -> list:
    """Every operand through its own strides over the output letters and over the summed ones
    (a repeated letter: the sum of its axes' strides; a size-1 axis against a longer one: 0);
    the output compact."""
    xs, y = list(node.inputs), node.outputs[0]
    if len(xs) > EINSUM_OPERANDS:
        raise Unbound(f"{len(xs)} operands; the contraction kernel reads {EINSUM_OPERANDS}")
    need_compact(b, y)
    shapes = [tuple(b.t(x).shape) for x in xs]
    spelled, out, _ = einsum_terms(node.attrs["equation"], shapes)
    sizes: dict[str, int] = {}
    for term, shape in zip(spelled, shapes):
        for c, n in zip(term, shape):
            if sizes.get(c, 1) == 1:  # a size-1 axis broadcasts; a 0 is a size too
                sizes[c] = int(n)
    summed = [c for c in dict.fromkeys("".join(spelled)) if c not in out]
    per_letter = []
    for term, shape, x in zip(spelled, shapes, xs):
        strides: dict[str, int] = {}
        for c, n, s in zip(term, shape, logical_strides(b, x)):
            strides[c] = strides.get(c, 0) + (s if n != 1 else 0)
        per_letter.append(strides)
    out_dims = [sizes[c] for c in out]
    if tuple(out_dims) != tuple(b.t(y).shape):
        raise Unbound(f"the equation gives {out_dims}, the output is {list(b.t(y).shape)}")
    # y is compact, so its offset is the output index however the dims collapse
    d, outs = collapse(out_dims, [[s.get(c, 0) for c in out] for s in per_letter])
    e, sums = collapse([sizes[c] for c in summed], [[s.get(c, 0) for c in summed]
                                                    for s in per_letter])
    n, m = math.prod(out_dims), math.prod(sizes[c] for c in summed)
    if n == 0:
        return []
    absent = EINSUM_OPERANDS - len(xs)
    operands = [b.buf(x) for x in xs] + [None] * absent
    strides = [v for o, s in zip(outs, sums) for v in (*o, *s)] + [0] * (12 * absent)
    return [b.launch(f"tr_einsum_{float_dt(b, *xs, y)}", n,
                     [*operands, b.buf(y, True), i64(n), i64(m)]
                     + [i64(v) for v in (*d, *e, *strides)])]


def describe_matmul_bias(node, plan, workspace: tuple[int, int]) -> GraphDesc:
    """MatMulBias(a, w, bias) is Gemm(a, w, bias) with alpha = beta = 1 and no transposes:
    Gemm's matmul graph with the bias epilogue (a of rank 2 or 3, w shared by the batch)."""
    gemm = copy.copy(node)
    gemm.domain, gemm.op_type, gemm.attrs = "", "Gemm", {}
    return describe_matmul(gemm, plan, workspace)


def matmul_bias_factory(ctx: KernelContext):
    """MatMulBias: the cuDNN graph where one describes the node, else the batched kernel and
    then y += bias over y's rows (the broadcasting add kernel)."""
    k = cudnn_workspace(ctx)

    def bind(b: BindContext, node) -> list:
        try:
            return b.cudnn(node, k)
        except Unbound as e:
            calls = batched_matmul(b, node, str(e))
        y, bias = node.outputs[0], node.inputs[2]
        need_compact(b, bias)
        n = math.prod(b.t(y).shape)
        cols = b.t(y).shape[-1]
        dims, strides = collapse([n // cols, cols], [[cols, 1], [0, 1], [cols, 1]])
        return calls + [b.launch(f"tr_bcast_binary_{float_dt(b, y, bias)}", n, [
            b.buf(y), b.buf(bias), b.buf(y, True), i64(n), i32(BCAST_FLOAT["Add"]), f32(0)]
            + [i64(v) for v in dims + [s for st in strides for s in st]])]

    return bind


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef("Gemm", "cuda", CudnnGraph(describe_matmul)),
            KernelDef("MatMul", "cuda", CudnnGraph(describe_matmul, binding=matmul_factory)),
            KernelDef("Einsum", "cuda", binding(bind_einsum)),
            KernelDef("MatMulBias", "cuda", CudnnGraph(describe_matmul_bias,
                                                       binding=matmul_bias_factory),
                      domain=INTERNAL_DOMAIN)]
