"""Prometheus metrics of the daemons (one registry per daemon process).

Names follow Prometheus conventions: ``kvwire_`` prefix, base units
(seconds, bytes), ``_total`` for counters, labels of low cardinality (peer
names, outcomes, opcodes, completion statuses; never request ids). The
docs/metrics.md's table lists every one.

Values the daemon already keeps (credits, writes in flight, connection
state) are read at scrape time through ``LiveCollector`` rather than
mirrored on every change; the write-size histogram counts a whole batch of
equal writes in one step, because observing 98,304 writes of a 512 B push
one by one would cost more than posting them.
"""

from __future__ import annotations

import bisect
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from socketserver import TCPServer, ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from . import __version__
from .errors import ConfigError

# From 50 us to 60 s: a 512 B write on a fast link up to a 48 MiB push
# over Soft-RoCE under emulation.
DURATION_BUCKETS = (
    50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
# Write sizes: 512 B (a token of a layer) to 64 MiB, powers of four, with the
# reference granularities (12 KiB a token, 2 MiB a layer, 48 MiB whole) on edges.
SIZE_BUCKETS = (512.0, 2048.0, 8192.0, 12288.0, 65536.0, 262144.0, 1048576.0, 2097152.0,
                8388608.0, 50331648.0, 67108864.0)

# (name, help, label names, label values, value): one gauge read at scrape time.
LiveSample = tuple[str, str, list[str], list[str], float]
LiveSamples = Callable[[], Iterable[LiveSample]]


@dataclass
class BatchHistogram:
    """A histogram that takes ``count`` equal observations at once."""

    name: str
    documentation: str
    buckets: tuple[float, ...]
    counts: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def observe(self, peer: str, value: float, count: int = 1) -> None:
        counts = self.counts.setdefault(peer, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += count
        self.sums[peer] = self.sums.get(peer, 0.0) + value * count

    def metric(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["peer"])
        for peer, counts in self.counts.items():
            cumulative, running = [], 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                cumulative.append((_bound(bound), running))
            family.add_metric([peer], cumulative, self.sums[peer])
        return family


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)


class LiveCollector(Collector):
    """Gauges read from the daemon's own state at scrape time, and batch histograms."""

    def __init__(self) -> None:
        self.sources: list[LiveSamples] = []
        self.histograms: list[BatchHistogram] = []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for source in self.sources:
            for name, doc, label_names, label_values, value in source():
                family = families.get(name)
                if family is None:
                    family = families[name] = GaugeMetricFamily(name, doc, labels=label_names)
                family.add_metric(label_values, value)
        yield from families.values()
        for histogram in self.histograms:
            yield histogram.metric()

class Metrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("kvwire_build", "kvwire release and daemon role", registry=r).info(
            {"version": __version__, "role": role}
        )
        ProcessCollector(registry=r)  # process_start_time_seconds shows restarts
        self.bytes = Counter(
            "kvwire_data_bytes_total", "payload bytes moved by one-sided writes",
            ["peer", "direction"], registry=r,
        )
        self.writes = Counter(
            "kvwire_data_writes_total",
            "one-sided writes posted or received, by opcode (write, write_imm)",
            ["peer", "direction", "opcode"], registry=r,
        )
        self.post_seconds = Histogram(
            "kvwire_request_post_seconds",
            "time a request spent cutting and posting its writes (sender)",
            ["peer"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.wait_seconds = Histogram(
            "kvwire_request_wait_seconds",
            "from the last commit until every write is placed and confirmed (sender)",
            ["peer"], buckets=DURATION_BUCKETS, registry=r,
        )
        self.completion_errors = Counter(
            "kvwire_completion_errors_total",
            "data-path failures by status (retry_exceeded, rnr_retry_exceeded, "
            "remote_access, connection_lost, ...)",
            ["peer", "status"], registry=r,
        )
        # Per rail (the RDMA device a data channel runs on; "default": the
        # control connection's, when no rails are configured).
        self.rail_bytes = Counter(
            "kvwire_rail_bytes_total", "payload bytes posted per rail (sender)",
            ["peer", "rail"], registry=r,
        )
        self.rail_writes = Counter(
            "kvwire_rail_writes_total", "writes posted per rail, immediates included (sender)",
            ["peer", "rail"], registry=r,
        )
        self.rail_errors = Counter(
            "kvwire_rail_errors_total", "data channels failed per rail, by status (sender)",
            ["peer", "rail", "status"], registry=r,
        )
        self.channel_replacements = Counter(
            "kvwire_channel_replacements_total",
            "data channels replaced under a live control connection, their lost writes "
            "posted again (replaced), or not (failed: the link went down) (sender)",
            ["peer", "result"], registry=r,
        )
        self.reconnects = Counter(
            "kvwire_reconnects_total",
            "control and data connections to a receiver rebuilt after the first",
            ["peer"], registry=r,
        )
        self.live = LiveCollector()
        self.write_sizes = BatchHistogram(
            "kvwire_write_size_bytes", "sizes of the one-sided writes posted", SIZE_BUCKETS)
        self.live.histograms.append(self.write_sizes)
        r.register(self.live)
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
        self.subscriptions = Gauge(
            "kvwire_subscriptions", "requests decode engines wait for or hold (receiver)",
            registry=r,
        )
        self.certificate_expiry = Gauge(
            "kvwire_certificate_expiry_timestamp_seconds",
            "when this daemon's TLS certificate expires (0 with auth = \"none\")",
            registry=r,
        )
        self.inflight = Gauge(
            "kvwire_requests_in_flight", "requests open and not yet delivered", registry=r,
        )
        self.protocol_errors = Counter(
            "kvwire_protocol_errors_total", "frames rejected (malformed, wrong version, ...)",
            ["channel"], registry=r,
        )
        # Before a peer is authenticated nothing is labelled by its (claimed)
        # name: the series stay as few as the reasons, whoever knocks.
        self.auth_failures = Counter(
            "kvwire_auth_failures_total",
            "connections refused before or at authentication, by port and reason (timeout, "
            "not_tls, bad_certificate, wrong_name, not_allowed, bad_token, too_many)",
            ["channel", "reason"], registry=r,
        )
        # Delivered requests taken back without a release: their engine died
        # holding them (engine_gone), or none claimed them in time (unclaimed).
        self.registry_refused = Counter(
            "kvwire_registry_records_refused_total",
            "registry records not believed, by reason (undecodable; with TLS: unsigned, "
            "bad_certificate, not_from_ca, wrong_name, not_a_receiver, expired, "
            "bad_signature): each is ignored",
            ["reason"], registry=r,
        )
        self.reclaimed = Counter(
            "kvwire_reclaimed_total",
            "delivered requests freed without a release, by reason",
            ["reason"], registry=r,
        )
        for reason in ("engine_gone", "unclaimed"):
            self.reclaimed.labels(reason)
        self.stale_immediates = Counter(
            "kvwire_stale_immediates_total",
            "immediates naming a lease that is no longer live (dropped, never delivered)",
            registry=r,
        )

    def peer_seen(self, peer: str) -> None:
        """Create a peer's request series at zero, so the first failure is an increase."""
        for outcome in ("delivered", "failed", "refused", "aborted"):
            self.requests.labels(peer, outcome)

    def forget_peer(self, peer: str) -> None:
        """Drop every series of a peer that is gone for good (removed from the
        configuration), so a fleet that changes does not grow the page."""
        for metric in (self.bytes, self.writes, self.post_seconds, self.wait_seconds,
                       self.completion_errors, self.reconnects, self.requests,
                       self.request_seconds, self.rail_bytes, self.rail_writes,
                       self.rail_errors, self.channel_replacements):
            for labels in list(metric._metrics):  # prometheus_client keeps no public list
                if labels and labels[0] == peer:
                    metric.remove(*labels)
        self.write_sizes.counts.pop(peer, None)
        self.write_sizes.sums.pop(peer, None)

    def set_pool(self, pool: str, size: int, used: int) -> None:
        self.pool_bytes.labels(pool, "used").set(used)
        self.pool_bytes.labels(pool, "free").set(size - used)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (a thread); returns the bound port, 0 if off."""
        if port == 0:
            return 0
        server_class = _MetricsServer6 if ":" in host else _MetricsServer
        try:
            server: WSGIServer = make_server(
                host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}",
                hint="pick a free port with --metrics HOST:PORT (port 0 turns metrics off)",
            ) from exc
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return int(server.server_port)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """The scrape endpoint: a thread per scrape, as prometheus_client's own.

    Its own rather than ``prometheus_client.start_http_server``'s because
    http.server names itself at bind time with ``socket.getfqdn(host)``, a
    reverse DNS lookup of the listen address. On a node with no reachable
    resolver (the lab's, and many a cluster's) that waited out the
    resolver's timeout, 10 s, before every daemon could start. Nothing
    reads the name but WSGI's SERVER_NAME, so the address serves.
    """

    daemon_threads = True

    def server_bind(self) -> None:
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per scrape: the daemons' logs are structured."""

    def log_message(self, format: str, *args: object) -> None:
        pass
