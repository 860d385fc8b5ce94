"""The ports between sibling packages: one definition of each, as typed protocols.

The daemons and the experiments never import each other. What one side
implements and the other calls is declared here, once, below both:

- ``LeaseHolder``: what the sender's link tells whoever holds a receiver's
  lease (a push, or an experiment's echo lease);
- the hosts and handles (``SenderHost``, ``PeerHandle``, ``ReceiverHost``,
  ``SessionHandle``, ``Connection``): the surface of the daemons that
  experiments may use.

The daemons satisfy these structurally, and mypy checks that they do where
``kvwired.cli`` hands the experiments in. Anything an experiment needs and
does not find here is a change to the daemons' public surface, made on
purpose.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from .config import ReceiverConfig, SenderConfig
from .errors import KvwireError
from .layout import RequestShape
from .pool import Pool, Slot
from .protocol import Message
from .tasks import TaskSet
from .transport.base import DataChannel, Responder, Transport

Report = Callable[[Message], None]
A = TypeVar("A", bound=Message)


class Connection(Protocol):
    """A control connection between the daemons."""

    @property
    def local_host(self) -> str: ...

    def send(self, msg: Message) -> None: ...


# ------------------------------------------------------------- sender side


class LeaseHolder(Protocol):
    """Whatever holds one of the receiver's leases on a link."""

    def delivered(self, checksum: int) -> None:
        """The receiver has every byte and says so."""

    def abort_acked(self) -> None:
        """The receiver aborted the lease at our request."""

    def fail(self, error: KvwireError, *, by_receiver: bool = False) -> None:
        """The receiver aborted the lease, or the link went down."""

    @property
    def takes_writes(self) -> bool:
        """Still posting: its writes lost with a failed channel are posted again
        on the replacement (an abort's drain only waits for them to end)."""


class PeerHandle(Protocol):
    """The sender's link to one receiver."""

    name: str
    address: str

    @property
    def channel(self) -> DataChannel | None:
        """The first data channel: the one experiments (echo pings, streams) use."""
        ...

    @property
    def connected(self) -> bool: ...

    @property
    def local_host(self) -> str: ...

    async def ensure(self) -> None: ...

    async def request(self, msg: Message, answer: type[A],
                      undo: Callable[[A], Message | None] | None = None) -> A: ...

    def send(self, msg: Message) -> None: ...

    async def take_credit(self) -> None: ...

    def credit_back(self) -> None:
        """A credit the receiver returned on the data path (an echo's answer)."""
        ...

    def attach(self, lease: int, holder: LeaseHolder) -> None: ...

    def detach(self, lease: int) -> None: ...


class SenderHost(Protocol):
    config: SenderConfig
    transport: Transport

    def link(self, peer: str) -> PeerHandle: ...

    async def push(self, req: str, peer: str, shape: RequestShape, chunk_bytes: int,
                   discard: bool = True) -> dict[str, float]: ...

    def reserve_staging(self, length: int) -> Awaitable[Slot]: ...

    def release_staging(self, slot: Slot) -> None: ...


# ----------------------------------------------------------- receiver side


class SessionHandle(Protocol):
    """One sender connected to the receiver."""

    name: str
    alive: bool
    tasks: TaskSet  # what the session's messages started: cancelled when it ends

    @property
    def responder(self) -> Responder | None:
        """Grants the keys for the session's echo slots (None before the handshake)."""
        ...

    @property
    def conn(self) -> Connection: ...

    def return_credits(self, n: int) -> None:
        """Hand back credits of immediates a service took but whose answer did not."""
        ...


class ReceiverHost(Protocol):
    config: ReceiverConfig
    transport: Transport

    @property
    def pool(self) -> Pool: ...

    def allocate_lease_id(self) -> int: ...

    def free_lease_id(self, lease_id: int) -> None: ...

    def update_pool_metrics(self) -> None: ...
