"""Where a small write's round trip goes: perftest's, kvwire's compiled
verbs core alone, kvwire's transport busy-polled and asleep on the event
loop, in one run.

Needs the lab (`kvctl lab up`); run from the checkout on the host:
`python -m benchmarks.round_trip`. It starts one process on each node; the
prefill node's pings, the decode node's echoes. Each round runs, on the
same link one after the other:

- **ib_write_lat**: perftest's C ping-pong, busy-polling (the receiving
  end polls the buffer's last byte: no receive completion at all);
- **ib_send_lat**, busy-polling and with ``-e`` (asleep on completion
  events): a compiled ping-pong whose every message consumes a receive and
  produces a completion, as a write with immediate does; the pair says
  what a compiled path's wake-up costs on this link;
- **the core alone, busy-polled**: a queue pair of the same kind driven with
  the fewest calls into kvwire's compiled verbs core a write and its answer
  take (post, poll, re-post the receive), from a Python loop: the floor of
  any path that keeps Python in charge, with none of the transport's code;
- **transport, busy-polled**: kvwire's own verbs transport objects (the
  daemons' queue pairs, send queue accounting and receive re-posting), a
  WRITE_WITH_IMM each way, each side polling its completion queues in a
  tight loop: what kvwire's code adds to a hop, with no wake-up;
- **transport, asleep**: the same, each side asleep on uvloop until its
  completion channel wakes it, as the daemons wait (no core burnt).

Every ratio is a round's p50 over the ib_write_lat run of the same round
(an emulated link's speed drifts within minutes), and the figure is the
median of the rounds' ratios. CPU is each process's user and system time
per round trip (``getrusage``), both ends, and its user part: rdma_rxe
builds and takes packets in the kernel, inside the posting call or in
interrupts, while Python's work is all user time. The daemons' own echo
(sessions, credits, the ping's timer) is what `kvctl run chunk-sweep
--baseline perftest` measures on top of the asleep path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvctl.figures import number, ratio_spread, times, with_spread
from kvwired import analysis
from kvwired.analysis import percentile
from kvwired.experiments import cpu, perftest
from kvwired.pool import SharedMemory
from kvwired.rdma import GidEntry, gid_table, pick_gid
from kvwired.transport.base import DataChannel, Responder, Write
from kvwired.transport.verbs import VerbsTransport, core
from kvwired.transport.verbs.channel import VerbsDataChannel
from kvwired.transport.verbs.queue_pair import Endpoint
from kvwired.transport.verbs.responder import VerbsResponder

CONTROL_PORT = 18620  # the two processes' own exchange, on the wire
PERFTEST_PORT = 18621
WARMUP = 20
# perftest's steps: the tool, and its flags beyond what the daemons pass it.
PERFTEST_STEPS = {"ib_write_lat": ("ib_write_lat", []), "ib_send_lat": ("ib_send_lat", []),
                  "ib_send_lat_events": ("ib_send_lat", ["--events"])}
STEPS = (*PERFTEST_STEPS, "core", "busy", "asleep")
LABELS = {"ib_write_lat": "ib_write_lat (C, busy-polls)",
          "ib_send_lat": "ib_send_lat (C, busy-polls)",
          "ib_send_lat_events": "ib_send_lat -e (C, asleep)",
          "core": "compiled core alone, busy-polled",
          "busy": "kvwire transport, busy-polled",
          "asleep": "kvwire transport, asleep on uvloop"}
PERFTEST_TIMEOUT = 120.0
STUCK_SECONDS = 30.0  # a round trip that has not come back by then is lost: say so
LOST = (f"no answer within {STUCK_SECONDS:g} s: the wire or the other node stopped "
        "(`kvctl lab status`)")


def perftest_args(step: str, gid: GidEntry, size: int, iterations: int,
                  server: str | None = None) -> list[str]:
    tool, flags = PERFTEST_STEPS[step]
    args = perftest.command("ib_write_lat", gid, size, iterations, PERFTEST_PORT, server)
    found = shutil.which(tool)
    if found is None:
        raise SystemExit(f"{tool} is not installed on this node (apt-get install perftest)")
    return [found, *flags, *args[1:]]


def per_round_trip(started: cpu.CpuTimes, size: int, count: int) -> dict[str, float]:
    """This process's CPU since ``started`` over ``count`` round trips: all of
    it, and the user part."""
    cost = cpu.WriteCost(size, count, cpu.own() - started)
    return {"cpu_us_per_rtt": cost.user_us_per_write + cost.system_us_per_write,
            "user_us_per_rtt": cost.user_us_per_write}


def stuck_after(seconds: float = STUCK_SECONDS) -> Callable[[], None]:
    """A check to call while spinning: it ends the run once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > deadline:
            raise SystemExit(LOST)
    return check


# ------------------------------------------------------------------ on a node


def ignore(imm: int) -> None:
    pass


class Bare:
    """A queue pair of kvwire's kind, driven with nothing but core calls."""

    RECEIVES = 64

    def __init__(self, transport: VerbsTransport, address: str, size: int) -> None:
        # Its completions are read here, in place, never by the event loop's callback.
        self.pair = transport.queue_pair(address, self.RECEIVES, lambda completions: None)
        self.size = size
        device = self.pair.device
        self.pair.qp.post_receives(device.base, 1, self.pair.receive_lkey, self.RECEIVES)
        self.rkey = self.remote = 0
        self.write = [Write(0, 0, size)]
        self.signalled = {0: 1}

    def endpoint(self) -> dict[str, Any]:
        device = self.pair.device
        return {**self.pair.endpoint.to_wire(), "rkey": device.mr.rkey, "addr": device.base}

    def connect(self, remote: dict[str, Any]) -> None:
        self.pair.connect(Endpoint.from_wire(remote))
        self.rkey, self.remote = int(remote["rkey"]), int(remote["addr"])

    def send(self, imm: int) -> None:
        device = self.pair.device
        self.pair.qp.post_writes(self.write, 0, 1, device.base, device.mr.lkey, self.remote,
                                 self.rkey, imm & 0xFFFFFFFF, self.signalled)

    def received(self) -> int:
        """Poll until at least one write with immediate has come; how many came."""
        cq, got, stuck = self.pair.cq.cq, 0, stuck_after()
        while not got:
            stuck()
            for _, status, opcode, _ in cq.poll(16):
                if status != core.IBV_WC_SUCCESS:
                    raise SystemExit(f"a completion failed: status {status}")
                got += opcode == core.IBV_WC_RECV_RDMA_WITH_IMM
        device = self.pair.device
        self.pair.qp.post_receives(device.base, 1, self.pair.receive_lkey, got)
        return got

    def drain(self) -> None:
        self.pair.cq.cq.poll(64)


class Side:
    """One node's end: a responder for the peer's writes, a channel to the peer."""

    def __init__(self, size: int) -> None:
        self.size = size
        table = gid_table()  # read once: a node's sysfs scan takes seconds
        self.address = next(e.ipv4 for e in table if e.type == "RoCE v2" and e.ipv4)
        self.gid = pick_gid(self.address, table=table)  # perftest's device and GID
        self.memory = SharedMemory(4 << 20, "round-trip")
        self.transport = VerbsTransport()
        self.received = 0
        self.on_received: Callable[[int], None] = ignore
        self.responder: Responder | None = None
        self.channel: DataChannel | None = None
        self.errors: list[Exception] = []
        self.bare: Bare  # on the same device, once the transport has opened it

    async def start(self) -> None:
        await self.transport.start(self.memory)
        self.responder = self.transport.responder(self.address, self._received, self._failed)
        self.bare = Bare(self.transport, self.address, self.size)

    def _received(self, imm: int) -> None:
        self.received += 1
        self.on_received(imm)

    def _failed(self, error: Exception) -> None:
        self.errors.append(error)

    def send(self, imm: int) -> asyncio.Future[None]:
        assert self.channel is not None
        return self.channel.post([Write(0, 0, self.size)], imm)

    def answer(self, imm: int) -> None:
        self.send(imm)

    def poll(self) -> None:
        """Both completion queues, in place (what busy-polling does)."""
        assert isinstance(self.channel, VerbsDataChannel)
        assert isinstance(self.responder, VerbsResponder)
        self.channel.poll_now()
        self.responder.poll_now()
        if self.errors:
            raise self.errors[0]


async def _send_line(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def _read_line(reader: asyncio.StreamReader) -> dict[str, Any]:
    line = await reader.readline()
    if not line:
        raise SystemExit("the other node's process went away")
    message: dict[str, Any] = json.loads(line)
    return message


def answer_until(side: Side, total: int, done: asyncio.Future[None]) -> Callable[[int], None]:
    """Answer each ping; ``done`` once ``total`` have come."""
    def answer(imm: int) -> None:
        side.answer(imm)
        if side.received >= total and not done.done():
            done.set_result(None)
    return answer


def lost(answered: asyncio.Future[None]) -> None:
    if not answered.done():
        answered.set_exception(TimeoutError(LOST))


def resolve(answered: asyncio.Future[None]) -> Callable[[int], None]:
    def received(imm: int) -> None:
        if not answered.done():
            answered.set_result(None)
    return received


async def echo(size: int, iterations: int) -> None:
    """The decode node's end: answers every write with one of the same size."""
    side = Side(size)
    await side.start()
    assert side.responder is not None
    connected: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
        asyncio.Queue())
    server = await asyncio.start_server(
        lambda r, w: connected.put_nowait((r, w)), "0.0.0.0", CONTROL_PORT)
    reader, writer = await connected.get()
    server.close()
    hello = await _read_line(reader)
    answer = await side.responder.accept(hello["offer"])
    initiator = side.transport.initiator(side.address)
    await _send_line(writer, {"answer": answer, "offer": await initiator.offer(),
                              "bare": side.bare.endpoint()})
    side.bare.connect(hello["bare"])
    side.channel = await initiator.complete((await _read_line(reader))["answer"])
    side.on_received = side.answer  # an answer per ping, posted from the completion
    while (step := (await _read_line(reader)).get("step")) is not None:
        total = WARMUP + iterations
        if step in PERFTEST_STEPS:
            args = perftest_args(step, side.gid, size, iterations)
            server_process = await perftest.start_server(args, PERFTEST_PORT)
            await _send_line(writer, {"ready": True})
            await server_process.wait()
            await _send_line(writer, {})
            continue
        side.received = 0
        cpu_before = cpu.own()
        if step == "core":
            await _send_line(writer, {"ready": True})
            answered = 0
            while answered < total:
                for _ in range(side.bare.received()):
                    side.bare.send(answered)
                    answered += 1
            side.bare.drain()
        elif step == "busy":
            await _send_line(writer, {"ready": True})
            stuck = stuck_after(STUCK_SECONDS + iterations)
            while side.received < total or side.channel.pending_writes:
                side.poll()
                stuck()
        else:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            side.on_received = answer_until(side, total, done)
            await _send_line(writer, {"ready": True})
            await asyncio.wait_for(done, STUCK_SECONDS + iterations)
            side.on_received = side.answer
        await _send_line(writer, per_round_trip(cpu_before, size, total))
    side.channel.close()
    side.responder.close()
    await side.transport.stop()


async def ping(peer: str, size: int, iterations: int, rounds: int) -> dict[str, Any]:
    """The prefill node's end: drives every step of every round; their figures."""
    side = Side(size)
    await side.start()
    assert side.responder is not None
    deadline = time.monotonic() + 60
    while True:
        try:
            reader, writer = await asyncio.open_connection(peer, CONTROL_PORT)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    initiator = side.transport.initiator(side.address)
    await _send_line(writer, {"offer": await initiator.offer(), "bare": side.bare.endpoint()})
    reply = await _read_line(reader)
    side.bare.connect(reply["bare"])
    answer = await side.responder.accept(reply["offer"])
    await _send_line(writer, {"answer": answer})
    side.channel = await initiator.complete(reply["answer"])
    results: list[dict[str, Any]] = []
    for _ in range(rounds):
        figures: dict[str, Any] = {}
        for step in STEPS:
            await _send_line(writer, {"step": step})
            await _read_line(reader)  # ready
            if step in PERFTEST_STEPS:
                args = perftest_args(step, side.gid, size, iterations, server=peer)
                code, out = await perftest.run(args, PERFTEST_TIMEOUT)
                if code != 0:
                    raise SystemExit(f"{LABELS[step]} failed ({code}): {out[-500:]}")
                theirs = perftest.parse_latency(out, size)
                # Busy-polling, it spins through its whole round trip, in user
                # space; asleep, its CPU is not measured here.
                spun = None if step == "ib_send_lat_events" else 2 * theirs.typical_us
                figures[step] = {"p50_us": theirs.typical_us,
                                 "near": {"cpu_us_per_rtt": spun, "user_us_per_rtt": spun},
                                 "far": {"cpu_us_per_rtt": None, "user_us_per_rtt": None}}
                await _read_line(reader)
                continue
            pings = {"core": _bare_pings, "busy": _busy_pings, "asleep": _asleep_pings}
            rtts, near = await pings[step](side, iterations)
            figures[step] = {"p50_us": percentile(rtts, 50) / 2 * 1e6,
                             "p99_us": percentile(rtts, 99) / 2 * 1e6,
                             "near": near, "far": await _read_line(reader)}
        results.append(figures)
    await _send_line(writer, {"step": None})
    side.channel.close()
    side.responder.close()
    await side.transport.stop()
    return {"size": size, "iterations": iterations, "rounds": results}


async def _bare_pings(side: Side, iterations: int) -> tuple[list[float], dict[str, float]]:
    rtts = []
    cpu_before = cpu.own()
    for n in range(WARMUP + iterations):
        started = time.perf_counter()
        side.bare.send(n)
        side.bare.received()
        if n >= WARMUP:
            rtts.append(time.perf_counter() - started)
    side.bare.drain()
    return rtts, per_round_trip(cpu_before, side.size, WARMUP + iterations)


async def _busy_pings(side: Side, iterations: int) -> tuple[list[float], dict[str, float]]:
    rtts = []
    cpu_before = cpu.own()
    for n in range(WARMUP + iterations):
        before = side.received
        started = time.perf_counter()
        side.send(n)
        stuck = stuck_after()
        while side.received == before:
            side.poll()
            stuck()
        if n >= WARMUP:
            rtts.append(time.perf_counter() - started)
    assert side.channel is not None
    stuck = stuck_after()
    while side.channel.pending_writes:
        side.poll()
        stuck()
    return rtts, per_round_trip(cpu_before, side.size, WARMUP + iterations)


async def _asleep_pings(side: Side, iterations: int) -> tuple[list[float], dict[str, float]]:
    rtts = []
    loop = asyncio.get_running_loop()
    cpu_before = cpu.own()
    for n in range(WARMUP + iterations):
        answered: asyncio.Future[None] = loop.create_future()
        side.on_received = resolve(answered)
        started = time.perf_counter()
        sent = side.send(n)
        # A bare timer, as the daemons' pings have: wait_for's task and
        # callbacks would be the benchmark's cost, not the transport's.
        timer = loop.call_later(STUCK_SECONDS, lost, answered)
        await answered
        timer.cancel()
        if n >= WARMUP:
            rtts.append(time.perf_counter() - started)
        await sent
    side.on_received = ignore
    return rtts, per_round_trip(cpu_before, side.size, WARMUP + iterations)


# ------------------------------------------------------------------ on the host


def in_lab(size: int, iterations: int, rounds: int) -> dict[str, Any]:
    from kvctl.lab import machine
    from kvctl.lab.daemons import DECODE_ADDRESS

    state = machine.require_state()
    common = ["--size", str(size), "--iterations", str(iterations)]
    echo_result: dict[str, Any] = {}

    def run_echo() -> None:
        echo_result["run"] = machine.run_in("decode", [
            sys.executable, "-m", "benchmarks.round_trip", "echo", *common], state=state)

    echoing = threading.Thread(target=run_echo)
    echoing.start()
    code, out, err = machine.run_in("prefill", [
        sys.executable, "-m", "benchmarks.round_trip", "ping", "--peer", DECODE_ADDRESS,
        "--rounds", str(rounds), *common], state=state)
    echoing.join()
    if code != 0:
        far = echo_result.get("run", (None, "", ""))[2]
        raise SystemExit(f"the pings failed ({code}): {err[-1500:]}\necho: {far[-1500:]}")
    measured: dict[str, Any] = json.loads(out)
    return measured


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """Per step: medians over rounds, and each round's p50 over that round's
    ib_write_lat, with their median and spread."""
    rounds = measured["rounds"]
    steps: dict[str, Any] = {}
    for step in STEPS:
        ratios = [r for figures in rounds if (r := analysis.ratio(
            figures[step]["p50_us"], figures["ib_write_lat"]["p50_us"])) is not None]
        row: dict[str, Any] = {
            "p50_us": statistics.median(f[step]["p50_us"] for f in rounds),
            "round_ratios": ratios}
        for end in ("near", "far"):
            for figure in ("cpu_us_per_rtt", "user_us_per_rtt"):
                row[f"{end}_{figure}"] = _median_or_none(
                    [f[step][end][figure] for f in rounds])
        with_spread(row, "x_ib_write_lat", ratios)
        steps[step] = row
    return {**measured, "steps": steps}


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and len(known) == len(values) else None


def table(summary: dict[str, Any]) -> str:
    lines = [f"{summary['size']} B half round trip, {len(summary['rounds'])} round(s) of "
             f"{summary['iterations']}; x ib_write_lat: the median of each round's p50 over "
             "that round's ib_write_lat, lowest and highest round",
             "CPU µs/rtt: each end's user and system time per round trip, and the user part "
             "(the prefill node's, then the decode node's)",
             f"{'path':36}  {'p50 µs':>8}  {'x ib_write_lat':<36}  {'CPU µs/rtt':>10}  "
             f"{'user':>6}  {'far end':>7}  {'user':>6}"]
    for step, row in summary["steps"].items():
        ratio = "" if step == "ib_write_lat" else times(ratio_spread(row, "x_ib_write_lat"))
        lines.append(f"{LABELS[step]:36}  {row['p50_us']:8.1f}  {ratio:<36}  "
                     f"{number(row['near_cpu_us_per_rtt'], '.0f'):>10}  "
                     f"{number(row['near_user_us_per_rtt'], '.0f'):>6}  "
                     f"{number(row['far_cpu_us_per_rtt'], '.0f'):>7}  "
                     f"{number(row['far_user_us_per_rtt'], '.0f'):>6}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("where", nargs="?", choices=("lab", "ping", "echo"), default="lab",
                        help="lab (the default, on the host) starts the other two in the nodes")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer", default="", help="ping: the echoing node's wire address")
    parser.add_argument("--json", action="store_true", help="print the JSON document")
    args = parser.parse_args()
    import uvloop  # the daemons' loop; imported here, on a node

    if args.where == "echo":
        uvloop.run(echo(args.size, args.iterations))
    elif args.where == "ping":
        print(json.dumps(uvloop.run(ping(args.peer, args.size, args.iterations, args.rounds))))
    else:
        summary = summarize(in_lab(args.size, args.iterations, args.rounds))
        print(json.dumps(summary, indent=2) if args.json else table(summary))


if __name__ == "__main__":
    main()
