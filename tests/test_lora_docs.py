"""Every ```python block of docs/lora.md runs as written, in order, in one namespace, in a
folder holding the model the page assumes (model_zoo/mlp.onnx as model.onnx), and prints what
the page says it prints."""

from __future__ import annotations

import pytest
from doc_blocks import ROOT, run_python_blocks

PAGE = ROOT / "docs" / "lora.md"

pytest.importorskip("onnxruntime")


def test_every_python_block_of_the_lora_page_runs(tmp_path, monkeypatch, capsys):
    run_python_blocks(PAGE, tmp_path, monkeypatch, least=5)
    said = capsys.readouterr().out
    assert "[('0.weight', 'gemm_t', 64, 128), ('2.weight', 'gemm_t', 128, 64)]" in said
    assert "'4.weight', '4.bias']" in said
    assert said.count("True") == 3, said
    assert (tmp_path / "task_a.onnx_adapter").stat().st_size > 0
