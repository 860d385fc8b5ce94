"""The shipped units under real systemd: the lab nodes boot systemd as PID 1,
``make install`` puts the units in place, and systemd runs the daemons."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from kvctl.lab.daemons import ServiceDaemon, receiver_config, sender_config
from kvctl.lab.machine import LabState, run_in

from ..waiting import wait_until
from .test_lab_kvwire import SMALL_BYTES, SMALL_TOKENS

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def services(lab: LabState) -> Iterator[tuple[ServiceDaemon, ServiceDaemon]]:
    receiver = ServiceDaemon("decode", "receiver", receiver_config(), lab)
    sender = ServiceDaemon("prefill", "sender", sender_config(), lab)
    receiver.start()
    sender.start()
    yield receiver, sender
    sender.stop()
    receiver.stop()


def _sh(lab: LabState, node: str, script: str) -> tuple[int, str, str]:
    return run_in(node, ["sh", "-c", script], state=lab)


def _push(lab: LabState, sender: ServiceDaemon, req: str) -> tuple[int, str, str]:
    # A small cache: these tests are about systemd, not the cache's size.
    return run_in("prefill", [sys.executable, "-m", "kvctl", "push", "--socket",
                              sender.socket, "--peer", "decode", "--req", req, "--tokens",
                              str(SMALL_TOKENS), "--chunk", "per-layer", "--json"], state=lab)


def _wait_active(daemon: ServiceDaemon, old_pid: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = daemon.pid
        if pid not in (0, old_pid) and daemon.running:
            return pid
        time.sleep(1)
    raise AssertionError(f"{daemon.unit} not back within {timeout} s:\n{daemon.log_tail()}")


def _wait_for_log(daemon: ServiceDaemon, line: str, timeout: float = 60) -> None:
    try:
        wait_until(lambda: line in daemon.log_text(), timeout, f"{line!r} logged", every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc} by {daemon.unit}:\n{daemon.log_tail()}") from None


def test_systemd_is_pid_1_and_the_units_verify(lab: LabState,
                                               services: tuple[ServiceDaemon, ...]) -> None:
    code, out, err = _sh(lab, "decode", "ps -p 1 -o comm=; systemctl is-system-running; "
                         "systemd-analyze verify /etc/systemd/system/kvwired-receiver.service "
                         "&& echo verified")
    assert code == 0, err
    assert out.split() == ["systemd", "running", "verified"], out + err


def test_ready_means_serving_and_status_is_clean(lab: LabState,
                                                 services: tuple[ServiceDaemon, ...]) -> None:
    receiver, sender = services
    for daemon in services:
        props = daemon.show("ActiveState", "SubState", "Type", "StatusText", "User",
                            "LimitMEMLOCK", "NRestarts")
        assert props["ActiveState"] == "active" and props["SubState"] == "running", props
        assert props["Type"] == "notify" and props["User"] == "kvwire"
        assert props["LimitMEMLOCK"] == "infinity"
        assert props["StatusText"].startswith("ready: "), props
        code, out, _ = _sh(lab, daemon.node, f"systemctl status --no-pager {daemon.unit}")
        assert code == 0 and "Active: active (running)" in out, (
            f"systemctl status exited {code}:\n{out}\n{daemon.log_tail()}")
    # READY=1 came after the socket was bound: a push works the moment start returns.
    code, out, err = _push(lab, sender, "right-after-start")
    assert code == 0, (f"{err}\nreceiver restarts: {receiver.show('NRestarts')}\n"
                       f"{receiver.log_tail()}\nsender:\n{sender.log_tail()}")
    assert f'"bytes": {SMALL_BYTES}' in out
    assert "verbs" in receiver.log_text()  # hardened, and RDMA still works


def test_a_killed_daemon_is_restarted_by_systemd(lab: LabState,
                                                 services: tuple[ServiceDaemon, ...]) -> None:
    receiver, sender = services
    before = int(receiver.show("NRestarts")["NRestarts"])
    old_pid = receiver.pid
    receiver.signal("KILL")
    new_pid = _wait_active(receiver, old_pid)
    assert new_pid != old_pid
    assert int(receiver.show("NRestarts")["NRestarts"]) == before + 1
    # The sender reconnects on its own; pushes go through again.
    deadline = time.monotonic() + 60
    while _push(lab, sender, f"after-restart-{time.monotonic():.0f}")[0] != 0:
        assert time.monotonic() < deadline, sender.log_tail()
        time.sleep(2)


def test_a_stuck_event_loop_is_restarted_by_the_watchdog(
        lab: LabState, services: tuple[ServiceDaemon, ...]) -> None:
    _, sender = services
    before = int(sender.show("NRestarts")["NRestarts"])
    old_pid = sender.pid
    sender.signal("STOP")  # the loop stops turning: no more WATCHDOG=1
    _wait_active(sender, old_pid, timeout=150)
    assert int(sender.show("NRestarts")["NRestarts"]) == before + 1
    _, out, _ = _sh(lab, "prefill", f"journalctl -u {sender.unit} --no-pager | "
                    "grep -c 'Watchdog timeout'")
    assert int(out.strip() or 0) >= 1


def test_reload_and_a_clean_stop(lab: LabState, services: tuple[ServiceDaemon, ...]) -> None:
    _, sender = services
    pid = sender.pid
    code, _, err = _sh(lab, "prefill", f"systemctl reload {sender.unit}")
    assert code == 0, err
    assert sender.pid == pid and sender.running  # reloaded in place
    # `kill -HUP` returns before the daemon has read the signal, and the
    # journal lags the daemon: wait for the line rather than expect it now.
    _wait_for_log(sender, "peer list reloaded")
    assert sender.stop() == 0
    props = sender.show("Result", "ActiveState")
    assert props["Result"] == "success" and props["ActiveState"] == "inactive", props
    _wait_for_log(sender, '"event": "stopped"')
    sender.start()  # back for the module's teardown
