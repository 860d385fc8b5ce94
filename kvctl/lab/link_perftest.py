"""perftest (ib_write_bw, ib_write_lat) between the lab nodes, run from the host.

The server runs on ``decode``, the client on ``prefill``, over one rail's rxe
device (rxe0 unless told) with the RoCE v2 GID (index 1 in the lab). This
checks the lab link itself; the baseline of an experiment is run by the
daemons (``kvwired.experiments.perftest``).
"""

from __future__ import annotations

import threading
import time

from kvwired.experiments.perftest import (
    BandwidthFigures,
    LatencyFigures,
    parse_bandwidth,
    parse_latency,
)

from .machine import NODES, LabError, LabState, run_in

GID_INDEX = "1"


def run_pair(tool: str, args: list[str], state: LabState | None = None,
             timeout: float = 90, tries: int = 3, rail: int = 0) -> str:
    """Run ``tool`` as server on decode and client on prefill; the client's output.

    perftest busy-polls, and on a one-CPU emulated node that can starve rxe's
    own processing: about one run in five never finishes (see LAB-NOTES). A
    run gets ``timeout`` seconds, and a hung one is killed and tried again.
    """
    failures = []
    for _ in range(tries):
        out, error = _attempt(tool, args, state, timeout, rail)
        if error is None:
            return out
        failures.append(error)
        for node in ("prefill", "decode"):
            run_in(node, ["pkill", "-KILL", "-x", tool], state=state)
    raise LabError(f"{tool} {' '.join(args)} failed {tries} times between the nodes:\n"
                   + "\n".join(failures))


def _attempt(tool: str, args: list[str], state: LabState | None,
             timeout: float, rail: int) -> tuple[str, str | None]:
    base = [tool, "-d", f"rxe{rail}", "-x", GID_INDEX, *args]
    decode = next(node for node in NODES if node.name == "decode").rail_address(rail)
    limit = ["timeout", "-s", "KILL", str(int(timeout))]
    server: list[tuple[int, str, str]] = []
    thread = threading.Thread(
        target=lambda: server.append(run_in("decode", [*limit, *base], state=state)),
        daemon=True)
    thread.start()
    code, out, err = 1, "", ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the server needs a moment to listen
        time.sleep(0.5)
        code, out, err = run_in("prefill", [*limit, *base, decode], state=state)
        if "Couldn't connect" not in out + err:
            break
    thread.join(timeout + 10)
    # `timeout -s KILL` kills its whole process group, itself included: the
    # node's agent then reports -9 (killed by signal 9), else 137 or 124.
    if code in (137, 124, -9):
        return out, f"timed out after {timeout:g} s"
    if code != 0 or not server or server[0][0] != 0:
        return out, f"exit {code}: {out}{err}{server[0][1] + server[0][2] if server else ''}"
    return out, None


def write_bw(size: int, iterations: int, state: LabState | None = None,
             rail: int = 0, timeout: float = 90, tries: int = 3) -> BandwidthFigures:
    out = run_pair("ib_write_bw", ["-s", str(size), "-n", str(iterations), "--report_gbits"],
                   state, timeout=timeout, tries=tries, rail=rail)
    return parse_bandwidth(out, size)


def write_lat(size: int, iterations: int, state: LabState | None = None) -> LatencyFigures:
    return parse_latency(run_pair("ib_write_lat", ["-s", str(size), "-n", str(iterations)],
                                  state), size)
