"""A folder of ``.npy`` files, one per model input (named after it) plus ``labels.npy``, memory-
mapped: a data set larger than memory trains, each batch read from the files when it is indexed.

The arrays are checked as an ``.npz``'s are (``npz.check_arrays``). Inputs stay on disk as
``MappedRows``: a split (``--val-split``) keeps row numbers, not rows, and a float64 file is cast
to the model's float type per batch. The labels (one value per sample for classification) are
read when they are checked and split."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import Loaded, cast
from .npz import check_arrays

SUFFIX = ".npy"


class MappedRows:
    """Rows ``rows`` (all, by default) of a memory-mapped ``array``, read from its file and cast
    to ``dtype`` when indexed (a ``Rows``)."""

    def __init__(self, array: np.memmap, dtype, rows: np.ndarray | None = None):
        self.array, self.dtype, self.rows = array, np.dtype(dtype), rows
        self.shape = (len(array) if rows is None else len(rows), *array.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, slice):  # row numbers, so that the rows are read now (a copy)
            idx = np.arange(*idx.indices(len(self)))
        if self.rows is not None:
            idx = self.rows[idx]
        return np.asarray(self.array[idx]).astype(self.dtype, copy=False)

    def subset(self, idx: np.ndarray) -> MappedRows:
        idx = np.asarray(idx)
        return MappedRows(self.array, self.dtype, idx if self.rows is None else self.rows[idx])

    def fingerprint(self) -> int:
        """The file's name, size and modification time, and which of its rows."""
        stat = os.stat(self.array.filename)
        crc = zlib.crc32(f"{self.array.filename}{stat.st_size}{stat.st_mtime_ns}".encode())
        if self.rows is not None:
            crc = zlib.crc32(np.ascontiguousarray(self.rows, np.int64).view(np.uint8), crc)
        return crc


def _mapped(x: np.memmap, dtype: np.dtype, what: str) -> MappedRows:
    cast(x[:0], dtype, what)  # the rule of ``cast``, checked on no rows: rows cast per batch
    return MappedRows(x, dtype)


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype,
         options) -> Loaded:
    del options  # the arrays say everything themselves
    found = {}
    for file in sorted(path.glob(f"*{SUFFIX}")):
        try:
            found[file.stem] = np.load(file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"{file}: not a readable .npy ({exc})") from None
    arrays, labels = check_arrays(path, found, input_specs, label_kind, label_dtype,
                                  convert=_mapped)
    return Loaded((arrays, labels), "npy_folder")
