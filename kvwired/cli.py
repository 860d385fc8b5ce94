"""``kvwired receiver|sender``: run a daemon in the foreground.

This is where the daemons are wired: each is built from its config and
handed the experiments it may run (the way aiokafka's producer is handed
its sender and accumulator), so neither daemon imports an experiment.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, logs
from .config import CommonConfig, ReceiverConfig, SenderConfig, add_flags, load
from .daemon import Daemon, run
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


def build_daemon(config: CommonConfig) -> Daemon:
    """A daemon for ``config``, with the experiments of its role plugged in."""
    if isinstance(config, ReceiverConfig):
        from .experiments.baseline import BaselineService
        from .experiments.echo import EchoService
        from .receiver import ReceiverDaemon

        return ReceiverDaemon(config, services=[EchoService(), BaselineService()])
    assert isinstance(config, SenderConfig)
    from .experiments import baseline, chunk_sweep
    from .sender import SenderDaemon

    return SenderDaemon(config, experiments={"chunk-sweep": chunk_sweep.run,
                                             "socket-loop": baseline.run_socket_loop})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cls = ReceiverConfig if args.role == "receiver" else SenderConfig
    try:
        config = load(cls, args)
        logs.configure(config.log_level, config.log_format)
        import uvloop

        uvloop.run(run(build_daemon(config), lambda: load(cls, args)))
    except KvwireError as exc:
        print(f"kvwired {args.role}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  what to do: {exc.hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
