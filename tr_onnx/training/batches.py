"""What a user trains on, made into what a ``Trainer`` reads: a data set ``(arrays, labels)``
that the Trainer shuffles and batches itself, or ``Batches``: any iterable of batches the user
already made (lists, generators, a torch ``DataLoader``, a Hugging Face ``datasets.Dataset``).

A batch is ``(inputs, labels)`` with ``inputs`` a dict by model input name, a single array (a
model with one input) or a tuple in the model's input order; or a dict holding the inputs by
name and the labels under ``"labels"`` or ``"label"`` (its other keys are left alone: a
``datasets`` row keeps its text column). Arrays may be NumPy arrays, anything ``np.asarray``
takes, or torch tensors (read with ``.numpy()``; torch itself is never imported here). Floating
point arrays are cast to the model input's float type and integer ones to its integer type, as
``tr-onnx train`` casts a float64 ``.npz``; labels to the loss's label dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from ..data import Rows
from ..errors import InputError

LABEL_KEYS = ("labels", "label")


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def _is_hf_dataset(x) -> bool:
    return type(x).__module__.split(".")[0] == "datasets" and hasattr(x, "column_names") \
        and hasattr(x, "iter")


def as_array(x, what: str) -> np.ndarray:
    """``x`` as a NumPy array (a torch tensor through ``.numpy()``, on the CPU)."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):  # as it is: a memory-mapped array stays one
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{what}: not an array ({type(x).__name__}: {exc})") from None


def cast_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Floating point to a wanted float type, integers to a wanted integer type; anything else
    as it is (the session names a dtype it does not take)."""
    dtype = np.dtype(dtype)
    if x.dtype != dtype and (x.dtype.kind == dtype.kind == "f"
                             or x.dtype.kind in "iu" and dtype.kind in "iu"):
        return x.astype(dtype, copy=False)
    return x


class Converter:
    """Batches of any form above into ``(feed by input name, labels)`` for a model with inputs
    ``input_specs`` (``TrainingSession.imported.inputs``) and a loss taking labels of kind
    ``label_kind`` (``"index"``: class indices, int64; ``"dense"``: ``label_dtype``)."""

    def __init__(self, input_specs, label_kind: str, label_dtype):
        self.specs = list(input_specs)
        self.names = [s.name for s in self.specs]
        self.label_dtype = np.dtype(np.int64) if label_kind == "index" else np.dtype(label_dtype)

    def inputs(self, inputs, what: str) -> dict[str, np.ndarray]:
        if isinstance(inputs, Mapping):
            missing = [n for n in self.names if n not in inputs]
            if missing:
                raise InputError(f"{what}: no array for the model input(s) {missing}; it has "
                                 f"{list(inputs)} (the model's inputs are {self.names})")
            given = {n: inputs[n] for n in self.names}
        elif isinstance(inputs, (tuple, list)):
            if len(inputs) != len(self.names):
                raise InputError(f"{what}: {len(inputs)} input arrays for the model's "
                                 f"{len(self.names)} inputs {self.names} (in that order)")
            given = dict(zip(self.names, inputs))
        elif len(self.names) == 1:
            given = {self.names[0]: inputs}
        else:
            raise InputError(f"{what}: one array for a model with inputs {self.names}; give a "
                             "dict by input name or a tuple in that order")
        return {s.name: given[s.name] if isinstance(given[s.name], Rows) else  # read lazily
                cast_to(as_array(given[s.name], f"{what} input {s.name!r}"), s.dtype)
                for s in self.specs}

    def labels(self, labels, what: str) -> np.ndarray:
        y = as_array(labels, f"{what} labels")
        if self.label_dtype.kind == "f" and y.dtype.kind in "iub":  # integer regression targets
            return y.astype(self.label_dtype)
        return cast_to(y, self.label_dtype)

    def batch(self, item, what: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if isinstance(item, Mapping):
            key = next((k for k in LABEL_KEYS if k in item), None)
            if key is None:
                raise InputError(f"{what}: a dict batch holds its labels under 'labels' or "
                                 f"'label'; it has {list(item)}")
            return self.inputs(item, what), self.labels(item[key], what)
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return self.inputs(item[0], what), self.labels(item[1], what)
        raise InputError(f"{what}: a batch is (inputs, labels) or a dict with 'labels'; got "
                         f"{type(item).__name__}"
                         + (f" of {len(item)} items" if isinstance(item, (tuple, list)) else ""))


class Batches:
    """A user's batches, read again each epoch (``epoch()`` yields ``(feed, labels)``).

    ``source``: an iterable (re-iterated each epoch: a list, a torch ``DataLoader``), a
    callable returning a fresh iterable each epoch (``lambda: my_generator()``), a one-shot
    iterator or generator (one epoch only: a second is an ``InputError`` saying to pass a
    callable), or a ``datasets.Dataset`` (read in batches of ``batch_size``, columns by input
    name plus ``label``/``labels``)."""

    def __init__(self, source, converter: Converter, batch_size: int | None = None,
                 what: str = "data"):
        self.source, self.converter, self.what = source, converter, what
        self.batch_size = batch_size
        self.one_shot = isinstance(source, Iterator)
        self._epochs = 0

    @property
    def length(self) -> int | None:
        """Batches per epoch where the source says (``len``), else None."""
        if _is_hf_dataset(self.source) and self.batch_size:
            return -(-len(self.source) // self.batch_size)
        try:
            return len(self.source)
        except TypeError:
            return None

    def _iterable(self) -> Iterable:
        if _is_hf_dataset(self.source):
            return self.source.with_format("numpy").iter(batch_size=self.batch_size or 32)
        if callable(self.source) and not hasattr(self.source, "__iter__"):
            return self.source()
        if self.one_shot and self._epochs:
            raise InputError(f"{self.what}: a generator or iterator gives its batches once; "
                             f"epoch {self._epochs + 1} needs them again: pass a callable that "
                             "returns a fresh one (lambda: make_batches()) or a list")
        return self.source

    def epoch(self) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
        items = self._iterable()
        self._epochs += 1
        for i, item in enumerate(items):
            yield self.converter.batch(item, f"{self.what} batch {i + 1}")


def is_data_set(data) -> bool:
    """Whether ``data`` is a whole data set ``(inputs, labels)`` (a tuple, not a list: a list
    of two batches is batches): inputs a dict (its labels anything array-like), or an array
    or a tuple of arrays with array labels (a tuple of two batches is batches)."""
    if not (isinstance(data, tuple) and len(data) == 2):
        return False
    inputs, labels = data
    if isinstance(inputs, Mapping):
        return True
    arrays = list(inputs) if isinstance(inputs, tuple) else [inputs]
    return all(hasattr(a, "shape") or _is_torch(a) for a in [*arrays, labels])


def prepare(data, input_specs, label_kind: str, label_dtype, batch_size: int | None = None,
            what: str = "data"):
    """``data`` as a ``Trainer`` reads it: a data set ``(arrays by input name, labels)`` for a
    path or ``"digits"`` (``tr_onnx.data.load``) or a tuple ``(inputs, labels)`` of whole
    arrays, ``Batches`` for anything else iterable or callable; None stays None."""
    if data is None or isinstance(data, Batches):
        return data
    if isinstance(data, (str, Path)):
        from ..data import load

        return load(data, input_specs, label_kind, label_dtype).data
    converter = Converter(input_specs, label_kind, label_dtype)
    if is_data_set(data):
        return converter.inputs(data[0], what), converter.labels(data[1], what)
    if callable(data) or _is_hf_dataset(data) or isinstance(data, Iterable):
        return Batches(data, converter, batch_size, what)
    raise InputError(f"{what}: a {type(data).__name__} is not data: give a path, 'digits', "
                     "(inputs, labels) arrays, or an iterable of (inputs, labels) batches")

