"""The one interface every data path implements: one-sided writes.

The shape follows RDMA verbs, so the daemons never learn which transport
they run over:

- memory is *registered* once and addressed remotely by (key, offset); a
  responder with per-lease keys (the receiver) grants a key per byte range
  and revokes it, and a write under any other key is a remote access error;
- the initiator *posts* a list of writes local→remote and is told when all of
  them have been placed in the remote memory (one signalled completion per
  post, because per-work-request completions are what small chunks cannot
  afford);
- a write may carry a 32-bit *immediate*, which the responder sees, after the
  bytes it follows, as a receive completion;
- any failure fails the channel: every outstanding post fails with the
  reason, and the daemon tears the channel down and builds a new one.

Connections are bootstrapped over the daemons' control connection: the
initiator makes an *offer*, the responder answers, the initiator completes.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import structlog

from ..errors import TransportError
from ..pool import SharedMemory

log = structlog.get_logger("kvwired.transport")

ImmediateHandler = Callable[[int], None]
ErrorHandler = Callable[[Exception], None]


class Door(Protocol):
    """What a data listener may cost before a connection proves it belongs to a
    session (``gate.Gate`` is one): admitted or refused, a timeout, counted."""

    timeout: float

    def admit(self, address: str) -> bool: ...

    def settled(self) -> None: ...

    def refuse(self, address: str, reason: str, detail: str) -> None: ...


class Write(NamedTuple):
    """Copy ``length`` bytes from local ``local_offset`` to remote ``remote_offset``."""

    local_offset: int
    remote_offset: int
    length: int


@dataclass(frozen=True)
class RemoteRegion:
    """What a responder tells its initiator about its registered memory."""

    key: int
    size: int

    def to_wire(self) -> dict[str, int]:
        return {"key": self.key, "size": self.size}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RemoteRegion:
        return cls(int(data["key"]), int(data["size"]))


class DataChannel(ABC):
    """The initiator's end of a connection: posts writes in order.

    Failing and closing are one path for every transport: the first error
    is kept, every post still outstanding fails with it, the connection is
    torn down; a failure (not a close on purpose) is also told, once, to
    ``on_failure``.
    """

    # Told once, when the channel fails (not when it is closed on purpose).
    on_failure: ErrorHandler | None = None
    _error: TransportError | None = None
    # When a write last completed, or writes became pending on an idle channel:
    # what ``stalled_for`` measures from.
    _progress_at: float = 0.0
    _busy_when_failed = False  # it had writes pending when it failed

    def _posting(self) -> None:
        """Called by ``post`` before it queues: an idle channel starts its clock."""
        if self.pending_writes == 0:
            self._progress_at = time.monotonic()

    def _progressed(self) -> None:
        """Called on every completion: the channel moves."""
        self._progress_at = time.monotonic()

    def stalled_for(self, now: float) -> float:
        """Seconds this channel has had writes pending and seen none complete
        (0 when idle or failed). A stream whose packets are silently dropped
        raises no error of its own, and the control connection beside it
        stays healthy: this is what tells (see ``DataChannels.check_progress``)."""
        if self._error is not None or self.pending_writes == 0:
            return 0.0
        return max(0.0, now - self._progress_at)

    def silent_for(self, now: float) -> float:
        """Like ``stalled_for``, but frozen at the failure: how long the channel
        had writes pending and placed none, up to ``now`` or until it failed
        (0 if it was idle). What decides whether a replacement is worth it."""
        busy = self.pending_writes > 0 if self._error is None else self._busy_when_failed
        return max(0.0, now - self._progress_at) if busy else 0.0

    def inherit_silence(self, replaced: DataChannel) -> None:
        """This channel replaces ``replaced`` and took over its writes: the
        silence goes on counting from the old channel's last progress, so a
        path that stays dead is given up after the stall bound, however many
        times its channel is replaced."""
        now = time.monotonic()
        if self.pending_writes > 0 and (silent := replaced.silent_for(now)) > 0:
            self._progress_at = now - silent

    def report_failure(self, error: Exception) -> None:
        if self.on_failure is not None:
            handler, self.on_failure = self.on_failure, None
            handler(error)

    def fail(self, error: TransportError, quiet: bool = False) -> None:
        if self._error is not None:
            return
        self._busy_when_failed = self.pending_writes > 0
        self._error = error
        if not quiet:
            log.warning("data channel failed", transport=self.kind, error=str(error))
            self.report_failure(error)
        for future in self._take_outstanding():
            if not future.done():
                future.set_exception(error)
        self._tear_down()

    def close(self) -> None:
        self.fail(TransportError("data channel closed"), quiet=True)

    kind: str = "?"

    @abstractmethod
    def _take_outstanding(self) -> list[asyncio.Future[None]]:
        """Forget every post not yet completed; their futures, to fail."""

    @abstractmethod
    def _tear_down(self) -> None:
        """Drop the connection (queue pair, socket) after a failure or close."""

    @property
    def pending_writes(self) -> int:
        """Writes posted and not yet known to be placed (queued ones included)."""
        return 0

    @abstractmethod
    def post(self, writes: Sequence[Write], imm: int | None = None,
             key: int | None = None) -> asyncio.Future[None]:
        """Queue ``writes`` in order; the last carries ``imm`` if given.

        ``key`` is the key the responder granted for the range written (a
        lease's); None writes under the region's key, which a responder with
        per-lease keys refuses. Never blocks. The future resolves when every
        write of this post has been placed remotely, or fails with a
        ``TransportError``.
        """

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once the channel has failed or been closed."""


class Responder(ABC):
    """The receiving end, made for one initiator.

    ``writes_received`` counts the writes this end saw land (all of them over
    TCP; over verbs only those with an immediate, as the others complete
    without the receiver's CPU); the daemon reads it once per immediate.
    """

    writes_received: int = 0

    @property
    def receives_posted(self) -> int:
        """Receives waiting for immediates (verbs); a stream needs none."""
        return 0

    @abstractmethod
    async def accept(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Prepare to receive (receives posted, listener armed); return the answer."""

    @abstractmethod
    async def grant(self, offset: int, length: int) -> int:
        """A key under which this responder's initiator may write ``length``
        bytes at ``offset``, and nowhere else."""

    @abstractmethod
    def revoke(self, key: int, then: Callable[[], None]) -> None:
        """End ``key``; ``then`` runs once no write under it can land any more
        (at once if the connection is gone). Unknown keys just run ``then``."""

    @abstractmethod
    def close(self) -> None: ...


class Initiator(ABC):
    """The sending end, being connected: offer, then complete with the answer."""

    @abstractmethod
    async def offer(self) -> dict[str, Any]: ...

    @abstractmethod
    async def complete(self, answer: dict[str, Any]) -> DataChannel:
        """Finish the connection; the answer also describes the remote region."""

    @abstractmethod
    def abandon(self) -> None:
        """Release what ``offer`` set up when ``complete`` will never be called."""


class Transport(ABC):
    """A kind of data path (``tcp``, ``verbs``) bound to one daemon's memory."""

    name: str
    # Keys per granted range (the receiver), or one key for the whole region.
    per_lease_keys: bool = False

    @abstractmethod
    async def start(self, memory: SharedMemory) -> None:
        """Take ``memory`` as this daemon's pool (checks, registration, listeners)."""

    @abstractmethod
    def initiator(self, local_host: str, rail: str = "") -> Initiator:
        """A connection from ``local_host`` (the control connection's own address),
        or over ``rail`` (a device name) when one is given and the transport has rails."""

    @abstractmethod
    def responder(
        self, local_host: str, on_immediate: ImmediateHandler, on_error: ErrorHandler
    ) -> Responder:
        """A responder on ``local_host``, the address the initiator reached us at."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What to log about this data path at start."""

    @abstractmethod
    async def stop(self) -> None: ...
