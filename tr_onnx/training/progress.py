"""The progress line the ``Trainer`` draws on stderr."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """One status line on ``stream``, redrawn in place with ``\\r`` at most every ``interval``
    seconds; draws nothing when disabled or (unless ``tty_only`` is False) when the stream is
    not a terminal."""

    def __init__(self, total: int, label: str, stream=None, enabled: bool = True,
                 width: int = 24, interval: float = 0.1, tty_only: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled and (not tty_only or isatty is not None and isatty()))
        self.total, self.label, self.width, self.interval = total, label, width, interval
        self._last = 0.0
        self._shown = 0

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < self.interval:
            return
        self._last = now
        filled = self.width * done // max(self.total, 1)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{self.total} {text}")
        self.stream.write("\r" + line.ljust(self._shown))
        self.stream.flush()
        self._shown = len(line)

    def close(self) -> None:
        """Clear the line (the caller logs a summary in its place)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0
