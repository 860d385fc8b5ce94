"""Data paths behind one interface (see ``base``): ``verbs`` (RDMA) and ``tcp``."""

from __future__ import annotations

from dataclasses import dataclass

from ..rdma import rdma_available
from .base import DataChannel, Door, Initiator, RemoteRegion, Responder, Transport, Write

__all__ = ["DataChannel", "Door", "Initiator", "RemoteRegion", "Responder", "Transport",
           "TransportOptions", "Write", "make_transport", "resolve"]


def resolve(name: str) -> str:
    """``auto`` is verbs wherever an RDMA device (and pyverbs) is present, else tcp."""
    if name == "auto":
        return "verbs" if rdma_available() else "tcp"
    return name


@dataclass(frozen=True)
class TransportOptions:
    """What a daemon asks of its data path; each transport takes what applies to it."""

    name: str = "auto"
    rdma_device: str = ""
    gid_index: int = -1
    poll_spin_us: float = 0.0
    ack_timeout: int = 14  # verbs: the queue pairs' local ACK timeout exponent
    # Receives kept posted per connected initiator (verbs).
    receive_depth: int = 64
    # TCP: where the data listener binds, and whether it binds at start (the
    # receiver) or on first use (a sender answering an experiment's echo).
    listen_host: str = "0.0.0.0"
    data_port: int = 0
    listen_at_start: bool = False
    # The receiver's pool: writable only under per-lease keys (memory windows
    # over verbs, granted ranges over TCP), never under a region-wide key.
    per_lease_keys: bool = False
    # TCP: the data listener's door (handshake timeout, cap, counted refusals).
    door: Door | None = None


def make_transport(options: TransportOptions) -> Transport:
    name = resolve(options.name)
    if name == "verbs":
        from .verbs import VerbsTransport

        # The sender's staging accepts remote writes under its region key
        # only from the echo channel a receiver opens back to it (no other QP
        # in its protection domain learns the key); the receiver's pool only
        # under a lease's memory window.
        return VerbsTransport(device=options.rdma_device, gid_index=options.gid_index,
                              receive_depth=options.receive_depth,
                              per_lease_keys=options.per_lease_keys,
                              spin_us=options.poll_spin_us,
                              ack_timeout=options.ack_timeout)
    from .tcp import TcpTransport

    return TcpTransport(options.listen_host, options.data_port,
                        listen=options.listen_at_start, per_lease_keys=options.per_lease_keys,
                        door=options.door)
