"""The sender's unix API: one ``EngineSession`` per prefill engine connection.

An engine opens pushes, commits layers and aborts; it hears ``opened``,
``sent`` per layer placed, then ``finished`` or ``failed``, once per request.
``kvctl run`` uses the same socket to run an experiment in the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from .. import verdicts
from ..errors import (
    DaemonUnavailable,
    DuplicateRequest,
    KvwireError,
    RequestAborted,
    UsageError,
    internal_error,
)
from ..protocol import Failed, Handlers, Message
from ..protocol import control as ctl
from ..protocol import sender_local as local
from ..tasks import TaskSet
from .push import Delivery, Push

log = structlog.get_logger("kvwired.sender")

OpenPush = Callable[[local.Open], Awaitable[Push]]
# (request, receiver, lease) -> the receiver's verdict, None if it could not be asked.
AskVerdict = Callable[[str, str, int], Awaitable[ctl.Verdict | None]]
RunExperiment = Callable[[str, str, dict[str, Any], Callable[[Message], None]],
                         Coroutine[Any, Any, None]]


class EngineSession:
    """What one connected engine has open, and the messages it is owed."""

    def __init__(self, send: Callable[[Message], None], open_push: OpenPush,
                 run_experiment: RunExperiment, ask_verdict: AskVerdict) -> None:
        self._send = send
        self._open_push = open_push
        self._run_experiment = run_experiment
        self._ask_verdict = ask_verdict
        self.pushes: dict[str, Push] = {}  # open: commits and aborts go to them
        # Ended, their staging held until the engine says it dropped its views.
        self.viewed: dict[str, Push] = {}
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.gone = False
        # Its opens and experiments (``runs``), and its asks. Opens are not
        # cancelled when the engine leaves: one that ends after is aborted
        # (see _open); experiments and asks are.
        self.tasks = TaskSet("prefill engine")
        self._asks = TaskSet("prefill engine's asks")
        handlers = self._handlers = Handlers[None]("a prefill engine")
        handlers.on(local.Open, lambda _, msg: self.tasks.spawn(self._open(msg),
                                                                f"open-{msg.req}"))
        handlers.on(local.Run, lambda _, msg: self._run(msg))
        handlers.on(local.Ask, lambda _, msg: self._asks.spawn(
            self._ask(msg.req, msg.peer, msg.lease), f"ask-{msg.req}"))
        handlers.on(local.Dropped, lambda _, msg: self._dropped(msg.req))
        handlers.on(local.Commit, lambda _, msg: self._with_push(
            msg.req, lambda push: push.commit(msg.layer)))
        handlers.on(local.Abort, lambda _, msg: self._with_push(
            msg.req, lambda push: push.abort(RequestAborted(
                f"the prefill engine aborted request {msg.req}"))))

    def send(self, msg: Message) -> None:
        if not self.gone:
            self._send(msg)

    def handle(self, msg: Message) -> None:
        """Take one message from the engine."""
        self._handlers(None, msg)

    def _with_push(self, req: str, then: Callable[[Push], None]) -> None:
        if (push := self.pushes.get(req)) is None:
            self.send(Failed(req=req, error=UsageError(
                f"no open request {req!r} on this connection",
                hint="open it first; a failed request must be opened again").to_wire()))
        else:
            then(push)

    def _dropped(self, req: str) -> None:
        if (ended := self.viewed.pop(req, None)) is not None:
            ended.drop_views()

    async def _open(self, msg: local.Open) -> None:
        req = msg.req
        try:
            push = await self._open_push(msg)
        except KvwireError as exc:
            log.info("push refused", req=req, peer=msg.peer, reason=str(exc))
            self.send(Failed(req=req, error=exc.to_wire()))
            return
        if self.gone:
            push.abort(RequestAborted(
                f"the prefill engine disconnected while request {req} was being opened"))
            push.drop_views()
            return
        self.pushes[req] = push
        push.on_sent = lambda layer: self.send(local.Sent(req=req, layer=layer))
        self.send(local.Opened(req=req, peer=push.link.name, offset=push.staging.offset,
                               chunk_bytes=push.chunk_bytes, lease=push.lease))
        push.outcome.add_done_callback(lambda outcome: self._ended(push, outcome))

    def _ended(self, push: Push, outcome: asyncio.Future[Delivery]) -> None:
        self.pushes.pop(push.req, None)
        if self.gone:
            push.drop_views()
        else:
            self.viewed[push.req] = push
        error = outcome.exception()
        if error is None:
            delivery = outcome.result()
            self.send(local.Finished(req=push.req, checksum=delivery.checksum,
                                     timings=delivery.timings))
        else:
            if not isinstance(error, KvwireError):
                error = internal_error(error, "sender daemon")
            self.send(Failed(req=push.req, error=error.to_wire()))

    async def _ask(self, req: str, peer: str, lease: int) -> None:
        """A request of a daemon before this one (it died or was restarted after
        the engine committed every layer): the receiver's verdict, as its
        ``finished`` or ``failed``, so the engine never guesses."""
        try:
            answer = await self._ask_verdict(req, peer, lease)
        except KvwireError as exc:
            self.send(Failed(req=req, error=exc.to_wire()))
            return
        verdict = None if answer is None else verdicts.from_message(answer)
        if verdict is not None and verdict.delivered:
            self.send(local.Finished(req=req, checksum=verdict.checksum,
                                     timings={"late": 0.0, "asked_after_restart": 1.0}))
        elif verdict is not None and verdict.error is not None:
            self.send(Failed(req=req, error=verdict.error.to_wire()))
        else:
            self.send(Failed(req=req, error=DaemonUnavailable(
                f"the sender daemon stopped while request {req} was in flight, and "
                f"receiver {peer} " + ("has no record of it: it was not delivered"
                                       if answer is not None else "could not be asked"),
                hint="push it again").to_wire()))

    def _run(self, msg: local.Run) -> None:
        req = msg.req
        if req in self.runs:
            self.send(Failed(req=req, error=DuplicateRequest(
                f"experiment {req} is already running").to_wire()))
            return
        task = self.tasks.spawn(self._run_experiment(req, msg.experiment, msg.params, self.send),
                     f"run-{req}")
        self.runs[req] = task
        task.add_done_callback(lambda _: self.runs.pop(req, None))

    def closed(self) -> None:
        """The engine left: its experiments stop, its pushes are aborted."""
        self.gone = True
        for run in self.runs.values():
            run.cancel()
        self._asks.cancel()
        for push in list(self.pushes.values()):
            push.abort(RequestAborted(
                f"the prefill engine disconnected before request {push.req} was delivered"))
            push.drop_views()  # its process has closed or lost its mappings with it
        for push in self.viewed.values():
            push.drop_views()
        self.viewed.clear()
