"""What a checkpoint holds and how a session is made again from it (``TrainingSession.
save_checkpoint`` / ``from_checkpoint``; ``storage`` reads and writes the file).

A full checkpoint holds the model and every state array. A LoRA run's (a session given
``lora=``, the ``LoraInfo`` of ``finetune.lora.add_lora``) holds only what training changed:
the trained tensors (A, B and ``train_also``'s), their optimizer state and accumulators, the
running statistics and any other array that no longer equals the model's initializer, with the
``LoraInfo`` (settings, names and the base graph's sha256) in its meta data, and no model: the
frozen base weights, nearly all of the bytes, are the base model's. Resuming takes the base
(``from_checkpoint(path, base=...)``), checks its hash and rebuilds the LoRA model from it.
"""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ..dtypes import np_dtype
from ..errors import CheckpointError, ModelLoadError, OptionError, TrOnnxError
from ..optim import make_optimizer, make_schedule
from .losses import LossSpec
from .storage import (
    CHECKPOINT_FORMAT,
    atomic_write,
    checkpoint_model,
    read_checkpoint,
    shared_checkpoint,
)


def save(session, path: str | Path, extra: dict | None) -> Path:
    """``TrainingSession.save_checkpoint``: the session's state, counters and configuration
    in one .npz written atomically (no step in flight)."""
    state = session._state
    meta = {"format": CHECKPOINT_FORMAT, "config": session.config(), "step": state.step,
            "micro_step": state.micro_step, "rng_counter": state.rng_counter,
            "bad_steps": state.bad_steps, "extra": extra or {}}
    arrays_of_state, arrays = state.arrays(), {}
    if session.lora is not None:  # the trained tensors alone: the base gives the rest
        meta["lora"], arrays_of_state = lora_state(session, arrays_of_state)
    else:
        arrays["__model__"] = np.frombuffer(session.imported.original.SerializeToString(),
                                            np.uint8)
    arrays |= {f"state/{k}": v for k, v in arrays_of_state.items()}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, buf.getvalue())
    return Path(path)


def resume(cls, path: str | Path, plugins, base, overrides: dict):
    """``TrainingSession.from_checkpoint``: a session of class ``cls`` made from the
    checkpoint at ``path`` (its docstring says what fails how)."""
    path = Path(path)
    world = overrides.get("distributed")
    shared = shared_checkpoint(path, world) if world is not None and world.size > 1 else None
    meta, model, arrays = read_checkpoint(path, shared)
    lora = None
    if "lora" in meta:
        model, lora = lora_model(path, meta["lora"], arrays, base)
    cfg, loss, optimizer, schedule = session_arguments(path, meta["config"])
    options = set(inspect.signature(cls).parameters) - {
        "model", "loss", "optimizer", "lr_schedule", "plugins", "lora"}  # passed below
    unknown = sorted(set(cfg) - options)
    if unknown:
        raise CheckpointError(f"{path}: its configuration has unknown option(s) {unknown}; "
                              "the file is damaged or written by another version")
    cfg.update(overrides)
    try:
        session = cls(model, loss=loss, optimizer=optimizer, lr_schedule=schedule,
                      plugins=plugins, lora=lora, **cfg)
    except ModelLoadError as exc:
        raise CheckpointError(f"{path}: its model does not load: {exc}") from None
    except TrOnnxError:
        raise
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot resume with its configuration"
                              f"{' and the overrides' if overrides else ''}: {exc}") from None
    check_parameters(path, session.imported, arrays)
    state = session._state
    state.step, state.micro_step = meta["step"], meta["micro_step"]
    state.rng_counter, state.bad_steps = meta["rng_counter"], meta["bad_steps"]
    state.pending = dict(arrays)
    state.checkpoint = (path, arrays)
    session.checkpoint_extra = meta.get("extra", {})
    return session


def check_lora(lora, initializers: set[str]):
    """``TrainingSession(lora=...)``: None, or the ``LoraInfo`` of this model's adapters."""
    if lora is None:
        return None
    names = lora.adapter_names() if hasattr(lora, "adapter_names") else None
    missing = ["(not a LoraInfo)"] if names is None else \
        [n for n in names if n not in initializers]
    if missing:
        raise OptionError(f"lora={type(lora).__name__}: must be the LoraInfo that add_lora "
                          f"returned with this model; the model has no {missing[:3]}")
    return lora


def lora_state(session, state: dict[str, np.ndarray]) -> tuple[str, dict[str, np.ndarray]]:
    """A LoRA session's checkpoint: its ``LoraInfo`` as JSON, and of ``state`` the arrays
    that are trained or no longer equal the model's initializer of the same name (bit for
    bit): the frozen base weights are left out, the base model gives them back."""
    trained = set(session.lora.trainable)
    initial = {i.name: i for i in session.imported.original.graph.initializer}
    kept = {}
    for name, value in state.items():
        init = initial.get(name)
        if name in trained or init is None or not _same(value, init):
            kept[name] = value
    return session.lora.to_json(), kept


def _same(value: np.ndarray, init: onnx.TensorProto) -> bool:
    """Bit for bit (a NaN equals itself; -0.0 is not 0.0)."""
    if (value.shape, value.dtype) != (tuple(init.dims), np_dtype(init.data_type)):
        return False
    return np.array_equal(_bytes(value), _bytes(numpy_helper.to_array(init)))


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def lora_model(path: Path, lora_json: str, state: dict[str, np.ndarray], base):
    """The LoRA model a LoRA checkpoint trains, rebuilt from ``base`` (a path or a
    ModelProto) and the checkpoint's ``LoraInfo``, with its trained tensors; and that
    ``LoraInfo``. A base whose graph hash is not the checkpoint's is a ``CheckpointError``
    naming both hashes."""
    from ..finetune.lora import LoraError, LoraInfo, apply_lora, base_hash  # the layer above

    try:
        info = LoraInfo.from_json(lora_json)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{path}: its LoRA settings are not valid ({type(exc).__name__}: "
                              f"{exc}); the file is damaged or not written by tr_onnx") from None
    if base is None:
        raise CheckpointError(f"{path}: a LoRA checkpoint holds the trained adapters, not the "
                              f"base model (graph sha256 {info.base_sha256}): resume with "
                              "from_checkpoint(path, base=<the base model>) (tr-onnx train: "
                              "MODEL is the base, with the same --lora)")
    try:
        model = onnx.load_model_from_string(base) if isinstance(base, bytes) else \
            base if isinstance(base, onnx.ModelProto) else onnx.load(str(base))
    except (OSError, DecodeError, ValueError) as exc:
        raise ModelLoadError(f"base={base if isinstance(base, (str, Path)) else '...'}: the "
                             f"base model of LoRA checkpoint {path} does not load "
                             f"({type(exc).__name__}: {exc})") from None
    found = base_hash(model)
    if found != info.base_sha256:
        where = f" {base}" if isinstance(base, (str, Path)) else ""
        raise CheckpointError(f"{path}: its LoRA adapters were trained on a base model whose "
                              f"graph has sha256 {info.base_sha256}; the base given{where} has "
                              f"sha256 {found}: resume with the base it was trained on")
    missing = [n for n in info.trainable if n not in state]
    if missing:
        raise CheckpointError(f"{path}: a LoRA checkpoint without its trained arrays "
                              f"{missing[:3]}; the file is damaged or its arrays were removed")
    try:
        rebuilt, _ = apply_lora(model, ({n: state[n] for n in info.trainable}, info))
    except (LoraError, ValueError) as exc:
        raise CheckpointError(f"{path}: its LoRA adapters do not fit the base: {exc}") from None
    return rebuilt, info


def session_arguments(path: Path, config: dict) -> tuple[dict, object, object, object]:
    """A checkpoint's configuration as ``TrainingSession`` arguments: the rest of it, and
    the loss, optimizer and schedule made from their records."""
    cfg = dict(config)
    try:
        loss = cfg.pop("loss")
        if "onnx" in loss:
            loss = checkpoint_model(path, bytes.fromhex(loss["onnx"]), "its loss model")
        else:
            loss = LossSpec(**{**loss, "weights": tuple(loss["weights"])
                               if loss["weights"] else None})
        optimizer = make_optimizer(cfg.pop("optimizer"))
        schedule = make_schedule(cfg.pop("lr_schedule"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: its configuration is not valid ({type(exc).__name__}:"
                              f" {exc}); the file is damaged or not written by tr_onnx") \
            from None
    return cfg, loss, optimizer, schedule


def check_parameters(path: Path, imported, state: dict[str, np.ndarray]) -> None:
    """The model's parameters in a checkpoint have the initializers' shapes and dtypes."""
    for init in imported.proto.graph.initializer:
        value = state.get(init.name)
        if init.name not in imported.param_names or value is None:
            continue
        want = (tuple(init.dims), np_dtype(init.data_type))
        if (value.shape, value.dtype) != want:
            raise CheckpointError(
                f"{path}: array {init.name!r} is {value.dtype}{list(value.shape)}, but the "
                f"model's parameter {init.name!r} is {want[1]}{list(want[0])}; the file is "
                "damaged or its arrays were replaced")
