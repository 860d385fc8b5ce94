"""The one exception hierarchy of kvwire.

Every error a user can cause says what happened and what to do. Errors that
cross a socket (control protocol, local APIs) travel as a ``code`` plus a
message and are rebuilt on the other side as the same class, so a caller of
the client library can ``except PoolFull`` whether the pool that was full is
local or on a decode node two hops away.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar


class KvwireError(Exception):
    """Root of every error kvwire raises on purpose."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str, *, hint: str = "") -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message} ({hint})" if hint else message)

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.hint}


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
    """The data path failed: a write did not complete, a connection broke.

    ``status`` names the failure for metrics (``retry_exceeded``,
    ``remote_access``, ``connection_lost``, ...).
    """

    code = "transport"
    status = "transport_error"


class PeerLost(TransportError):
    """The other daemon went away while work was in flight."""

    code = "peer_lost"
    status = "connection_lost"


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


class DeadlineExceeded(RequestAborted):
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


_BY_CODE: dict[str, type[KvwireError]] = {}


def _index(cls: type[KvwireError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _index(sub)


_index(KvwireError)


def from_wire(payload: Mapping[str, object]) -> KvwireError:
    """Rebuild an error sent by :meth:`KvwireError.to_wire`."""
    cls = _BY_CODE.get(str(payload.get("code", "error")), KvwireError)
    return cls(str(payload.get("message", "unknown error")), hint=str(payload.get("hint", "")))
