"""benchmarks/data_loading.py runs and prints a row per model and data source whose numbers
parse (their values are not checked: they are timings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_data_loading_benchmark_prints_a_row_per_source():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_loading.py"),
                           "--models", "mlp,lenet", "--samples", "96", "--steps", "2",
                           "--blas-env", "given"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in proc.stdout.splitlines() if line.startswith(("| mlp", "| lenet"))]
    assert [r[:2] for r in rows] == [
        ["mlp [64]", "npz in memory"], ["mlp [64]", "npy memmap"], ["mlp [64]", "CSV loaded"],
        ["lenet [1x8x8]", "npz in memory"], ["lenet [1x8x8]", "npy memmap"],
        ["lenet [1x8x8]", "PNG decoded"]]
    for row in rows:
        assert len(row) == 12 and all(float(c) >= 0 for c in [*row[2:5], *row[6:]]), row
        assert row[5] in ("a thread", "training thread"), row
