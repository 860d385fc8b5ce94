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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

_BY_CODE: dict[str, type[KvwireError]] = {}


class KvwireError(Exception):
    """Root of every error kvwire raises on purpose."""

    code: ClassVar[str] = "error"
    # Names the failure for metrics (``retry_exceeded``, ``remote_access``, ...).
    default_status: ClassVar[str] = "error"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} must define its own wire code")
        taken = _BY_CODE.get(cls.code)
        if taken is not None:
            raise TypeError(f"error code {cls.code!r} of {cls.__qualname__} is already "
                            f"taken by {taken.__module__}.{taken.__qualname__}")
        _BY_CODE[cls.code] = cls

    def __init__(self, message: str, *, hint: str = "", status: str | None = None) -> None:
        self.message = message
        self.hint = hint
        self.status = status or self.default_status
        super().__init__(f"{message} ({hint})" if hint else message)

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.hint,
                "status": self.status}

    def renamed(self, message: str) -> KvwireError:
        """The same error (class, hint, status) with another message."""
        return type(self)(message, hint=self.hint, status=self.status)


_BY_CODE[KvwireError.code] = KvwireError


class ConfigError(KvwireError):
    """A configuration file or flag is wrong."""

    code = "config"


class ProtocolError(KvwireError):
    """A frame that cannot be decoded or does not follow the protocol."""

    code = "protocol"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class VersionMismatch(ProtocolError):
    code = "version"


class TransportError(KvwireError):
    """The data path failed: a write did not complete, a connection broke."""

    code = "transport"
    default_status = "transport_error"


class PeerLost(TransportError, ConnectionError):
    """The other daemon went away while work was in flight."""

    code = "peer_lost"
    default_status = "connection_lost"


class UnknownPeer(KvwireError):
    code = "unknown_peer"


class RequestRefused(KvwireError):
    """The receiver would not take a request (and said why)."""

    code = "refused"


class RequestTooLarge(RequestRefused):
    code = "too_large"


class PoolFull(RequestRefused):
    """No room in a pool before the wait ran out."""

    code = "pool_full"


class DuplicateRequest(RequestRefused):
    code = "duplicate"


class RequestAborted(KvwireError):
    """A request was aborted by either side, or its deadline passed."""

    code = "aborted"


class DeadlineExceeded(RequestAborted, TimeoutError):
    code = "deadline"


class UsageError(KvwireError):
    """A client used the API out of order (commit after finish, ...)."""

    code = "usage"


class DaemonUnavailable(KvwireError):
    """A local client could not reach its daemon."""

    code = "unavailable"


class ExperimentFailed(KvwireError):
    """An experiment (kvctl run) could not finish; its partial results stand."""

    code = "experiment_failed"


class PerftestFailed(ExperimentFailed):
    """The perftest baseline could not be run or read."""

    code = "perftest_failed"


def internal_error(exc: BaseException, where: str) -> KvwireError:
    """What a caller hears when a bug (not its input) broke the daemon's work."""
    return KvwireError(f"internal error in the {where}: {exc!r}",
                       hint="this is a bug in kvwire; the daemon log has the traceback")


def from_wire(payload: Mapping[str, object]) -> KvwireError:
    """Rebuild an error sent by :meth:`KvwireError.to_wire`."""
    cls = _BY_CODE.get(str(payload.get("code", "error")), KvwireError)
    status = payload.get("status")
    return cls(str(payload.get("message", "unknown error")), hint=str(payload.get("hint", "")),
               status=str(status) if status else None)


def registered() -> dict[str, type[KvwireError]]:
    """Every error class defined so far, by wire code."""
    return dict(_BY_CODE)
