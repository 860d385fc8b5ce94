#!/bin/bash
# Second stage of a lab node, run as PID 1 on the overlay of the host's root.
# Brings up the node's own /proc, /sys, /run and /tmp, its Ethernet wire with
# a Soft-RoCE device bound to it, and its management NIC; then hands PID 1
# to systemd, which runs the agent that `kvctl lab exec` talks to.
# Parameters come on the kernel command line as kvwire.KEY=VALUE.
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
# Rail r is kvwire.railR=ADDRESS/PREFIX,MAC: NIC wireR with Soft-RoCE rxeR.
rails=$(param rails)
for _ in $(seq 50); do
    mgmt=$(iface_with_mac "$(param mgmtmac)")
    missing=0
    for rail in $(seq 0 $((rails - 1))); do
        [ -n "$(iface_with_mac "$(param rail$rail | cut -d, -f2)")" ] || missing=1
    done
    [ -n "$mgmt" ] && [ "$missing" = 0 ] && break
    sleep 0.1
done
[ -n "$mgmt" ] || die "no NIC with MAC $(param mgmtmac)"
# Stable names, whatever order PCI enumeration gave.
ip link set "$mgmt" name mgmt0 && mgmt=mgmt0
ip addr add "$(param mgmt)" dev "$mgmt"
ip link set "$mgmt" up
ip route add default via "$(param gateway)" dev "$mgmt" 2>/dev/null
wires=""
for rail in $(seq 0 $((rails - 1))); do
    spec=$(param rail$rail)
    address=${spec%%,*}
    nic=$(iface_with_mac "${spec#*,}")
    [ -n "$nic" ] || die "no NIC with MAC ${spec#*,} for rail $rail"
    ip link set "$nic" name "wire$rail" || die "renaming $nic to wire$rail"
    ip addr add "$address" dev "wire$rail"
    ip link set "wire$rail" up
    rdma link add "rxe$rail" type rxe netdev "wire$rail" || die "rdma link add rxe$rail"
    wires="$wires wire$rail $address (rxe$rail)"
done

checkout=$(param checkout)
[ -d "$checkout" ] || die "checkout $checkout not visible in the node"
say "node $node up:$wires"

# systemd becomes PID 1, as on a real node: it runs the agent that
# `kvctl lab exec` talks to, and kvwired's own units once `make install`
# has put them in place. The node's /etc is its own (the overlay): the
# host's fstab and enabled services are not this node's business.
: > /etc/fstab
mkdir -p /etc/systemd/system
# tmpfiles would walk /tmp and /var of the host's whole tree over 9p (40 s
# under emulation) for nothing: the node's /run is fresh, its /tmp a layer.
ln -sf /dev/null /etc/systemd/system/systemd-tmpfiles-setup.service
ln -sf /dev/null /etc/systemd/system/systemd-tmpfiles-clean.timer
cat > /etc/systemd/system/kvwire-lab-agent.service <<EOF
[Unit]
Description=kvwire lab agent (kvctl lab exec)
DefaultDependencies=no

[Service]
ExecStart=$(param python) -m kvctl.lab.agent --port $(param agentport) --node $node
WorkingDirectory=$checkout
Environment=PATH=$PATH
# Commands run through the agent get what a root shell in the lab had.
LimitMEMLOCK=infinity
# Daemons a command leaves running outlive an agent restart.
KillMode=process
StandardOutput=journal+console
EOF
cat > /etc/systemd/system/kvwire-lab.target <<EOF
[Unit]
Description=kvwire lab node: the agent, and whatever it starts
Wants=kvwire-lab-agent.service
AllowIsolate=yes
EOF
exec /lib/systemd/systemd --system --unit=kvwire-lab.target
