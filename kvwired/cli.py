"""``kvwired receiver|sender``: run a daemon in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING

import structlog

from . import __version__, logs
from .config import CommonConfig, ReceiverConfig, SenderConfig, add_flags, load

if TYPE_CHECKING:
    from .receiver import ReceiverDaemon
    from .sender import SenderDaemon
from .errors import KvwireError
from .systemd import Notifier
from .tasks import spawn


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


STATUS_EVERY = 10.0  # seconds between STATUS= updates to systemd


async def run(config: CommonConfig, role: str, args: argparse.Namespace | None = None) -> None:
    """Run a daemon until SIGTERM/SIGINT, then drain it and stop.

    Under systemd (Type=notify) it reports READY=1 once serving, STATUS=
    lines, STOPPING=1, and keeps the watchdog fed from this event loop.
    SIGHUP re-reads the configuration: the sender applies its peer list.
    """
    from .receiver import ReceiverDaemon
    from .sender import SenderDaemon

    log = structlog.get_logger("kvwired")
    daemon: ReceiverDaemon | SenderDaemon
    if isinstance(config, ReceiverConfig):
        daemon = ReceiverDaemon(config)
    else:
        assert isinstance(config, SenderConfig)
        daemon = SenderDaemon(config)
    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(daemon, role, args, notifier))
    try:
        await daemon.start()
    except BaseException:
        notifier.notify("STATUS=failed to start")
        raise
    notifier.ready(daemon.status_line())
    background = [spawn(notifier.keep_alive(), "watchdog"),
                  spawn(_report_status(daemon, notifier), "status")]
    await stop.wait()
    log.info("stopping", role=role, drain_timeout=config.drain_timeout)
    notifier.stopping(f"draining: up to {config.drain_timeout:g} s for requests in flight")
    left = await daemon.drain(config.drain_timeout)
    notifier.stopping("stopping" + (f": {left} requests failed by the drain timeout"
                                    if left else ""))
    for task in background:
        task.cancel()
    await daemon.stop()
    log.info("stopped", role=role, unfinished=left)
    notifier.close()


async def _report_status(daemon: ReceiverDaemon | SenderDaemon, notifier: Notifier) -> None:
    while True:
        await asyncio.sleep(STATUS_EVERY)
        notifier.status(daemon.status_line())


def _reload(daemon: ReceiverDaemon | SenderDaemon, role: str, args: argparse.Namespace | None,
            notifier: Notifier) -> None:
    from .sender import SenderDaemon

    log = structlog.get_logger("kvwired")
    if not isinstance(daemon, SenderDaemon) or args is None:
        log.info("SIGHUP: nothing to reload", role=role,
                 hint="the receiver's settings take effect on restart")
        return
    notifier.notify("RELOADING=1")
    try:
        fresh = load(SenderConfig, args)
        assert isinstance(fresh, SenderConfig)
        daemon.reload_peers(fresh.peers)
    except KvwireError as exc:
        log.error("SIGHUP: configuration not reloaded", error=exc.message, hint=exc.hint)
    finally:
        notifier.notify("READY=1", f"STATUS={daemon.status_line()}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cls = ReceiverConfig if args.role == "receiver" else SenderConfig
    try:
        config = load(cls, args)
        logs.configure(config.log_level, config.log_format)
        import uvloop

        uvloop.run(run(config, args.role, args))
    except KvwireError as exc:
        print(f"kvwired {args.role}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  what to do: {exc.hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
