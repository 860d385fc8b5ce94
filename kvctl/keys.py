"""``kvctl keys``: the cluster CA and each node's credentials.

``kvctl keys init`` makes the cluster CA once, on one node (its key never
leaves that node). ``kvctl keys issue NAME --role receiver|sender`` makes a
node's key and certificate under it, in a directory to copy to the node's
/etc/kvwire/tls. Reissuing a node (rotation) is the same command; the
daemons pick the new files up on SIGHUP (``systemctl reload``) without
dropping established sessions.

Keys are ECDSA P-256: small, fast to verify on an emulated lab node, and
supported by every TLS 1.3 stack.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import grp
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvwired.errors import ConfigError
from kvwired.trust import CA_FILE, CERT_FILE, DEFAULT_DIR, KEY_FILE

CA_KEY_FILE = "ca.key"
ROLES = {
    "receiver": [ExtendedKeyUsageOID.SERVER_AUTH],
    "sender": [ExtendedKeyUsageOID.CLIENT_AUTH],
    "both": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
}
DAEMON_GROUP = "kvwire"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvwire"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int, group: int | None = None) -> None:
    """Atomically, with its mode from the start: a key is never readable by others,
    and a daemon reloading mid-write never sees half a file."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        if group is not None:
            os.fchown(fd, -1, group)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _daemon_group() -> int | None:
    """The daemons' group, if this host has it and we may give files to it."""
    try:
        gid = grp.getgrnam(DAEMON_GROUP).gr_gid
    except KeyError:
        return None
    return gid if os.geteuid() == 0 else None


def _check_lifetime(days: int) -> None:
    if days < 1:
        raise ConfigError(f"a lifetime of {days} days makes a certificate that is already "
                          "expired", hint="pass --days 1 or more (the default is a year)")


def init_ca(directory: Path, cluster: str = "kvwire", days: int = 3650,
            force: bool = False) -> Path:
    _check_lifetime(days)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_KEY_FILE).exists() and not force:
        raise ConfigError(f"{directory / CA_KEY_FILE} exists: this cluster has a CA already",
                          hint="issue node credentials with `kvctl keys issue`; --force "
                               "replaces the CA, and every node must then be reissued")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{cluster} cluster CA"))
        .issuer_name(_name(f"{cluster} cluster CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(directory / CA_KEY_FILE, _pem_key(key), 0o600)
    _write(directory / CA_FILE, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
    return directory / CA_FILE


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        certificate = x509.load_pem_x509_certificate((directory / CA_FILE).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY_FILE).read_bytes(), None)
    except FileNotFoundError as exc:
        raise ConfigError(f"no cluster CA in {directory} ({exc.filename} is missing)",
                          hint="run `kvctl keys init` once, on one node") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{directory / CA_KEY_FILE} is not a kvwire CA key")
    return certificate, key


def issue(ca_directory: Path, name: str, role: str, out: Path, days: int = 365) -> Path:
    """A node's key and certificate (and the CA certificate) in ``out``."""
    _check_lifetime(days)
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}", hint=f"one of {', '.join(ROLES)}")
    if not name or len(name) > 64 or not name.isprintable():
        raise ConfigError(f"{name!r} cannot name a node", hint="use the daemon's `name`")
    ca_certificate, ca_key = _load_ca(ca_directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(ROLES[role]), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    group = _daemon_group()
    _write(out / KEY_FILE, _pem_key(key), 0o640 if group is not None else 0o600, group)
    _write(out / CERT_FILE, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
    if (out / CA_FILE).resolve() != (ca_directory / CA_FILE).resolve():
        shutil.copyfile(ca_directory / CA_FILE, out / CA_FILE)
    return out


def describe(directory: Path) -> dict[str, Any]:
    """What the credentials in ``directory`` say: names, roles, expiry."""
    result: dict[str, Any] = {"directory": str(directory)}
    for label, file in (("ca", CA_FILE), ("node", CERT_FILE)):
        path = directory / file
        if not path.exists():
            result[label] = None
            continue
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
        names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        entry: dict[str, Any] = {"name": str(names[0].value) if names else "",
                                 "expires": certificate.not_valid_after.isoformat()}
        with contextlib.suppress(x509.ExtensionNotFound):
            usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
            entry["role"] = next(role for role, oids in ROLES.items()
                                 if set(oids) == set(usages.value))
        result[label] = entry
    return result


def add_parser(commands: Any) -> None:
    keys = commands.add_parser("keys", help="the cluster CA and each node's credentials")
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    init = actions.add_parser("init", help="make the cluster CA (once, on one node)")
    init.add_argument("--dir", type=Path, default=Path(DEFAULT_DIR),
                      help=f"where the CA lives (default {DEFAULT_DIR})")
    init.add_argument("--cluster", default="kvwire", help="a name for the cluster")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(handler=_init)
    issue_parser = actions.add_parser(
        "issue", help="a node's key and certificate under the cluster CA (again: rotation)")
    issue_parser.add_argument("name", help="the daemon's `name` in its config")
    issue_parser.add_argument("--role", required=True, choices=sorted(ROLES))
    issue_parser.add_argument("--dir", type=Path, default=Path(DEFAULT_DIR),
                              help=f"the CA's directory (default {DEFAULT_DIR})")
    issue_parser.add_argument("--out", type=Path, help="where to write them (default: --dir, "
                              "for the CA's own node); copy the directory to the node's "
                              f"{DEFAULT_DIR}")
    issue_parser.add_argument("--days", type=int, default=365)
    issue_parser.set_defaults(handler=_issue)
    show = actions.add_parser("show", help="what credentials a directory holds")
    show.add_argument("--dir", type=Path, default=Path(DEFAULT_DIR))
    show.set_defaults(handler=_show)


def _init(args: argparse.Namespace) -> int:
    path = init_ca(args.dir, args.cluster, force=args.force)
    print(f"cluster CA: {path} (its key, {args.dir / CA_KEY_FILE}, stays on this node)")
    return 0


def _issue(args: argparse.Namespace) -> int:
    out = issue(args.dir, args.name, args.role, args.out or args.dir, args.days)
    print(f"{args.name} ({args.role}): {out / CERT_FILE}, {out / KEY_FILE}, {out / CA_FILE}")
    if args.out is not None:
        print(f"copy {out}/ to {DEFAULT_DIR}/ on {args.name}'s node, then "
              "`systemctl reload` its daemon")
    return 0


def _show(args: argparse.Namespace) -> int:
    info = describe(args.dir)
    for label in ("ca", "node"):
        entry = info[label]
        print(f"{label:5} " + ("(none)" if entry is None else
                               " ".join(f"{k}={v}" for k, v in entry.items())))
    return 0


def local_cluster(root: Path, nodes: dict[str, str]) -> dict[str, Path]:
    """A CA under ``root/ca`` (made once) and credentials for each of ``nodes``
    (name -> role) under ``root/NAME``, for the harnesses that run a
    cluster on one machine (namespaces, the lab, tests), with auth on as a
    deployment runs it. Returns each node's tls_dir."""
    ca = root / "ca"
    if not (ca / CA_KEY_FILE).exists():
        init_ca(ca, cluster="kvwire-local")
    directories = {}
    for name, role in nodes.items():
        out = root / name
        if not (out / CERT_FILE).exists() or describe(out)["node"].get("role") != role:
            issue(ca, name, role, out)
        directories[name] = out
    return directories


def with_credentials(config: dict[str, Any], role: str, root: Path) -> dict[str, Any]:
    """``config`` (a daemon's, as a dict) with ``tls_dir`` pointing at credentials
    for its name under ``root``'s local cluster, unless it runs without auth
    or names its own."""
    if config.get("auth", "tls") == "none" or "tls_dir" in config:
        return config
    name = str(config["name"])
    return {**config, "tls_dir": str(local_cluster(root, {name: role})[name])}
