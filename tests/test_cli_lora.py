"""``tr-onnx train --lora`` (issue 33): a BERT-style classifier exported by torch trains LoRA
adapters from the command line, and its four files serve in onnxruntime as the Python API's
exports do (tests/test_lora.py checks those against PyTorch + peft).

Oracle: onnxruntime. The merged model (``--out``) equals the adapter model run with the
``.onnx_adapter`` file active, within 1e-5; without an active adapter the adapter model gives
the base model's output exactly; the ``.lora.npz`` adapters put back on the base
(``apply_lora``) equal the merged model too. A run stopped after one epoch and resumed with the
same flags ends where one uninterrupted run ends, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import real_exports as rx

from tr_onnx.cli import main
from tr_onnx.finetune.lora import apply_lora

ort = pytest.importorskip("onnxruntime")

SAMPLES = 24
LORA = "rank=4,alpha=8,targets=query|value"


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    path = rx.export(rx.build("bert", "classic"), "bert", "classic", folder / "bert.onnx")
    feed = rx.example_inputs("bert", seed=1, batch=SAMPLES)
    np.savez(folder / "text.npz", **feed, labels=rx.example_labels("bert", 1, SAMPLES))
    return path, folder / "text.npz", feed


def _train(bert, out, *extra) -> int:
    path, data, _ = bert
    return main(["train", str(path), "--data", str(data), "--lora", LORA, "--optimizer", "sgd",
                 "--lr", "0.5", "--batch-size", "8", "--val-split", "0", "--no-progress",
                 "--backend", "numpy", "--out", str(out), *extra])


def _run(model, feed, adapter=None):
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    options = ort.RunOptions()
    if adapter is not None:
        options.add_active_adapter(adapter)
    return session.run(None, feed, options)[0]


def test_lora_from_the_command_line_writes_four_files_that_serve_alike(bert, tmp_path):
    path, _, feed = bert
    out = tmp_path / "tuned.onnx"
    assert _train(bert, out, "--epochs", "2") == 0
    merged = onnx.load(out)
    base = onnx.load(path)
    assert [n.name for n in merged.graph.node] == [n.name for n in base.graph.node]
    assert {i.name for i in merged.graph.initializer} == {i.name for i in base.graph.initializer}
    tuned, before = _run(out, feed), _run(path, feed)
    assert np.max(np.abs(tuned - before)) > 1e-3  # the adapters moved the outputs
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "tuned.onnx_adapter"))
    served = tmp_path / "tuned.adapter_model.onnx"
    np.testing.assert_allclose(_run(served, feed, adapter), tuned, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(_run(served, feed), before)
    reapplied, _ = apply_lora(path, tmp_path / "tuned.lora.npz")
    reapplied_path = tmp_path / "reapplied.onnx"
    onnx.save(reapplied, reapplied_path)
    np.testing.assert_allclose(_run(reapplied_path, feed), tuned, atol=1e-5, rtol=0)


def test_a_lora_run_resumes_with_the_same_flags_bit_for_bit(bert, tmp_path):
    straight = tmp_path / "straight.onnx"
    assert _train(bert, straight, "--epochs", "2") == 0
    resumed = tmp_path / "resumed.onnx"
    ckpt = str(tmp_path / "ckpt")
    assert _train(bert, resumed, "--epochs", "1", "--checkpoint-dir", ckpt) == 0
    assert _train(bert, resumed, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume") == 0
    a = {i.name: i.raw_data for i in onnx.load(straight).graph.initializer}
    b = {i.name: i.raw_data for i in onnx.load(resumed).graph.initializer}
    assert a == b


def test_lora_refuses_the_options_it_replaces(bert, tmp_path, capsys):
    assert _train(bert, tmp_path / "x.onnx", "--num-classes", "3") != 0
    assert "--lora" in capsys.readouterr().err
