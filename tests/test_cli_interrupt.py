"""Ctrl-C at any moment ends ``tr-onnx`` with one line and exit status 130 (issue 31, item 10):
in its first second, while Python imports NumPy, it printed a ``KeyboardInterrupt`` traceback
and died of the signal (-2). A real SIGINT lands deterministically: an import hook in the child
announces the import of NumPy on stderr and sleeps in it, and the test sends the signal then.
Both ways in are run: ``python -m tr_onnx`` and the console script's entry point as
pyproject.toml names it (what pip's generated ``tr-onnx`` script calls)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = "importing numpy"

SLOW_NUMPY = textwrap.dedent(f"""\
    import sys, time

    class SlowNumpy:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                print({MARKER!r}, file=sys.stderr, flush=True)
                time.sleep(60)  # the SIGINT ends this sleep with a KeyboardInterrupt
            return None

    sys.meta_path.insert(0, SlowNumpy())
    sys.argv = ["tr-onnx", "ops"]
""")


def _console_script() -> str:
    """The ``tr-onnx`` entry point: what the generated script runs."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["tr-onnx"].partition(":")
    return f"from {module} import {function}\nsys.exit({function}())\n"


STARTS = {"python -m tr_onnx": "import runpy\nrunpy.run_module('tr_onnx', run_name='__main__', "
                               "alter_sys=True)\n",
          "console script": _console_script()}


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("start", list(STARTS), ids=["python_m", "console_script"])
def test_sigint_while_numpy_imports_is_one_line_and_exit_130(start):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the child starts as from a terminal: a test run in the background of a non-interactive
    # shell has SIGINT ignored, and a child would inherit that and never see the signal
    proc = subprocess.Popen([sys.executable, "-c", SLOW_NUMPY + STARTS[start]], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        before = []  # what the child wrote first (a warning another test's environment asks
        for line in proc.stderr:  # for), up to the marker: the signal goes in after it
            if line == MARKER + "\n":
                break
            before.append(line)
        else:
            raise AssertionError("the child never imported NumPy: " + "".join(before))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "tr-onnx: interrupted\n")
