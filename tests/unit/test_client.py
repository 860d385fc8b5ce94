"""The client library's routing of daemon messages, in every order, without a daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvwired import localsock
from kvwired.client import SenderClient
from kvwired.errors import DaemonUnavailable, DeadlineExceeded, UsageError
from kvwired.layout import RequestShape
from kvwired.protocol import SENDER_LOCAL, Failed, Message
from kvwired.protocol import sender_local as prefill_api
from kvwired.slot_maps import SlotMaps

from ..conftest import LocalDaemons


def _client() -> tuple[SenderClient, list[Message]]:
    """A client whose connection is a list of what it sent, over 1 MiB of memory."""
    client = SenderClient("/nonexistent.sock")
    sent: list[Message] = []
    client.conn.fd = os.memfd_create("staging")
    os.ftruncate(client.conn.fd, 1 << 20)
    client.conn.slot_maps = SlotMaps(client.conn.fd)
    client.conn.send = sent.append  # type: ignore[method-assign,assignment]
    return client, sent


async def _opening(client: SenderClient, **kwargs: Any) -> asyncio.Task[Any]:
    task = asyncio.create_task(client.open("r", "decode", RequestShape(2, 4096), **kwargs))
    await asyncio.sleep(0)  # the open is sent
    return task


async def test_a_failure_right_behind_opened_reaches_finish() -> None:
    client, _ = _client()
    opening = await _opening(client, deadline=0.001)
    # Both arrive in one read, before open() resumes.
    client._route(prefill_api.Opened(req="r", peer="decode", offset=0, chunk_bytes=4096,
                                    lease=1))
    client._route(Failed(req="r", error=DeadlineExceeded("late").to_wire()))
    push = await opening
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(push.finish(), 1)
    with pytest.raises(DeadlineExceeded):
        push.commit(0)
    # An engine still filling layers hears the failure, not a released buffer.
    with pytest.raises(DeadlineExceeded):
        push.layer(1)


async def test_opened_after_the_caller_gave_up_is_aborted() -> None:
    client, sent = _client()
    opening = await _opening(client)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    client._route(prefill_api.Opened(req="r", peer="decode", offset=0, chunk_bytes=4096,
                                    lease=1))
    assert sent[-1] == prefill_api.Abort(req="r")
    assert not client._pushes


async def test_opened_in_the_turn_the_caller_gives_up_is_aborted() -> None:
    client, sent = _client()
    opening = await _opening(client)
    client._route(prefill_api.Opened(req="r", peer="decode", offset=0, chunk_bytes=4096,
                                    lease=1))
    opening.cancel()  # the answer is there, but the caller never sees it
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert sent[-1] == prefill_api.Abort(req="r")


async def test_failed_before_opened_fails_open() -> None:
    client, _ = _client()
    opening = await _opening(client)
    client._route(Failed(req="r", error=DeadlineExceeded("late").to_wire()))
    with pytest.raises(DeadlineExceeded):
        await opening
    # A stray "finished" for it afterwards changes nothing.
    client._route(prefill_api.Finished(req="r", checksum=1, timings={}))
    assert not client._pushes


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), 0, -1, 1e9, "5"])
async def test_a_deadline_that_is_no_number_of_seconds_is_a_usage_error(deadline: Any) -> None:
    client, sent = _client()
    with pytest.raises(UsageError, match="not a number of seconds"):
        await client.open("r", "decode", RequestShape(1, 4096), deadline=deadline)
    assert sent == []


async def test_a_burst_of_engines_connecting_at_once_all_get_in(local: LocalDaemons) -> None:
    def engine(_: int) -> str:
        sock, welcome, fd, _decoder = localsock._handshake(local.sender_socket, "prefill",
                                                           SENDER_LOCAL)
        os.close(fd)
        sock.close()
        return welcome.kind

    def burst() -> set[str]:
        with ThreadPoolExecutor(max_workers=300) as pool:
            return set(pool.map(engine, range(300)))

    assert await asyncio.to_thread(burst) == {"welcome"}


def test_a_full_backlog_is_retried_then_named(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "busy.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy:
        busy.bind(path)
        busy.listen(0)  # accepts nothing: the backlog fills at once
        waiting = []
        for _ in range(8):
            queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                queued.connect(path)
            waiting.append(queued)
        monkeypatch.setattr(localsock, "CONNECT_PATIENCE", 0.3)
        with pytest.raises(DaemonUnavailable, match="backlog stayed full") as info:
            localsock._handshake(path, "prefill", SENDER_LOCAL)
        assert "is the daemon running" not in str(info.value)
        for queued in waiting:
            queued.close()


def test_a_daemon_that_dies_mid_handshake_is_a_typed_error(tmp_path: Path) -> None:
    """Accepted, then gone with our hello unread (a SIGKILL): the kernel resets
    the connection, and the engine hears DaemonUnavailable, not an OSError."""
    path = str(tmp_path / "dying.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dying:
        dying.bind(path)
        dying.listen(1)

        def die_with_the_hello_unread() -> None:
            conn, _ = dying.accept()
            select.select([conn], [], [], 10)  # the hello has arrived
            conn.close()

        with ThreadPoolExecutor(1) as pool:
            killed = pool.submit(die_with_the_hello_unread)
            with pytest.raises(DaemonUnavailable, match="broke off the handshake"):
                localsock._handshake(path, "prefill", SENDER_LOCAL)
            killed.result()


def _writes_sent(local: LocalDaemons) -> float:
    metric = local.sender.metrics.writes
    return float(sum(metric.labels("decode", "sent", opcode)._value.get()
                     for opcode in ("write", "write_imm")))


async def test_named_granularities_follow_the_requests_own_layout(local: LocalDaemons) -> None:
    async with await SenderClient.connect(local.sender_socket) as client:
        before = _writes_sent(local)
        await client.push_bytes("one-layer", "decode", b"L" * (3 << 20), chunk="per-layer")
        assert _writes_sent(local) - before == 1  # its one 3 MiB layer, not 2 MiB pieces
        shape = RequestShape(8, 256 << 10)
        before = _writes_sent(local)
        push = await client.open("eight-layers", "decode", shape, chunk="per-layer")
        for n in range(shape.layers):
            push.layer(n)[:] = bytes([n]) * shape.layer_bytes
            push.commit(n)
        await push.finish()
        assert _writes_sent(local) - before == 8
        with pytest.raises(UsageError, match="tokens"):
            await client.open("no-tokens", "decode", shape, chunk="per-token")
