"""``kvctl probe`` against a fake sysfs: a hardware RNIC, Soft-RoCE on a PCIe NIC
and Soft-RoCE on a veth (no PCIe link at all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.probe import pcie_ceiling_gbps, probe, render
from kvwired.errors import KvwireError

from .test_rdma import _port


def _pci_function(root: Path, bdf: str, speed: str, width: int, numa: int,
                  max_speed: str = "", max_width: int = 0) -> Path:
    function = root / "devices" / "pci0000:00" / bdf
    function.mkdir(parents=True)
    (function / "vendor").write_text("0x15b3\n")
    (function / "current_link_speed").write_text(speed + "\n")
    (function / "current_link_width").write_text(f"{width}\n")
    (function / "max_link_speed").write_text((max_speed or speed) + "\n")
    (function / "max_link_width").write_text(f"{max_width or width}\n")
    (function / "numa_node").write_text(f"{numa}\n")
    return function


def _device(ib: Path, name: str, state: str = "4: ACTIVE") -> Path:
    port = ib / name / "ports" / "1"
    port.mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    return ib / name


@pytest.fixture
def fake(tmp_path: Path) -> tuple[Path, Path]:
    ib, net = tmp_path / "class" / "infiniband", tmp_path / "class" / "net"
    # A ConnectX-style RNIC: its own PCI function, Gen4 x16 running at Gen3 x8.
    mlx = _device(ib, "mlx5_0")
    _port(ib, "mlx5_0", 1, {3: ("0000:0000:0000:0000:0000:ffff:0a00:0005", "RoCE v2", "ens1")})
    (mlx / "device").symlink_to(_pci_function(tmp_path, "0000:3b:00.0", "8.0 GT/s PCIe", 8, 1,
                                              "16.0 GT/s PCIe", 16))
    # rxe0 on wire0, a PCIe NIC (like the lab): rxe -> parent netdev -> PCI function.
    rxe = _device(ib, "rxe0")
    _port(ib, "rxe0", 1, {1: ("0000:0000:0000:0000:0000:ffff:c612:4e01", "RoCE v2", "wire0")})
    (rxe / "parent").write_text("wire0\n")
    (net / "wire0").mkdir(parents=True)
    # virtio-net, as in the lab: the netdev's device is a virtio device below
    # the PCI function.
    virtio = _pci_function(tmp_path, "0000:01:00.0", "2.5 GT/s PCIe", 1, -1) / "virtio3"
    virtio.mkdir()
    (virtio / "vendor").write_text("0x1af4\n")
    (net / "wire0" / "device").symlink_to(virtio)
    # rxe1 on a veth: nothing under it.
    veth = _device(ib, "rxe1")
    _port(ib, "rxe1", 1, {1: ("0000:0000:0000:0000:0000:ffff:c612:4d01", "RoCE v2", "veth0")})
    (veth / "parent").write_text("veth0\n")
    (net / "veth0").mkdir()
    return ib, net


def test_pcie_ceiling_accounts_for_line_encoding() -> None:
    assert pcie_ceiling_gbps(2.5, 1) == pytest.approx(2.0)  # 8b/10b
    assert pcie_ceiling_gbps(8.0, 8) == pytest.approx(63.0, rel=1e-3)  # 128b/130b
    assert pcie_ceiling_gbps(16.0, 16) == pytest.approx(252.06, rel=1e-3)
    assert pcie_ceiling_gbps(None, 4) is None and pcie_ceiling_gbps(8.0, 0) is None


def test_probe_follows_each_device_to_its_pcie_link(fake: tuple[Path, Path]) -> None:
    ib, net = fake
    result = probe(configs=[], root=ib, net=net)
    by_name = {d.name: d for d in result.devices}
    assert set(by_name) == {"mlx5_0", "rxe0", "rxe1"}

    mlx = by_name["mlx5_0"]
    assert mlx.kind == "hardware" and mlx.ports[0].state == "ACTIVE"
    assert mlx.pcie is not None and mlx.pcie.bdf == "0000:3b:00.0"
    assert (mlx.pcie.speed_gts, mlx.pcie.width) == (8.0, 8)
    assert (mlx.pcie.max_speed_gts, mlx.pcie.max_width) == (16.0, 16)
    assert mlx.pcie.numa_node == 1
    assert mlx.pcie.ceiling_gbps == pytest.approx(63.0, rel=1e-3)

    rxe = by_name["rxe0"]
    assert rxe.kind == "soft (on wire0)" and rxe.netdev == "wire0"
    assert rxe.pcie is not None and rxe.pcie.bdf == "0000:01:00.0"
    assert rxe.pcie.ceiling_gbps == pytest.approx(2.0) and rxe.pcie.numa_node is None
    assert "wire0" in rxe.pcie_note

    veth = by_name["rxe1"]
    assert veth.pcie is None and "veth0 is a virtual device" in veth.pcie_note

    text = render(result)
    assert "PCIe 0000:3b:00.0: 8 GT/s x8 (device max 16 GT/s x16), 63.0 Gb/s" in text
    assert "PCIe 0000:01:00.0: 2.5 GT/s x1, 2.0 Gb/s payload ceiling" in text
    assert "no PCIe link: veth0 is a virtual device" in text


def test_probe_shows_the_gid_table_and_the_pick(fake: tuple[Path, Path]) -> None:
    ib, net = fake
    result = probe(device="rxe0", configs=[], root=ib, net=net)
    assert [g["index"] for g in result.gids] == [1]
    assert result.picked is not None and result.picked["ipv4"] == "198.18.78.1"
    assert result.gids[0]["picked"] is True
    assert "<- picks" in render(result)


def test_probe_checks_memlock_against_the_configured_pools(fake: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    ib, net = fake
    config = tmp_path / "receiver.toml"
    config.write_text('pool_size = "64GiB"\n')
    result = probe(configs=[config], root=ib, net=net)
    assert result.pools == {f"receive pool ({config})": 64 << 30}
    assert result.memlock_needed == (64 << 30) + (16 << 20)
    if result.memlock_bytes is not None and result.memlock_bytes < result.memlock_needed:
        assert not result.memlock_ok and "LimitMEMLOCK=infinity" in result.memlock_note


def test_probe_unknown_device_is_a_clear_error(fake: tuple[Path, Path]) -> None:
    ib, net = fake
    with pytest.raises(KvwireError, match="no RDMA device named 'mlx9'"):
        probe(device="mlx9", configs=[], root=ib, net=net)


def test_kvctl_probe_runs_on_this_machine(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvctl", "probe", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "memlock (this shell)" in done.stdout
    assert (tmp_path / "probe.json").read_text().startswith("{")
