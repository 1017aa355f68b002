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


class InternalError(TrOnnxError):
    """A broken internal invariant: a bug in tr_onnx, not in the model or in what the user
    passed. Raise it where the code relies on something tr_onnx itself guarantees (a table
    that covers every builtin, a plan that validates); never for bad user input, which gets
    the error naming what to change. Its message asks for a bug report."""

    REPORT = ("this is a bug in tr_onnx, not in the model or the call: please report it, "
              "with the model and the call that raised it")

    def __str__(self) -> str:
        # appended here, not in __init__, so that ``args`` stays the bare message (pickling
        # and re-raising keep one copy of the request)
        return f"{super().__str__()} ({self.REPORT})"


class PlanError(InternalError):
    """The MemoryPlan violates an invariant (alignment, overlap, region order): the planner
    made a plan ``MemoryPlan.finalize`` rejects."""


class TrainingDiverged(TrOnnxError):
    """Too many steps in a row had a non-finite loss or gradient; none of them was applied."""
