"""Training data: load a data set shaped for a model's inputs, split it deterministically.

A data set is ``(arrays, labels)``: ``arrays`` maps each model input name to an array whose first
axis is the sample axis; ``labels`` has the same first axis. ``"digits"`` is scikit-learn's
bundled 8x8 digits (no download), reshaped to the model's single input.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np

from .errors import InputError, TrOnnxError

LABELS = "labels"
LABEL_KINDS = ("index", "dense")
DIGITS_CLASSES = 10

Dataset = tuple[dict[str, np.ndarray], np.ndarray]


def load_dataset(spec: str | Path, input_specs, label_kind: str = "index",
                 label_dtype=np.float32) -> Dataset:
    """Load ``spec`` as ``(arrays, labels)`` for a model whose inputs are ``input_specs``.

    ``spec``: a path to an .npz holding one array per model input (named after it) plus
    ``labels``, or ``"digits"`` (scikit-learn's 8x8 digits scaled to [0, 1], reshaped to the
    model's single input with the batch dimension free). ``input_specs``: the model's
    ``InputSpec`` list (``TrainingSession.imported.inputs``). ``label_kind``: ``"index"`` for
    integer class indices (returned as int64), ``"dense"`` for targets of the model output's
    shape (returned as ``label_dtype``; digits become one-hot rows).

    Raises ``InputError`` naming the file and the missing/extra arrays, or the input whose
    shape or dtype does not match.
    """
    if label_kind not in LABEL_KINDS:
        raise ValueError(f"label_kind {label_kind!r}; valid: {', '.join(LABEL_KINDS)}")
    if str(spec) == "digits":
        return _digits(input_specs, label_kind, np.dtype(label_dtype))
    return _npz(Path(spec), input_specs, label_kind, np.dtype(label_dtype))


def split(arrays: dict[str, np.ndarray], labels: np.ndarray, val_fraction: float,
          seed: int = 0) -> tuple[Dataset, Dataset]:
    """Split into ``(train, val)``: a permutation from ``np.random.default_rng(seed)``, the
    first ``round(n * val_fraction)`` samples of it for validation. The same arguments give the
    same split on every run and platform."""
    n = len(labels)
    n_val = round(n * val_fraction)
    if not 0 < val_fraction < 1 or n_val < 1 or n_val >= n:
        raise ValueError(f"val_fraction {val_fraction} of {n} samples leaves no training or no "
                         "validation sample; use 0 < val_fraction < 1")
    order = np.random.default_rng(seed).permutation(n)
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
    return _take(arrays, labels, train_idx), _take(arrays, labels, val_idx)


def _take(arrays: dict[str, np.ndarray], labels: np.ndarray, idx: np.ndarray) -> Dataset:
    return {k: v[idx] for k, v in arrays.items()}, labels[idx]


def num_samples(data: Dataset) -> int:
    return len(data[1])


# ---- sources -------------------------------------------------------------------------------

@functools.cache
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 64] float32 in [0, 1], labels [N] int64), read-only, parsed once."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise TrOnnxError("the 'digits' data set needs scikit-learn: "
                          "pip install 'tr_onnx[train]'") from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = digits.target.astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


def _digits(input_specs, label_kind: str, label_dtype: np.dtype) -> Dataset:
    if len(input_specs) != 1:
        raise InputError(f"'digits' feeds one input; the model has {len(input_specs)}: "
                         f"{[s.name for s in input_specs]} (use an .npz)")
    (spec,) = input_specs
    x, y = _digits_raw()
    n, features = x.shape
    dims = _sample_dims(spec, features)
    if spec.dtype.kind != "f":
        raise InputError(f"'digits' is floating point; model input {spec.name!r} is "
                         f"{spec.dtype}")
    y = np.eye(DIGITS_CLASSES, dtype=label_dtype)[y] if label_kind == "dense" else y.copy()
    return {spec.name: x.reshape(n, *dims).astype(spec.dtype)}, y


def _sample_dims(spec, features: int) -> tuple[int, ...]:
    """The per-sample shape of ``spec`` holding ``features`` values (one symbolic dim besides
    the batch dim is solved for)."""
    rest = list(spec.shape[1:])
    fixed = int(np.prod([d for d in rest if isinstance(d, int)]))
    free = [i for i, d in enumerate(rest) if not isinstance(d, int)]
    if len(free) == 1 and fixed and features % fixed == 0:
        rest[free[0]] = features // fixed
    elif free or fixed != features:
        raise InputError(f"'digits' has {features} features per sample (8x8 images); model "
                         f"input {spec.name!r} has shape {list(spec.shape)}, which they cannot "
                         "be reshaped to with the batch dimension free")
    return tuple(rest)


def _npz(path: Path, input_specs, label_kind: str, label_dtype: np.dtype) -> Dataset:
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
        arrays[spec.name] = _cast(x, spec.dtype, f"{path}: array {spec.name!r}")
    if label_kind == "index":
        if labels.dtype.kind not in "iu":
            raise InputError(f"{path}: {LABELS!r} is {labels.dtype}; this loss needs integer "
                             "class indices")
        labels = labels.astype(np.int64, copy=False)
    else:
        labels = _cast(labels, label_dtype, f"{path}: {LABELS!r}")
    return arrays, labels


def _cast(x: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Floating point to the wanted float type (float64 files are common); nothing else."""
    if x.dtype == dtype:
        return x
    if x.dtype.kind == "f" and dtype.kind == "f":
        return x.astype(dtype)
    raise InputError(f"{what} is {x.dtype}; expected {dtype}")
