"""The one exception hierarchy: every class crosses a socket as itself."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kvctl
import kvwired
from kvwired.errors import (
    AccessDenied,
    AuthenticationFailed,
    ChannelStalled,
    ConfigError,
    DaemonUnavailable,
    DeadlineExceeded,
    DuplicateRequest,
    FailureStatus,
    KvwireError,
    PeerLost,
    PoolFull,
    ProtocolError,
    RemoteAccessError,
    RequestAborted,
    RequestTooLarge,
    TransportError,
    UsageError,
    VersionMismatch,
    from_wire,
    registered,
)


def _import_everything() -> None:
    for package in (kvwired, kvctl):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith("__main__"):  # those run the program
                importlib.import_module(module.name)


def _all_subclasses(cls: type[KvwireError]) -> list[type[KvwireError]]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


_import_everything()
EVERY_ERROR = [KvwireError, *_all_subclasses(KvwireError)]


def test_the_walk_finds_classes_defined_outside_errors_py() -> None:
    modules = {cls.__module__ for cls in EVERY_ERROR}
    assert {"kvwired.errors", "kvwired.rdma", "kvctl.lab.machine", "kvctl.push"} <= modules


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda cls: cls.__qualname__)
def test_every_error_round_trips_as_its_own_class(cls: type[KvwireError]) -> None:
    assert registered()[cls.code] is cls
    error = cls("what happened", hint="what to do", status="some_status")
    rebuilt = from_wire(error.to_wire())
    assert type(rebuilt) is cls
    assert (rebuilt.message, rebuilt.hint, rebuilt.status) == (
        "what happened", "what to do", "some_status")
    assert str(rebuilt) == "what happened (what to do)"


def test_status_defaults_by_class_and_is_a_constructor_argument() -> None:
    assert TransportError("x").status == "transport_error"
    assert PeerLost("x").status == "connection_lost"
    assert TransportError("x", status="retry_exceeded").status == "retry_exceeded"
    renamed = TransportError("x", hint="h", status="remote_access").renamed("receiver d: x")
    assert (type(renamed), renamed.message, renamed.hint, renamed.status) == (
        TransportError, "receiver d: x", "h", "remote_access")


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda cls: cls.__qualname__)
def test_whether_retrying_can_help_crosses_the_wire(cls: type[KvwireError]) -> None:
    assert from_wire(cls("x").to_wire()).retriable is cls.default_retriable
    for said in (True, False):
        assert from_wire(cls("x", retriable=said).to_wire()).retriable is said
    # An older end's error map has no "retriable": the class says.
    old = {k: v for k, v in cls("x", retriable=not cls.default_retriable).to_wire().items()
           if k != "retriable"}
    assert from_wire(old).retriable is cls.default_retriable


def test_what_may_pass_is_retriable_and_what_will_not_is_not() -> None:
    may_pass = (PoolFull, PeerLost, ChannelStalled, DeadlineExceeded, RequestAborted,
                DaemonUnavailable, TransportError)
    will_not = (RemoteAccessError, RequestTooLarge, DuplicateRequest, ConfigError,
                ProtocolError, VersionMismatch, AuthenticationFailed, AccessDenied, UsageError)
    assert all(cls("x").retriable for cls in may_pass)
    assert not any(cls("x").retriable for cls in will_not)
    assert TransportError("x", retriable=False).renamed("y").retriable is False


def test_a_duplicate_code_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match=r"already taken by kvwired\.errors\.PoolFull"):
        class Impostor(KvwireError, code="pool_full"):
            pass
    with pytest.raises(TypeError, match="must define its own wire code"):
        class Nameless(KvwireError):
            pass
    assert registered()["pool_full"].__name__ == "PoolFull"


def test_generic_handlers_see_the_matching_built_ins() -> None:
    with pytest.raises(TimeoutError):
        raise DeadlineExceeded("request r missed its deadline")
    with pytest.raises(ConnectionError):
        raise PeerLost("receiver d went away")
    assert isinstance(from_wire(DeadlineExceeded("late").to_wire()), TimeoutError)


def test_an_unknown_code_becomes_the_root_class() -> None:
    error = from_wire({"code": "from-the-future", "message": "m"})
    assert type(error) is KvwireError and error.message == "m"


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda cls: cls.__name__)
def test_every_error_class_says_what_to_do(cls: type[KvwireError]) -> None:
    error = cls("something went wrong")
    assert error.hint, f"{cls.__name__} has no default hint (class ...(..., hint=\"...\"))"
    assert from_wire(error.to_wire()).hint == error.hint


def test_the_wire_failures_a_new_channel_rides_out_and_those_it_never_does() -> None:
    replaceable = {s for s in FailureStatus if s.replaceable}
    assert replaceable == {"transport_error", "connection_lost", "stalled", "rail_left_out",
                           "retry_exceeded", "rnr_retry_exceeded", "remote_invalid_request"}
    # A write under a wrong key is a bug or an attack; a local error is this host's.
    for never in ("remote_access", "local_protection", "local_length", "flushed"):
        assert not FailureStatus(never).replaceable
    assert {s for s in FailureStatus if s.rail_unanswered} == {"retry_exceeded", "stalled"}


def test_an_errors_failure_status_is_read_from_the_error_itself() -> None:
    assert FailureStatus.of(PeerLost("gone")) is FailureStatus.CONNECTION_LOST
    assert FailureStatus.of(ChannelStalled("quiet")) is FailureStatus.STALLED
    assert FailureStatus.of(RemoteAccessError("bad key")) is FailureStatus.REMOTE_ACCESS
    assert FailureStatus.of(OSError("reset")) is FailureStatus.TRANSPORT_ERROR  # not kvwire's
    # A verbs status this vocabulary does not name is kept, and never ridden out.
    unknown = TransportError("odd completion", status="status_99")
    assert FailureStatus.of(unknown) is None and unknown.status == "status_99"
    # Every transport error's status is in the vocabulary, and crosses the wire as it.
    for cls in (TransportError, RemoteAccessError, PeerLost, ChannelStalled):
        assert isinstance(cls.default_status, FailureStatus)
        assert from_wire(cls("x").to_wire()).status == cls.default_status
