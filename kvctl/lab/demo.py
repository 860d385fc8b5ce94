"""``kvctl demo lab`` (``make demo``): the experiments between two Soft-RoCE nodes.

Boots the lab (unless one is up), installs and starts
``kvwired-receiver.service`` on ``decode`` and ``kvwired-sender.service`` on
``prefill`` under the nodes' systemd (verbs over rxe0), then on the prefill
node, as a user would there: ``kvctl probe``, ``kvctl run chunk-sweep --baseline perftest``
and ``kvctl run overlap``. Then the same daemons over the TCP transport run
``kvctl run chunk-sweep --baseline socket`` on the same wire: kvwire's TCP
path against a plain socket loop between the same nodes. The figures,
CSV/JSON and plots land in ``results/`` on the host (the TCP sweep's in
``results/tcp/``), with a summary; the lab goes down again if the demo
booted it. Each step's output reaches the host as the node prints it.

The demo fits ten minutes of a quiet 2-core host (Soft-RoCE under emulation
moves 0.1 to 0.3 Gb/s); ``--full`` adds the round trips at 48 MiB. Where
the time goes, and what was cut: docs/reading-the-demo.md, "How long, and why".
"""

from __future__ import annotations

import codecs
import concurrent.futures
import contextlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from kvwired.units import format_clock, format_size

from ..figures import NOISE_NOTE, cpu_lines, knee_certainty, ratio_spread, speedup_text, times
from ..progress import BARS_VARIABLE
from . import cpu_speed, machine
from .daemons import DECODE_ADDRESS, ServiceDaemon, receiver_config, sender_config
from .machine import SHARED_DIR, LabError, LabState, exec_in

SWEEP_ARGS = ("--iters", "300", "--latency-bytes", "32MiB", "--stream-bytes", "32MiB",
              "--baseline", "perftest")
# By default the round trips stop at 8 MiB: at 48 MiB one is the cache moved
# twice (streaming and the delivery give that), and ib_write_lat's three
# runs of five took 2 min 40 s of an 8-minute sweep. --full keeps them.
LATENCY_UP_TO = ("--latency-up-to", "8MiB")
# Qwen2.5-0.5B prefill of 4,096 tokens is about 0.12 TFLOP per layer; at an
# effective 200 TFLOP/s (an H100 at half its dense fp16 peak) that is 0.6 ms
# a layer: the compute time the overlap experiment places the deployment at.
LAYER_COMPUTE = "0.6ms"
# Medians of three: at the ridge two buffers leave no slack, so one slow
# layer on the emulated nodes moves a pair's ratio by a tenth.
OVERLAP_ARGS = ("--ratios", "0,0.5,1,2,4", "--repeats", "3", "--layer-compute", LAYER_COMPUTE)
# kvwire's TCP transport against the plain loop on the wire: a layer's chunk
# and the whole cache (a 512 B loop is 98,304 Python calls per round there).
TCP_SWEEP_ARGS = ("--sizes", "2MiB,48MiB", "--iters", "20", "--latency-bytes", "8MiB",
                  "--stream-bytes", "8MiB", "--baseline", "socket")


def _kvctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", *args]


class Relay:
    """A node's output, shown on the host as it arrives and kept for the summary."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def write(self, data: bytes) -> int:
        text = self._decoder.decode(data)
        self.text += text
        self._out.write(text)
        return len(data)

    def flush(self) -> None:
        self._out.flush()


def run_step(state: LabState, title: str, argv: list[str], out: TextIO) -> str:
    """``argv`` on the prefill node, its progress and figures streamed to ``out``
    while it runs; its standard output, for the summary."""
    print(f"\n== {title}", file=out, flush=True)
    started = time.monotonic()
    stdout, stderr = Relay(out), Relay(out)
    # Unbuffered: the figures come out in order with the progress on stderr;
    # on a terminal, the node draws its bars for this one.
    env = {"PYTHONUNBUFFERED": "1"}
    if out.isatty():
        env.update({BARS_VARIABLE: "1", "COLUMNS": str(shutil.get_terminal_size().columns)})
    code = exec_in("prefill", argv, stdout=stdout, stderr=stderr, state=state, env=env)
    if code != 0:
        raise LabError(f"{title} failed (exit {code}):\n{stderr.text.strip()[-2000:]}")
    print(f"({format_clock(time.monotonic() - started)} for this step)", file=out, flush=True)
    return stdout.text


def lab_demo(results: Path = Path("results"), out: TextIO = sys.stdout,
             full: bool = False) -> Path:
    began = time.monotonic()
    state, health = machine.status()
    started_here = state is None or "up" not in health.values()
    if started_here:
        print("booting the two-node Soft-RoCE lab ...", file=out, flush=True)
        state = machine.up()
        print(f"lab up in {state.booted_seconds:.1f} s", file=out, flush=True)
    assert state is not None
    node_results = SHARED_DIR / "results"
    shutil.rmtree(node_results, ignore_errors=True)
    node_results.mkdir(parents=True)
    sections = []
    try:
        # As on real nodes: make install, then systemd runs the shipped units.
        rx = ServiceDaemon("decode", "receiver", receiver_config(), state)
        tx = ServiceDaemon("prefill", "sender", sender_config(), state)
        print("starting kvwired-receiver.service (decode) and kvwired-sender.service "
              "(prefill) under systemd, over verbs ...", file=out, flush=True)
        with _serving(rx, tx):
            out_flag = ("--out", str(node_results))
            sections.append(run_step(state, "kvctl probe (prefill node)", _kvctl(
                "probe", "--to", DECODE_ADDRESS, *out_flag), out))
            sections.append(run_step(state, "kvctl run chunk-sweep --baseline perftest", _kvctl(
                "run", "chunk-sweep", "--socket", tx.socket, *SWEEP_ARGS,
                *(() if full else LATENCY_UP_TO), *out_flag), out))
            sections.append(run_step(state, "kvctl run overlap", _kvctl(
                "run", "overlap", "--socket", tx.socket, *OVERLAP_ARGS, *out_flag), out))
        sections.append(_tcp_against_socket_loop(state, node_results / "tcp", out))
        # To read the nodes' CPU per write as one of this host's cores.
        slowdown = cpu_speed.slowdown(state, "prefill")
        (node_results / "cpu-speed.json").write_text(json.dumps(
            {"node": "prefill", "slowdown": slowdown, "loop": cpu_speed.LOOP}) + "\n")
        # Before the lab goes down: its shared directory goes with it.
        results.mkdir(parents=True, exist_ok=True)
        shutil.copytree(node_results, results, dirs_exist_ok=True)
    finally:
        if started_here:
            machine.down()
    summary = _summary(results, time.monotonic() - began)
    (results / "summary.txt").write_text("\n\n".join(sections) + "\n\n" + summary + "\n")
    print("\n" + summary, file=out)
    print(f"\nresults: {results.resolve()}/ (summary.txt, CSV, JSON, PNG plots)", file=out)
    return results


def _tcp_against_socket_loop(state: LabState, out_dir: Path, out: TextIO) -> str:
    """The daemons again, over TCP on the same wire, against the plain socket loop."""
    rx = ServiceDaemon("decode", "receiver", receiver_config(transport="tcp"), state)
    tx = ServiceDaemon("prefill", "sender", sender_config(transport="tcp"), state)
    print("\nrestarting both daemons over the TCP transport, same wire ...", file=out,
          flush=True)
    with _serving(rx, tx):
        return run_step(state, "kvctl run chunk-sweep --baseline socket (transport tcp)",
                     _kvctl("run", "chunk-sweep", "--socket", tx.socket, *TCP_SWEEP_ARGS,
                            "--out", str(out_dir)), out)


@contextlib.contextmanager
def _serving(rx: ServiceDaemon, tx: ServiceDaemon) -> Iterator[None]:
    """Receiver and sender started under the nodes' systemd, stopped after.

    Side by side: each node has its own CPU, and a daemon's start on an
    emulated one (its install, Python's imports, the TLS handshake's keys)
    takes half a minute; the sender reaches its receiver at the first
    request, not at start.
    """
    with concurrent.futures.ThreadPoolExecutor(2) as both:
        starting = [both.submit(daemon.start) for daemon in (rx, tx)]
        try:
            for started in starting:
                started.result()
            yield
        finally:
            for stopped in [both.submit(daemon.stop) for daemon in (tx, rx)]:
                stopped.result()


def _summary(results: Path, seconds: float) -> str:
    sweep = json.loads((results / "chunk-sweep.json").read_text())
    overlap = json.loads((results / "overlap.json").read_text())
    s, o = sweep["summary"], overlap["summary"]
    lines = ["== summary (Soft-RoCE between two emulated nodes: read ratios, not absolutes; "
             "each ratio is the median of its rounds, lowest\N{EN DASH}highest round after it)",
             f"knee: {format_size(s['knee_bytes'])} ({knee_certainty(s)}); peak streaming "
             f"{s['peak_gbps']:.3f} Gb/s; recommended chunk "
             f"{format_size(s['recommended_chunk_bytes'])} ({s['recommendation']})"]
    said = []
    for ratio in sweep["ratios"]:
        figures = [f"{what} {times(ratio_spread(ratio, key))}"
                   for what, key in (("latency", "latency_ratio"),
                                     ("bandwidth", "bandwidth_ratio"))
                   if ratio.get(key) is not None]  # no round trips beyond 8 MiB
        said.append(f"kvwire / perftest at {format_size(ratio['size'])}: {', '.join(figures)}")
    said.append(f"overlap: T_x {o['transfer_per_layer_s'] * 1e3:.1f} ms per 2 MiB layer; peak "
                f"speedup {speedup_text(o)} at Tc/Tx = {o['peak_speedup_ratio']:g} "
                f"({o['peak_efficiency']:.0%} of ideal; the link's T_x spread caps it at "
                f"{o['peak_ceiling_speedup']:.2f})")
    tcp = results / "tcp" / "chunk-sweep.json"
    if tcp.exists():
        for ratio in json.loads(tcp.read_text())["ratios"]:
            if ratio.get("delivery_time_ratio") is None:
                continue
            said.append(f"kvwire tcp / plain socket loop on the wire, 48 MiB in "
                        f"{format_size(ratio['size'])} writes: time "
                        f"{times(ratio_spread(ratio, 'delivery_time_ratio'))}")
    lines += said
    if any("within the spread" in line for line in said):
        lines.append(NOISE_NOTE)
    speed = results / "cpu-speed.json"
    slowdown = json.loads(speed.read_text())["slowdown"] if speed.exists() else None
    lines += cpu_lines(sweep["rows"], slowdown)
    if "deployment_side" in o:
        lines.append(f"at {LAYER_COMPUTE} compute per layer this link is {o['deployment_side']}: "
                     f"{o['deployment_meaning']}")
    lines.append(f"demo took {seconds / 60:.1f} min")
    return "\n".join(lines)
