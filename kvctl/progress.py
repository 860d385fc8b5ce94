"""Progress of a running experiment: bars on a terminal, one line per phase elsewhere.

Given the experiment's plan (``kvwired.experiments.plan``), both say how
long the run has taken and about how long is left. In a log or a pipe (the
lab's nodes stream theirs to the host) a phase that runs long still shows a
line every ``HEARTBEAT`` seconds, so a slow step never looks like a hung one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
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

from kvwired.experiments.plan import Estimate, PlannedPhase
from kvwired.units import format_clock as clock

HEARTBEAT = 20.0  # seconds of one phase without a line, in a log or pipe
BARS_VARIABLE = "KVWIRE_PROGRESS_BARS"  # "1": draw bars even into a pipe


class PhaseProgress:
    """One bar per phase ("latency 512 B", "stream 2 MiB", ...), in order."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True,
                 plan: Sequence[PlannedPhase] = ()) -> None:
        self._stream = stream
        self._enabled = enabled
        # A lab node's stderr is a pipe to the host; the host says when its
        # own is a terminal, and the bars are drawn through the pipe.
        self._live = enabled and (stream.isatty() or os.environ.get(BARS_VARIABLE) == "1")
        self._estimate = Estimate(list(plan)) if plan else None
        self._bars = Progress(
            TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[left]}"),
            console=Console(file=stream, force_terminal=self._live or None),
            disable=not self._live)
        self._whole: TaskID | None = None
        self._phase = ""
        self._task: TaskID | None = None
        self._last = (0, 0)
        self._started = self._phase_started = self._said = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> PhaseProgress:
        self._started = self._said = time.monotonic()
        self._bars.start()
        if self._live and self._estimate is not None:
            self._whole = self._bars.add_task(
                "whole run", total=self._estimate.phases, left="")
        if self._enabled and not self._live:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stopped.set()
        if self._beat is not None:
            self._beat.join()
        with self._lock:
            self._close_phase()
        self._bars.stop()

    def update(self, phase: str, done: int, total: int) -> None:
        with self._lock:
            if phase != self._phase:
                self._close_phase()
                self._phase = phase
                self._phase_started = time.monotonic()
                if self._estimate is not None:
                    self._estimate.begin(phase)
                self._task = self._bars.add_task(phase, total=total, left="")
            assert self._task is not None
            self._last = (done, total)
            left = self._left()
            self._bars.update(self._task, completed=done, total=total)
            if self._whole is not None and self._estimate is not None:
                self._bars.update(self._whole, completed=self._estimate.position,
                                  left=left)

    def _left(self) -> str:
        """``about 4:40 left`` from the plan, or "" before the plan can tell."""
        if self._estimate is None:
            return ""
        done, total = self._last
        seconds = self._estimate.remaining(done / total if total else 0.0)
        return "" if seconds is None else f"about {clock(seconds)} left"

    def _where(self) -> str:
        """``3:12 in, about 4:40 left, phase 14 of 62``."""
        parts = [f"{clock(time.monotonic() - self._started)} in"]
        left = self._left()
        if left:
            parts.append(left)
        if self._estimate is not None and self._estimate.position >= 0:
            parts.append(f"phase {self._estimate.position + 1} of {self._estimate.phases}")
        return ", ".join(parts)

    def _close_phase(self) -> None:
        if not self._phase:
            return
        took = time.monotonic() - self._phase_started
        if self._estimate is not None:
            self._estimate.finish(took)
        done, total = self._last
        line = f"  {self._phase}: {done}/{total} in {took:.1f} s ({self._where()})"
        if self._live and self._task is not None:
            # The finished phase's line above the bars; the bars keep the
            # running phase and the whole run only.
            self._bars.console.print(line, highlight=False)
            self._bars.remove_task(self._task)
            self._task = None
        elif self._enabled:
            self._say(line)
        self._phase = ""

    def _say(self, line: str) -> None:
        print(line, file=self._stream, flush=True)
        self._said = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stopped.wait(1.0):
            with self._lock:
                if self._phase and time.monotonic() - self._said >= HEARTBEAT:
                    done, total = self._last
                    took = time.monotonic() - self._phase_started
                    self._say(f"  {self._phase}: {done}/{total} so far, {took:.0f} s "
                              f"({self._where()})")
