"""``kvctl status``: health and key figures of daemons, from their metrics endpoints."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvwired.units import format_size

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class DaemonStatus:
    url: str
    up: bool
    error: str = ""
    samples: Samples = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float:
        """Sum of ``name`` over every series whose labels include ``labels``."""
        return sum(value for (metric, series), value in self.samples.items()
                   if metric == name and set(labels.items()) <= set(series))

    def label(self, name: str, key: str) -> str:
        for (metric, series), _ in self.samples.items():
            if metric == name:
                return dict(series).get(key, "")
        return ""


def scrape(url: str, timeout: float = 3.0) -> DaemonStatus:
    if not url.startswith("http"):
        url = f"http://{url}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return DaemonStatus(url, False, f"unreachable: {reason}")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return DaemonStatus(url, True, samples=samples)


HEADERS = ["daemon", "state", "peers", "engines", "pool used", "delivered", "failed",
           "refused", "moved"]


def row(status: DaemonStatus) -> list[object]:
    if not status.up:
        return [status.url, f"DOWN ({status.error})", "-", "-", "-", "-", "-", "-", "-"]
    role = status.label("kvwire_build_info", "role") or "?"
    pool = "staging" if role == "sender" else "receive"
    used = status.total("kvwire_pool_bytes", pool=pool, state="used")
    free = status.total("kvwire_pool_bytes", pool=pool, state="free")
    moved = status.total("kvwire_data_bytes_total")
    return [
        f"{role} {status.url}",
        "up",
        int(status.total("kvwire_peers_connected")),
        int(status.total("kvwire_local_clients")),
        f"{format_size(int(used))} of {format_size(int(used + free))}",
        int(status.total("kvwire_requests_total", outcome="delivered")),
        int(status.total("kvwire_requests_total", outcome="failed")),
        int(status.total("kvwire_requests_total", outcome="refused")),
        format_size(int(moved)),
    ]
