"""One connected sender, as the receiver's parts share it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..control import ControlConnection
from ..protocol.control import Credits
from ..tasks import TaskSet
from ..transport.base import Responder


@dataclass(eq=False)
class SenderSession:
    """One connected sender: its control connection and data-path responders,
    one per data channel (``qps_per_peer`` on the sender)."""

    conn: ControlConnection
    name: str = "?"
    label: str = "?"  # its name in metrics: bounded (kvwired.receiver.senders)
    responders: list[Responder] = field(default_factory=list)
    leases: set[int] = field(default_factory=set)
    # Credits to hand back, per channel: each channel's receives are its own.
    credits_to_return: dict[int, int] = field(default_factory=dict)
    alive: bool = True
    handshake_step: str = "waiting for its hello"  # while it handshakes: what it owes
    writes_counted: int = 0
    # Channels whose responder failed, each waiting (a timer, the stall bound)
    # for the sender to replace it before the whole session is dropped.
    broken: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    # What its messages started (opens, replacements, asks, services' work):
    # cancelled when the session is dropped.
    tasks: TaskSet = field(default_factory=lambda: TaskSet("sender session"))

    @property
    def responder(self) -> Responder | None:
        """The first channel's: the one services (echo leases) use."""
        return self.responders[0] if self.responders else None

    @property
    def writes_received(self) -> int:
        return sum(responder.writes_received for responder in self.responders)

    def is_current(self, responders: list[Responder]) -> bool:
        """Whether ``responders`` are still the session's, none replaced since."""
        return all(a is b for a, b in zip(responders, self.responders, strict=True))

    def return_credits(self, n: int, channel: int = 0) -> None:
        """Hand ``n`` credits of ``channel`` back: one ``credits`` message per
        channel per loop turn."""
        if n <= 0:
            return
        if not self.credits_to_return:
            asyncio.get_running_loop().call_soon(self._flush_credits)
        self.credits_to_return[channel] = self.credits_to_return.get(channel, 0) + n

    def _flush_credits(self) -> None:
        returning, self.credits_to_return = self.credits_to_return, {}
        if not self.alive:
            return
        for channel, n in returning.items():
            self.conn.send(Credits(n=n, channel=channel or None))
