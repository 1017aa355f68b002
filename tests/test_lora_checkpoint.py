"""A LoRA run's checkpoint holds the trained tensors and the base model's hash, not the model
(issue 33): ``TrainingSession(lora=info)`` writes it, ``from_checkpoint(path, base=...)`` and
``tr-onnx train --resume`` (MODEL the base, the same ``--lora``) rebuild the LoRA model from
the base and continue.

Oracles: the uninterrupted run (a resumed one ends with the same losses and weights, bit for
bit); hashlib's sha256 of the base graph (the hashes a wrong base is refused with); the file
sizes on disk (the tiny Llama of ``real_exports.py``: a LoRA checkpoint is under a quarter of
the same run's full checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import zipfile

import numpy as np
import onnx
import pytest
import real_exports as rx
from onnx import numpy_helper

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.errors import CheckpointError, ModelLoadError
from tr_onnx.finetune.lora import add_lora

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS, STOP = 6, 3  # micro-batches in all, and where the interrupted run stops


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return rx.export(rx.build("llama", "classic"), "llama", "classic", folder / "llama.onnx")


def _session(model, info, grad_accumulation=1, lora=True) -> tr_onnx.TrainingSession:
    return tr_onnx.TrainingSession(
        model, loss=tr_onnx.LossSpec("cross_entropy", class_axis=-1),
        optimizer=tr_onnx.optim.AdamW(lr=1e-2, weight_decay=0.01), trainable=info.trainable,
        grad_accumulation=grad_accumulation, backend="numpy", lora=info if lora else None)


def _batch(k: int):
    return rx.example_inputs("llama", seed=k), rx.example_labels("llama", seed=k)


def _entries(path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return [n.removesuffix(".npy") for n in z.namelist()]


def _sha256(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()


def test_a_lora_checkpoint_holds_the_trained_tensors_and_is_a_fraction_of_a_full_one(
        llama, tmp_path):
    lora_model, info = add_lora(onnx.load(llama), rank=4, alpha=8, targets=LLAMA_TARGETS)
    sizes = {}
    for what, lora in (("lora", True), ("full", False)):
        session = _session(lora_model, info, lora=lora)
        for k in range(2):
            session.train_step(*_batch(k))
        path = session.save_checkpoint(tmp_path / f"{what}.ckpt.npz")
        sizes[what] = path.stat().st_size
    base_bytes = llama.stat().st_size
    print(f"\ntiny Llama, LoRA r=4 on {len(info.adapters)} weights, AdamW: LoRA checkpoint "
          f"{sizes['lora']:,} B, full checkpoint {sizes['full']:,} B "
          f"({sizes['lora'] / sizes['full']:.1%}); base model {base_bytes:,} B")
    assert sizes["lora"] < 0.25 * sizes["full"]
    entries = _entries(tmp_path / "lora.ckpt.npz")
    assert "__model__" not in entries
    state = {e.removeprefix("state/") for e in entries if e.startswith("state/")}
    assert set(info.trainable) <= state
    assert not state & {t.weight for t in info.adapters}  # the frozen base weights stay out
    with np.load(tmp_path / "lora.ckpt.npz") as z:
        meta = json.loads(z["__meta__"].tobytes())
    assert json.loads(meta["lora"])["base_sha256"] == _sha256(onnx.load(llama))


@pytest.mark.parametrize(("grad_accumulation", "base_dtype"), [(1, None), (2, None),
                                                               (1, "bfloat16")],
                         ids=["every-step", "mid-accumulation", "bf16-base"])
def test_a_lora_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(
        llama, tmp_path, grad_accumulation, base_dtype):
    # dropout: the resumed run must continue the RNG counter; AdamW: the moments and step
    lora_model, info = add_lora(onnx.load(llama), rank=4, alpha=8, dropout=0.1,
                                targets=LLAMA_TARGETS, train_also=r"norm", base_dtype=base_dtype)
    straight = _session(lora_model, info, grad_accumulation)
    want = [straight.train_step(*_batch(k)) for k in range(STEPS)]

    first = _session(lora_model, info, grad_accumulation)
    got = [first.train_step(*_batch(k)) for k in range(STOP)]
    ckpt = first.save_checkpoint(tmp_path / "lora.ckpt.npz")
    del first
    resumed = tr_onnx.TrainingSession.from_checkpoint(ckpt, base=str(llama))
    assert resumed.lora.to_json() == info.to_json()
    got += [resumed.train_step(*_batch(k)) for k in range(STOP, STEPS)]
    assert got == want
    a, b = straight.parameters(), resumed.parameters()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert resumed.step == straight.step
    # and it saves a LoRA checkpoint again
    assert "__model__" not in _entries(resumed.save_checkpoint(tmp_path / "again.ckpt.npz"))


def test_a_frozen_weight_changed_by_load_parameters_is_kept_in_a_lora_checkpoint(
        llama, tmp_path):
    lora_model, info = add_lora(onnx.load(llama), rank=4, alpha=8, targets=["q_proj"])
    frozen = info.adapters[1].weight  # adapted, so frozen: the base holds its old value
    session = _session(lora_model, info)
    session.load_parameters({frozen: session.parameters()[frozen] * np.float32(0.5)})
    session.train_step(*_batch(0))
    ckpt = session.save_checkpoint(tmp_path / "lora.ckpt.npz")
    assert f"state/{frozen}" in _entries(ckpt)
    assert f"state/{info.adapters[0].weight}" not in _entries(ckpt)
    resumed = tr_onnx.TrainingSession.from_checkpoint(ckpt, base=str(llama))
    assert resumed.train_step(*_batch(1)) == session.train_step(*_batch(1))
    np.testing.assert_array_equal(resumed.parameters()[frozen], session.parameters()[frozen])


def test_another_base_is_refused_naming_both_hashes(llama, tmp_path):
    base = onnx.load(llama)
    lora_model, info = add_lora(base, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    session = _session(lora_model, info)
    session.train_step(*_batch(0))
    ckpt = session.save_checkpoint(tmp_path / "lora.ckpt.npz")
    other = onnx.load(llama)
    w = other.graph.initializer[0]  # a frozen weight changed: another base
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) + np.float32(1e-3), w.name))
    with pytest.raises(CheckpointError) as err:
        tr_onnx.TrainingSession.from_checkpoint(ckpt, base=other)
    assert _sha256(base) in str(err.value) and _sha256(other) in str(err.value)
    with pytest.raises(CheckpointError, match="base="):
        tr_onnx.TrainingSession.from_checkpoint(ckpt)
    with pytest.raises(ModelLoadError, match="nothing.onnx"):
        tr_onnx.TrainingSession.from_checkpoint(ckpt, base=tmp_path / "nothing.onnx")


def test_a_full_checkpoint_of_a_lora_model_still_loads_with_or_without_a_base(llama, tmp_path):
    lora_model, info = add_lora(onnx.load(llama), rank=4, alpha=8, targets=["q_proj"])
    session = _session(lora_model, info, lora=False)  # as every checkpoint was written before
    session.train_step(*_batch(0))
    ckpt = session.save_checkpoint(tmp_path / "full.ckpt.npz")
    assert "__model__" in _entries(ckpt)
    want = session.train_step(*_batch(1))
    for base in (None, str(llama)):
        resumed = tr_onnx.TrainingSession.from_checkpoint(ckpt, base=base)
        assert resumed.lora is None
        assert resumed.train_step(*_batch(1)) == want


SAMPLES = 24
LORA = "rank=4,alpha=8,targets=query|value"


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    path = rx.export(rx.build("bert", "classic"), "bert", "classic", folder / "bert.onnx")
    np.savez(folder / "text.npz", **rx.example_inputs("bert", seed=1, batch=SAMPLES),
             labels=rx.example_labels("bert", 1, SAMPLES))
    return path, folder / "text.npz"


def _train(model, data, out, *extra) -> int:
    return main(["train", str(model), "--data", str(data), "--lora", LORA, "--optimizer",
                 "adamw", "--lr", "0.01", "--batch-size", "8", "--val-split", "0",
                 "--no-progress", "--backend", "numpy", "--out", str(out), *extra])


def test_cli_resume_of_a_lora_run_takes_the_base_and_continues_bit_for_bit(
        bert, tmp_path, capsys):
    path, data = bert
    straight = tmp_path / "straight.onnx"
    assert _train(path, data, straight, "--epochs", "2") == 0
    resumed = tmp_path / "resumed.onnx"
    ckpt = tmp_path / "ckpt"
    assert _train(path, data, resumed, "--epochs", "1", "--checkpoint-dir", str(ckpt)) == 0
    assert "__model__" not in _entries(ckpt / "last.ckpt.npz")
    size, base_size = (ckpt / "last.ckpt.npz").stat().st_size, path.stat().st_size
    print(f"\ntiny BERT, LoRA r=4 on query/value, AdamW: checkpoint {size:,} B, base model "
          f"{base_size:,} B")
    assert size < 0.25 * base_size
    other = tmp_path / "other.onnx"
    model = onnx.load(path)
    w = model.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) * np.float32(2), w.name))
    onnx.save(model, other)
    capsys.readouterr()
    assert _train(other, data, resumed, "--epochs", "2", "--checkpoint-dir", str(ckpt),
                  "--resume") != 0
    err = capsys.readouterr().err
    assert _sha256(onnx.load(path)) in err and _sha256(model) in err
    resume = ("--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume")
    assert main(["train", str(path), "--data", str(data), "--backend", "numpy", "--out",
                 str(resumed), *resume]) != 0  # without --lora
    assert "is a --lora run's (rank=4,alpha=8.0,dropout=0.0,targets=query|value)" in \
        capsys.readouterr().err
    assert main(["train", str(path), "--data", str(data), "--lora", "rank=4,alpha=16,"
                 "targets=query|value", "--backend", "numpy", "--out", str(resumed),
                 *resume]) != 0  # another alpha: the same graph, another scale
    assert "--lora alpha=16.0 (the checkpoint's: 8.0)" in capsys.readouterr().err
    assert _train(path, data, resumed, *resume) == 0
    a = {i.name: i.raw_data for i in onnx.load(straight).graph.initializer}
    b = {i.name: i.raw_data for i in onnx.load(resumed).graph.initializer}
    assert a == b
    for suffix in (".lora.npz", ".onnx_adapter"):  # the adapters alone, for onnxruntime too
        assert (tmp_path / f"straight{suffix}").read_bytes() == \
            (tmp_path / f"resumed{suffix}").read_bytes()
