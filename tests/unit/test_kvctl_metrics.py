"""``kvctl metrics``: quantiles from buckets by hand, and live figures from both
daemons while they push."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvctl import metrics
from kvwired.client import SenderClient
from kvwired.layout import RequestShape

from ..conftest import LocalDaemons, start_local, until


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    # 10 requests: 2 under 1 ms, 8 more under 10 ms, none above.
    buckets = [(0.001, 2.0), (0.01, 10.0), (0.1, 10.0), (math.inf, 10.0)]
    assert metrics.bucket_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * 3 / 8)
    assert metrics.bucket_quantile(0.1, buckets) == pytest.approx(0.0005)  # 1 of 2 in [0, 1 ms]
    assert metrics.bucket_quantile(0.99, buckets) == pytest.approx(0.001 + 0.009 * 7.9 / 8)
    # Everything in the +Inf bucket: the largest finite bound is the answer.
    assert metrics.bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 4.0)]) == 1.0
    assert metrics.bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert metrics.bucket_quantile(0.5, []) is None


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def scraped(tmp_path: Path) -> AsyncIterator[tuple[LocalDaemons, list[str]]]:
    ports = [_port(), _port()]
    daemons = await start_local(tmp_path, receiver={"metrics": f"127.0.0.1:{ports[0]}"},
                                sender={"metrics": f"127.0.0.1:{ports[1]}"})
    yield daemons, [f"127.0.0.1:{port}" for port in ports]
    await daemons.sender.stop()
    await daemons.receiver.stop()


async def _keep_pushing(socket_path: str, stop: asyncio.Event,
                        done: list[int] | None = None) -> int:
    pushed = 0
    done = [] if done is None else done
    async with await SenderClient.connect(socket_path) as client:
        payload = os.urandom(1 << 20)
        while not stop.is_set():
            # Nobody consumes these: the receiver discards each once delivered.
            push = await client.open(f"m-{pushed}", "decode", RequestShape(1, 1 << 20),
                                     chunk=65536, discard=True)
            push.layer(0)[:] = payload
            push.commit(0)
            await push.finish()
            pushed += 1
            done.append(pushed)
    return pushed


async def test_metrics_show_rates_latency_and_credits_per_peer(
        scraped: tuple[LocalDaemons, list[str]]) -> None:
    daemons, urls = scraped
    stop = asyncio.Event()
    done: list[int] = []
    pushing = asyncio.create_task(_keep_pushing(daemons.sender_socket, stop, done))
    await until(lambda: len(done) >= 2, what="pushes flowing")
    statuses, _, rows = await asyncio.to_thread(metrics.collect, urls, 0.5)
    stop.set()
    assert await pushing > 0
    by_daemon = {row.daemon.split()[0]: row for row in rows}
    sender, receiver = by_daemon["sender"], by_daemon["receiver"]
    assert sender.peer == "decode" and receiver.peer == "prefill"
    assert sender.up is True and receiver.up is True
    assert sender.gbps > 0 and sender.writes_per_s > 0 and sender.requests_per_s > 0
    assert receiver.gbps > 0
    assert sender.p50_s is not None and 0 < sender.p50_s <= (sender.p99_s or 0)
    assert sender.credits is not None and sender.in_flight is not None
    assert sender.errors == 0 and sender.failed == 0
    assert "of 64 MiB" in sender.pool
    assert all(status.up for status in statuses)
    text = metrics.render(rows)
    assert "Gb/s" in text and "decode" in text


async def test_kvctl_metrics_once_and_watching(scraped: tuple[LocalDaemons, list[str]]) -> None:
    _, urls = scraped
    once = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvctl", "metrics", *urls, "--interval", "0.2", "--json",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await once.communicate()
    assert once.returncode == 0, err
    rows = json.loads(out)
    assert {row["peer"] for row in rows} == {"decode", "prefill"}

    down = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvctl", "metrics", "127.0.0.1:1", "--interval", "0.1",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, _ = await down.communicate()
    assert down.returncode == 1 and b"DOWN" in out

    # Started as a background job starts it: SIGINT ignored. kvctl restores
    # Ctrl-C for itself, so the SIGINT below still stops it.
    watching = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvctl", "metrics", *urls, "--watch", "--interval", "0.3",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert watching.stdout is not None
        seen = b""
        async with asyncio.timeout(30):  # a frame with both daemons in it
            while not all(word in seen for word in (b"kvwire, every 0.3 s", b"decode",
                                                     b"prefill")):
                chunk = await watching.stdout.read(65536)
                assert chunk, seen
                seen += chunk
        watching.send_signal(signal.SIGINT)
        await asyncio.wait_for(watching.communicate(), 10)
        assert watching.returncode is not None
    finally:
        if watching.returncode is None:  # never left behind, whatever failed
            watching.kill()
            await watching.wait()
