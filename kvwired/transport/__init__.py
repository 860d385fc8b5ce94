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


def make_transport(config: CommonConfig) -> Transport:
    name = resolve(config.transport)
    receiver = isinstance(config, ReceiverConfig)
    if name == "verbs":
        from .verbs import VerbsTransport

        return VerbsTransport(
            device=config.rdma_device, gid_index=config.gid_index,
            receive_depth=config.credits if isinstance(config, ReceiverConfig) else 0,
            remote_write=receiver, spin_us=config.poll_spin_us)
    from .tcp import TcpTransport

    if isinstance(config, ReceiverConfig):
        return TcpTransport(parse_address(config.listen, 7471)[0], config.data_port,
                            listen=True)
    return TcpTransport()
