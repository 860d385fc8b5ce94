"""When a lab test fails, whether the lab's wire was passing packets.

A run once lost the wire between the nodes mid-test (every later push said
"No route to host" while both nodes answered their agents), and the report
showed only the pushes' errors. A failed lab test now checks every rail; if
one is dead, the report carries what the nodes' links, neighbour tables,
kernels and consoles said, and the wire NICs are taken down and up so the
tests after it run on a wire that passes packets again (the report says
whether it did).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvctl.lab import health, machine
from kvwired.errors import KvwireError


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    if "lab" not in getattr(item, "fixturenames", ()):
        return
    state = machine.LabState.load()
    if state is None:
        return
    try:
        broken = health.broken_rails(state)
        if not broken:
            return
        text = ["the lab's wire stopped passing packets: " + "; ".join(broken),
                health.diagnose(state)]
        health.bounce(state)
        still = health.broken_rails(state)
        text.append("after the wire NICs went down and up: "
                    + ("still broken: " + "; ".join(still) if still else "passing again"))
    except KvwireError as exc:
        text = [f"the lab could not be asked about its wire: {exc}"]
    report.sections.append(("lab wire", "\n".join(text)))
