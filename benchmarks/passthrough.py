"""A plain HTTP pass-through, for the benchmark: what one proxy hop costs.

``kvctl proxy`` stands between the client and two engines. To see what its
own hop costs beyond any proxy's, the benchmark asks the plain engine both
directly and through this: one aiohttp server that forwards each request's
body and headers to one upstream and streams the answer back as it comes,
with nothing else (no parsing, no choice of server, no tracing).

    python -m benchmarks.passthrough UPSTREAM_URL --listen HOST:PORT
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself.
SKIPPED = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def app(upstream: str) -> web.Application:
    session: aiohttp.ClientSession | None = None

    async def opened(_: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def closed(_: web.Application) -> None:
        if session is not None:
            await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in SKIPPED}
        async with session.request(request.method, upstream + request.path_qs,
                                   data=await request.read(), headers=headers) as up:
            response = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in SKIPPED})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    application = web.Application()
    application.on_startup.append(opened)
    application.on_cleanup.append(closed)
    application.router.add_route("*", "/{path:.*}", forward)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.passthrough")
    parser.add_argument("upstream", help="the server every request goes to")
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    web.run_app(app(args.upstream.rstrip("/")), host=host, port=int(port),
                print=lambda _: print(f"pass-through on {args.listen}", flush=True))


if __name__ == "__main__":
    main()
