"""The one exception hierarchy of kvwire.

Every error a user can cause says what happened and what to do. Errors that
cross a socket (control protocol, local APIs) travel as a ``code`` plus a
message and are rebuilt on the other side as the same class, so a caller of
the client library can ``except PoolFull`` whether the pool that was full is
local or on a decode node two hops away.

A class registers its code as it is defined (``__init_subclass__``, as
asyncpg's exceptions do), wherever it is defined: the registry cannot miss a
class that a module outside this one adds, and two classes cannot claim one
code. Errors that mean "too late" or "the other side is gone" also subclass
the matching built-ins (``TimeoutError``, ``ConnectionError``, as aiohttp's
client exceptions do), so generic handlers treat them right.

Each error says whether trying the same thing again can help (``retriable``,
as aiokafka's do): a full pool, a lost peer or a missed deadline may pass; a
wrong key, a bad config or a request larger than the pool will not. It
crosses the wire beside ``status``, so an engine decides on the error as the
daemon that raised it saw it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, ClassVar

_BY_CODE: dict[str, type[KvwireError]] = {}


class FailureStatus(StrEnum):
    """How a data path failed: a transport error's ``status``, the label of
    ``kvwire_completion_errors_total`` and ``kvwire_rail_errors_total``, and
    whether a new data channel under the live control connection can ride
    the failure out (``replaceable``). The verbs names are libibverbs' work
    completion statuses; an unknown one is reported as ``status_N``."""

    TRANSPORT_ERROR = "transport_error"  # a failure with no more precise name
    CONNECTION_LOST = "connection_lost"
    STALLED = "stalled"  # writes pending, none completing, for the stall bound
    RAIL_FAILED = "rail_failed"
    RAIL_LEFT_OUT = "rail_left_out"  # moved off a rail that failed under another channel
    RETRY_EXCEEDED = "retry_exceeded"
    RNR_RETRY_EXCEEDED = "rnr_retry_exceeded"
    REMOTE_ACCESS = "remote_access"
    REMOTE_OPERATION = "remote_operation"
    REMOTE_INVALID_REQUEST = "remote_invalid_request"
    LOCAL_PROTECTION = "local_protection"
    LOCAL_LENGTH = "local_length"
    LOCAL_QP_OPERATION = "local_qp_operation"
    FLUSHED = "flushed"
    GENERAL = "general"

    @property
    def replaceable(self) -> bool:
        """The wire's failure, which a fresh channel can ride out: packets lost
        for longer than the queue pair's retries, a broken stream, a silent
        channel, a rail left out, or a responder that refused the request
        stream (rdma_rxe does, now and then, after retransmitting from the
        middle of a message: a fresh queue pair starts its sequence clean).
        A write under a wrong key (remote_access) is a bug or an attack, and
        a local error is this host's: never ridden out."""
        return self in _REPLACEABLE

    @property
    def rail_unanswered(self) -> bool:
        """The peer did not acknowledge on the channel's rail: the rail is
        left out until it proves itself again."""
        return self in (FailureStatus.RETRY_EXCEEDED, FailureStatus.STALLED)

    @classmethod
    def of(cls, error: BaseException) -> FailureStatus | None:
        """``error``'s status (transport_error for a failure that is not
        kvwire's), or None for a name outside this vocabulary."""
        status = error.status if isinstance(error, KvwireError) else cls.TRANSPORT_ERROR
        try:
            return cls(status)
        except ValueError:
            return None


_REPLACEABLE = frozenset({
    FailureStatus.TRANSPORT_ERROR, FailureStatus.CONNECTION_LOST, FailureStatus.STALLED,
    FailureStatus.RAIL_LEFT_OUT, FailureStatus.RETRY_EXCEEDED,
    FailureStatus.RNR_RETRY_EXCEEDED, FailureStatus.REMOTE_INVALID_REQUEST})


class KvwireError(Exception):
    """Root of every error kvwire raises on purpose."""

    code: ClassVar[str] = "error"
    # Names the failure for metrics (``retry_exceeded``, ``remote_access``, ...).
    default_status: ClassVar[str] = "error"

    # What to do about it, when the raiser has nothing more specific to say.
    default_hint: ClassVar[str] = "the daemons' logs say more"
    # Whether the same request, tried again, may succeed.
    default_retriable: ClassVar[bool] = False

    def __init_subclass__(cls, *, code: str = "", status: str = "", hint: str = "",
                          retriable: bool | None = None, **kwargs: Any) -> None:
        """``class PoolFull(RequestRefused, code="pool_full", hint=...)``: the wire
        code, and optionally the metrics status and the default hint, are part
        of the class statement."""
        super().__init_subclass__(**kwargs)
        if not code:
            raise TypeError(f"{cls.__qualname__} must define its own wire code "
                            f"(class {cls.__name__}(..., code=\"...\"))")
        taken = _BY_CODE.get(code)
        if taken is not None:
            raise TypeError(f"error code {code!r} of {cls.__qualname__} is already "
                            f"taken by {taken.__module__}.{taken.__qualname__}")
        cls.code = code
        if status:
            cls.default_status = status
        if hint:
            cls.default_hint = hint
        if retriable is not None:
            cls.default_retriable = retriable
        _BY_CODE[code] = cls

    def __init__(self, message: str, *, hint: str = "", status: str | None = None,
                 retriable: bool | None = None) -> None:
        self.message = message
        self.hint = hint or self.default_hint
        self.status = status or self.default_status
        self.retriable = self.default_retriable if retriable is None else retriable
        super().__init__(f"{message} ({self.hint})" if self.hint else message)

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "hint": self.hint,
                "status": self.status, "retriable": self.retriable}

    def renamed(self, message: str) -> KvwireError:
        """The same error (class, hint, status, retriable) with another message."""
        error = type(self)(message, hint=self.hint, status=self.status)
        error.retriable = self.retriable
        return error


_BY_CODE[KvwireError.code] = KvwireError


class ConfigError(KvwireError, code="config",
                  hint="`kvwired receiver --help` / `kvwired sender --help` list every key"):
    """A configuration file or flag is wrong."""


class ProtocolError(KvwireError, code="protocol",
                    hint="both ends must run the same kvwire release; the peer's log says "
                         "what it sent"):
    """A frame that cannot be decoded or does not follow the protocol."""


class InvalidRequest(ProtocolError, code="invalid_request",
                     hint="fix the request's fields; the connection stays open"):
    """A well-framed message naming one request whose other fields are wrong.

    An engine-facing API fails that request alone (``failed`` for its id) and
    keeps the connection: one bad open must not cost an engine its other
    pushes. Between daemons it is a protocol violation like any other."""

    def __init__(self, message: str, *, hint: str = "", status: str | None = None,
                 retriable: bool | None = None, req: str = "") -> None:
        super().__init__(message, hint=hint, status=status, retriable=retriable)
        self.req = req


class FrameTooLarge(ProtocolError, code="frame_too_large",
                    hint="a frame this large is not kvwire's; is something else talking "
                         "to this port?"):
    """A frame larger than the protocol allows, refused from its length alone."""


class VersionMismatch(ProtocolError, code="version",
                      hint="upgrade both nodes to the same kvwire release"):
    """The peer speaks another version of the protocol."""


class TransportError(KvwireError, code="transport", status=FailureStatus.TRANSPORT_ERROR,
                     retriable=True,
                     hint="the data connection is torn down and rebuilt on the next "
                          "request; the daemons' logs say what failed"):
    """The data path failed: a write did not complete, a connection broke."""


class RemoteAccessError(
        TransportError, code="remote_access", status=FailureStatus.REMOTE_ACCESS,
        retriable=False,
        hint="a sender may write only into its own live leases, under each lease's key; "
             "the connection is torn down and rebuilt"):
    """A write outside every range the responder granted (or under a revoked key)."""


class PeerLost(TransportError, ConnectionError, code="peer_lost",
               status=FailureStatus.CONNECTION_LOST,
               hint="the other daemon stopped or the network between the nodes is down; "
                    "the next request reconnects"):
    """The other daemon went away while work was in flight."""


class ChannelStalled(TransportError, code="stalled", status=FailureStatus.STALLED,
                     hint="the data connection carried nothing while writes were pending "
                          "(packets dropped on the path, a wedged NIC or peer); it is torn "
                          "down and the next request reconnects"):
    """A data channel with writes pending saw none of them complete for the stall bound."""


class RailFailed(TransportError, code="rail_failed", status=FailureStatus.RAIL_FAILED,
                 hint="the link is rebuilt on the rails that are left; the failed one is "
                      "tried again after a backoff (kvwire_rail_errors_total counts it)"):
    """A rail (one RDMA device) could not carry a data channel's probe."""

    def __init__(self, message: str, *, hint: str = "", status: str | None = None,
                 retriable: bool | None = None, rail: str = "") -> None:
        super().__init__(message, hint=hint, status=status, retriable=retriable)
        self.rail = rail


class AuthenticationFailed(
        KvwireError, code="auth_failed",
        hint="both daemons need credentials from the same cluster CA: `kvctl keys issue "
             "NAME --role ROLE` on the CA's node, then copy them to the node"):
    """A peer's credentials did not prove who it says it is (or it had none)."""


class AccessDenied(KvwireError, code="access_denied",
                   hint="add the sender's name to `senders` in the receiver's config"):
    """An authenticated peer this daemon does not accept."""


class UnknownPeer(KvwireError, code="unknown_peer",
                  hint="name a receiver from the sender's [peers]"):
    """No receiver of that name is configured on the sender."""


class RequestRefused(KvwireError, code="refused", retriable=True,
                     hint="the receiver's log says why; send it elsewhere or later"):
    """The receiver would not take a request (and said why)."""


class RequestTooLarge(RequestRefused, code="too_large", retriable=False,
                      hint="raise pool_size (or sender_quota) on the receiver, or send it "
                           "in parts"):
    """A request that the pool could never hold, however long it waited."""


class PoolFull(RequestRefused, code="pool_full",
               hint="decode engines must release delivered requests; or raise the "
                    "pool size"):
    """No room in a pool before the wait ran out."""


class DuplicateRequest(RequestRefused, code="duplicate", retriable=False,
                       hint="request ids must be unique until their request is released"):
    """A request id already in use where it must be unique."""


class RequestAborted(KvwireError, code="aborted", retriable=True,
                     hint="push it again; the other side's log says who aborted it and why"):
    """A request was aborted by either side, or its deadline passed."""


class DeadlineExceeded(RequestAborted, TimeoutError, code="deadline",
                       hint="raise the deadline, or push less at once"):
    """A request's deadline passed before it was delivered."""


class UsageError(KvwireError, code="usage",
                 hint="see the client's docstrings: open, then layer/commit in order, "
                      "then finish"):
    """A client used the API out of order (commit after finish, ...)."""


class DaemonUnavailable(KvwireError, code="unavailable", retriable=True,
                        hint="is the daemon running (systemctl status kvwired-*), and is "
                             "this the socket in its config?"):
    """A local client could not reach its daemon."""


class ExperimentFailed(KvwireError, code="experiment_failed",
                       hint="the partial results are written; the daemons' logs say "
                            "what stopped it"):
    """An experiment (kvctl run) could not finish; its partial results stand."""


class PerftestFailed(ExperimentFailed, code="perftest_failed",
                     hint="is perftest installed on both nodes (apt-get install "
                          "perftest)?"):
    """The perftest baseline could not be run or read."""


def internal_error(exc: BaseException, where: str) -> KvwireError:
    """What a caller hears when a bug (not its input) broke the daemon's work."""
    return KvwireError(f"internal error in the {where}: {exc!r}",
                       hint="this is a bug in kvwire; the daemon log has the traceback")


def from_wire(payload: Mapping[str, object]) -> KvwireError:
    """Rebuild an error sent by :meth:`KvwireError.to_wire`."""
    cls = _BY_CODE.get(str(payload.get("code", "error")), KvwireError)
    status = payload.get("status")
    retriable = payload.get("retriable")  # absent from an older end's: the class says
    error = cls(str(payload.get("message", "unknown error")),
                hint=str(payload.get("hint", "")), status=str(status) if status else None)
    if isinstance(retriable, bool):
        error.retriable = retriable
    return error


def registered() -> dict[str, type[KvwireError]]:
    """Every error class defined so far, by wire code."""
    return dict(_BY_CODE)
