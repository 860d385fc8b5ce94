"""The lab's rails as QEMU and the node see them, checked without booting it."""

from __future__ import annotations

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


def test_free_wire_ports_are_distinct() -> None:
    ports = machine._free_udp_ports(8)
    assert len(set(ports)) == 8


@pytest.mark.parametrize("rails", ["0", str(machine.MAX_RAILS + 1)])
def test_an_impossible_rail_count_is_refused_with_the_range(rails: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvctl", "lab", "up", "--rails", rails],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"1 to {machine.MAX_RAILS} rails, not {rails}" in result.stderr
    assert "kvctl lab up --rails 2" in result.stderr
