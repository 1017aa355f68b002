"""Helpers the cuda family tests share (tests/test_cuda_*_ops_cpu.py): the launches of an
emulated plan, and a one-node model's outputs typed by ONNX shape inference."""

from __future__ import annotations

import onnx

from tr_onnx.backends.cuda.bind import Launch


def launches_of(plan) -> list[Launch]:
    """Every kernel launch of a cuda plan, in order."""
    return [c for b in plan.executor.bound for c in b.calls if isinstance(c, Launch)]


def typed_outputs(model: onnx.ModelProto, outputs) -> onnx.ModelProto:
    """``model`` with graph outputs ``outputs`` (names; '' skipped) typed by ONNX shape
    inference (strict), replacing what the graph declared."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    typed = {vi.name: vi for vi in inferred.graph.value_info}
    del model.graph.output[:]
    model.graph.output.extend(typed[o] for o in outputs if o)
    return model
