"""The update phase's shortcuts change no bit: the optimizer updates run block by block
(``ops.optimizers.BLOCK_BYTES``) exactly as over whole spans, and with one micro-batch per step
the gradients computed straight into GRAD (``train_pass.fold_accumulators``) train exactly as
accumulating into zeroed GRAD does -- bad batches, checkpoints and state included.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import tr_onnx
from tr_onnx.optim import SGD, Adagrad, Adam, AdamW
from tr_onnx.training import pipeline

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"


def train(session, steps: int, shape, nan_at: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    for i in range(steps):
        x = rng.standard_normal((4, *shape)).astype(np.float32)
        if i == nan_at:
            x[0, 0] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the bad batch's warning
            session.train_step({"input": x}, np.arange(4) % 10)
    return session.state_arrays()


@pytest.mark.parametrize("optimizer", [
    SGD(lr=0.1), SGD(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True),
    SGD(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    Adam(lr=1e-2, weight_decay=1e-2), AdamW(lr=1e-2), Adagrad(lr=0.1, lr_decay=0.1,
                                                              weight_decay=1e-2),
], ids=["sgd", "sgd_nesterov_wd", "sgd_dampening_wd", "adam_l2", "adamw", "adagrad"])
def test_blocked_updates_equal_whole_span_updates_bit_for_bit(optimizer, monkeypatch):
    states = []
    for block in (1 << 40, 100):  # one block; many, the last one partial
        monkeypatch.setattr("tr_onnx.ops.optimizers.BLOCK_BYTES", block)
        session = tr_onnx.TrainingSession(ZOO / "mlp.onnx", optimizer=optimizer)
        states.append(train(session, 3, (64,)))
    for name, value in states[0].items():
        assert np.array_equal(states[1][name], value), name


def test_gradients_written_into_grad_train_as_accumulated_ones(monkeypatch, tmp_path):
    def session():
        return tr_onnx.TrainingSession(ZOO / "resnet.onnx", optimizer=SGD(
            lr=0.05, momentum=0.9, weight_decay=1e-3), clip_grad_norm=1.0)

    folded = session()
    got = train(folded, 4, (3, 16, 16), nan_at=2)
    monkeypatch.setattr(pipeline, "fold_accumulators", lambda *args: False)
    accumulating = session()
    want = train(accumulating, 4, (3, 16, 16), nan_at=2)
    ops = [{(n.op_type, n.phase) for n in s._state.active.graph.nodes} for s in (folded,
                                                                            accumulating)]
    assert ("Accumulate", "compute") not in ops[0] and ("ZeroFill", "apply") not in ops[0]
    assert {("Accumulate", "compute"), ("ZeroFill", "apply")} <= ops[1]
    assert folded.step == accumulating.step == 3 and folded.last_grad_norm > 0
    assert folded.last_grad_norm == accumulating.last_grad_norm
    assert got.keys() == want.keys()
    for name, value in want.items():  # GRAD included: it reads as zeros between steps
        assert np.array_equal(got[name], value), name
    # a checkpoint holds empty accumulators, as before: resuming it with accumulation adds
    # nothing stale
    path = folded.save_checkpoint(tmp_path / "ck.npz")
    with np.load(path) as saved:
        grads = [k for k in saved.files if k.endswith(".grad")]
        assert len(grads) == len(folded._state.active.info.trainable)
        assert not any(saved[k].any() for k in grads)
