"""Ports and addresses: the defaults, and reading "host:port".

The well-known ports are here, once: the receiver's control listener (which
senders dial), its TCP data listener, and the two daemons' Prometheus
endpoints. Everything else (configs' defaults, the lab, the namespaces,
kvctl's defaults) names these.
"""

from __future__ import annotations

import socket

from .errors import ConfigError

DEFAULT_CONTROL_PORT = 7471  # the receiver's listener for senders' control connections
DEFAULT_DATA_PORT = 7472  # the receiver's TCP data listener (transport = tcp)
RECEIVER_METRICS_PORT = 9471
SENDER_METRICS_PORT = 9472


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """"host:port", "host" or ":port" (IPv6 in brackets) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:
        host, port = text, str(default_port)
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as host:port") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"port {number} in {text!r} is outside 0..65535")
    return host, number


def control_address(text: str) -> tuple[str, int]:
    """A receiver's control address; the port defaults to DEFAULT_CONTROL_PORT."""
    return parse_address(text, DEFAULT_CONTROL_PORT)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a listener started next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
