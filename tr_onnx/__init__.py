"""tr_onnx: train exported ONNX models; ONNX in, trained ONNX out.

``import tr_onnx`` needs no GPU: CUDA code is imported only when the cuda backend is asked for.
"""

import importlib

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

# Imported on first use (PEP 562): NumPy, onnx and ml_dtypes take about a second to import, and
# ``tr-onnx`` (``__main__``) must be able to catch an interrupt that lands in that second.
_LAZY = {"InferenceSession": ".session", "TrainingSession": ".training.session",
         "LossSpec": ".training.losses", "hookimpl": ".hookspecs",
         "Trainer": ".training.trainer", "fit": ".training.fit", "evaluate": ".training.fit",
         "FitResult": ".training.fit", "EarlyStopping": ".training.fit",
         "KeepBest": ".training.fit"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif not name.startswith("__"):  # a submodule (tr_onnx.optim, tr_onnx.training, ...)
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__version__ = "0.1.0"
__all__ = ["InferenceSession", "TrainingSession", "LossSpec", "fit", "evaluate", "FitResult",
           "EarlyStopping", "KeepBest", "Trainer", "losses", "optim", "hookimpl", "TrOnnxError",
           "ModelLoadError", "UnsupportedModelError", "RegistryError", "ShapeError", "InputError",
           "OptionError", "InternalError", "PlanError", "TrainingDiverged", "NoStepApplied",
           "ExportAdviceWarning", "CheckpointError", "WriteError", "ArenaSizeError",
           "DistributedError", "__version__"]
