"""tr_onnx: train exported ONNX models; ONNX in, trained ONNX out.

``import tr_onnx`` needs no GPU: CUDA code is imported only when the cuda backend is asked for.
"""

from . import optim
from .errors import (
                     ArenaSizeError,
                     CheckpointError,
                     DistributedError,
                     ExportAdviceWarning,
                     InputError,
                     InternalError,
                     ModelLoadError,
                     NoStepApplied,
                     OptionError,
                     PlanError,
                     RegistryError,
                     ShapeError,
                     TrainingDiverged,
                     TrOnnxError,
                     UnsupportedModelError,
                     WriteError,
)
from .hookspecs import hookimpl
from .session import InferenceSession
from .training.losses import LossSpec
from .training.session import TrainingSession

__version__ = "0.1.0"
__all__ = ["InferenceSession", "TrainingSession", "LossSpec", "optim", "hookimpl", "TrOnnxError",
           "ModelLoadError", "UnsupportedModelError", "RegistryError", "ShapeError", "InputError",
           "OptionError", "InternalError", "PlanError", "TrainingDiverged", "NoStepApplied",
           "ExportAdviceWarning", "CheckpointError", "WriteError", "ArenaSizeError",
           "DistributedError", "__version__"]
