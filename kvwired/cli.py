"""``kvwired receiver|sender``: run a daemon in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import structlog

from . import __version__, logs
from .config import CommonConfig, ReceiverConfig, SenderConfig, add_flags, load
from .errors import KvwireError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwired", description="kvwire daemons: move KV cache from prefill to decode."
    )
    parser.add_argument("--version", action="version", version=f"kvwired {__version__}")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    receiver = roles.add_parser(
        "receiver", help="decode node: receive pool, senders in, decode engines notified",
    )
    add_flags(receiver, ReceiverConfig)
    sender = roles.add_parser(
        "sender", help="prefill node: staging pool, prefill engines in, writes to receivers",
    )
    add_flags(sender, SenderConfig)
    return parser


async def run(config: CommonConfig, role: str) -> None:
    from .receiver import ReceiverDaemon
    from .sender import SenderDaemon

    daemon: ReceiverDaemon | SenderDaemon
    if isinstance(config, ReceiverConfig):
        daemon = ReceiverDaemon(config)
    else:
        assert isinstance(config, SenderConfig)
        daemon = SenderDaemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await daemon.start()
    await stop.wait()
    structlog.get_logger("kvwired").info("stopping", role=role)
    await daemon.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cls = ReceiverConfig if args.role == "receiver" else SenderConfig
    try:
        config = load(cls, args)
        logs.configure(config.log_level, config.log_format)
        import uvloop

        uvloop.run(run(config, args.role))
    except KvwireError as exc:
        print(f"kvwired {args.role}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  what to do: {exc.hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
