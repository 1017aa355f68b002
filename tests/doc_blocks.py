"""The fenced code blocks of a docs page, and running its ```python blocks as a user would:
as written, in order, in one namespace, in a folder holding the model the pages assume
(model_zoo/mlp.onnx as model.onnx)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def blocks(page: Path, kind: str = "python") -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", page.read_text(), re.S | re.M)


def run_python_blocks(page: Path, folder: Path, monkeypatch, least: int) -> dict:
    """Run every ```python block of ``page`` in ``folder``; the namespace they leave. At least
    ``least`` blocks: a change to the fences cannot silently run nothing."""
    code = blocks(page)
    assert len(code) >= least, f"{page}: {len(code)} python blocks"
    shutil.copy(ROOT / "model_zoo" / "mlp.onnx", folder / "model.onnx")
    monkeypatch.chdir(folder)
    namespace: dict = {}
    for i, block in enumerate(code):
        exec(compile(block, f"{page}:python block {i + 1}", "exec"), namespace)
    return namespace
