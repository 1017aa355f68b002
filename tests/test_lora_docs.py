"""Every ```python block of docs/lora.md runs as written, in order, in one namespace, in a
folder holding the model the page assumes (model_zoo/mlp.onnx as model.onnx), and prints what
the page says it prints."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "lora.md"

pytest.importorskip("onnxruntime")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_every_python_block_of_the_lora_page_runs(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) >= 5  # a change to the fences cannot silently run nothing
    shutil.copy(ROOT / "model_zoo" / "mlp.onnx", tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE}:python block {i + 1}", "exec"), namespace)
    said = capsys.readouterr().out
    assert "[('0.weight', 'gemm_t', 64, 128), ('2.weight', 'gemm_t', 128, 64)]" in said
    assert "'4.weight', '4.bias']" in said
    assert said.count("True") == 3, said
    assert (tmp_path / "task_a.onnx_adapter").stat().st_size > 0
