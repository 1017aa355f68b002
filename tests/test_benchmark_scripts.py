"""The benchmark scripts still run and print tables that parse: ``profile_step.py``,
``forward.py``, ``train.py`` and ``step_ab.py`` on the smallest zoo model, a few steps, tr_onnx
and PyTorch (the ORT training peer needs a venv of its own and is left out). Numbers are not
checked, only that a ratio is printed and that both peers start from the same loss."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def run_script(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def load_script(name: str):
    """A benchmark script as a module (its folder on the path: it imports peer_common)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{Path(name).stem}", BENCH / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(text: str, first: str) -> list[list[str]]:
    """The cells of every markdown table row whose first cell is ``first``."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines()
            if line.startswith("|") and line.strip("| ").split("|")[0].strip() == first]


def test_profile_step_prints_the_step_time_the_loop_overhead_and_a_row_per_op_type():
    out = run_script("profile_step.py", "--model", "mlp", "--steps", "2", "--blas-env", "given")
    assert rows(out, "train_step, ms median (min)")
    overhead = [r for r in out.splitlines() if r.startswith("| executor Python per kernel call")]
    assert overhead and float(overhead[0].split("|")[-2]) > 0
    gemm = rows(out, "Gemm")
    assert gemm and float(gemm[0][3]) == 8  # calls per step: 4 Gemm forward, 4 backward


def test_train_prints_a_ratio_per_peer_and_equal_first_losses():
    out = run_script("train.py", "--models", "mlp", "--peers", "tr_onnx,torch", "--steps", "2",
                     "--warmup", "1")
    assert "OPENBLAS_CORETYPE=" in out and "OPENBLAS_L2_SIZE=" in out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    ours = [c for c in (line.strip("|").split("|") for line in lines) if "tr_onnx" in c[1]]
    torch = [c for c in (line.strip("|").split("|") for line in lines) if "PyTorch" in c[1]]
    assert ours and len(ours) == len(torch)  # one row each per OpenBLAS setting
    for a, b in zip(ours, torch):
        assert a[0] == b[0]  # same setting
        assert re.fullmatch(r"\d+\.\d+x", a[3].strip()) and re.fullmatch(r"\d+\.\d+x", b[3].strip())
        assert abs(float(a[5]) - float(b[5])) <= 1e-4


def test_forward_prints_a_ratio_per_model():
    out = run_script("forward.py", "--models", "mlp", "--repeat", "4", "--blas-env", "given")
    (mlp,) = rows(out, "mlp")
    ours, ort = float(mlp[3]), float(mlp[5])  # 4 significant digits
    assert ours > 0 and ort > 0 and re.fullmatch(r"\d+\.\d\dx", mlp[6])
    assert abs(float(mlp[6][:-1]) - ours / ort) < 0.02 * ours / ort
    # per block: the median and quartiles of the paired ratios, in order
    paired = re.fullmatch(r"(\d+\.\d\d)x \((\d+\.\d\d)-(\d+\.\d\d)\)", mlp[7])
    assert paired
    mid, low, high = (float(g) for g in paired.groups())
    assert 0 < low <= mid <= high


def test_forward_pairs_each_block_with_the_same_rounds_onnxruntime_block():
    forward = load_script("forward.py")
    ours = [[2.0, 4.0, 3.0], [], [1.0]]
    theirs = [[1.0, 2.0, 1.0], [5.0], [2.0]]
    assert forward.paired_ratios(ours, theirs) == [3.0, 0.5]  # the empty block is left out
    assert forward.quartiles([0.5, 3.0]) == (0.5, 1.75, 3.0)
    assert forward.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.5, 3.0, 4.5)
    assert forward.quartiles([2.0]) == (2.0, 2.0, 2.0)


def test_forward_warms_each_block_up_for_a_while_before_timing(monkeypatch):
    """Every block is preceded by untimed calls: at least WARM_CALLS, and for WARM_S (a fast
    model's first calls after the pause are its slowest)."""
    forward = load_script("forward.py")
    monkeypatch.setattr(forward, "IDLE_S", 0.0)
    monkeypatch.setattr(forward, "WARM_S", 0.02)
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(0.05)  # one call outlasts WARM_S: WARM_CALLS decide

    blocks = forward.interleaved_blocks_ms([fast, slow], repeat=4, rounds=2)
    assert [len(b) for b in blocks[0]] == [2, 2] and [len(b) for b in blocks[1]] == [2, 2]
    assert calls["slow"] == 2 * (forward.WARM_CALLS + 2)
    assert calls["fast"] > 2 * (forward.WARM_CALLS + 2) + 100  # 20 ms of near-empty calls


def test_step_ab_prints_a_row_per_variant_against_the_first():
    out = run_script("step_ab.py", "--model", "mlp", "--steps", "3", "--warmup", "1",
                     "--rounds", "1", "--variant", "base=",
                     "--variant", "no_cblas=TR_ONNX_NO_CBLAS=1")
    base, other = rows(out, "base"), rows(out, "no_cblas")
    assert base and other
    assert base[0][-2] == "1.00x" and re.fullmatch(r"\d+\.\d+x", other[0][-2])
    assert float(other[0][1]) > 0
    assert base[0][-1] == other[0][-1] == str(ROOT / "tr_onnx")  # this tree, not another


def test_lora_prints_a_row_per_peer_with_peft_counting_the_same_trainable_parameters():
    """benchmarks/lora.py: tr_onnx and PyTorch + peft train the same number of parameters
    and start from PyTorch's loss."""
    pytest.importorskip("peft")
    out = run_script("lora.py", "--size", "tiny", "--steps", "2", "--warmup", "1",
                     "--blas-env", "given")
    for model in ("llama", "bert"):
        assert f"### {model} (tiny)" in out
    tables = out.split("### ")[1:]
    for table in tables:
        peers = {r[0]: r for line in table.splitlines() if line.startswith("| ")
                 for r in [[c.strip() for c in line.strip("| \n").split("|")]]}
        # the same adapters (and BERT's new head) train in both frameworks
        assert peers["tr_onnx LoRA"][1] == peers["PyTorch + peft LoRA"][1]
        assert peers["tr_onnx full"][1] == peers["PyTorch full"][1]
        assert int(peers["tr_onnx LoRA"][3].replace(",", "")) < int(
            peers["tr_onnx full"][3].replace(",", ""))
        rows_ = [r for r in peers.values() if r[0] != "peer"]
        assert all(float(r[5].split()[0]) > 0 for r in rows_)
        # all four start from the same model (LoRA's B is zero): PyTorch's step-1 loss
        first = [float(r[9]) for r in rows_]
        assert max(first) - min(first) < 1e-5, first
