"""The receiver's memory of verdicts (kvwired.verdicts): no I/O, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwired.errors import RequestAborted
from kvwired.protocol import CONTROL, validate
from kvwired.protocol import control as ctl
from kvwired.verdicts import (
    MissedFailures,
    Verdict,
    VerdictBook,
    from_message,
    outcome,
    to_message,
)


def test_a_verdict_is_found_by_sender_request_and_lease() -> None:
    book = VerdictBook(ttl=10)
    book.record(("prefill-1", "r1"), Verdict(7, True, checksum=42), now=0)
    assert book.lookup_lease("prefill-1", "r1", 7, now=1) == Verdict(7, True, checksum=42)
    assert book.lookup_lease("prefill-2", "r1", 7, now=1) is None  # another sender's request
    assert book.lookup_lease("prefill-1", "r1", 8, now=1) is None  # the id leased again since


def test_an_abort_keeps_its_reason() -> None:
    book = VerdictBook()
    error = RequestAborted("the decode engine released request r1 early")
    book.record(("s", "r1"), Verdict(3, False, error=error), now=0)
    found = book.lookup_lease("s", "r1", 3, now=0)
    assert found is not None and not found.delivered and found.error is error


def test_a_verdict_is_forgotten_after_its_ttl() -> None:
    book = VerdictBook(ttl=10)
    book.record(("s", "r1"), Verdict(1, True), now=0)
    assert book.lookup_lease("s", "r1", 1, now=10) is not None
    assert book.lookup_lease("s", "r1", 1, now=10.5) is None
    assert len(book) == 0


@settings(deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.text(min_size=1, max_size=3),
                          st.integers(1, 5)), max_size=60),
       st.integers(1, 8))
def test_the_book_never_holds_more_than_its_limit_and_keeps_the_newest(
        records: list[tuple[str, str, int]], limit: int) -> None:
    book = VerdictBook(ttl=1000, limit=limit)
    for now, (sender, req, lease) in enumerate(records):
        book.record((sender, req), Verdict(lease, True), now=now)
        assert len(book) <= limit
        # The one just recorded is always there, whatever was evicted.
        assert book.lookup_lease(sender, req, lease, now=now) == Verdict(lease, True)


@pytest.mark.parametrize("verdict", [
    None, Verdict(3, True, checksum=(1 << 64) - 1),
    Verdict(4, False, error=RequestAborted("the decode engine released request r early"))])
def test_a_verdict_crosses_the_wire_as_it_was_kept(verdict: Verdict | None) -> None:
    msg = validate(to_message("r", 3 if verdict is None else verdict.lease, verdict).to_wire(),
                   CONTROL)
    assert isinstance(msg, ctl.Verdict)
    back = from_message(msg)
    assert outcome(back) == outcome(verdict) == msg.outcome
    if verdict is not None and back is not None:
        assert (back.lease, back.delivered, back.checksum) == (
            verdict.lease, verdict.delivered, verdict.checksum)
        assert type(back.error) is type(verdict.error)
        assert str(back.error) == str(verdict.error)


def test_a_missed_failure_is_told_until_its_ttl_or_the_id_is_opened_again() -> None:
    missed = MissedFailures(ttl=10)
    error = RequestAborted("the sender aborted request r1")
    missed.record("r1", error, now=0)
    assert missed.lookup("r1", now=5) is error
    missed.forget("r1")  # opened again under the same id
    assert missed.lookup("r1", now=5) is None
    missed.record("r2", error, now=0)
    assert missed.lookup("r2", now=10.5) is None and len(missed) == 0
