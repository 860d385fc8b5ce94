"""A completion queue that wakes the event loop, and what a failed completion means."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from typing import Any

import pyverbs.enums as e
from pyverbs.cq import CQ, CompChannel, cqe_status_to_str
from pyverbs.pyverbs_error import PyverbsError

from ...errors import FailureStatus, RemoteAccessError, TransportError
from .device import Device

POLL_BATCH = 64


HINTS = {
    e.IBV_WC_RETRY_EXC_ERR: "the peer did not acknowledge: it is gone, or the GID/network "
    "between the nodes is wrong",
    e.IBV_WC_RNR_RETRY_EXC_ERR: "the receiver had no receive posted (its queue ran dry)",
    e.IBV_WC_REM_ACCESS_ERR: "the write fell outside what its key grants: outside its "
    "lease, or under a key revoked when the lease ended",
    e.IBV_WC_WR_FLUSH_ERR: "flushed after an earlier error on the same queue pair",
}



def infiniband_event_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                found.add(int(name))
    return found


STATUS_NAMES = {
    e.IBV_WC_RETRY_EXC_ERR: FailureStatus.RETRY_EXCEEDED,
    e.IBV_WC_RNR_RETRY_EXC_ERR: FailureStatus.RNR_RETRY_EXCEEDED,
    e.IBV_WC_REM_ACCESS_ERR: FailureStatus.REMOTE_ACCESS,
    e.IBV_WC_REM_OP_ERR: FailureStatus.REMOTE_OPERATION,
    e.IBV_WC_REM_INV_REQ_ERR: FailureStatus.REMOTE_INVALID_REQUEST,
    e.IBV_WC_LOC_PROT_ERR: FailureStatus.LOCAL_PROTECTION,
    e.IBV_WC_LOC_LEN_ERR: FailureStatus.LOCAL_LENGTH,
    e.IBV_WC_LOC_QP_OP_ERR: FailureStatus.LOCAL_QP_OPERATION,
    e.IBV_WC_WR_FLUSH_ERR: FailureStatus.FLUSHED,
    e.IBV_WC_GENERAL_ERR: FailureStatus.GENERAL,
}


def completion_error(status: int, qp_num: int, what: str) -> TransportError:
    text = cqe_status_to_str(status)
    kind = RemoteAccessError if status == e.IBV_WC_REM_ACCESS_ERR else TransportError
    return kind(f"{what} on QP {qp_num} failed: {text} (status {status})",
                          hint=HINTS.get(status, "the queue pair is torn down and rebuilt on "
                                         "the next request"),
                          status=STATUS_NAMES.get(status, f"status_{status}"))



class CompletionQueue:
    """A CQ whose completion channel wakes the event loop.

    With ``spin_seconds`` > 0 it also polls on every turn of the event loop
    while its owner has work outstanding (``busy``) and for ``spin_seconds``
    after the last completion, so a stream of completions does not pay a
    wake-up each; once quiet it sleeps on the descriptor again.
    """

    def __init__(self, device: Device, depth: int,
                 on_completions: Callable[[list[Any]], None],
                 spin_seconds: float = 0.0) -> None:
        before = infiniband_event_fds()
        self.channel = CompChannel(device.context)
        created = infiniband_event_fds() - before
        if len(created) != 1:
            self.channel.close()
            raise TransportError("cannot find the completion channel's file descriptor")
        self.fd = created.pop()
        # Non-blocking, so a spurious wake-up can never block the loop in
        # ibv_get_cq_event (which pyverbs calls holding the GIL).
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.cq = CQ(device.context, depth, None, self.channel, 0)
        self._on_completions = on_completions
        self._loop = asyncio.get_running_loop()
        self.cq.req_notify()
        self._loop.add_reader(self.fd, self._woken)
        self.closed = False
        self.busy: Callable[[], bool] = lambda: False
        self._spin_seconds = spin_seconds
        self._spinning = False
        self._last_activity = 0.0

    def _woken(self) -> None:
        try:
            self.channel.get_cq_event(self.cq)
        except PyverbsError:
            return  # nothing pending after all
        self.cq.ack_events(1)
        # Re-arm before draining: a completion arriving meanwhile still wakes us.
        self.cq.req_notify()
        self.drain()
        self.kick()

    def drain(self) -> None:
        while not self.closed:
            count, completions = self.cq.poll(POLL_BATCH)
            if not count:
                return
            self._last_activity = time.perf_counter()
            self._on_completions(completions)

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
        """Destroy the CQ and its channel; the QP on it must be gone already.

        ibv_destroy_cq waits until every completion event the channel has
        delivered is read and acknowledged. An event still pending (a QP that
        failed flushes its work requests, and the loop has not woken yet)
        would make it wait for ever, inside the event loop: read and ack the
        pending ones first. Found by the systemd watchdog in the lab, which
        killed a sender stuck exactly there after its receiver was killed.
        """
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self.fd)
        while True:
            try:
                self.channel.get_cq_event(self.cq)  # non-blocking: fails when none is left
            except PyverbsError:
                break
            self.cq.ack_events(1)
        for resource in (self.cq, self.channel):
            with contextlib.suppress(PyverbsError):
                resource.close()


