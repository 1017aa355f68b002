"""What a user hands a session, checked in one place for ``InferenceSession`` and
``TrainingSession``: the feed (input names, dtypes, shapes), the labels of a training step and
the output names asked for.

Every failure is an ``InputError`` that names the input, what the model expects and what was
given, raised before anything is compiled, uploaded or run. Symbolic dimensions (``'batch'``)
take any size, the same wherever one name appears; the dtype must match exactly (a session
never casts a model input), except that integer class-index labels of any width are taken as
the int64 the loss reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .errors import InputError
from .importer import InputSpec


def check_feed(feed, inputs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """``feed`` (input name -> array-like) as arrays, in the model's input order.

    ``inputs``: the model's inputs (``ImportedModel.inputs``). Raises ``InputError`` for a feed
    that is not a mapping, unknown or missing names (all of them in one message), a value that
    is not an array, a dtype or shape the input does not take, or two sizes for one symbolic
    dimension.
    """
    expected = [s.name for s in inputs]
    if not isinstance(feed, Mapping):
        raise InputError(f"the feed must be a dict of input name -> array, got "
                         f"{type(feed).__name__}; the model's inputs are {expected}")
    unknown = [k for k in feed if k not in expected]
    missing = [k for k in expected if k not in feed]
    if unknown or missing:
        problems = ([f"unknown input(s) {unknown}"] if unknown else []) + \
            ([f"missing input(s) {missing}"] if missing else [])
        hint = f" (a renamed input? unknown {unknown} in place of {missing})" \
            if unknown and missing else ""
        raise InputError(f"{' and '.join(problems)}: expected the model's inputs {expected}, "
                         f"given {list(feed)}{hint}")
    checked = {spec.name: _checked("input", spec, feed[spec.name]) for spec in inputs}
    _check_symbols(checked, inputs)
    return checked


def _check_symbols(feed: dict[str, np.ndarray], inputs: Sequence[InputSpec]) -> None:
    """A symbolic dimension is one size across the feed: ``x ['N', 4]`` and ``y ['N', 4]``
    given [2, 4] and [3, 4] is an error naming both inputs, the dimension and the two sizes
    (unnamed dimensions, ``'?'``, are free)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for spec in inputs:
        for axis, (dim, size) in enumerate(zip(spec.shape or (), feed[spec.name].shape)):
            if not isinstance(dim, str) or dim == "?":
                continue
            first = seen.setdefault(dim, (spec.name, axis, size))
            if first[2] != size:
                raise InputError(
                    f"inputs {first[0]!r} and {spec.name!r} disagree on dimension {dim!r}: "
                    f"{first[2]} ({first[0]!r} axis {first[1]}) and {size} ({spec.name!r} axis "
                    f"{axis}); every input declaring {dim!r} must be given the same size")


def check_batch_rows(feed: dict[str, np.ndarray], skip=()) -> None:
    """A training batch has at least one sample: the first input (``skip``: names that are not
    batches, plan-time constants) whose axis 0 is 0 is an ``InputError`` naming it and its
    shape. A loss averaged over 0 samples is 0/0: the step would read as a NaN loss and count
    as a bad step instead of saying what is wrong with the batch."""
    for name, x in feed.items():
        if name not in skip and x.ndim and x.shape[0] == 0:
            raise InputError(f"input {name!r}: a batch of 0 samples (shape {list(x.shape)}); a "
                             f"training step needs at least one sample")


def check_labels(labels, name: str, shape: Sequence[int], dtype) -> np.ndarray:
    """``labels`` as the array the training graph's label input ``name`` takes (``shape``,
    ``dtype``); integer labels are widened to int64 where int64 is wanted."""
    return _checked("labels", InputSpec(name, tuple(shape), np.dtype(dtype)), labels,
                    widen_integers=True)


def check_class_indices(labels: np.ndarray, what: str, classes: int,
                        ignore_index: int | None, scores: str) -> None:
    """Every label in ``[0, classes)`` or equal to ``ignore_index``: NumPy would read -1 as
    the last class and class ``classes`` as an IndexError mid-run. Raises ``InputError`` naming
    the first label out of range, its position in ``labels``, the valid range and ``scores``
    (where the number of classes comes from); ``what`` says which labels they are."""
    y = np.asarray(labels)
    bad = (y < 0) | (y >= classes)
    if ignore_index is not None:
        bad &= y != ignore_index
    if not bad.any():
        return
    first = np.argwhere(bad)[0]
    count = int(np.count_nonzero(bad))
    valid = f"0..{classes - 1}" + (f" or ignore_index {ignore_index}"
                                   if ignore_index is not None else "")
    more = f" ({count} labels out of range)" if count > 1 else ""
    skip = "" if ignore_index is not None else \
        ", or give the loss an ignore_index for the labels to skip"
    raise InputError(f"{what}: label {y[tuple(first)]} at position {first.tolist()} is not a "
                     f"class index: {scores} has {classes} classes, valid labels {valid}{more}; "
                     f"fix the labels{skip}")


def check_output_names(names, outputs: Sequence[InputSpec]) -> list[str]:
    """The output names to read: ``names``, or every model output when it is None or empty
    (as onnxruntime). Raises ``InputError`` for a bare string or a name that is not a model
    output."""
    known = [o.name for o in outputs]
    if isinstance(names, (str, bytes)):
        raise InputError(f"output names must be a list of names (or None), got the string "
                         f"{names!r}; the model's outputs are {known}")
    if not names:
        return known
    names = list(names)
    bad = [n for n in names if n not in known]
    if bad:
        raise InputError(f"unknown output(s) {bad}: expected some of the model's outputs "
                         f"{known}")
    return names


def _checked(what: str, spec: InputSpec, value, widen_integers: bool = False) -> np.ndarray:
    """One array against its spec: dtype, then rank and every fixed dimension."""
    try:
        x = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nested lists, objects numpy cannot take
        raise InputError(f"{what} {spec.name!r}: expected an array of {spec.dtype}, got a "
                         f"{type(value).__name__} numpy cannot convert ({exc})") from None
    if widen_integers and x.dtype.kind in "iu" and spec.dtype == np.int64:
        x = x.astype(np.int64, copy=False)
    elif x.dtype != spec.dtype:
        raise InputError(f"{what} {spec.name!r}: expected dtype {spec.dtype}, got {x.dtype}")
    if spec.shape is not None and (len(x.shape) != len(spec.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(spec.shape, x.shape))):
        raise InputError(f"{what} {spec.name!r}: expected shape {list(spec.shape)}, got "
                         f"{list(x.shape)}")
    return x
