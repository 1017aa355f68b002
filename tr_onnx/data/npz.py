"""An ``.npz`` holding one array per model input (named after it) plus ``labels``.

``check_arrays`` is the rule every source of named arrays shares (the ``.npy`` folder too):
one array per model input plus ``labels``, the samples on axis 0, each input's shape and dtype
as the model takes it."""

from __future__ import annotations

import math
import os
import resource
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import LABELS, Dataset, Loaded, cast


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype,
         options) -> Loaded:
    del options  # an .npz says everything itself
    try:
        _check_sizes(path)
        with np.load(path, allow_pickle=False) as data:
            loaded = {k: data[k] for k in data.files}
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (give an .npz or 'digits')") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise InputError(f"{path}: not a readable .npz ({exc})") from None
    return Loaded(check_arrays(path, loaded, input_specs, label_kind, label_dtype), "npz")


def _check_sizes(path: Path) -> None:
    """Refuse an .npz before NumPy allocates what its members' headers declare (issue 35
    items 6, 7): a header's shape must match the bytes its member holds, and all the members
    must fit in the memory this process may still take. Raises ``InputError`` naming the
    member and the sizes; zipfile's own errors (not a zip: an empty file, a bare .npy) are the
    caller's to word."""
    declared = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename
            if not name.endswith(".npy"):
                raise InputError(f"{path}: member {name!r} is not an .npy array")
            with archive.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise InputError(f"{path}: member {name!r} is .npy format {version}; "
                                     "versions 1.0 and 2.0 are read")
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f)
                held = info.file_size - f.tell()
            if dtype.hasobject:
                raise InputError(f"{path}: member {name!r} holds Python objects ({dtype})")
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes != held:
                raise InputError(f"{path}: member {name!r} declares shape {list(shape)} of "
                                 f"{dtype} ({nbytes} bytes) but holds {held} bytes")
            declared[name] = nbytes
    total, free = sum(declared.values()), memory_available()
    if free is not None and total > free:
        largest = max(declared, key=declared.get)
        raise InputError(f"{path}: its arrays take {total} bytes in memory (member {largest!r}: "
                         f"{declared[largest]} bytes); this process may take {free} more")


def memory_available() -> int | None:
    """Bytes this process may still allocate: the smaller of the system's available memory and
    what its address-space limit (RLIMIT_AS) leaves; None where neither is known."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                limits.append(soft - int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_arrays(where, found: Mapping[str, np.ndarray], input_specs, label_kind: str,
                 label_dtype: np.dtype, convert: Callable = cast) -> Dataset:
    """``found`` (array name -> array, read from ``where``) as a data set for a model whose
    inputs are ``input_specs``: the names, the sample counts and each input's shape checked,
    each input made the model's dtype by ``convert(x, dtype, what)`` (``cast``: floating point
    to the wanted float type, at once; a source may defer it to batch time), the labels as
    ``label_kind`` wants them. Raises ``InputError`` naming ``where`` and the array."""
    names = [s.name for s in input_specs]
    missing = [k for k in [*names, LABELS] if k not in found]
    extra = sorted(k for k in found if k not in names and k != LABELS)
    if missing or extra:
        raise InputError(f"{where}: arrays {sorted(found)} do not match the model's inputs "
                         f"{names} plus {LABELS!r} (missing {missing}, extra {extra})")
    labels = found[LABELS]
    n = labels.shape[0] if labels.ndim else None
    if not n:
        raise InputError(f"{where}: {LABELS!r} has shape {list(labels.shape)}; need at least "
                         "one sample along axis 0")
    arrays = {}
    for spec in input_specs:
        x = found[spec.name]
        want = [n, *spec.shape[1:]]
        if x.ndim != len(spec.shape) or any(
                isinstance(d, int) and d != s for d, s in zip(want, x.shape, strict=True)):
            raise InputError(f"{where}: array {spec.name!r} has shape {list(x.shape)}; model "
                             f"input {spec.name!r} needs {want} ({n} samples, as in "
                             f"{LABELS!r})")
        arrays[spec.name] = convert(x, spec.dtype, f"{where}: array {spec.name!r}")
    if label_kind == "index":
        if labels.dtype.kind not in "iu":
            raise InputError(f"{where}: {LABELS!r} is {labels.dtype}; this loss needs integer "
                             "class indices")
        labels = labels.astype(np.int64, copy=False)
    else:
        labels = cast(labels, label_dtype, f"{where}: {LABELS!r}")
    return arrays, labels
