#!/bin/sh
# Install kvwire's daemons as systemd services on this node (make install).
#
#   scripts/install.sh [receiver|sender|both]
#
# PREFIX (default /opt/kvwire): the venv the daemons run from; created, with
# kvwire installed from this checkout, unless it already holds kvwired.
# DESTDIR: stage into another root (packaging, tests); then no user is
# created and systemd is not told.
# Existing /etc/kvwire/*.toml are never overwritten.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${PREFIX:-/opt/kvwire}
DESTDIR=${DESTDIR:-}
case "${1:-both}" in
    receiver|sender) roles=$1 ;;
    both) roles="receiver sender" ;;
    *) echo "usage: $0 [receiver|sender|both]" >&2; exit 2 ;;
esac

if [ ! -x "$DESTDIR$PREFIX/bin/kvwired" ]; then
    # Debian's python3: pyverbs comes from the distribution's rdma-core.
    /usr/bin/python3 -m venv --system-site-packages "$DESTDIR$PREFIX"
    "$DESTDIR$PREFIX/bin/pip" install --quiet --disable-pip-version-check "$here"
fi
install -d -m 0755 "$DESTDIR/etc/kvwire" "$DESTDIR/etc/systemd/system"
for role in $roles; do
    config="$DESTDIR/etc/kvwire/$role.toml"
    [ -e "$config" ] || install -m 0644 "$here/deploy/config/$role.toml" "$config"
    sed "s|/opt/kvwire/bin/kvwired|$PREFIX/bin/kvwired|" \
        "$here/deploy/systemd/kvwired-$role.service" \
        > "$DESTDIR/etc/systemd/system/kvwired-$role.service"
done

if [ -z "$DESTDIR" ]; then
    # The daemons run as kvwire; engines join group kvwire to reach the sockets.
    getent group kvwire >/dev/null || groupadd --system kvwire
    getent passwd kvwire >/dev/null || useradd --system --gid kvwire --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvwire
    # Credentials (kvctl keys): the daemons' group may read them, no one else.
    install -d -m 0750 -g kvwire /etc/kvwire/tls
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
    fi
fi
for role in $roles; do
    echo "installed kvwired-$role.service (config: /etc/kvwire/$role.toml);" \
         "start it with: systemctl enable --now kvwired-$role"
done
