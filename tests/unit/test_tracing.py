"""A request's trace (kvwired.tracing): nothing at all when off, one trace
across processes when on, and a traceparent from anyone never breaks a request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl import timeline
from kvwired import tracing
from kvwired.errors import ConfigError

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def traced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process tracing into a fresh folder (the tracer is per process:
    each test gets its own, and none is left on for the next)."""
    monkeypatch.setattr(tracing, "_tracer", None)
    assert tracing.configure("test", str(tmp_path))
    yield tmp_path
    monkeypatch.setattr(tracing, "_tracer", None)


def _spans(folder: Path) -> list[dict[str, object]]:
    return [json.loads(line) for path in folder.glob("*.jsonl")
            for line in path.read_text().splitlines()]


def test_off_by_default_no_span_is_made_and_opentelemetry_is_not_imported() -> None:
    code = ("import sys; from kvwired import tracing; "
            "assert not tracing.configure('x'); span = tracing.start('a', "
            f"'{VALID}', {{'k': 1}}); span.add_event('e'); span.set_attribute('n', 2); "
            "tracing.fail(span, 'why'); span.end(); "
            "assert span is tracing.NO_SPAN and tracing.traceparent(span) is None; "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != tracing.ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True)
    assert done.stdout.strip() == "False"


def test_a_folder_that_does_not_exist_is_a_clear_error(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    with pytest.raises(ConfigError, match="no such folder") as caught:
        tracing.configure("test", str(tmp_path / "missing"))
    assert "make the folder" in (caught.value.hint or "")
    assert not tracing.recording()


def test_tracing_asked_for_without_the_sdk_says_which_extra_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_tracer", None)
    # None in sys.modules makes the import fail, as in an environment without it.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ConfigError, match="SDK is not installed") as caught:
        tracing.configure("test", str(tmp_path))
    assert "kvwire[trace]" in (caught.value.hint or "")
    assert not tracing.recording()


def test_a_child_started_from_the_traceparent_joins_the_parents_trace(traced: Path) -> None:
    root = tracing.start("kvwire.request", None, {"kvwire.transfer": "t-1"})
    handed_on = tracing.traceparent(root)
    assert tracing.is_traceparent(handed_on)
    child = tracing.start("kvwire.push", handed_on)
    child.add_event("open sent", {"kvwire.push": "t-1.h0"})
    tracing.fail(child, "refused: the pool is full")
    child.end()
    root.end()
    by_name = {span["name"]: span for span in _spans(traced)}
    push, request = by_name["kvwire.push"], by_name["kvwire.request"]
    assert push["context"]["trace_id"] == request["context"]["trace_id"]  # type: ignore[index]
    assert push["parent_id"] == request["context"]["span_id"]  # type: ignore[index]
    assert push["status"] == {"status_code": "ERROR",
                              "description": "refused: the pool is full"}
    assert [e["name"] for e in push["events"]] == ["open sent"]  # type: ignore[attr-defined]
    # kvctl.timeline reads what the exporter wrote.
    records = {span.name: span for span in timeline.read_spans(traced)}
    assert records["kvwire.push"].failed == "refused: the pool is full"
    assert records["kvwire.push"].trace == records["kvwire.request"].trace
    assert records["kvwire.request"].start <= records["kvwire.push"].start


def test_a_parent_that_is_not_a_traceparent_starts_a_new_trace(traced: Path) -> None:
    for parent in ("", "garbage", VALID.upper(), "00-" + "0" * 32 + "-b7ad6b7169203331-01"):
        tracing.start("kvwire.load", parent).end()
    assert len({span["context"]["trace_id"] for span in _spans(traced)}) == 4  # type: ignore[index]


def test_configure_keeps_the_first_choice(traced: Path, tmp_path_factory:
                                          pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("other")
    assert tracing.configure("again", str(other))
    tracing.start("x").end()
    assert _spans(traced) and not _spans(other)


@given(st.text(max_size=80) | st.binary(max_size=60) | st.integers() | st.none())
def test_any_value_as_a_traceparent_is_judged_without_raising(value: object) -> None:
    assert tracing.is_traceparent(value) is False or isinstance(value, str)


@given(st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", fullmatch=True))
def test_every_well_formed_w3c_traceparent_but_all_zero_ids_is_taken(value: str) -> None:
    zero = value[3:35] == "0" * 32 or value[36:52] == "0" * 16
    assert tracing.is_traceparent(value) is not zero
