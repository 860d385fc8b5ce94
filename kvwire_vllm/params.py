"""What travels in vLLM's ``kv_transfer_params``, and the connector's settings.

The proxy asks the prefill engine for a push:

    {"do_remote_decode": true, "kvwire_transfer": ID,
     "kvwire_receiver": NAME | null, "kvwire_deadline": SECONDS}

and the decode engine is asked, at the same time, to load it:

    {"do_remote_prefill": true, "kvwire_transfer": ID, "kvwire_deadline": S}

so it subscribes before the push lands and copies the moment it does. The
prefill engine's answer (``request_finished``) carries the same, with
``"kvwire_tokens": N``, the seconds left and ``"kvwire_layout": {...}``
(kvwire_vllm.shards.EngineLayout), for a proxy that asks the decode engine
only after the prefill engine answered (as vLLM's toy proxy does): the
decode engine then checks the layout when it plans the load.

Each may carry ``"kvwire_trace": TRACEPARENT``: the proxy traces the request
(kvwired.tracing), and both engines record their part in the same trace.

``ID`` is the push's request id at the daemons; ``NAME`` the receiver as the
prefill node's sender daemon knows it (null: its only one; "auto": chosen by
the registry); ``N`` the prompt tokens pushed (the whole prompt; 0: nothing was pushed,
the decode engine computes the prompt itself; left out: the whole prompt).

Plain Python with no vLLM in it, so it is tested with the daemons' suite.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwired import tracing

# How long past the push's deadline a decode engine waits for the receiver's
# verdict before it gives up on its own (the receiver decides first): the
# grace a prefill engine gives its sender daemon's verdict too.
from kvwired.client import VERDICT_GRACE
from kvwired.errors import ConfigError, UsageError

from .shards import EngineLayout

DEFAULT_DEADLINE = 20.0  # seconds a push may take, prefill's start to delivery
DEFAULT_IDLE_WAIT = 0.005
MAX_IDLE_WAIT = 0.1
MAX_DEADLINE = 3600.0
_TRANSFER = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


def new_transfer_id() -> str:
    return f"kvw-{uuid.uuid4().hex}"


def _deadline(value: object, where: str) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value) or not 0 < value <= MAX_DEADLINE):
        raise UsageError(f"{where}: kvwire_deadline {value!r} is not a number of seconds",
                         hint=f"give seconds in (0, {MAX_DEADLINE:g}]")
    return float(value)


def _trace(params: Mapping[str, Any]) -> str | None:
    """The request's trace (kvwired.tracing), when it carries one kvwire can
    continue: a malformed one starts no error, as W3C trace context asks."""
    trace = params.get("kvwire_trace")
    return trace if tracing.is_traceparent(trace) else None


def _transfer(value: object, where: str) -> str:
    if not isinstance(value, str) or not _TRANSFER.match(value):
        raise UsageError(f"{where}: kvwire_transfer {value!r} is not a transfer id",
                         hint="1 to 200 characters of letters, digits and ._:- "
                              "(the proxy makes one per request)")
    return value


@dataclass(frozen=True)
class PushOrder:
    """What a prefill engine is asked to push, and where."""

    transfer: str
    receiver: str | None
    deadline: float
    trace: str | None = None  # the request's traceparent, when the proxy traces it

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None,
                    default_deadline: float) -> PushOrder | None:
        """The order in a request's params; None when it asks for no push."""
        if not params or not params.get("do_remote_decode"):
            return None
        where = "a request for remote decode"
        receiver = params.get("kvwire_receiver")
        if receiver is not None and (not isinstance(receiver, str) or not receiver):
            raise UsageError(f"{where}: kvwire_receiver {receiver!r} is not a receiver name",
                             hint="name a receiver of the sender daemon's [peers], "
                                  "\"auto\", or leave it out for its only one")
        transfer = params.get("kvwire_transfer")
        return cls(_transfer(transfer, where) if transfer is not None else new_transfer_id(),
                   receiver,
                   _deadline(params.get("kvwire_deadline", default_deadline), where),
                   _trace(params))

    def answer(self, tokens: int, seconds_left: float,
               layout: EngineLayout | None = None) -> dict[str, Any]:
        """The params a decode engine needs, as ``request_finished`` returns them."""
        params: dict[str, Any] = {
            "do_remote_prefill": True, "kvwire_transfer": self.transfer,
            "kvwire_tokens": tokens,
            "kvwire_deadline": round(min(max(seconds_left, 0.001), MAX_DEADLINE), 3)}
        if layout is not None:
            params["kvwire_layout"] = layout.to_params()
        if self.trace is not None:
            params["kvwire_trace"] = self.trace
        return params


@dataclass(frozen=True)
class LoadOrder:
    """What a decode engine is told to load."""

    transfer: str
    tokens: int | None  # None: the whole prompt (asked before the prefill engine answered)
    deadline: float  # seconds the decode engine gives the push
    layout: EngineLayout | None = None  # the prefill engine's, once it answered
    trace: str | None = None  # the request's traceparent, when the proxy traces it

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> LoadOrder | None:
        """The order in a request's params; None when it asks for no load."""
        if not params or not params.get("do_remote_prefill"):
            return None
        where = "a request for remote prefill"
        tokens = params.get("kvwire_tokens")
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)
                                   or tokens < 0):
            raise UsageError(f"{where}: kvwire_tokens {tokens!r} is not a token count",
                             hint="pass the prefill engine's kv_transfer_params unchanged")
        layout = params.get("kvwire_layout")
        return cls(_transfer(params.get("kvwire_transfer"), where), tokens,
                   _deadline(params.get("kvwire_deadline"), where),
                   EngineLayout.from_params(layout, where) if layout is not None else None,
                   _trace(params))

    @property
    def wait(self) -> float:
        """How long the decode engine waits for the delivery at most."""
        return self.deadline + VERDICT_GRACE


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, checked."""

    sender_socket: str | None = None  # None: $KVWIRE_SENDER_SOCKET, then the default
    receiver_socket: str | None = None
    receiver: str | None = None  # the default receiver for pushes that name none
    deadline: float = DEFAULT_DEADLINE
    # Seconds a decode engine's step that computes nothing waits for a load
    # to end, rather than spin (kvwire_vllm.consumer); 0: spin, as vLLM does.
    idle_wait: float = DEFAULT_IDLE_WAIT

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {"sender_socket", "receiver_socket", "receiver", "deadline", "idle_wait"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}",
                              hint=f"kvwire's connector takes {', '.join(sorted(known))}")
        for key in ("sender_socket", "receiver_socket", "receiver"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ConfigError(f"kv_connector_extra_config: {key} must be a string")
        try:
            deadline = _deadline(extra.get("deadline", DEFAULT_DEADLINE),
                                 "kv_connector_extra_config")
        except UsageError as exc:
            raise ConfigError(exc.message, hint=exc.hint) from None
        idle_wait = extra.get("idle_wait", DEFAULT_IDLE_WAIT)
        if (not isinstance(idle_wait, int | float) or isinstance(idle_wait, bool)
                or not 0 <= idle_wait <= MAX_IDLE_WAIT):
            raise ConfigError(f"kv_connector_extra_config: idle_wait {idle_wait!r} is not "
                              "a number of seconds",
                              hint=f"give seconds in [0, {MAX_IDLE_WAIT:g}] (0: spin while "
                                   "loads are pending, as vLLM does)")
        return cls(extra.get("sender_socket"), extra.get("receiver_socket"),
                   extra.get("receiver"), deadline, float(idle_wait))
