"""Training metrics as TensorBoard event files (``tr-onnx train --log-dir``), written with
tensorboardX's ``SummaryWriter``, a maintained writer of TensorBoard's own format (imported
only when a log is asked for: ``pip install 'tr_onnx[train]'``).

Each metrics record (the Trainer's JSON lines) becomes scalars: an epoch record's under
``epoch/``, at the epoch; a step record's (``metrics_every``) under ``step/``, at the optimizer
step. ``train_<name>`` and ``val_<name>`` become ``<name>/train`` and ``<name>/val``, so that
TensorBoard draws a metric's two curves in one chart; ``lr``, ``samples_per_s`` and the other
numbers keep their names. Values that are not numbers (null, per-class lists) are left out."""

from __future__ import annotations

from pathlib import Path

from ..errors import TrOnnxError

POSITION = ("kind", "epoch", "step", "batch")  # where a record is, not what it measured


def scalar_tags(record: dict) -> dict[str, float]:
    """The TensorBoard tag and value of each number in ``record`` (the module docstring)."""
    prefix = "step" if record.get("kind") == "step" else "epoch"
    tags = {}
    for key, value in record.items():
        if key in POSITION or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        split, _, name = key.partition("_")
        tag = f"{name}/{split}" if split in ("train", "val") and name else key
        tags[f"{prefix}/{tag}"] = float(value)
    return tags


class TensorBoardLog:
    """Writes metrics records to event files in ``log_dir`` (created if missing)."""

    def __init__(self, log_dir: str | Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise TrOnnxError(f"--log-dir {log_dir}: TensorBoard logs need tensorboardX: pip "
                              "install 'tr_onnx[train]'") from None
        self.writer = SummaryWriter(logdir=str(log_dir))

    def write(self, record: dict) -> None:
        at = record["step"] if record.get("kind") == "step" else record["epoch"]
        for tag, value in scalar_tags(record).items():
            self.writer.add_scalar(tag, value, global_step=at)

    def close(self) -> None:
        self.writer.close()
