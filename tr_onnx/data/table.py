"""A CSV or Parquet table (read with pyarrow): feature columns -> the model's single float input
``[N, F]``, one label column (several for a multi-target regression) -> the labels.

Which columns (``--data-spec``'s ``[table]``): ``features = [...]`` (default: every column but
the labels; a column with no number in it, such as a name, is left out and said so), ``label``
(default: the column ``label``, else ``labels``, else the last column; which one was taken is
said). Text labels are classes, numbered in sorted order; the mapping is kept beside the trained
model. Numeric labels are class indices for cross-entropy (whole numbers), targets otherwise
(``[N, K]`` for K label columns). Rows are counted as a spreadsheet shows them: in a CSV the
header is row 1, so the first sample is row 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InputError, TrOnnxError
from . import Loaded, section

KINDS = {".csv": "CSV", ".parquet": "Parquet", ".pq": "Parquet"}
DEFAULT_LABELS = ("label", "labels")
KNOWN = {"features": list, "label": (str, list), "delimiter": str}
# a number as a CSV writes it, so that a text column holding numbers is told from one of names
NUMBER = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$|^\s*[-+]?(inf|nan)\s*$"


def _read(path: Path, delimiter: str):
    kind = KINDS.get(path.suffix.lower(), "CSV")  # a --data-spec kind = "table" of any name
    try:
        import pyarrow as pa
    except ImportError:
        raise TrOnnxError(f"{path}: reading a {kind} table needs pyarrow: pip install "
                          "'tr_onnx[data]'") from None

    try:
        if kind == "CSV":
            from pyarrow import csv

            return csv.read_csv(path, parse_options=csv.ParseOptions(delimiter=delimiter),
                                # an empty text cell is missing, as an empty number cell is
                                convert_options=csv.ConvertOptions(strings_can_be_null=True)), kind
        from pyarrow import parquet

        return parquet.read_table(path), kind
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable {kind} file ({exc})") from None


class _Table:
    """The table read from ``path`` and how to name its rows in errors."""

    def __init__(self, path: Path, table, kind: str):
        self.path, self.table, self.kind = path, table, kind
        self.columns = table.column_names

    def row(self, i: int) -> str:
        """Sample ``i`` (0-based) as a spreadsheet numbers it."""
        return f"row {i + 2}" if self.kind == "CSV" else f"row {i + 1}"

    def error(self, column: str, i: int, what: str) -> InputError:
        header = " (the header is row 1)" if self.kind == "CSV" else ""
        return InputError(f"{self.path}: column {column!r}, {self.row(i)}{header}: {what}")

    def column(self, name: str):
        if name not in self.columns:
            raise InputError(f"{self.path}: no column {name!r}; the columns are "
                             f"{self.columns}")
        return self.table.column(name)

    def numbers(self, name: str) -> np.ndarray:
        """Column ``name`` as float64, every value present: a missing value or a text one is
        an error naming the first such row."""
        import pyarrow as pa
        import pyarrow.compute as pc

        col = self.column(name)
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
                or pa.types.is_boolean(col.type)):
            bad = _first(pc.invert(pc.match_substring_regex(col, NUMBER)).fill_null(False)) \
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) else 0
            if bad is None:  # numbers written as text (a Parquet string column)
                col = pc.cast(col, pa.float64())
            else:
                raise self.error(name, bad, f"{col[bad].as_py()!r} is not a number (the column is "
                                 f"{col.type}); features must be numeric")
        missing = col.is_null()
        if pa.types.is_floating(col.type):
            missing = pc.or_(missing, pc.is_nan(col))
        bad = _first(missing)
        if bad is not None:
            raise self.error(name, bad, "missing value; fill or drop the rows with missing "
                             "values")
        return col.to_numpy().astype(np.float64)

    def is_text(self, name: str) -> bool:
        """A text column with no number in it (names, ids): left out of the default features."""
        import pyarrow as pa
        import pyarrow.compute as pc

        col = self.table.column(name)
        if pa.types.is_dictionary(col.type):
            return True
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            return False
        return not pc.any(pc.match_substring_regex(col, NUMBER)).as_py()


def _first(mask) -> int | None:
    """The index of the first true value of a pyarrow boolean array, or None."""
    import pyarrow.compute as pc

    idx = pc.index(mask, True).as_py()
    return None if idx < 0 else idx


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype,
         options) -> Loaded:
    opts = section(options, "table", KNOWN)
    table = _Table(path, *_read(path, opts.get("delimiter", ",")))
    notes = []
    label_names = _label_names(table, opts.get("label"), notes)
    if "features" in opts:
        features = [str(f) for f in opts["features"]]
        for name in features:
            table.column(name)
            if name in label_names:
                raise InputError(f"{path}: column {name!r} is both a feature and the label")
    else:
        rest = [c for c in table.columns if c not in label_names]
        text = [c for c in rest if table.is_text(c)]
        features = [c for c in rest if c not in text]
        if text:
            notes.append(f"{path}: text columns {text} left out of the features ([table] "
                         "features = [...] lists them)")
    if not features:
        raise InputError(f"{path}: no feature columns (the columns are {table.columns}, the "
                         f"label {label_names})")
    spec = _single_input(path, input_specs, len(features))
    x = np.empty((table.table.num_rows, len(features)), spec.dtype)
    for j, name in enumerate(features):
        x[:, j] = table.numbers(name)
    labels, meta = _labels(table, label_names, label_kind, label_dtype)
    if not len(x):
        raise InputError(f"{path}: no rows; need at least one sample")
    return Loaded(({spec.name: x}, labels), "table",
                  {"label": label_names[0] if len(label_names) == 1 else label_names,
                   "features": features, **meta}, notes)


def _label_names(table: _Table, given, notes: list[str]) -> list[str]:
    if given is not None:
        names = [given] if isinstance(given, str) else [str(g) for g in given]
        for name in names:
            table.column(name)
        return names
    name = next((c for c in DEFAULT_LABELS if c in table.columns), None)
    why = f"the column named {name!r}"
    if name is None:
        name, why = table.columns[-1], "the last column"
    notes.append(f"{table.path}: labels from column {name!r} ({why}; [table] label = ... "
                 "chooses another)")
    return [name]


def _single_input(path: Path, input_specs, width: int):
    if len(input_specs) != 1:
        raise InputError(f"{path}: a table feeds one input; the model has "
                         f"{[s.name for s in input_specs]}")
    (spec,) = input_specs
    if len(spec.shape) != 2 or spec.dtype.kind != "f" or \
            isinstance(spec.shape[1], int) and spec.shape[1] != width:
        raise InputError(f"{path}: {width} feature columns make [N, {width}] values; model "
                         f"input {spec.name!r} is {spec.dtype} {list(spec.shape)} ([table] "
                         "features = [...] chooses the columns)")
    return spec


def _labels(table: _Table, names: list[str], label_kind: str, label_dtype: np.dtype):
    """(labels, meta): text labels as class indices in sorted order (meta: the classes)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first = table.column(names[0])
    if len(names) == 1 and not (pa.types.is_integer(first.type)
                                or pa.types.is_floating(first.type)):
        name = names[0]
        bad = _first(first.is_null())
        if bad is not None:
            raise table.error(name, bad, "missing label")
        values = pc.cast(first, pa.string()) if not pa.types.is_dictionary(first.type) else \
            first.cast(pa.string())
        classes = sorted(pc.unique(values).to_pylist())
        if label_kind != "index":
            raise InputError(f"{table.path}: column {name!r} holds text labels ({classes[:5]}"
                             "...), class names; this loss needs numeric targets (a "
                             "classification loss such as cross_entropy takes class names)")
        index = pc.index_in(values, value_set=pa.array(classes, pa.string()))
        return index.to_numpy().astype(np.int64), {"classes": classes}
    y = np.stack([table.numbers(name) for name in names], axis=1)
    if label_kind == "index":
        if len(names) != 1:
            raise InputError(f"{table.path}: {len(names)} label columns {names}; class labels "
                             "are one column")
        whole = y[:, 0] == np.round(y[:, 0])
        if not whole.all():
            i = int(np.argmin(whole))
            raise table.error(names[0], i, f"label {y[i, 0]} is not a class index (a whole "
                              "number); use a regression loss (--loss mse) for numeric targets")
        return y[:, 0].astype(np.int64), {}
    return y.astype(label_dtype), {}
