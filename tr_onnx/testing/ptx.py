"""Kernel parameter lists as the GPU sees them: every launch checked against its kernel's PTX.

The host build of the kernels is called through ctypes with argument types taken from the
launch's own arguments, so a launch that passes an ``np.int32`` where the kernel takes a
``long long`` (or a float where it takes an int) runs correctly on the CPU and reads garbage on
the GPU: the host build cannot see it. NVRTC's PTX for ``compute_90`` (no driver needed) lists
each ``.entry``'s parameters with their PTX types; ``check_launch`` holds a launch's arguments
against that list: a ``DeviceBuffer`` (or None, a null pointer) and an ``np.int64`` are
``.u64``/``.s64``, an ``np.int32`` ``.u32``/``.s32``, an ``np.float32`` ``.f32``, an
``np.float64`` ``.f64``, and the count must match. (A pointer and a ``long long`` are both 64
bits in PTX: which one a parameter is, the host signatures test of
tests/test_cuda_executor_cpu.py checks.)

``FakeRecorder.launch`` (and so the host emulator) checks every launch it records, so every
emulated plan in the tests is held against the device's parameter lists. The PTX of a source is
compiled once per process and text. Needs CuPy's NVRTC binding (the test extra installs it);
``available()`` says whether it imports.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence

import numpy as np

from ..backends.cuda import sources
from ..backends.cuda.capture import DeviceBuffer
from ..errors import InternalError

ARCH = "compute_90"

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+\w+")

ACCEPTS: dict[type, frozenset[str]] = {
    DeviceBuffer: frozenset({"u64", "s64", "b64"}),
    type(None): frozenset({"u64", "s64", "b64"}),
    np.int64: frozenset({"u64", "s64", "b64"}),
    np.int32: frozenset({"u32", "s32", "b32"}),
    np.float32: frozenset({"f32"}),
    np.float64: frozenset({"f64"}),
}
"""A launch argument's Python type -> the PTX parameter types that take it."""


class LaunchSignatureError(InternalError):
    """A launch's arguments do not match its kernel's PTX parameter list."""


def entry_params(ptx: str) -> dict[str, tuple[str, ...]]:
    """``{entry name: (PTX type of each parameter, ...)}`` of a PTX module's ``.entry``s."""
    return {name: tuple(_PARAM.findall(params)) for name, params in _ENTRY.findall(ptx)}


@functools.cache
def available() -> bool:
    """Whether CuPy's NVRTC binding imports (it needs no driver or GPU)."""
    try:
        return importlib.import_module("cupy.cuda").nvrtc is not None
    except (ImportError, AttributeError):
        return False


@functools.cache
def _params_of_text(text: str, label: str) -> dict[str, tuple[str, ...]]:
    ptx = sources.nvrtc_compile(text, label.replace("/", "_").replace(":", "_") + ".cu",
                                sources.compile_options(ARCH), label)
    return entry_params(ptx.decode() if isinstance(ptx, bytes) else ptx)


def kernel_params(ref) -> tuple[str, ...]:
    """The PTX parameter types of the kernel ``ref`` (a ``KernelRef``) names: of tr_onnx's
    family ``ref.family``, or of the source ``ref.source`` an op set brings."""
    if ref.source is None:
        text, label = sources.SOURCES[ref.family].text, f"kernels/{ref.family}.cu"
    else:
        text, label = ref.source, ref.family
    params = _params_of_text(text, label)
    if ref.name not in params:
        raise LaunchSignatureError(f"{label} defines no kernel {ref.name!r} in its PTX "
                                   f"(it has {len(params)} entries)")
    return params[ref.name]


def check_launch(ref, args: Sequence, node: str = "") -> None:
    """Raise ``LaunchSignatureError`` unless ``args`` match ``ref``'s PTX parameters in count
    and, one by one, in type (``ACCEPTS``)."""
    params = kernel_params(ref)
    where = f"{node}: " if node else ""
    if len(params) != len(args):
        raise LaunchSignatureError(f"{where}launch of {ref.name} passes {len(args)} arguments; "
                                   f"its PTX takes {len(params)}")
    for k, (ptx_type, arg) in enumerate(zip(params, args)):
        accepted = ACCEPTS.get(type(arg))
        if accepted is None or ptx_type not in accepted:
            raise LaunchSignatureError(
                f"{where}launch of {ref.name}: argument {k} is {type(arg).__name__} "
                f"({arg!r}), the kernel's PTX parameter {k} is .{ptx_type}")


__all__ = ["ACCEPTS", "LaunchSignatureError", "available", "check_launch", "entry_params",
           "kernel_params"]
