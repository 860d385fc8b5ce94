"""``kvctl run faults``: the campaign in the lab or between two namespaces, its
report, its verdict."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvwired.experiments.plan import PlannedPhase
from kvwired.layout import RequestShape

from ..netns import HarnessError, check_can_run
from ..progress import PhaseProgress
from . import report
from .campaign import Campaign, ScenarioResult
from .deployment import Deployment, NetnsDeployment
from .scenarios import SHORT, Scenario, select


# Daemons tuned for a campaign: pools of two pushes (the iteration's, and a
# probe beside one still being reclaimed; pool-full's two hogs fill them);
# leases that wait 1 s for room; deliveries nobody claims (a decode engine
# killed before it subscribed) freed after 5 s.
def tuned(shape: RequestShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """The receiver's and the sender's settings for pushes of ``shape``."""
    pools = f"{2 * shape.total_bytes}B"
    return ({"pool_size": pools, "lease_wait": 1.0, "unclaimed_ttl": 5.0},
            {"staging_size": pools})


SHORT_ITERATIONS = 3
# The lab's daemons otherwise beat every 5 s, slack for an emulated CPU that
# rdma_rxe starves for seconds while it moves a 48 MiB cache; a peer would be
# declared lost only after 20 s, and a stopped daemon's error would surface
# that late. The campaign's pushes (make faults: 12 MiB) starve it less.
LAB_HEARTBEAT = 1.5
# The lab's other daemons wait 268 ms for an ACK (kvctl/lab/daemons.py): the
# right bound for a clean wire under four channels. The campaign's wires lose
# packets on purpose, and rdma_rxe resends only when that timer fires:
# ib_write_bw moved 12 MiB over a wire losing 5 % of its packets in about 4 s
# at ack timeout 10, 8 s at 12 and 29 s at 14. Its pushes are one channel
# each, which 17 ms serves without needless resends; not 10: 4 ms is shorter
# than a starved node takes to answer.
LAB_ACK_TIMEOUT = 12


def _deployment(where: str, workdir: Path, shape: RequestShape
                ) -> contextlib.AbstractContextManager[Deployment]:
    receiver, sender = tuned(shape)
    if where == "lab":
        from ..lab.machine import require_state
        from .lab import LabDeployment

        lab = {"heartbeat": LAB_HEARTBEAT, "ack_timeout": LAB_ACK_TIMEOUT}
        return LabDeployment(require_state(), {**receiver, **lab}, {**sender, **lab})
    reason = check_can_run()
    if reason:
        raise HarnessError(f"the fault campaign runs between two namespaces: {reason}")
    return NetnsDeployment(workdir, receiver, sender)


def planned(scenario: Scenario, iterations: int, shape: RequestShape) -> PlannedPhase:
    """A scenario's work for the progress estimate: its pushes, and a
    recovery per iteration where the fault stops a daemon or the wire."""
    disrupts = bool(scenario.action or scenario.blackout or scenario.data_cut)
    return PlannedPhase(scenario.name, iterations * shape.layers,
                        iterations * shape.total_bytes, iterations if disrupts else 0)


def run_faults(args: argparse.Namespace) -> int:
    names = list(SHORT) if args.short and not args.scenarios else args.scenarios
    iterations = SHORT_ITERATIONS if args.short else args.iterations
    shape = RequestShape(args.layers, args.layer_bytes)
    results: list[ScenarioResult] = []
    with tempfile.TemporaryDirectory(prefix="kvwire-faults-") as tmp, \
            _deployment(args.where, Path(tmp), shape) as deployment:
        scenarios = select(names, deployment.transport)
        plan = [planned(scenario, iterations, shape) for scenario in scenarios]
        with PhaseProgress(enabled=not args.quiet, plan=plan) as progress:
            campaign = Campaign(deployment, iterations, shape, seed=args.seed,
                                progress=progress.update)
            for scenario in scenarios:
                results.append(campaign.run(scenario))
    setup = {"where": args.where, "iterations": iterations, "layers": shape.layers,
             "push_bytes": shape.total_bytes}
    print(json.dumps(report.document(results, setup), indent=2) if args.json
          else report.render(results))
    if args.out is not None:
        for path in report.write(results, args.out, setup):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.clean for r in results) else 1
