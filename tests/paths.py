"""Paths the file-writing tests need whoever runs them (CI runs as root)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ZOO = Path(__file__).resolve().parent.parent / "model_zoo"
"""The model zoo's folder (the repository's ``model_zoo/``)."""


def unwritable_folder(tmp_path: Path) -> tuple[Path, str]:
    """An existing folder in which no file can be created, and the reason the OS gives: a
    chmod'ed folder (it does not stop root), else a kernel folder that refuses new files even
    to root. Checked by trying to create a file there."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    for folder in (locked, Path("/sys"), Path("/proc/self")):
        try:
            fd, probe = tempfile.mkstemp(dir=folder)
        except OSError as exc:
            return folder, os.strerror(exc.errno)
        os.close(fd)
        os.unlink(probe)
    pytest.skip("no folder here refuses new files to this user (root on a writable /sys)")
