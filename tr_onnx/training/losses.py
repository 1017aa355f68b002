"""Loss nodes appended to the model's graph: ``loss(b, output, labels) -> scalar Value``.

Each builder emits standard ONNX ops through a GradBuilder (so their gradients come from the
same rules as any model op). ``cross_entropy`` is ONNX's SoftmaxCrossEntropyLoss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..domains import ONNX_DOMAINS
from ..errors import InputError
from ..ir import Graph, Value
from ..passes.autodiff import GradBuilder


@dataclass(frozen=True)
class LossSpec:
    """A builtin loss by name with its options (``reduction``: mean or sum). cross_entropy's
    ``ignore_index``, ``weights`` (per class) and ``label_smoothing`` are
    ``torch.nn.functional.cross_entropy``'s, with its semantics."""

    name: str
    reduction: str = "mean"
    ignore_index: int | None = None  # cross_entropy
    weights: tuple[float, ...] | None = None  # cross_entropy: per-class weights
    label_smoothing: float = 0.0  # cross_entropy: the target mixes in this much of uniform
    beta: float = 1.0  # smooth_l1
    options: dict = field(default_factory=dict)
    # cross_entropy: the output's class axis (ONNX's and torch's 1; a language model's logits
    # [N, T, V] take -1); the labels are the output's shape without it
    class_axis: int = 1

    def config(self) -> dict:
        return {"name": self.name, "reduction": self.reduction, "ignore_index": self.ignore_index,
                "weights": list(self.weights) if self.weights else None, "beta": self.beta,
                "class_axis": self.class_axis, "label_smoothing": self.label_smoothing}

    def class_axis_of(self, rank: int) -> int:
        """The class axis of an output of ``rank`` (a named error where there is none)."""
        if not -rank <= self.class_axis < rank or rank < 2:
            raise InputError(f"cross_entropy class_axis={self.class_axis} for an output of rank "
                             f"{rank}: the scores need a batch axis and a class axis")
        axis = self.class_axis % rank
        if axis == 0:
            raise InputError("cross_entropy class_axis=0 is the batch axis")
        return axis


def _reduce(b: GradBuilder, v: Value, reduction: str) -> Value:
    if not v.shape:
        return v
    axes = list(range(len(v.shape)))
    if reduction == "sum":
        return b.op("ReduceSum", [v, b.ints(axes)], {"keepdims": 0})
    return b.op("ReduceMean", [v], {"axes": axes, "keepdims": 0})  # attribute until opset 18


def cross_entropy(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    """ONNX SoftmaxCrossEntropyLoss over the class axis. Scores whose classes are the last of
    three or more axes (token logits [N, T, V]) become rows [N*T, V] and the labels [N*T]
    (zero-copy reshapes; the mean over rows is the mean over tokens), which every backend's
    kernel reads; another class axis is moved to axis 1."""
    axis = spec.class_axis_of(len(x.shape))
    if axis == len(x.shape) - 1 and axis > 1:
        x = b.op("Reshape", [x, b.ints([-1, x.shape[-1]])])
        y = b.op("Reshape", [y, b.ints([-1])])
    elif axis != 1:
        perm = [0, axis] + [a for a in range(1, len(x.shape)) if a != axis]
        x = b.op("Transpose", [x], {"perm": perm})
    attrs = {"reduction": spec.reduction}
    if spec.ignore_index is not None:
        attrs["ignore_index"] = int(spec.ignore_index)
    inputs = [x, y]
    if spec.weights is not None:
        inputs.append(b.const(np.asarray(spec.weights, dtype=x.dtype)))
    nll = b.op("SoftmaxCrossEntropyLoss", inputs, attrs)
    if not spec.label_smoothing:
        return nll
    eps = float(spec.label_smoothing)
    smooth = _smoothing_term(b, x, y, spec)
    return b.add(b.mul(nll, b.scalar_like(1.0 - eps, nll)),
                 b.mul(smooth, b.scalar_like(eps / x.shape[1], nll)))


def _smoothing_term(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    """PyTorch's label smoothing term (ATen ``cross_entropy_loss_label_smoothing``): per label
    ``-sum_c w_c log_softmax(x)_c`` (0 where the label is ``ignore_index``), summed, and for
    the mean divided by what the NLL term is divided by: the weights of the kept labels (their
    count without weights). ``x``: scores with classes on axis 1; ``y``: the labels. Scores
    of rank > 2 become rows [M, C] first (classes last, then a reshape): a backend may hold
    them channels-last, where its LogSoftmax reads only row-major rows."""
    if len(x.shape) > 2:
        perm = [0, *range(2, len(x.shape)), 1]
        x = b.op("Reshape", [b.op("Transpose", [x], {"perm": perm}), b.ints([-1, x.shape[1]])])
        y = b.op("Reshape", [y, b.ints([-1])])
    logp = b.op("LogSoftmax", [x], {"axis": 1})
    w = None
    if spec.weights is not None:
        w = np.asarray(spec.weights, dtype=x.dtype)
        logp = b.mul(logp, b.const(w))
    per_label = b.neg(b.op("ReduceSum", [logp, b.ints([1])], {"keepdims": 0}))
    keep = None
    if spec.ignore_index is not None:
        ignored = b.op("Equal", [y, b.const(np.asarray(spec.ignore_index, dtype=y.dtype))])
        keep = b.op("Not", [ignored])
        per_label = b.mul(per_label, b.op("Cast", [keep], {"to": _onnx_type(x.dtype)}))
    total = _reduce(b, per_label, "sum")
    if spec.reduction == "sum":
        return total
    if w is not None:
        idx = y if keep is None else b.op("Where", [keep, y, b.const(np.zeros((), y.dtype))])
        label_w = b.op("Gather", [b.const(w), idx], {"axis": 0})
        if keep is not None:
            label_w = b.mul(label_w, b.op("Cast", [keep], {"to": _onnx_type(x.dtype)}))
        denom = _reduce(b, label_w, "sum")
    elif keep is not None:
        denom = _reduce(b, b.op("Cast", [keep], {"to": _onnx_type(x.dtype)}), "sum")
    else:
        denom = b.scalar_like(float(np.prod(y.shape)), total)
    return b.div(total, denom)


def _onnx_type(dtype) -> int:
    from onnx.helper import np_dtype_to_tensor_dtype

    return np_dtype_to_tensor_dtype(np.dtype(dtype))


def mse(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    d = b.sub(x, y)
    return _reduce(b, b.mul(d, d), spec.reduction)


def l1(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    return _reduce(b, b.op("Abs", [b.sub(x, y)]), spec.reduction)


def bce_with_logits(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    """max(x, 0) - x*y + log(1 + exp(-|x|)): stable for large |x| (PyTorch's formula)."""
    pos = b.op("Relu", [x])
    soft = b.op("Softplus", [b.neg(b.op("Abs", [x]))])
    return _reduce(b, b.add(b.sub(pos, b.mul(x, y)), soft), spec.reduction)


def smooth_l1(b: GradBuilder, x: Value, y: Value, spec: LossSpec) -> Value:
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (PyTorch's smooth_l1_loss)."""
    d = b.op("Abs", [b.sub(x, y)])
    beta = b.scalar_like(spec.beta, x)
    quad = b.div(b.mul(b.mul(d, d), b.scalar_like(0.5, x)), beta)
    lin = b.sub(d, b.scalar_like(0.5 * spec.beta, x))
    return _reduce(b, b.op("Where", [b.op("Less", [d, beta]), quad, lin]), spec.reduction)


LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy, "mse": mse, "l1": l1,
                               "bce_with_logits": bce_with_logits, "smooth_l1": smooth_l1}
INTEGER_LABELS = {"cross_entropy"}


# the ONNX losses whose labels are class indices, and the ops that hand labels on with their
# values unchanged (only the shape or the integer width changes)
CLASS_INDEX_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
_LABEL_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast",
                          "Transpose"})


@dataclass(frozen=True)
class ClassLabels:
    """Labels a loss node reads as class indices: valid are ``0..classes - 1`` and
    ``ignore_index``."""

    classes: int
    ignore_index: int | None
    node: str  # the loss node's label


def class_labels(graph: Graph, label_name: str) -> list[ClassLabels]:
    """Where a training graph reads its labels ``label_name`` as class indices: every
    SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss that reads them (directly or through
    reshapes and casts: the builtin cross_entropy's [N*T] rows, a user's ONNX loss model), with
    its number of classes (axis 1 of its scores, concrete in a specialised graph) and its
    ignore_index. Empty for losses whose labels are not class indices (mse, ...)."""
    found, todo, seen = [], [graph.values[label_name]], set()
    while todo:
        v = todo.pop()
        for node in v.consumers:
            if node.domain in ONNX_DOMAINS and node.op_type in CLASS_INDEX_LOSSES \
                    and node.inputs[1] is v:
                ignore = node.attrs.get("ignore_index")
                found.append(ClassLabels(int(node.inputs[0].shape[1]),
                                         None if ignore is None else int(ignore), node.label))
            elif node.op_type in _LABEL_VIEWS and node.inputs[0] is v and id(node) not in seen:
                seen.add(id(node))
                todo.append(node.outputs[0])
    return found


def check_loss_model(loss_model, source: str = "the ONNX loss model") -> None:
    """An ONNX loss model takes (model output, labels) and returns one value: anything else
    (a model given as ``loss=`` by mistake) is an ``InputError`` naming its inputs and outputs,
    before anything reads its label input. ``loss_model``: an ``ImportedModel``."""
    inputs, outputs = loss_model.inputs, loss_model.outputs
    if len(inputs) != 2 or len(outputs) != 1:
        def listed(specs) -> str:
            return ", ".join(f"{s.name!r} {list(s.shape) if s.shape is not None else '?'}"
                             for s in specs) or "none"
        raise InputError(f"{source} {loss_model.source}: a loss model takes "
                         f"exactly 2 inputs (model output, labels) and returns 1 scalar; this "
                         f"one has {len(inputs)} input(s) ({listed(inputs)}) and "
                         f"{len(outputs)} output(s) ({listed(outputs)}): is it the model "
                         "instead of a loss?")


def make_loss_spec(loss: str | LossSpec | dict) -> LossSpec:
    if isinstance(loss, LossSpec):
        spec = loss
    elif isinstance(loss, dict):
        d = dict(loss)
        if d.get("weights") is not None:
            d["weights"] = tuple(d["weights"])
        spec = LossSpec(**d)
    else:
        spec = LossSpec(loss)
    if spec.name not in LOSSES:
        raise ValueError(f"unknown loss {spec.name!r}; valid: {', '.join(LOSSES)} (or an ONNX "
                         "loss model path)")
    if spec.reduction not in ("mean", "sum"):
        raise ValueError(f"loss reduction {spec.reduction!r}; valid: mean, sum")
    if spec.label_smoothing and (spec.name != "cross_entropy"
                                 or not 0.0 <= spec.label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing={spec.label_smoothing!r}: a fraction in [0, 1], "
                         "for cross_entropy only")
    return spec


def label_dtype(spec: LossSpec, output_dtype: np.dtype) -> np.dtype:
    return np.dtype(np.int64) if spec.name in INTEGER_LABELS else np.dtype(output_dtype)
