"""A data set saved by Hugging Face ``datasets`` (``Dataset.save_to_disk``): a folder holding
``dataset_info.json`` and ``state.json``, or a ``DatasetDict``'s folder holding
``dataset_dict.json`` (its ``"train"`` split is read, or ``[hf_dataset] split``; each split is
a folder of its own, so ``--val-data DICT/validation`` reads the validation split).

The columns say how the data reaches the model, in this order:
- a column named after every model input: those columns, as they are (shapes and dtypes
  checked, floating point cast to the input's);
- else an image column (the ``datasets.Image`` feature, or ``[hf_dataset] image``): decoded
  per batch and preprocessed as an image folder's images (``[images]`` keys, ``images.py``);
- else a text column (``[text] column``, default ``"text"``): tokenised as text data
  (``[text]`` keys, ``text.py``).
Labels: ``[hf_dataset] label``, else the column ``label`` or ``labels``; a ``ClassLabel``
column's names go beside the trained model, string labels are mapped as text labels are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InputError
from . import Loaded, cast, section
from .images import ImageRows, class_labels, preprocess_for, preprocess_meta
from .text import KEYS as TEXT_KEYS
from .text import encode, label_array

KEYS = {"split": str, "label": str, "image": str}
DEFAULT_SPLIT = "train"


def claims(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype, options) -> Loaded:
    opts = section(options, "hf_dataset", KEYS)
    ds, where = _open(path, opts)
    columns = ds.column_names
    names = [s.name for s in input_specs]
    label = _label_column(ds, opts, where)
    if all(n in columns for n in names):
        if label is None:
            raise InputError(f"{where}: no label column: 'label', 'labels' or "
                             f"[hf_dataset] label (columns: {columns})")
        return _columns(ds, input_specs, label, label_kind, label_dtype, where)
    image = opts.get("image") or next((c for c, f in ds.features.items()
                                       if type(f).__name__ == "Image"), None)
    if image is not None:
        if label is None:
            raise InputError(f"{where}: images need a label column: 'label', 'labels' or "
                             f"[hf_dataset] label (columns: {columns})")
        return _images(ds, image, input_specs, label, label_kind, label_dtype, options, where)
    text = section(options, "text", TEXT_KEYS).get("column", "text")
    if text in columns:
        texts = ds[text][:]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise InputError(f"{where}: row {bad} (0-based): {text!r} is {texts[bad]!r}, not a "
                             "string")
        labels = ds[label][:] if label is not None else []
        loaded = encode(texts, labels, input_specs, label_kind, label_dtype, options, where)
        if label is not None:
            _class_names(ds, label, loaded.meta)
        return Loaded(loaded.data, "hf_dataset", loaded.meta)
    raise InputError(f"{where}: columns {columns}: none named after every model input "
                     f"{names}, no image column, no text column {text!r}")


def _open(path: Path, opts):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise InputError(f"{path}: not a readable saved data set ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = opts.get("split") or (DEFAULT_SPLIT if DEFAULT_SPLIT in ds or len(splits) != 1
                                      else splits[0])
        if split not in ds:
            raise InputError(f"{path}: no split {split!r}; its splits: {splits} "
                             "([hf_dataset] split = ...)")
        ds, where = ds[split], f"{path} (split {split!r})"
    elif opts.get("split"):
        raise InputError(f"{path}: a single data set, not a DatasetDict: [hf_dataset] split "
                         "does not apply")
    else:
        where = str(path)
    if len(ds) == 0:
        raise InputError(f"{where}: no rows")
    return ds, where


def _label_column(ds, opts, where: str) -> str | None:
    given = opts.get("label")
    if given is not None:
        if given not in ds.column_names:
            raise InputError(f"{where}: no label column {given!r}; columns: {ds.column_names}")
        return given
    return next((c for c in ("label", "labels") if c in ds.column_names), None)


def _numpy_column(ds, name: str) -> np.ndarray:
    """Column ``name`` as one array in its stored dtype (datasets' numpy format would turn
    float64 into float32); rows of different lengths give an object array."""
    leaf = ds.features[name]
    while hasattr(leaf, "feature"):  # a List or Sequence of values
        leaf = leaf.feature
    try:
        dtype = np.dtype(getattr(leaf, "dtype", "string"))
    except TypeError:  # "string" and other types numpy does not name
        dtype = None
    kwargs = {"dtype": dtype} if dtype is not None and dtype.kind in "biuf" else {}
    return ds.select_columns([name]).with_format("numpy", **kwargs)[:][name]


def _labels(ds, label: str, label_kind: str, label_dtype: np.dtype, where: str):
    """(labels, class names or None) of column ``label``: a ``ClassLabel``'s names; strings
    numbered in sorted order; numbers as they are (token labels [N, T] too)."""
    feature = ds.features[label]
    names = list(feature.names) if type(feature).__name__ == "ClassLabel" else None
    y = _numpy_column(ds, label)
    what = f"{where}: label column {label!r}"
    if y.dtype.kind in "USO":
        if y.dtype.kind == "O" or label_kind == "dense":
            raise InputError(f"{what}: rows of different lengths, or strings where this loss "
                             "needs numbers")
        return label_array(y.tolist(), label_kind, label_dtype, what)
    if label_kind == "index":
        if y.dtype.kind not in "iu":
            raise InputError(f"{what} is {y.dtype}; this loss needs integer class indices")
        return y.astype(np.int64), names
    if names is not None:
        return class_labels(y.astype(np.int64), len(names), label_kind, label_dtype), names
    return cast(y, label_dtype, what) if y.dtype.kind == "f" else y.astype(label_dtype), None


def _class_names(ds, label: str, meta: dict) -> None:
    feature = ds.features[label]
    if type(feature).__name__ == "ClassLabel":
        meta["classes"] = list(feature.names)


def _columns(ds, input_specs, label, label_kind, label_dtype, where: str) -> Loaded:
    y, classes = _labels(ds, label, label_kind, label_dtype, where)
    arrays = {}
    for spec in input_specs:
        x = _numpy_column(ds, spec.name)
        if x.dtype == object:
            raise InputError(f"{where}: column {spec.name!r} has rows of different lengths; "
                             f"model input {spec.name!r} needs {list(spec.shape)}")
        want = [len(y), *spec.shape[1:]]
        if x.ndim != len(spec.shape) or any(
                isinstance(d, int) and d != s for d, s in zip(want, x.shape, strict=True)):
            raise InputError(f"{where}: column {spec.name!r} has shape {list(x.shape)}; model "
                             f"input {spec.name!r} needs {want}")
        if spec.dtype.kind in "iu" and x.dtype.kind in "iu":
            x = x.astype(spec.dtype, copy=False)
        arrays[spec.name] = cast(x, spec.dtype, f"{where}: column {spec.name!r}")
    return Loaded((arrays, y), "hf_dataset", {"classes": classes} if classes else {})


def _images(ds, column: str, input_specs, label, label_kind, label_dtype, options,
            where: str) -> Loaded:
    spec, prep = preprocess_for(input_specs, options, where)
    y, classes = _labels(ds, label, label_kind, label_dtype, where)
    n = len(ds)
    plain = ds.select_columns([column])

    def open_image(i):
        image = plain[int(i)][column]
        if image is None:
            raise ValueError("no image")
        return image

    rows = ImageRows(range(n), open_image, [f"{where} row {i} column {column!r}"
                                            for i in range(n)],
                     np.arange(n), prep, spec.dtype, f"{where}:{ds._fingerprint}")
    meta = {**preprocess_meta(prep), **({"classes": classes} if classes else {})}
    return Loaded(({spec.name: rows}, y), "hf_dataset", meta)
