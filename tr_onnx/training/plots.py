"""Plots of a training history (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..errors import InputError
from .storage import atomic_write


def plot_format(path: str | Path) -> str:
    """The image format the suffix of ``path`` names (``.svg`` -> ``"svg"``; no suffix: png).
    A suffix matplotlib cannot write is an InputError naming those it can; ImportError without
    matplotlib."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix[1:] not in supported:
        raise InputError(f"{path}: plot format {suffix!r} is not supported; use one of "
                         f"{', '.join('.' + s for s in supported)}")
    return suffix[1:] or "png"


# what the panels' axes say for a metric's short name in the records (train_<name>, val_<name>)
METRIC_LABELS = {"loss": "loss", "acc": "accuracy"}
SPLITS = (("train", "o-"), ("val", "s--"))


def metric_names(records: list[dict]) -> list[str]:
    """The metrics ``records`` hold a number for, as ``train_<name>`` or ``val_<name>``, loss
    first: one panel each (a regression's history has no accuracy, so no accuracy panel)."""
    names: list[str] = []
    for r in records:
        for key, value in r.items():
            split, _, name = key.partition("_")
            if split in ("train", "val") and name and name not in names and isinstance(
                    value, (int, float)) and not isinstance(value, bool):
                names.append(name)
    return sorted(names, key=lambda n: (n != "loss", names.index(n)))


def history_figure(history: list[dict], steps: list[dict] | None = None):
    """The matplotlib Figure ``plot_history`` draws: one panel per metric of the epoch records
    ``history`` (train and validation); with ``steps`` (the ``"kind": "step"`` records of
    ``metrics_every``) the x axis is the optimizer step and each step record is a point (the
    epoch's running value), else it is the epoch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = steps or []
    names = metric_names(history + steps) or ["loss"]
    fig = Figure(figsize=(4.5 * len(names), 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    x_key = "step" if steps else "epoch"
    for ax, name in zip(axes, names):
        if steps:
            ys = [r.get(f"train_{name}") for r in steps]
            if any(y is not None for y in ys):
                ax.plot([r["step"] for r in steps], [np.nan if y is None else y for y in ys],
                        ".", alpha=0.5, label="train (per step)")
        for split, style in SPLITS:
            ys = [r.get(f"{split}_{name}") for r in history]
            if any(y is not None for y in ys):
                ax.plot([r[x_key] for r in history], [np.nan if y is None else y for y in ys],
                        style, label=split)
        ax.set_xlabel(x_key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(METRIC_LABELS.get(name, name))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    return fig


def plot_history(history: list[dict], path: str | Path, steps: list[dict] | None = None) -> Path:
    """The curves of ``history_figure(history, steps)``, written atomically in the format the
    suffix of ``path`` names (``plot_format``). Imports matplotlib (Agg canvas, no pyplot
    state); raises ImportError without it."""
    fig = history_figure(history, steps)
    buf = io.BytesIO()
    fig.savefig(buf, format=plot_format(path), dpi=100)
    atomic_write(path, buf.getvalue())
    return Path(path)
