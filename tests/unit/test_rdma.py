"""Device and GID selection, and the memlock check, against a fake sysfs."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from kvwired.rdma import (
    MemlockTooLow,
    NoRdmaPath,
    active_roce_devices,
    check_memlock,
    gid_table,
    pick_gid,
    rail_gid,
    roce_devices,
    source_address,
)


def _port(root: Path, device: str, port: int, gids: dict[int, tuple[str, str, str]]) -> None:
    base = root / device / "ports" / str(port)
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for index in range(8):
        gid, gid_type, netdev = gids.get(index, ("0000:0000:0000:0000:0000:0000:0000:0000",
                                                 "", ""))
        (base / "gids" / str(index)).write_text(gid + "\n")
        if gid_type:
            (base / "gid_attrs/types" / str(index)).write_text(gid_type + "\n")
            (base / "gid_attrs/ndevs" / str(index)).write_text(netdev + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    # Like rxe in the lab: link-local at 0, IPv4-mapped at 1; plus a second
    # device whose RoCE v1 entry holds another address.
    _port(tmp_path, "rxe0", 1, {
        0: ("fe80:0000:0000:0000:5054:00ff:fe4b:5701", "RoCE v2", "wire0"),
        1: ("0000:0000:0000:0000:0000:ffff:c612:4e01", "RoCE v2", "wire0"),
    })
    _port(tmp_path, "mlx5_1", 1, {
        0: ("0000:0000:0000:0000:0000:ffff:0a00:0005", "IB/RoCE v1", "eth1"),
        1: ("0000:0000:0000:0000:0000:ffff:0a00:0005", "RoCE v2", "eth1"),
    })
    return tmp_path


def test_gid_table_skips_empty_entries(sysfs: Path) -> None:
    table = gid_table(sysfs)
    assert [(e.device, e.index) for e in table] == [("mlx5_1", 0), ("mlx5_1", 1),
                                                   ("rxe0", 0), ("rxe0", 1)]
    assert table[3].ipv4 == "198.18.78.1" and table[3].netdev == "wire0"


def test_roce_devices_are_those_with_a_roce_v2_entry(sysfs: Path) -> None:
    # A daemon registers its pool with each: every one is a rail a peer's
    # address may route its data over.
    _port(sysfs, "ib0", 1, {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1", "")})
    _port(sysfs, "rxe1", 1, {1: ("0000:0000:0000:0000:0000:ffff:c612:5001", "RoCE v2", "wire1")})
    assert roce_devices(sysfs) == ["mlx5_1", "rxe0", "rxe1"]
    assert roce_devices(sysfs / "absent") == []


def test_the_roce_v2_entry_of_the_local_address_is_chosen(sysfs: Path) -> None:
    chosen = pick_gid("198.18.78.1", root=sysfs)
    assert (chosen.device, chosen.port, chosen.index) == ("rxe0", 1, 1)
    other = pick_gid("10.0.0.5", root=sysfs)
    assert (other.device, other.index, other.type) == ("mlx5_1", 1, "RoCE v2")


def test_overrides_are_checked(sysfs: Path) -> None:
    assert pick_gid("198.18.78.1", device="rxe0", gid_index=0, root=sysfs).index == 0
    with pytest.raises(NoRdmaPath, match="no GID index 9") as info:
        pick_gid("198.18.78.1", gid_index=9, root=sysfs)
    assert "rxe0 port 1 index 1" in info.value.hint  # the valid entries are listed
    with pytest.raises(NoRdmaPath, match="is IB/RoCE v1, not RoCE v2"):
        pick_gid("10.0.0.5", device="mlx5_1", gid_index=0, root=sysfs)


def test_an_address_without_a_gid_is_explained(sysfs: Path, tmp_path: Path) -> None:
    with pytest.raises(NoRdmaPath, match=r"no RoCE v2 GID for local address 192\.0\.2\.7"):
        pick_gid("192.0.2.7", root=sysfs)
    with pytest.raises(NoRdmaPath, match="no RDMA device") as info:
        pick_gid("192.0.2.7", root=tmp_path / "empty")
    assert "rdma link add" in info.value.hint


def test_memlock_too_low_says_the_limit_the_need_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    with pytest.raises(MemlockTooLow) as info:
        check_memlock(256 << 20, "the 256 MiB pool")
    assert "is 8 MiB" in info.value.message and "272 MiB" in info.value.message
    assert "LimitMEMLOCK=infinity" in info.value.hint and "ulimit -l" in info.value.hint
    monkeypatch.setattr(resource, "getrlimit",
                        lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    check_memlock(256 << 20, "the 256 MiB pool")  # unlimited: fine


def test_rails_take_each_devices_ipv4_roce_v2_entry(sysfs: Path) -> None:
    assert rail_gid("rxe0", sysfs).index == 1  # ::ffff:198.18.78.1, not the link-local 0
    assert rail_gid("mlx5_1", sysfs).ipv4 == "10.0.0.5"
    _port(sysfs, "ib0", 1, {0: ("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1", "")})
    with pytest.raises(NoRdmaPath, match="rail ib0 has no RoCE v2 GID") as refused:
        rail_gid("ib0", sysfs)
    assert "mlx5_1, rxe0" in refused.value.hint


def test_auto_rails_are_the_devices_with_an_active_port(sysfs: Path) -> None:
    (sysfs / "rxe0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    (sysfs / "mlx5_1" / "ports" / "1" / "state").write_text("1: DOWN\n")
    assert active_roce_devices(sysfs) == ["rxe0"]


def test_the_source_address_is_what_the_routes_say() -> None:
    assert source_address("127.0.0.1") == "127.0.0.1"


def test_the_choices_read_a_table_they_are_given_as_they_read_sysfs(
        sysfs: Path, tmp_path: Path) -> None:
    # The verbs transport hands them the table it asked the devices for; the
    # sysfs under `root` is then not read at all (here: there is none).
    table = gid_table(sysfs)
    nowhere = tmp_path / "no-sysfs"
    assert pick_gid("198.18.78.1", root=nowhere, table=table) == pick_gid("198.18.78.1",
                                                                          root=sysfs)
    assert rail_gid("mlx5_1", nowhere, table=table) == rail_gid("mlx5_1", sysfs)
    assert roce_devices(nowhere, table=table) == roce_devices(sysfs)
    with pytest.raises(NoRdmaPath, match="devices with one: mlx5_1, rxe0"):
        rail_gid("ib0", nowhere, table=table)
    with pytest.raises(NoRdmaPath, match="no RDMA device"):
        pick_gid("198.18.78.1", root=sysfs, table=[])
