"""``kvctl metrics [--watch]``: the key figures of both daemons, per peer, live.

Rates (throughput, writes/s, requests/s) and latency quantiles come from two
scrapes an interval apart: the quantiles from the request-duration histogram
buckets that filled in between, interpolated the way Prometheus'
``histogram_quantile`` does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvwired.units import format_size

from .status import DaemonStatus, scrape

HEADERS = ["daemon", "peer", "up", "Gb/s", "writes/s", "req/s", "p50 ms", "p99 ms",
           "failed", "errors", "reconnects", "credits", "in flight", "pool used"]


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """``histogram_quantile``: q-th quantile from cumulative (upper bound, count) pairs."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count)
        lower_bound, lower_count = bound, count
    return None


@dataclass
class PeerFigures:
    daemon: str
    peer: str
    up: bool | None
    gbps: float
    writes_per_s: float
    requests_per_s: float
    p50_s: float | None
    p99_s: float | None
    failed: int
    errors: int
    reconnects: int
    credits: int | None
    in_flight: int | None
    pool: str

    def row(self) -> list[object]:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.2f}"

        return [self.daemon, self.peer, {None: "-", True: "up", False: "DOWN"}[self.up],
                f"{self.gbps:.3f}", f"{self.writes_per_s:,.0f}", f"{self.requests_per_s:.1f}",
                ms(self.p50_s), ms(self.p99_s), self.failed, self.errors, self.reconnects,
                "-" if self.credits is None else self.credits,
                "-" if self.in_flight is None else self.in_flight, self.pool]


def _peers(status: DaemonStatus) -> list[str]:
    return sorted({dict(series).get("peer", "") for (name, series) in status.samples
                   if name.startswith("kvwire_") and dict(series).get("peer")})


def _value(status: DaemonStatus, name: str, **labels: str) -> float | None:
    found = [value for (metric, series), value in status.samples.items()
             if metric == name and set(labels.items()) <= set(series)]
    return sum(found) if found else None


def _buckets(status: DaemonStatus, name: str, peer: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for (metric, series), value in status.samples.items():
        labels = dict(series)
        if metric == f"{name}_bucket" and labels.get("peer") == peer:
            out[float(labels["le"])] = value
    return out


def figures(before: DaemonStatus, after: DaemonStatus, seconds: float) -> list[PeerFigures]:
    if not after.up:
        return [PeerFigures(after.url, "-", False, 0, 0, 0, None, None, 0, 0, 0, None, None,
                            f"DOWN ({after.error})")]
    role = after.label("kvwire_build_info", "role") or "?"
    pool_name = "staging" if role == "sender" else "receive"
    used = after.total("kvwire_pool_bytes", pool=pool_name, state="used")
    free = after.total("kvwire_pool_bytes", pool=pool_name, state="free")
    pool = f"{format_size(int(used))} of {format_size(int(used + free))}"
    direction = "sent" if role == "sender" else "received"
    rows = []
    for peer in _peers(after) or ["-"]:
        def delta(name: str, peer: str = peer, **labels: str) -> float:
            now = after.total(name, peer=peer, **labels)
            then = before.total(name, peer=peer, **labels) if before.up else now
            return max(0.0, now - then)  # a restart resets counters

        latest = _buckets(after, "kvwire_request_duration_seconds", peer)
        earlier = _buckets(before, "kvwire_request_duration_seconds", peer)
        window = [(le, count - earlier.get(le, 0.0)) for le, count in latest.items()]
        recent = window if window and max(c for _, c in window) > 0 else list(latest.items())
        up = _value(after, "kvwire_peer_up", peer=peer)
        credits = _value(after, "kvwire_credits", peer=peer)
        in_flight = _value(after, "kvwire_writes_in_flight", peer=peer)
        rows.append(PeerFigures(
            daemon=f"{role} {after.url.removeprefix('http://').removesuffix('/metrics')}",
            peer=peer, up=None if up is None else up > 0,
            gbps=delta("kvwire_data_bytes_total", direction=direction) * 8 / seconds / 1e9,
            writes_per_s=delta("kvwire_data_writes_total", direction=direction) / seconds,
            requests_per_s=delta("kvwire_requests_total", outcome="delivered") / seconds,
            p50_s=bucket_quantile(0.5, recent), p99_s=bucket_quantile(0.99, recent),
            failed=int(after.total("kvwire_requests_total", peer=peer, outcome="failed")),
            errors=int(after.total("kvwire_completion_errors_total", peer=peer)),
            reconnects=int(after.total("kvwire_reconnects_total", peer=peer)),
            credits=None if credits is None else int(credits),
            in_flight=None if in_flight is None else int(in_flight), pool=pool))
    return rows


def collect(urls: Sequence[str], interval: float, previous: list[DaemonStatus] | None = None,
            previous_at: float = 0.0) -> tuple[list[DaemonStatus], float, list[PeerFigures]]:
    """Scrape ``urls``; rates are over the time since ``previous`` (or a first
    scrape taken ``interval`` earlier)."""
    if previous is None:
        previous, previous_at = [scrape(url) for url in urls], time.monotonic()
        time.sleep(interval)
    current = [scrape(url) for url in urls]
    now = time.monotonic()
    seconds = max(now - previous_at, 1e-3)
    rows = [f for before, after in zip(previous, current, strict=True)
            for f in figures(before, after, seconds)]
    return current, now, rows


def render(rows: Sequence[PeerFigures]) -> str:
    from . import table

    return table.render(HEADERS, [r.row() for r in rows])


def watch(urls: Sequence[str], interval: float) -> None:
    """Redraw the table every ``interval`` seconds until interrupted."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    def as_table(rows: Sequence[PeerFigures]) -> Table:
        grid = Table(*HEADERS, title=f"kvwire, every {interval:g} s (Ctrl-C to stop)")
        for r in rows:
            grid.add_row(*(str(cell) for cell in r.row()))
        return grid

    console = Console()
    statuses, at, rows = collect(urls, interval)
    if not console.is_terminal:
        # A log or a pipe: a frame after another, each whole as it is made
        # (a live display would only draw on exit), 14 columns not squeezed.
        console = Console(width=200)
        while True:
            console.print(as_table(rows))
            console.file.flush()
            time.sleep(interval)
            statuses, at, rows = collect(urls, interval, statuses, at)
    with Live(as_table(rows), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            statuses, at, rows = collect(urls, interval, statuses, at)
            live.update(as_table(rows), refresh=True)
