"""The lab's rails as QEMU and the node see them, checked without booting it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvctl.lab import machine


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


@pytest.mark.parametrize("rails", [1, 2, 4])
def test_each_rail_is_a_nic_of_its_own_with_its_own_wire(rails: int) -> None:
    prefill, decode = machine.NODES
    wires = [(40000 + 2 * rail, 40001 + 2 * rail) for rail in range(rails)]
    argv = machine._qemu_command(prefill, "6.1.0-test", {name: 1 for name in machine.FORWARDED},
                                 "/usr/bin/python3", "/src", wires)
    devices = _values(argv, "-device")
    root_ports = [d for d in devices if d.startswith("pcie-root-port")]
    wire_nics = [d for d in devices if "netdev=wire" in d]
    assert len(root_ports) == len(wire_nics) == rails
    # Each NIC behind its own root port, so each rxe device has its own PCIe link.
    assert [nic.split("bus=")[1].split(",")[0] for nic in wire_nics] == [
        f"rp{rail + 1}" for rail in range(rails)]
    macs = [nic.split("mac=")[1].split(",")[0] for nic in wire_nics]
    assert len(set(macs)) == rails and machine.NODES[0].mgmt_mac not in macs
    assert macs[0] == "52:54:00:4b:57:01"  # rail 0 as before rails existed
    dgrams = [n for n in _values(argv, "-netdev") if n.startswith("dgram")]
    for rail, (local, remote) in enumerate(wires):
        assert f"local.port={local}," in dgrams[rail] and f"remote.port={remote}" in dgrams[rail]
    # What the node's init reads: the count, then each rail's address and MAC.
    append = _values(argv, "-append")[0].split()
    assert f"kvwire.rails={rails}" in append
    for rail in range(rails):
        subnet = machine.RAIL_SUBNETS[rail]
        assert f"kvwire.rail{rail}={subnet}.1/24,{macs[rail]}" in append
        assert decode.rail_address(rail) == f"{subnet}.2"
    assert len(set(machine.RAIL_SUBNETS)) == machine.MAX_RAILS
    assert machine.MGMT_NET not in machine.RAIL_SUBNETS


@pytest.mark.parametrize("kind", [socket.SOCK_DGRAM, socket.SOCK_STREAM])
def test_the_labs_host_ports_are_distinct_free_and_below_the_ephemeral_range(
        kind: socket.SocketKind) -> None:
    """Below the range no outgoing connection can take a port between the probe
    and QEMU's bind (CI saw one taken there)."""
    ports = machine._free_ports(8, kind)
    assert len(set(ports)) == 8
    low, high = machine._lab_port_range()
    ephemeral_low = int(machine.EPHEMERAL_RANGE.read_text().split()[0])
    assert high < ephemeral_low and all(low <= port <= high for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, kind) as again:
            again.bind(("127.0.0.1", port))


def test_a_port_taken_while_qemu_starts_is_drawn_again_and_other_failures_are_not(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(machine, "why_lab_cannot_run", lambda: None)
    monkeypatch.setattr(machine, "find_kernel", lambda: "6.1.0-test")
    monkeypatch.setattr(machine.LabState, "load", classmethod(lambda cls: None))
    failures = [machine.LabError(f"node prefill stopped while booting:\n"
                                 f"{machine.PORT_TAKEN} 'tcp:127.0.0.1:28087-:7400'")]
    booted = machine.LabState(kernel="6.1.0-test", started=0.0, rails=1)

    def boot(kernel: str, rails: int) -> machine.LabState:
        if failures:
            raise failures.pop()
        return booted

    monkeypatch.setattr(machine, "_boot", boot)
    assert machine.up(out=sys.stdout) is booted
    assert "attempt 1 of 3" in capsys.readouterr().out

    failures[:] = [machine.LabError("node decode not ready within 240 s")]
    with pytest.raises(machine.LabError, match="not ready"):
        machine.up(out=sys.stdout)
    assert not failures

    attempts = []

    def always_taken(kernel: str, rails: int) -> machine.LabState:
        attempts.append(1)
        raise machine.LabError(machine.PORT_TAKEN)

    monkeypatch.setattr(machine, "_boot", always_taken)
    with pytest.raises(machine.LabError):
        machine.up(out=sys.stdout)
    assert len(attempts) == machine.BOOT_ATTEMPTS


@pytest.mark.parametrize("rails", ["0", str(machine.MAX_RAILS + 1)])
def test_an_impossible_rail_count_is_refused_with_the_range(rails: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvctl", "lab", "up", "--rails", rails],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"1 to {machine.MAX_RAILS} rails, not {rails}" in result.stderr
    assert "kvctl lab up --rails 2" in result.stderr
