"""What ``kvctl run chunk-sweep`` asks of the daemon: its parameters and defaults.

Both kvctl (which builds the request) and the sender daemon (which checks
and runs it) import this module; neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..units import parse_size

MiB = 1 << 20
DEFAULT_SIZES = (512, 2 << 10, 8 << 10, 12 << 10, 64 << 10, 256 << 10, MiB, 2 * MiB,
                 8 * MiB, 48 * MiB)
PERFTEST_TRIES = 3
# perftest: ib_write_lat/ib_write_bw; socket: a plain socket loop moving the
# 48 MiB cache at each size, against which the delivery is compared.
BASELINES = ("", "perftest", "socket")
SOCKET_LOOP_ROUNDS = 3
# ib_write_lat runs per size, each beside a round of our pings (drift: see chunk_sweep).
PERFTEST_LATENCY_ROUNDS = 3
PROGRESS_EVERY = 0.2  # seconds between progress messages


@dataclass(frozen=True)
class SweepParams:
    peer: str
    sizes: tuple[int, ...] = DEFAULT_SIZES
    iters: int = 1000
    # Bytes moved per size, both ways, at most, for the ping-pong: large sizes
    # get fewer round trips (at least MIN_PINGS).
    latency_bytes: int = 64 * MiB
    stream_bytes: int = 64 * MiB
    deliver: bool = True
    baseline: str = ""
    ping_timeout: float = 10.0

    MIN_PINGS = 3
    MIN_STREAM = 2

    @classmethod
    def from_wire(cls, params: dict[str, Any]) -> SweepParams:
        try:
            sizes = tuple(parse_size(s) for s in params.get("sizes") or DEFAULT_SIZES)
            built = cls(
                peer=str(params.get("peer") or ""), sizes=sizes,
                iters=int(params.get("iters", 1000)),
                latency_bytes=parse_size(params.get("latency_bytes", 64 * MiB)),
                stream_bytes=parse_size(params.get("stream_bytes", 64 * MiB)),
                deliver=bool(params.get("deliver", True)),
                baseline=str(params.get("baseline") or ""),
                ping_timeout=float(params.get("ping_timeout", 10.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"bad chunk-sweep parameters: {exc}") from exc
        if not sizes or min(sizes) < 1 or len(sizes) > 64:
            raise UsageError("chunk-sweep takes 1 to 64 positive sizes")
        if built.iters < 1:
            raise UsageError("--iters must be at least 1")
        if built.baseline not in BASELINES:
            raise UsageError(f"unknown baseline {built.baseline!r}",
                             hint="use perftest (RDMA) or socket (a plain TCP loop)")
        return built

    def pings(self, size: int) -> int:
        return max(self.MIN_PINGS, min(self.iters, self.latency_bytes // (2 * size)))

    def stream_writes(self, size: int) -> int:
        return max(self.MIN_STREAM, self.stream_bytes // size)
