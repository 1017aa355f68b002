"""How training writes and reads its files: atomic writes that leave the old file or the new
one (never half of one, never a stray temporary), the errors a full or read-only disk gives,
and reading a checkpoint, where anything wrong is a ``CheckpointError`` naming the file.

``TrainingSession.save_checkpoint``/``export`` and the trainer's metrics and plots write
through here; ``TrainingSession.from_checkpoint`` reads through ``read_checkpoint``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError

from ..errors import CheckpointError, WriteError
from ..importer import external_location, external_tensors

CHECKPOINT_FORMAT = 1


STALE_TEMP_SECONDS = 300.0
"""A leftover temporary of ``atomic_write`` whose writer is gone is removed once it has not been
written to for this long (see ``remove_stale_temporaries``)."""


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def write_error(path: Path, exc: OSError, what: str) -> WriteError:
    """The one-line ``WriteError`` for ``exc`` while writing ``path`` (``what``: the step)."""
    err = WriteError(f"{path}: could not be written ({what}): {_os_reason(exc)}")
    err.errno = exc.errno
    return err


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a filling disk writes part of it first)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_name(path: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[a-z0-9_]+\.tmp")


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporaries that ``atomic_write(path)`` calls killed midway left beside
    ``path`` (``.<name>.<pid>-<random>.tmp``); returns them.

    A temporary is stale when its writer is gone: its pid is not a live process here, and it
    has not been written to for ``STALE_TEMP_SECONDS``. The pid alone is exact on this machine
    (a reused pid only keeps a file longer); the age covers writers the pid cannot see, on
    another machine or in another pid namespace sharing the folder, whose temporary is being
    written and so is recent. Temporaries of other targets in the folder are left alone."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe on POSIX only
        return []
    pattern, removed = _temp_name(path), []
    now = time.time()
    for entry in os.scandir(path.parent):
        match = pattern.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)  # signal 0: only asks whether the process exists
            continue
        except ProcessLookupError:
            pass  # no such process: the writer is gone (if it ran on this machine)
        except (PermissionError, OverflowError):  # another user's live process; not a pid
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except FileNotFoundError:  # another process cleaned it first
            pass
    return removed


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never half
    of one: a temporary file ``.<name>.<pid>-<random>.tmp`` in the same folder, fsync, rename,
    fsync of the folder. Failing (disk full, read-only folder) is a ``WriteError`` naming the
    file and the reason; the old file is unchanged and the temporary removed. Temporaries that
    an earlier, killed writer of ``path`` left are removed first (``remove_stale_temporaries``)."""
    path = Path(path)
    tmp = None
    what = "creating its folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        what = f"creating a temporary file in {path.parent}"
        remove_stale_temporaries(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp",
                                   dir=path.parent)
        what = "writing"
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; the file should look like others
            write_all(fd, data)
            what = "syncing to disk"
            os.fsync(fd)
        finally:
            os.close(fd)
        what = "renaming the temporary file onto it"
        os.replace(tmp, path)
        tmp = None
        what = "written, but syncing its folder failed"
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise write_error(path, exc, what) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_META_COUNTS = ("step", "micro_step", "rng_counter", "bad_steps")


def checkpoint_model(path: Path, data: bytes, what: str) -> onnx.ModelProto:
    """A model stored in a checkpoint: valid ONNX, every tensor inline (``save_checkpoint``
    writes them so). One that references external data is refused: it would read files of the
    folder the process runs in, and ``export`` would copy them into the trained model."""
    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: {what} is not a valid ONNX model ({exc})") from None
    external = external_tensors(model)
    if external:
        t = external[0]
        raise CheckpointError(
            f"{path}: {what} references external data (tensor {t.name!r} in "
            f"{external_location(t)!r}); checkpoints carry every tensor inline, so this file "
            "was not written by save_checkpoint or was altered: it is refused")
    return model


BCAST_CHUNK = 1 << 30
"""Bytes per broadcast of a shared checkpoint (an MPI count is a C int: at most 2 GiB - 1)."""


def shared_checkpoint(path: Path, world) -> bytes:
    """The bytes of checkpoint ``path`` as rank 0 of ``world`` reads them, on every rank (a
    data-parallel resume: the file need only be on rank 0's machine, as rank 0 alone writes
    checkpoints). A file rank 0 cannot read is the same ``CheckpointError`` on every rank."""
    error, data = None, b""
    if world.is_root:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            error = f"{path}: no such checkpoint file (on rank 0, which reads it for all ranks)"
        except OSError as exc:
            error = f"{path}: cannot read the checkpoint on rank 0 ({_os_reason(exc)})"
    error, size = world.bcast_object((error, len(data)))
    if error is not None:
        raise CheckpointError(error)
    buf = np.frombuffer(bytearray(data) if world.is_root else bytearray(size), np.uint8)
    for lo in range(0, size, BCAST_CHUNK):
        world.bcast_(buf[lo:lo + BCAST_CHUNK])
    return buf.tobytes() if not world.is_root else data


def _is_lora(arrays: dict[str, np.ndarray]) -> bool:
    """Whether a checkpoint's meta data says it is a LoRA run's (without the model)."""
    try:
        meta = json.loads(arrays["__meta__"].tobytes())
        return isinstance(meta, dict) and "lora" in meta
    except (KeyError, ValueError, TypeError):
        return False  # the checks below name what is wrong


def read_checkpoint(path: Path, data: bytes | None = None
                    ) -> tuple[dict, onnx.ModelProto | None, dict[str, np.ndarray]]:
    """A checkpoint's meta data, model (None in a LoRA run's: ``checkpoints.lora_model``
    rebuilds it from the base) and state arrays, from the file or from its ``data``
    (``shared_checkpoint``; errors still name ``path``). Anything wrong with the file is a
    ``CheckpointError`` naming it and what; pickled objects are never loaded."""
    if data is None and not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    arrays, key = {}, None
    try:
        data = np.load(path if data is None else io.BytesIO(data), allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise CheckpointError(f"{path}: not a tr_onnx checkpoint (one .npy array, not the "
                                  ".npz archive save_checkpoint writes)")
        with data:
            for key in data.files:
                arrays[key] = data[key]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        where = f"entry {key!r}: " if key is not None else ""
        # numpy's own advice here is to load the file unsafely: never repeat it
        reason = f"{type(exc).__name__}: {exc}"
        if "pickle" in str(exc):
            reason = ("pickled Python objects, which tr_onnx never loads" if key is not None else
                      "not a .npz archive; numpy would unpickle it, which tr_onnx never does")
        raise CheckpointError(f"{path}: not a readable tr_onnx checkpoint ({where}{reason}); "
                              "it is truncated, damaged or not written by save_checkpoint") \
            from None
    for key in ("__meta__", "__model__"):
        if key == "__model__" and key not in arrays and _is_lora(arrays):
            continue  # a LoRA run's: the base model is given to resume it (``checkpoints``)
        if key not in arrays:
            raise CheckpointError(f"{path}: not a tr_onnx checkpoint (no {key} entry)")
        if arrays[key].dtype != np.uint8 or arrays[key].ndim != 1:
            raise CheckpointError(f"{path}: its {key} entry is {arrays[key].dtype}"
                                  f"{list(arrays[key].shape)}, not bytes")
    try:
        meta = json.loads(arrays["__meta__"].tobytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: its __meta__ entry is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its __meta__ entry is not a JSON object")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}; this tr_onnx "
                              f"reads format {CHECKPOINT_FORMAT} (written by another version?)")
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("extra", {}), dict):
        raise CheckpointError(f"{path}: its __meta__ has no 'config' (or 'extra') object")
    for key in _META_COUNTS:
        if type(meta.get(key)) is not int or meta[key] < 0:
            raise CheckpointError(f"{path}: its __meta__ {key!r} is {meta.get(key)!r}, not a "
                                  "count")
    if "lora" in meta and not isinstance(meta["lora"], str):
        raise CheckpointError(f"{path}: its __meta__ 'lora' is not the LoRA settings' JSON")
    model = checkpoint_model(path, arrays["__model__"].tobytes(), "its model") \
        if "__model__" in arrays else None
    state = {k[len("state/"):]: v for k, v in arrays.items() if k.startswith("state/")}
    for name, value in state.items():
        if value.dtype.fields is not None or value.dtype.kind not in "fiubV":
            raise CheckpointError(f"{path}: array {name!r} holds {value.dtype}, not numbers")
    return meta, model, state
