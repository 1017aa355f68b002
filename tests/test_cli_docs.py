"""docs/cli.md, the command line's reference, names every option of ``tr-onnx train`` and
``tr-onnx evaluate`` (the parser is the oracle: an option added without its documentation
fails here)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tr_onnx.cli import build_parser

DOC = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()


def options(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [o for a in sub.choices[command]._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"]


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_docs_cli_names_every_option(command):
    assert options(command)  # the parser was read
    section = DOC.split(f"## `tr-onnx {command}`", 1)[1].split("\n## ", 1)[0]
    missing = [o for o in options(command) if f"`{o}" not in section]
    assert not missing, f"docs/cli.md, tr-onnx {command}: {missing}"
