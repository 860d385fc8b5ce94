"""``kvctl run chunk-sweep``, run by the sender daemon against a receiver.

Per size, on the daemons' own data path:

1. latency: WRITE_WITH_IMM ping-pong through the receiver's echo lease;
   half round trips, like ib_write_lat reports them;
2. streaming: writes of that size back to back, no immediates, a window of
   posts in flight (like ib_write_bw): Gb/s and writes/s, in three rounds;
3. delivery: the whole 48 MiB reference cache pushed at that granularity
   through the real request path (lease, per-layer immediates, delivery
   confirmation), the receiver discarding it once delivered;
4. optionally a baseline on the same link: perftest (``baseline = perftest``:
   latency and streaming against ib_write_lat/ib_write_bw, a round of ours
   and a perftest run in turn, three of each) or a plain socket
   loop (``baseline = socket``: the 48 MiB cache moved at that size by
   ``sendall``/``recv_into``, against the delivery; a delivery and a loop
   round alternate, three of each, and the medians are compared).

Each finished size goes to kvctl as a ``row`` at once, so a sweep cut short
by a vanished receiver still leaves every row it measured.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from .. import analysis
from ..errors import ExperimentFailed, KvwireError, PerftestFailed
from ..layout import KVLayout
from ..ports import PeerHandle, Report, SenderHost
from ..protocol import control as ctl
from ..protocol import sender_local as local
from ..rdma import pick_gid
from ..transport.base import DataChannel
from ..units import format_size
from . import baseline, cpu, perftest, socket_loop
from .echo import EchoInitiator
from .spec import (
    PERFTEST_MIN_ITERS,
    PERFTEST_TRIES,
    PROGRESS_EVERY,
    ROUNDS,
    SweepParams,
    ping_warmup,
)

log = structlog.get_logger("kvwired.experiments.chunk_sweep")


@dataclass
class _Progress:
    req: str
    report: Report
    last: float = 0.0

    def __call__(self, phase: str, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or done >= total or now - self.last >= PROGRESS_EVERY:
            self.last = now
            self.report(local.Progress(req=self.req, phase=phase, done=done, total=total))


@dataclass
class ChunkSweep:
    daemon: SenderHost
    params: SweepParams
    req: str
    report: Report
    rows: list[dict[str, Any]] = field(default_factory=list)

    async def run(self) -> dict[str, Any]:
        daemon, params = self.daemon, self.params
        if params.baseline == "perftest" and daemon.transport.name != "verbs":
            raise PerftestFailed(
                "the perftest baseline needs RDMA; the daemons run over tcp",
                hint="run the daemons with transport = verbs, or drop --baseline")
        link = daemon.link(params.peer)
        progress = _Progress(self.req, self.report)
        await link.ensure()
        region = max(params.sizes)
        slot = await daemon.reserve_staging(region)
        echo = EchoInitiator(self.req, link.name, slot, list(params.sizes),
                             credit_back=link.credit_back)
        try:
            await self._open_echo(link, echo)
            for index, size in enumerate(params.sizes):
                try:
                    row = await self._measure(link, echo, index, size, progress)
                except PerftestFailed:
                    raise
                except KvwireError as exc:
                    raise ExperimentFailed(
                        f"chunk-sweep stopped at {format_size(size)}: receiver {link.name}: "
                        f"{exc.message}",
                        hint=f"the {len(self.rows)} sizes measured before are kept; check the "
                        "receiver (its log, kvctl status)") from exc
                self.rows.append(row)
                self.report(local.Row(req=self.req, row=row))
                log.info("chunk-sweep size done", **{
                    k: v for k, v in row.items() if not isinstance(v, list)})
        finally:
            self._close_echo(link, echo)
            daemon.release_staging(slot)
        return self.summary(link)

    async def _measure(self, link: PeerHandle, echo: EchoInitiator, index: int, size: int,
                       progress: _Progress) -> dict[str, Any]:
        row: dict[str, Any] = {"size": size}
        if not self.params.measures_latency(size):
            pass  # beyond --latency-up-to: streaming and the delivery only
        elif self.params.baseline == "perftest":
            row.update(await self._latency_against_perftest(link, echo, index, size, progress))
        else:
            row.update(await self._latency(link, echo, index, size, progress))
        row.update(await self._stream(link, echo, size, progress))
        if self.params.baseline == "socket":
            row.update(await self._against_socket_loop(link, size, progress))
        elif self.params.deliver:
            row.update(await self._deliver(link, size, progress))
        return row

    # ------------------------------------------------------------ echo

    async def _open_echo(self, link: PeerHandle, echo: EchoInitiator) -> None:
        offer = await link.request(
            ctl.EchoOpen(req=self.req, bytes=echo.slot.length, sizes=echo.sizes),
            ctl.EchoOffer, undo=_close_unwanted_echo)
        echo.lease, echo.remote_offset, echo.key = offer.lease, offer.offset, offer.key
        link.attach(echo.lease, echo)
        echo.responder = self.daemon.transport.responder(
            link.local_host, echo.on_immediate, echo.fail)
        answer = await echo.responder.accept(offer.params)
        await link.request(ctl.EchoAnswer(req=self.req, lease=echo.lease,
                                          reply_offset=echo.slot.offset, params=answer),
                           ctl.EchoReady, undo=_close_unwanted_echo)

    def _close_echo(self, link: PeerHandle, echo: EchoInitiator) -> None:
        if echo.lease:
            link.detach(echo.lease)
            link.send(ctl.EchoClose(req=self.req, lease=echo.lease, answers=echo.answers))
        if echo.responder is not None:
            echo.responder.close()

    def _channel(self, link: PeerHandle, echo: EchoInitiator) -> DataChannel:
        echo.check()
        if not link.connected or link.channel is None:
            raise ExperimentFailed(f"receiver {link.name} went away during the sweep")
        return link.channel

    # ----------------------------------------------------- measurements

    async def _latency(self, link: PeerHandle, echo: EchoInitiator, index: int, size: int,
                       progress: _Progress) -> dict[str, Any]:
        rtts, cost = await self._pings(link, echo, index, size, self.params.pings(size),
                                       progress)
        return {**_latency_row(rtts), "lat_cpu_user_us_per_rtt": cost.user_us_per_write}

    async def _pings(self, link: PeerHandle, echo: EchoInitiator, index: int, size: int,
                     pings: int, progress: _Progress) -> tuple[list[float], cpu.WriteCost]:
        """``pings`` round trips (after a few unmeasured ones), in seconds, and the
        CPU they all cost (a round trip is a write each way)."""
        warmup = ping_warmup(pings)
        started = cpu.own()
        phase = f"latency {format_size(size)}"
        progress(phase, 0, pings, force=True)  # a phase is timed from its first report
        rtts = []
        for n in range(warmup + pings):
            rtt = await echo.ping(self._channel(link, echo), index, self.params.ping_timeout,
                                  link.take_credit)
            if n >= warmup:
                rtts.append(rtt)
                progress(phase, len(rtts), pings)
        return rtts, cpu.WriteCost(size, warmup + pings, cpu.own() - started)

    async def _latency_against_perftest(self, link: PeerHandle, echo: EchoInitiator,
                                        index: int, size: int,
                                        progress: _Progress) -> dict[str, Any]:
        """Pings and ib_write_lat, a round of each in turn.

        As with the socket loop: on a shared host the link's speed drifts
        within minutes, and a batch of pings followed by one perftest run
        much later compares two different links. Each round's p50 is set
        against the perftest run beside it; the ratio is their median.
        """
        per_round = self.params.pings_per_round(size)
        rtts: list[float] = []
        round_p50s: list[float] = []
        figures: list[perftest.LatencyFigures] = []
        ratios: list[float] = []
        # A round trip's CPU, ours; ib_write_lat spins through each of its own.
        costs: list[cpu.WriteCost] = []
        for n in range(ROUNDS):
            ours, cost = await self._pings(link, echo, index, size, per_round, progress)
            costs.append(cost)
            progress(f"perftest latency {format_size(size)}", n, ROUNDS, force=True)
            out = await self._perftest_pair(link, "ib_write_lat", size,
                                            max(PERFTEST_MIN_ITERS, per_round))
            progress(f"perftest latency {format_size(size)}", n + 1, ROUNDS, force=True)
            theirs = perftest.parse_latency(out, size)
            rtts += ours
            round_p50s.append(analysis.half_rtt_latency(ours).p50_us)
            figures.append(theirs)
            ratio = analysis.ratio(round_p50s[-1], theirs.typical_us)
            if ratio is not None:  # perftest reported 0 µs: that round has no ratio
                ratios.append(ratio)
        return {**_latency_row(rtts), "lat_rounds_p50_us": round_p50s,
                "perftest_lat_samples": sum(f.iterations for f in figures),
                "perftest_lat_typical_us": statistics.median(f.typical_us for f in figures),
                "perftest_lat_p99_us": statistics.median(f.p99_us for f in figures),
                "perftest_lat_p999_us": statistics.median(f.p999_us for f in figures),
                "perftest_lat_rounds_us": [f.typical_us for f in figures],
                "latency_round_ratios": ratios,
                "latency_ratio": statistics.median(ratios) if ratios else None,
                "lat_cpu_user_us_per_rtt": statistics.median(
                    c.user_us_per_write for c in costs),
                "perftest_lat_cpu_user_us_per_rtt": 2 * statistics.median(
                    f.typical_us for f in figures)}

    async def _stream(self, link: PeerHandle, echo: EchoInitiator, size: int,
                      progress: _Progress) -> dict[str, Any]:
        """Streaming in rounds; with perftest, an ib_write_bw run after each
        (or one, in the middle, at sizes where its minimum is a lot: see
        ``SweepParams.perftest_bandwidth_runs``).

        The bandwidth ratio is the median of the rounds' own ratios, each
        round set against the perftest run beside it (as the latency's).
        """
        count = self.params.stream_writes_per_round(size)
        phase = f"stream {format_size(size)}"
        seconds: list[float] = []
        costs: list[cpu.WriteCost] = []
        theirs: list[perftest.BandwidthFigures] = []
        for n in range(ROUNDS):
            progress(phase, n * count, count * ROUNDS, force=True)

            def counted(done: int, before: int = n * count) -> None:
                progress(phase, before + done, count * ROUNDS)  # the rounds' writes together

            started = cpu.own()
            seconds.append(await echo.stream(self._channel(link, echo), size, count, counted))
            costs.append(cpu.WriteCost(size, count, cpu.own() - started,
                                       counts_kernel=self.daemon.transport.name == "tcp"))
            progress(phase, (n + 1) * count, count * ROUNDS, force=True)
            if self.params.baseline == "perftest" and self.params.perftest_after_round(size, n):
                theirs.append(await self._perftest_bandwidth(link, size, count, progress))
        total = count * ROUNDS
        elapsed = sum(seconds)
        rounds_gbps = [analysis.gbps(count * size, s) for s in seconds]
        # The median round, as every figure measured in rounds.
        median = statistics.median(seconds)
        row: dict[str, Any] = {
            "stream_writes": total, "stream_bytes": total * size, "stream_seconds": elapsed,
            "stream_gbps": statistics.median(rounds_gbps),
            "stream_writes_per_s": count / median if median else 0.0,
            "stream_rounds_gbps": rounds_gbps, **cpu.figures("stream_cpu", costs)}
        if theirs:
            # Each round against the perftest run beside it, or all against the one run.
            beside = theirs if len(theirs) == len(rounds_gbps) else theirs * len(rounds_gbps)
            ratios = [r for ours, bw in zip(rounds_gbps, beside, strict=True)
                      if (r := analysis.ratio(ours, bw.gbps)) is not None]
            row.update(perftest_gbps=statistics.median(bw.gbps for bw in theirs),
                       perftest_writes_per_s=statistics.median(bw.mpps for bw in theirs) * 1e6,
                       perftest_rounds_gbps=[bw.gbps for bw in theirs],
                       bandwidth_round_ratios=ratios,
                       bandwidth_ratio=statistics.median(ratios) if ratios else None)
            # CPU per GiB, each round against the perftest run beside it too.
            # perftest spins a core while it measures: its CPU is its time.
            cpu_ratios = []
            for ours_cost, bw in zip(costs, beside, strict=True):
                if (spun := cpu.busy_polled(size, bw.mpps * 1e6)) is not None:
                    cpu_ratios.append(ours_cost.counted / ours_cost.writes / spun.counted)
            their_costs = [c for bw in theirs if (c := cpu.busy_polled(size, bw.mpps * 1e6))]
            row.update(cpu.figures("perftest_cpu", their_costs) if their_costs else {},
                       cpu_round_ratios=cpu_ratios,
                       cpu_ratio=statistics.median(cpu_ratios) if cpu_ratios else None)
        return row

    async def _deliver(self, link: PeerHandle, size: int,
                       progress: _Progress) -> dict[str, Any]:
        """The reference cache through the request path, as an engine would push it."""
        layout = KVLayout()
        phase = f"deliver 48 MiB at {format_size(size)}"
        progress(phase, 0, 1, force=True)
        req = f"{self.req}-deliver-{size}-{uuid.uuid4().hex[:8]}"
        timings = await self.daemon.push(req, link.name, layout.shape(), size, discard=True)
        progress(phase, 1, 1)
        return {"deliver_seconds": timings["total_seconds"],
                "deliver_writes": int(timings["writes"]),
                "deliver_gbps": analysis.gbps(layout.total_bytes, timings["total_seconds"])}

    async def _perftest_bandwidth(self, link: PeerHandle, size: int, writes: int,
                                  progress: _Progress) -> perftest.BandwidthFigures:
        phase = f"perftest bandwidth {format_size(size)}"
        progress(phase, 0, 1, force=True)
        out = await self._perftest_pair(link, "ib_write_bw", size,
                                        max(PERFTEST_MIN_ITERS, writes))
        progress(phase, 1, 1)
        return perftest.parse_bandwidth(out, size)

    async def _against_socket_loop(self, link: PeerHandle, size: int,
                                   progress: _Progress) -> dict[str, Any]:
        """The delivery and the plain loop, a round of each in turn.

        Alternated rather than one batch after the other: on a shared host a
        slow patch (another tenant, the page cache) then slows both sides of
        the ratio alike instead of one. Each loop round is a fresh
        connection, as each delivery is a fresh request.
        """
        total = KVLayout().total_bytes
        spec = socket_loop.LoopSpec(size, max(1, total // size), rounds=1)
        delivered: list[dict[str, Any]] = []
        looped: list[float] = []
        phase = f"socket loop {format_size(size)}"
        for n in range(ROUNDS):
            if self.params.deliver:
                delivered.append(await self._deliver(link, size, progress))
            progress(phase, n, ROUNDS, force=True)
            looped += await baseline.measure_socket_loop(
                link, f"{self.req}-socket-{size}-{n}", spec)
            progress(phase, n + 1, ROUNDS)
        median = statistics.median(looped)
        row: dict[str, Any] = {"socket_seconds": median, "socket_rounds": looped,
                               "socket_gbps": analysis.gbps(spec.total, median)}
        if delivered:
            ranked = sorted(delivered, key=lambda d: d["deliver_seconds"])
            row.update(ranked[len(ranked) // 2])  # the median round, with its writes
            row["deliver_rounds"] = [d["deliver_seconds"] for d in delivered]
        return row

    async def _perftest_pair(self, link: PeerHandle, tool: str, size: int, iters: int) -> str:
        """Server on the receiver, client here; a hung or failed run is tried again."""
        cfg = self.daemon.config
        gid = pick_gid(link.local_host, cfg.rdma_device, cfg.gid_index)
        # Generous: emulated links move a few MB/s, and setup takes seconds.
        limit = 30 + 2 * size * iters / 4e6
        failures = []
        for attempt in range(PERFTEST_TRIES):
            req = f"{self.req}-{tool}-{size}-{attempt}"
            async with baseline.served(link, req, tool, size, iters) as (host, port):
                args = perftest.command(tool, gid, size, iters, port, server=host)
                try:
                    return await _connect_and_run(args, limit)
                except PerftestFailed as exc:
                    failures.append(str(exc))
                    log.warning("perftest run failed", tool=tool, size=size, error=str(exc))
        raise PerftestFailed(f"{tool} at {size} B failed {PERFTEST_TRIES} times: "
                             + "; ".join(failures))

    # ---------------------------------------------------------- summary

    def summary(self, link: PeerHandle) -> dict[str, Any]:
        bandwidth = {row["size"]: row["stream_gbps"] for row in self.rows}
        layout = KVLayout()
        knee = analysis.knee(bandwidth)
        could_be = analysis.knee_range({row["size"]: row["stream_rounds_gbps"]
                                        for row in self.rows})
        chunk, why = analysis.recommend_chunk(bandwidth, layout.layer_bytes)
        return {"peer": link.name, "sender": self.daemon.config.name,
                **self.daemon.transport.describe(),
                "sizes": list(self.params.sizes), "knee_bytes": knee,
                # The sizes the knee could be, given each size's rounds.
                "knee_range_bytes": list(could_be) if could_be else None,
                "peak_gbps": max(bandwidth.values()) if bandwidth else None,
                "recommended_chunk_bytes": chunk, "recommendation": why,
                "baseline": self.params.baseline or None}


def _latency_row(rtts: list[float]) -> dict[str, Any]:
    lat = analysis.half_rtt_latency(rtts)
    return {"lat_samples": lat.samples, "lat_min_us": lat.min_us, "lat_p50_us": lat.p50_us,
            "lat_p99_us": lat.p99_us, "lat_p999_us": lat.p999_us,
            "lat_mean_us": lat.mean_us, "half_rtt_us": [r / 2 * 1e6 for r in rtts]}


async def _connect_and_run(args: list[str], limit: float) -> str:
    # The server needs a moment to listen; "Couldn't connect" means try again.
    deadline = time.monotonic() + 15
    while True:
        code, out = await perftest.run(args, limit)
        if code == 0:
            return out
        if "Couldn't connect" in out and time.monotonic() < deadline:
            await asyncio.sleep(0.3)
            continue
        raise PerftestFailed(f"{args[0].rsplit('/', 1)[-1]} exited with {code}",
                             hint=out.strip()[-600:])


def _close_unwanted_echo(answer: ctl.EchoOffer | ctl.EchoReady) -> ctl.EchoClose:
    return ctl.EchoClose(req=answer.req, lease=answer.lease, answers=0)


async def run(daemon: SenderHost, req: str, params: dict[str, Any],
              report: Report) -> dict[str, Any]:
    """``kvctl run chunk-sweep``: rows as they finish, then the summary."""
    sweep = ChunkSweep(daemon, SweepParams.from_wire(params), req, report)
    log.info("chunk-sweep started", req=req, peer=sweep.params.peer,
             sizes=list(sweep.params.sizes), baseline=sweep.params.baseline)
    result = await sweep.run()
    log.info("chunk-sweep finished", req=req, knee=result["knee_bytes"],
             peak_gbps=result["peak_gbps"])
    return result
