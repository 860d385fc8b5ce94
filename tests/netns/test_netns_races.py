"""Races on purpose, between two hosts: deadlines around the transfer time and
engines SIGKILLed at random points on both sides. Afterwards both daemons
agree on every request's outcome, and both pools are empty.

The daemons run in two network namespaces over TCP; every engine is a
process of its own (a prefill engine pushing a batch, a decode engine
consuming it), so a SIGKILL is a real crash: no close, no release.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.netns import (
    DaemonProcess,
    Host,
    NetnsPair,
    check_can_run,
    receiver_config,
    scrape_in,
    sender_config,
)
from kvctl.status import DaemonStatus
from kvwired.client import ReceiverClient, SenderClient
from kvwired.layout import RequestShape

from ..waiting import until

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

SHAPE = RequestShape(4, 256 << 10)  # 1 MiB in 4 layers
ROUNDS, PER_ROUND = 20, 25  # 500 pushes

PREFILL = """
import asyncio, json, sys
from kvwired.client import SenderClient
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape

async def main(socket, plan):
    shape = RequestShape(4, 256 << 10)
    async with await SenderClient.connect(socket) as engine:
        async def one(req, deadline, fill):
            try:
                push = await engine.open(req, "decode", shape, chunk="per-layer",
                                         deadline=deadline)
                for layer in range(shape.layers):
                    push.layer(layer)[:] = bytes([fill]) * shape.layer_bytes
                    push.commit(layer)
                result = await push.finish()
                out = {"req": req, "outcome": "delivered", "late": result.timings["late"]}
            except KvwireError as exc:
                out = {"req": req, "outcome": "failed", "error": type(exc).__name__}
            print(json.dumps(out), flush=True)
        await asyncio.gather(*(one(*item) for item in plan))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""

DECODE = """
import asyncio, json, sys
from kvwired.client import ReceiverClient
from kvwired.errors import KvwireError

async def main(socket, plan):
    async with await ReceiverClient.connect(socket) as engine:
        for req, _, fill in plan:
            engine.subscribe(req)
        print(json.dumps({"ready": True}), flush=True)
        async def one(req, fill):
            try:
                delivered = await engine.wait_delivered(req, timeout=None)
            except KvwireError as exc:
                print(json.dumps({"req": req, "outcome": "failed"}), flush=True)
                return
            view = engine.view(delivered)
            exact = bytes(view) == bytes([fill]) * delivered.length
            view.release()
            await engine.release(req)
            print(json.dumps({"req": req, "outcome": "delivered", "exact": exact}), flush=True)
        await asyncio.gather(*(one(req, fill) for req, _, fill in plan))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
"""


@pytest.fixture(scope="module")
def pair() -> Iterator[NetnsPair]:
    with NetnsPair(f"r{uuid.uuid4().hex[:6]}") as hosts:
        yield hosts


def _engine(script: str, socket: str, plan: list[Any]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, socket, json.dumps(plan)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class _Watcher(threading.Thread):
    """Collects an engine's records as it prints them; SIGKILLs it after ``kill_after``."""

    def __init__(self, process: subprocess.Popen[str], kill_after: int | None) -> None:
        super().__init__(daemon=True)
        self.process, self.kill_after = process, kill_after
        self.records: list[dict[str, Any]] = []
        self.killed = False
        self.start()

    def run(self) -> None:
        assert self.process.stdout is not None
        if self.kill_after == 0:
            self._kill()
        for line in self.process.stdout:
            if line.startswith("{"):
                self.records.append(json.loads(line))
            if self.kill_after is not None and len(self.records) >= self.kill_after:
                self._kill()
        self.process.wait()

    def _kill(self) -> None:
        if not self.killed and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.killed = True


def _log_events(daemon: DaemonProcess, event: str) -> set[str]:
    found = set()
    for line in daemon.log_path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == event:
                found.add(str(entry.get("req")))
    return found


async def _until_status(pair: NetnsPair, host: Host, port: int,
                        condition: Callable[[DaemonStatus], bool], what: str,
                        timeout: float = 30.0) -> DaemonStatus:
    seen: list[DaemonStatus] = []

    def holds() -> bool:
        seen.append(scrape_in(pair, host, port))
        return condition(seen[-1])
    await until(holds, timeout, what, every=0.2)
    return seen[-1]


async def _let_release(pair: NetnsPair, decode: subprocess.Popen[str]) -> None:
    """Give a live decode engine a few seconds to release what it was delivered."""
    deadline = time.monotonic() + 5
    while decode.poll() is None and time.monotonic() < deadline:
        if scrape_in(pair, pair.decode, 9471).total("kvwire_leases", state="held") == 0:
            return
        await asyncio.sleep(0.2)


def _settled(rx: DaemonStatus, tx: DaemonStatus) -> bool:
    return (rx.total("kvwire_pool_bytes", pool="receive", state="used") == 0
            and rx.total("kvwire_leases") == 0
            and tx.total("kvwire_pool_bytes", pool="staging", state="used") == 0)


async def test_500_racing_pushes_and_killed_engines_leave_agreement_and_empty_pools(
        pair: NetnsPair, tmp_path: Path) -> None:
    rx = DaemonProcess(pair, pair.decode, "receiver", receiver_config(
        pair, tmp_path, pool_size="256MiB", unclaimed_ttl=2.0, lease_wait=2.0), tmp_path)
    tx = DaemonProcess(pair, pair.prefill, "sender", sender_config(
        pair, tmp_path, staging_size="256MiB"), tmp_path)
    rx.start()
    tx.start()
    try:
        # The transfer time the deadlines are drawn around: a push's, among a
        # round's worth of concurrent ones.
        async with await SenderClient.connect(tx.socket) as engine, \
                await ReceiverClient.connect(rx.socket) as consumer:
            async def timed(n: int) -> float:
                started = time.monotonic()
                await engine.push_bytes(f"warm-{n}", "decode", b"w" * SHAPE.total_bytes)
                return time.monotonic() - started
            times = sorted(await asyncio.gather(*(timed(n) for n in range(PER_ROUND))))
            for n in range(PER_ROUND):
                await consumer.release(f"warm-{n}")
            transfer = times[len(times) // 2]
        rng = random.Random(2026)
        engine_said: dict[str, dict[str, Any]] = {}
        killed = {"prefill": 0, "decode": 0}
        for round_ in range(ROUNDS):
            plan = [(f"r{round_}-{n}", max(1e-3, rng.uniform(0.3, 2.0) * transfer),
                     rng.randrange(1, 256)) for n in range(PER_ROUND)]
            decode = _engine(DECODE, rx.socket, plan)
            assert decode.stdout is not None
            assert json.loads(decode.stdout.readline()) == {"ready": True}
            # Some engines die at a random point of their work: after k of
            # their requests have ended (k = 0: before they got anywhere).
            kill_prefill = rng.randrange(PER_ROUND) if rng.random() < 0.4 else None
            kill_decode = rng.randrange(PER_ROUND) if rng.random() < 0.4 else None
            prefill = _Watcher(_engine(PREFILL, tx.socket, plan), kill_prefill)
            watcher = _Watcher(decode, kill_decode)
            prefill.join(120)
            for record in prefill.records:
                engine_said[record["req"]] = record
            # Nothing of this round is still arriving at the receiver; then the
            # decode engine has had its chance to release what it got, and is
            # killed (what it still holds is reclaimed; a request aborted before
            # the receiver ever heard of it would keep it waiting for good).
            await _until_status(pair, pair.decode, 9471, lambda rx: sum(
                rx.total("kvwire_leases", state=s) for s in ("filling", "landed", "aborting"))
                == 0, "nothing arriving")
            await _let_release(pair, decode)
            decode.kill()
            watcher.join(60)
            killed["prefill"] += prefill.killed
            killed["decode"] += watcher.killed
            for record in watcher.records:
                if record["outcome"] == "delivered":
                    assert record["exact"], record  # every byte as the prefill wrote it
        # Both pools drain: released, reclaimed (dead decode engines, or none
        # left to claim: unclaimed_ttl), or aborted (dead prefill engines).
        deadline = time.monotonic() + 30
        while not _settled(rx_status := scrape_in(pair, pair.decode, 9471),
                           tx_status := scrape_in(pair, pair.prefill, 9472)):
            assert time.monotonic() < deadline, "pools did not drain"
            await asyncio.sleep(0.2)
    finally:
        tx.stop()
        rx.stop()
    delivered_at_receiver = _log_events(rx, "request delivered") - {
        f"warm-{n}" for n in range(PER_ROUND)}
    failed_at_sender = _log_events(tx, "push failed")
    # One outcome per request: nothing the sender failed was delivered, and
    # everything an engine was told was delivered, was.
    assert not failed_at_sender & delivered_at_receiver
    told_delivered = {req for req, r in engine_said.items() if r["outcome"] == "delivered"}
    told_failed = {req for req, r in engine_said.items() if r["outcome"] == "failed"}
    assert told_delivered <= delivered_at_receiver
    assert not told_failed & delivered_at_receiver
    sender_delivered = tx_status.total("kvwire_requests_total", outcome="delivered")
    receiver_delivered = rx_status.total("kvwire_requests_total", outcome="delivered")
    assert sender_delivered == receiver_delivered
    late = sum(1 for r in engine_said.values() if r.get("late"))
    print(f"{ROUNDS * PER_ROUND} pushes, deadlines {0.3 * transfer * 1e3:.1f}-"
          f"{2.0 * transfer * 1e3:.1f} ms; engines killed: {killed['prefill']} prefill, "
          f"{killed['decode']} decode; receiver delivered {len(delivered_at_receiver)} "
          f"(sender: {int(sender_delivered) - PER_ROUND}), sender failed {len(failed_at_sender)}; "
          f"engines told: {len(told_delivered)} delivered ({late} late), "
          f"{len(told_failed)} failed; disagreements 0; pool bytes left 0, leases 0; "
          f"reclaimed: {int(rx_status.total('kvwire_reclaimed_total'))}")
