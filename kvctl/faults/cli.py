"""``kvctl run faults``: the campaign in the lab or between two namespaces, its
report, its verdict."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from kvwired.layout import RequestShape

from ..netns import HarnessError, check_can_run
from ..run.progress import PhaseProgress
from . import report
from .campaign import Campaign, ScenarioResult
from .deployment import Deployment, NetnsDeployment
from .scenarios import SHORT, select

# Daemons tuned for a campaign: room for the iteration's push and two that
# hold a pool full; leases that wait 1 s for room; deliveries nobody claims
# (a decode engine killed before it subscribed) freed after 5 s.
RECEIVER = {"pool_size": "96MiB", "lease_wait": 1.0, "unclaimed_ttl": 5.0}
SENDER = {"staging_size": "96MiB"}
SHORT_ITERATIONS = 3


def _deployment(where: str, workdir: Path) -> contextlib.AbstractContextManager[Deployment]:
    if where == "lab":
        from ..lab.machine import require_state
        from .lab import LabDeployment

        return LabDeployment(require_state(), RECEIVER, SENDER)
    reason = check_can_run()
    if reason:
        raise HarnessError(f"the fault campaign runs between two namespaces: {reason}")
    return NetnsDeployment(workdir, RECEIVER, SENDER)


def run_faults(args: argparse.Namespace) -> int:
    names = list(SHORT) if args.short and not args.scenarios else args.scenarios
    iterations = SHORT_ITERATIONS if args.short else args.iterations
    results: list[ScenarioResult] = []
    with tempfile.TemporaryDirectory(prefix="kvwire-faults-") as tmp, \
            _deployment(args.where, Path(tmp)) as deployment, \
            PhaseProgress(enabled=not args.quiet) as progress:
        campaign = Campaign(deployment, iterations, RequestShape(args.layers, args.layer_bytes),
                            seed=args.seed, progress=progress.update)
        for scenario in select(names, deployment.transport):
            results.append(campaign.run(scenario))
    print(json.dumps(report.document(results), indent=2) if args.json
          else report.render(results))
    if args.out is not None:
        for path in report.write(results, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.clean for r in results) else 1
