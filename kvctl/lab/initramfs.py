"""The lab nodes' first stage: a tiny initramfs that mounts the host's root.

It holds a static busybox, the modules needed to reach the host's root
filesystem over virtio 9p and to layer a writable tmpfs over it (overlayfs),
and an ``/init`` that mounts them and hands over to the second stage,
``node-init.sh`` from the checkout, running on the host's own userland.
Everything else (virtio_net, rdma_rxe, python, perftest) comes from the
host's root, so a node runs exactly what is installed on the host.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

# What the first stage must load before it can see the host's root.
ROOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.order); do
    insmod "/modules/$m.ko" || echo "kvwire-lab: insmod $m failed"
done
mkdir -p /lower /upper /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /lower || {
    echo "kvwire-lab: cannot mount the host root over 9p"; echo o > /proc/sysrq-trigger; }
mount -t tmpfs -o mode=0755 upper /upper
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot
stage2=$(sed -n 's/.*kvwire.init=\([^ ]*\).*/\1/p' /proc/cmdline)
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash "$stage2"
"""


def module_order(modules_dir: Path, wanted: tuple[str, ...] = ROOT_MODULES) -> list[str]:
    """Relative paths of ``wanted`` and their dependencies, dependencies first."""
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        module, _, rest = line.partition(":")
        deps[module] = rest.split()
    by_name = {Path(path).name.removesuffix(".ko"): path for path in deps}
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in deps.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name not in by_name:
            raise FileNotFoundError(f"module {name} is not in {modules_dir}")
        visit(by_name[name])
    return order


class _Cpio:
    """A newc-format cpio archive, the format the kernel unpacks."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self._ino = 1

    def add(self, name: str, mode: int, data: bytes = b"") -> None:
        header = (
            f"070701{self._ino:08x}{mode:08x}{0:08x}{0:08x}{1:08x}{0:08x}"
            f"{len(data):08x}{0:08x}{0:08x}{0:08x}{0:08x}{len(name) + 1:08x}{0:08x}"
        )
        self._ino += 1
        self.out.write(header.encode() + name.encode() + b"\0")
        self._pad()
        self.out.write(data)
        self._pad()

    def _pad(self) -> None:
        self.out.write(b"\0" * (-self.out.tell() % 4))

    def finish(self) -> bytes:
        self.add("TRAILER!!!", 0)
        return self.out.getvalue()


def build(kernel_version: str, busybox: Path, target: Path) -> Path:
    """Write the initramfs for ``kernel_version`` to ``target``."""
    modules_dir = Path("/lib/modules") / kernel_version
    order = module_order(modules_dir)
    archive = _Cpio()
    for directory in ("bin", "dev", "proc", "sys", "modules"):
        archive.add(directory, stat.S_IFDIR | 0o755)
    archive.add("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes())
    archive.add("init", stat.S_IFREG | 0o755, INIT.encode())
    names = []
    for path in order:
        name = Path(path).name.removesuffix(".ko")
        archive.add(f"modules/{name}.ko", stat.S_IFREG | 0o644,
                    (modules_dir / path).read_bytes())
        names.append(name)
    archive.add("modules.order", stat.S_IFREG | 0o644, ("\n".join(names) + "\n").encode())
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(archive.finish())
    os.replace(tmp, target)
    return target
