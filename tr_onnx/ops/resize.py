"""Resize and the legacy Upsample, with their backward op ResizeGrad.

Every mode ONNX defines is a separable linear map: along each resized axis, output position
``o`` is a weighted sum of a few input positions (nearest: one, linear: two, cubic: four,
antialias: as many as the downscaled kernel covers). ``axis_table`` computes those (index,
weight) tables once, at plan time, the way ``onnx.reference``'s Resize does (same source
coordinates, neighbour windows, edge clamping, ``exclude_outside`` renormalisation); the step
then runs gathers (``np.take``) and weighted sums into workspaces, one axis at a time.
tf_crop_and_resize's positions that fall outside the input take ``extrapolation_value`` (a mask
applied after the sums; the gradient does not flow from them).

The gradient is the transpose of that sparse map: ResizeGrad (domain ai.tr_onnx) builds the
same tables from the forward node's attributes and constant inputs, transposes them (each input
position then lists the output positions that read it and with which weight) and runs the same
gather-and-sum kernel. So nearest, linear, cubic and antialias all have their exact gradient.

Layout: the kernels read logical views and gather along the physical axis order of their input,
so a channels-last feature map stays channels-last (contiguous channels, no LayoutTranspose)
and padded channel lanes are never written.

Legacy semantics (Resize 10, Upsample 7/9/10): coordinates are ``asymmetric`` (``x / scale``)
and nearest rounds the way onnxruntime does for those opsets (down when upsampling, up when
downsampling); ``output = floor(input * scale)``. Upsample 1 (``height_scale``/``width_scale``)
needs no kernel: the importer converts models below opset 7 to opset 7 first. Upsample 10 is
registered as Upsample 9, though onnx.checker refuses it (deprecated at opset 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..dtypes import accumulator_dtype
from ..hookspecs import hookimpl
from ..layouts import StridedLayout
from ..opdef import OpDef
from .tensor import DATA_INPUT, first_only, positive_axis

CONST_INPUTS = (1, 2, 3)  # roi, scales, sizes (Upsample 9: scales): the plan specialises on them


# ---- geometry: what each axis becomes ------------------------------------------------------


@dataclass(frozen=True)
class ResizeSpec:
    """A Resize/Upsample node's semantics, normalised across versions."""

    mode: str  # nearest | linear | cubic
    coordinate_mode: str
    nearest_mode: str  # round_prefer_floor | round_prefer_ceil | floor | ceil | legacy
    cubic_coeff_a: float = -0.75
    exclude_outside: bool = False
    extrapolation_value: float = 0.0
    antialias: bool = False


@dataclass(frozen=True)
class AxisGeometry:
    """One axis of the data: its scale factor, sizes, and roi."""

    axis: int
    scale: float
    in_size: int
    out_size: int
    roi: tuple[float, float] | None  # tf_crop_and_resize's (start, end) along this axis


def _floats(a) -> list[float]:
    return [float(v) for v in np.asarray(a, np.float64).reshape(-1)]


def node_spec(op: str, version: int, attrs) -> ResizeSpec:
    """The ResizeSpec of a Resize (``op``) of ``version`` or an Upsample, from its attributes
    (schema defaults already filled in)."""
    mode = attrs.get("mode", "nearest")
    if mode == "bilinear":  # Upsample 1's name for it
        mode = "linear"
    if op == "Upsample" or version < 11:
        return ResizeSpec(mode, "asymmetric", "legacy")
    return ResizeSpec(mode, attrs["coordinate_transformation_mode"], attrs["nearest_mode"],
                      float(attrs["cubic_coeff_a"]), bool(attrs["exclude_outside"]),
                      float(attrs["extrapolation_value"]), bool(attrs.get("antialias", 0)))


def _given(a) -> np.ndarray | None:
    """An optional tensor input's value; an empty tensor counts as absent (Resize 11's way to
    leave out scales)."""
    return None if a is None or np.asarray(a).size == 0 else np.asarray(a)


def geometry(op: str, version: int, attrs, in_shape, roi, scales, sizes
             ) -> list[AxisGeometry]:
    """Scale, sizes and roi of every axis (the ones the node does not resize included), as
    ``onnx.reference`` derives them. Raises ValueError for inconsistent inputs."""
    rank = len(in_shape)
    if op == "Upsample" and version == 7:
        scales = np.asarray(attrs["scales"], np.float64)
    roi, scales, sizes = _given(roi), _given(scales), _given(sizes)
    axes = [positive_axis(int(a), rank) for a in attrs.get("axes") or range(rank)]
    n = len(axes)
    scale = [1.0] * rank
    out = [int(d) for d in in_shape]
    if scales is not None:
        if scales.size != n:
            raise ValueError(f"{scales.size} scales for {n} axes")
        for a, s in zip(axes, _floats(scales)):
            if s <= 0:
                raise ValueError(f"scale {s} along axis {a} is not positive")
            scale[a] = s
            out[a] = int(s * in_shape[a])  # floor, as the reference and shape inference do
    elif sizes is not None:
        if sizes.size != n:
            raise ValueError(f"{sizes.size} sizes for {n} axes")
        for a, s in zip(axes, np.asarray(sizes).reshape(-1)):
            scale[a], out[a] = int(s) / in_shape[a], int(s)
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            common = pick(scale[a] for a in axes)
            for a in axes:
                scale[a], out[a] = common, int(common * in_shape[a] + 0.5)
    else:
        raise ValueError("neither scales nor sizes is given")
    rois = [None] * rank
    if roi is not None:
        values = _floats(roi)
        if len(values) != 2 * n:
            raise ValueError(f"roi has {len(values)} values for {n} axes (needs starts, ends)")
        for i, a in enumerate(axes):
            rois[a] = (values[i], values[n + i])
    return [AxisGeometry(a, scale[a], int(in_shape[a]), out[a],
                         rois[a] if rois[a] is not None else (0.0, 1.0)) for a in range(rank)]


def is_identity(spec: ResizeSpec, g: AxisGeometry) -> bool:
    """An axis the node leaves as it is (the reference skips it the same way)."""
    return (math.isclose(g.scale, 1.0) and g.out_size == g.in_size
            and (spec.coordinate_mode != "tf_crop_and_resize"
                 or (math.isclose(g.roi[0], 0.0) and math.isclose(g.roi[1], 1.0))))


# ---- one axis's (index, weight) table ------------------------------------------------------


def _source_coordinates(spec: ResizeSpec, g: AxisGeometry):
    """(x_ori per output position, extrapolated mask or None): ONNX's coordinate transforms."""
    y = np.arange(g.out_size, dtype=np.float64)
    s, n_in, width = g.scale, g.in_size, g.scale * g.in_size
    mode = spec.coordinate_mode
    if mode == "align_corners":
        return (np.zeros_like(y) if width == 1 else y * (n_in - 1) / (width - 1)), None
    if mode == "asymmetric":
        return y / s, None
    if mode == "tf_crop_and_resize":
        r0, r1 = g.roi
        x = (np.full_like(y, (r1 - r0) * (n_in - 1) / 2) if width == 1
             else y * (r1 - r0) * (n_in - 1) / (width - 1)) + r0 * (n_in - 1)
        return x, (x < 0) | (x > n_in - 1)
    if mode == "pytorch_half_pixel":
        return (np.full_like(y, -0.5) if width == 1 else (y + 0.5) / s - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / s - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - g.out_size / width)
        return offset + (y + 0.5) / s - 0.5, None
    if mode == "tf_half_pixel_for_nn":  # Resize 11 only
        return (y + 0.5) / s, None
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter ``a`` at distances ``x``."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _coefficients(spec: ResizeSpec, ratio: np.ndarray, scale: float) -> np.ndarray:
    """``[out, n]`` weights of the window ``k - n/2 + 1 .. k + n/2`` around each source
    coordinate (``ratio`` in (0, 1] is its distance past ``k``), as the reference's
    ``_*_coeffs`` functions give them."""
    r = ratio[:, None]
    if spec.mode == "nearest":
        rule = spec.nearest_mode
        if rule == "legacy":  # onnxruntime's opset < 11 rounding
            rule = "floor" if scale >= 1 else "ceil"
        right = {"round_prefer_floor": r > 0.5, "round_prefer_ceil": r >= 0.5,
                 "floor": r == 1, "ceil": np.ones_like(r, bool)}.get(rule)
        if right is None:
            raise ValueError(f"unknown nearest_mode {spec.nearest_mode!r}")
        right = right | (r == 1)  # an integer coordinate is the right tap itself
        return np.concatenate([~right, right], axis=1).astype(np.float64)
    if spec.mode == "linear":
        if not spec.antialias:
            return np.concatenate([1 - r, r], axis=1)
        s = min(scale, 1.0)
        start = math.floor(-1 / s) + 1
        c = np.clip(1 - np.abs((np.arange(start, 2 - start) - r) * s), 0, 1)
        return c / c.sum(axis=1, keepdims=True)
    if spec.mode == "cubic":
        a = spec.cubic_coeff_a
        if not spec.antialias:
            return _cubic(np.arange(-1, 3) - r, a)
        s = min(scale, 1.0)
        start = math.floor(-2 / s) + 1
        c = _cubic(s * (np.arange(start, 2 - start) - r), a)
        return c / c.sum(axis=1, keepdims=True)
    raise ValueError(f"unknown mode {spec.mode!r}")


@dataclass(frozen=True)
class Table:
    """Along ``axis``: row ``o`` of the result is ``sum_t w[o, t] * source[idx[o, t]]``."""

    axis: int
    idx: np.ndarray  # [rows, taps] intp
    w: np.ndarray  # [rows, taps] float64
    n_src: int

    @property
    def unit(self) -> bool:
        """Every weight is 1: gathers and adds only."""
        return bool(np.all(self.w == 1))


def _pack(axis: int, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n_rows: int,
          n_src: int) -> Table:
    """A Table from sparse entries (repeated (row, col) pairs summed, zeros dropped), with as
    few taps as the fullest row needs (padding: index 0, weight 0)."""
    key, inverse = np.unique(rows * n_src + cols, return_inverse=True)
    summed = np.bincount(inverse.reshape(-1), weights=vals, minlength=len(key))
    keep = summed != 0
    key, summed = key[keep], summed[keep]
    rows, cols = key // n_src, key % n_src
    counts = np.bincount(rows, minlength=n_rows)
    taps = max(1, int(counts.max(initial=0)))
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    idx = np.zeros((n_rows, taps), np.intp)
    w = np.zeros((n_rows, taps), np.float64)
    idx[rows, slot], w[rows, slot] = cols, summed
    return Table(axis, idx, w, n_src)


def axis_table(spec: ResizeSpec, g: AxisGeometry) -> tuple[Table, np.ndarray | None]:
    """The forward table of one resized axis and its extrapolated positions (a bool mask over
    the output positions, tf_crop_and_resize only; their rows are left empty)."""
    x, outside = _source_coordinates(spec, g)
    k = np.floor(x)
    integer = x == k
    ratio = np.where(integer, 1.0, x - k)
    coeffs = _coefficients(spec, ratio, g.scale)
    n = coeffs.shape[1]
    # the reference's neighbour window: n consecutive positions, ties to the smaller index
    start = k + np.where(integer, -(n // 2), -(n // 2) + 1)
    pos = (start[:, None] + np.arange(n)[None, :]).astype(np.int64)
    if spec.exclude_outside:
        coeffs = np.where((pos < 0) | (pos >= g.in_size), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    if outside is not None:
        coeffs[outside] = 0.0
    rows = np.repeat(np.arange(g.out_size), n)
    cols = np.clip(pos, 0, g.in_size - 1).reshape(-1)  # edge padding = clamped indices
    table = _pack(g.axis, rows, cols, coeffs.reshape(-1), g.out_size, g.in_size)
    return table, (outside if outside is not None and outside.any() else None)


def transpose_table(t: Table) -> Table:
    """The adjoint map: row ``i`` lists the outputs that read input ``i``, with their weight."""
    rows = np.repeat(np.arange(t.idx.shape[0]), t.idx.shape[1])
    return _pack(t.axis, t.idx.reshape(-1), rows, t.w.reshape(-1), t.n_src, t.idx.shape[0])


@dataclass(frozen=True)
class ResizePlan:
    """A node's forward: the tables of the axes it changes, its output shape, and where
    tf_crop_and_resize writes ``fill_value`` instead."""

    tables: list[Table]  # forward, in the order they run
    out_shape: tuple[int, ...]
    fill_mask: np.ndarray | None  # broadcastable over the output: extrapolated positions
    fill_value: float


def resize_plan(op: str, version: int, attrs, in_shape, roi, scales, sizes) -> ResizePlan:
    """Everything a Resize/Upsample node computes, decided at plan time."""
    spec = node_spec(op, version, attrs)
    if spec.antialias and spec.mode == "nearest":
        raise ValueError("antialias applies to linear and cubic modes only")
    geo = geometry(op, version, attrs, in_shape, roi, scales, sizes)
    rank = len(in_shape)
    tables, mask = [], None
    for g in geo:
        if is_identity(spec, g):
            continue
        table, outside = axis_table(spec, g)
        if outside is not None:
            axis_mask = outside.reshape([-1 if a == g.axis else 1 for a in range(rank)])
            mask = axis_mask if mask is None else mask | axis_mask
        if outside is None and table.idx.shape == (g.in_size, 1) and table.unit \
                and np.array_equal(table.idx[:, 0], np.arange(g.in_size)):
            continue  # the map is the identity after all (e.g. align_corners, same size)
        tables.append(table)
    # shrinking axes first keeps the intermediate results small
    tables.sort(key=lambda t: t.idx.shape[0] / t.n_src)
    return ResizePlan(tables, tuple(g.out_size for g in geo), mask, spec.extrapolation_value)


# ---- the step: gathers and weighted sums ----------------------------------------------------


def _physical_perm(info) -> tuple[int, ...]:
    layout = info.layout
    rank = len(info.shape)
    if isinstance(layout, StridedLayout) and len(layout.perm) == rank:
        return tuple(layout.perm)
    return tuple(range(rank))


def separable_numpy(ctx, tables: list[Table], fill_mask=None, fill_value: float = 0.0):
    """The ``run`` applying ``tables`` (one axis each, in order) to input 0 into output 0.

    Work happens in the physical axis order of input 0 (channels-last stays channels-last):
    ``np.take`` needs a contiguous source, so a padded or differently typed input is first
    copied into a workspace; each step gathers into compact workspaces, and the last one sums
    into the output's (possibly padded) view with ufuncs, which take any strides."""
    x_info, y_info = ctx.inputs[0], ctx.outputs[0]
    perm = _physical_perm(x_info)
    out_dtype = np.dtype(y_info.dtype)
    work = accumulator_dtype(x_info.dtype)
    if any(not t.unit for t in tables) and work.kind not in "fc":
        raise ctx.error(f"weighted ({ctx.attrs.get('mode')}) interpolation of {x_info.dtype} "
                        "tensors is not implemented; integer tensors take plain nearest gathers")
    if not tables:
        def run_copy(ins, outs, ws):
            np.copyto(outs[0], ins[0], casting="unsafe")
            if fill_mask is not None:
                np.copyto(outs[0], fill_value, where=fill_mask)
        return run_copy

    phys = [tuple(int(x_info.shape[p]) for p in perm)]
    for t in tables:
        shape = list(phys[-1])
        shape[perm.index(t.axis)] = t.idx.shape[0]
        phys.append(tuple(shape))
    contiguous = (isinstance(x_info.layout, StridedLayout) and not x_info.layout.is_padded
                  and np.dtype(x_info.dtype) == work)
    src_ws = None if contiguous else ctx.workspace(phys[0], work)
    direct = out_dtype == work  # the last step may sum straight into the output's view
    step_ws = [ctx.workspace(s, work) for s in phys[1:-1]] + \
              ([None] if direct else [ctx.workspace(phys[-1], work)])
    tmp_ws = ctx.workspace((max(math.prod(s) for s in phys[1:]),), work)
    steps = []
    for t, dst in zip(tables, step_ws):
        pa = perm.index(t.axis)
        wshape = [1] * len(perm)
        wshape[pa] = t.idx.shape[0]
        cols = [np.ascontiguousarray(t.idx[:, j]) for j in range(t.idx.shape[1])]
        weights = None if t.unit else [t.w[:, j].astype(work).reshape(wshape)
                                       for j in range(t.w.shape[1])]
        steps.append((pa, cols, weights, dst))

    def run(ins, outs, ws):
        src = ins[0].transpose(perm)
        if src_ws is not None and not (src.flags.c_contiguous and src.dtype == work):
            np.copyto(ws[src_ws], src)
            src = ws[src_ws]
        final = outs[0].transpose(perm)
        for (pa, cols, weights, dst_i), shape in zip(steps, phys[1:]):
            dst = final if dst_i is None else ws[dst_i]
            tmp = ws[tmp_ws][:math.prod(shape)].reshape(shape)
            for j, col in enumerate(cols):
                into = dst if j == 0 and dst_i is not None else tmp
                np.take(src, col, axis=pa, out=into, mode="clip")  # indices are in range
                if weights is not None:
                    np.multiply(into, weights[j], out=into)
                if into is tmp:
                    if j == 0:
                        np.copyto(dst, tmp)
                    else:
                        np.add(dst, tmp, out=dst)
            src = dst
        if not direct:
            np.copyto(final, src, casting="unsafe")
        if fill_mask is not None:
            np.copyto(outs[0], fill_value, where=fill_mask)

    return run


def resize_inputs(ctx, op: str, version: int):
    """(roi, scales, sizes) of a Resize/Upsample (``op`` of ``version``) from the node's
    constant inputs 1-3 (ResizeGrad has the forward's); absent ones are None."""
    const = [ctx.const(i) for i in range(1, 4)]
    if op == "Upsample" or version < 11:
        return None, const[0], None  # Upsample 9 / Resize 10: (X, scales)
    return tuple(const)


def _plan_of(ctx, op: str, version: int, in_shape) -> ResizePlan:
    """The plan of a Resize/Upsample (``op`` of ``version``) over ``in_shape``, from the
    node's attributes and constant inputs 1-3 (ResizeGrad has the forward's)."""
    roi, scales, sizes = resize_inputs(ctx, op, version)
    try:
        plan = resize_plan(op, version, ctx.attrs, in_shape, roi, scales, sizes)
    except ValueError as e:
        raise ctx.error(str(e)) from None
    return plan


def resize_numpy(ctx):
    """Resize/Upsample: the plan's tables applied to input 0, the output shape checked against
    the one shape inference gave."""
    op = ctx.node.op_type
    plan = _plan_of(ctx, op, ctx.since_version, ctx.inputs[0].shape)
    want = tuple(ctx.outputs[0].shape)
    if plan.out_shape != want:
        raise ctx.error(f"resizing {list(ctx.inputs[0].shape)} gives {list(plan.out_shape)}, "
                        f"but shape inference says {list(want)}")
    return separable_numpy(ctx, plan.tables, plan.fill_mask, plan.fill_value)


def resize_grad_numpy(ctx):
    """gx = the transpose of the forward's map applied to gy (input 0); inputs 1-3 and the
    attributes are the forward node's, output 0 is shaped like its data input."""
    op, version = ctx.attrs["forward_op"], int(ctx.attrs["forward_version"])
    plan = _plan_of(ctx, op, version, ctx.outputs[0].shape)
    if plan.out_shape != tuple(ctx.inputs[0].shape):
        raise ctx.error(f"gy {list(ctx.inputs[0].shape)} is not the forward's output "
                        f"{list(plan.out_shape)}")
    return separable_numpy(ctx, [transpose_table(t) for t in reversed(plan.tables)])


# ---- gradient rule --------------------------------------------------------------------------


def resize_vjp(b, node, gys, needed):
    """ResizeGrad of gy with the forward's attributes and constant inputs."""
    attrs = {k: v for k, v in node.attrs.items() if v is not None}
    attrs.update(forward_op=node.op_type, forward_version=int(node.since_version))
    g = b.op("ResizeGrad", [gys[0], *node.inputs[1:]], attrs, domain=INTERNAL_DOMAIN,
             like=node.inputs[0])
    return first_only(node, g)


# ---- registration ---------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    common = {"differentiable": True, "gradient": resize_vjp, "grad_inputs": DATA_INPUT,
              "const_inputs": CONST_INPUTS}
    return [
        OpDef("Resize", (10, 11, 13, 18, 19), {"numpy": resize_numpy}, **common,
              doc="nearest (every nearest_mode), linear and cubic (cubic_coeff_a, "
                  "exclude_outside) with every coordinate_transformation_mode, antialias, "
                  "axes, keep_aspect_ratio_policy; scales or sizes known at plan time. "
                  "Separable gather-and-sum tables; the gradient is their transpose"),
        OpDef("Upsample", (7, 9, 10), {"numpy": resize_numpy}, **common,
              doc="legacy Resize: asymmetric coordinates, nearest or linear; scales an "
                  "attribute (7) or an input known at plan time (9)"),
        OpDef("ResizeGrad", (1,), {"numpy": resize_grad_numpy}, domain=INTERNAL_DOMAIN,
              const_inputs=CONST_INPUTS,
              doc="gradient of Resize/Upsample: the transposed gather-and-sum tables "
                  "applied to gy (attributes: the forward's, forward_op, forward_version)"),
    ]
