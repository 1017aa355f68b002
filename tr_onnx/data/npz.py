"""An ``.npz`` holding one array per model input (named after it) plus ``labels``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import LABELS, Loaded, cast


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype,
         options) -> Loaded:
    del options  # an .npz says everything itself
    try:
        with np.load(path, allow_pickle=False) as data:
            loaded = {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give an .npz or 'digits')") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"{path}: not a readable .npz ({exc})") from None
    names = [s.name for s in input_specs]
    missing = [k for k in [*names, LABELS] if k not in loaded]
    extra = sorted(k for k in loaded if k not in names and k != LABELS)
    if missing or extra:
        raise InputError(f"{path}: arrays {sorted(loaded)} do not match the model's inputs "
                         f"{names} plus {LABELS!r} (missing {missing}, extra {extra})")
    labels = loaded[LABELS]
    n = labels.shape[0] if labels.ndim else None
    if not n:
        raise InputError(f"{path}: {LABELS!r} has shape {list(labels.shape)}; need at least one "
                         "sample along axis 0")
    arrays = {}
    for spec in input_specs:
        x = loaded[spec.name]
        want = [n, *spec.shape[1:]]
        if x.ndim != len(spec.shape) or any(
                isinstance(d, int) and d != s for d, s in zip(want, x.shape, strict=True)):
            raise InputError(f"{path}: array {spec.name!r} has shape {list(x.shape)}; model "
                             f"input {spec.name!r} needs {want} ({n} samples, as in "
                             f"{LABELS!r})")
        arrays[spec.name] = cast(x, spec.dtype, f"{path}: array {spec.name!r}")
    if label_kind == "index":
        if labels.dtype.kind not in "iu":
            raise InputError(f"{path}: {LABELS!r} is {labels.dtype}; this loss needs integer "
                             "class indices")
        labels = labels.astype(np.int64, copy=False)
    else:
        labels = cast(labels, label_dtype, f"{path}: {LABELS!r}")
    return Loaded((arrays, labels), "npz")
