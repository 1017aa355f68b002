"""Pad (constant, reflect, edge and wrap modes; negative pads crop) and its backward op
``ai.tr_onnx.PadGrad``. One plan serves both: ``pad_plan`` turns the pads into a crop of the
input, the interior of the output and, axis after axis, the border steps (fills, or slice
copies from inside); PadGrad runs the steps backwards, adding each border's gradient to its
source. The axis and gradient helpers are ops/tensor.py's.
"""

from __future__ import annotations

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..hookspecs import hookimpl
from ..opdef import OpDef
from .tensor import DATA_INPUT, _const_of, _ints, first_only, positive_axis


def _pad_source(t: int, n: int, mode: str) -> int:
    """Where position ``t`` (relative to the first input element) reads from, in [0, n)."""
    if mode == "edge":
        return min(max(t, 0), n - 1)
    if mode == "wrap":
        return t % n
    if n == 1:  # reflect
        return 0
    period = 2 * (n - 1)
    t %= period
    return period - t if t >= n else t


def _copy_runs(dst: list[int], src: list[int]) -> list[tuple[slice, slice]]:
    """Group ``out[dst[i]] = out[src[i]]`` into slice copies (source step +1, -1 or 0)."""
    runs: list[list[int]] = []  # [dst0, src0, step, length]
    for d, s in zip(dst, src):
        if runs:
            d0, s0, step, length = runs[-1]
            if d == d0 + length and (
                    (length == 1 and s - s0 in (-1, 0, 1)) or s == s0 + step * length):
                runs[-1] = [d0, s0, s - s0 if length == 1 else step, length + 1]
                continue
        runs.append([d, s, 0, 1])
    slices = []
    for d0, s0, step, length in runs:
        if step == 0:
            src_slice = slice(s0, s0 + 1)  # broadcast one element
        else:
            stop = s0 + step * length
            src_slice = slice(s0, stop if stop >= 0 else None, step)
        slices.append((slice(d0, d0 + length), src_slice))
    return slices


def pad_amounts(since_version: int, attrs, pads, axes, rank: int) -> tuple[list, list]:
    """Pad's per-axis (begin, end) amounts from the attribute (<11) or the pads/axes inputs."""
    if since_version < 11:
        pads = list(attrs["pads"] if "pads" in attrs else attrs["paddings"])
        axes = list(range(rank))
    else:
        pads = _ints(pads)
        axes = [positive_axis(a, rank) for a in _ints(axes)] if axes is not None \
            else list(range(rank))
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begin[a], end[a] = int(pads[i]), int(pads[i + len(axes)])
    return begin, end


def pad_plan(in_shape, begin, end, mode: str, error):
    """(crop of the input, interior of the output, border steps) for Pad and PadGrad.

    Negative pads crop the input; the rest pads around what remains. Axes are padded one
    after another; axis a's border is filled over the full extent of the axes before it
    (already padded) and the interior of the axes after it. A step is ``(region, fills,
    copies)``: ``fills`` (constant mode) are slices of the region to set, ``copies`` pairs
    ``(dst, src)`` of slices of the region (source step +1, -1 or 0 along the axis)."""
    rank = len(in_shape)
    crop = tuple(slice(max(-b, 0), n - max(-e, 0)) for b, e, n in zip(begin, end, in_shape))
    lo, hi = [max(b, 0) for b in begin], [max(e, 0) for e in end]
    kept = [s.stop - s.start for s in crop]
    interior = tuple(slice(lo[a], lo[a] + kept[a]) for a in range(rank))
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise error(f"unknown Pad mode {mode!r}")
    if mode != "constant" and any((lo[a] or hi[a]) and kept[a] == 0 for a in range(rank)):
        raise error(f"Pad mode {mode!r} cannot pad an empty axis")
    steps = []
    for a in range(rank):
        if not lo[a] and not hi[a]:
            continue
        region = tuple(slice(None) if b < a else interior[b] if b > a else slice(None)
                       for b in range(rank))
        border = list(range(lo[a])) + list(range(lo[a] + kept[a], lo[a] + kept[a] + hi[a]))
        head = (slice(None),) * a
        if mode == "constant":
            fills = [head + (slice(0, lo[a]),), head + (slice(lo[a] + kept[a], None),)]
            steps.append((region, fills, None))
        else:
            src = [lo[a] + _pad_source(j - lo[a], kept[a], mode) for j in border]
            copies = [(head + (d,), head + (s,)) for d, s in _copy_runs(border, src)]
            steps.append((region, None, copies))
    return crop, interior, steps


def pad_numpy(ctx):
    in_shape = ctx.inputs[0].shape
    begin, end = pad_amounts(ctx.since_version, ctx.attrs, ctx.const(1),
                             ctx.const(3) if ctx.has_input(3) else None, len(in_shape))
    # Before v11 the fill is an attribute; later it is input 2, read at run time (0 if absent).
    value = ctx.attrs["value"] if ctx.since_version < 11 else None
    crop, interior, steps = pad_plan(in_shape, begin, end, ctx.attrs["mode"], ctx.error)

    def run(ins, outs, ws):
        y = outs[0]
        np.copyto(y[interior], ins[0][crop])
        fill = value if value is not None else ins[2] if len(ins) > 2 and ins[2] is not None \
            else 0
        for region, fills, copies in steps:
            v = y[region]
            if fills is not None:
                for f in fills:
                    np.copyto(v[f], fill)
            else:
                for d, s in copies:
                    np.copyto(v[d], v[s])

    return run


# ---- backward op (domain ai.tr_onnx) and gradient rule -------------------------------------


def pad_grad_numpy(ctx):
    """Pad's forward steps run backwards: every border element copied from the interior
    adds its gradient back to its source, last axis first; what the forward cropped (negative
    pads) gets zero. Attrs: ``mode`` and ``pads`` (begin then end, one per axis)."""
    in_shape = ctx.outputs[0].shape
    rank = len(in_shape)
    pads = [int(p) for p in ctx.attrs["pads"]]
    crop, interior, steps = pad_plan(in_shape, pads[:rank], pads[rank:], ctx.attrs["mode"],
                                     ctx.error)
    acc = ctx.workspace(ctx.inputs[0].shape, ctx.inputs[0].dtype)  # gy must stay untouched
    cropped = any(s.start or s.stop != n for s, n in zip(crop, in_shape))

    def run(ins, outs, ws):
        g = ws[acc]
        np.copyto(g, ins[0])
        for region, _, copies in reversed(steps):
            if copies is None:  # a constant border: its gradient goes nowhere
                continue
            v = g[region]
            for d, s in reversed(copies):
                src, dst = v[s], v[d]
                if src.shape != dst.shape:  # one element broadcast (edge): a small temporary
                    dst = dst.sum(axis=len(d) - 1, keepdims=True)
                np.add(src, dst, out=src)
        if cropped:
            outs[0].fill(0)
        np.copyto(outs[0][crop], g[interior])

    return run


def pad_vjp(b, node, gys, needed):
    """constant: the interior of gy (Slice), zero-padded back over what negative pads cropped.
    reflect/edge/wrap: PadGrad adds each border's gradient back to its source."""
    x, gy = node.inputs[0], gys[0]
    const = _const_of(node)
    begin, end = pad_amounts(node.since_version, node.attrs, const(1), const(3), x.rank)
    mode = node.attrs["mode"]
    if mode != "constant":
        return first_only(node, b.op("PadGrad", [gy], {"mode": mode, "pads": begin + end},
                                 domain=INTERNAL_DOMAIN, like=x))
    crop = [(max(-p, 0), max(-q, 0)) for p, q in zip(begin, end)]
    kept = tuple(n - lo - hi for n, (lo, hi) in zip(x.shape, crop))
    starts = [max(p, 0) for p in begin]
    g = gy
    if tuple(gy.shape) != kept:
        ends = [s + k for s, k in zip(starts, kept)]
        g = b.op("Slice", [gy, b.ints(starts), b.ints(ends), b.ints(range(x.rank))],
                 shapes=[(kept, gy.dtype)])
    if kept != tuple(x.shape):
        g = b.op("Pad", [g, b.ints([lo for lo, _ in crop] + [hi for _, hi in crop])],
                 {"mode": "constant"}, like=x)
    return first_only(node, g)


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("Pad", (1, 2, 11, 13, 18, 19, 21, 23, 24, 25), {"numpy": pad_numpy},
              const_inputs=(1, 3), differentiable=True, gradient=pad_vjp,
              grad_inputs=DATA_INPUT),
        # backward-only op of the rule above
        OpDef("PadGrad", (1,), {"numpy": pad_grad_numpy}, domain=INTERNAL_DOMAIN,
              doc="gradient of Pad (any mode): border gradients added back to their sources"),
    ]
