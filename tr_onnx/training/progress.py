"""The progress the ``Trainer`` shows on stderr: where the epoch is, how long it has run and how
long it has left.

On a terminal it is one line redrawn in place with ``\\r``. Anywhere else (a pipe, a log file,
the output ``mpiexec`` forwards from rank 0) a ``\\r`` line is one endless line, and nothing
at all until the epoch ends tells nobody anything: there it writes plain lines instead, one
each time another tenth of the epoch's batches is done or ``line_every`` seconds (10) have
passed since the last one, whichever comes first."""

from __future__ import annotations

import sys
import time


def clock(seconds: float) -> str:
    """``seconds`` as ``M:SS`` (``H:MM:SS`` from an hour on)."""
    s = int(seconds + 0.5)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class ProgressBar:
    """Progress through ``total`` steps (the batches of an epoch) on ``stream`` (stderr):
    the step, elapsed time, the ETA (from the rate of the steps since the first update, so that
    a first step that also plans is not counted) and the caller's ``text``. A terminal gets a
    line redrawn in place at most every ``interval`` seconds; another stream plain lines (the
    module docstring). ``enabled=False`` draws nothing. ``total`` 0: not known (a stream of
    batches without a length): the steps done and the elapsed time, no ETA."""

    def __init__(self, total: int, label: str, stream=None, enabled: bool = True,
                 width: int = 24, interval: float = 0.1, line_every: float = 10.0):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty is not None and isatty())
        self.enabled = bool(enabled)
        self.total, self.label, self.width, self.interval = total, label, width, interval
        self.line_every = line_every
        self._start = time.monotonic()
        self._first: tuple[float, int] | None = None  # (time, done) of the first update
        self._last = 0.0
        self._last_done = 0  # steps done at the last plain line
        self._shown = 0

    def timing(self, done: int, now: float) -> str:
        """``elapsed<eta`` (tqdm's notation); ``?`` until the rate is known."""
        elapsed = clock(now - self._start)
        t0, d0 = self._first or (now, done)
        if self.total <= 0:
            return elapsed
        if done <= d0 or now <= t0:
            return f"{elapsed}<?"
        return f"{elapsed}<{clock((now - t0) / (done - d0) * (self.total - done))}"

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (now, done)
        if self.terminal:
            self._redraw(done, text, now)
        else:
            self._line(done, text, now)

    def _redraw(self, done: int, text: str, now: float) -> None:
        if done < self.total and now - self._last < self.interval:
            return
        self._last = now
        if self.total > 0:
            filled = self.width * done // self.total
            where = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}"
        else:
            where = f"{done}/?"
        line = f"{self.label} {where} {self.timing(done, now)} {text}"
        self.stream.write("\r" + line.ljust(self._shown))
        self.stream.flush()
        self._shown = len(line)

    def _line(self, done: int, text: str, now: float) -> None:
        total = self.total
        if 0 < total <= done:  # the caller's epoch summary follows
            return
        tenth = total > 0 and self._last_done * 10 // total < done * 10 // total
        if not tenth and now - max(self._last, self._start) < self.line_every:
            return
        self._last, self._last_done = now, done
        where = f"{done}/{total} ({100 * done // total}%)" if total > 0 else f"{done}/?"
        self.stream.write(f"{self.label}: {where} {self.timing(done, now)} {text}\n")
        self.stream.flush()

    def close(self) -> None:
        """Clear the terminal's line (the caller logs a summary in its place)."""
        if self.enabled and self.terminal and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0
