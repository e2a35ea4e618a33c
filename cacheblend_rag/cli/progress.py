"""Progress of the long commands (ingest, eval, tune, bench, check, store recode): Rich bars on a terminal,
plain lines everywhere else.

Rich draws its bars only on a terminal: with output sent to a file, a pipe, ``nohup``, CI or a container
log it prints them once, when the work is over, and a user watching the log sees nothing for the whole run.
There each stage prints a line instead when it starts, every ``every_items`` items (a tenth of the stage by
default), every ``every_s`` seconds while it runs, counted by a timer so that a single slow item (or a
stage that reports no items, a bench section) still shows it is alive, and when it ends; each line says
the time since the command started, the count, the rate and about how long is left.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

DEFAULT_EVERY_S = 30.0
STEPS_PER_STAGE = 10  # plain lines per stage from its counts alone, beside the timer's


@dataclass
class _Stage:
    label: str
    total: int | None
    started: float
    done: int = 0
    printed_done: int = -1  # the count of the last line printed; -1: none yet
    printed_at: float = 0.0
    finished: bool = False
    task: TaskID | None = field(default=None, repr=False)


class ProgressReporter:
    """``update(stage, done, total)`` from a command's progress callback; a context manager around the
    work. ``labels``: what each stage is called in the output (default: its name). ``terminal``: bars or
    lines (default: whether ``console`` is a terminal)."""

    def __init__(
        self,
        console: Console,
        labels: dict[str, str] | None = None,
        every_s: float = DEFAULT_EVERY_S,
        every_items: int | None = None,
        terminal: bool | None = None,
    ) -> None:
        self.console = console
        self.labels = labels or {}
        self.every_s = every_s
        self.every_items = every_items
        self.terminal = console.is_terminal if terminal is None else terminal
        self.started = time.monotonic()
        self._stages: dict[str, _Stage] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._bars: Progress | None = None

    def __enter__(self) -> ProgressReporter:
        if self.terminal:
            self._bars = Progress(
                TextColumn("{task.description:<24}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._bars.__enter__()
        else:
            self._timer = threading.Thread(target=self._tick, name="progress-lines", daemon=True)
            self._timer.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
        if self._bars is not None:
            self._bars.__exit__(kind, exc, tb)

    def update(self, stage: str, done: int, total: int | None = None) -> None:
        """``done`` of ``total`` items of ``stage`` (total None: not known, a stage that counts nothing)."""
        now = time.monotonic()
        with self._lock:
            entry = self._stages.get(stage)
            if entry is None:
                entry = self._stages[stage] = _Stage(self.labels.get(stage, stage), total, now)
                if self._bars is not None:
                    entry.task = self._bars.add_task(entry.label, total=total)
            entry.done, entry.total = done, total if total is not None else entry.total
            entry.finished = entry.total is not None and done >= entry.total
            if self._bars is not None and entry.task is not None:
                self._bars.update(entry.task, completed=done, total=entry.total)
                return
            step = self.every_items or max(1, (entry.total or 0) // STEPS_PER_STAGE)
            due = (
                entry.printed_done < 0
                or entry.finished
                or done - entry.printed_done >= step
                or now - entry.printed_at >= self.every_s
            )
            if due and done != entry.printed_done:
                self._line(entry, now)

    def finish(self, stage: str) -> None:
        """``stage`` is over, whatever its count says (one that counts nothing, a bench section)."""
        now = time.monotonic()
        with self._lock:
            entry = self._stages.get(stage)
            if entry is None or entry.finished:
                return
            entry.finished = True
            if self._bars is not None and entry.task is not None:
                total = entry.total if entry.total is not None else max(1, entry.done)
                self._bars.update(entry.task, completed=total, total=total)
                return
            self._line(entry, now)

    def _tick(self) -> None:
        """Every second, a line for each running stage that has printed none for ``every_s`` seconds."""
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self._lock:
                for entry in self._stages.values():
                    if not entry.finished and now - entry.printed_at >= self.every_s:
                        self._line(entry, now)

    def _line(self, entry: _Stage, now: float) -> None:
        elapsed = now - entry.started
        if entry.total is not None:
            count = f"{entry.done}/{entry.total}"
            count += f" ({100 * entry.done // entry.total}%)" if entry.total else ""
        else:  # a stage that counts nothing until it is over
            count = f"{entry.done}" if entry.done else ("done" if entry.finished else "running")
        parts = [f"[{self._clock(now)}] {entry.label}: {count}"]
        if entry.done and elapsed > 0:
            rate = entry.done / elapsed
            parts.append(f"{rate:.2f}/s" if rate < 10 else f"{rate:,.0f}/s")
            if entry.total is not None and not entry.finished:
                parts.append(f"~{_duration((entry.total - entry.done) / rate)} left")
        parts.append(f"{_duration(elapsed)} so far" if not entry.finished else f"took {_duration(elapsed)}")
        self._print(", ".join(parts))
        entry.printed_done, entry.printed_at = entry.done, now

    def _clock(self, now: float) -> str:
        return _duration(now - self.started)

    def _print(self, text: str) -> None:
        # markup off: labels and notes may hold user text with [...]; soft_wrap: one line, whatever the width
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.console.file.flush()


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
