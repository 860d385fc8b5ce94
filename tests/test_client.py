"""The client library's routing of daemon messages, in every order, without a daemon."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from kvwired.client import SenderClient
from kvwired.errors import DeadlineExceeded, UsageError
from kvwired.layout import RequestShape
from kvwired.protocol import Message, message


def _client() -> tuple[SenderClient, list[Message]]:
    """A client whose connection is a list of what it sent, over 1 MiB of memory."""
    client = SenderClient("/nonexistent.sock")
    sent: list[Message] = []
    client.conn.fd = os.memfd_create("staging")
    os.ftruncate(client.conn.fd, 1 << 20)
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
    client._route(message("opened", req="r", offset=0, chunk_bytes=4096))
    client._route(message("failed", req="r", error=DeadlineExceeded("late").to_wire()))
    push = await opening
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(push.finish(), 1)
    with pytest.raises(DeadlineExceeded):
        push.commit(0)


async def test_opened_after_the_caller_gave_up_is_aborted() -> None:
    client, sent = _client()
    opening = await _opening(client)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    client._route(message("opened", req="r", offset=0, chunk_bytes=4096))
    assert sent[-1] == message("abort", req="r")
    assert not client._pushes


async def test_opened_in_the_turn_the_caller_gives_up_is_aborted() -> None:
    client, sent = _client()
    opening = await _opening(client)
    client._route(message("opened", req="r", offset=0, chunk_bytes=4096))
    opening.cancel()  # the answer is there, but the caller never sees it
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert sent[-1] == message("abort", req="r")


async def test_failed_before_opened_fails_open() -> None:
    client, _ = _client()
    opening = await _opening(client)
    client._route(message("failed", req="r", error=DeadlineExceeded("late").to_wire()))
    with pytest.raises(DeadlineExceeded):
        await opening
    # A stray "finished" for it afterwards changes nothing.
    client._route(message("finished", req="r", checksum=1, timings={}))
    assert not client._pushes


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), 0, -1, 1e9, "5"])
async def test_a_deadline_that_is_no_number_of_seconds_is_a_usage_error(deadline: Any) -> None:
    client, sent = _client()
    with pytest.raises(UsageError, match="not a number of seconds"):
        await client.open("r", "decode", RequestShape(1, 4096), deadline=deadline)
    assert sent == []
