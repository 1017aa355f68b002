"""tr_onnx as an ``onnx.backend.base.Backend``, so ONNX's own backend test suite can run it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .session import InferenceSession


class TrOnnxRep(BackendRep):
    def __init__(self, session: InferenceSession):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feed = inputs
        else:
            inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            feed = dict(zip(self.input_names, inputs))
        return tuple(self.session.run(None, {k: np.asarray(v) for k, v in feed.items()}))


class TrOnnxBackend(Backend):
    """``channel_align`` may be passed to ``prepare`` to run the suite with padded channels."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> TrOnnxRep:
        super().prepare(model, device, **kwargs)
        return TrOnnxRep(InferenceSession(model, backend="numpy",
                                          channel_align=kwargs.get("channel_align")))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"
