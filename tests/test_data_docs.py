"""Every ```python block of docs/data.md runs as written, in order, in one namespace, in a
folder holding the model the page assumes (model_zoo/mlp.onnx as model.onnx)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "data.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_every_python_block_of_the_data_page_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) >= 5  # a change to the fences cannot silently run nothing
    shutil.copy(ROOT / "model_zoo" / "mlp.onnx", tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE}:python block {i + 1}", "exec"), namespace)
    said = capsys.readouterr().out
    assert "[('input', ['batch', 64])]" in said
    assert "pets.csv table {'input': (300, 64)} (300,)" in said
    assert "'classes': ['cat', 'dog', 'fish']" in said
    assert "train_npy npy_folder {'input': (10000, 64)} (10000,)" in said
