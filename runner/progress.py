"""Progress display: a rich bar on a terminal, timestamped plain lines for cron and Slurm logs."""
from __future__ import annotations

import datetime as _dt
import sys
import time
from typing import Optional, TextIO


_STDERR_CONSOLE = None


def stderr_console():
    """One rich Console on stderr shared by the progress bar and log lines, so logs print above
    the bar instead of through it."""
    global _STDERR_CONSOLE
    if _STDERR_CONSOLE is None:
        from rich.console import Console

        _STDERR_CONSOLE = Console(stderr=True)
    return _STDERR_CONSOLE


def _eta(done: int, total: Optional[int], elapsed: float) -> Optional[float]:
    if not total or done <= 0 or elapsed <= 0 or done >= total:
        return None
    return (total - done) * elapsed / done


def now_stamp() -> str:
    """The wall clock as a progress line starts with (run's, profile's)."""
    return _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def hms(seconds: Optional[float]) -> str:
    """H:MM:SS, or ? where unknown."""
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """update(done, failed, output_tokens) as results land; close() at the end.

    `total` counts the records this session will look at (already-done ones included, since
    resume skips them quickly); `already_done` starts the count there, and `already_failed`
    (those of them in errors.jsonl) the error count, so a resumed run's lines count the errors
    of the whole run as they count its requests.
    """

    def __init__(self, total: Optional[int], already_done: int = 0, mode: str = "auto",
                 interval_s: float = 10.0, stream: Optional[TextIO] = None,
                 already_failed: int = 0, unit: str = "output"):
        self.stream = stream or sys.stderr
        self.total = total
        self.interval_s = interval_s
        self.start = time.monotonic()
        self._begun = False
        self.base = already_done
        self.base_failed = already_failed
        self.done = already_done
        self.failed = already_failed
        self.output_tokens = 0          # the tokens its rate counts (unit: output or prompt)
        self.unit = unit                # "prompt" for an embedding job
        self._last_line = self.start
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self._bar = None
        if mode == "bar":
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)

        self._bar = RichProgress(
            TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[errors]} errors"),
            TextColumn("{task.fields[tps]} %s tok/s" % ("out" if self.unit == "output"
                                                         else self.unit)),
            TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(),
            console=stderr_console() if self.stream is sys.stderr else Console(file=self.stream),
            transient=False)
        self._task = self._bar.add_task("run", total=self.total, completed=self.done,
                                        errors=self.failed, tps="0.0")
        self._bar.start()

    def begin(self) -> None:
        """The first request reached the engine: rates count from here, as the report's
        generation time does (reading and forecasting the first batch are setup), so the last
        line and the summary after it give one figure."""
        if not self._begun:
            self._begun = True
            self.start = time.monotonic()

    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return self.output_tokens / elapsed if elapsed > 0 else 0.0

    def update(self, done: int, failed: int, output_tokens: int) -> None:
        self.done = self.base + done + failed
        self.failed = self.base_failed + failed
        self.output_tokens = output_tokens
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, errors=self.failed,
                             tps=f"{self.rate():.1f}")
        elif now - self._last_line >= self.interval_s:
            self._last_line = now
            self.print_line()

    def print_line(self, prefix: str = "progress") -> None:
        elapsed = time.monotonic() - self.start
        stamp = now_stamp()
        total = f"/{self.total}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        eta = _eta(self.done - self.base, (self.total - self.base) if self.total else None, elapsed)
        print(f"{stamp} batchinfer {prefix}: {self.done}{total} requests{pct}, {self.failed} errors, "
              f"{self.rate():.1f} {self.unit} tok/s, elapsed {hms(elapsed)}, ETA {hms(eta)}",
              file=self.stream, flush=True)

    def close(self, outcome: str = "finished") -> None:
        """`outcome`: the last progress line's word (finished, interrupted, failed)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.mode == "lines":
            self.print_line(outcome)
