"""docs/finetune.md runs as written: its ```python blocks in order in one namespace, and each
``tr-onnx`` line of its ```bash blocks through the CLI, in a temporary folder; the exports
have 5 outputs and run in onnxruntime as tr_onnx runs them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
from oracles import ort_run
from torchvision_models import models

import tr_onnx
from tr_onnx.cli import main

PAGE = Path(__file__).resolve().parent.parent / "docs" / "finetune.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_the_finetune_page_runs(tmp_path, monkeypatch, capsys):
    models()  # torchvision importable, as the page's reader has it
    python, bash = blocks("python"), blocks("bash")
    assert len(python) == 2 and len(bash) == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python[0], f"{PAGE}:python block 1", "exec"), namespace)
    lines = [line for line in bash[0].splitlines() if line.startswith("tr-onnx ")]
    assert len(lines) == 2
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "new head: Gemm '/fc/Gemm' (512 -> 5 classes, was 1000" in said
    assert "unfrozen after 1 epochs" in said
    exec(compile(python[1], f"{PAGE}:python block 2", "exec"), namespace)
    x = np.random.default_rng(2).standard_normal((3, 3, 64, 64)).astype(np.float32)
    for out in ("flowers_head.onnx", "flowers_all.onnx", "resnet18_5.onnx"):
        (exported,) = ort_run(out, {"x": x})
        (ours,) = tr_onnx.InferenceSession(out, backend="numpy").run(None, {"x": x})
        assert exported.shape == (3, 5)
        np.testing.assert_allclose(ours, exported, rtol=0, atol=1e-4)
