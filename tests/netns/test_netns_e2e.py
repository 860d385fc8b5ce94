"""End to end between two hosts: the daemons as separate processes in two
network namespaces joined by a veth pair, the engines' clients beside them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvctl.netns import DaemonProcess, NetnsPair, check_can_run, receiver_config, sender_config
from kvctl.push import push_one
from kvctl.source import synthetic
from kvwired import checksum
from kvwired.client import Delivered, ReceiverClient, SenderClient
from kvwired.errors import KvwireError, PeerLost, PoolFull, RequestTooLarge
from kvwired.layout import GRANULARITIES, KVLayout

_why_not = check_can_run()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why_not is not None, reason=_why_not or "")]

QWEN = KVLayout()


@pytest.fixture(scope="module")
def pair() -> Iterator[NetnsPair]:
    with NetnsPair(f"t{uuid.uuid4().hex[:6]}") as hosts:
        yield hosts


@pytest.fixture(scope="module")
def qwen_cache() -> np.ndarray:
    return synthetic(QWEN)


Start = Callable[..., tuple[DaemonProcess, DaemonProcess]]


@pytest.fixture
def start(pair: NetnsPair, tmp_path: Path) -> Iterator[Start]:
    started: list[DaemonProcess] = []

    def start_daemons(receiver: dict[str, Any] | None = None,
                      sender: dict[str, Any] | None = None) -> tuple[DaemonProcess, DaemonProcess]:
        rx = DaemonProcess(pair, pair.decode, "receiver",
                           receiver_config(pair, tmp_path, **(receiver or {})), tmp_path)
        tx = DaemonProcess(pair, pair.prefill, "sender",
                           sender_config(pair, tmp_path, **(sender or {})), tmp_path)
        started.extend([rx, tx])
        rx.start()
        tx.start()
        return rx, tx

    yield start_daemons
    for daemon in reversed(started):
        daemon.stop()


@pytest.fixture
async def clients(start: Start) -> AsyncIterator[tuple[SenderClient, ReceiverClient]]:
    rx, tx = start()
    prefill = await SenderClient.connect(tx.socket)
    decode = await ReceiverClient.connect(rx.socket)
    yield prefill, decode
    await prefill.close()
    await decode.close()


@pytest.mark.parametrize("granularity", GRANULARITIES)
async def test_48mib_cache_arrives_byte_exact_at_every_granularity(
    clients: tuple[SenderClient, ReceiverClient], qwen_cache: np.ndarray, granularity: str
) -> None:
    prefill, decode = clients
    record = await push_one(prefill, "decode", f"qwen-{granularity}", QWEN, qwen_cache,
                            chunk=granularity, receiver=decode)
    assert record.verified is True  # byte compare of the receive pool against the source
    assert record.checksum == checksum.of_buffer(qwen_cache.tobytes(), QWEN.shape())
    assert record.chunk_bytes == QWEN.granularity_bytes(granularity)
    expected_writes = {"per-token-per-layer": 98304, "per-token": 24 * 171, "per-layer": 24,
                       "whole": 1}
    assert record.writes == expected_writes[granularity]


async def test_layers_are_announced_in_order_and_read_in_place(
    clients: tuple[SenderClient, ReceiverClient], qwen_cache: np.ndarray
) -> None:
    prefill, decode = clients
    raw = qwen_cache.reshape(-1).view(np.uint8)
    decode.subscribe("in-place")
    push = await prefill.open("in-place", "decode", QWEN, chunk="per-token")
    seen: list[int] = []
    for n in range(QWEN.layers):
        offset, length = QWEN.shape().layer_span(n)
        push.layer(n)[:] = raw[offset : offset + length].data
        push.commit(n)
    await push.finish()
    delivered = None
    async for event in decode.events("in-place"):
        if isinstance(event, Delivered):
            delivered = event
        else:
            seen.append(event.layer)
    assert seen == list(range(QWEN.layers))
    assert delivered is not None
    view = decode.view(delivered)
    # K of layer 5, token 100, head 1, read straight out of the receive pool.
    at = QWEN.offset(5, 100, 0, 1)
    assert view[at : at + 128] == raw[at : at + 128].tobytes()
    view.release()
    await decode.release("in-place")


async def test_eight_concurrent_requests(start: Start) -> None:
    rx, tx = start(receiver={"pool_size": "512MiB"}, sender={"staging_size": "512MiB"})
    caches = [np.frombuffer(os.urandom(QWEN.total_bytes), np.uint8) for _ in range(8)]
    async with await SenderClient.connect(tx.socket) as prefill, \
            await ReceiverClient.connect(rx.socket) as decode:
        records = await asyncio.gather(*(
            push_one(prefill, "decode", f"concurrent-{n}", QWEN, cache,
                     chunk="per-token", receiver=decode)
            for n, cache in enumerate(caches)))
    assert [r.verified for r in records] == [True] * 8
    assert len({r.checksum for r in records}) == 8


async def test_request_larger_than_the_pool_is_refused_clearly(start: Start) -> None:
    _, tx = start(receiver={"pool_size": "64MiB"}, sender={"staging_size": "128MiB"})
    big = KVLayout(tokens=8192)  # 96 MiB
    async with await SenderClient.connect(tx.socket) as prefill:
        started = time.monotonic()
        with pytest.raises(RequestTooLarge, match="cannot fit the receive pool") as info:
            await prefill.open("too-big", "decode", big)
        assert time.monotonic() - started < 5  # refused at once, not after a wait
        assert "pool_size" in info.value.hint
        # The sender is still fine for requests that fit.
        data = os.urandom(1 << 20)
        result = await prefill.push_bytes("fits", "decode", data)
        assert result.checksum == checksum.of_buffer(data)


async def test_receiver_killed_mid_push_fails_fast_then_recovers(
    start: Start, qwen_cache: np.ndarray
) -> None:
    rx, tx = start()
    raw = qwen_cache.reshape(-1).view(np.uint8)
    async with await SenderClient.connect(tx.socket) as prefill:
        decode = await ReceiverClient.connect(rx.socket)
        decode.subscribe("doomed")
        push = await prefill.open("doomed", "decode", QWEN, chunk="per-token-per-layer")
        for n in range(6):
            offset, length = QWEN.shape().layer_span(n)
            push.layer(n)[:] = raw[offset : offset + length].data
            push.commit(n)
        async for _ in decode.events("doomed"):
            break  # layer 0 has landed: the transfer is under way
        await decode.close()
        assert rx.process is not None
        rx.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(KvwireError) as info:
            for n in range(6, QWEN.layers):
                push.commit(n)
            await asyncio.wait_for(push.finish(), 30)
        assert isinstance(info.value, PeerLost), info.value
        assert "receiver decode" in str(info.value)
        assert time.monotonic() - killed_at < 10
        rx.process.wait()

        rx.start()  # the same receiver, restarted
        record = await push_one(prefill, "decode", "after-restart", QWEN, qwen_cache,
                                chunk="per-layer")
        assert record.checksum == checksum.of_buffer(qwen_cache.tobytes(), QWEN.shape())
    assert tx.running


async def test_receiver_host_that_vanishes_silently_is_detected_by_heartbeat(
    start: Start, pair: NetnsPair, qwen_cache: np.ndarray
) -> None:
    # A host that loses its link sends no FIN: only missed heartbeats tell.
    rx, tx = start(receiver={"heartbeat": 0.5}, sender={"heartbeat": 0.5})
    raw = qwen_cache.reshape(-1).view(np.uint8)
    link = ["ip", "-n", pair.decode.netns, "link", "set", pair.decode.ifname]
    async with await SenderClient.connect(tx.socket) as prefill:
        push = await prefill.open("stranded", "decode", QWEN, chunk="per-layer")
        push.layer(0)[:] = raw[: QWEN.layer_bytes].data
        push.commit(0)
        subprocess.run([*link, "down"], check=True)
        try:
            vanished_at = time.monotonic()
            with pytest.raises(PeerLost, match="sent nothing for 2 s"):
                for n in range(1, QWEN.layers):
                    push.commit(n)
                await asyncio.wait_for(push.finish(), 30)
            assert time.monotonic() - vanished_at < 10
        finally:
            subprocess.run([*link, "up"], check=True)
        # The link is back: the next push reconnects and gets through.
        record = await push_one(prefill, "decode", "link-back", QWEN, qwen_cache,
                                chunk="per-layer")
        assert record.checksum == checksum.of_buffer(qwen_cache.tobytes(), QWEN.shape())
    assert rx.running and tx.running


async def test_consumer_that_never_releases_fills_the_pool_without_damage(
    start: Start,
) -> None:
    rx, tx = start(receiver={"pool_size": "100MiB", "lease_wait": 2.0})
    caches = [np.frombuffer(os.urandom(QWEN.total_bytes), np.uint8) for _ in range(3)]
    async with await SenderClient.connect(tx.socket) as prefill, \
            await ReceiverClient.connect(rx.socket) as hoarder:
        delivered = []
        for n in range(2):
            delivered.append(await _push_and_keep(prefill, hoarder, f"kept-{n}", caches[n]))
        started = time.monotonic()
        with pytest.raises(PoolFull, match="pool full") as info:
            await _push_and_keep(prefill, hoarder, "one-too-many", caches[2])
        waited = time.monotonic() - started
        assert 2.0 <= waited < 10  # it waited for room, then gave up with a reason
        assert "release" in info.value.hint
        for event, cache in zip(delivered, caches, strict=False):
            view = hoarder.view(event)
            assert view == cache.data  # nothing already delivered was overwritten
            view.release()
        await hoarder.release("kept-0")
        again = await _push_and_keep(prefill, hoarder, "after-release", caches[2])
        view = hoarder.view(again)
        assert view == caches[2].data
        view.release()


async def _push_and_keep(prefill: SenderClient, decode: ReceiverClient, req: str,
                         cache: np.ndarray) -> Delivered:
    decode.subscribe(req)
    push = await prefill.open(req, "decode", QWEN, chunk="per-layer")
    for n in range(QWEN.layers):
        offset, length = QWEN.shape().layer_span(n)
        push.layer(n)[:] = cache[offset : offset + length].data
        push.commit(n)
    await push.finish()
    return await decode.wait_delivered(req, timeout=10)


def test_kvctl_push_and_status_between_the_hosts(start: Start, pair: NetnsPair) -> None:
    rx, tx = start()
    result = subprocess.run(
        [sys.executable, "-m", "kvctl", "push", "--socket", tx.socket, "--peer", "decode",
         "--verify-socket", rx.socket, "--chunk", "per-token", "--chunk", "per-layer",
         "--count", "2", "--json"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["chunk_bytes"] for r in records] == [12288, 12288, 2 << 20, 2 << 20]
    assert all(r["verified"] and r["bytes"] == 48 << 20 and r["gbps"] > 0 for r in records)

    status = subprocess.run(
        pair.argv(pair.decode, [sys.executable, "-m", "kvctl", "status", "--json",
                                f"{pair.decode.address}:9471"]),
        capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stdout + status.stderr
    (receiver,) = json.loads(status.stdout)
    assert receiver["up"]
    assert receiver["row"]["delivered"] == "4"
    assert receiver["row"]["moved"] == "192 MiB"

    down = subprocess.run([sys.executable, "-m", "kvctl", "status", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "DOWN" in down.stdout


def _kvctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", *args]


def test_kvctl_consume_compares_every_byte_of_a_file_push(start: Start,
                                                          tmp_path: Path) -> None:
    rx, tx = start()
    cache = np.random.default_rng(7).standard_normal((6, 512, 128)).astype(np.float16)
    np.save(tmp_path / "kv.npy", cache)
    one_bit_off = cache.copy()
    one_bit_off.view(np.uint16)[5, 511, 127] ^= 1  # the very last byte differs
    np.save(tmp_path / "other.npy", one_bit_off)
    for req in ("file-a", "file-b"):
        pushed = subprocess.run(_kvctl("push", "--socket", tx.socket, "--file",
                                       str(tmp_path / "kv.npy"), "--req", req, "--chunk",
                                       "per-layer", "--json"),
                                capture_output=True, text=True, timeout=120)
        assert pushed.returncode == 0, pushed.stderr
        assert json.loads(pushed.stdout)["chunk_bytes"] == 512 * 128 * 2  # its own layers

    def consume(req: str, file: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_kvctl("consume", req, "--socket", rx.socket, "--file",
                                     str(tmp_path / file), "--json", "--timeout", "30"),
                              capture_output=True, text=True, timeout=60)

    same = consume("file-a", "kv.npy")
    assert same.returncode == 0, same.stderr
    record = json.loads(same.stdout)
    assert record["bytes_ok"] is True and record["checksum_ok"] is True
    assert record["bytes"] == cache.nbytes and record["layers"] == 6
    differs = consume("file-b", "other.npy")
    assert differs.returncode == 1
    assert json.loads(differs.stdout)["bytes_ok"] is False
    assert "file-b did not arrive intact" in differs.stderr


def test_kvctl_experiments_between_the_hosts(start: Start, pair: NetnsPair,
                                             tmp_path: Path) -> None:
    _, tx = start()
    out = tmp_path / "results"
    sweep = subprocess.run(
        _kvctl("run", "chunk-sweep", "--socket", tx.socket, "--sizes", "512,12KiB,2MiB",
               "--iters", "50", "--stream-bytes", "4MiB", "--out", str(out)),
        capture_output=True, text=True, timeout=180)
    assert sweep.returncode == 0, sweep.stderr
    assert "knee: " in sweep.stdout and "recommended streaming chunk" in sweep.stdout
    document = json.loads((out / "chunk-sweep.json").read_text())
    assert document["complete"] and [r["size"] for r in document["rows"]] == [512, 12288, 2 << 20]
    assert document["summary"]["transport"] == "tcp"

    overlap = subprocess.run(
        _kvctl("run", "overlap", "--socket", tx.socket, "--ratios", "0,1", "--layers", "6",
               "--repeats", "1", "--layer-compute", "1ms", "--out", str(out)),
        capture_output=True, text=True, timeout=180)
    assert overlap.returncode == 0, overlap.stderr
    assert "ridge point" in overlap.stdout and "this deployment" in overlap.stdout
    for png in ("chunk-sweep-latency.png", "chunk-sweep-bandwidth.png", "overlap-speedup.png",
                "overlap-bandwidth.png"):
        assert (out / png).stat().st_size > 10_000, png

    probe = subprocess.run(pair.argv(pair.prefill, _kvctl("probe", "--json")),
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert "memlock_bytes" in json.loads(probe.stdout)


def test_sweep_whose_receiver_is_killed_ends_with_an_error_and_partial_results(
        start: Start, tmp_path: Path) -> None:
    rx, tx = start()
    out = tmp_path / "partial"
    sweep = subprocess.Popen(
        _kvctl("run", "chunk-sweep", "--socket", tx.socket, "--sizes", "512,4KiB,1MiB",
               "--iters", "20000", "--stream-bytes", "4MiB", "--out", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert sweep.stderr is not None
    # Phase lines appear as phases end: once 512 B's delivery is done, its row is in.
    for line in sweep.stderr:
        if line.startswith("  deliver 48 MiB at 512 B"):
            break
    assert rx.process is not None
    rx.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    stdout, stderr = sweep.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert sweep.returncode == 2, stdout + stderr
    assert "kvctl run: error: " in stderr and "receiver decode" in stderr
    assert "INCOMPLETE" in stdout
    document = json.loads((out / "chunk-sweep.json").read_text())
    assert document["complete"] is False and document["error"]["code"]
    assert [r["size"] for r in document["rows"]] == [512]
    assert (out / "chunk-sweep-latency.png").stat().st_size > 10_000
    rx.process.wait()
