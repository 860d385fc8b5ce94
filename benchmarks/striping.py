"""One QP against four, one rail against two: the 48 MiB push side by side.

Needs a two-rail lab (`kvctl lab up --rails 2`); run from the checkout on the
host: `python benchmarks/striping.py`. One receiver on the decode node; one
sender per setup on the prefill node, all up at once, so each round pushes
through every setup in turn and drift hits them alike. Each push is
`kvctl push` on the prefill node (the real client, seeded bytes), timed by
it; the medians are reported with their ratio to the one-QP, one-rail setup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from kvctl.lab import machine
from kvctl.lab.daemons import NodeDaemon, receiver_config, sender_config

SETUPS: dict[str, dict[str, Any]] = {
    "1 QP, 1 rail": {"qps_per_peer": 1},
    "4 QPs, 1 rail": {"qps_per_peer": 4},
    "2 QPs, 2 rails": {"qps_per_peer": 2, "rails": ["rxe0", "rxe1"]},
    "4 QPs, 2 rails": {"qps_per_peer": 4, "rails": ["rxe0", "rxe1"]},
}


def _push(state: machine.LabState, socket: str, chunk: str, req: str) -> float:
    code, out, err = machine.run_in("prefill", [
        sys.executable, "-m", "kvctl", "push", "--socket", socket, "--peer", "decode",
        "--req", req, "--chunk", chunk, "--json"], state=state)
    if code != 0:
        raise SystemExit(f"push {req} failed: {err.strip()[-1000:]}")
    (record,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(record["seconds"])


def main(rounds: int, chunks: list[str]) -> dict[str, Any]:
    state = machine.require_state()
    if state.rails < 2:
        raise SystemExit("this compares rails: `kvctl lab down; kvctl lab up --rails 2`")
    receiver = NodeDaemon("decode", "receiver", receiver_config(
        # Nobody consumes these: each is reclaimed half a second after delivery.
        transport="verbs", pool_size="256MiB", unclaimed_ttl=0.5), state).start()
    senders = {}
    try:
        for number, (name, extra) in enumerate(SETUPS.items()):
            senders[name] = NodeDaemon("prefill", "sender", sender_config(
                f"prefill-bench-{number}", transport="verbs", metrics="0.0.0.0:0",
                staging_size="64MiB", **extra), state).start()
        times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in SETUPS} for c in chunks}
        for round_number in range(rounds):
            for chunk in chunks:
                for number, (name, sender) in enumerate(senders.items()):
                    times[chunk][name].append(_push(
                        state, sender.socket, chunk, f"bench-{chunk}-{number}-{round_number}"))
    finally:
        for sender in senders.values():
            sender.stop()
        receiver.stop()
    report: dict[str, Any] = {"rounds": rounds, "bytes": 48 << 20, "chunks": {}}
    for chunk, by_setup in times.items():
        baseline = statistics.median(by_setup["1 QP, 1 rail"])
        report["chunks"][chunk] = {
            name: {"median_ms": statistics.median(samples) * 1e3,
                   "gbps": (48 << 20) * 8 / statistics.median(samples) / 1e9,
                   "x_one_qp": statistics.median(samples) / baseline,
                   "samples_ms": [s * 1e3 for s in samples]}
            for name, samples in by_setup.items()}
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", default="per-layer,whole,per-token")
    args = parser.parse_args()
    result = main(args.rounds, args.chunks.split(","))
    print(json.dumps(result, indent=2))
    print(f"\n48 MiB push over verbs in the lab, median of {args.rounds} "
          "(x: time against 1 QP on 1 rail; lower is faster)")
    for chunk, by_setup in result["chunks"].items():
        for name, row in by_setup.items():
            print(f"{chunk:<12} {name:<16} {row['median_ms']:8.0f} ms  {row['gbps']:.3f} Gb/s"
                  f"  x{row['x_one_qp']:.2f}")
