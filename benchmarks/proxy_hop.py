"""What ``kvctl proxy``'s own hop costs, next to a plain pass-through, with no engine.

In ``benchmarks.vllm_connectors`` the proxy's hops are a few milliseconds
among hundreds, measured through vLLM's HTTP server and its scheduler, so a
change to the proxy cannot be told from an engine's noise there. Here every
server is a stub that answers at once, each in a process of its own:

- ``engine``: answers a prefill order (``do_remote_decode``) with one JSON
  completion and ``kv_transfer_params``, and any other request with one
  streamed token and ``[DONE]``, as vLLM's completions endpoint does;
- ``kvctl proxy`` in front of two such engines (prefill and decode);
- ``benchmarks.passthrough`` in front of one.

The client times each request's first token, round after round, asking in
turn: the decode engine directly; both engines directly, as the proxy does
(the prefill order and the decode request at once, the first token once
prefill has answered); the pass-through; the proxy. A hop is what it adds
to the same requests made directly (p50 and p90 of the per-round
differences, ms): the pass-through's over one request, the proxy's over
the two it makes. Then the proxy's hop over the pass-through's.

    python -m benchmarks.proxy_hop [--rounds 300] [--against CHECKOUT] [--json FILE]

``--against`` adds another checkout's ``kvctl proxy`` to the same rounds:
a change's before and after, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvctl.vllm.engines import start_until_it_says
from kvctl.vllm.load import complete
from kvwired.addresses import free_port
from kvwired.analysis import percentile

REPO = Path(__file__).resolve().parents[1]
PROMPT = list(range(256))  # a short prompt's tokens: the body a proxy parses


def engine_app() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        order = body.get("kv_transfer_params") or {}
        if order.get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "a", "token_ids": [1]}],
                                      "kv_transfer_params": {"done": True}})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"text": "a", "token_ids": [1]}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _both_directly(session: aiohttp.ClientSession, prefill: str, decode: str
                         ) -> float | None:
    """What the proxy does, done by the client: the prefill order and the decode
    request at once, decode's first token once prefill has answered."""
    started = time.perf_counter()
    decoding = asyncio.create_task(complete(session, decode, PROMPT, 1))
    async with session.post(f"{prefill}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}) as answer:
        await answer.read()
    decoded = await decoding
    if decoded.ttft is None:
        return None
    return max(decoded.ttft, time.perf_counter() - started)


async def _rounds(urls: dict[str, str], prefill: str, rounds: int) -> dict[str, list[float]]:
    """Each round asks every URL once (and the two engines directly, as the
    proxy does: ``both directly``), in an order that turns each round."""
    async def ask(session: aiohttp.ClientSession, name: str) -> float | None:
        if name == "both directly":
            return await _both_directly(session, prefill, urls["direct"])
        return (await complete(session, urls[name], PROMPT, 1)).ttft

    names = [*urls, "both directly"]
    ttft: dict[str, list[float]] = {name: [] for name in names}
    async with aiohttp.ClientSession() as session:
        for name in names:  # warm: connections, first imports
            for _ in range(5):
                await ask(session, name)
        for number in range(rounds):
            turn = number % len(names)
            for name in names[turn:] + names[:turn]:
                seconds = await ask(session, name)
                if seconds is None:
                    raise RuntimeError(f"{name}: no token")
                ttft[name].append(seconds * 1e3)
    return ttft


def measure(rounds: int, against: Path | None = None) -> dict[str, Any]:
    names = ["prefill", "decode", "pass", "proxy"] + (["before"] if against else [])
    ports = {name: free_port() for name in names}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    me = [sys.executable, "-m", "benchmarks.proxy_hop"]
    proxies = {"kvctl proxy": ("proxy", REPO)}
    if against is not None:
        proxies[f"kvctl proxy of {against}"] = ("before", against)
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="proxy-hop-")))
        for name in ("prefill", "decode"):
            start_until_it_says(stack, [*me, "engine", "--port", str(ports[name])],
                                logs / f"{name}.log", "engine on", f"the {name} stub",
                                cwd=REPO)
        start_until_it_says(stack, [sys.executable, "-m", "benchmarks.passthrough",
                                    url["decode"], "--listen", f"127.0.0.1:{ports['pass']}"],
                            logs / "pass.log", "pass-through on", "the pass-through", cwd=REPO)
        for port_name, checkout in proxies.values():
            start_until_it_says(
                stack, [sys.executable, "-m", "kvctl", "proxy", "--prefill", url["prefill"],
                        "--decode", url["decode"], "--listen",
                        f"127.0.0.1:{ports[port_name]}"],
                logs / f"{port_name}.log", "kvctl proxy on", f"the proxy in {checkout}",
                cwd=checkout)
        ttft = asyncio.run(_rounds({"direct": url["decode"], "pass-through": url["pass"],
                                    **{label: url[port_name]
                                       for label, (port_name, _) in proxies.items()}},
                                   url["prefill"], rounds))
    # A proxy's hop: over the same two requests made directly. The
    # pass-through's: over the one request it relays.
    added = {name: [hop - direct for hop, direct in zip(
        ttft[name], ttft["direct" if name == "pass-through" else "both directly"], strict=True)]
        for name in ttft if name not in ("direct", "both directly")}
    over = [proxy - plain for proxy, plain in zip(added["kvctl proxy"], added["pass-through"],
                                                  strict=True)]
    return {"rounds": rounds,
            "direct_ms": {name: {"p50": percentile(ttft[name], 50),
                                 "p90": percentile(ttft[name], 90)}
                          for name in ("direct", "both directly")},
            "added_ms": {name: {"p50": percentile(v, 50), "p90": percentile(v, 90)}
                         for name, v in added.items()},
            "proxy_hop_over_passthrough_ms": {"p50": percentile(over, 50),
                                              "p90": percentile(over, 90)}}


def report(result: dict[str, Any]) -> str:
    width = max(len(name) for name in result["added_ms"])
    direct = result["direct_ms"]
    lines = [f"{result['rounds']} rounds; first token asked directly: "
             f"{direct['direct']['p50']:.2f} ms p50 (one engine), "
             f"{direct['both directly']['p50']:.2f} ms (prefill and decode, as the proxy asks)",
             f"{'hop':<{width}}  added p50 (ms)  added p90 (ms)"]
    for name, added in result["added_ms"].items():
        lines.append(f"{name:<{width}}  {added['p50']:>14.2f}  {added['p90']:>14.2f}")
    over = result["proxy_hop_over_passthrough_ms"]
    lines.append(f"kvctl proxy's hop over the pass-through's: {over['p50']:+.2f} ms p50, "
                 f"{over['p90']:+.2f} ms p90")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.proxy_hop",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("engine", help="serve a stub engine (used by the benchmark)")
    serve.add_argument("--port", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="another checkout whose kvctl proxy joins the same rounds")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if args.command == "engine":
        web.run_app(engine_app(), host="127.0.0.1", port=args.port,
                    print=lambda _: print(f"engine on {args.port}", flush=True))
        return
    started = time.monotonic()
    result = measure(args.rounds, args.against)
    result["seconds"] = round(time.monotonic() - started, 1)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
