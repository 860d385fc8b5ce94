#!/usr/bin/env bash
# Installs the Debian packages kvwire needs, only those missing.
# python3-venv: the venv; iproute2: the two-namespace harness and `rdma`;
# rdma-core, ibverbs-utils, python3-pyverbs: the verbs transport and probes;
# gcc, libibverbs-dev, python3-dev: the verbs transport's compiled core, built
# when kvwire is installed (kvwired/transport/verbs/_ibv.c);
# qemu-system-x86, linux-image-amd64 (ships rdma_rxe), busybox-static,
# perftest: the two-node Soft-RoCE lab and its baseline; systemd: the units
# (systemd-analyze); prometheus: the real server the metrics tests scrape with;
# python3-cryptography: kvctl keys mints the cluster CA and node certificates;
# nftables: the fault campaign drops packets where the kernel has no netem;
# etcd-server: the registry the discovery tests run a fleet against.
set -euo pipefail

packages=(python3 python3-venv python3-pip python3-cryptography iproute2 rdma-core
          ibverbs-utils python3-pyverbs gcc libibverbs-dev python3-dev
          qemu-system-x86 linux-image-amd64 busybox-static perftest systemd prometheus
          nftables etcd-server)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing Debian packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null; then
  sudo=(sudo)
else
  echo "error: need root to run: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
