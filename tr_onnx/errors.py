"""Exceptions raised by tr_onnx. Every message names the file, node, op or argument at fault."""


class TrOnnxError(Exception):
    """Base class of every error tr_onnx raises on purpose."""


class ModelLoadError(TrOnnxError):
    """The file is missing, truncated, not ONNX, or fails the ONNX checker."""


class UnsupportedModelError(TrOnnxError):
    """The model uses ops (or dtypes) that no registered op set provides.

    ``missing`` lists every ``(domain, op_type, since_version, [node names])``.
    """

    def __init__(self, message: str, missing: list[tuple[str, str, int, list[str]]]):
        super().__init__(message)
        self.missing = missing


class RegistryError(TrOnnxError):
    """Two op sets registered the same key, or a lookup found nothing."""


class ShapeError(TrOnnxError):
    """A value's shape could not be inferred, or a node's shapes are inconsistent."""


class InputError(TrOnnxError, ValueError):
    """A feed has the wrong name, shape or dtype."""


class PlanError(TrOnnxError):
    """The MemoryPlan violates an invariant (alignment, overlap, region order)."""


class TrainingDiverged(TrOnnxError):
    """Too many steps in a row had a non-finite loss or gradient; none of them was applied."""
