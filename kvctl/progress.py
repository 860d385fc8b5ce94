"""Progress of a running experiment: bars on a terminal, one line per phase elsewhere."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class PhaseProgress:
    """One bar per phase ("latency 512 B", "stream 2 MiB", ...), in order."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self._stream = stream
        self._enabled = enabled
        self._live = enabled and stream.isatty()
        self._bars = Progress(
            TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=Console(file=stream), disable=not self._live)
        self._phase = ""
        self._task: TaskID | None = None
        self._last = (0, 0)

    def __enter__(self) -> PhaseProgress:
        self._bars.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close_phase()
        self._bars.stop()

    def update(self, phase: str, done: int, total: int) -> None:
        if phase != self._phase:
            self._close_phase()
            self._phase = phase
            self._task = self._bars.add_task(phase, total=total)
        assert self._task is not None
        self._bars.update(self._task, completed=done, total=total)
        self._last = (done, total)

    def _close_phase(self) -> None:
        if not self._phase:
            return
        done, total = self._last
        if not self._live and self._enabled:
            print(f"  {self._phase}: {done}/{total}", file=self._stream, flush=True)
        self._phase = ""
