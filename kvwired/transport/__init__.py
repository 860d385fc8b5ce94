"""Data paths behind one interface (see ``base``): ``verbs`` (RDMA) and ``tcp``."""

from __future__ import annotations

from ..config import CommonConfig, ReceiverConfig, parse_address
from ..rdma import rdma_available
from .base import DataChannel, Initiator, RemoteRegion, Responder, Transport, Write

__all__ = ["DataChannel", "Initiator", "RemoteRegion", "Responder", "Transport", "Write",
           "make_transport", "resolve"]


def resolve(name: str) -> str:
    """``auto`` is verbs wherever an RDMA device (and pyverbs) is present, else tcp."""
    if name == "auto":
        return "verbs" if rdma_available() else "tcp"
    return name


# A sender responds only to the echo channel of an experiment (kvctl run),
# which has one ping in flight at a time.
SENDER_RECEIVE_DEPTH = 16


def make_transport(config: CommonConfig) -> Transport:
    name = resolve(config.transport)
    if name == "verbs":
        from .verbs import VerbsTransport

        # Both pools accept remote writes: the sender's only from the echo
        # channel a receiver opens back to it, since no other QP in its
        # protection domain ever learns the key.
        return VerbsTransport(
            device=config.rdma_device, gid_index=config.gid_index,
            receive_depth=config.credits if isinstance(config, ReceiverConfig)
            else SENDER_RECEIVE_DEPTH,
            remote_write=True, spin_us=config.poll_spin_us)
    from .tcp import TcpTransport

    if isinstance(config, ReceiverConfig):
        return TcpTransport(parse_address(config.listen, 7471)[0], config.data_port,
                            listen=True)
    return TcpTransport()
