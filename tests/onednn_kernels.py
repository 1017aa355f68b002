"""What the tests of the oneDNN fast paths share: oneDNN is required where the test extra
installs it (``onednn-cpu-gomp``, Linux x86-64) and skipped elsewhere, and a spy naming the
fast-path factories that built a kernel."""

from __future__ import annotations

import platform

import pytest

from tr_onnx import onednn

EXPECTED = platform.system() == "Linux" and platform.machine() == "x86_64"


def require_onednn() -> None:
    """Fail where the test extra installs oneDNN and it is missing; skip where it has no wheel."""
    if not onednn.available():
        if EXPECTED:
            pytest.fail("oneDNN is not installed (pip install onednn-cpu-gomp, in tr_onnx[test])")
        pytest.skip("oneDNN has no wheel for this platform")


def spy_kernels(monkeypatch, module, names) -> list[str]:
    """The names of ``module``'s factories ``names`` that built a kernel, in call order (a
    factory returning None, declining, is not counted)."""
    built = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, real=real, name=name, **kwargs):
            run = real(*args, **kwargs)
            if run is not None:
                built.append(name)
            return run

        monkeypatch.setattr(module, name, spy)
    return built
