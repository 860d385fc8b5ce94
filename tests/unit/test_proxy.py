"""``kvctl proxy`` without vLLM: its choices, and what a client hears when the
request is bad or the servers are down (the user's path through real vLLM
servers is in tests/netns/test_vllm_e2e.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvctl.vllm.proxy import Pool, Proxy, Server
from kvwired.errors import UsageError


def test_servers_are_urls_and_decode_servers_may_name_their_receiver() -> None:
    assert Server.parse("http://10.0.0.2:8200/", "prefill") == Server("http://10.0.0.2:8200")
    assert Server.parse("decode-0=http://10.0.0.3:8200", "decode") == \
        Server("http://10.0.0.3:8200", "decode-0")
    with pytest.raises(UsageError, match="not an http"):
        Server.parse("10.0.0.2:8200", "prefill")
    with pytest.raises(UsageError, match="only decode servers"):
        Server.parse("decode-0=http://10.0.0.3:8200", "prefill")
    with pytest.raises(UsageError, match="at least one prefill and one decode"):
        Proxy([], [Server("http://d")])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 12))
def test_the_least_loaded_server_is_chosen_and_ties_take_turns(loads: list[int],
                                                               picks: int) -> None:
    pool = Pool("decode", [Server(f"http://s{n}", in_flight=load)
                           for n, load in enumerate(loads)])
    chosen = [pool.ranked()[0] for _ in range(picks)]
    least = min(loads)
    assert all(server.in_flight == least for server in chosen)
    idle = [s for s in pool.servers if s.in_flight == least]
    # With no load changing, the idle ones are each chosen before any twice.
    firsts = [s.url for s in chosen[: len(idle)]]
    assert len(set(firsts)) == len(firsts)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def proxy_url() -> AsyncIterator[str]:
    dead = [f"http://127.0.0.1:{_closed_port()}" for _ in range(3)]
    proxy = Proxy([Server(dead[0]), Server(dead[1])], [Server(dead[2], "decode")])
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_a_body_that_is_not_a_json_object_is_a_400(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
            async with session.post(f"{proxy_url}/v1/completions", data=body) as response:
                assert response.status == 400
                error = (await response.json())["error"]
                assert "JSON" in error["message"] and error["type"] == "kvwire_proxy"
                assert response.headers["x-kvwire-transfer"].startswith("kvw-")


async def test_no_prefill_server_reachable_is_a_502_at_once_naming_them(
        proxy_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(f"{proxy_url}/v1/chat/completions",
                                json={"model": "m", "messages": []}) as response:
            assert response.status == 502
            message = (await response.json())["error"]["message"]
        assert time.monotonic() - started < 10  # refused connections, not a timeout
        assert message.startswith("no prefill server could be reached")
        assert message.count("http://127.0.0.1:") == 2  # both were tried
        async with session.get(f"{proxy_url}/proxy/status") as response:
            status = await response.json()
        assert [s["failures"] for s in status["prefill"]] == [1, 1]
        assert status["decode"][0]["in_flight"] == 0  # nothing left counted


async def test_other_paths_are_not_served(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{proxy_url}/v1/embeddings", json={}) as response:
            assert response.status in (404, 405)
        async with session.get(f"{proxy_url}/health") as response:
            assert response.status == 200
