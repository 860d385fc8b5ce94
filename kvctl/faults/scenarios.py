"""The fault campaign's scenarios: one fault each, with where and when it strikes.

A scenario is data; ``campaign`` carries it out. ``at`` lists the points of
a push where the fault may strike (one is drawn per iteration): the
prefill engine's phases (opened, half: half the layers committed,
committed: before finish) or the decode engine's (subscribed, first-layer,
verified: holding the delivered request, before release).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # wire, process, resource
    what: str  # one line for the table's legend
    netem: str | None = None  # on the wire for the whole push
    blackout: float = 0.0  # seconds of 100 % loss, from the fault point
    # The data path's packets dropped without a reset from the fault point to
    # the push's end; the control connection untouched.
    data_cut: bool = False
    # The prefill engine stops waiting on finish() (asyncio.wait_for) after
    # this many seconds, aborts, and waits for the verdict.
    give_up_after: float | None = None
    target: str | None = None  # receiver, sender (daemons); prefill, decode (engines)
    action: str | None = None  # kill, stop, stall, restart, memlock, pool-full, ...
    at: tuple[str, ...] = ()
    transports: frozenset[str] = field(default_factory=lambda: frozenset({"tcp", "verbs"}))


PUSH_POINTS = ("opened", "half", "committed")
DECODE_POINTS = ("subscribed", "first-layer", "verified")

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("loss-0.1%", "wire", "0.1 % of packets lost", netem="loss 0.1%"),
    Scenario("loss-1%", "wire", "1 % of packets lost", netem="loss 1%"),
    Scenario("loss-5%", "wire", "5 % of packets lost", netem="loss 5%"),
    Scenario("delay-reorder", "wire", "1 ms delay, 0.5 ms jitter, 25 % reordered",
             netem="delay 1ms 500us reorder 25% 50%"),
    Scenario("duplicate-1%", "wire", "1 % of packets duplicated", netem="duplicate 1%"),
    Scenario("corrupt-0.1%", "wire", "0.1 % of packets corrupted (checksums must drop them)",
             netem="corrupt 0.1%"),
    Scenario("blackout-2s", "wire", "100 % loss for 2 s mid-push, then a clean wire",
             blackout=2.0, at=("half",)),
    Scenario("stalled-stream", "wire", "the data path's packets dropped without a reset "
             "mid-push (the control connection healthy): progress detection must end it",
             data_cut=True, at=("half",)),
    Scenario("kill-sender", "process", "SIGKILL of the sender daemon", target="sender",
             action="kill", at=PUSH_POINTS),
    Scenario("kill-receiver", "process", "SIGKILL of the receiver daemon",
             target="receiver", action="kill", at=(*PUSH_POINTS, "verified")),
    Scenario("kill-prefill", "process", "SIGKILL of the prefill engine", target="prefill",
             action="kill", at=PUSH_POINTS),
    Scenario("kill-decode", "process", "SIGKILL of the decode engine", target="decode",
             action="kill", at=DECODE_POINTS),
    Scenario("stop-sender", "process", "SIGSTOP of the sender past the heartbeat, SIGCONT",
             target="sender", action="stop", at=("half",)),
    Scenario("stop-receiver", "process", "SIGSTOP of the receiver past the heartbeat, "
             "SIGCONT", target="receiver", action="stop", at=("half",)),
    Scenario("cancel-wait", "process", "the prefill engine stops waiting on finish() "
             "(asyncio.wait_for), aborts, then waits for the verdict", target="prefill",
             action="cancel-wait", give_up_after=0.001, at=("committed",)),
    Scenario("restart-receiver", "process", "a clean restart of the receiver under load",
             target="receiver", action="restart", at=PUSH_POINTS),
    Scenario("restart-sender", "process", "a clean restart of the sender under load",
             target="sender", action="restart", at=PUSH_POINTS),
    Scenario("watchdog-receiver", "process", "the receiver's loop stalls (SIGSTOP): systemd's "
             "watchdog kills it and starts it again", target="receiver", action="stall",
             at=("half",)),
    Scenario("pool-full", "resource", "receive pool held full past lease_wait",
             action="pool-full"),
    Scenario("staging-full", "resource", "staging held full by other engines",
             action="staging-full"),
    Scenario("memlock-receiver", "resource", "the receiver restarted with LimitMEMLOCK=64K: "
             "it must refuse to start and say why", target="receiver", action="memlock",
             at=("half",)),
)

# A few scenarios, a few iterations: the campaign's own test in `make test`.
SHORT = ("loss-1%", "blackout-2s", "stalled-stream", "kill-receiver", "kill-decode",
         "cancel-wait", "pool-full")


def select(names: list[str] | None, transport: str) -> list[Scenario]:
    """The scenarios named (all by default) that apply to ``transport``."""
    known = {s.name: s for s in SCENARIOS}
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            from kvwired.errors import UsageError

            raise UsageError(f"no fault scenario named {', '.join(unknown)}",
                             hint=f"scenarios: {', '.join(known)}")
        chosen = [known[n] for n in names]
    else:
        chosen = list(SCENARIOS)
    return [s for s in chosen if transport in s.transports]
