"""Every code block of README.md runs (issue 32: the README is a user guide, and its code works
verbatim).

The ```python blocks and the walkthrough's ```bash blocks run in README order in one temporary
folder, as a user types them: later blocks read the files earlier ones wrote (the export, the
.npz, the trained model). A ```bash line `tr-onnx ...` runs as `python -m tr_onnx ...` with
this checkout first on the path (the console script would run whichever copy is installed).
The install commands are checked instead: the test command is `.ci/run`'s, the demo's extras
exist, and the demo's training runs for one epoch. A block of any other kind fails the test, so
a new block cannot go unrun.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 250
VENV = "python3 -m venv .venv && . .venv/bin/activate"
DEMO_INSTALL = "python3 -m pip install -e '.[train]'"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(), re.S | re.M)


def ci_command() -> str:
    return (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]


def is_install(code: str) -> bool:
    return code.startswith(("python3 -m pip install", "python3 -m venv"))


def run_cli(command: str, cwd: Path) -> str:
    """Run one `tr-onnx ...` line as `python -m tr_onnx ...` of this checkout, in ``cwd``."""
    argv = shlex.split(command)
    assert argv[0] == "tr-onnx", f"a README bash line that is not a tr-onnx command: {command}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-m", "tr_onnx", *argv[1:]], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_readme_is_under_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_LINES, f"README.md has {lines} lines; move detail under docs/"


def test_readme_names_no_commit_or_machine():
    """Measurements with their commits and VMs live in docs/benchmarks.md, not the guide."""
    text = README.read_text()
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
              if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, hashes
    machines = re.findall(r"\b(?:VMs?|EPYC|Xeon|Zen ?\d|AVX-?512|AVX2)\b", text)
    assert not machines, machines


def test_every_readme_block_is_one_this_test_runs_or_checks():
    blocks = readme_blocks()
    assert len(blocks) >= 8, "the README lost its code blocks, or this parser lost them"
    for language, code in blocks:
        assert language in ("python", "bash"), f"a ```{language} block nobody runs:\n{code}"
        if language == "bash" and not is_install(code):
            assert all(line.startswith("tr-onnx ") for line in code.strip().splitlines()), code


def test_the_readme_test_command_is_the_ci_command():
    tests = [code.strip() for language, code in readme_blocks()
             if language == "bash" and code.startswith("python3 -m pip install -e '.[test]'")]
    assert tests == [ci_command()]


def test_the_venv_step_makes_and_activates_a_venv(tmp_path):
    (code,) = [code.strip() for language, code in readme_blocks()
               if language == "bash" and code.startswith("python3 -m venv")]
    assert code == VENV
    result = subprocess.run(["bash", "-c", f"{code} && python -c 'import sys; print(sys.prefix)'"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == (tmp_path / ".venv").resolve()


def test_the_demo_installs_an_extra_that_exists_and_trains(tmp_path):
    """The install half is checked (pip would take minutes): the extra it names exists. The
    training half runs verbatim but for one epoch (the 15 take half a minute here)."""
    (code,) = [code.strip() for language, code in readme_blocks()
               if language == "bash" and code.startswith(DEMO_INSTALL + " && ")]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert re.fullmatch(r"python3 -m pip install -e '\.\[(\w+)\]'", DEMO_INSTALL)[1] in extras
    train = code.removeprefix(DEMO_INSTALL + " && ")
    (tmp_path / "model_zoo").symlink_to(ROOT / "model_zoo")
    out = run_cli(train + " --epochs 1", tmp_path)
    assert "epoch 1/1" in out
    for written in ("lenet_trained.onnx", "curves.png", "metrics.jsonl"):
        assert (tmp_path / written).stat().st_size > 0, written
    onnx.checker.check_model(str(tmp_path / "lenet_trained.onnx"))


def test_the_readme_walkthrough_runs_block_by_block(tmp_path, monkeypatch):
    """Export, data, train, inspect, check in onnxruntime, the Python API: in order, in one
    folder and one namespace. Then the trained file is checked against the untrained export,
    both run by onnxruntime (the oracle): training moved it, and it classifies the digits."""
    import onnxruntime

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    ran = []
    for language, code in readme_blocks():
        if language == "python":
            stdout = io.StringIO()
            with warnings.catch_warnings(), contextlib.redirect_stdout(stdout):
                warnings.simplefilter("ignore")  # the exporters' deprecation notes
                exec(compile(code, "README.md", "exec"), namespace)
            ran.append(("python", code.splitlines()[0], stdout.getvalue()))
        elif not is_install(code):
            for line in code.strip().splitlines():
                ran.append(("bash", line, run_cli(line, tmp_path)))
    assert [kind for kind, *_ in ran].count("bash") >= 2, ran

    data = np.load("my_data.npz")
    trained = onnxruntime.InferenceSession("my_cnn_trained.onnx").run(
        None, {"input": data["input"]})[0]
    untrained = onnxruntime.InferenceSession("my_cnn.onnx").run(
        None, {"input": data["input"]})[0]
    assert (trained.argmax(axis=1) == data["labels"]).mean() > 0.9
    assert (untrained.argmax(axis=1) == data["labels"]).mean() < 0.5
    (check_output,) = [out for kind, first, out in ran if "accuracy on every digit" in out]
    assert float(check_output.split(":")[-1]) > 0.9
    assert len(namespace["history"]) == 2  # the Python API's fit ran its two epochs
    api = onnxruntime.InferenceSession("my_cnn_api.onnx").run(None, {"input": data["input"]})[0]
    assert (api.argmax(axis=1) == data["labels"]).mean() > 0.9
    # fine-tuning: a 5-class head; LoRA's merged model serves as its adapter file does
    five = onnxruntime.InferenceSession("my_cnn_5.onnx").run(None, {"input": data["input"]})[0]
    assert five.shape == (len(data["labels"]), 5)
    merged = onnxruntime.InferenceSession("my_cnn_lora.onnx").run(
        None, {"input": data["input"]})[0]
    adapter = onnxruntime.LoraAdapter()
    adapter.Load("my_cnn_lora.onnx_adapter")
    options = onnxruntime.RunOptions()
    options.add_active_adapter(adapter)
    served = onnxruntime.InferenceSession("my_cnn_lora.adapter_model.onnx").run(
        None, {"input": data["input"]}, options)[0]
    np.testing.assert_allclose(served, merged, atol=1e-5, rtol=0)
    assert np.max(np.abs(merged - untrained)) > 1e-3  # the adapters trained


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_reach_pages_and_headings(page):
    """The README's links, and those of the pages under docs/ (moved out of it), resolve."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        assert path.is_file(), f"{page.name} links {target}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name} links {target}: no heading"
