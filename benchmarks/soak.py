"""Soak: what the daemons keep per push, per TLS session and per engine connection.

A daemon that runs for weeks through reconnect storms cannot afford a cost
per session or per request. Two network namespaces with a receiver and a
sender (mutual TLS, TCP over a veth, as in ``make demo-netns``); each kind of
work below runs ``--count`` times, one kind after the other, and at
``--checkpoints`` points through it both daemons are read from outside: their
resident and anonymous memory and open file descriptors (/proc), and from
their metrics endpoints their live asyncio tasks
(``kvwire_event_loop_tasks``) and metric series.

- ``push``: a 16 KiB push (2 layers of 16 tokens), delivered, every byte
  checked at the decode side, released;
- ``engine``: an engine connecting to each daemon's unix socket and leaving;
- ``tls-good``: from the prefill host, a TLS handshake on the receiver's
  control port with the sender's own certificate, then the connection closed;
- ``tls-refused``: plaintext on the receiver's control port, refused at the
  handshake;
- ``tls-idle``: connections to the receiver's control port that say nothing,
  200 open at once, each closed by the receiver when its handshake time is up
  (``handshake_timeout``, 0.5 s here): the reconnect storm's silent half.

Per kind and figure, the table gives the value after the first checkpoint
(the warm-up: the first of ``--checkpoints`` parts), at the end, and the
growth per 10,000 operations over the second half of the run, where a cost
that levels off shows as about 0 and one per operation does not.

    python -m benchmarks.soak [--count 10000] [--checkpoints 6] [--kinds push,engine]
        [--out results/soak.json]

It needs root (namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvctl import table
from kvctl.netns import DaemonProcess, NetnsPair, check_can_run, scrape_in, two_hosts
from kvctl.processes import holdings
from kvctl.push import push_one
from kvwired.addresses import DEFAULT_CONTROL_PORT, RECEIVER_METRICS_PORT, SENDER_METRICS_PORT
from kvwired.client import ReceiverClient, SenderClient
from kvwired.layout import KVLayout

KINDS = ("push", "engine", "tls-good", "tls-refused", "tls-idle")
IDLE_AT_ONCE = 200
HANDSHAKE_TIMEOUT = 0.5
PUSH_LAYOUT = KVLayout(layers=2, tokens=16)

# Runs in the prefill namespace: ``count`` connections to the receiver's
# control port, one at a time, each closed once the receiver has answered
# (its TLS handshake, or its refusal); or, silent, AT_ONCE at a time, each
# left until the receiver closes it.
KNOCKER = """
import socket, ssl, sys
host, port, count, kind, tls, at_once = sys.argv[1:7]
port, count, at_once = int(port), int(count), int(at_once)
if kind == "tls-idle":
    left = count
    while left:
        batch = [socket.create_connection((host, port), timeout=30)
                 for _ in range(min(at_once, left))]
        for sock in batch:
            try:
                while sock.recv(4096):
                    pass  # nothing is said, so the receiver has nothing to answer
            except OSError:
                pass  # closed by the receiver: what is waited for
            sock.close()
        left -= len(batch)
    sys.exit(0)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False  # the receiver is known by its name, not this address
context.load_verify_locations(tls + "/ca.crt")
context.load_cert_chain(tls + "/node.crt", tls + "/node.key")
for _ in range(count):
    with socket.create_connection((host, port), timeout=10) as raw:
        if kind == "tls-good":
            with context.wrap_socket(raw):
                pass  # the handshake is done once wrapped
        else:
            raw.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            try:
                while raw.recv(4096):
                    pass
            except OSError:
                pass
"""


@dataclass
class Reading:
    done: int  # operations of this kind so far
    figures: dict[str, float]  # "receiver rss MiB" -> value


@dataclass
class KindRun:
    kind: str
    readings: list[Reading] = field(default_factory=list)
    seconds: float = 0.0


def read_daemons(pair: NetnsPair, daemons: dict[str, tuple[DaemonProcess, int]]
                 ) -> dict[str, float]:
    figures: dict[str, float] = {}
    for role, (daemon, port) in daemons.items():
        assert daemon.process is not None
        host = pair.decode if role == "receiver" else pair.prefill
        status = scrape_in(pair, host, port)
        held = holdings(daemon.process.pid)
        own = {"rss MiB": held.rss_bytes / 2**20, "anon MiB": held.anon_bytes / 2**20,
               "fds": float(held.fds)}
        own["tasks"] = status.total("kvwire_event_loop_tasks")
        own["series"] = float(len(status.samples))
        figures |= {f"{role} {name}": value for name, value in own.items()}
    return figures


async def soak(count: int, checkpoints: int, kinds: list[str]) -> list[KindRun]:
    runs = []
    data = np.random.default_rng(7).integers(0, 256, PUSH_LAYOUT.total_bytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory(prefix="kvwire-soak-") as tmp, \
            two_hosts(Path(tmp), receiver={"handshake_timeout": HANDSHAKE_TIMEOUT},
                      tag=f"s{uuid.uuid4().hex[:6]}") as (pair, rx, tx):
        daemons = {"receiver": (rx, RECEIVER_METRICS_PORT), "sender": (tx, SENDER_METRICS_PORT)}
        prefill = await SenderClient.connect(tx.socket)
        decode = await ReceiverClient.connect(rx.socket)
        pushed = 0

        async def push(n: int) -> None:
            nonlocal pushed
            for _ in range(n):
                await push_one(prefill, "decode", f"soak-{pushed}", PUSH_LAYOUT, data,
                               receiver=decode)
                pushed += 1

        async def engines(n: int) -> None:
            for _ in range(n):
                client = await SenderClient.connect(tx.socket)
                await client.close()
                other = await ReceiverClient.connect(rx.socket)
                await other.close()

        def knocks(kind: str) -> Callable[[int], Awaitable[None]]:
            async def run(n: int) -> None:
                command = pair.argv(pair.prefill, [
                    sys.executable, "-c", KNOCKER, pair.decode.address,
                    str(DEFAULT_CONTROL_PORT), str(n), kind, str(tx.config["tls_dir"]),
                    str(IDLE_AT_ONCE)])
                done = await asyncio.to_thread(subprocess.run, command, capture_output=True,
                                               text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(f"{kind}: {done.stderr[-2000:]}")
            return run

        work = {"push": push, "engine": engines, "tls-good": knocks("tls-good"),
                "tls-refused": knocks("tls-refused"), "tls-idle": knocks("tls-idle")}
        try:
            for kind in kinds:
                run = KindRun(kind)
                started = time.monotonic()
                step = max(1, count // checkpoints)
                done = 0
                while done < count:
                    n = min(step, count - done)
                    await work[kind](n)
                    done += n
                    run.readings.append(Reading(done, await asyncio.to_thread(
                        read_daemons, pair, daemons)))
                    print(f"  {kind}: {done}/{count}", file=sys.stderr, flush=True)
                run.seconds = time.monotonic() - started
                runs.append(run)
        finally:
            await prefill.close()
            await decode.close()
    return runs


def growth_per_10k(run: KindRun, figure: str) -> float:
    """Over the second half of the readings: a cost that levels off gives ~0."""
    half = run.readings[len(run.readings) // 2 :]
    if len(half) < 2 or half[-1].done == half[0].done:
        half = run.readings
    first, last = half[0], half[-1]
    return (last.figures[figure] - first.figures[figure]) / (last.done - first.done) * 10_000


def report(runs: list[KindRun], count: int) -> str:
    lines = []
    for run in runs:
        rows = []
        for figure in run.readings[0].figures:
            values = [r.figures[figure] for r in run.readings]
            rows.append([figure, f"{values[0]:.1f}", f"{values[-1]:.1f}",
                         f"{min(values):.1f}-{max(values):.1f}",
                         f"{growth_per_10k(run, figure):+.2f}"])
        lines.append(f"\n{run.kind}: {count} in {run.seconds:.0f} s")
        lines.append(table.render(["figure", "after warm-up", "end", "range",
                                   "per 10,000 (second half)"], rows))
    return "\n".join(lines)


def to_json(runs: list[KindRun], count: int, checkpoints: int) -> dict[str, Any]:
    return {"experiment": "soak", "count": count, "checkpoints": checkpoints,
            "kinds": [{"kind": run.kind, "seconds": run.seconds,
                       "readings": [{"done": r.done, **r.figures} for r in run.readings],
                       "per_10k_second_half": {figure: growth_per_10k(run, figure)
                                               for figure in run.readings[0].figures}}
                      for run in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="operations of each kind")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"which work, in order, of {', '.join(KINDS)}")
    parser.add_argument("--out", type=Path, default=Path("results/soak.json"))
    args = parser.parse_args(argv)
    why_not = check_can_run()
    if why_not is not None:
        print(f"soak: {why_not}", file=sys.stderr)
        return 2
    if args.count < args.checkpoints or args.checkpoints < 2:
        parser.error("--count must be at least --checkpoints, and --checkpoints at least 2")
    kinds = args.kinds.split(",")
    if unknown := sorted(set(kinds) - set(KINDS)):
        parser.error(f"unknown kinds {', '.join(unknown)}: use {', '.join(KINDS)}")
    runs = asyncio.run(soak(args.count, args.checkpoints, kinds))
    print(report(runs, args.count))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(runs, args.count, args.checkpoints), indent=2) + "\n")
    print(f"\nfigures: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
