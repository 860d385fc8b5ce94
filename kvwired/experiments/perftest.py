"""perftest (ib_write_lat, ib_write_bw) as the baseline of an experiment.

The daemons run it themselves, over the device and GID their own data path
uses, so "ours vs perftest" compares two programs on one link in one run:
the receiver runs the server side when a sender asks (``baseline`` on the
control connection), the sender runs the client side against it.

perftest can hang (it busy-polls; on a starved emulated CPU a run sometimes
never finishes), so every run has a time limit and is killed at it. The
receiver's side of a run is ``kvwired.experiments.baseline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass

from ..errors import PerftestFailed, UsageError
from ..rdma import GidEntry

TOOLS = ("ib_write_lat", "ib_write_bw")
LISTEN_TIMEOUT = 10.0  # seconds a server may take to listen before the client tries anyway
LISTEN_POLL = 0.02


@dataclass(frozen=True)
class LatencyFigures:
    """ib_write_lat: half round trips, microseconds."""

    size: int
    iterations: int
    min_us: float
    typical_us: float
    avg_us: float
    p99_us: float
    p999_us: float


@dataclass(frozen=True)
class BandwidthFigures:
    size: int
    iterations: int
    gbps: float  # average, 1e9 bit/s (--report_gbits)
    mpps: float


def check_tool(tool: str) -> str:
    if tool not in TOOLS:
        raise UsageError(f"unknown baseline tool {tool!r}", hint=f"use one of {', '.join(TOOLS)}")
    path = shutil.which(tool)
    if path is None:
        raise PerftestFailed(f"{tool} is not installed on this node",
                             hint="install perftest (apt-get install perftest)")
    return path


def command(tool: str, gid: GidEntry, size: int, iters: int, port: int,
            server: str | None = None) -> list[str]:
    """The command line of one side; ``server`` is the address a client connects to."""
    args = [check_tool(tool), "-d", gid.device, "-i", str(gid.port), "-x", str(gid.index),
            "-s", str(size), "-n", str(iters), "-p", str(port), "-F"]
    if tool == "ib_write_bw":
        args.append("--report_gbits")
    if server is not None:
        args.append(server)
    return args


async def run(args: list[str], timeout: float) -> tuple[int, str]:
    """Run one side to completion within ``timeout``; exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        kill(proc)
        await proc.wait()
        raise PerftestFailed(f"{args[0].rsplit('/', 1)[-1]} did not finish within "
                             f"{timeout:g} s") from None
    except asyncio.CancelledError:
        kill(proc)
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def start_server(args: list[str], port: int,
                       timeout: float = LISTEN_TIMEOUT) -> asyncio.subprocess.Process:
    """The server side, once it listens on ``port``.

    Answering before it listens sent the client into perftest's "Couldn't
    connect" and a retry: a second process start, a second or more on an
    emulated CPU, for every run.
    """
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        stdin=asyncio.subprocess.DEVNULL)
    deadline = asyncio.get_running_loop().time() + timeout
    while not listening(port):
        if proc.returncode is not None:
            raise PerftestFailed(f"{args[0].rsplit('/', 1)[-1]} server exited with "
                                 f"{proc.returncode} before listening")
        if asyncio.get_running_loop().time() > deadline:
            break  # the client's own retries take over, as before
        await asyncio.sleep(LISTEN_POLL)
    return proc


def listening(port: int) -> bool:
    """Whether a TCP socket of this host listens on ``port`` (/proc/net/tcp{,6})."""
    wanted = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    # local_address is ADDR:PORT in hex; state 0A is LISTEN.
                    if len(fields) > 3 and fields[1].endswith(wanted) and fields[3] == "0A":
                        return True
        except OSError:
            continue
    return False


def kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _row(output: str, size: int) -> list[str]:
    for line in output.splitlines():
        fields = line.split()
        if fields and fields[0] == str(size) and len(fields) >= 5:
            return fields
    raise PerftestFailed(f"no result row for {size} B in perftest's output",
                         hint=output.strip()[-800:] or "perftest printed nothing")


def parse_latency(output: str, size: int) -> LatencyFigures:
    # #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
    row = _row(output, size)
    try:
        return LatencyFigures(size, int(row[1]), float(row[2]), float(row[4]), float(row[5]),
                              float(row[7]), float(row[8]))
    except (IndexError, ValueError) as exc:
        raise PerftestFailed(f"unreadable ib_write_lat row: {' '.join(row)}") from exc


def parse_bandwidth(output: str, size: int) -> BandwidthFigures:
    # #bytes #iterations BW-peak BW-average MsgRate[Mpps]
    row = _row(output, size)
    try:
        return BandwidthFigures(size, int(row[1]), float(row[3]), float(row[4]))
    except (IndexError, ValueError) as exc:
        raise PerftestFailed(f"unreadable ib_write_bw row: {' '.join(row)}") from exc
