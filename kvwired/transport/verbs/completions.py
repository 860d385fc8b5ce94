"""A completion queue that wakes the event loop, and what a failed completion means."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from ...errors import FailureStatus, RemoteAccessError, TransportError
from . import core
from .core import VerbsError
from .device import Device

# (wr_id, status, opcode, immediate in host order), as the compiled core reaps them.
Completion = tuple[int, int, int, int]
# What the owner of a queue that failed as a whole is handed.
QUEUE_FAILED: Completion = (0, core.IBV_WC_GENERAL_ERR, 0, 0)

log = structlog.get_logger("kvwired.transport")

HINTS = {
    core.IBV_WC_RETRY_EXC_ERR: "the peer did not acknowledge: it is gone, or the GID/network "
    "between the nodes is wrong",
    core.IBV_WC_RNR_RETRY_EXC_ERR: "the receiver had no receive posted (its queue ran dry)",
    core.IBV_WC_REM_ACCESS_ERR: "the write fell outside what its key grants: outside its "
    "lease, or under a key revoked when the lease ended",
    core.IBV_WC_WR_FLUSH_ERR: "flushed after an earlier error on the same queue pair",
}

STATUS_NAMES = {
    core.IBV_WC_RETRY_EXC_ERR: FailureStatus.RETRY_EXCEEDED,
    core.IBV_WC_RNR_RETRY_EXC_ERR: FailureStatus.RNR_RETRY_EXCEEDED,
    core.IBV_WC_REM_ACCESS_ERR: FailureStatus.REMOTE_ACCESS,
    core.IBV_WC_REM_OP_ERR: FailureStatus.REMOTE_OPERATION,
    core.IBV_WC_REM_INV_REQ_ERR: FailureStatus.REMOTE_INVALID_REQUEST,
    core.IBV_WC_LOC_PROT_ERR: FailureStatus.LOCAL_PROTECTION,
    core.IBV_WC_LOC_LEN_ERR: FailureStatus.LOCAL_LENGTH,
    core.IBV_WC_LOC_QP_OP_ERR: FailureStatus.LOCAL_QP_OPERATION,
    core.IBV_WC_WR_FLUSH_ERR: FailureStatus.FLUSHED,
    core.IBV_WC_GENERAL_ERR: FailureStatus.GENERAL,
}


def completion_error(status: int, qp_num: int, what: str) -> TransportError:
    text = core.wc_status_str(status)
    kind = RemoteAccessError if status == core.IBV_WC_REM_ACCESS_ERR else TransportError
    return kind(f"{what} on QP {qp_num} failed: {text} (status {status})",
                hint=HINTS.get(status, "the queue pair is torn down and rebuilt on "
                               "the next request"),
                status=STATUS_NAMES.get(status, f"status_{status}"))


class CompletionQueue:
    """A CQ whose completion channel wakes the event loop.

    A wake-up is one call into the compiled core: take the channel's event,
    acknowledge it, re-arm, reap. With ``spin_seconds`` > 0 it also polls on
    every turn of the event loop while its owner has work outstanding
    (``busy``) and for ``spin_seconds`` after the last completion, so a
    stream of completions does not pay a wake-up each; once quiet it sleeps
    on the descriptor again.
    """

    def __init__(self, device: Device, depth: int,
                 on_completions: Callable[[list[Completion]], None],
                 spin_seconds: float = 0.0) -> None:
        try:
            self.cq = core.CompletionQueue(device.context, depth)
        except VerbsError as exc:
            raise TransportError(f"creating a completion queue on {device.name} failed: "
                                 f"{exc}") from exc
        self.fd = self.cq.fd
        self._on_completions = on_completions
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.fd, self._woken)
        self.closed = False
        self.busy: Callable[[], bool] = lambda: False
        self._spin_seconds = spin_seconds
        self._spinning = False
        self._last_activity = 0.0

    def _woken(self) -> None:
        if self.closed:
            return
        try:
            completions = self.cq.woken()
        except VerbsError as exc:
            self._failed(exc)
            return
        if completions:
            # Whatever completes from now on wakes us again: the core re-armed
            # the queue before it reaped.
            self._last_activity = time.perf_counter()
            self._on_completions(completions)
        self.kick()

    def drain(self) -> None:
        while not self.closed:
            try:
                completions = self.cq.poll()
            except VerbsError as exc:
                self._failed(exc)
                return
            if not completions:
                return
            self._last_activity = time.perf_counter()
            self._on_completions(completions)

    def _failed(self, exc: VerbsError) -> None:
        """The queue itself failed, not one of its completions (the kernel
        refused a poll or an event read): its owner is handed one failed
        completion, and fails and tears down as it would on any other."""
        log.warning("completion queue failed", fd=self.fd, error=str(exc))
        self._on_completions([QUEUE_FAILED])

    def kick(self) -> None:
        """Work was just posted or completed: poll for a while before sleeping."""
        if self._spin_seconds <= 0 or self.closed:
            return
        self._last_activity = max(self._last_activity, time.perf_counter())
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        if self.closed:
            self._spinning = False
            return
        self.drain()
        if self.busy() or time.perf_counter() - self._last_activity < self._spin_seconds:
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    def close(self) -> None:
        """Destroy the CQ and its channel (and a QP still on it, first).

        The core reads and acknowledges every event still pending before
        ibv_destroy_cq, which would otherwise wait for them for ever, inside
        the event loop (a failed QP flushes its work requests, and the loop
        has not woken yet): found by the systemd watchdog in the lab, which
        killed a sender stuck exactly there after its receiver was killed.
        """
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.fd)
        with contextlib.suppress(VerbsError):
            self.cq.close()
