"""cuda bindings of ``ops/random.py``: the training form ``ai.tr_onnx.RandomDraw`` (what the
train pass puts in place of RandomUniform, RandomNormal, their *Like forms and Bernoulli),
drawn on the device from NumPy's Philox stream (``kernels/random.cu``).

Uniforms and Bernoulli draws equal the numpy kernel's bit for bit. Normals do not: NumPy's
ziggurat takes a variable number of draws per value, so value i's place in the stream depends
on every value before it; the device draws the same distribution by Box-Muller from the same
stream instead (``kernels/random.cu``). NumPy's Bernoulli raises for p outside [0, 1]; a
captured step cannot raise, so there p > 1 draws 1 and p < 0 or NaN draws 0.

The public ops register a binding that refuses (``Unbound``): outside training their numpy
kernels count their own calls in host state (the counter of each draw), which a captured cuda
step replaying fixed launches cannot advance, and drawing the same numbers every run would
differ from numpy silently. Registered, they let a model that holds them be imported for
training on cuda, where the train pass replaces each by its RandomDraw.
"""

from __future__ import annotations

import math

import numpy as np

from ....domains import INTERNAL_DOMAIN
from ....hookspecs import hookimpl
from ....opdef import KernelDef
from ....ops.random import RANDOM_OPS
from ..bind import BindContext, Unbound, binding, f64, i64, need_compact
from ..sources import STORAGE, instantiate, kernel_source, widths

FLOAT_OUT = (*STORAGE, {"dt": "f64", "T": "double"})
"""The float types a draw writes: the storage types and float64."""
OUT_DT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}
BERNOULLI_OUT = ({"bytes": "1", "U": "char"}, *widths(2, 4, 8))
"""Bernoulli writes the bits of 0 or 1 in any type of 1, 2, 4 or 8 bytes; one byte as plain
``char``: bool, int8 and uint8 alike (``unsigned char`` is bool's in the kernels)."""

KERNELS = kernel_source(
    "random",
    instantiate("TR_RANDOM({T}, {dt})", ("tr_random_uniform_{dt}", "tr_random_normal_{dt}"),
                FLOAT_OUT),
    instantiate("TR_BERNOULLI({T}, {dt}, {U}, {bytes})", "tr_random_bernoulli_{dt}_b{bytes}",
                FLOAT_OUT, BERNOULLI_OUT))


def _float_dt(b: BindContext, v) -> str:
    name = np.dtype(b.t(v).dtype).name
    if name not in OUT_DT:
        raise Unbound(f"{v.name!r} is {name}; the draws write {', '.join(OUT_DT)}")
    return OUT_DT[name]


def bind_random_draw(b: BindContext, node) -> list:
    """RandomDraw(input?, step) -> y, the op of attribute ``op`` keyed by attribute ``key``."""
    a = node.attrs
    op, step, y = a["op"], node.inputs[-1], node.outputs[0]
    key = int(a["key"]) % 2**64
    key = key - 2**64 if key >= 2**63 else key  # the kernel's long long
    if b.t(step).dtype != np.int64 or math.prod(b.t(step).shape) != 1:
        raise Unbound(f"the step {step.name!r} must be an int64 scalar")
    need_compact(b, y)
    n = math.prod(b.t(y).shape)
    head = [b.buf(y, True), i64(n), b.buf(step), i64(key)]
    if op in ("RandomUniform", "RandomUniformLike"):
        low, high = float(a.get("low", 0.0)), float(a.get("high", 1.0))
        return [b.launch(f"tr_random_uniform_{_float_dt(b, y)}", -(-n // 4),
                         head + [f64(low), f64(high - low)])]
    if op in ("RandomNormal", "RandomNormalLike"):
        return [b.launch(f"tr_random_normal_{_float_dt(b, y)}", -(-n // 4),
                         head + [f64(a.get("mean", 0.0)), f64(a.get("scale", 1.0))])]
    if op != "Bernoulli":
        raise Unbound(f"RandomDraw of {op!r}")
    p = node.inputs[0]
    need_compact(b, p)
    ty = b.t(y).dtype
    if ty.itemsize not in (1, 2, 4, 8) or math.prod(b.t(p).shape) != n:
        raise Unbound(f"Bernoulli of {list(b.t(p).shape)} into {ty} {list(b.t(y).shape)}")
    one = int(np.ones(1, ty).view(f"u{ty.itemsize}")[0])
    return [b.launch(f"tr_random_bernoulli_{_float_dt(b, p)}_b{ty.itemsize}", -(-n // 4),
                     [b.buf(p)] + head + [i64(one)])]


def bind_public_random(b: BindContext, node) -> list:
    """RandomUniform, RandomNormal, their *Like forms and Bernoulli outside training."""
    raise Unbound("outside training the draws are counted per call in host state, which a "
                  "replayed cuda step cannot advance; train the model (the step counts its "
                  "draws) or run it with backend='numpy'")


@hookimpl
def tr_onnx_op_definitions():
    return [KernelDef(op, "cuda", binding(bind_public_random)) for op in RANDOM_OPS] + [
        KernelDef("RandomDraw", "cuda", binding(bind_random_draw), domain=INTERNAL_DOMAIN)]
