"""kvwire_vllm.loads: a decode engine's ended loads, handed from the connector's
loop thread to vLLM's, and an idle step that sleeps until one ends."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire_vllm.loads import EndedLoads
from kvwire_vllm.params import ConnectorSettings
from kvwired.errors import ConfigError

# A step: ("begin", n) loads begun, ("end", failed) the oldest running one
# ends, ("take",) vLLM asks.
steps = st.lists(st.one_of(st.tuples(st.just("begin"), st.integers(1, 3)),
                           st.tuples(st.just("end"), st.booleans()),
                           st.tuples(st.just("take"))), max_size=40)


@given(steps)
def test_every_load_is_handed_to_vllm_once_with_its_failure(script: list[tuple[object, ...]]
                                                           ) -> None:
    loads = EndedLoads()
    running: list[str] = []
    ended: dict[str, bool] = {}
    handed: dict[str, bool] = {}
    made = 0
    for step in script:
        if step[0] == "begin":
            count = int(step[1])  # type: ignore[call-overload]
            loads.begun(count)
            running += [f"r{made + n}" for n in range(count)]
            made += count
        elif step[0] == "end" and running:
            req = running.pop(0)
            loads.ended(req, bool(step[1]))
            ended[req] = bool(step[1])
        elif step[0] == "take":
            finished, failed = loads.take()
            assert failed <= finished and not finished & set(handed)
            handed |= {req: req in failed for req in finished}
    finished, failed = loads.take()
    handed |= {req: req in failed for req in finished}
    assert handed == ended
    # Nothing left to end or hand over: an idle step does not wait.
    if not running:
        started = time.monotonic()
        assert loads.wait(5.0) is False
        assert time.monotonic() - started < 1.0


def test_an_idle_step_returns_at_once_when_a_load_ended_untaken() -> None:
    loads = EndedLoads()
    loads.begun(2)
    loads.ended("a", failed=False)
    started = time.monotonic()
    assert loads.wait(5.0) is True
    assert time.monotonic() - started < 1.0


def test_an_idle_step_sleeps_until_a_load_ends_on_another_thread() -> None:
    loads = EndedLoads()
    loads.begun(1)
    ending = threading.Timer(0.05, loads.ended, ("a", False))
    started = time.monotonic()
    ending.start()
    assert loads.wait(30.0) is True  # woken by the end, not by the bound
    assert time.monotonic() - started < 15.0
    ending.join()
    assert loads.take() == ({"a"}, set())


def test_an_idle_step_waits_no_longer_than_its_bound() -> None:
    loads = EndedLoads()
    loads.begun(1)
    assert loads.wait(0.01) is False


def test_idle_wait_is_a_bounded_number_of_seconds() -> None:
    assert ConnectorSettings.from_extra({}).idle_wait == 0.005
    assert ConnectorSettings.from_extra({"idle_wait": 0}).idle_wait == 0.0
    for bad in (-0.001, 0.5, "5ms", True, float("nan")):
        with pytest.raises(ConfigError, match="idle_wait") as caught:
            ConnectorSettings.from_extra({"idle_wait": bad})
        assert "0: spin" in (caught.value.hint or "")
