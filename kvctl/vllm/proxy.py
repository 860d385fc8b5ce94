"""``kvctl proxy``: one OpenAI endpoint in front of prefill and decode servers.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:
1. pick a prefill server and a decode server (least loaded: the fewest
   requests in flight through this proxy; ties go round robin);
2. send the request to prefill with one token to generate and
   ``kv_transfer_params = {"do_remote_decode": true, "kvwire_transfer": ID,
   "kvwire_receiver": NAME, "kvwire_deadline": S}``: its connector pushes
   the prompt's KV, layer by layer while prefill computes, to the receiver
   daemon NAME (as the prefill node's sender daemon knows it);
3. send the original request to decode with the ``kv_transfer_params`` the
   prefill answer carried, and stream decode's answer back.

Nothing but the ``kvwire_*`` keys is kvwire's: with vLLM's own connectors
(NIXL, Mooncake), which read ``do_remote_decode`` and return their own
params, the same proxy works (the benchmark runs them through it).

A server that cannot be reached is skipped for another of its kind; when
none answers, the client gets HTTP 502 with the servers' addresses, at once
rather than at a timeout. Errors from a server pass through with its status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
import uvloop
from aiohttp import web

from kvwire_vllm.params import DEFAULT_DEADLINE, new_transfer_id
from kvwired import tracing
from kvwired.errors import UsageError

log = structlog.get_logger("kvctl.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")
# parallel: both servers at once (kvwire's connector: the decode engine
# subscribes and waits for the push); sequential: decode after prefill, with
# the params its answer carries (vLLM's NIXL connector, which pulls).
FLOWS = ("parallel", "sequential")
CONNECT_TIMEOUT = 5.0


@dataclass
class Server:
    url: str
    receiver: str | None = None  # decode servers: their receiver daemon's name
    in_flight: int = 0
    requests: int = 0
    failures: int = 0

    @classmethod
    def parse(cls, spec: str, kind: str) -> Server:
        """``URL``, or for a decode server ``NAME=URL``."""
        name, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"{kind} server {spec!r} is not an http(s) URL",
                             hint="e.g. http://10.0.0.2:8200" + (
                                 ", or decode-0=http://10.0.0.3:8200 to name the receiver "
                                 "daemon beside it" if kind == "decode" else ""))
        if name and kind != "decode":
            raise UsageError(f"prefill server {spec!r} names a receiver; only decode "
                             "servers have one", hint="give prefill servers as plain URLs")
        return cls(url.rstrip("/"), name or None)


@dataclass
class Pool:
    """Servers of one kind, chosen least loaded, ties round robin."""

    kind: str
    servers: list[Server]
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def ranked(self) -> list[Server]:
        """The servers, least loaded first; among equally loaded ones the first
        place turns with every call."""
        turn = next(self._turn)
        ranked: list[Server] = []
        by_load = sorted(self.servers, key=lambda server: server.in_flight)
        for _, level in itertools.groupby(by_load, key=lambda server: server.in_flight):
            tied = list(level)
            start = turn % len(tied)
            ranked += tied[start:] + tied[:start]
        return ranked


class ProxyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self, transfer: str) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": "kvwire_proxy",
                                            "code": self.status}},
                                 status=self.status, headers={"x-kvwire-transfer": transfer})


class Proxy:
    def __init__(self, prefill: Sequence[Server], decode: Sequence[Server],
                 deadline: float = DEFAULT_DEADLINE, timeout: float = 600.0,
                 flow: str = "parallel") -> None:
        if flow not in FLOWS:
            raise UsageError(f"no flow {flow!r}", hint=f"choose one of {', '.join(FLOWS)}")
        self.flow = flow
        if not prefill or not decode:
            raise UsageError("the proxy needs at least one prefill and one decode server",
                             hint="kvctl proxy --prefill URL --decode [NAME=]URL")
        self.prefill = Pool("prefill", list(prefill))
        self.decode = Pool("decode", list(decode))
        self.deadline = deadline
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/proxy/status", self.status)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, connect=CONNECT_TIMEOUT, sock_read=self.timeout))

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response({
            kind: [{"url": s.url, "receiver": s.receiver, "in_flight": s.in_flight,
                    "requests": s.requests, "failures": s.failures} for s in pool.servers]
            for kind, pool in (("prefill", self.prefill), ("decode", self.decode))})

    async def models(self, request: web.Request) -> web.StreamResponse:
        async with self._session_or_fail().get(f"{self.decode.servers[0].url}/v1/models") as up:
            return web.json_response(await up.json(), status=up.status)

    def _session_or_fail(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app was not started"
        return self._session

    async def handle(self, request: web.Request) -> web.StreamResponse:
        transfer = new_transfer_id()
        # The request's trace (kvwired.tracing): a child of the client's, if it
        # sent one; both engines continue it.
        span = tracing.start("kvwire.request", request.headers.get("traceparent"),
                             {"kvwire.transfer": transfer, "http.route": request.path})
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ProxyError(400, f"the request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ProxyError(400, "the request body must be a JSON object")
            return await self._disaggregate(request, body, transfer, span)
        except ProxyError as exc:
            log.warning("request failed", transfer=transfer, status=exc.status,
                        error=exc.message)
            tracing.fail(span, exc.message)
            return exc.response(transfer)
        finally:
            span.end()

    async def _disaggregate(self, request: web.Request, body: dict[str, Any],
                            transfer: str, span: tracing.Span) -> web.StreamResponse:
        decode = self.decode.ranked()[0]
        decode.in_flight += 1  # from now: its receiver expects this request's KV
        decode.requests += 1
        try:
            return await self._through(request, body, transfer, decode, span)
        finally:
            decode.in_flight -= 1

    async def _through(self, request: web.Request, body: dict[str, Any], transfer: str,
                       decode: Server, span: tracing.Span) -> web.StreamResponse:
        path = request.path
        started = time.perf_counter()
        trace = tracing.traceparent(span)
        traced = {"kvwire_trace": trace} if trace else {}
        headers = {"traceparent": trace} if trace else {}
        order = {"do_remote_decode": True, "kvwire_transfer": transfer,
                 "kvwire_receiver": decode.receiver, "kvwire_deadline": self.deadline,
                 **traced}
        prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": order}
        prefill_body.pop("stream_options", None)
        if path.endswith("chat/completions"):
            prefill_body["max_completion_tokens"] = 1
        decoding: asyncio.Task[aiohttp.ClientResponse] | None = None
        if self.flow == "parallel":
            # The decode engine takes the request now, subscribes to the push
            # and copies it the moment it lands: its own steps overlap prefill.
            decoding = asyncio.create_task(self._ask_decode(decode, path, {
                **body, "kv_transfer_params": {"do_remote_prefill": True,
                                               "kvwire_transfer": transfer,
                                               "kvwire_deadline": self.deadline, **traced}},
                headers))
        try:
            prefill, answer = await self._post_any(self.prefill, path, prefill_body, headers)
        except BaseException:
            if decoding is not None:  # nothing will be pushed: the decode request goes
                decoding.cancel()
                with contextlib.suppress(BaseException):
                    (await decoding).release()
            raise
        prefilled = time.perf_counter()
        span.add_event("prefill answered", {"url": prefill.url})
        if decoding is None:
            params = answer.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise ProxyError(502, f"prefill server {prefill.url} answered without "
                                 "kv_transfer_params: is it running with a KV connector as "
                                 "kv_producer (--kv-transfer-config)?")
            decoding = asyncio.create_task(self._ask_decode(
                decode, path, {**body, "kv_transfer_params": params}, headers))
        answer_headers = {"x-kvwire-transfer": transfer, "x-kvwire-prefill": prefill.url,
                          "x-kvwire-decode": decode.url,
                          "x-kvwire-prefill-ms": f"{(prefilled - started) * 1e3:.1f}"}
        return await self._relay(request, decode, await decoding, answer_headers, transfer,
                                 span)

    async def _ask_decode(self, decode: Server, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> aiohttp.ClientResponse:
        """The decode server's response, open (its body not read yet)."""
        try:
            return await self._session_or_fail().post(decode.url + path, json=body,
                                                      headers=headers)
        except aiohttp.ClientConnectionError as exc:
            decode.failures += 1
            raise ProxyError(502, f"decode server {decode.url} could not be reached "
                             f"({exc.__class__.__name__}: {exc})") from None

    async def _post_any(self, pool: Pool, path: str, body: dict[str, Any],
                        headers: dict[str, str]) -> tuple[Server, dict[str, Any]]:
        """POST to the least loaded server of ``pool`` that can be reached."""
        unreachable: list[str] = []
        for server in pool.ranked():
            server.in_flight += 1
            server.requests += 1
            try:
                async with self._session_or_fail().post(server.url + path, json=body,
                                                        headers=headers) as up:
                    if up.status != 200:
                        raise ProxyError(up.status, f"{pool.kind} server {server.url}: "
                                         f"{await _error_text(up)}")
                    return server, dict(await up.json())
            except aiohttp.ClientConnectionError as exc:
                server.failures += 1
                unreachable.append(f"{server.url} ({exc.__class__.__name__}: {exc})")
            finally:
                server.in_flight -= 1
        raise ProxyError(502, f"no {pool.kind} server could be reached: "
                         + "; ".join(unreachable))

    async def _relay(self, request: web.Request, decode: Server,
                     up: aiohttp.ClientResponse, headers: dict[str, str],
                     transfer: str, span: tracing.Span) -> web.StreamResponse:
        """Decode's answer, streamed through as it comes."""
        response: web.StreamResponse | None = None
        try:
            if up.status != 200:
                raise ProxyError(up.status, f"decode server {decode.url}: "
                                 f"{await _error_text(up)}")
            response = web.StreamResponse(status=200, headers={
                **headers, "content-type": up.headers.get("content-type",
                                                          "application/json")})
            await response.prepare(request)
            first = True
            async for chunk in up.content.iter_any():
                if first:  # a streamed answer's first token
                    span.add_event("decode first chunk")
                    first = False
                await response.write(chunk)
            await response.write_eof()
            return response
        except aiohttp.ClientConnectionError as exc:
            decode.failures += 1
            if response is not None:  # mid-stream: the client sees the stream cut
                log.warning("decode stream broke", transfer=transfer, error=str(exc))
                return response
            raise ProxyError(502, f"decode server {decode.url} could not be reached "
                             f"({exc.__class__.__name__}: {exc})") from None
        finally:
            up.release()


async def _error_text(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        message = json.loads(text).get("error", {}).get("message")
    except (json.JSONDecodeError, AttributeError):
        message = None
    return str(message or text[:500] or response.reason)


def add_parser(commands: Any) -> None:
    proxy = commands.add_parser(
        "proxy", help="an OpenAI endpoint that sends each request to a prefill server, "
                      "then to a decode server with its KV moved by kvwire")
    proxy.set_defaults(handler=main)
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill servers (vLLM with kvwire's connector as kv_producer)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="[NAME=]URL",
                       help="decode servers (kv_consumer); NAME: the receiver daemon beside "
                            "it, as the prefill nodes' sender daemons name it (left out: "
                            "their only receiver)")
    proxy.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    proxy.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE,
                       help="seconds a request's KV may take from prefill to the decode node")
    proxy.add_argument("--timeout", type=float, default=600.0,
                       help="seconds to wait for a server's next bytes")
    proxy.add_argument("--flow", choices=FLOWS, default="parallel",
                       help="parallel: the decode server gets the request with the prefill "
                            "server and waits for its KV (kvwire); sequential: after prefill "
                            "answered, with the params it returned (connectors that pull)")


def main(args: argparse.Namespace) -> int:
    tracing.configure("kvctl-proxy")
    proxy = Proxy([Server.parse(s, "prefill") for s in args.prefill],
                  [Server.parse(s, "decode") for s in args.decode],
                  deadline=args.deadline, timeout=args.timeout, flow=args.flow)
    host, _, port = args.listen.rpartition(":")
    print(f"kvctl proxy on http://{args.listen}: prefill "
          f"{', '.join(s.url for s in proxy.prefill.servers)}; decode "
          f"{', '.join(s.url for s in proxy.decode.servers)}", flush=True)
    # uvloop, as the daemons: every request is two upstream calls and a relay,
    # and the loop's own cost per call is the hop's fixed cost.
    web.run_app(proxy.app(), host=host or "127.0.0.1", port=int(port), print=None,
                handle_signals=True, loop=uvloop.new_event_loop())
    return 0
