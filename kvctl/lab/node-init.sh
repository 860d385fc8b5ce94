#!/bin/bash
# Second stage of a lab node, run as PID 1 on the overlay of the host's root.
# Brings up the node's own /proc, /sys, /run and /tmp, its Ethernet wire with
# a Soft-RoCE device bound to it, and its management NIC; then runs the
# agent that `kvctl lab exec` talks to. Parameters come on the kernel
# command line as kvwire.KEY=VALUE.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
exec </dev/null >/dev/console 2>&1

param() { sed -n "s/.*kvwire\.$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
say() { echo "kvwire-lab: $*"; }
die() { say "FAILED: $*"; echo o > /proc/sysrq-trigger; sleep 60; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
# /run is the node's own; /tmp, /etc and /var are writable through the
# overlay (the host's files show through until the node writes its own).
mount -t tmpfs -o mode=0755 run /run
shared=$(param shared)
mkdir -p "$shared" && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 labshare "$shared" \
    || die "cannot mount the shared directory $shared"
ln -sf /proc/self/fd /dev/fd 2>/dev/null

node=$(param node)
hostname "$node"
echo "$node" > /etc/hostname

iface_with_mac() {
    for dev in /sys/class/net/*; do
        [ "$(cat "$dev/address")" = "$1" ] && basename "$dev" && return
    done
}

modprobe virtio_net || die "modprobe virtio_net"
modprobe rdma_rxe || die "modprobe rdma_rxe"
ip link set lo up
for _ in $(seq 50); do
    wire=$(iface_with_mac "$(param wiremac)"); mgmt=$(iface_with_mac "$(param mgmtmac)")
    [ -n "$wire" ] && [ -n "$mgmt" ] && break
    sleep 0.1
done
[ -n "$wire" ] || die "no NIC with MAC $(param wiremac)"
[ -n "$mgmt" ] || die "no NIC with MAC $(param mgmtmac)"
# Stable names, whatever order PCI enumeration gave.
ip link set "$wire" name wire0 && wire=wire0
ip link set "$mgmt" name mgmt0 && mgmt=mgmt0
ip addr add "$(param wire)" dev "$wire"
ip link set "$wire" up
ip addr add "$(param mgmt)" dev "$mgmt"
ip link set "$mgmt" up
ip route add default via "$(param gateway)" dev "$mgmt" 2>/dev/null
rdma link add rxe0 type rxe netdev "$wire" || die "rdma link add rxe0"

ulimit -l unlimited
cd "$(param checkout)" || die "checkout $(param checkout) not visible in the node"
say "node $node up: wire $wire $(param wire), rxe0 on $wire"
"$(param python)" -m kvctl.lab.agent --port "$(param agentport)" --node "$node" &
# PID 1 stays bash: it reaps every orphan (daemons started in the background
# by `kvctl lab exec` outlive their shell), which a Python PID 1 would not.
while :; do sleep 3600 & wait $!; done
