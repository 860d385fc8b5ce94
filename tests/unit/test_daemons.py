"""Both daemons in one event loop on loopback: the protocol's failure paths."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvctl.cli import main as kvctl_main
from kvctl.consume import consume
from kvwired import checksum
from kvwired.client import (
    PushOpened,
    ReceiverClient,
    SenderClient,
    SyncReceiverClient,
    SyncSenderClient,
)
from kvwired.errors import (
    DaemonUnavailable,
    DeadlineExceeded,
    DuplicateRequest,
    PeerLost,
    PoolFull,
    RequestAborted,
    UnknownPeer,
    UsageError,
)
from kvwired.layout import RequestShape
from kvwired.protocol import CONTROL, Error, FrameDecoder, Message, encode, message
from kvwired.protocol import control as ctl

from ..conftest import LocalDaemons, start_local, until


async def _control(local: LocalDaemons, name: str = "rogue"
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A sender of the cluster (authenticated) that then breaks the protocol."""
    return await local.control(name)


async def _read_control(reader: asyncio.StreamReader, decoder: FrameDecoder) -> Message:
    """The next control message the receiver sends (the test holds the decoder)."""
    while (msg := decoder.next_message()) is None:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, "the receiver hung up"
        decoder.feed(data)
    return msg


async def _expect_error_then_close(reader: asyncio.StreamReader,
                                   decoder: FrameDecoder | None = None) -> dict[str, str]:
    msg = await _read_control(reader, decoder or FrameDecoder(CONTROL))
    assert isinstance(msg, Error)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and the daemon hung up
    return dict(msg.error)


async def _push_ok(local: LocalDaemons, req: str, size: int = 1 << 20) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        data = os.urandom(size)
        result = await client.push_bytes(req, "decode", data, chunk=65536)
        assert result.checksum == checksum.of_buffer(data)
    async with await ReceiverClient.connect(local.receiver_socket) as consumer:
        await consumer.release(req)


@pytest.mark.parametrize(
    ("frame", "code", "reason"),
    [
        (struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", "protocol", "not valid msgpack"),
        (encode({"t": "hello", "v": 99, "role": "sender", "name": "rogue", "transports": ["tcp"]}),
         "version", "version 99"),
        (struct.pack(">I", 1 << 30), "frame_too_large", "limit"),
        (encode(message("lease", req="r", lease=1, offset=0, keys=[9])), "protocol", "hello"),
    ],
)
async def test_bad_control_frames_get_a_reason_and_others_are_still_served(
    local: LocalDaemons, frame: bytes, code: str, reason: str
) -> None:
    reader, writer = await _control(local)
    writer.write(frame)
    error = await _expect_error_then_close(reader)
    assert error["code"] == code
    assert reason in error["message"]
    writer.close()
    await _push_ok(local, "after-bad-frame")
    assert local.receiver.metrics.protocol_errors.labels("control")._value.get() >= 1


async def test_bad_frame_mid_session_closes_only_that_session(local: LocalDaemons) -> None:
    reader, writer = await _control(local)
    writer.write(encode(message("hello", role="sender", name="rogue", transports=["tcp"])))
    decoder = FrameDecoder(CONTROL)
    welcome = await _read_control(reader, decoder)
    assert welcome.kind == "welcome"
    writer.write(encode(message("connect", params={})))
    assert (await _read_control(reader, decoder)).kind == "ready"
    writer.write(encode(message("open", req="r", shape="not a dict")))
    error = await _expect_error_then_close(reader, decoder)
    assert "expected dict" in error["message"]
    await _push_ok(local, "after-rogue")


async def test_bad_engine_frame_is_answered_and_engine_cut_off(local: LocalDaemons) -> None:
    reader, writer = await asyncio.open_unix_connection(local.sender_socket)
    writer.write(struct.pack(">I", 3) + b"\x92\x01\x02")  # a msgpack list, not a map
    data = await asyncio.wait_for(reader.read(), 5)  # the answer, then the end of stream
    writer.close()
    body = msgpack.unpackb(data[4:])
    assert body["t"] == "error" and "not a map" in body["error"]["message"]
    await _push_ok(local, "after-bad-engine")


async def test_unknown_peer_names_the_known_ones(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        with pytest.raises(UnknownPeer, match="'elsewhere'") as info:
            await client.push_bytes("r", "elsewhere", b"x")
    assert "decode" in info.value.hint


async def test_unreachable_receiver_fails_fast_with_a_hint(tmp_path: Path) -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead_port = placeholder.getsockname()[1]
    daemons = await start_local(tmp_path, sender={"peers": {"decode": f"127.0.0.1:{dead_port}"}})
    try:
        async with await SenderClient.connect(daemons.sender_socket) as client:
            started = time.monotonic()
            with pytest.raises(PeerLost, match="cannot reach receiver decode") as info:
                await client.push_bytes("r", "decode", b"x" * 100)
            assert time.monotonic() - started < 5
            assert "running" in info.value.hint
        assert daemons.sender.staging is not None
        assert daemons.sender.staging.used_bytes == 0
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_a_decode_engine_waiting_for_a_refused_request_is_told_why(
        local: LocalDaemons) -> None:
    """The receiver refused it (pool full): the prefill engine and the decode
    engine subscribed to it both hear PoolFull, not just the prefill one."""
    async with await SenderClient.connect(local.sender_socket) as prefill, \
            await ReceiverClient.connect(local.receiver_socket) as decode:
        held = await prefill.push_bytes("holds-the-pool", "decode", bytes(48 << 20))
        decode.subscribe("holds-the-pool")
        decode.subscribe("no-room")
        with pytest.raises(PoolFull, match="receive pool full"):
            await prefill.push_bytes("no-room", "decode", bytes(32 << 20))
        with pytest.raises(PoolFull, match="receive pool full"):
            await decode.wait_delivered("no-room", timeout=5)
        # The request it holds is untouched by the refusal, and comes back.
        assert (await decode.wait_delivered("holds-the-pool", timeout=5)).checksum == \
            held.checksum
        await decode.release("holds-the-pool")
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)


async def test_a_decode_engine_that_asks_after_the_refusal_is_told_at_once(
        local: LocalDaemons) -> None:
    """Disaggregated serving's order: the decode engine hears of a request only
    after the prefill side answered, when its push may already be refused. It
    learns why at once, not at its own timeout; the id opened again later is
    a fresh request."""
    async with await SenderClient.connect(local.sender_socket) as prefill, \
            await ReceiverClient.connect(local.receiver_socket) as decode:
        held = await prefill.push_bytes("fills-the-pool", "decode", bytes(48 << 20))
        with pytest.raises(PoolFull):
            await prefill.push_bytes("late", "decode", bytes(32 << 20))
        started = time.monotonic()
        with pytest.raises(PoolFull, match="receive pool full"):
            await decode.wait_delivered("late", timeout=30)
        assert time.monotonic() - started < 5
        decode.subscribe("fills-the-pool")
        assert (await decode.wait_delivered("fills-the-pool", timeout=5)).checksum == \
            held.checksum
        await decode.release("fills-the-pool")
        again = await prefill.push_bytes("late", "decode", bytes(1 << 20))
        assert (await decode.wait_delivered("late", timeout=5)).checksum == again.checksum
        await decode.release("late")


async def test_deadline_aborts_and_frees_both_pools(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        push = await client.open("slow", "decode", RequestShape(4, 1 << 20), deadline=0.3)
        push.commit(0)  # ... and never the rest
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(push._result, 5)
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)
    assert local.sender.staging is not None and local.sender.staging.used_bytes == 0


async def test_lease_granted_after_the_sender_gave_up_is_returned(
    local: LocalDaemons,
) -> None:
    async with await SenderClient.connect(local.sender_socket) as client, \
            await ReceiverClient.connect(local.receiver_socket) as consumer:
        await client.push_bytes("hog", "decode", b"h" * (40 << 20))
        opening = asyncio.create_task(
            client.open("late", "decode", RequestShape(30, 1 << 20), deadline=0.2))
        with pytest.raises(DeadlineExceeded):
            await opening
        # Room appears while the receiver still holds the abandoned open
        # (lease_wait 0.5 s): the lease it grants must come straight back.
        await consumer.release("hog")
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)
    assert not local.receiver.by_req


async def test_engine_abort_and_disconnect_free_the_receiver_slot(local: LocalDaemons) -> None:
    client = await SenderClient.connect(local.sender_socket)
    push = await client.open("a", "decode", RequestShape(2, 1 << 20))
    push.commit(0)
    push.abort()
    with pytest.raises(RequestAborted, match="aborted"):
        await asyncio.wait_for(push._result, 5)
    await client.open("b", "decode", RequestShape(2, 1 << 20))
    await client.close()  # the engine goes away mid-request
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)
    await _push_ok(local, "after-aborts")


async def test_release_before_delivery_aborts_the_push_with_the_reason(
    local: LocalDaemons,
) -> None:
    async with await SenderClient.connect(local.sender_socket) as client, \
            await ReceiverClient.connect(local.receiver_socket) as consumer:
        push = await client.open("early", "decode", RequestShape(3, 1 << 20))
        push.commit(0)
        async for event in consumer.events("early"):
            assert event.layer == 0  # type: ignore[union-attr]
            break
        await consumer.release("early")
        with pytest.raises(RequestAborted, match="released request early before"):
            await asyncio.wait_for(push._result, 5)
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)


async def test_full_staging_pool_waits_then_says_so_at_both_ends(tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, sender={"staging_size": "8MiB", "staging_wait": 0.3})
    try:
        async with await SenderClient.connect(daemons.sender_socket) as client, \
                await ReceiverClient.connect(daemons.receiver_socket) as decode:
            held = await client.open("held", "decode", RequestShape(6, 1 << 20))
            decode.subscribe("blocked")
            with pytest.raises(PoolFull, match="staging pool full") as info:
                await client.open("blocked", "decode", RequestShape(6, 1 << 20))
            assert "staging_size" in info.value.hint
            # The receiver never leased it, yet the decode engine waiting for it
            # hears the same error at once (withdrawn), not at its own timeout.
            with pytest.raises(PoolFull, match="staging pool full"):
                await decode.wait_delivered("blocked", timeout=5)
            held.abort()
            with pytest.raises(RequestAborted):
                await asyncio.wait_for(held._result, 5)
            await client.push_bytes("fits-again", "decode", b"z" * (6 << 20))
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_duplicate_request_ids_are_refused(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        await client.push_bytes("same", "decode", b"1" * 4096)
        with pytest.raises(DuplicateRequest, match="already held"):
            await client.push_bytes("same", "decode", b"2" * 4096)


async def test_api_misuse_is_explained(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        push = await client.open("m", "decode", RequestShape(2, 4096))
        with pytest.raises(UsageError, match="layer 0 is next"):
            push.commit(1)
        with pytest.raises(UsageError, match="before every layer"):
            await push.finish()
        push.abort()
    async with await ReceiverClient.connect(local.receiver_socket) as consumer:
        with pytest.raises(UsageError, match="not held"):
            await consumer.release("never-pushed")


async def test_missing_daemon_is_explained(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="is the daemon running"):
        await SenderClient.connect(str(tmp_path / "nothing.sock"))


async def test_sync_wrappers(local: LocalDaemons) -> None:
    def engine_and_consumer() -> bytes:
        prefill = SyncSenderClient(local.sender_socket)
        decode = SyncReceiverClient(local.receiver_socket)
        try:
            push = prefill.open("sync", "decode", RequestShape(2, 8192), chunk=4096)
            for n in range(2):
                push.layer(n)[:] = bytes([n + 1]) * 8192
                push.commit(n)
            result = push.finish()
            delivered = decode.wait_delivered("sync", timeout=5)
            assert delivered.checksum == result.checksum
            data = bytes(decode.view(delivered))
            decode.release("sync")
            return data
        finally:
            prefill.close()
            decode.close()

    data = await asyncio.to_thread(engine_and_consumer)
    assert data == b"\x01" * 8192 + b"\x02" * 8192


async def test_sync_clients_do_what_the_async_ones_do(local: LocalDaemons) -> None:
    """Events, subscribe, peers, discard, wait_sent, context managers."""
    def scenario() -> list[str]:
        with SyncSenderClient(local.sender_socket) as prefill, \
                SyncReceiverClient(local.receiver_socket) as decode:
            assert prefill.peers == ["decode"]
            decode.subscribe("evented")
            push = prefill.open("evented", "decode", RequestShape(2, 4096), chunk=4096)
            for n in range(2):
                push.layer(n)[:] = b"e" * 4096
                push.commit(n)
                push.wait_sent(n)
            push.finish()
            seen = [type(event).__name__ for event in decode.events("evented")]
            decode.release("evented")
            dropped = prefill.open("dropped", "decode", RequestShape(1, 4096), discard=True)
            dropped.layer(0)[:] = b"d" * 4096
            dropped.commit(0)
            dropped.finish()
            return seen

    assert await asyncio.to_thread(scenario) == ["LayerLanded", "LayerLanded", "Delivered"]
    await until(lambda: local.receiver.pool.used_bytes == 0)  # the discarded one too


async def test_metrics_agree_on_both_ends(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        await client.push_bytes("counted", "decode", os.urandom(3 << 20), chunk=65536)

    def value(daemon: LocalDaemons, side: str, name: str, *labels: str) -> float:
        metrics = getattr(daemon, side).metrics
        names = {"kvwire_data_writes_total": ["peer", "direction", "opcode"],
                 "kvwire_data_bytes_total": ["peer", "direction"]}.get(name, ["peer", "outcome"])
        return float(metrics.registry.get_sample_value(name, dict(zip(
            names, labels, strict=True))) or 0)

    # 48 writes of 64 KiB, the last with the immediate; over TCP the receiver sees all.
    for side, peer, direction in (("sender", "decode", "sent"),
                                  ("receiver", "prefill", "received")):
        assert value(local, side, "kvwire_data_writes_total", peer, direction, "write") == 47
        assert value(local, side, "kvwire_data_writes_total", peer, direction,
                     "write_imm") == 1
    assert value(local, "sender", "kvwire_data_bytes_total", "decode", "sent") == 3 << 20
    assert value(local, "receiver", "kvwire_data_bytes_total", "prefill", "received") == 3 << 20
    assert value(local, "sender", "kvwire_requests_total", "decode", "delivered") == 1
    assert value(local, "receiver", "kvwire_requests_total", "prefill", "delivered") == 1
    registry = local.receiver.metrics.registry
    assert registry.get_sample_value("kvwire_request_duration_seconds_count",
                                     {"peer": "prefill"}) == 1
    assert registry.get_sample_value("kvwire_pool_bytes",
                                     {"pool": "receive", "state": "used"}) == 3 << 20
    assert registry.get_sample_value("kvwire_peers_connected") == 1
    assert registry.get_sample_value("kvwire_peer_up", {"peer": "prefill"}) == 1
    assert registry.get_sample_value("kvwire_leases", {"state": "held"}) == 1
    assert registry.get_sample_value("kvwire_leases", {"state": "filling"}) == 0
    assert registry.get_sample_value("kvwire_receives_posted", {"peer": "prefill"}) == 0
    assert registry.get_sample_value("process_start_time_seconds") is not None
    for daemon in (local.receiver, local.sender):  # both share this test's loop
        tasks = daemon.metrics.registry.get_sample_value("kvwire_event_loop_tasks")
        assert tasks is not None and tasks >= 1

    sender = local.sender.metrics.registry
    at_decode = {"peer": "decode"}
    assert sender.get_sample_value("kvwire_write_size_bytes_count", at_decode) == 48
    assert sender.get_sample_value("kvwire_write_size_bytes_sum", at_decode) == 3 << 20
    assert sender.get_sample_value("kvwire_write_size_bytes_bucket",
                                   {**at_decode, "le": "12288.0"}) == 0
    assert sender.get_sample_value("kvwire_write_size_bytes_bucket",
                                   {**at_decode, "le": "65536.0"}) == 48
    assert sender.get_sample_value("kvwire_request_post_seconds_count", at_decode) == 1
    assert sender.get_sample_value("kvwire_request_wait_seconds_count", at_decode) == 1
    assert sender.get_sample_value("kvwire_peer_up", at_decode) == 1
    assert sender.get_sample_value("kvwire_credits", at_decode) == 64
    assert sender.get_sample_value("kvwire_writes_in_flight", at_decode) == 0
    assert sender.get_sample_value("kvwire_reconnects_total", at_decode) == 0  # first connect
    assert sender.get_sample_value("kvwire_completion_errors_total",
                                   {**at_decode, "status": "retry_exceeded"}) == 0


async def test_receiver_that_never_confirms_fails_the_push_not_hangs(tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, sender={"delivery_timeout": 0.5})

    async def lost_track(lease: object) -> None:
        return None  # every byte landed, but no "delivered" ever goes out

    daemons.receiver.landing.complete = lost_track  # type: ignore[method-assign]
    try:
        async with await SenderClient.connect(daemons.sender_socket) as client:
            with pytest.raises(PeerLost, match=r"did not confirm delivery within 0\.5 s"):
                await asyncio.wait_for(client.push_bytes("silent", "decode", b"q" * 8192), 10)
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_a_receiver_silent_on_our_abort_loses_its_link_not_our_next_push(
        tmp_path: Path) -> None:
    # A receiver that neither confirms a push nor answers its abort has
    # stopped following the protocol: the push fails, the link is dropped
    # (which voids the lease on the receiver's side), and the next push
    # reconnects and is delivered.
    daemons = await start_local(tmp_path, sender={"delivery_timeout": 0.5})
    receiver = daemons.receiver
    complete = receiver.landing.complete

    async def lost_track(lease: object) -> None:
        return None

    receiver.landing.complete = lost_track  # type: ignore[method-assign]
    receiver._handlers.on(ctl.Abort, lambda session, msg: None)
    registry = daemons.sender.metrics.registry
    try:
        async with await SenderClient.connect(daemons.sender_socket) as client:
            with pytest.raises(PeerLost, match=r"did not confirm delivery within 0\.5 s"):
                await asyncio.wait_for(client.push_bytes("silent", "decode", b"q" * 8192), 10)
            await until(lambda: receiver.pool.used_bytes == 0, what="the lease voided")
            receiver.landing.complete = complete  # type: ignore[method-assign]
            await asyncio.wait_for(client.push_bytes("next", "decode", b"n" * 8192), 10)
        assert registry.get_sample_value("kvwire_reconnects_total", {"peer": "decode"}) == 1
    finally:
        await daemons.sender.stop()
        await receiver.stop()


async def test_a_receiver_gone_counts_one_data_path_failure_whichever_end_is_seen_first(
        local: LocalDaemons) -> None:
    # The receiver ends the session: its control connection and data
    # connection close together. The sender counts the data path as failed
    # once, whether the loop saw the data socket's end first or the control's.
    link = local.sender.links["decode"]
    await until(lambda: link.connected, what="connected")
    lost = local.sender.metrics.completion_errors.labels("decode", "connection_lost")
    before = lost._value.get()
    (session,) = local.receiver.sessions
    session.conn.close()
    await until(lambda: lost._value.get() > before, what="the failure counted")
    await until(lambda: link.connected and len(local.receiver.sessions) == 1,
                what="reconnected")
    assert lost._value.get() == before + 1


async def test_consume_keep_leaves_the_request_for_the_next_decode_engine(
        local: LocalDaemons) -> None:
    """``kvctl consume --keep`` checks a request and leaves it: its engine going
    away used to reclaim it at once (engine_gone), keeping nothing."""
    data = os.urandom(3 << 20)
    async with await SenderClient.connect(local.sender_socket) as prefill:
        sent = await prefill.push_bytes("kept", "decode", data)
    records = await consume(local.receiver_socket, ["kept"], None, 10, keep=True)
    assert records[0].checksum_ok
    assert local.receiver.metrics.reclaimed.labels("engine_gone")._value.get() == 0
    async with await ReceiverClient.connect(local.receiver_socket) as decode:
        delivered = await decode.wait_delivered("kept", timeout=5)
        assert delivered.checksum == sent.checksum
        await decode.release("kept")
    await until(lambda: local.receiver.pool is not None and local.receiver.pool.used_bytes == 0)


async def test_an_engine_that_unsubscribes_without_release_leaves_it_unclaimed(
        tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, receiver={"unclaimed_ttl": 0.5})
    try:
        async with await SenderClient.connect(daemons.sender_socket) as prefill, \
                await ReceiverClient.connect(daemons.receiver_socket) as decode:
            decode.subscribe("let-go")
            await prefill.push_bytes("let-go", "decode", b"k" * 4096)
            await decode.wait_delivered("let-go", timeout=5)
            await decode.unsubscribe("let-go")
        # Nobody came for it within unclaimed_ttl: reclaimed as unclaimed.
        await until(lambda: daemons.receiver.pool.used_bytes == 0)
        assert daemons.receiver.metrics.reclaimed.labels("unclaimed")._value.get() == 1
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


def test_kvctl_push_of_a_file_names_the_chunks_it_can_take(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """It used to tell a command-line user to "open with a KVLayout"."""
    cache = tmp_path / "cache.npy"
    np.save(cache, np.zeros((4, 1024), dtype=np.float16))
    code = kvctl_main(["push", "--file", str(cache), "--chunk", "per-token",
                       "--socket", str(tmp_path / "no-daemon.sock")])
    err = capsys.readouterr().err
    assert code == 2  # kvctl's exit status for an error it explains
    assert "--chunk per-token needs the cache's tokens" in err and "--file" in err
    assert "--chunk per-layer or whole" in err and "KVLayout" not in err


async def test_an_engine_that_subscribes_and_lets_go_again_restarts_the_unclaimed_wait(
        local: LocalDaemons) -> None:
    """Each time a request becomes unclaimed it gets a whole unclaimed_ttl: the
    wait started when the first engine let go no longer counts."""
    async with await SenderClient.connect(local.sender_socket) as prefill:
        await prefill.push_bytes("passed-on", "decode", b"p" * 4096)
    waits = []
    for _ in range(2):
        async with await ReceiverClient.connect(local.receiver_socket) as decode:
            await decode.wait_delivered("passed-on", timeout=5)
            await decode.unsubscribe("passed-on")
        timer = local.receiver.by_req["passed-on"].unclaimed_timer
        assert timer is not None
        waits.append(timer)
    assert waits[0].cancelled() and not waits[1].cancelled()
    async with await ReceiverClient.connect(local.receiver_socket) as decode:
        await decode.wait_delivered("passed-on", timeout=5)
        await decode.release("passed-on")
    assert waits[1].cancelled()  # freed: nothing is left to reclaim


async def test_a_sender_gone_while_its_open_waits_for_room_leaves_nothing_running(
        tmp_path: Path) -> None:
    """The open waits for pool room (lease_wait 30 s); the sender leaves. The
    session's task ends with it, now, and its quota and the pool are whole."""
    local = await start_local(tmp_path, receiver={"lease_wait": 30.0})
    try:
        reader, writer = await _control(local)
        writer.write(encode(message("hello", role="sender", name="rogue", transports=["tcp"])))
        decoder = FrameDecoder(CONTROL)
        assert (await _read_control(reader, decoder)).kind == "welcome"
        writer.write(encode(message("connect", params={})))
        assert (await _read_control(reader, decoder)).kind == "ready"
        (session,) = [s for s in local.receiver.sessions if s.name == "rogue"]
        pool = local.receiver.pool.size
        writer.write(encode(message("open", req="hog", shape={"layers": 1,
                                                               "layer_bytes": pool})))
        writer.write(encode(message("open", req="waits", shape={"layers": 1,
                                                                 "layer_bytes": 4096})))
        await until(lambda: "hog" in local.receiver.by_req and len(session.tasks) == 1,
                    what="the second open waiting for room")
        writer.close()
        await until(lambda: not session.alive and len(session.tasks) == 0,
                    what="the session and its waiting open ended")
        await until(lambda: local.receiver.pool.used_bytes == 0
                    and not local.receiver.quotas.held.get("rogue"),
                    what="the pool and the quota whole")
        assert not local.receiver.by_req
    finally:
        await local.sender.stop()
        await local.receiver.stop()


async def test_a_push_read_by_two_engines_is_freed_by_the_second_release_only(
        local: LocalDaemons) -> None:
    """The ranks of a parallel decode engine share one push (an MLA cache, a
    head two ranks hold): the first to release lets go, the last one frees."""
    async with await SenderClient.connect(local.sender_socket) as prefill, \
            await ReceiverClient.connect(local.receiver_socket) as rank0, \
            await ReceiverClient.connect(local.receiver_socket) as rank1:
        rank0.subscribe("shared", readers=2)
        await prefill.push_bytes("shared", "decode", b"s" * 8192)
        first = await rank0.wait_delivered("shared", timeout=5)
        await rank0.release("shared")
        assert local.receiver.pool.used_bytes > 0  # rank 1 has not read it yet
        # Rank 1 comes late, after rank 0 let go: the bytes are still there.
        rank1.subscribe("shared", readers=2)
        second = await rank1.wait_delivered("shared", timeout=5)
        assert bytes(rank1.view(second)) == b"s" * 8192 and second.offset == first.offset
        await rank1.release("shared")
    await until(lambda: local.receiver.pool.used_bytes == 0)


async def test_the_prefill_engines_note_reaches_every_decode_engine_before_a_layer(
        local: LocalDaemons) -> None:
    """What a prefill engine says with its open (its KV layout) comes first in a
    subscription, before any layer lands: to an engine that subscribed before
    the push opened and to one that came after it was delivered; an engine
    that did not ask for it sees the events it always did."""
    note = {"attention": "mha", "dtype": "float32", "block_size": 128, "tp": 2}
    async with await SenderClient.connect(local.sender_socket) as prefill, \
            await ReceiverClient.connect(local.receiver_socket) as early, \
            await ReceiverClient.connect(local.receiver_socket) as late:
        early.subscribe("noted", readers=2)
        push = await prefill.open("noted", "decode", RequestShape(2, 4096), note=note)
        events = early.events("noted", readers=2, opened=True)
        assert await anext(events) == PushOpened("noted", note)
        for layer in range(2):
            push.layer(layer)[:] = bytes([layer]) * 4096
            push.commit(layer)
        await push.finish()
        kinds = [type(event).__name__ async for event in events]
        assert kinds[-1] == "Delivered" and "PushOpened" not in kinds
        seen = [event async for event in late.events("noted", readers=2, opened=True)]
        assert seen[0] == PushOpened("noted", note)
        assert [type(e).__name__ for e in seen[1:]] == ["LayerLanded", "LayerLanded",
                                                        "Delivered"]
        await early.release("noted")
        await late.release("noted")
        # Without a note, or without asking: no PushOpened in the way.
        await prefill.push_bytes("plain", "decode", b"p" * 4096)
        assert [type(e).__name__ async for e in early.events("plain")] == ["LayerLanded",
                                                                          "Delivered"]
        await early.release("plain")
    await until(lambda: local.receiver.pool.used_bytes == 0)


@pytest.mark.parametrize(("note", "wrong"), [
    ({"layout": {"dtype": "float16"}}, "is dict, not a string"),
    ({f"k{n}": n for n in range(40)}, "40 entries"),
    ({"k": "x" * 300}, "300 characters"),
    ("dtype=float16", "not a mapping"),
])
async def test_a_note_the_daemons_would_refuse_is_refused_by_the_client_saying_what_fits(
        local: LocalDaemons, note: object, wrong: str) -> None:
    async with await SenderClient.connect(local.sender_socket) as prefill:
        with pytest.raises(UsageError, match=wrong) as refused:
            await prefill.open("bad-note", "decode", RequestShape(1, 4096),
                               note=note)  # type: ignore[arg-type]
        assert "flat map of at most 32" in refused.value.hint
        # Nothing was opened: the id is free.
        await prefill.push_bytes("bad-note", "decode", b"n" * 4096)


async def test_a_shared_push_whose_second_reader_never_comes_is_reclaimed(
        tmp_path: Path) -> None:
    daemons = await start_local(tmp_path, receiver={"unclaimed_ttl": 0.5})
    try:
        async with await SenderClient.connect(daemons.sender_socket) as prefill, \
                await ReceiverClient.connect(daemons.receiver_socket) as rank0:
            rank0.subscribe("half-read", readers=2)
            await prefill.push_bytes("half-read", "decode", b"h" * 4096)
            await rank0.wait_delivered("half-read", timeout=5)
            await rank0.release("half-read")
        await until(lambda: daemons.receiver.pool.used_bytes == 0)
        assert daemons.receiver.metrics.reclaimed.labels("unclaimed")._value.get() == 1
    finally:
        await daemons.sender.stop()
        await daemons.receiver.stop()


async def test_one_reader_of_a_shared_push_giving_up_before_delivery_aborts_it_for_all(
        local: LocalDaemons) -> None:
    """No rank decodes on a push another rank gave up: the request ends for both."""
    async with await ReceiverClient.connect(local.receiver_socket) as rank0, \
            await ReceiverClient.connect(local.receiver_socket) as rank1, \
            await SenderClient.connect(local.sender_socket) as prefill:
        rank0.subscribe("given-up", readers=2)
        rank1.subscribe("given-up", readers=2)
        push = await prefill.open("given-up", "decode", RequestShape(2, 4096))
        await until(lambda: "given-up" in local.receiver.by_req)
        await rank0.release("given-up")
        with pytest.raises(RequestAborted, match="released request given-up before"):
            await rank1.wait_delivered("given-up", timeout=5)
        with pytest.raises(RequestAborted, match="released request given-up before"):
            await asyncio.wait_for(push._result, 5)
    await until(lambda: local.receiver.pool.used_bytes == 0)


def _descriptors_of(inodes: set[int]) -> list[int]:
    """The inode behind each of this process's descriptors that is one of ``inodes``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            inode = os.stat(f"/proc/self/fd/{fd}").st_ino
        except OSError:
            continue  # the listing's own descriptor, closed meanwhile
        if inode in inodes:
            found.append(inode)
    return sorted(found)


async def test_daemons_stopped_in_process_give_their_pools_back(tmp_path: Path) -> None:
    # Each stop used to leave its pool's memfd open: 128 MiB per pair of
    # daemons, never freed while the process lived (a test run grew by
    # gigabytes). A view still held past the stop keeps only the mapping.
    local = await start_local(tmp_path)
    stopped: list[str] = []
    for daemon in (local.sender, local.receiver):
        daemon.transport.stop = _noting(daemon.transport.stop, daemon.role,  # type: ignore[method-assign]
                                        stopped)
    receive = os.fstat(local.receiver.pool.memory.fd).st_ino
    staging = os.fstat(local.sender.staging.memory.fd).st_ino
    async with await SenderClient.connect(local.sender_socket) as engine:
        await engine.push_bytes("r", "decode", b"x" * 4096)
    held = local.receiver.pool.memory.view[0:16]
    # Each pool: the daemon's descriptor and its mapping's own (mmap dups it).
    assert _descriptors_of({receive, staging}) == sorted(2 * [receive, staging])
    await local.sender.stop()
    await local.receiver.stop()
    assert _descriptors_of({receive, staging}) == [receive]
    assert stopped == ["sender", "receiver"]  # each closed its devices (verbs: the MRs)
    assert bytes(held) == b"x" * 16  # the mapping outlives the stop while viewed
    held.release()
    local.receiver.pool.close()  # again: now the mapping goes too
    assert _descriptors_of({receive, staging}) == []


def _noting(stop: Callable[[], Coroutine[Any, Any, None]], role: str,
            stopped: list[str]) -> Callable[[], Coroutine[Any, Any, None]]:
    """``stop`` itself, that also notes ``role`` in ``stopped`` when called."""
    async def noted() -> None:
        stopped.append(role)
        await stop()
    return noted
