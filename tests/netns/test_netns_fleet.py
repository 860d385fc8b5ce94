"""A fleet found through a real etcd: two senders and three receivers across
two namespaces, none of them configured with the others' addresses.

While pushes to ``peer="auto"`` run from both senders, receivers join, leave
cleanly, are SIGKILLed (their lease expires) and come back, and etcd itself
is killed and restarted. Every push ends delivered, its bytes compared in
the receive pool by a decode engine, or with a typed error; none hangs and
none is silently wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvctl.keys import local_cluster
from kvctl.netns import DaemonProcess, Host, NetnsPair, check_can_run, scrape_in
from kvwired.client import Delivered, ReceiverClient, SenderClient
from kvwired.discovery.address import RegistryAddress
from kvwired.errors import KvwireError
from kvwired.layout import RequestShape

from ..waiting import until

_why_not = check_can_run() or (None if shutil.which("etcd") else
                               "etcd is missing (apt-get install etcd-server)")
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

SHAPE = RequestShape(4, 512 << 10)  # 2 MiB in 4 layers
ETCD_PORT = 2379
RESULTS = Path(os.environ.get("KVWIRE_FLEET_RESULTS", "/dev/null"))


class Etcd:
    """A one-member etcd in the decode namespace, restartable on its data."""

    def __init__(self, pair: NetnsPair, workdir: Path) -> None:
        self.pair, self.workdir = pair, workdir
        self.address = f"{pair.decode.address}:{ETCD_PORT}"
        self.url = f"etcd://{self.address}/fleet"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = ["etcd", "--name", "kvw", "--data-dir", str(self.workdir / "etcd"),
                   "--listen-client-urls", f"http://{self.address}",
                   "--advertise-client-urls", f"http://{self.address}",
                   "--listen-peer-urls", "http://127.0.0.1:2380",
                   "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                   "--initial-cluster", "kvw=http://127.0.0.1:2380"]
        with open(self.workdir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen(self.pair.argv(self.pair.decode, command),
                                            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._answers():
            assert self.process.poll() is None, (self.workdir / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not answer within 30 s"
            time.sleep(0.1)

    def _answers(self) -> bool:
        probe = subprocess.run(self.pair.argv(self.pair.decode, [
            sys.executable, "-c", "import socket,sys; socket.create_connection("
            f"('{self.pair.decode.address}', {ETCD_PORT}), 1)"]), capture_output=True)
        return probe.returncode == 0

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class Fleet:
    pair: NetnsPair
    workdir: Path
    etcd: Etcd
    receivers: dict[str, DaemonProcess] = field(default_factory=dict)
    senders: dict[str, DaemonProcess] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def _daemon(self, name: str, role: str, host: Host, config: dict[str, Any]) -> DaemonProcess:
        home = self.workdir / name
        home.mkdir(exist_ok=True)
        tls = local_cluster(self.workdir / "tls", {name: role})[name]
        config = {"name": name, "socket": str(home / f"{role}.sock"), "transport": "tcp",
                  "discovery": self.etcd.url, "tls_dir": str(tls), **config}
        return DaemonProcess(self.pair, host, role, config, home)

    def receiver(self, name: str, index: int) -> DaemonProcess:
        if name not in self.receivers:
            port = 7471 + 10 * index
            self.metrics_ports[name] = 9471 + 10 * index
            self.receivers[name] = self._daemon(name, "receiver", self.pair.decode, {
                "listen": f"{self.pair.decode.address}:{port}", "data_port": port + 1,
                "metrics": f"{self.pair.decode.address}:{self.metrics_ports[name]}",
                "pool_size": "24MiB"})
        return self.receivers[name].start()

    def sender(self, name: str, index: int) -> DaemonProcess:
        self.metrics_ports[name] = 9472 + 10 * index
        self.senders[name] = self._daemon(name, "sender", self.pair.prefill, {
            "metrics": f"{self.pair.prefill.address}:{self.metrics_ports[name]}",
            "staging_size": "16MiB"})
        return self.senders[name].start()

    async def sample(self, sender: str, metric: str, **labels: str) -> float:
        status = await asyncio.to_thread(scrape_in, self.pair, self.pair.prefill,
                                         self.metrics_ports[sender])
        return status.total(metric, **labels)

    def log_has(self, daemon: DaemonProcess, text: str) -> bool:
        return text in daemon.log_path.read_text()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with NetnsPair(f"f{os.getpid() % 100000}") as pair:
        etcd = Etcd(pair, tmp_path)
        etcd.start()
        fleet = Fleet(pair, tmp_path, etcd)
        try:
            yield fleet
        finally:
            for daemon in [*fleet.senders.values(), *fleet.receivers.values()]:
                daemon.stop()
            etcd.kill()


@dataclass
class Tally:
    verified: dict[str, int] = field(default_factory=dict)  # by receiver
    typed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # anything untyped, or wrong bytes

    @property
    def total_verified(self) -> int:
        return sum(self.verified.values())


async def push_and_verify(fleet: Fleet, engine: SenderClient, req: str, fill: int,
                          tally: Tally) -> None:
    """One push to ``auto``, read back byte for byte by a decode engine."""
    push = None
    try:
        push = await asyncio.wait_for(engine.open(req, "auto", SHAPE, chunk="per-layer"), 30)
        receiver = fleet.receivers[push.peer]
        async with await ReceiverClient.connect(receiver.socket) as decode:
            decode.subscribe(req)
            for layer in range(SHAPE.layers):
                push.layer(layer)[:] = bytes([(fill + layer) % 256]) * SHAPE.layer_bytes
                push.commit(layer)
            await asyncio.wait_for(push.finish(), 30)
            delivered: Delivered = await decode.wait_delivered(req, timeout=30)
            view = decode.view(delivered)
            try:
                for layer in range(SHAPE.layers):
                    start, length = SHAPE.layer_span(layer)
                    if view[start : start + length] != bytes([(fill + layer) % 256]) * length:
                        tally.errors.append(f"{req}: layer {layer} differs at {push.peer}")
            finally:
                view.release()
            await decode.release(req)
        tally.verified[push.peer] = tally.verified.get(push.peer, 0) + 1
    except KvwireError as exc:
        tally.typed.append(f"{req}: {type(exc).__name__}: {exc.message}")
        if push is not None:
            push.abort()  # its staging goes back (a no-op if it already ended)
    except TimeoutError:
        tally.errors.append(f"{req}: hung for 30 s")
    except Exception as exc:  # the test reports it, never hides it
        where = traceback.extract_tb(exc.__traceback__)[-1]
        tally.errors.append(f"{req}: untyped {type(exc).__name__}: {exc} "
                            f"(raised at {where.filename}:{where.lineno})")


@pytest.fixture
async def pushing(fleet: Fleet) -> AsyncIterator[Callable[[], Tally]]:
    """Both senders pushing to ``auto`` in a loop until the test ends."""
    stop = asyncio.Event()
    tally = Tally()
    engines: list[SenderClient] = []

    async def loop(sender: str) -> None:
        engine = await SenderClient.connect(fleet.senders[sender].socket)
        engines.append(engine)
        n = 0
        while not stop.is_set():
            n += 1
            await push_and_verify(fleet, engine, f"{sender}-{n}", n, tally)

    tasks: list[asyncio.Task[None]] = []

    def begin() -> Tally:
        tasks.extend(asyncio.ensure_future(loop(name)) for name in fleet.senders)
        return tally

    yield begin
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for engine in engines:
        await engine.close()


async def test_a_fleet_rides_out_joins_departures_crashes_and_an_etcd_restart(
        fleet: Fleet, pushing: Callable[[], Tally]) -> None:
    timings: dict[str, float] = {}
    fleet.receiver("decode-a", 0)
    fleet.receiver("decode-b", 1)
    for index, name in enumerate(["prefill-1", "prefill-2"]):
        fleet.sender(name, index)

    async def connected(receiver: str, up: bool = True) -> bool:
        for sender in fleet.senders:
            value = await fleet.sample(sender, "kvwire_peer_up", peer=receiver)
            if (value >= 1) != up:
                return False
        return True

    for name in ("decode-a", "decode-b"):
        await until(functools.partial(connected, name), 30, f"both senders reach {name}")
    tally = pushing()
    await until(lambda: _at_least(tally, 4), 60, "pushes delivered")

    # kvctl cluster, from the prefill node, sees the registry and the link.
    out = await asyncio.to_thread(subprocess.run, fleet.pair.argv(fleet.pair.prefill, [
        sys.executable, "-m", "kvctl", "cluster", fleet.etcd.url, "--json",
        "--sender-metrics", f"{fleet.pair.prefill.address}:{fleet.metrics_ports['prefill-1']}"
    ]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    members = {m["name"]: m for m in json.loads(out.stdout)["members"]}
    assert set(members) == {"decode-a", "decode-b"}, out.stdout
    assert {m["sender"] for m in members.values()} == {"connected"}, out.stdout
    assert all(m["state"] == "live" for m in members.values()), out.stdout

    # A third receiver joins: how long until both senders can use it.
    started = time.monotonic()
    await asyncio.to_thread(fleet.receiver, "decode-c", 2)
    await until(lambda: connected("decode-c"), 30, "both senders reach decode-c")
    timings["join_to_connected_s"] = time.monotonic() - started

    # SIGKILL: no goodbye, the record stays until its lease runs out.
    victim = fleet.receivers["decode-b"].process
    assert victim is not None
    victim.send_signal(signal.SIGKILL)
    await asyncio.to_thread(victim.wait)
    started = time.monotonic()
    # ``auto`` chooses among connected receivers only: this is when it stops
    # choosing the dead one. Then the registry forgets it, at lease expiry.
    await until(functools.partial(connected, "decode-b", False), 30, "decode-b disconnected")
    timings["sigkill_to_disconnected_s"] = time.monotonic() - started
    await until(lambda: _left_everywhere(fleet, "decode-b"), 30, "decode-b dropped")
    timings["sigkill_to_dropped_s"] = time.monotonic() - started
    done = tally.total_verified
    await until(lambda: _at_least(tally, done + 4), 60, "pushes after the crash")

    # It comes back under its name.
    await asyncio.to_thread(fleet.receiver, "decode-b", 1)
    await until(lambda: connected("decode-b"), 30, "decode-b back")

    # A clean stop withdraws the record at once.
    started = time.monotonic()
    # Off the event loop: the pushes on it must go on while decode-a drains.
    code = await asyncio.to_thread(fleet.receivers["decode-a"].stop)
    assert code == 0, fleet.receivers["decode-a"].log_tail()
    await until(lambda: _left_everywhere(fleet, "decode-a", times=1), 30, "decode-a gone")
    timings["clean_stop_to_dropped_s"] = time.monotonic() - started

    # etcd dies: pushes go on from the membership last seen.
    await asyncio.to_thread(fleet.etcd.kill)

    async def registry(up: bool) -> bool:
        for sender in fleet.senders:
            if (await fleet.sample(sender, "kvwire_registry_up") >= 1) != up:
                return False
        return True

    await until(lambda: registry(False), 30, "senders notice etcd is gone")
    done = tally.total_verified
    await until(lambda: _at_least(tally, done + 4), 60, "pushes with etcd down")
    await asyncio.to_thread(fleet.etcd.start)
    started = time.monotonic()
    await until(lambda: registry(True), 30, "senders see etcd again")
    timings["etcd_back_to_watching_s"] = time.monotonic() - started
    for name in ("decode-b", "decode-c"):
        await until(functools.partial(connected, name), 30, f"{name} after the etcd restart")
    done = tally.total_verified
    await until(lambda: _at_least(tally, done + 4), 60, "pushes after etcd is back")

    RESULTS.write_text(json.dumps({"timings": timings, "verified": tally.verified,
                                   "typed_errors": tally.typed}, indent=2))
    print(json.dumps(timings))
    assert not tally.errors, tally.errors
    # Every receiver that lived long enough took pushes; none were lost silently.
    assert set(tally.verified) >= {"decode-b", "decode-c"} or len(tally.verified) >= 2


async def _at_least(tally: Tally, count: int) -> bool:
    assert not tally.errors, tally.errors
    return tally.total_verified >= count


async def _left_everywhere(fleet: Fleet, receiver: str, times: int = 1) -> bool:
    """Every sender logged the receiver's departure from the registry ``times`` times."""
    def departures(daemon: DaemonProcess) -> int:
        count = 0
        for line in daemon.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                count += (event.get("event") == "membership changed"
                          and receiver in event.get("left", []))
        return count
    return all(departures(daemon) >= times for daemon in fleet.senders.values())


def registry_call(fleet: Fleet, body: str) -> str:
    """Run ``body`` (async Python with ``client`` and ``key``) against the fleet's
    etcd from the decode namespace, as anyone with write access could."""
    address = RegistryAddress.parse(fleet.etcd.url)
    script = ("import asyncio, json, aetcd\n"
              "async def main():\n"
              f"    client = aetcd.Client({address.host!r}, {address.port})\n"
              f"    key = {address.key('decode-a')!r}\n"
              + "".join(f"    {line}\n" for line in body.splitlines())
              + "    await client.close()\n"
              "asyncio.run(main())\n")
    out = subprocess.run(fleet.pair.argv(fleet.pair.decode, [sys.executable, "-c", script]),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def stored_record(fleet: Fleet) -> tuple[dict[str, Any], int]:
    """decode-a's record as etcd holds it, and the etcd lease it is bound to."""
    shown = json.loads(registry_call(fleet, "got = await client.get(key)\n"
                                            "print(json.dumps([got.value.decode(), got.lease]))"))
    return json.loads(shown[0]), int(shown[1])


async def test_a_forged_record_heals_within_a_refresh_and_costs_auto_nothing(
        fleet: Fleet, pushing: Callable[[], Tally]) -> None:
    """An overwrite of a receiver's record (a tarpit address, no etcd lease, so
    it would never expire) is not believed by the sender (its signature does
    not cover it) and is undone by the receiver within a refresh."""
    receiver = fleet.receiver("decode-a", 0)
    sender = fleet.sender("prefill-1", 0)

    async def connected() -> bool:
        return await fleet.sample("prefill-1", "kvwire_peer_up", peer="decode-a") >= 1

    await until(connected, 30, "prefill-1 reaches decode-a")
    genuine, lease = await asyncio.to_thread(stored_record, fleet)
    assert lease != 0, genuine
    tally = pushing()
    await until(lambda: _at_least(tally, 2), 60, "pushes delivered")

    forged = {**genuine, "control": f"{fleet.pair.decode.address}:7999",
              "pool_bytes": 1 << 50, "pool_free": 1 << 50}
    started = time.monotonic()
    await asyncio.to_thread(registry_call, fleet,
                            f"await client.put(key, {json.dumps(forged).encode()!r})")

    async def restored() -> bool:
        record, bound = await asyncio.to_thread(stored_record, fleet)
        return record["control"] == genuine["control"] and bound != 0

    healed = await until(restored, 10, "decode-a restores its record")
    await until(lambda: asyncio.to_thread(fleet.log_has, receiver,
                                          "registry record changed by someone else"),
                10, "the receiver says its record was overwritten")
    done = tally.total_verified
    await until(lambda: _at_least(tally, done + 6), 60, "auto pushes after the forgery")
    print(json.dumps({"forged_record_healed_s": round(healed, 2),
                      "since_forgery_s": round(time.monotonic() - started, 2)}))
    assert not tally.errors, tally.errors
    assert not tally.typed, tally.typed  # not one auto push lost to the forgery
    assert await fleet.sample("prefill-1", "kvwire_reconnects_total", peer="decode-a") == 0
    # Its signature does not cover its fields: not believed, counted, ignored.
    assert await fleet.sample("prefill-1", "kvwire_registry_records_refused_total",
                              reason="bad_signature") >= 1
    assert fleet.log_has(sender, "registry record not believed")
