"""scripts/gpu_check.sh in stages (scripts/gpu_stages.py), checked on the CPU.

``bash scripts/gpu_check.sh --dry-run`` runs every stage's plumbing (the host emulator where a
stage can use it, else ``skipped: no GPU``) and writes the files the GPU run writes: one final
line per stage in stages.jsonl, every stage in summary.md, the benchmark's results.md. The
record helpers are checked directly: a stage interrupted by SIGINT or killed still ends with a
``timeout`` line, and one failing check fails its stage but not the next.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from script_modules import ROOT, load_script

gpu_stages = load_script("gpu_stages")
NAMES = [s.name for s in gpu_stages.STAGES]


def _finals(out):
    return {r["stage"]: r for r in gpu_stages.records(out) if r["type"] == "stage"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_out")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                          timeout=240)
    return out, done


def test_the_plan_lists_every_stage_with_a_limit_of_about_five_minutes_in_all():
    assert NAMES == ["0-versions", "1-kernels", "2-capture", "3-cudnn", "4-models",
                     "4b-models-tf32-off", "5-convnets", "5b-precision-export", "5c-nccl",
                     "5d-real-exports", "6-benchmark"]
    total = sum(s.limit_s for s in gpu_stages.STAGES)
    assert total <= 480, total  # the device tool's 540 s leaves the installs their minute
    assert gpu_stages.STAGE_BY_NAME["4b-models-tf32-off"].env == {"NVIDIA_TF32_OVERRIDE": "0"}


def test_the_dry_run_writes_one_final_line_per_stage_and_a_summary_of_all(dry_run):
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finals = _finals(out)
    assert list(finals) == NAMES
    want = {name: "ok" for name in NAMES} | {"2-capture": "skipped"}
    assert {n: r["status"] for n, r in finals.items()} == want, finals
    assert finals["2-capture"]["key"] == "skipped: no GPU"
    assert all(isinstance(r["seconds"], float | int) and r["dry"] for r in finals.values())
    summary = (out / "summary.md").read_text()
    for name in NAMES:
        assert f"| {name} | {want[name]} |" in summary, summary


def test_the_dry_run_result_lines_carry_numbers(dry_run):
    out, _ = dry_run
    rows = [r for r in gpu_stages.records(out) if r["type"] == "result"]
    by = {(r["stage"], r["name"]): r for r in rows}
    assert by[("0-versions", "versions")]["cupy"]
    kernels = [r for r in rows if r["stage"] == "1-kernels" and r["name"].startswith("kernel ")]
    assert len(kernels) == 12 and all(r["ok"] and r["max_rel"] <= 1e-6 for r in kernels)
    assert by[("1-kernels", "nvrtc amp")]["missing"] == []
    for precision in ("fp32", "fp16", "bf16"):
        row = by[("3-cudnn", f"cudnn {precision}")]
        assert row["ok"] and row["replay"] == 0.0, row
        assert set(row["kinds"]) == {"conv_fprop", "conv_dgrad", "conv_wgrad", "batchnorm",
                                     "batchnorm_backward", "matmul"}, row
    assert by[("4b-models-tf32-off", "settings")]["tf32_override"] == "0"
    assert by[("4-models", "mlp replay")]["replay"] == 0.0
    assert by[("5-convnets", "resnet training")]["ok"]
    for label in ("mlp", "mlp fp16"):
        nccl = by[("5c-nccl", f"{label} world of 1 via nccl")]
        assert nccl["ok"] and nccl["nccl"] == 0.0 and "reduce" in nccl["captured_graphs"][0]
    sync = by[("5c-nccl", "resnet sync_batchnorm world of 1 via nccl")]
    assert sync["ok"] and (sync["sync_nodes"], sync["all_reduces"]) == (12, 18), sync
    real = by[("5d-real-exports", "zoo-mlp training")]
    assert real["ok"] and real["steps"] == 3 and real["parameters"] == 6, real


def test_an_exported_real_set_trains_through_the_stages_parity_function(tmp_path):
    """scripts/export_real_sets.py writes what the GPU machine cannot export (a set of the
    tests' catalogue, its batches and options); ``real_export_parity`` trains it on numpy and
    on the cuda backend (here the host emulator) as stage 5d does on the GPU."""
    export_real_sets = load_script("export_real_sets")
    gpu_check = load_script("gpu_check")
    rows = export_real_sets.export(tmp_path, ["mlp-classic"])
    assert rows == {"mlp-classic": {"lr": 0.1, "class_axis": 1, "session_kwargs": {},
                                    "steps": 3}}
    assert json.loads((tmp_path / "sets.json").read_text()) == rows
    got = gpu_check.real_export_parity(tmp_path, "mlp-classic", gpu_stages.emulator())
    assert got["steps"] == 3 and got["parameters"] == 6
    assert got["loss"] <= gpu_check.TOL["loss"] and got["weights"] <= gpu_check.TOL["weights"]


def test_the_benchmark_stage_writes_the_readme_table_as_before(dry_run):
    out, _ = dry_run
    results = json.loads((out / "results.json").read_text())
    runners = {r["runner"] for r in results["benchmark"]}
    assert {f"tr_onnx cuda {p} (train_step)" for p in ("fp32", "fp16", "bf16")} <= runners
    assert {"torch AMP fp16 channels_last eager", "torch AMP bf16 channels_last eager"} <= runners
    assert not [r for r in results["benchmark"] if r.get("note", "").startswith("error")]
    table = (out / "results.md").read_text()
    assert "| resnet50 |" in table and "images/s" in table
    bench = [r for r in gpu_stages.records(out) if r["stage"] == "6-benchmark"
             and r["type"] == "result"]
    assert len(bench) == len(results["benchmark"])


def _stage(monkeypatch, run):
    stage = gpu_stages.Stage("1-kernels", 5, run)
    monkeypatch.setitem(gpu_stages.STAGE_BY_NAME, "1-kernels", stage)
    return stage


def test_a_stage_interrupted_by_sigint_ends_with_a_timeout_line_after_its_results(
        monkeypatch, tmp_path):
    def run(ctx):
        ctx.result(name="first", value=1.5)
        raise KeyboardInterrupt

    _stage(monkeypatch, run)
    assert gpu_stages.run_stage("1-kernels", tmp_path, dry=True) == 1
    rows = gpu_stages.records(tmp_path)
    assert [r["type"] for r in rows] == ["result", "stage"]
    assert rows[0]["value"] == 1.5 and rows[1]["status"] == "timeout"
    assert "| 1-kernels | timeout |" in (tmp_path / "summary.md").read_text()


def test_a_check_that_raises_fails_its_stage_with_the_error_and_the_stage_goes_on(
        monkeypatch, tmp_path):
    def run(ctx):
        ctx.check("broken", lambda: 1 / 0)
        ctx.check("fine", lambda: {"err": 0.5}, {"err": 1.0})
        return "key numbers"

    _stage(monkeypatch, run)
    assert gpu_stages.run_stage("1-kernels", tmp_path, dry=True) == 1
    broken, fine, final = gpu_stages.records(tmp_path)
    assert broken["ok"] is False and broken["error"].startswith("ZeroDivisionError")
    assert fine["ok"] is True and fine["tol"] == {"err": 1.0}
    assert final["status"] == "failed" and final["error"] == "failed: broken"


@pytest.mark.parametrize(("rc", "status"), [(124, "timeout"), (137, "timeout"),
                                            (139, "failed")], ids=["sigint", "kill", "crash"])
def test_close_writes_the_final_line_a_killed_stage_could_not(tmp_path, rc, status):
    gpu_stages.close_stage("3-cudnn", tmp_path, rc, 12.0, dry=False)
    (final,) = gpu_stages.records(tmp_path)
    assert final["status"] == status and str(rc) in final["error"]
    gpu_stages.close_stage("3-cudnn", tmp_path, rc, 12.0, dry=False)  # never twice
    assert len(gpu_stages.records(tmp_path)) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert f"| 3-cudnn | {status} | 12.0 |" in summary and "| 0-versions | not run |" in summary
