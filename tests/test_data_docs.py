"""Every ```python block of docs/data.md runs as written, in order, in one namespace, in a
folder holding the model the page assumes (model_zoo/mlp.onnx as model.onnx)."""

from __future__ import annotations

from doc_blocks import ROOT, run_python_blocks

PAGE = ROOT / "docs" / "data.md"


def test_every_python_block_of_the_data_page_runs(tmp_path, monkeypatch, capsys):
    run_python_blocks(PAGE, tmp_path, monkeypatch, least=5)
    said = capsys.readouterr().out
    assert "[('input', ['batch', 64])]" in said
    assert "pets.csv table {'input': (300, 64)} (300,)" in said
    assert "'classes': ['cat', 'dog', 'fish']" in said
    assert "train_npy npy_folder {'input': (10000, 64)} (10000,)" in said
