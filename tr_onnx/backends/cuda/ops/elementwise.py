"""cuda bindings of ``ops/elementwise.py``: broadcasting arithmetic (Add/Sub/Mul/Div, Pow, Mod,
PRelu, variadic Sum/Mean/Max/Min), comparisons, logic and bitwise ops, Where, Cast/CastLike,
Identity and Dropout, inference and training (``kernels/elementwise.cu``); ``Not`` and
``BitwiseNot`` (ops/unary.py's, but integer kernels of this family) too.

Operands are indexed by the output's elements through specs (``bind.operand_spec``): the same
layout, a scalar, a trailing broadcast, or a change between compact and padded channels-last.
Add/Sub/Mul/Div/Sum and Greater/Less/Equal take those fast kernels where the specs express the
node; every other form, and every other op, takes the strided kernel of its kind
(``tr_bcast_binary`` for floats, ``tr_bcast_compare``, ``tr_bcast_int`` for integers and
bools), one per storage type that switches on an op code: each operand and the output are
walked through the element strides of their logical axes (``bind.logical_strides``, 0 on a
broadcast axis), so any mix of compact and channels-last padded layouts broadcasts (squeeze-
excite's [N,C,1,1] gate, a per-channel [C,1,1] scale, a per-sample [N,1,1,1] mask). Padded
output lanes must stay zero: the strided kernels never write them, and where a kernel could
write non-zero there (a scalar operand, a division, a kernel that writes pads), a
``tr_zero_lanes`` launch follows.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.dropout import check_inference_dropout, dropout_scale
from ..bind import (
    DT,
    TO_PADDED,
    BindContext,
    Unbound,
    binding,
    collapse,
    copy_of,
    f32,
    f64,
    float_dt,
    geometry,
    i32,
    i64,
    keeps_pads_zero,
    logical_strides,
    move_kernel,
    need_compact,
    operand_spec,
    operand_specs,
    out_geometry,
    same_layout,
)
from ..sources import (
    DTYPES,
    STORAGE,
    KernelSource,
    instantiate,
    kernel_source,
    storage_pairs,
    values,
    widths,
)

# ---- kernels/elementwise.cu: the family's name table --------------------------------------------

BINARY_OPS = ("add", "sub", "mul", "div")
"""Kernel stems of ``tr_<op>_<dt>`` and ``tr_<op>_mixed_<dt>``."""

COMPARE_OPS = {"greater": ">", "less": "<", "equal": "=="}
"""Kernel stem of ``tr_<op>_<dt>`` -> the C comparison it makes."""

CONVERT_PAIRS = (("f32", "f16"), ("f32", "bf16"), ("f16", "f32"), ("bf16", "f32"))
"""(source, destination) storage of the Cast kernels ``tr_convert_<src>_<dst>`` between float
storage types (the precision plans' casts)."""

INT_TYPES = {"bool": ("unsigned char", "unsigned char"), "i8": ("signed char", "unsigned char"),
             "u8": ("tr_u8", "unsigned char"),
             "i16": ("short", "unsigned short"), "u16": ("unsigned short", "unsigned short"),
             "i32": ("int", "unsigned int"), "u32": ("unsigned int", "unsigned int"),
             "i64": ("long long", "unsigned long long"),
             "u64": ("unsigned long long", "unsigned long long")}
"""Integer kernel suffix -> (C type, the unsigned type its arithmetic wraps through); bool is
one byte, 0 or 1, as NumPy stores it (``unsigned char``, the type the other families' bool
kernels take), uint8 the same byte under its own name (``tr_u8``)."""

INT_DT = {"int8": "i8", "uint8": "u8", "bool": "bool", "int16": "i16", "uint16": "u16",
          "int32": "i32", "uint32": "u32", "int64": "i64", "uint64": "u64"}
"""NumPy dtype name -> integer kernel suffix."""

CAST_TYPES = {**DTYPES, "i32": "int", "i64": "long long", "bool": "unsigned char"}
CAST_DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
           "int64": "i64", "bool": "bool"}
CAST_PAIRS = tuple((s, d) for s in CAST_TYPES for d in CAST_TYPES
                   if s != d and not (s in DTYPES and d in DTYPES))
"""The casts real exports make with an integer or bool side (masks: Cast(bool or int64 ->
float), index arithmetic: int64 <-> int32, float -> bool), ``tr_convert_<src>_<dst>`` too;
the float <-> float ones among fp16 and bf16 go through f32 and are not bound directly."""

BCAST_FLOAT = {"Add": 0, "Sum": 0, "Sub": 1, "Mul": 2, "Div": 3, "Pow": 4, "Max": 5, "Min": 6,
               "Mod": 7, "PRelu": 9, "Mean": 0}
"""ONNX op -> ``tr_bcast_binary``'s op code (kernels/elementwise.cu ``tr_binop``); Mod is 7
(fmod=1) or 8 (np.remainder), Mean's last input 10 ((acc + x) / count)."""
REMAINDER, MEAN_LAST, COPY = 8, 10, 5

BCAST_INT = {"Add": 0, "Sum": 0, "Sub": 1, "Mul": 2, "Div": 3, "Mod": 5, "Max": 6, "Min": 7,
             "And": 8, "Or": 9, "Xor": 10, "BitwiseAnd": 8, "BitwiseOr": 9, "BitwiseXor": 10,
             "BitShift": 11}
"""ONNX op -> ``tr_bcast_int``'s op code (``tr_intop``); Mod with fmod=1 is 4, BitShift RIGHT
12."""
INT_FMOD, SHIFT_RIGHT = 4, 12
LOGIC = ("And", "Or", "Xor")  # bool operands only

COMPARE_CODES = {"Greater": 0, "Less": 1, "Equal": 2, "GreaterOrEqual": 3, "LessOrEqual": 4}
"""ONNX op -> ``tr_bcast_compare``'s op code (``tr_cmpop``)."""

FLOAT_TESTS = {"IsNaN": 0, "IsInf": 1}
"""ONNX op -> ``tr_float_test``'s op code (IsInf: 1, 2 or 3 by its detections, 4 neither)."""


def elementwise_source() -> KernelSource:
    """kernels/elementwise.cu: binary ops by period, by operand spec (mixed layouts) and by
    strides (general broadcasting, floats, comparisons, integers), Greater/Less/Equal, Where,
    Cast, the integer unary ops and the float predicates."""
    ops = values("op", BINARY_OPS)
    compares = tuple({"op": op, "cmp": cmp} for op, cmp in COMPARE_OPS.items())
    ints = tuple({"t": t, "T": c, "U": u} for t, (c, u) in INT_TYPES.items())
    casts = tuple({"sdt": a, "S": CAST_TYPES[a], "ddt": d, "D": CAST_TYPES[d]}
                  for a, d in CAST_PAIRS)
    return kernel_source(
        "elementwise",
        instantiate("TR_BINARY({op}, {T}, {dt})", "tr_{op}_{dt}", ops, STORAGE),
        instantiate("TR_MIXED_BINARY({op}, {T}, {dt})", "tr_{op}_mixed_{dt}", ops, STORAGE),
        instantiate("TR_COMPARE({op}, {cmp}, {T}, {dt})", "tr_{op}_{dt}", compares, STORAGE),
        instantiate("TR_WHERE({T}, {dt})", "tr_where_{dt}", STORAGE),
        instantiate("TR_BCAST_BINARY({T}, {dt})", "tr_bcast_binary_{dt}", STORAGE),
        instantiate("TR_BCAST_COMPARE({T}, {dt})", "tr_bcast_compare_{dt}", STORAGE),
        instantiate("TR_BCAST_COMPARE({T}, {t})", "tr_bcast_compare_{t}", ints),
        instantiate("TR_BCAST_INT({T}, {U}, {t})", "tr_bcast_int_{t}", ints),
        instantiate("TR_BCAST_WHERE({U}, {bytes})", "tr_bcast_where_b{bytes}",
                    widths(1, 2, 4, 8)),
        instantiate("TR_INT_UNARY({T}, {t})", "tr_int_unary_{t}", ints),
        instantiate("TR_FLOAT_TEST({T}, {dt})", "tr_float_test_{dt}", STORAGE),
        instantiate("TR_CONVERT({S}, {sdt}, {D}, {ddt})", "tr_convert_{sdt}_{ddt}",
                    storage_pairs(CONVERT_PAIRS)),
        instantiate("TR_CAST({S}, {sdt}, {D}, {ddt})", "tr_convert_{sdt}_{ddt}", casts),
        instantiate("TR_DROPOUT({T}, {dt})", "tr_dropout_{dt}", STORAGE))


KERNELS = elementwise_source()


BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Sum": "add"}
COMPARE = {"Greater": "greater", "Less": "less", "Equal": "equal"}


def bind_binary_specs(b: BindContext, node) -> list:
    """Add/Sub/Mul/Div/Sum through operand specs (a Sum of more inputs: y = y + next)."""
    op = BINARY[node.op_type]
    ins = [v for v in node.inputs if v is not None]
    if len(ins) < 2:
        raise Unbound("a one-input Sum is a copy; the fan-in sums have a binding")
    y = node.outputs[0]
    dt = b.dt(y)
    for v in ins:
        if b.dt(v) != dt:
            raise Unbound(f"mixed dtypes ({b.t(v).dtype} and {b.t(y).dtype})")
    out = out_geometry(b, y)
    calls = []
    acc = ins[0]
    for other in ins[1:]:
        specs, (m, c, s, cp) = operand_specs(b, [acc, other], out)
        a_buf, b_buf, y_buf = b.buf(acc), b.buf(other), b.buf(y, True)
        if all(isinstance(p, int) and p > 0 for p in specs):
            calls.append(b.launch(f"tr_{op}_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, i64(out.n), i64(specs[0]),
                                   i64(specs[1])]))
        else:
            calls.append(b.launch(f"tr_{op}_mixed_{dt}", out.n,
                                  [a_buf, b_buf, y_buf, i64(out.n), i64(specs[0]),
                                   i64(specs[1]), i64(m), i64(c), i64(s), i64(cp)]))
        acc = y
        if out.padded and not (op != "div" and keeps_pads_zero(specs, out)):
            calls.append(b.zero_lanes(y, out))
    return calls


def check_numpy_broadcasting(node) -> None:
    """Before opset 7, ``broadcast=1, axis`` (and PRelu's per-channel 1-D slope) aligned the
    second operand from an axis rather than from the end. Import converts such models to
    opset 7 (the version converter rewrites the operand); a node still in that form is
    refused rather than broadcast the numpy way."""
    if node.since_version < 7 and len(node.inputs) > 1 and (
            node.attrs.get("broadcast") or node.op_type == "PRelu"):
        raise Unbound(f"{node.op_type}-{node.since_version} broadcasts from an axis (opset < 7)")


def broadcast_walk(b: BindContext, node, operands, y) -> tuple[int, list]:
    """(n, the strided kernels' dims and stride arguments) for ``y = f(*operands)`` (an
    operand may be ``y`` itself, read back by a fold): the output's logical axes, ordered by
    its own strides (so consecutive threads write consecutive elements), each operand's
    element strides along them (0 on a broadcast axis), collapsed (``bind.collapse``) to
    ``MAX_DIMS`` axes."""
    out = tuple(b.t(y).shape)
    rank = len(out)
    sets = []
    check_numpy_broadcasting(node)
    for v in operands:
        shape, strides = tuple(b.t(v).shape), logical_strides(b, v)
        if len(shape) > rank:
            raise Unbound(f"operand {v.name!r} {list(shape)} has more axes than the output")
        lead = rank - len(shape)
        shape, strides = (1,) * lead + shape, [0] * lead + strides
        for i in range(rank):
            if shape[i] != out[i] and shape[i] != 1:
                raise Unbound(f"operand {v.name!r} {list(v.shape)} does not broadcast to "
                              f"{list(out)}")
        sets.append([0 if shape[i] == 1 and out[i] != 1 else strides[i] for i in range(rank)])
    ys = logical_strides(b, y)
    order = sorted(range(rank), key=lambda i: -ys[i])
    dims, walked = collapse([out[i] for i in order],
                            [[st[i] for i in order] for st in sets + [ys]])
    return math.prod(out), [i64(v) for v in dims + [x for st in walked for x in st]]


def pads_zeroed(b: BindContext, y) -> list:
    """The ``tr_zero_lanes`` launch after a strided kernel (it writes logical elements only)."""
    g = geometry(b.t(y))
    return [b.zero_lanes(y, g)] if g is not None and g.padded else []


def operands_of(b: BindContext, node, dtype_of_output: bool = True) -> tuple[list, object]:
    ins = [v for v in node.inputs if v is not None]
    y = node.outputs[0]
    want = b.t(y).dtype if dtype_of_output else b.t(ins[0]).dtype
    for v in ins:
        if b.t(v).dtype != want:
            raise Unbound(f"mixed dtypes ({b.t(v).dtype} and {want}): the kernels take "
                          "operands of one type")
    return ins, y


def int_dt(b: BindContext, v, what: str) -> str:
    name = np.dtype(b.t(v).dtype).name
    if name not in INT_DT:
        raise Unbound(f"{what} {v.name!r} has dtype {name}")
    return INT_DT[name]


def fold_strided(b: BindContext, node, kernel: str, codes: list[int], scalars=()) -> list:
    """y = op_k(... op_1(op_0(x0, x1), x2) ..., x_k+1) through ``kernel``, one launch per
    input after the first, the later ones reading y; one input is a copy (op ``codes[0]``
    applied to x0 and x0: max(x, x) = x, bit for bit). Then the padded lanes zeroed."""
    ins = [v for v in node.inputs if v is not None]
    y = node.outputs[0]
    pairs = list(zip([ins[0]] + [y] * (len(ins) - 2), ins[1:])) or [(ins[0], ins[0])]
    calls = []
    for (acc, other), code, extra in zip(pairs, codes, scalars or [()] * len(pairs)):
        n, walk = broadcast_walk(b, node, [acc, other], y)
        if n:
            calls.append(b.launch(kernel, n, [b.buf(acc), b.buf(other), b.buf(y, True), i64(n),
                                              i32(code), *extra] + walk))
    return calls + pads_zeroed(b, y)


def bind_strided_float(b: BindContext, node) -> list:
    """A float op of ``BCAST_FLOAT`` through ``tr_bcast_binary`` (any layouts, any
    broadcast); variadic ones fold input by input, Mean's last launch divides by the count."""
    ins, y = operands_of(b, node)
    dt = b.dt(y)
    op = node.op_type
    k = len(ins) - 1 or 1
    codes = [BCAST_FLOAT[op]] * k
    if op == "Mod" and not int(node.attrs.get("fmod", 0)):
        codes = [REMAINDER]
    if len(ins) == 1:
        codes = [COPY]
    elif op == "Mean":
        codes[-1] = MEAN_LAST
    count = f32(len(ins))
    return fold_strided(b, node, f"tr_bcast_binary_{dt}", codes, [(count,)] * k)


def bind_strided_int(b: BindContext, node) -> list:
    """An integer or bool op of ``BCAST_INT`` through ``tr_bcast_int``: And/Or/Xor on bool,
    the bitwise ops and BitShift on their integers, arithmetic on int32/int64 (attention
    masks, index math)."""
    ins, y = operands_of(b, node)
    op = node.op_type
    is_bool = b.t(y).dtype == np.bool_
    if (op in LOGIC) != is_bool:
        raise Unbound(f"{op} of {b.t(y).dtype} operands")
    code = BCAST_INT[op]
    if op == "Mod" and int(node.attrs.get("fmod", 0)):
        code = INT_FMOD
    if op == "BitShift" and node.attrs.get("direction") in ("RIGHT", b"RIGHT"):
        code = SHIFT_RIGHT
    if len(ins) == 1:
        code = BCAST_INT["Max"]
    return fold_strided(b, node, f"tr_bcast_int_{int_dt(b, y, 'output')}",
                        [code] * max(len(ins) - 1, 1))


def bind_binary(b: BindContext, node) -> list:
    """Add/Sub/Mul/Div/Sum through operand specs (``bind_binary_specs``) where they express the
    node, else the strided kernels; Pow, Max, Min, Mean, Mod, PRelu, the logic and bitwise
    ops always through those."""
    check_numpy_broadcasting(node)
    ins = [v for v in node.inputs if v is not None]
    y = node.outputs[0]
    if np.dtype(b.t(y).dtype).name in DT:
        if node.op_type in BINARY and len(ins) > 1:
            try:
                return bind_binary_specs(b, node)
            except Unbound:
                pass
        if node.op_type not in BCAST_FLOAT:
            raise Unbound(f"{node.op_type} of {b.t(y).dtype} operands")
        return bind_strided_float(b, node)
    if node.op_type not in BCAST_INT:
        raise Unbound(f"{node.op_type} of {b.t(y).dtype} operands: the kernels take "
                      f"{', '.join(DT)}")
    return bind_strided_int(b, node)


def bind_compare(b: BindContext, node) -> list:
    """Greater / Less / Equal / GreaterOrEqual / LessOrEqual into a bool (one byte) output:
    float operands in layouts the specs express take ``tr_<op>_<dt>``; any other broadcast,
    layout mix or type (int32/int64/bool: attention masks compare integers) the strided
    ``tr_bcast_compare``, comparing integers as integers."""
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if b.t(a).dtype != b.t(c).dtype or b.t(y).dtype != np.bool_:
        raise Unbound("operands of different dtypes")
    name = np.dtype(b.t(a).dtype).name
    if node.op_type in COMPARE and name in DT:
        try:
            return bind_compare_specs(b, node)
        except Unbound:
            pass
    t = DT.get(name) or int_dt(b, a, "operand")
    n, walk = broadcast_walk(b, node, [a, c], y)
    calls = [b.launch(f"tr_bcast_compare_{t}", n, [
        b.buf(a), b.buf(c), b.buf(y, True), i64(n), i32(COMPARE_CODES[node.op_type])] + walk)]
    return (calls if n else []) + pads_zeroed(b, y)


def bind_compare_specs(b: BindContext, node) -> list:
    a, c, y = node.inputs[0], node.inputs[1], node.outputs[0]
    dt = b.dt(a)
    out = out_geometry(b, y)
    specs, (m, ch, s, cp) = operand_specs(b, [a, c], out)
    calls = [b.launch(f"tr_{COMPARE[node.op_type]}_{dt}", out.n,
                      [b.buf(a), b.buf(c), b.buf(y, True), i64(out.n), i64(specs[0]),
                       i64(specs[1]), i64(m), i64(ch), i64(s), i64(cp)])]
    if out.padded and not keeps_pads_zero(specs, out):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_where(b: BindContext, node) -> list:
    """Where through operand specs (``tr_where_<dt>``) where they express it, else the strided
    ``tr_bcast_where`` on bit patterns (any dtype, any broadcast: masks)."""
    try:
        return bind_where_specs(b, node)
    except Unbound:
        pass
    cond, a, c = node.inputs[:3]
    y = node.outputs[0]
    if b.t(cond).dtype != np.bool_ or not b.t(a).dtype == b.t(c).dtype == b.t(y).dtype:
        raise Unbound("Where needs a bool condition and two operands of the output's dtype")
    n, walk = broadcast_walk(b, node, [cond, a, c], y)
    calls = [b.launch(f"tr_bcast_where_{move_kernel(b, y)}", n, [
        b.buf(cond), b.buf(a), b.buf(c), b.buf(y, True), i64(n)] + walk)]
    return (calls if n else []) + pads_zeroed(b, y)


def bind_where_specs(b: BindContext, node) -> list:
    cond, a, c = node.inputs[:3]
    y = node.outputs[0]
    dt = b.dt(y)
    if b.t(cond).dtype != np.bool_ or b.dt(a) != dt or b.dt(c) != dt:
        raise Unbound("Where needs a bool condition and two operands of the output's dtype")
    out = out_geometry(b, y)
    specs, (m, ch, s, cp) = operand_specs(b, [cond, a, c], out)
    calls = [b.launch(f"tr_where_{dt}", out.n,
                      [b.buf(cond), b.buf(a), b.buf(c), b.buf(y, True), i64(out.n)]
                      + [i64(p) for p in specs] + [i64(m), i64(ch), i64(s), i64(cp)])]
    # a padded lane reads cond = false (pads of a same-layout cond are zero), so it takes c
    zero_c = specs[2] == 1 and c.data is not None and not np.asarray(c.data).reshape(
        -1).view(np.uint8).any()
    if out.padded and not (specs[0] != 1 and (zero_c or specs[2] in (out.n, TO_PADDED))):
        calls.append(b.zero_lanes(y, out))
    return calls


def bind_cast(b: BindContext, node) -> list:
    """Cast / CastLike in one layout: between float storage types (the float16 copy of a float32
    BatchNorm parameter gradient in a half-precision plan, the loss region's casts), and the
    casts with an integer or bool side (``CAST_PAIRS``: masks, index arithmetic). A cast to
    its own type is a copy. Padded lanes stay zero (a zero casts to zero)."""
    x, y = node.inputs[0], node.outputs[0]
    names = (np.dtype(b.t(x).dtype).name, np.dtype(b.t(y).dtype).name)
    gy = out_geometry(b, y)
    if operand_spec(b.t(x), geometry(b.t(x)), gy) != gy.n:
        raise Unbound("input and output in different layouts")
    if names[0] == names[1]:
        return [copy_of(b, x, y)]
    pair = tuple(CAST_DT.get(n) for n in names)
    if pair not in CONVERT_PAIRS + CAST_PAIRS:
        raise Unbound(f"Cast {names[0]} -> {names[1]}: the conversion kernels are "
                      f"{', '.join(f'{s}->{d}' for s, d in CONVERT_PAIRS + CAST_PAIRS)}")
    return [b.launch(f"tr_convert_{pair[0]}_{pair[1]}", gy.n,
                     [b.buf(x), b.buf(y, True), i64(gy.n)])]


def bind_int_unary(b: BindContext, node) -> list:
    """Not (bool) and BitwiseNot (integers) in one layout; both make pads non-zero, which a
    ``tr_zero_lanes`` launch clears."""
    x, y = node.inputs[0], node.outputs[0]
    is_bool = b.t(x).dtype == np.bool_
    if (node.op_type == "Not") != is_bool or b.t(y).dtype != b.t(x).dtype:
        raise Unbound(f"{node.op_type} of {b.t(x).dtype}")
    g = same_layout(b, x, y)
    calls = [b.launch(f"tr_int_unary_{int_dt(b, x, 'input')}", g.n, [
        b.buf(x), b.buf(y, True), i64(g.n), i32(0 if is_bool else 1)])]
    return calls + ([b.zero_lanes(y, g)] if g.padded else [])


def bind_float_test(b: BindContext, node) -> list:
    """IsNaN / IsInf (detect_positive, detect_negative) of a float tensor into bool, in one
    layout (a zero pad lane tests false)."""
    x, y = node.inputs[0], node.outputs[0]
    g = same_layout(b, x, y)
    code = FLOAT_TESTS[node.op_type]
    if node.op_type == "IsInf":
        pos = int(node.attrs.get("detect_positive", 1))
        neg = int(node.attrs.get("detect_negative", 1))
        code = {(1, 1): 1, (1, 0): 2, (0, 1): 3, (0, 0): 4}[(bool(pos), bool(neg))]
    return [b.launch(f"tr_float_test_{b.dt(x)}", g.n, [
        b.buf(x), b.buf(y, True), i64(g.n), i32(code)])]


def bind_copy(b: BindContext, node) -> list:
    """Identity (and the reshaping ops of ``ops/tensor.py``) where the output could not alias
    its input: a device copy when the bytes are the same."""
    x, y = node.inputs[0], node.outputs[0]
    tx, ty = b.t(x), b.t(y)
    if not (tx.layout.is_plain and ty.layout.is_plain) or tx.dtype != ty.dtype:
        raise Unbound(f"a copy from {tx.layout.describe()} to {ty.layout.describe()}")
    return [copy_of(b, x, y)]


def _dropout(b: BindContext, x, y, mask, step, rows_before, seed: int, ratio: float,
             scale: float) -> list:
    """``tr_dropout_<dt>`` over compact x, y and mask (one launch per Philox block of 4)."""
    need_compact(b, x, y, mask)
    if b.t(mask).dtype != np.bool_:
        raise Unbound(f"the mask {mask.name!r} must be bool")
    for v in (step, rows_before):
        if v is not None and (b.t(v).dtype != np.int64 or math.prod(b.t(v).shape) != 1):
            raise Unbound(f"{v.name!r} must be an int64 scalar")
    n = math.prod(b.t(x).shape)
    per_row = n // b.t(x).shape[0] if rows_before is not None else 0
    seed = seed % 2**64
    return [b.launch(f"tr_dropout_{float_dt(b, x, y)}", -(-n // 4) + 1, [
        b.buf(x), b.buf(y, True), b.buf(mask, True), i64(n), b.buf(step), b.buf(rows_before),
        i64(per_row), i64(seed - 2**64 if seed >= 2**63 else seed), f64(ratio), f32(scale)])]


def dropout_training_factory(ctx):
    """DropoutTraining(x, step[, rows_before]): the numpy kernel's masks bit for bit (NumPy's
    Philox, drawn on the device), y = (x * mask) * scale in x's storage."""
    ratio = float(ctx.attrs.get("ratio", 0.5))
    scale = float(dropout_scale(ratio))

    def bind(b: BindContext, node) -> list:
        x, step = node.inputs[:2]
        rows_before = node.inputs[2] if len(node.inputs) > 2 else None
        return _dropout(b, x, node.outputs[0], node.outputs[1], step, rows_before,
                        int(node.attrs["seed"]), ratio, scale)

    return bind


def dropout_inference_factory(ctx):
    """Inference Dropout (``ops.dropout.check_inference_dropout`` refuses a training-mode
    one): y = x, the optional mask all ones."""
    check_inference_dropout(ctx)

    def bind(b: BindContext, node) -> list:
        x, y = node.inputs[0], node.outputs[0]
        mask = node.outputs[1] if len(node.outputs) > 1 else None
        if mask is None:
            return bind_copy(b, node)
        return _dropout(b, x, y, mask, None, None, 0, 0.0, 1.0)

    return bind


@hookimpl
def tr_onnx_op_definitions():
    binary = sorted(set(BCAST_FLOAT) | set(BCAST_INT))
    return ([KernelDef(op, "cuda", binding(bind_binary)) for op in binary]
            + [KernelDef(op, "cuda", binding(bind_compare)) for op in COMPARE_CODES]
            + [KernelDef(op, "cuda", binding(bind_float_test)) for op in FLOAT_TESTS]
            + [KernelDef(op, "cuda", binding(bind_int_unary)) for op in ("Not", "BitwiseNot")]
            + [KernelDef("Where", "cuda", binding(bind_where)),
               KernelDef("Cast", "cuda", binding(bind_cast)),
               KernelDef("CastLike", "cuda", binding(bind_cast)),
               KernelDef("Identity", "cuda", binding(bind_copy)),
               KernelDef("Dropout", "cuda", dropout_inference_factory),
               KernelDef("DropoutTraining", "cuda", dropout_training_factory,
                         domain=INTERNAL_DOMAIN)])
