"""``kvctl``: push KV caches, run experiments, probe nodes, check daemons, run the demo."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import signal
import sys
import uuid
from collections.abc import Callable
from typing import Any

from kvwired.addresses import RECEIVER_METRICS_PORT, SENDER_METRICS_PORT
from kvwired.client import (
    RECEIVER_SOCKET_VARIABLE,
    SENDER_SOCKET_VARIABLE,
    ReceiverClient,
    SenderClient,
)
from kvwired.errors import KvwireError, UsageError
from kvwired.layout import DTYPE_BYTES, KVLayout, RequestShape

from . import table

# What kvwire's ctl extra installs: kvctl's experiments, plots, lab, demos and
# proxy need them; the daemons and kvctl's node commands (status, keys, probe,
# cluster) do not, so a node that runs only a daemon installs none.
CTL_EXTRA = frozenset({"numpy", "safetensors", "rich", "matplotlib", "aiohttp"})


def needs_ctl_extra(exc: ModuleNotFoundError) -> bool:
    """Whether a missing module is one of the ctl extra's (not a broken install)."""
    return (exc.name or "").split(".")[0] in CTL_EXTRA


# Both daemons' Prometheus endpoints on this host, as the shipped configs have them.
DEFAULT_METRICS = [f"127.0.0.1:{RECEIVER_METRICS_PORT}", f"127.0.0.1:{SENDER_METRICS_PORT}"]


# Commands defined in their own modules, and the function that adds each one's
# parser. Only the command named is imported: `kvctl push` does not load the
# proxy's aiohttp, the keys' cryptography or the cluster view. On the lab's
# emulated nodes loading them all took longer than the rest of a push's start.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "run": (".run.cli", "add_parsers"),
    "probe": (".probe", "add_parser"),
    "lab": (".lab.cli", "add_parser"),
    "keys": (".keys", "add_parser"),
    "netns": (".netns_session", "add_parser"),
    "cluster": (".cluster", "add_parser"),
    "proxy": (".vllm.proxy", "add_parser"),
    "timeline": (".timeline", "add_parser"),
}


# The commands defined here, with their parsers always built: they are cheap.
BUILT_IN = ("push", "consume", "status", "metrics", "demo")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """kvctl's parser; with ``only``, of the commands in their own modules
    just that one (the ones defined here are cheap and always there)."""
    parser = argparse.ArgumentParser(prog="kvctl", description="Control and measure kvwire.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    push = commands.add_parser("push", help="push a KV cache through the local sender daemon")
    push.add_argument("--peer", help="receiver name, as in the sender's [peers] (default: the "
                      "sender's only one)")
    push.add_argument("--socket", help=f"sender daemon socket (default: ${SENDER_SOCKET_VARIABLE}"
                      ", else /run/kvwire/sender.sock)")
    push.add_argument("--file", help=".npy (first axis: layers) or .safetensors (one tensor a "
                      "layer); default: a synthetic cache of the --layers.. shape")
    _layout_flags(push)
    push.add_argument("--chunk", action="append", help="granularity (per-token-per-layer, "
                      "per-token, per-layer, whole) or bytes; repeat to compare; default: the "
                      "sender's")
    push.add_argument("--count", type=int, default=1, help="pushes per chunk size")
    push.add_argument("--concurrency", type=int, default=1, help="pushes in flight at once")
    push.add_argument("--deadline", type=float, help="seconds each push may take")
    push.add_argument("--verify-socket", nargs="?", const="",
                      help="receiver daemon socket on this machine (default: "
                      f"${RECEIVER_SOCKET_VARIABLE}, else /run/kvwire/receiver.sock): check "
                      "every byte there and time the first layer")
    push.add_argument("--seed", type=int, default=0,
                      help="seed of the synthetic cache (kvctl consume --expect-seed checks it)")
    push.add_argument("--req", help="request id (with --count: ID-0, ID-1, ...); default: "
                      "random")
    push.add_argument("--json", action="store_true", help="one JSON object per push")
    push.set_defaults(handler=lambda args: asyncio.run(_push(args)))

    consume = commands.add_parser("consume", help="stand in for a decode engine: wait for "
                                  "requests, check them, release them")
    consume.add_argument("requests", nargs="+", metavar="REQ")
    consume.add_argument("--socket", help=f"receiver daemon socket (default: "
                         f"${RECEIVER_SOCKET_VARIABLE}, else /run/kvwire/receiver.sock)")
    expected = consume.add_mutually_exclusive_group()
    expected.add_argument("--expect-seed", type=int,
                          help="compare every byte with kvctl push's synthetic cache of this "
                          "seed (and the --layers.. shape)")
    expected.add_argument("--file", help="compare every byte with this .npy or .safetensors, "
                          "as kvctl push --file sends it")
    _layout_flags(consume)
    consume.add_argument("--timeout", type=float, default=120.0,
                         help="seconds to wait for every request")
    consume.add_argument("--keep", action="store_true",
                         help="check, but do not release: the receiver keeps the requests for "
                         "a decode engine that subscribes within its unclaimed_ttl")
    consume.add_argument("--json", action="store_true", help="one JSON object per request")
    consume.set_defaults(handler=lambda args: asyncio.run(_consume(args)))

    status = commands.add_parser("status", help="health and key figures of daemons")
    status.add_argument("urls", nargs="*", default=DEFAULT_METRICS,
                        help="metrics endpoints (host:port or URL); default: the local "
                        "receiver's and sender's")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=_status)

    metrics = commands.add_parser("metrics", help="key figures of both daemons per peer "
                                  "(rates, latency quantiles, credits, errors); --watch: live")
    metrics.add_argument("urls", nargs="*", default=DEFAULT_METRICS,
                         help="metrics endpoints; default: the local receiver and sender")
    metrics.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    metrics.add_argument("--interval", type=float, default=2.0,
                         help="seconds between scrapes (rates are over this interval)")
    metrics.add_argument("--json", action="store_true")
    metrics.set_defaults(handler=_metrics)

    for name, (module, function) in COMMAND_MODULES.items():
        if only is None or only == name:
            _add_command(commands, name, module, function)

    demo = commands.add_parser("demo", help="the end-to-end demo")
    demo.add_argument("where", choices=["lab", "netns", "vllm"],
                      help="lab: RDMA (Soft-RoCE) between two QEMU nodes, with TCP and "
                      "perftest beside it; netns: TCP between two network namespaces; "
                      "vllm: vLLM prefill and decode servers through kvwire and the proxy, "
                      "against one engine (needs make vllm-env)")
    demo.add_argument("--repeat", type=int, default=3, help="netns: pushes per granularity")
    demo.add_argument("--pairs", type=int, default=7,
                      help="netns: pairs of a push and a plain loop round per granularity")
    demo.add_argument("--full", action="store_true",
                      help="lab: also the ping-pong and ib_write_lat beyond 8 MiB (48 MiB: "
                      "about three minutes more)")
    demo.set_defaults(handler=_demo)
    return parser


def _layout_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES))


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout(args.layers, args.tokens, args.kv_heads, args.head_dim, args.dtype)


def _add_command(commands: Any, name: str, module: str, function: str) -> None:
    try:
        add_parser = getattr(importlib.import_module(module, __package__), function)
    except ModuleNotFoundError as exc:
        if name != "proxy" or not needs_ctl_extra(exc):
            raise
        # Listed all the same: running it says what to install.
        missing = exc

        def needs_extra(args: argparse.Namespace) -> int:
            raise missing
        commands.add_parser("proxy", help="an OpenAI endpoint in front of disaggregated "
                                          "vLLM servers (needs kvwire[ctl])"
                            ).set_defaults(handler=needs_extra)
        return
    add_parser(commands)


def main(argv: list[str] | None = None) -> int:
    # A shell's background job starts its children with SIGINT ignored; a
    # command that stops on Ctrl-C (metrics --watch, consume) must still.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=_command_named(argv)).parse_args(argv)
    try:
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except ModuleNotFoundError as exc:
        if not needs_ctl_extra(exc):
            raise
        error: KvwireError = UsageError(
            f"this command needs {exc.name}, which comes with kvwire's ctl extra",
            hint="pip install 'kvwire[ctl]' (a node that only runs a daemon needs none of it)")
    except KvwireError as exc:
        error = exc
    except KeyboardInterrupt:
        return 130
    print(f"kvctl {args.command}: error: {error.message}", file=sys.stderr)
    if error.hint:
        print(f"  what to do: {error.hint}", file=sys.stderr)
    return 2


def _command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names; None (every command) for anything else, so
    `kvctl --help` and a mistyped command list them all."""
    named = argv[0] if argv else None
    return named if named in COMMAND_MODULES or named in BUILT_IN else None


def _demo(args: argparse.Namespace) -> int:
    # Each demo's modules (the lab, vLLM's engines) are imported only for it.
    if args.where == "lab":
        from .lab.demo import lab_demo

        lab_demo(full=args.full)
    elif args.where == "vllm":
        from .vllm.demo import vllm_demo

        vllm_demo()
    else:
        from .netns_demo import netns_demo

        asyncio.run(netns_demo(args.repeat, pairs=args.pairs))
    return 0


async def _push(args: argparse.Namespace) -> int:
    from .push import HEADERS, PushRecord, push_one
    from .source import from_file, synthetic

    if args.file:
        shape, data = from_file(args.file)
        layout = None
    else:
        layout = _layout(args)
        shape, data = layout.shape(), synthetic(layout, args.seed)
    chunks = args.chunk or [None]
    sizes = {chunk: _chunk(chunk, layout, shape) for chunk in chunks}  # refused before connecting
    sender = await SenderClient.connect(args.socket)
    receiver = (None if args.verify_socket is None
                else await ReceiverClient.connect(args.verify_socket or None))
    records: list[PushRecord] = []
    run = uuid.uuid4().hex[:8]
    limit = asyncio.Semaphore(max(1, args.concurrency))

    def request_id(chunk: str | None, n: int) -> str:
        if args.req is None:
            return f"kvctl-{run}-{chunk or 'default'}-{n}"
        if args.count == 1 and len(chunks) == 1:
            return str(args.req)
        return f"{args.req}-{chunk or 'default'}-{n}" if len(chunks) > 1 else f"{args.req}-{n}"

    async def one(chunk: str | None, n: int) -> PushRecord:
        async with limit:
            return await push_one(sender, args.peer, request_id(chunk, n), shape, data,
                                  chunk=sizes[chunk], receiver=receiver,
                                  deadline=args.deadline)

    try:
        for chunk in chunks:
            records += await asyncio.gather(*(one(chunk, n) for n in range(args.count)))
    finally:
        await sender.close()
        if receiver is not None:
            await receiver.close()
    if args.json:
        for record in records:
            print(json.dumps(record.to_dict()))
    else:
        print(table.render(HEADERS, [r.row() for r in records]))
    return 0


async def _consume(args: argparse.Namespace) -> int:
    from .consume import consume
    from .source import from_file, synthetic

    expected = None
    if args.file:
        expected = from_file(args.file)[1]
    elif args.expect_seed is not None:
        expected = synthetic(_layout(args), args.expect_seed)
    records = await consume(args.socket, args.requests, expected, args.timeout, args.keep)
    if args.json:
        for record in records:
            print(json.dumps(record.to_dict()))
    else:
        print(table.render(
            ["request", "bytes", "layers", "first layer s", "delivered s", "checksum", "bytes"],
            [[r.req, r.bytes, r.layers, r.first_layer_at, r.delivered_at,
              "ok" if r.checksum_ok else "BAD", {None: "-", True: "ok", False: "BAD"}[r.bytes_ok]]
             for r in records]))
    bad = [r.req for r in records if not r.checksum_ok or r.bytes_ok is False]
    if bad:
        print(f"kvctl consume: {', '.join(bad)} did not arrive intact", file=sys.stderr)
        return 1
    return 0


def _chunk(spec: str | None, layout: KVLayout | None,
           shape: RequestShape | None = None) -> str | int | None:
    """``--chunk`` in bytes, against the synthetic cache's layout, or against a
    ``--file``'s shape (``layout`` None), which knows its layers but not its tokens."""
    from kvwired.errors import UsageError
    from kvwired.layout import resolve_chunk_bytes

    if spec is None:
        return None
    if layout is not None:
        return resolve_chunk_bytes(spec, layout)
    try:
        return resolve_chunk_bytes(spec, shape)
    except UsageError:
        raise UsageError(
            f"--chunk {spec} needs the cache's tokens, and a --file says only its layers "
            "(its first axis)", hint="use --chunk per-layer or whole, or a size in bytes "
            "(e.g. --chunk 512 for one token of one layer of the reference cache)") from None


def _metrics(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from . import metrics

    if args.watch:
        metrics.watch(args.urls, args.interval)
        return 0
    statuses, _, rows = metrics.collect(args.urls, args.interval)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(metrics.render(rows))
    return 0 if all(s.up for s in statuses) else 1


def _status(args: argparse.Namespace) -> int:
    from .status import HEADERS, row, scrape

    statuses = [scrape(url) for url in args.urls]
    if args.json:
        print(json.dumps([{"url": s.url, "up": s.up, "error": s.error,
                           "row": dict(zip(HEADERS, map(str, row(s)), strict=True))}
                          for s in statuses]))
    else:
        print(table.render(HEADERS, [row(s) for s in statuses]))
    return 0 if all(s.up for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
