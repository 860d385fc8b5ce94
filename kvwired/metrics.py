"""Prometheus metrics of the daemons (one registry per daemon process).

Names follow Prometheus conventions: ``kvwire_`` prefix, base units
(seconds, bytes), ``_total`` for counters, labels of low cardinality (peer
names, outcomes; never request ids).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from . import __version__
from .errors import ConfigError

# From 50 us to 60 s: a 512 B write on a fast link up to a 48 MiB push
# over Soft-RoCE under emulation.
DURATION_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


class Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("kvwire_build", "kvwire release and daemon role", registry=r).info(
            {"version": __version__, "role": role}
        )
        self.bytes = Counter(
            "kvwire_data_bytes_total", "payload bytes moved by one-sided writes",
            ["peer", "direction"], registry=r,
        )
        self.writes = Counter(
            "kvwire_data_writes_total", "one-sided writes posted or received",
            ["peer", "direction"], registry=r,
        )
        self.requests = Counter(
            "kvwire_requests_total", "requests finished, by outcome",
            ["peer", "outcome"], registry=r,
        )
        self.request_seconds = Histogram(
            "kvwire_request_duration_seconds", "request open to delivered",
            ["peer"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.pool_bytes = Gauge(
            "kvwire_pool_bytes", "pool bytes by state", ["pool", "state"], registry=r,
        )
        self.peers = Gauge(
            "kvwire_peers_connected", "daemons connected over the control protocol",
            registry=r,
        )
        self.clients = Gauge(
            "kvwire_local_clients", "engines connected on the unix socket", registry=r,
        )
        self.inflight = Gauge(
            "kvwire_requests_in_flight", "requests open and not yet delivered", registry=r,
        )
        self.protocol_errors = Counter(
            "kvwire_protocol_errors_total", "frames rejected (malformed, wrong version, ...)",
            ["channel"], registry=r,
        )
        self.stale_immediates = Counter(
            "kvwire_stale_immediates_total",
            "immediates naming a lease that is no longer live (dropped, never delivered)",
            registry=r,
        )

    def set_pool(self, pool: str, size: int, used: int) -> None:
        self.pool_bytes.labels(pool, "used").set(used)
        self.pool_bytes.labels(pool, "free").set(size - used)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (a thread); returns the bound port, 0 if off."""
        if port == 0:
            return 0
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}",
                hint="pick a free port with --metrics HOST:PORT (port 0 turns metrics off)",
            ) from exc
        return int(server.server_port)
