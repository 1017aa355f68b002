"""Text: a JSONL file (one JSON object a line; claimed by the suffix ``.jsonl``) or a CSV with a
header (``kind = "text"`` in ``--data-spec``: a CSV without it is a table), tokenised by a Hugging
Face ``tokenizer.json`` (``tokenizers``) into the model's sequence inputs.

``[text]`` keys: ``column`` (the text, default ``"text"``), ``label`` (default ``"label"``),
``tokenizer`` (the ``tokenizer.json``; or ``--tokenizer``), ``max_length`` (the sequence
length where the model's is free), ``task`` (``"classification"``, the default: one label per
text; ``"causal_lm"``: the labels are the next tokens), ``pad_id`` (default: the tokenizer's
padding id, else the id of ``[PAD]``/``<pad>``, else 0).

The model's inputs are matched by name (lower case): one containing ``attention_mask`` gets the
mask (1 on tokens, 0 on padding), one containing ``token_type`` the type ids, one containing
``position_ids`` the positions 0..T-1; the one input left gets the token ids. Texts are encoded
with the tokenizer's own special tokens and truncation (at T tokens), then padded on the right.

Causal LM: each text is encoded to T + 1 tokens; position t's label is token t + 1, and
``IGNORE_INDEX`` (-100, PyTorch's default) where that is padding -- train with
``LossSpec("cross_entropy", ignore_index=-100, class_axis=-1)`` for logits [N, T, V].
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import InputError
from . import Loaded, section

IGNORE_INDEX = -100
TASKS = ("classification", "causal_lm")
KEYS = {"column": str, "label": str, "tokenizer": str, "max_length": int, "task": str,
        "pad_id": int}
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>")


def claims(path: Path) -> bool:
    return path.suffix == ".jsonl" and path.is_file()


def add_arguments(group) -> None:
    group.add_argument("--tokenizer", default=None, dest="text.tokenizer",
                       metavar="tokenizer.json", help="text data: the Hugging Face tokenizer "
                       "(overrides [text] tokenizer)")


def load(path: Path, input_specs, label_kind: str, label_dtype: np.dtype, options) -> Loaded:
    opts = section(options, "text", KEYS)
    column, label = opts.get("column", "text"), opts.get("label", "label")
    task = _task(opts)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".csv":
        rows = _csv_rows(path)
    else:
        raise InputError(f"{path}: text data is a .jsonl or a .csv file")
    texts, labels = [], []
    for where, row in rows:
        texts.append(_field(row, column, where, str, "a string"))
        if task == "classification":
            labels.append(_field(row, label, where, (str, int, float), "a string or a number"))
    if not texts:
        raise InputError(f"{path}: no rows")
    return encode(texts, labels, input_specs, label_kind, label_dtype, options, str(path))


def _task(opts) -> str:
    task = opts.get("task", "classification")
    if task not in TASKS:
        raise InputError(f"--data-spec: [text] task = {task!r}; valid: {', '.join(TASKS)}")
    return task


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n}: not a JSON object ({exc})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{n}: a JSON {type(row).__name__}, not an object")
            yield f"{path}:{n}", row


def _csv_rows(path: Path):
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:  # line_num: the file line the row ends on (the header is line 1)
            yield f"{path}:{reader.line_num}", row


def _field(row, key: str, where: str, types, what: str):
    value = row.get(key)
    if value is None:
        raise InputError(f"{where}: no {key!r} (the columns there: {sorted(row)})")
    if not isinstance(value, types) or isinstance(value, bool):
        raise InputError(f"{where}: {key!r} is {value!r}, not {what}")
    return value


def encode(texts: Sequence[str], labels: Sequence, input_specs, label_kind: str,
           label_dtype: np.dtype, options, where: str) -> Loaded:
    """Tokenise ``texts`` into the model's inputs and make the labels (``labels``, one per
    text, for classification; ignored for a causal LM). ``where`` names the data in errors.
    The text of a Hugging Face data set comes here too."""
    opts = section(options, "text", KEYS)
    task = _task(opts)
    tokenizer, tokenizer_path = _tokenizer(opts, where)
    roles = input_roles(input_specs, where)
    ids_spec = next(s for s in input_specs if roles[s.name] == "ids")
    length = _length(ids_spec, opts, where)
    pad = _pad_id(tokenizer, opts)
    n_tokens = length + 1 if task == "causal_lm" else length
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=n_tokens)
    encodings = tokenizer.encode_batch(list(texts))
    n = len(texts)
    ids = np.full((n, n_tokens), pad, np.int64)
    mask = np.zeros((n, n_tokens), np.int64)
    types = np.zeros((n, n_tokens), np.int64)
    for i, e in enumerate(encodings):
        k = len(e.ids)
        ids[i, :k], mask[i, :k], types[i, :k] = e.ids, e.attention_mask, e.type_ids
    by_role = {"ids": ids[:, :length], "attention_mask": mask[:, :length],
               "token_type_ids": types[:, :length],
               "position_ids": np.broadcast_to(np.arange(length), (n, length))}
    arrays = {s.name: np.ascontiguousarray(by_role[roles[s.name]], dtype=s.dtype)
              for s in input_specs}
    meta = {"tokenizer": str(tokenizer_path.resolve()), "max_length": length, "task": task,
            "pad_id": pad, "inputs": roles}
    if task == "causal_lm":
        if label_kind != "index":
            raise InputError(f"{where}: a causal LM's labels are token ids: train with "
                             "cross_entropy (class_axis=-1, ignore_index=-100)")
        y = np.where(mask[:, 1:] == 1, ids[:, 1:], IGNORE_INDEX)
        meta["ignore_index"] = IGNORE_INDEX
    else:
        y, classes = label_array(labels, label_kind, label_dtype, where)
        if classes is not None:
            meta["classes"] = classes
    return Loaded((arrays, y), "text", meta)


def _tokenizer(opts, where: str):
    given = opts.get("tokenizer")
    if given is None:
        raise InputError(f"{where}: text needs a tokenizer: --tokenizer tokenizer.json, or "
                         "[text] tokenizer = \"tokenizer.json\" in --data-spec")
    path = Path(given)
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or bad file
        raise InputError(f"{path}: not a readable tokenizer.json ({exc})") from None


def input_roles(input_specs, where: str) -> dict[str, str]:
    """Each model input's role by its name (the module docstring's rule)."""
    roles, left = {}, []
    for s in input_specs:
        name = s.name.lower()
        if "attention_mask" in name:
            roles[s.name] = "attention_mask"
        elif "token_type" in name:
            roles[s.name] = "token_type_ids"
        elif "position_ids" in name:
            roles[s.name] = "position_ids"
        else:
            left.append(s.name)
    if len(left) != 1:
        raise InputError(f"{where}: model inputs {[s.name for s in input_specs]}: text feeds "
                         "one token-id input and, by name, inputs containing attention_mask, "
                         f"token_type or position_ids; {left or 'none'} left for the token ids")
    roles[left[0]] = "ids"
    for s in input_specs:
        if len(s.shape) != 2:
            raise InputError(f"{where}: model input {s.name!r} has shape {list(s.shape)}; text "
                             "inputs are [N, T]")
    return roles


def _length(spec, opts, where: str) -> int:
    fixed, given = spec.shape[1], opts.get("max_length")
    if isinstance(fixed, int):
        if given is not None and given != fixed:
            raise InputError(f"{where}: [text] max_length = {given} but model input "
                             f"{spec.name!r} has {fixed} positions")
        return fixed
    if given is None or given < 1:
        raise InputError(f"{where}: model input {spec.name!r} has a free sequence length "
                         f"({spec.shape[1]!r}): give [text] max_length = T in --data-spec")
    return given


def _pad_id(tokenizer, opts) -> int:
    if "pad_id" in opts:
        return opts["pad_id"]
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    for token in PAD_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    return 0


def label_array(values: Sequence, label_kind: str, label_dtype: np.dtype,
                where: str) -> tuple[np.ndarray, list[str] | None]:
    """One label per row: integers (or strings of integers, as a CSV holds them) are class
    indices; other strings are classes numbered in sorted order (returned, for the meta);
    for a loss of dense targets, numbers as ``label_dtype``."""
    if label_kind == "dense":
        try:
            return np.asarray([float(v) for v in values], dtype=label_dtype), None
        except ValueError as exc:
            raise InputError(f"{where}: labels must be numbers for this loss ({exc})") from None
    ints = [_as_int(v) for v in values]
    if all(v is not None for v in ints):
        return np.asarray(ints, np.int64), None
    if not all(isinstance(v, str) for v in values):
        i = next(i for i, v in enumerate(values) if not isinstance(v, (str, int)))
        raise InputError(f"{where}: label {values[i]!r} (row {i + 1}) is not a class: give "
                         "integers or strings")
    classes = sorted(set(values))
    index = {c: k for k, c in enumerate(classes)}
    return np.asarray([index[v] for v in values], np.int64), classes


def _as_int(value) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None
