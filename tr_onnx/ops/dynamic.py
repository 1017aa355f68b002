"""Ops whose output size depends on data: NonZero, Compress, Unique, NonMaxSuppression,
ImageDecoder, and the nodes that run a data-dependent part of a graph: DynamicRegion, If (a
condition known only at run time) and their gradient DynamicRegionGrad.

NonZero, Compress and Unique have a static plan only where their deciding input is a plan-time
constant (then import folds them, or, for Compress with a constant condition, the kernel here
gathers). Otherwise ``subplan`` cuts the nodes from such a producer down to the
first values whose shapes are static again into one DynamicRegion node: its kernel runs the
producers eagerly (``EAGER``, NumPy, allocating their small results), then a sub-plan
specialised to the sizes they gave; DynamicRegionGrad runs that sub-plan's backward. Both kernels
only delegate to the ``Region`` object the node carries in ``attrs["region"]``.

ImageDecoder decodes with Pillow, imported when a plan first decodes (not a dependency of
tr_onnx: the ``test`` extra installs it). NonZero, Unique and ImageDecoder are not
differentiable; Compress is w.r.t. its data (a scatter back of the selected slices,
GatherGrad).
"""

from __future__ import annotations

import io

import numpy as np

from ..domains import INTERNAL_DOMAIN
from ..errors import UnsupportedModelError
from ..hookspecs import hookimpl
from ..opdef import PLAIN_ONLY, OpDef
from .tensor import DATA_INPUT, first_only, positive_axis, zeros_like

# ---- eager forms: inputs -> outputs, for the producers a DynamicRegion runs each step ------


def nonzero_eager(attrs: dict, x: np.ndarray) -> list[np.ndarray]:
    """Indices of the non-zero elements, one row per axis ([rank, count], int64)."""
    x = np.asarray(x)
    if x.ndim == 0:  # ONNX: a scalar has rank 0, so [0, count] rows
        return [np.zeros((0, int(bool(x))), np.int64)]
    return [np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)]


def compress_indices(condition: np.ndarray) -> np.ndarray:
    """The positions Compress keeps (a condition shorter than the axis keeps none past it)."""
    return np.flatnonzero(np.asarray(condition)).astype(np.int64)


def compress_eager(attrs: dict, x: np.ndarray, condition: np.ndarray) -> list[np.ndarray]:
    axis = attrs.get("axis")
    keep = compress_indices(condition)
    if axis is None:
        return [np.asarray(x).reshape(-1)[keep]]
    return [np.take(x, keep, axis=positive_axis(axis, np.ndim(x)))]


def unique_eager(attrs: dict, x: np.ndarray) -> list[np.ndarray]:
    """Y, indices (first occurrence), inverse_indices, counts, as ONNX defines them: sorted
    ascending (``sorted=1``), else in order of first occurrence; along ``axis`` or flattened."""
    x = np.asarray(x)
    axis = attrs.get("axis")
    if axis is None:
        x, ax = x.reshape(-1), 0
    else:
        ax = positive_axis(axis, x.ndim)
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True,
                                          return_counts=True, axis=ax)
    inverse = inverse.reshape(-1)
    if not int(attrs.get("sorted", 1)):
        order = np.argsort(first, kind="stable")  # unique values by first occurrence
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        y, first, counts, inverse = np.take(y, order, axis=ax), first[order], counts[order], \
            rank[inverse]
    return [y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)]


def _box_corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """[n, 4] boxes as (y_min, x_min, y_max, x_max): ONNX's corner format names two opposite
    corners in either order; the center format is (x_center, y_center, width, height)."""
    boxes = boxes.astype(np.float64)
    if center_point_box:
        x, y, half_w, half_h = boxes[:, 0], boxes[:, 1], boxes[:, 2] / 2, boxes[:, 3] / 2
        return np.stack([y - half_h, x - half_w, y + half_h, x + half_w], axis=1)
    return np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]),
                           np.maximum(boxes[:, :2], boxes[:, 2:])], axis=1)


def _iou_with(corners: np.ndarray, i: int) -> np.ndarray:
    """Intersection over union of box ``i`` with every box; 0 where the boxes do not overlap or
    one has no area (such a pair never suppresses)."""
    lo = np.maximum(corners[i, :2], corners[:, :2])
    hi = np.minimum(corners[i, 2:], corners[:, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    area = np.prod(corners[:, 2:] - corners[:, :2], axis=1)
    union = area[i] + area - inter
    valid = (inter > 0) & (area[i] > 0) & (area > 0) & (union > 0)
    return np.where(valid, inter / np.where(valid, union, 1), 0.0)


def non_max_suppression_eager(attrs: dict, boxes, scores, max_output=None, iou_threshold=None,
                              score_threshold=None) -> list[np.ndarray]:
    """Selected [batch, class, box] rows, greedily per batch and class: highest score first
    (the lower box index first among equal scores), dropping boxes whose IoU with a kept one is
    above ``iou_threshold``, at most ``max_output`` per class (absent: none), only scores above
    ``score_threshold`` when given."""
    def scalar(v, default):
        return default if v is None or np.size(v) == 0 else np.asarray(v).reshape(-1)[0]

    keep_max = max(int(scalar(max_output, 0)), 0)
    iou_limit = float(scalar(iou_threshold, 0.0))
    score_min = scalar(score_threshold, None)
    boxes, scores = np.asarray(boxes), np.asarray(scores)
    rows = []
    for b in range(boxes.shape[0]):
        corners = _box_corners(boxes[b], int(attrs.get("center_point_box", 0)))
        for c in range(scores.shape[1]):
            s = scores[b, c]
            order = np.lexsort((np.arange(len(s)), -s.astype(np.float64)))
            if score_min is not None:
                order = order[s[order] > score_min]
            kept: list[int] = []
            for i in order:
                if len(kept) >= keep_max:
                    break
                if not kept or not np.any(_iou_with(corners, i)[kept] > iou_limit):
                    kept.append(int(i))
            rows += [(b, c, i) for i in kept]
    return [np.array(rows, np.int64).reshape(-1, 3)]


IMAGE_PIXEL_FORMATS = ("RGB", "BGR", "Grayscale")


def _pil_image():
    try:
        import PIL.Image
    except ImportError as exc:
        raise ImportError("ImageDecoder needs Pillow to decode images: pip install pillow "
                          "(tr_onnx's test extra installs it)") from exc
    return PIL.Image


def image_decoder_eager(attrs: dict, encoded) -> list[np.ndarray]:
    """The image in ``encoded`` (a file's bytes, any format Pillow reads) as [height, width,
    channels] uint8: 3 channels in ``pixel_format`` RGB or BGR order, or 1 for Grayscale
    (Pillow's ITU-R 601-2 luma). An image of another mode (palette, RGBA, 16-bit...) is
    converted by Pillow's ``Image.convert``."""
    image_module = _pil_image()
    fmt = attrs.get("pixel_format", "RGB")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    if fmt not in IMAGE_PIXEL_FORMATS:
        raise ValueError(f"ImageDecoder: pixel_format {fmt!r} is not one of "
                         f"{', '.join(IMAGE_PIXEL_FORMATS)}")
    with image_module.open(io.BytesIO(np.ascontiguousarray(encoded, np.uint8).tobytes())) as img:
        image = np.asarray(img.convert("L" if fmt == "Grayscale" else "RGB"), np.uint8)
    return [image[:, :, None] if fmt == "Grayscale" else
            image[:, :, ::-1] if fmt == "BGR" else image]


# (domain, op_type) -> eager form; other producers are evaluated by onnx.reference
EAGER = {("", "NonZero"): nonzero_eager, ("", "Compress"): compress_eager,
         ("", "Unique"): unique_eager, ("", "NonMaxSuppression"): non_max_suppression_eager,
         ("", "ImageDecoder"): image_decoder_eager}


# ---- kernels of a static plan (the deciding input known when the plan is made) --------------


def _static_kernel(eager, ctx):
    """Run the eager form and check the sizes the plan was made for: used when the deciding
    input is a plan-time value that was not folded (too large to fold). One temporary per
    output (the eager form's result)."""
    attrs, want = ctx.attrs, [o.shape if o is not None else None for o in ctx.outputs]

    def run(ins, outs, ws):
        for i, (y, value) in enumerate(zip(outs, eager(attrs, *ins))):
            if y is None:
                continue
            if value.shape != want[i]:
                raise ValueError(f"output {i} has shape {list(value.shape)} at run time but "
                                 f"{list(want[i])} was planned (its deciding input changed)")
            np.copyto(y, value)

    return run


def nonzero_numpy(ctx):
    return _static_kernel(nonzero_eager, ctx)


def unique_numpy(ctx):
    return _static_kernel(unique_eager, ctx)


def non_max_suppression_numpy(ctx):
    return _static_kernel(non_max_suppression_eager, ctx)


def image_decoder_numpy(ctx):
    return _static_kernel(image_decoder_eager, ctx)


def compress_numpy(ctx):
    """With a plan-time condition the kept positions are known: a take along the axis (the
    flattened data for ``axis`` absent; a strided input is copied to flatten it)."""
    condition = ctx.const(1)
    if condition is None:
        return _static_kernel(compress_eager, ctx)
    keep = compress_indices(condition)
    axis = ctx.attrs.get("axis")
    if keep.size and keep[-1] >= (int(np.prod(ctx.inputs[0].shape)) if axis is None else
                                  ctx.inputs[0].shape[positive_axis(axis, len(
                                      ctx.inputs[0].shape))]):
        raise ctx.error("the condition selects past the end of the data (ONNX: condition "
                        "length must not exceed the selected axis)")
    if axis is None:
        def run(ins, outs, ws):
            np.take(ins[0].reshape(-1), keep, out=outs[0])
        return run
    ax = positive_axis(axis, len(ctx.inputs[0].shape))

    def run_axis(ins, outs, ws):
        np.take(ins[0], keep, axis=ax, out=outs[0])

    return run_axis


def compress_vjp(b, node, gys, needed):
    """gx = 0 with gy scattered back at the kept positions (GatherGrad); needs a plan-time
    condition -- a data-dependent one is a DynamicRegion's, which gathers instead."""
    x, condition = node.inputs[0], node.inputs[1]
    if condition.data is None:
        raise UnsupportedModelError(f"{node.label}: gradient needs the condition at plan time "
                                    "(a data-dependent one runs inside a DynamicRegion)", [])
    keep = b.const(compress_indices(condition.data))
    axis = node.attrs.get("axis")
    if axis is not None:
        return first_only(node, b.op("GatherGrad", [gys[0], keep],
                                     {"axis": positive_axis(axis, x.rank)},
                                     domain=INTERNAL_DOMAIN, like=x))
    size = int(np.prod(x.shape))
    flat = b.op("GatherGrad", [gys[0], keep], {"axis": 0}, domain=INTERNAL_DOMAIN,
                shapes=[((size,), x.dtype)])
    return first_only(node, b.op("Reshape", [flat, b.ints(x.shape)]))


# ---- DynamicRegion ---------------------------------------------------------------------------


def dynamic_region_numpy(ctx):
    region = ctx.attrs["region"]

    def run(ins, outs, ws):
        region.forward(ins, outs)

    return run


def loop_shape(node, in_shapes, in_types):
    """A Loop left to run as a loop: its carried values keep their shapes (ONNX's inference
    gives them none, as a body may change them; ``subplan.Iterations`` plans the body with
    these and names a body that does not keep them). Scan outputs: none here."""
    carried = len(node.input) - 2
    return list(zip(in_shapes[2:], in_types[2:])) + [(None, None)] * (len(node.output)
                                                                      - carried)


def run_loop_cuda(ctx):
    raise ctx.error("a Loop that runs as a loop (not unrolled when the plan is made) runs on "
                    "the numpy backend only")


def dynamic_region_grad_numpy(ctx):
    region = ctx.attrs["region"]

    def run(ins, outs, ws):
        region.backward(ins, outs)

    return run


def dynamic_region_vjp(b, node, gys, needed):
    """One DynamicRegionGrad node: cotangents of the region's outputs (zeros where none flows)
    in, gradients of the needed inputs out. It runs the backward of the sub-plan the forward
    ran in the same step."""
    region = node.attrs["region"]
    wanted = [i for i, need in enumerate(needed) if need]
    region.require_gradients(wanted)
    cots = [gy if gy is not None else zeros_like(b, y) for gy, y in zip(gys, node.outputs)]
    outs = b.op("DynamicRegionGrad", cots, {}, domain=INTERNAL_DOMAIN,
                like=[node.inputs[i] for i in wanted])
    outs = [outs] if len(wanted) == 1 else outs
    outs[0].producer.attrs["region"] = region  # a Python object: no ONNX attribute holds it
    grads = [None] * len(node.inputs)
    for i, g in zip(wanted, outs):
        grads[i] = g
    return grads


# ---- registration ----------------------------------------------------------------------------


@hookimpl
def tr_onnx_op_definitions():
    return [
        OpDef("NonZero", (9, 13), {"numpy": nonzero_numpy}, differentiable=False,
              layout=PLAIN_ONLY,
              doc="indices of non-zero elements [rank, count]; count is data-dependent: a "
                  "DynamicRegion runs it unless its input is a plan-time constant"),
        OpDef("Compress", (9, 11, 28), {"numpy": compress_numpy}, layout=PLAIN_ONLY,
              differentiable=True, gradient=compress_vjp, grad_inputs=DATA_INPUT,
              doc="slices where condition is true along axis (flattened without one); a "
                  "data-dependent condition runs in a DynamicRegion as a Gather"),
        OpDef("Unique", (11, 28), {"numpy": unique_numpy}, differentiable=False,
              layout=PLAIN_ONLY,
              doc="unique values/slices, first indices, inverse indices, counts; sizes are "
                  "data-dependent: a DynamicRegion runs it unless its input is constant"),
        OpDef("NonMaxSuppression", (10, 11), {"numpy": non_max_suppression_numpy},
              differentiable=False, layout=PLAIN_ONLY,
              doc="selected [batch, class, box] indices; their count is data-dependent: a "
                  "DynamicRegion runs it unless its inputs are plan-time constants"),
        OpDef("ImageDecoder", (20,), {"numpy": image_decoder_numpy}, differentiable=False,
              layout=PLAIN_ONLY,
              doc="encoded image bytes -> [H, W, C] uint8 (RGB, BGR or Grayscale) by Pillow; "
                  "its size is data-dependent: the plan is made for the bytes given"),
        OpDef("If", (1, 11, 13, 16, 19, 21, 23, 24, 25), {"numpy": dynamic_region_numpy},
              layout=PLAIN_ONLY, differentiable=True, gradient=dynamic_region_vjp,
              doc="a condition computed at run time: both branches planned (their outer "
                  "values become inputs; equal static output shapes), the selected one runs; "
                  "its backward gives the gradients, the other branch's inputs get zeros"),
        OpDef("RunLoop", (1,), {"numpy": dynamic_region_numpy, "cuda": run_loop_cuda},
              domain=INTERNAL_DOMAIN, layout=PLAIN_ONLY, differentiable=True,
              gradient=dynamic_region_vjp,
              doc="a Loop not unrolled at plan time (its trip count or condition known only at "
                  "run time, or too many iterations to unroll) run as a loop: the body one "
                  "sub-plan (the carried values keep static shapes; no scan outputs), its "
                  "backward by running each iteration again in reverse (subplan.Iterations)"),
        OpDef("DynamicRegion", (1,), {"numpy": dynamic_region_numpy}, domain=INTERNAL_DOMAIN,
              layout=PLAIN_ONLY, differentiable=True, gradient=dynamic_region_vjp,
              doc="a data-dependent part of the graph: eager producers, then a sub-plan "
                  "specialised to their sizes (subplan)"),
        OpDef("DynamicRegionGrad", (1,), {"numpy": dynamic_region_grad_numpy},
              domain=INTERNAL_DOMAIN, layout=PLAIN_ONLY,
              doc="gradient of DynamicRegion: the backward of the sub-plan its forward ran"),
    ]
