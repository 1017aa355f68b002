"""Exceptions raised by tr_onnx, and its warning category. Every message names the file, node,
op or argument at fault."""

from .domains import INTERNAL_DOMAIN, ONNX_DOMAINS


class TrOnnxError(Exception):
    """Base class of every error tr_onnx raises on purpose."""


class ModelLoadError(TrOnnxError):
    """The file is missing, truncated, not ONNX, or fails the ONNX checker."""


class CheckpointError(TrOnnxError):
    """A checkpoint file that tr_onnx cannot resume from: truncated, not a checkpoint, another
    format, an entry missing or garbled, arrays that do not fit the model, or a model that
    references external data (checkpoints carry every tensor inline)."""


class WriteError(TrOnnxError, OSError):
    """A checkpoint, exported model or metrics file could not be written (disk full, read-only
    folder): names the file and the operating system's reason. The previous file is unchanged
    and no temporary file is left. An ``OSError`` too, with the original ``errno``."""


class UnsupportedModelError(TrOnnxError):
    """The model uses ops (or dtypes) that no registered op set provides.

    ``missing`` lists every ``(domain, op_type, since_version, [node names])``.
    """

    def __init__(self, message: str, missing: list[tuple[str, str, int, list[str]]]):
        super().__init__(message)
        self.missing = missing


def unsupported_message(missing: list[tuple[str, str, int, list[str]]], backend: str,
                        source: str | None = None, registered=None,
                        reasons: dict[str, str] | None = None) -> str:
    """The one message for ops a backend cannot run, wherever that is found (import, dispatch,
    a cuda binding refusing the plan's layouts): each ``(domain, op, version, nodes)`` with the
    versions ``registered(domain, op)`` lists for the backend and who would provide the op,
    then why (``reasons``: node label -> why its binding refused), then what to do."""
    head = f"{source}: " if source else ""
    lines = [f"{head}{len(missing)} op(s) have no kernel for backend {backend!r}:"]
    for domain, op_type, version, nodes in missing:
        shown = ", ".join(repr(n) for n in nodes[:5]) + (" ..." if len(nodes) > 5 else "")
        have = registered(domain, op_type) if registered is not None else None
        extra = f"; registered versions: {have}" if have else ""
        provider = ("tr_onnx (builtin op set)" if domain in (*ONNX_DOMAINS, INTERNAL_DOMAIN)
                    else f"a tr_onnx plugin package providing domain {domain!r}")
        lines.append(f"  - {op_type} (domain {domain or 'ai.onnx'!r}, since_version {version}) "
                     f"at node(s) {shown}{extra}; would be provided by {provider}")
    why = list(dict.fromkeys(f"    {label.split(' (', 1)[-1].rstrip(')')}: {reason}"
                             for label, reason in (reasons or {}).items()))[:12]
    if why:
        lines += ["  why (the op has a kernel, but not for these layouts/dtypes):"] + why
    if backend == "cuda":
        lines.append("No node falls back to NumPy on its own: train this model with "
                     "backend='numpy', or give these ops a cuda kernel (a KernelDef, or "
                     "OpDef.kernels['cuda'] = CudaKernel(...), in a plugin; the builtin "
                     "bindings are in tr_onnx/backends/cuda/ops/<family>.py).")
    lines.append("Ops come from op-set plugins; see docs/plugins.md and "
                 "`tr-onnx ops` for what is registered.")
    return "\n".join(lines)


class RegistryError(TrOnnxError):
    """Two op sets registered the same key, or a lookup found nothing."""


class ShapeError(TrOnnxError):
    """A value's shape could not be inferred, or a node's shapes are inconsistent."""


class InputError(TrOnnxError, ValueError):
    """A feed has the wrong name, shape or dtype."""


class OptionError(TrOnnxError, ValueError):
    """An optimizer's or a learning-rate schedule's argument is out of its range (PyTorch's
    checks, and no NaN or infinity): the message names the argument and its value."""


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


class ArenaSizeError(TrOnnxError):
    """A plan's arena would be larger than ``max_arena_bytes`` (default: the machine's physical
    memory), or could not be allocated; the message names the largest values and their nodes."""


class TrainingDiverged(TrOnnxError):
    """Too many steps in a row had a non-finite loss or gradient; none of them was applied."""


class NoStepApplied(TrOnnxError):
    """A training run trained batches but applied no optimizer step (each skipped as
    non-finite, fewer than ``max_bad_steps`` in a row, or too few to complete an accumulated
    step): its weights are those it started from."""


class ExportAdviceWarning(UserWarning):
    """The model shows signs that its exporter changed it (BatchNorm folded into the
    convolutions, all-zero biases dropped, tied weights untied, equal initializers merged):
    it trains exactly as written, but not as the PyTorch model would have. Emitted by
    ``TrainingSession`` once per finding of ``tr_onnx.export_advice.export_advice``; silence it
    with ``warnings.filterwarnings("ignore", category=tr_onnx.ExportAdviceWarning)``."""


class DistributedError(TrOnnxError):
    """A collective across ranks failed: another rank did not join it within the world's
    ``timeout_s`` (it died, hung or took another path), or it was called wrongly. ``rank`` is
    this rank, ``waited_for`` the collective, ``failed_rank`` the rank at fault where it can
    be known (else None)."""

    def __init__(self, message: str, rank: int | None = None, waited_for: str | None = None,
                 failed_rank: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.waited_for = waited_for
        self.failed_rank = failed_rank
