"""Carry out fault scenarios: verified pushes, one fault each, every outcome counted.

One iteration: a decode engine subscribes, a prefill engine pushes a 48 MiB
cache of seeded random bytes, and the scenario's fault strikes at its point
(the holding engine waits there until it has). Both engines report how
their side ended; the decode engine compares every delivered byte with the
seed's. Then the wire is cleaned, dead daemons are started again (as
systemd would), and probe pushes run until one is delivered byte-exact
again: the time to recovery. After the last iteration, the pools must drain
to zero.
"""

from __future__ import annotations

import contextlib
import json
import queue
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvwired.analysis import percentile
from kvwired.layout import RequestShape

from .deployment import Deployment, EngineHandle
from .engine import DECODE_PHASES, PREFILL_PHASES
from .reference import DEADLINE_FLOOR, WireReference
from .scenarios import Scenario
from .watch import PushWatch, Release, Strike

HANG = 30.0  # no event from either engine for this long (past the push's deadline): a hang
RECOVERY_LIMIT = 90.0
DECODE_GRACE = 10.0  # every failure must reach both engines within this
Event = tuple[str, float, dict[str, Any]]


@dataclass
class ScenarioResult:
    name: str
    kind: str
    transport: str
    iterations: int = 0
    attempted: int = 0
    delivered_verified: int = 0
    failed_by_class: Counter[str] = field(default_factory=Counter)
    error_seconds: list[float] = field(default_factory=list)
    recovery_seconds: list[float] = field(default_factory=list)
    corrupt_bytes: int = 0
    leaked_bytes: int = 0
    hangs: int = 0
    untyped_errors: int = 0
    split_outcomes: int = 0
    not_told: int = 0  # decode engines never told their request failed before a lease
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    not_run: str | None = None  # why, when the deployment cannot inject this fault
    # The plain tool's time for a push's bytes on this scenario's wire (wire
    # scenarios only), which set the pushes' deadline.
    reference: WireReference | None = None
    seconds: float = 0.0  # how long the scenario's iterations took, all told

    @property
    def clean(self) -> bool:
        return not (self.corrupt_bytes or self.leaked_bytes or self.hangs
                    or self.untyped_errors or self.split_outcomes or self.not_told)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "transport": self.transport,
            "iterations": self.iterations, "attempted": self.attempted,
            "delivered_verified": self.delivered_verified,
            "failed_by_class": dict(sorted(self.failed_by_class.items())),
            "error_seconds_p50": _percentile(self.error_seconds, 50),
            "error_seconds_p99": _percentile(self.error_seconds, 99),
            "recovery_seconds_p99": _percentile(self.recovery_seconds, 99),
            "corrupt_bytes": self.corrupt_bytes, "leaked_bytes": self.leaked_bytes,
            "hangs": self.hangs, "untyped_errors": self.untyped_errors,
            "split_outcomes": self.split_outcomes, "decode_not_told": self.not_told,
            "restarts": self.restarts,
            "error_seconds": self.error_seconds, "recovery_seconds": self.recovery_seconds,
            "notes": self.notes, "not_run": self.not_run, "seconds": round(self.seconds, 1),
            "wire_reference": None if self.reference is None else self.reference.to_dict(),
        }


def _percentile(values: list[float], q: float) -> float | None:
    """kvwired.analysis.percentile, or None for a scenario with no such samples."""
    return percentile(values, q) if values else None


class Engine:
    """One engine process; a thread turns its stdout into events on a shared queue."""

    def __init__(self, role: str, handle: EngineHandle, events: queue.Queue[Event],
                 hold: str | None) -> None:
        self.role, self.handle = role, handle
        self.hold = hold  # the fault's point, if this engine holds for it
        self.killed = False
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events: queue.Queue[Event]) -> None:
        for line in self.handle.lines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("e") != "pid":
                    events.put((self.role, time.monotonic(), event))
        events.put((self.role, time.monotonic(), {"e": "exit"}))

    @property
    def alive(self) -> bool:
        return self.handle.alive()

    def release(self, phase: str | None = None) -> None:
        """Let an engine held at ``phase`` (by default its fault point) go on."""
        phase = phase or self.hold
        if phase is not None:
            self.handle.release(phase)

    def kill(self) -> None:
        self.killed = True
        self.handle.kill()

    def reap(self) -> None:
        self.handle.kill()
        self._reader.join(timeout=HANG)


class Campaign:
    # The pushes' deadline: the floor, or what the scenario's wire earned.
    deadline = DEADLINE_FLOOR

    def __init__(self, deployment: Deployment, iterations: int,
                 shape: RequestShape | None = None, seed: int = 0,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        self.deployment, self.iterations = deployment, iterations
        self.shape = shape or RequestShape(24, 2 << 20)  # the reference 48 MiB cache
        self.rng = random.Random(seed)
        self.progress = progress or (lambda phase, done, total: None)

    # ------------------------------------------------------------- engines

    def _engine(self, role: str, req: str, seed: int, events: queue.Queue[Event],
                hold: str | None = None, gated: bool = False,
                extra: tuple[str, ...] = ()) -> Engine:
        """An engine process. ``gated``: a prefill engine starts with the decode
        engine (both pay their start-up at once) but holds at "connected"
        until the decode engine has subscribed."""
        argv = ["--socket", self.deployment.sockets["sender" if role == "prefill"
                                                    else "receiver"],
                "--req", req, "--seed", str(seed), "--layers", str(self.shape.layers),
                "--layer-bytes", str(self.shape.layer_bytes),
                "--deadline", str(self.deadline)]
        for phase in (["connected"] if gated else []) + ([hold] if hold else []):
            argv += ["--hold", phase]
        argv += extra
        return Engine(role, self.deployment.engine(role, argv, hold), events, hold)

    def _push(self, req: str, seed: int, decode_hold: str | None = None,
              prefill_hold: str | None = None, prefill_extra: tuple[str, ...] = (),
              at_hold: Callable[[Engine], None] | None = None
              ) -> tuple[dict[str, dict[str, Any]], float | None, bool]:
        """One verified push. Returns each side's ending, when the fault struck
        (with no fault point: when the prefill engine was let open its push,
        so engines' start-up is not counted) and whether it hung. The engines
        are reaped."""
        events: queue.Queue[Event] = queue.Queue()
        engines = {"decode": self._engine("decode", req, seed, events, decode_hold),
                   "prefill": self._engine("prefill", req, seed, events, prefill_hold,
                                           gated=True, extra=prefill_extra)}
        watch = PushWatch({role: engine.hold for role, engine in engines.items()},
                          strikes_at_hold=at_hold is not None, hang=self._hang,
                          last=time.monotonic(), decode_grace=DECODE_GRACE)
        try:
            while not watch.done:
                try:
                    role, at, event = events.get(timeout=1.0)
                except queue.Empty:
                    actions = watch.tick(time.monotonic())
                else:
                    actions = watch.event(role, at, event, time.monotonic(),
                                          killed=engines[role].killed)
                for action in actions:
                    engine = engines[action.role]
                    if isinstance(action, Release):
                        engine.release(action.phase)
                    elif isinstance(action, Strike):
                        assert at_hold is not None
                        at_hold(engine)
                    else:
                        engine.kill()
        finally:
            for engine in engines.values():
                engine.reap()
        return watch.endings, watch.struck, watch.hung

    @property
    def _hang(self) -> float:
        """Silence from both engines that counts as a hang: a push on a slow
        wire may be quiet until its deadline, and its failure then must reach
        both engines within the grace."""
        return max(HANG, self.deadline + DECODE_GRACE)

    # ------------------------------------------------------------- scenarios

    def run(self, scenario: Scenario) -> ScenarioResult:
        result = ScenarioResult(scenario.name, scenario.kind, self.deployment.transport)
        for netem in filter(None, (scenario.netem, "loss 100%" if scenario.blackout else None)):
            result.not_run = self.deployment.can_emulate(netem)
            if result.not_run:
                return result
        if scenario.action:
            result.not_run = self.deployment.supports(scenario.action)
            if result.not_run:
                return result
        restarts_before = self.deployment.restarts()
        began = time.monotonic()
        self.deadline = DEADLINE_FLOOR
        if scenario.netem:
            self.progress(scenario.name, 0, self.iterations)  # the reference is its time too
            result.reference = self._reference(scenario.netem)
            self.deadline = result.reference.deadline
        for n in range(self.iterations):
            self.progress(scenario.name, n, self.iterations)
            try:
                self._iteration(scenario, n, result)
            except BaseException:
                self.deployment.wire(None)  # never leave a fault on the wire
                if scenario.data_cut:
                    self.deployment.cut_data(False)
                raise
        self.progress(scenario.name, self.iterations, self.iterations)
        result.leaked_bytes = self._leftover_after_draining()
        result.restarts = self.deployment.restarts() - restarts_before
        result.seconds = time.monotonic() - began
        return result

    def _reference(self, netem: str) -> WireReference:
        """The plain tool's time for one push's bytes, with ``netem`` on the wire."""
        self.deployment.wire(netem)
        try:
            return self.deployment.wire_reference(self.shape.layer_bytes, self.shape.layers)
        finally:
            self.deployment.wire(None)

    def _iteration(self, scenario: Scenario, n: int, result: ScenarioResult) -> None:
        point = self.rng.choice(scenario.at) if scenario.at else None
        req = f"{scenario.name}-{n}-{uuid.uuid4().hex[:6]}"
        seed = self.rng.randrange(1 << 31)
        hogs: list[tuple[Engine, ...]] = []
        if scenario.action in ("pool-full", "staging-full"):
            hogs = self._hog(scenario.action)
        if scenario.netem:
            self.deployment.wire(scenario.netem)
        if scenario.action == "memlock" and scenario.target:
            self.deployment.lower_memlock(scenario.target)  # felt at the strike's restart
        result.iterations += 1
        result.attempted += 1
        endings, struck_at, hung = self._push(
            req, seed,
            decode_hold=point if point in DECODE_PHASES else None,
            prefill_hold=point if point in PREFILL_PHASES else None,
            prefill_extra=(() if scenario.give_up_after is None
                           else ("--give-up-after", str(scenario.give_up_after))),
            at_hold=self._striker(scenario, result) if point else None)
        for hog in hogs:
            for engine in hog:
                engine.release()
        self._end_hogs(hogs)
        if scenario.netem:
            self.deployment.wire(None)
        if scenario.data_cut:
            self.deployment.cut_data(False)
        healed = time.monotonic()
        self.deployment.supervise()
        self._account(scenario, result, endings, struck_at, hung, req)
        if not self._delivered(endings) or hung:
            recovery = self._recover(seed + 1, result)
            if recovery is None:
                result.hangs += 1
                result.notes.append(f"{req}: pushes did not succeed again within "
                                    f"{RECOVERY_LIMIT:g} s")
            else:
                result.recovery_seconds.append(recovery - healed)

    def _striker(self, scenario: Scenario, result: ScenarioResult
                 ) -> Callable[[Engine], None]:
        """What happens at the fault point; the holding engine goes on after it."""
        def strike(holder: Engine) -> None:
            deployment = self.deployment
            if scenario.target in ("prefill", "decode") and scenario.action == "kill":
                if holder.role == scenario.target:
                    holder.kill()
                    return
                holder.release()
                return
            if scenario.action == "kill" and scenario.target:
                deployment.signal(scenario.target, signal.SIGKILL)
                holder.release()
            elif scenario.action == "stop" and scenario.target:
                holder.release()
                deployment.signal(scenario.target, signal.SIGSTOP)
                # The fault's duration (past the peers' heartbeat), not a wait
                # for a condition.
                time.sleep(deployment.stop_pause)
                deployment.signal(scenario.target, signal.SIGCONT)
            elif scenario.action == "restart" and scenario.target:
                holder.release()
                deployment.restart(scenario.target)
            elif scenario.action == "stall" and scenario.target:
                deployment.stall(scenario.target)
                holder.release()
                # Until the watchdog has put the daemon down and systemd has
                # started it again, no engine of the daemon's can be told.
                deployment.supervise()
            elif scenario.action == "memlock" and scenario.target:
                holder.release()
                refusal = deployment.starve_memlock(scenario.target)
                if refusal is None:  # it started, or died without saying why
                    result.untyped_errors += 1
                    result.notes.append(f"the {scenario.target} did not refuse to start under "
                                        f"a low memlock limit:\n"
                                        f"{deployment.log_tail(scenario.target)}")
                elif not result.notes:
                    result.notes.append(f"the {scenario.target} refused: {refusal}")
            elif scenario.blackout:
                holder.release()
                deployment.wire("loss 100%")
                time.sleep(scenario.blackout)  # the blackout itself
                deployment.wire(None)
            elif scenario.data_cut:
                # Cut before the rest is committed: it is posted into a path
                # that drops it silently, until the push has ended.
                deployment.cut_data(True)
                holder.release()
            else:
                holder.release()
        return strike

    # ------------------------------------------------------------- resources

    def _hog(self, action: str) -> list[tuple[Engine, ...]]:
        """Hold the receive pool (delivered, unreleased) or the staging (opened,
        uncommitted) full with two other pushes, until the iteration ends."""
        events: queue.Queue[Event] = queue.Queue()
        hogs: list[tuple[Engine, ...]] = []
        for n in range(2):
            req = f"hog-{uuid.uuid4().hex[:6]}-{n}"
            decode = self._engine("decode", req, n, events,
                                  "verified" if action == "pool-full" else None)
            self._await(events, decode, "subscribed")
            prefill = self._engine("prefill", req, n, events,
                                   "opened" if action == "staging-full" else None)
            self._await(events, decode if action == "pool-full" else prefill,
                        "verified" if action == "pool-full" else "opened")
            hogs.append((decode, prefill))
        return hogs

    def _await(self, events: queue.Queue[Event], engine: Engine, phase: str) -> None:
        deadline = time.monotonic() + HANG
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                role, _, event = events.get(timeout=1.0)
                if role == engine.role and event["e"] == phase:
                    return
        raise RuntimeError(f"a {engine.role} engine holding resources never reached {phase}")

    def _end_hogs(self, hogs: list[tuple[Engine, ...]]) -> None:
        deadline = time.monotonic() + HANG
        for hog in hogs:
            for engine in hog:
                while engine.alive and time.monotonic() < deadline:
                    time.sleep(0.05)
                engine.reap()

    # ------------------------------------------------------------- accounting

    @staticmethod
    def _delivered(endings: dict[str, dict[str, Any]]) -> bool:
        """The prefill engine was told finished, and the decode engine was handed
        every byte as sent (whatever happened after, a crash before release say)."""
        return (endings.get("prefill", {}).get("e") == "finished"
                and endings.get("decode", {}).get("corrupt") == 0)

    def _account(self, scenario: Scenario, result: ScenarioResult,
                 endings: dict[str, dict[str, Any]], struck_at: float | None, hung: bool,
                 req: str) -> None:
        if hung:
            result.hangs += 1
            result.notes.append(f"{req}: no progress for {self._hang:g} s")
        corrupt = int(endings.get("decode", {}).get("corrupt") or 0)
        result.corrupt_bytes += corrupt
        if self._delivered(endings):
            result.delivered_verified += 1
        errors = [e for e in endings.values() if e.get("e") == "failed"]
        for error in errors:
            if not error.get("typed"):
                result.untyped_errors += 1
                result.notes.append(f"{req}: untyped {error['class']}: {error['message']}")
        exits = [role for role, e in endings.items() if e.get("e") == "exit"]
        for role in exits:
            result.untyped_errors += 1
            result.notes.append(f"{req}: the {role} engine exited without an outcome")
        if errors:
            first = min(errors, key=lambda e: e["at"])
            result.failed_by_class[first["class"]] += 1
            if struck_at is not None:
                result.error_seconds.append(max(0.0, first["at"] - struck_at))
        # One outcome at both ends: finished at prefill exactly when delivered at
        # decode (unless the scenario killed one of the two engines).
        prefill, decode = endings.get("prefill", {}), endings.get("decode", {})
        if decode.get("e") == "not-told":
            result.not_told += 1
        elif "killed" not in (prefill.get("e"), decode.get("e")):
            finished, delivered = prefill.get("e") == "finished", "corrupt" in decode
            if finished != delivered:
                result.split_outcomes += 1
                result.notes.append(
                    f"{req}: prefill {prefill.get('e')} "
                    f"({prefill.get('class', '')}: {prefill.get('message', '')}), decode "
                    f"{'delivered' if delivered else decode.get('e')} "
                    f"({decode.get('class', '')}: {decode.get('message', '')})")

    def _recover(self, seed: int, result: ScenarioResult) -> float | None:
        """Probe pushes until one is delivered byte-exact; when it was."""
        deadline = time.monotonic() + RECOVERY_LIMIT
        while time.monotonic() < deadline:
            self.deployment.supervise()
            req = f"probe-{uuid.uuid4().hex[:6]}"
            endings, _, hung = self._push(req, seed)
            if hung:
                result.hangs += 1
                result.notes.append(f"{req} (after the fault): no progress for "
                                    f"{self._hang:g} s, "
                                    f"{endings}")
            if self._delivered(endings):
                return time.monotonic()
            time.sleep(0.5)  # between probes: a daemon may still be coming up
        return None

    def _leftover_after_draining(self, patience: float = 45.0) -> int:
        """Pool bytes still held once every request has ended (waits for
        reclaiming: engines gone, unclaimed deliveries)."""
        deadline = time.monotonic() + patience
        while True:
            used = sum(self.deployment.pool_used().values())
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.5)
