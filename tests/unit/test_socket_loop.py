"""The plain socket loop, the TCP transport's baseline: both halves on loopback,
run by the daemons for kvctl (``socket-loop``, ``chunk-sweep --baseline
socket``), and what the receiver refuses to serve."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.progress import PhaseProgress
from kvctl.run import chunk_sweep
from kvwired.client import SenderClient
from kvwired.errors import KvwireError, UsageError
from kvwired.experiments import socket_loop
from kvwired.experiments.baseline import SOCKET_LOOP_MAX_BYTES, LoopParams
from kvwired.protocol import CONTROL, FrameDecoder, Message, RawMessage, encode, message

from ..conftest import LocalDaemons, until


async def test_the_loop_times_every_round_and_the_receiver_counts_them() -> None:
    spec = socket_loop.LoopSpec(64 << 10, 16, rounds=3)
    server = socket_loop.LoopServer("127.0.0.1", spec.total)
    served = asyncio.create_task(asyncio.to_thread(server.run))
    seconds = await asyncio.to_thread(socket_loop.send, "127.0.0.1", server.port, spec)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert await asyncio.wait_for(served, 10) == 3


async def test_stop_ends_a_server_nobody_connected_to() -> None:
    server = socket_loop.LoopServer("127.0.0.1", 4096)
    ended = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            server.run()
        ended.set()

    threading.Thread(target=serve, daemon=True).start()
    server.stop()
    await until(ended.is_set, what="the server's thread to end")


async def test_a_receiver_gone_mid_round_is_a_clear_failure() -> None:
    spec = socket_loop.LoopSpec(64 << 10, 16, rounds=2)
    # It waits for more than a round holds, so the sender waits for its answer.
    server = socket_loop.LoopServer("127.0.0.1", 2 * spec.total)
    served = asyncio.create_task(asyncio.to_thread(server.run))
    sending = asyncio.create_task(
        asyncio.to_thread(socket_loop.send, "127.0.0.1", server.port, spec))
    await until(lambda: server.connected, what="the sender connected")
    server.stop()
    with pytest.raises(KvwireError, match=r"closed mid-round|socket loop to"):
        await asyncio.wait_for(sending, 20)
    await asyncio.wait_for(asyncio.gather(served, return_exceptions=True), 10)


async def test_the_daemons_run_the_loop_for_kvctl(roomy: LocalDaemons) -> None:
    rows: list[Message] = []
    async with await SenderClient.connect(roomy.sender_socket) as client:
        result = await client.run("socket-loop", {
            "peer": "decode", "sizes": [65536, "1MiB"], "bytes": "4MiB", "rounds": 2},
            rows.append)
    assert [row["size"] for row in result["rows"]] == [65536, 1 << 20]
    for row in result["rows"]:
        assert row["bytes"] == 4 << 20 and len(row["seconds"]) == 2
        assert min(row["seconds"]) <= row["median_seconds"] <= max(row["seconds"])
        assert row["gbps"] > 0
    assert [msg.kind for msg in rows] == ["row", "row"]


async def test_chunk_sweep_puts_the_loop_beside_each_delivery(roomy: LocalDaemons) -> None:
    params = {"sizes": ["2MiB"], "iters": 10, "stream_bytes": "4MiB", "baseline": "socket"}
    run = await chunk_sweep.run_sweep(roomy.sender_socket, params, PhaseProgress(enabled=False))
    assert run.error is None, run.error
    (row,) = run.rows
    assert len(row["socket_rounds"]) == 3 and row["socket_seconds"] > 0
    # A delivery per loop round, and the row's delivery is their median.
    assert len(row["deliver_rounds"]) == 3
    assert row["deliver_seconds"] == sorted(row["deliver_rounds"])[1]
    assert row["socket_seconds"] == sorted(row["socket_rounds"])[1]
    # The ratio is the median of each delivery over the loop round beside it,
    # and its spread their lowest and highest.
    (ratio,) = chunk_sweep.ratios(run.rows)
    paired = [d / s for d, s in zip(row["deliver_rounds"], row["socket_rounds"], strict=True)]
    assert ratio["delivery_time_ratio"] == pytest.approx(statistics.median(paired))
    assert ratio["delivery_time_ratio_spread"] == pytest.approx([min(paired), max(paired)])
    assert "plain socket loop" in chunk_sweep.render(run)


async def _ask_baseline(local: LocalDaemons, **fields: Any) -> RawMessage:
    reader, writer = await local.control("rogue")
    try:
        writer.write(encode(message("hello", role="sender", name="rogue", transports=["tcp"])))
        decoder = FrameDecoder(CONTROL)

        async def answer(kinds: tuple[str, ...]) -> RawMessage:
            while True:
                while (msg := decoder.next_message()) is None:
                    data = await asyncio.wait_for(reader.read(65536), 10)
                    assert data, "the receiver hung up"
                    decoder.feed(data)
                if msg.kind in kinds:
                    return msg.to_wire()

        await answer(("welcome",))
        writer.write(encode(message("connect", params={})))
        await answer(("ready",))
        writer.write(encode(message("baseline", req="b", **fields)))
        return await answer(("refused", "baseline_ready"))
    finally:
        writer.close()


@pytest.mark.parametrize(("size", "iters", "why"), [
    (1 << 20, 1 << 20, "outside"),  # a terabyte: the receiver would allocate it
    (0, 10, "outside"),
    (4096, 0, "outside"),
])
async def test_a_loop_the_receiver_should_not_allocate_is_refused(
        roomy: LocalDaemons, size: int, iters: int, why: str) -> None:
    answer = await _ask_baseline(roomy, tool="socket", size=size, iters=iters)
    assert answer["t"] == "refused" and why in answer["error"]["message"]
    assert SOCKET_LOOP_MAX_BYTES <= 256 << 20


async def test_an_unknown_baseline_tool_is_refused_by_name(roomy: LocalDaemons) -> None:
    answer = await _ask_baseline(roomy, tool="rm -rf /", size=512, iters=1)
    assert answer["t"] == "refused" and "rm -rf /" in answer["error"]["message"]


@given(params=st.dictionaries(
    st.sampled_from(["peer", "sizes", "bytes", "rounds"]),
    st.one_of(st.none(), st.integers(-3, 1 << 30), st.text(max_size=6),
              st.lists(st.one_of(st.integers(-3, 1 << 22), st.text(max_size=6)), max_size=4))))
def test_loop_parameters_validate_or_are_a_usage_error(params: dict[str, Any]) -> None:
    try:
        loop = LoopParams.from_wire(params)
    except UsageError:
        return
    assert loop.sizes and all(s >= 1 and loop.total % s == 0 for s in loop.sizes)
    assert 1 <= loop.rounds <= 100
