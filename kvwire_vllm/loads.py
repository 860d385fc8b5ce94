"""Which of a decode engine's loads have ended, between two threads.

A load runs on the connector's event-loop thread and ends there; vLLM asks
which ended from its own thread, once a step. Plain Python with no vLLM or
torch in it, so it is tested with the daemons' suite.
"""

from __future__ import annotations

import threading


class EndedLoads:
    """Loads begun, and those ended since vLLM last asked (and which failed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._an_end = threading.Condition(self._lock)
        self._running = 0
        self._finished: set[str] = set()
        self._failed: set[str] = set()

    def begun(self, count: int) -> None:
        with self._lock:
            self._running += count

    def ended(self, req_id: str, failed: bool) -> None:
        with self._lock:
            self._running -= 1
            self._finished.add(req_id)
            if failed:
                self._failed.add(req_id)
            self._an_end.notify_all()

    def take(self) -> tuple[set[str], set[str]]:
        """Loads ended since the last call, and which of them failed."""
        with self._lock:
            finished, self._finished = self._finished, set()
            failed, self._failed = self._failed, set()
            return finished, failed

    def wait(self, seconds: float) -> bool:
        """Until a load ends, at most ``seconds``, when loads run and none has
        ended untaken; whether one has ended (untaken) now.

        For a step that computes nothing: vLLM steps an engine whose only
        requests wait for their KV without pause, each step only to ask
        whether a load ended, which spins a core per waiting engine (taken
        from the prefill engine on a shared machine) and hears a load that
        ended mid-step only at the next step. Waiting here sleeps instead,
        and hears the end the moment it comes; ``seconds`` bounds how late
        the engine sees a request that arrives meanwhile."""
        with self._lock:
            if self._running > 0 and not self._finished:
                self._an_end.wait(seconds)
            return bool(self._finished)
