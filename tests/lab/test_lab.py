"""The two-node Soft-RoCE lab: real rdma_rxe in two QEMU guests."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvctl.lab import cpu_speed, health
from kvctl.lab import link_perftest as perftest
from kvctl.lab.demo import run_step
from kvctl.lab.machine import SHARED_DIR, LabState, run_in
from kvctl.processes import alive

from ..waiting import wait_until

pytestmark = pytest.mark.lab

DECODE = "198.18.78.2"


def kvctl(*args: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvctl", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_prefill_node_has_an_active_rxe_port(lab: LabState) -> None:
    result = kvctl("lab", "exec", "prefill", "--", "ibv_devinfo")
    assert result.returncode == 0, result.stderr
    assert "hca_id:\trxe0" in result.stdout
    assert "PORT_ACTIVE" in result.stdout
    assert "link_layer:\t\tEthernet" in result.stdout


def test_exec_streams_output_and_returns_the_exit_code(lab: LabState) -> None:
    result = kvctl("lab", "exec", "decode", "--", "sh", "-c",
                   "pwd; hostname; ulimit -l; echo oops >&2; exit 3")
    assert result.returncode == 3
    cwd, hostname, memlock = result.stdout.split()
    assert Path(cwd) == Path.cwd()  # the nodes see the checkout at the same path
    assert (hostname, memlock) == ("decode", "unlimited")
    assert result.stderr == "oops\n"
    missing = kvctl("lab", "exec", "decode", "--", "no-such-command")
    assert missing.returncode == 127 and "cannot run no-such-command" in missing.stderr


# A step in a node: progress lines, then a wait at a gate only the test opens.
_GATED_STEP = """
import pathlib, time
from kvctl.progress import PhaseProgress
from kvwired.experiments.plan import PlannedPhase
with PhaseProgress(plan=[PlannedPhase("first", 10), PlannedPhase("second", 10)]) as shown:
    shown.update("first", 10, 10)
    shown.update("second", 0, 10)
    while not pathlib.Path({gate!r}).exists():
        time.sleep(0.05)
    shown.update("second", 10, 10)
print("figures")
"""


def test_a_steps_progress_reaches_the_host_while_the_step_runs(lab: LabState) -> None:
    # make demo's path: run_step relays the node's output as it arrives. The
    # step cannot end before the test opens the gate, and the test opens it
    # only once the first phase's line has reached the host.
    gate = SHARED_DIR / f"gate-{os.getpid()}"
    gate.unlink(missing_ok=True)
    shown = io.StringIO()
    outcome: list[str] = []
    step = threading.Thread(target=lambda: outcome.append(run_step(
        lab, "a gated step", [sys.executable, "-c", _GATED_STEP.format(gate=str(gate))],
        shown)))
    step.start()
    try:
        wait_until(lambda: "  first: 10/10 in " in shown.getvalue(), timeout=120,
                   what="the first phase's line on the host")
        assert step.is_alive() and not outcome  # still at the gate
    finally:
        gate.touch()
        step.join(120)
    assert outcome == ["figures\n"]
    second = next(line for line in shown.getvalue().splitlines() if "second: 10/10" in line)
    assert "left" in second and "phase 2 of 2" in second  # elapsed and left, from the plan
    gate.unlink()


def test_each_rail_has_its_own_active_rxe_device_and_subnet(lab: LabState) -> None:
    assert lab.rails == 2
    assert lab.nodes["decode"].rail_addresses == ["198.18.78.2", "198.18.80.2"]
    code, out, err = run_in("decode", [sys.executable, "-c", """
import pyverbs.device as d, pyverbs.enums as e
from pyverbs.device import Context
print(sorted(dev.name.decode() for dev in d.get_device_list()))
for name in ("rxe0", "rxe1"):
    ctx = Context(name=name)
    entry = ctx.query_gid_ex(1, 1)
    print(name, ctx.query_port(1).state == e.IBV_PORT_ACTIVE,
          entry.gid_type == e.IBV_GID_TYPE_ROCE_V2, entry.gid_str())
"""], state=lab)
    assert code == 0, err
    devices, rail0, rail1 = out.splitlines()
    assert devices == "['rxe0', 'rxe1']"
    assert rail0.split()[:3] == ["rxe0", "True", "True"]
    assert rail0.split()[3].endswith("ffff:c612:4e02")  # ::ffff:198.18.78.2
    assert rail1.split()[:3] == ["rxe1", "True", "True"]
    assert rail1.split()[3].endswith("ffff:c612:5002")  # ::ffff:198.18.80.2


def test_the_transport_suite_passes_over_rdma_rxe_in_a_node(lab: LabState) -> None:
    # tests/unit/test_transport.py, the suite the tcp transport passes here, run
    # over verbs where rdma_rxe is: both ends on the decode node's rxe0. With
    # it, the GID table the devices answer against the one sysfs lists, and
    # the compiled core's objects on a real device.
    unit = Path(__file__).parents[1] / "unit"
    code, out, err = run_in("decode", [sys.executable, "-m", "pytest",
                                       str(unit / "test_transport.py"),
                                       str(unit / "test_verbs_gids.py"),
                                       str(unit / "test_verbs_core.py"), "-k", "verbs",
                                       "-q", "-p", "no:cacheprovider"], state=lab)
    assert code == 0, out + err
    assert "skipped" not in out and " passed" in out, out


def test_the_speed_of_a_nodes_core_against_the_hosts_is_measured(lab: LabState) -> None:
    # make demo reads the nodes' CPU per write as one of this host's cores by
    # it (a figure, not a bound: TCG ran the loop 11-12x slower here).
    node, host = cpu_speed.in_node(lab, "prefill"), cpu_speed.here()
    print(f"the post loop: {node:.3f} s in the prefill node, {host:.3f} s here")
    assert node > 0 and host > 0


def test_the_wire_nic_has_a_pcie_link_for_the_probe(lab: LabState) -> None:
    code, out, err = run_in("prefill", ["sh", "-c",
                                        "cat /sys/class/infiniband/rxe0/parent; "
                                        "d=$(readlink -f /sys/class/net/wire0/device/..); "
                                        "cat $d/current_link_speed $d/current_link_width"],
                            state=lab)
    assert code == 0, err
    assert out.splitlines() == ["wire0", "2.5 GT/s PCIe", "1"]


def test_kvctl_probe_follows_rxe_to_the_pcie_link_of_its_nic(lab: LabState) -> None:
    for rail, peer in enumerate(("198.18.78.2", "198.18.80.2")):
        code, out, err = run_in("prefill", [sys.executable, "-m", "kvctl", "probe", "--to",
                                            peer, "--json"], state=lab)
        assert code == 0, err
        result = json.loads(out)
        rxe = {device["name"]: device for device in result["devices"]}[f"rxe{rail}"]
        assert rxe["netdev"] == f"wire{rail}"
        assert rxe["ports"][0]["state"] == "ACTIVE" and rxe["ports"][0]["active_mtu"] == 1024
        assert rxe["pcie"]["bdf"] == f"0000:0{rail + 1}:00.0"  # each NIC its own root port
        assert (rxe["pcie"]["speed_gts"], rxe["pcie"]["width"]) == (2.5, 1)
        assert rxe["pcie"]["ceiling_gbps"] == 2.0
        # The path to the peer's rail decides the device, as it does for the daemons.
        assert result["picked"]["device"] == f"rxe{rail}"
        assert result["picked"]["index"] == 1
        assert result["picked"]["ipv4"] == lab.nodes["prefill"].rail_addresses[rail]
        assert result["memlock_ok"]


def test_ib_write_lat_between_the_nodes(lab: LabState) -> None:
    result = perftest.write_lat(512, 500, lab)
    print(f"ib_write_lat 512 B: typical {result.typical_us} us, min {result.min_us} us, "
          f"p99 {result.p99_us} us")
    assert 0 < result.min_us <= result.typical_us <= result.p99_us


def test_the_round_trip_is_broken_down_beside_ib_write_lat(lab: LabState) -> None:
    # benchmarks.round_trip, one short round: each path's pings come back,
    # and each is set against the ib_write_lat run of its own round (a
    # figure, not a bound: the README quotes a full run's).
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-m", "benchmarks.round_trip", "--rounds", "1",
                           "--iterations", "30", "--json"], capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    steps = summary["steps"]
    assert list(steps) == ["ib_write_lat", "ib_send_lat", "ib_send_lat_events", "core",
                           "busy", "asleep"]
    theirs = summary["rounds"][0]["ib_write_lat"]["p50_us"]
    assert theirs > 0
    for step, row in list(steps.items())[1:]:
        print(f"{step}: {row['p50_us']:.0f} µs, x{row['x_ib_write_lat']:.2f} ib_write_lat")
        assert row["x_ib_write_lat"] == pytest.approx(row["p50_us"] / theirs)
    for step in ("core", "busy", "asleep"):
        # Both ends measured their own CPU over the same round trips.
        row = steps[step]
        assert row["near_cpu_us_per_rtt"] >= row["near_user_us_per_rtt"] >= 0
        assert row["far_cpu_us_per_rtt"] >= row["far_user_us_per_rtt"] >= 0
        assert row["near_cpu_us_per_rtt"] > 0 and row["far_cpu_us_per_rtt"] > 0


@pytest.mark.parametrize("rail", [0, 1])
def test_ib_write_bw_between_the_nodes(lab: LabState, rail: int) -> None:
    result = perftest.write_bw(1 << 20, 100, lab, rail=rail)
    print(f"ib_write_bw 1 MiB on rail {rail}: {result.gbps:.3f} Gb/s average")
    assert result.gbps > 0 and result.iterations == 100


def test_management_ports_reach_the_nodes_from_host_loopback(lab: LabState) -> None:
    # Something listening on the decode node's metrics port (a directory
    # listing of the checkout) must answer on the host's forwarded port.
    code, out, err = run_in("decode", ["sh", "-c",
                                       f"setsid {sys.executable} -m http.server 9471 "
                                       ">/dev/null 2>&1 </dev/null & echo $!"], state=lab)
    assert code == 0, err
    server_pid = out.strip()
    port = lab.nodes["decode"].ports["metrics_receiver"]
    deadline = time.monotonic() + 30
    reply = b""
    try:
        while time.monotonic() < deadline and b"kvwired" not in reply:
            try:
                with socket.create_connection(("127.0.0.1", port), 2) as sock:
                    sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    sock.settimeout(5)
                    reply = b"".join(iter(lambda: sock.recv(65536), b""))
            except OSError:
                time.sleep(0.3)
    finally:
        run_in("decode", ["kill", server_pid], state=lab)
    assert b"kvwired" in reply


def test_a_dead_wire_is_found_and_coming_back_up_revives_it(lab: LabState) -> None:
    # What a failed lab test does (tests/lab/conftest.py), on a wire cut on purpose.
    code, _, err = run_in("decode", ["ip", "link", "set", "wire1", "down"], state=lab)
    assert code == 0, err
    try:
        (broken,) = health.broken_rails(lab, timeout=1)
        assert broken.startswith(f"wire1 ({lab.nodes['decode'].rail_addresses[1]})")
        assert "--- decode: links" in health.diagnose(lab)
    finally:
        health.bounce(lab)
    wait_until(lambda: not health.broken_rails(lab, timeout=1), timeout=60,
               what="both wires passing packets again")


def test_status_lists_the_ports_and_a_second_lab_is_refused(lab: LabState) -> None:
    status = kvctl("lab", "status")
    assert status.returncode == 0
    for node in lab.nodes.values():
        assert f"127.0.0.1:{node.ports['control']}" in status.stdout
        wires = ", ".join(f"{address} (wire{rail}, rxe{rail})"
                          for rail, address in enumerate(node.rail_addresses))
        assert re.search(rf"{node.name}\s+up\s+{re.escape(wires)}", status.stdout)
    assert "every wire passes packets" in status.stdout
    second = kvctl("lab", "up")
    assert second.returncode == 2
    assert "already up" in second.stderr and "kvctl lab down" in second.stderr


def test_down_after_a_crashed_up_leaves_nothing(lab: LabState, tmp_path: Path) -> None:
    # A separate lab (its own state directory), killed half-way through `up`.
    state_dir = Path("/var/tmp") / f"kvwire-lab-crash-{os.getpid()}"
    env = {"KVWIRE_LAB_DIR": str(state_dir)}
    up = subprocess.Popen([sys.executable, "-m", "kvctl", "lab", "up"],
                          env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    # Killed once a node is running: up is half-way, with QEMUs to clean up.
    deadline = time.monotonic() + 60
    while not any(alive(pid) for pid in machine_state(state_dir)):
        assert time.monotonic() < deadline, "lab up never started a node"
        time.sleep(0.2)
    up.send_signal(signal.SIGKILL)
    up.wait()
    crashed = machine_state(state_dir)
    assert crashed, "up did not get far enough to start a node"
    assert any(alive(pid) for pid in crashed)

    down = kvctl("lab", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert not state_dir.exists()
    assert not any(alive(pid) for pid in crashed)
    assert not _qemus_of(state_dir)
    # And the session's own lab was left alone.
    assert kvctl("lab", "status").returncode == 0


def machine_state(state_dir: Path) -> list[int]:
    import json

    try:
        raw = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return [node["pid"] for node in raw["nodes"].values()]


def _qemus_of(state_dir: Path) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline and str(state_dir).encode() in cmdline:
                found.append(entry.name)
    return found
