"""Issue 35's items not fixed yet (their code is held by other branches): a reproducer each,
marked ``xfail(strict=True)`` so that whoever fixes one sees its test pass, and removes the mark.
Crashes and out-of-memory cases run in a subprocess under a memory limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tr_onnx
from tr_onnx.errors import UnsupportedModelError

ROOT = Path(__file__).resolve().parent.parent
F = TensorProto.FLOAT


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", opset)])


def _run_python(code: str, memory_bytes: int = 3 << 30, timeout: float = 120):
    code = (f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({memory_bytes}, "
            f"{memory_bytes}))\n") + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


@pytest.mark.xfail(strict=True, reason="issue 35 item 14: an internal op in a user's model "
                   "fails inside its kernel instead of being refused by name")
def test_an_internal_op_in_a_users_model_is_refused_by_name():
    model = _model([helper.make_node("DropoutTraining", ["x"], ["y"], domain="ai.tr_onnx",
                                     ratio=0.5, seed=1)],
                   [_vi("x", F, [2, 4])], [_vi("y", F, [2, 4])])
    model.opset_import.append(helper.make_opsetid("ai.tr_onnx", 1))
    with pytest.raises(UnsupportedModelError, match="internal"):
        tr_onnx.InferenceSession(model).run(None, {"x": np.ones((2, 4), np.float32)})
