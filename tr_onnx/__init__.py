"""tr_onnx: train exported ONNX models; ONNX in, trained ONNX out.

``import tr_onnx`` needs no GPU: CUDA code is imported only when the cuda backend is asked for.
"""

from .errors import (InputError, ModelLoadError, PlanError, RegistryError, ShapeError, TrOnnxError,
                     UnsupportedModelError)
from .hookspecs import hookimpl
from .session import InferenceSession

__version__ = "0.1.0"
__all__ = ["InferenceSession", "hookimpl", "TrOnnxError", "ModelLoadError", "UnsupportedModelError",
           "RegistryError", "ShapeError", "InputError", "PlanError", "__version__"]
