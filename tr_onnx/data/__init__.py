"""Training data: load a data set shaped for a model's inputs, split it deterministically.

A data set is ``(arrays, labels)``: ``arrays`` maps each model input name to an array whose first
axis is the sample axis; ``labels`` has the same first axis. An "array" is a NumPy array, a
memory-mapped one, or a ``Rows`` (a source that reads or decodes rows when they are indexed:
images decoded per batch). ``"digits"`` is scikit-learn's bundled 8x8 digits (no download),
reshaped to the model's single input.

``load`` chooses the source by what ``--data`` points at (``SOURCES``, first match); each source
lives in its own module here and imports its libraries (Pillow, pyarrow, tokenizers, datasets)
only when it reads. ``--data-spec FILE.toml`` says what cannot be guessed: a table's label
column, an image size, a tokenizer; its ``kind`` key picks the source, and each source reads
its own ``[section]``.
"""

from __future__ import annotations

import functools
import importlib
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import InputError, TrOnnxError

LABELS = "labels"
LABEL_KINDS = ("index", "dense")
DIGITS_CLASSES = 10

Dataset = tuple[dict[str, np.ndarray], np.ndarray]


@runtime_checkable
class Rows(Protocol):
    """Samples read when indexed (``rows[idx]`` -> an ndarray of ``len(idx)`` samples), with
    the ``shape``/``dtype`` of the whole; ``subset(idx)`` is the same source over those rows
    (a split), ``fingerprint()`` a cheap CRC-32 of what identifies the data (its files and
    their sizes and times), recorded by checkpoints. Optionally ``for_epoch(seed, epoch)``:
    the rows a training epoch reads (an image folder's augmentation); the ``Trainer`` asks
    its training data only. The Trainer may index it from a background thread
    (``prefetch.Prefetcher``), one call at a time."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __len__(self) -> int: ...
    def __getitem__(self, idx) -> np.ndarray: ...
    def subset(self, idx: np.ndarray) -> Rows: ...
    def fingerprint(self) -> int: ...


@dataclass
class Loaded:
    """What a source read: the data set, and ``meta`` to keep beside the trained model
    (``write_meta``: a table's label mapping, an image folder's class names, the tokenizer's
    path and sequence length), which source read it, and ``notes``: what it chose that the user
    did not say (a table's label column), for the command line to print."""

    data: Dataset
    source: str
    meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Source:
    """A kind of data ``load`` can read: ``claims(path)`` says whether ``path`` looks like it
    (without reading much), ``module`` (under ``tr_onnx.data``) has ``load(path, input_specs,
    label_kind, label_dtype, options) -> Loaded`` and, optionally, ``add_arguments(group)``
    for its command-line flags."""

    name: str
    module: str
    claims: Callable[[Path], bool]


def _is_npz(path: Path) -> bool:
    return path.suffix == ".npz"


def _claims(module: str) -> Callable[[Path], bool]:
    """``tr_onnx.data.<module>.claims``, imported when first asked."""
    return lambda path: importlib.import_module(f"{__name__}.{module}").claims(path)


def _is_npy_folder(path: Path) -> bool:
    return path.is_dir() and (path / f"{LABELS}.npy").is_file()


def _is_table(path: Path) -> bool:
    return path.suffix.lower() in (".csv", ".parquet", ".pq")


SOURCES: list[Source] = [
    Source("npz", "npz", _is_npz),
    Source("npy_folder", "npy_folder", _is_npy_folder),
    Source("hf_dataset", "hf_dataset", _claims("hf_dataset")),
    Source("images", "images", _claims("images")),
    Source("table", "table", _is_table),  # a CSV is a table unless kind = "text" says not
    Source("text", "text", _claims("text")),
]


def load(spec: str | Path, input_specs, label_kind: str = "index", label_dtype=np.float32,
         options: Mapping[str, Any] | None = None) -> Loaded:
    """Read ``spec`` for a model whose inputs are ``input_specs`` with the first source of
    ``SOURCES`` that claims it (``options["kind"]`` names one instead). ``options``: the
    ``--data-spec`` file's contents (``read_spec``) and command-line flags; a source reads
    the keys of its own section. See ``load_dataset`` for the rest."""
    if label_kind not in LABEL_KINDS:
        raise ValueError(f"label_kind {label_kind!r}; valid: {', '.join(LABEL_KINDS)}")
    options = dict(options or {})
    if str(spec) == "digits":
        return Loaded(_digits(input_specs, label_kind, np.dtype(label_dtype)), "digits")
    path = Path(spec)
    kind = options.get("kind")
    if kind is not None:
        source = next((s for s in SOURCES if s.name == kind), None)
        if source is None:
            raise InputError(f"data kind {kind!r} (--data-spec): valid kinds are "
                             f"{[s.name for s in SOURCES]}")
    else:
        if not path.exists():
            raise InputError(f"{path}: no such file or folder (give a data file or folder, or "
                             f"'digits'; readable: {_kinds()})")
        source = next((s for s in SOURCES if s.claims(path)), None)
        if source is None:
            raise InputError(f"{path}: not a kind of data tr_onnx reads ({_kinds()}); "
                             "--data-spec FILE.toml with kind = ... names the kind")
    module = importlib.import_module(f"{__name__}.{source.module}")
    return module.load(path, input_specs, label_kind, np.dtype(label_dtype), options)


def _kinds() -> str:
    return ", ".join(s.name for s in SOURCES)


def read_spec(path: str | Path) -> dict[str, Any]:
    """``--data-spec FILE``: a TOML table (``kind = "table"``, then one ``[section]`` per
    source, e.g. ``[table] label = "species"``). A file that is not valid TOML is an
    ``InputError`` naming the file and the line."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InputError(f"--data-spec {path}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"--data-spec {path}: not a readable TOML file ({exc})") from None


def section(options: Mapping[str, Any], name: str, known: Mapping[str, type | tuple]) -> dict:
    """The ``[name]`` section of ``options`` checked against ``known`` (key -> its type(s)):
    an unknown key or a value of the wrong type is an ``InputError`` naming it."""
    values = options.get(name, {})
    if not isinstance(values, Mapping):
        raise InputError(f"--data-spec: [{name}] must be a table, got {values!r}")
    for key, value in values.items():
        if key not in known:
            raise InputError(f"--data-spec: [{name}] has no key {key!r}; known: "
                             f"{sorted(known)}")
        if not isinstance(value, known[key]):
            raise InputError(f"--data-spec: [{name}] {key} = {value!r} has the wrong type")
    return dict(values)


def add_arguments(group) -> None:
    """Every source's command-line flags (``Source.module``'s ``add_arguments``)."""
    for source in SOURCES:
        module = importlib.import_module(f"{__name__}.{source.module}")
        if hasattr(module, "add_arguments"):
            module.add_arguments(group)


def flag_options(options: Mapping[str, Any], args) -> dict[str, Any]:
    """``options`` with the sources' command-line flags laid over it: a flag whose ``dest`` is
    ``"section.key"`` (``add_arguments``), when given, sets ``options[section][key]``."""
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in options.items()}
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            name, key = dest.split(".", 1)
            values = merged.setdefault(name, {})
            if isinstance(values, dict):  # else section() names the bad [name]
                values[key] = value
    return merged


def write_meta(loaded: Loaded, model_path: str | Path) -> Path | None:
    """``loaded.meta`` as JSON beside the trained model (``<model>.data.json``), where a source
    recorded any: what turns the model's outputs back into the data's labels."""
    if not loaded.meta:
        return None
    import json

    path = Path(model_path).with_suffix(".data.json")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"source": loaded.source, **loaded.meta}, indent=1) + "\n")
    tmp.replace(path)
    return path


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
    return load(spec, input_specs, label_kind, label_dtype).data


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
    return {k: v.subset(idx) if isinstance(v, Rows) else v[idx]
            for k, v in arrays.items()}, labels[idx]


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


def cast(x: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Floating point to the wanted float type (float64 files are common); nothing else."""
    if x.dtype == dtype:
        return x
    if x.dtype.kind == "f" and dtype.kind == "f":
        return x.astype(dtype)
    raise InputError(f"{what} is {x.dtype}; expected {dtype}")
