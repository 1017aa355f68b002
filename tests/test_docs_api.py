"""docs/api.md's ```python blocks run verbatim, in order, in one namespace (as a reader pastes
them), in a fresh folder."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "api.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


def test_the_api_guide_has_its_examples():
    assert len(BLOCKS) >= 7  # a changed fence cannot make the test below run nothing


def test_every_python_block_of_the_api_guide_runs(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(BLOCKS, 1):
        try:
            exec(compile(block, f"docs/api.md block {i}", "exec"), namespace)
        except Exception:
            pytest.fail(f"docs/api.md block {i} failed:\n{block}\n{traceback.format_exc()}")
    assert (tmp_path / "mlp_trained.onnx").exists() and (tmp_path / "ckpt" /
                                                         "best.ckpt.npz").exists()
