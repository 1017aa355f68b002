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


def plot_history(history: list[dict], path: str | Path) -> Path:
    """Loss and accuracy per epoch (train and validation), written atomically in the format
    the suffix of ``path`` names (``plot_format``). Imports matplotlib (Agg canvas, no pyplot
    state); raises ImportError without it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    epochs = [r["epoch"] for r in history]
    for ax, metric in ((ax_loss, "loss"), (ax_acc, "acc")):
        for split, style in (("train", "o-"), ("val", "s--")):
            ys = [r.get(f"{split}_{metric}") for r in history]
            if any(y is not None for y in ys):
                ax.plot(epochs, [np.nan if y is None else y for y in ys], style, label=split)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("accuracy" if metric == "acc" else "loss")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format=plot_format(path), dpi=100)
    atomic_write(path, buf.getvalue())
    return Path(path)
