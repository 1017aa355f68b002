"""Backends run a compiled plan. ``numpy`` is the reference (the CPU); ``cuda`` comes later and
is imported only when asked for."""

BACKENDS = ("numpy",)
DEFAULT_CHANNEL_ALIGN = {"numpy": 1, "cuda": 8}


def resolve_backend(name: str) -> str:
    """``auto`` picks the best usable backend; unknown names list the valid ones."""
    from ..errors import TrOnnxError

    if name == "auto":
        return "numpy"
    if name not in BACKENDS:
        raise TrOnnxError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)} (or 'auto')")
    return name
