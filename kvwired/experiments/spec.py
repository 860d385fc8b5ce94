"""What ``kvctl run chunk-sweep`` asks of the daemon: its parameters and defaults.

Both kvctl (which builds the request) and the sender daemon (which checks
and runs it) import this module; neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..layout import KVLayout
from ..units import format_size, parse_size
from .plan import PlannedPhase, merged

MiB = 1 << 20
# 512 B a token of a layer, 12 KiB a token, 2 MiB a layer, 48 MiB the cache;
# 512 KiB a block of a few hundred tokens (where the CPU per write is read too).
DEFAULT_SIZES = (512, 2 << 10, 8 << 10, 12 << 10, 64 << 10, 256 << 10, 512 << 10, MiB,
                 2 * MiB, 8 * MiB, 48 * MiB)
PERFTEST_TRIES = 3
# perftest: ib_write_lat/ib_write_bw; socket: a plain socket loop moving the
# 48 MiB cache at each size, against which the delivery is compared.
BASELINES = ("", "perftest", "socket")
# Every figure is measured in rounds, and a figure compared with a baseline
# alternates with it round by round (drift: see chunk_sweep): the rounds'
# spread is how steady the figure is, the median what it is.
ROUNDS = 3
PERFTEST_MIN_ITERS = 5  # perftest refuses fewer
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
    # The ping-pong (and ib_write_lat) only up to this size: beyond a layer a
    # round trip is two transfers, which streaming and the delivery measure,
    # and at 48 MiB perftest's five round trips alone take half a minute.
    latency_up_to: int | None = None

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
                ping_timeout=float(params.get("ping_timeout", 10.0)),
                latency_up_to=(parse_size(params["latency_up_to"])
                               if params.get("latency_up_to") else None))
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

    def measures_latency(self, size: int) -> bool:
        return self.latency_up_to is None or size <= self.latency_up_to

    def pings(self, size: int) -> int:
        return max(self.MIN_PINGS, min(self.iters, self.latency_bytes // (2 * size)))

    def stream_writes(self, size: int) -> int:
        return max(self.MIN_STREAM, self.stream_bytes // size)

    def pings_per_round(self, size: int) -> int:
        return max(1, -(-self.pings(size) // ROUNDS))

    def stream_writes_per_round(self, size: int) -> int:
        return max(1, -(-self.stream_writes(size) // ROUNDS))

    def perftest_bandwidth_runs(self, size: int) -> int:
        """ib_write_bw runs beside the streaming rounds: one per round, or one
        in the middle where perftest's five writes at least already move more
        than all the streaming (8 MiB and 48 MiB by default: three runs at
        48 MiB cost half a minute and pair with rounds of one write)."""
        if PERFTEST_MIN_ITERS * size > self.stream_bytes:
            return 1
        return ROUNDS

    def perftest_after_round(self, size: int, n: int) -> bool:
        return self.perftest_bandwidth_runs(size) == ROUNDS or n == ROUNDS // 2

    def phases(self) -> list[PlannedPhase]:
        """The phases the sweep reports, in order, with the work each does."""
        return merged([phase for size in self.sizes for phase in self._phases_of(size)])

    def _phases_of(self, size: int) -> list[PlannedPhase]:
        name = format_size(size)
        cache = KVLayout()
        per_layer = -(-cache.layer_bytes // size)
        deliver = PlannedPhase(f"deliver 48 MiB at {name}", per_layer * cache.layers,
                               cache.total_bytes)
        out = []
        pings = self.pings_per_round(size) if self.baseline == "perftest" else self.pings(size)
        latency_rounds = ROUNDS if self.baseline == "perftest" else 1
        if not self.measures_latency(size):
            latency_rounds = 0
        for _ in range(latency_rounds):
            trips = ping_warmup(pings) + pings
            out.append(PlannedPhase(f"latency {name}", round_trips=trips,
                                    exchanged=2 * trips * size))
            if self.baseline == "perftest":
                iters = max(PERFTEST_MIN_ITERS, pings)
                out.append(PlannedPhase(f"perftest latency {name}", startups=1,
                                        round_trips=iters, exchanged=2 * iters * size))
        writes = self.stream_writes_per_round(size)
        if self.baseline == "perftest":
            iters = max(PERFTEST_MIN_ITERS, writes)
            for n in range(ROUNDS):
                out.append(PlannedPhase(f"stream {name}", writes, writes * size))
                if self.perftest_after_round(size, n):
                    out.append(PlannedPhase(f"perftest bandwidth {name}", iters, iters * size,
                                            1))
        else:  # the rounds back to back: one phase
            out.append(PlannedPhase(f"stream {name}", ROUNDS * writes, ROUNDS * writes * size))
        if self.baseline == "socket":
            loop_writes = max(1, cache.total_bytes // size)
            for _ in range(ROUNDS):
                if self.deliver:
                    out.append(deliver)
                out.append(PlannedPhase(f"socket loop {name}", loop_writes,
                                        loop_writes * size, 1))
        elif self.deliver:
            out.append(deliver)
        return out


def ping_warmup(pings: int) -> int:
    """Unmeasured round trips before ``pings`` measured ones."""
    return min(10, max(1, pings // 10))
