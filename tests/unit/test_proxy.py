"""``kvctl proxy`` without vLLM: its choices, and what a client hears when the
request is bad or the servers are down (the user's path through real vLLM
servers is in tests/netns/test_vllm_e2e.py)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvctl import timeline
from kvctl.vllm.proxy import Pool, Proxy, Server
from kvwired import tracing
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


# ------------------------------------------------------------------ tracing

CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _through_proxy(headers: dict[str, str]) -> list[tuple[str, dict[str, Any], str]]:
    """One streamed request through the proxy to two stand-in engines (an
    aiohttp app each: the proxy's own HTTP, not vLLM's); what each engine got:
    (which, its kv_transfer_params, its traceparent header)."""
    seen: list[tuple[str, dict[str, Any], str]] = []

    async def prefill(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(("prefill", body["kv_transfer_params"],
                     request.headers.get("traceparent", "")))
        return web.json_response({"choices": [{"text": "a"}],
                                  "kv_transfer_params": body["kv_transfer_params"]})

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(("decode", body["kv_transfer_params"],
                     request.headers.get("traceparent", "")))
        response = web.StreamResponse()
        await response.prepare(request)
        for chunk in (b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"):
            await response.write(chunk)
        await response.write_eof()
        return response

    upstreams = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        upstreams.append(await _serve(app))
    proxy = Proxy([Server(upstreams[0][1])], [Server(upstreams[1][1], "decode-0")])
    runner, url = await _serve(proxy.app())
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/completions", json={"model": "m", "prompt": [1, 2], "stream": True},
                headers=headers) as response:
            assert response.status == 200
            assert b"[DONE]" in await response.read()
    finally:
        for r in (runner, upstreams[0][0], upstreams[1][0]):
            await r.cleanup()
    return sorted(seen)


async def test_a_traced_request_hands_its_trace_to_both_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    tracing.configure("kvctl-proxy", str(tmp_path))
    try:
        seen = await _through_proxy({"traceparent": CLIENT_TRACE})
        spans = timeline.read_spans(tmp_path)
    finally:
        monkeypatch.setattr(tracing, "_tracer", None)
    [(_, decode_params, decode_header), (_, prefill_params, prefill_header)] = seen
    # The same traceparent in the params (for kvwire's connector) and the
    # header (for vLLM's own tracing), to both engines: a child of the client's.
    assert prefill_params["kvwire_trace"] == decode_params["kvwire_trace"] == \
        prefill_header == decode_header
    [request] = spans
    assert request.trace == "0x" + CLIENT_TRACE.split("-")[1]
    assert prefill_header.split("-")[1] == CLIENT_TRACE.split("-")[1]
    assert [name for name, _ in request.events] == ["prefill answered", "decode first chunk"]
    assert request.attributes["kvwire.transfer"] == prefill_params["kvwire_transfer"]


async def test_untraced_the_engines_get_no_trace_at_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    seen = await _through_proxy({"traceparent": CLIENT_TRACE})
    for _, params, header in seen:
        assert "kvwire_trace" not in params and header == ""


def test_the_hop_benchmark_runs_the_real_proxy_beside_a_pass_through(tmp_path: Path) -> None:
    # benchmarks.proxy_hop, a few rounds: every server a process of its own,
    # the proxy through `python -m kvctl proxy` (uvloop) as users start it.
    # Its figures are read, not bounded: timings on a loaded 2-core machine.
    import subprocess
    import sys

    out = tmp_path / "hop.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.proxy_hop", "--rounds", "5",
                           "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kvctl proxy's hop over the pass-through's" in done.stdout, done.stdout
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 5
    assert set(figures["added_ms"]) == {"pass-through", "kvctl proxy"}
    assert figures["direct_ms"]["both directly"]["p50"] > 0
