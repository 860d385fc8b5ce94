"""``kvctl run chunk-sweep|overlap``: flags and the glue to the runners."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from kvwired.client import SENDER_SOCKET_VARIABLE, SenderClient
from kvwired.errors import KvwireError
from kvwired.units import parse_seconds, parse_size


def add_parsers(commands: Any) -> None:
    run = commands.add_parser("run", help="run an experiment in the daemons")
    experiments = run.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")

    sweep = experiments.add_parser(
        "chunk-sweep", help="latency, bandwidth and 48 MiB delivery time per write size")
    _common(sweep)
    sweep.set_defaults(handler=lambda args: asyncio.run(_chunk_sweep(args)))
    sweep.add_argument("--sizes", type=_sizes, help="comma-separated sizes (default: 512, 2KiB, "
                       "8KiB, 12KiB, 64KiB, 256KiB, 1MiB, 2MiB, 8MiB, 48MiB)")
    sweep.add_argument("--iters", type=int, default=1000,
                       help="ping-pong round trips per size (fewer for large sizes, see "
                       "--latency-bytes)")
    sweep.add_argument("--latency-bytes", type=_size, default=64 << 20,
                       help="at most this many bytes moved per size by the ping-pong")
    sweep.add_argument("--stream-bytes", type=_size, default=64 << 20,
                       help="bytes streamed per size for the bandwidth figure")
    sweep.add_argument("--latency-up-to", type=_size, metavar="SIZE",
                       help="the ping-pong (and ib_write_lat) only at sizes up to SIZE; larger "
                       "ones get streaming and the delivery (default: every size)")
    sweep.add_argument("--no-deliver", action="store_true",
                       help="skip pushing the 48 MiB cache at each size")
    sweep.add_argument("--baseline", choices=["perftest", "socket"],
                       help="also run, on the same link at the same sizes, ib_write_lat and "
                       "ib_write_bw (perftest: RDMA), or a plain socket loop moving the 48 MiB "
                       "cache (socket: the TCP transport's baseline)")

    overlap = experiments.add_parser(
        "overlap", help="prefill compute overlapped with transfer (double-buffered)")
    _common(overlap)
    overlap.set_defaults(handler=lambda args: asyncio.run(_overlap(args)))
    overlap.add_argument("--ratios", type=_floats, default=None,
                         help="Tc/Tx ratios (default 0,0.25,0.5,1,2,4)")
    overlap.add_argument("--layers", type=int, default=24)
    overlap.add_argument("--layer-bytes", type=_size, default=2 << 20)
    overlap.add_argument("--repeats", type=int, default=3, help="pushes per point (median)")
    overlap.add_argument("--chunk", help="write size (default: the sender's)")
    overlap.add_argument("--layer-compute", type=_seconds,
                         help="your prefill's compute time per layer (e.g. 0.6ms), to place "
                         "the deployment against the ridge")
    overlap.add_argument("--buffers", type=int, default=2,
                         help="layer buffers the engine computes into (default 2: "
                         "double-buffered)")


    faults = experiments.add_parser(
        "faults", help="a fault campaign: verified pushes, one injected fault at a time")
    faults.set_defaults(handler=_faults)
    faults.add_argument("--where", choices=["netns", "lab"], default="netns",
                        help="netns: two network namespaces over TCP (root); lab: the lab's "
                        "nodes (kvctl lab up first), verbs over Soft-RoCE, under systemd")
    faults.add_argument("--scenarios", type=lambda text: [s for s in text.split(",") if s],
                        help="comma-separated scenario names (default: all)")
    faults.add_argument("--short", action="store_true",
                        help="a few scenarios, 3 iterations each (what make test runs)")
    faults.add_argument("--iterations", type=int, default=20, help="iterations per scenario")
    faults.add_argument("--seed", type=int, default=0,
                        help="seed of the fault points and the caches")
    faults.add_argument("--layers", type=int, default=24, help="layers of each pushed cache")
    faults.add_argument("--layer-bytes", type=_size, default=2 << 20,
                        help="bytes per layer (default 2MiB: the 48 MiB reference cache)")
    faults.add_argument("--out", type=Path, help="write faults.json, faults.csv, faults.png")
    faults.add_argument("--json", action="store_true", help="print the JSON document")
    faults.add_argument("--quiet", action="store_true", help="no progress output")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", help="receiver name (default: the sender's only one)")
    parser.add_argument("--socket", help=f"sender daemon socket (default: ${SENDER_SOCKET_VARIABLE}"
                        ", else /run/kvwire/sender.sock)")
    parser.add_argument("--out", type=Path, help="write CSV, JSON and PNG plots here")
    parser.add_argument("--json", action="store_true", help="print the JSON document")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except KvwireError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _seconds(text: str) -> float:
    try:
        return parse_seconds(text)
    except KvwireError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _sizes(text: str) -> list[int]:
    return [_size(part.strip()) for part in text.split(",") if part.strip()]


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None


def _faults(args: argparse.Namespace) -> int:
    from ..faults.cli import run_faults  # faults/ sits beside run/: imported when run

    return run_faults(args)


async def _chunk_sweep(args: argparse.Namespace) -> int:
    from kvwired.experiments.spec import DEFAULT_SIZES, SweepParams

    from . import chunk_sweep

    params: dict[str, Any] = {
        "peer": args.peer or "", "sizes": args.sizes or list(DEFAULT_SIZES),
        "iters": args.iters, "latency_bytes": args.latency_bytes,
        "stream_bytes": args.stream_bytes, "deliver": not args.no_deliver,
        "baseline": args.baseline or "", "latency_up_to": args.latency_up_to}
    from ..progress import PhaseProgress  # rich: the ctl extra

    progress = PhaseProgress(enabled=not args.quiet, plan=SweepParams.from_wire(params).phases())
    run = await chunk_sweep.run_sweep(args.socket, params, progress)
    return _finish(args, run.document(), chunk_sweep.render(run),
                   lambda out: chunk_sweep.write_outputs(run, out), run.error)


async def _overlap(args: argparse.Namespace) -> int:
    from . import overlap

    peer = args.peer
    if not peer:
        client = await SenderClient.connect(args.socket)
        try:
            peer = client.only_peer()
        finally:
            await client.close()
    params = overlap.OverlapParams(
        peer=peer, ratios=tuple(args.ratios or overlap.DEFAULT_RATIOS), layers=args.layers,
        layer_bytes=args.layer_bytes, repeats=args.repeats, chunk=args.chunk,
        layer_compute=args.layer_compute, buffers=args.buffers)
    from ..progress import PhaseProgress  # rich: the ctl extra

    progress = PhaseProgress(enabled=not args.quiet, plan=params.phases())
    run = await overlap.run_overlap(args.socket, params, progress)
    return _finish(args, run.document(), overlap.render(run),
                   lambda out: overlap.write_outputs(run, out), run.error)


def _finish(args: argparse.Namespace, document: dict[str, Any], text: str,
            write: Any, error: KvwireError | None) -> int:
    print(json.dumps(document, indent=2) if args.json else text)
    if args.out is not None:
        for path in write(args.out):
            print(f"wrote {path}", file=sys.stderr)
    if error is not None:
        # The figures measured so far are printed and written above.
        raise error
    return 0

