"""Export real-export model sets of the tests (tests/real_export_sets.py) to a folder, for the
GPU check's real-export stage (scripts/gpu_stages.py, ``5d-real-exports``): the lent GPU
machine has no transformers, tf2onnx or torchvision, so the models are exported here, with the
exporters users have, and carried.

    python scripts/export_real_sets.py .gpu-real              # the GPU check's default sets
    python scripts/export_real_sets.py DIR convnet-dynamo ... # chosen sets

Per set: ``<id>.onnx``, ``<id>.npz`` (its batches: ``k<step>/<input>`` and ``k<step>/labels``)
and a row of ``sets.json`` (learning rate, class axis, TrainingSession keywords), what
``gpu_check.real_export_parity`` needs to train it on both backends.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GPU_SETS = ("convnet-dynamo", "hf-bert-classic", "llama-opset23", "bilstm2-classic")
"""The sets the GPU check trains: a torchvision-shaped CNN from the dynamo exporter, a Hugging
Face BERT, a Llama at opset 23 and a bidirectional LSTM (issue 30)."""
STEPS = 3


def write_set(folder: Path, case: str, model: Path, batches, lr: float, class_axis: int = 1,
              session_kwargs: dict | None = None) -> dict:
    """One set into ``folder``: the model as ``<case>.onnx``, ``batches(k)`` -> (feed,
    labels) for k < STEPS as ``<case>.npz``; returns its ``sets.json`` row."""
    target = folder / f"{case}.onnx"
    if model != target:
        target.write_bytes(model.read_bytes())
    arrays = {}
    for k in range(STEPS):
        feed, labels = batches(k)
        arrays |= {f"k{k}/{name}": np.asarray(x) for name, x in feed.items()}
        arrays[f"k{k}/labels"] = np.asarray(labels)
    np.savez(folder / f"{case}.npz", **arrays)
    return {"lr": lr, "class_axis": class_axis, "session_kwargs": session_kwargs or {},
            "steps": STEPS}


def write_index(folder: Path, rows: dict) -> None:
    (folder / "sets.json").write_text(json.dumps(rows, indent=1) + "\n")


def export(folder: Path, ids=GPU_SETS) -> dict:
    """Export each set of ``ids`` into ``folder`` and return ``sets.json``'s rows."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    from real_export_sets import CATALOGUE  # the tests' catalogue: torch, transformers, tf

    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for case in ids:
        if case not in CATALOGUE:
            raise SystemExit(f"no set {case!r}; the catalogue has: {', '.join(CATALOGUE)}")
        export_set = CATALOGUE[case]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_set.write(folder)
        rows[case] = write_set(folder, case, path, export_set.batches, export_set.lr,
                               export_set.class_axis, export_set.session_kwargs)
    write_index(folder, rows)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("ids", nargs="*", default=list(GPU_SETS))
    args = p.parse_args(argv)
    for case in export(args.folder, args.ids):
        print(f"{args.folder / case}.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
