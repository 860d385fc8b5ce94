"""Who may talk to a daemon: mutual TLS under one cluster CA.

Every node holds the cluster CA's certificate and a certificate of its own
whose common name is the daemon's ``name``. The certificate's extended key
usage says what the node may be: ``serverAuth`` for a receiver (it answers
control connections), ``clientAuth`` for a sender (it makes them). OpenSSL
checks that usage during the handshake, so a sender's certificate cannot
pose as a receiver, nor the other way round.

Both ends check the chain before anything else is said; the receiver then
holds the sender to the name in its certificate (the hello must say the
same) and, if ``senders`` is set, to that list. Only then is a region key
or a data-connection token disclosed, and both travel inside the TLS
session, out of sight of the network. (docs/DESIGN.md, "Trust".)

The files live in one directory (default /etc/kvwire/tls): ``ca.crt``,
``node.crt``, ``node.key``. ``kvctl keys`` makes them. A reload (SIGHUP)
reads them again: new handshakes use the new certificate and also trust the
new CA, sessions already established are not touched.
"""

from __future__ import annotations

import datetime
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .errors import ConfigError

log = structlog.get_logger("kvwired.trust")

CA_FILE = "ca.crt"
CERT_FILE = "node.crt"
KEY_FILE = "node.key"
DEFAULT_DIR = "/etc/kvwire/tls"
# A certificate this close to its end is loaded with a warning (and alerted on).
EXPIRY_WARNING = datetime.timedelta(days=14)


@dataclass(frozen=True)
class CredentialFiles:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / CA_FILE

    @property
    def cert(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    def check(self) -> None:
        """Every file there, and the private key readable by no one else."""
        for path in (self.ca, self.cert, self.key):
            if not path.is_file():
                raise ConfigError(
                    f"no {path.name} in {self.directory}: this daemon has no credentials",
                    hint=f"on the node holding the cluster CA run `kvctl keys issue NAME "
                         f"--role ROLE --out DIR` and copy DIR to {self.directory}; or set "
                         f"auth = \"none\" to run without authentication")
        mode = self.key.stat().st_mode
        if mode & stat.S_IROTH or mode & stat.S_IWOTH or mode & stat.S_IWGRP:
            raise ConfigError(
                f"{self.key} is readable or writable by others (mode {stat.S_IMODE(mode):o})",
                hint=f"chmod 0640 {self.key} (owner root, group kvwire) or 0600")


def _utc(moment: datetime.datetime) -> datetime.datetime:
    """cryptography 38 (Debian 12's) gives naive datetimes that mean UTC."""
    return moment.replace(tzinfo=datetime.UTC)


def _check_validity(certificate: x509.Certificate, path: Path, what: str) -> None:
    """Refuse a certificate outside its validity window: every handshake made
    with it would fail, and the peers would hear only a verify failure."""
    now = datetime.datetime.now(datetime.UTC)
    not_after, not_before = _utc(certificate.not_valid_after), _utc(certificate.not_valid_before)
    if now > not_after:
        raise ConfigError(
            f"the {what} in {path} expired at "
            f"{not_after.isoformat(timespec='seconds')}",
            hint="issue a new one (`kvctl keys issue NAME --role ROLE`, or `kvctl keys init "
                 "--force` for the CA), copy it in and send SIGHUP")
    if now < not_before:
        raise ConfigError(
            f"the {what} in {path} is not valid before "
            f"{not_before.isoformat(timespec='seconds')}",
            hint="check this node's clock (and the issuing node's), or reissue it")


def peer_name(certificate: dict[str, Any] | None) -> str:
    """The common name of a verified peer certificate (``getpeercert()``)."""
    for rdn in (certificate or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


class Trust:
    """The TLS contexts of one daemon, reloadable in place.

    The contexts are built once and then changed in place on reload: the
    control server keeps the context it was started with, so a new one
    would never be seen by it.
    """

    def __init__(self, directory: str, name: str) -> None:
        self.files = CredentialFiles(Path(directory or DEFAULT_DIR))
        self.name = name
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER)
        self.client = self._context(ssl.PROTOCOL_TLS_CLIENT)
        self.own_name = ""
        self.fingerprint = ""  # SHA-256 of our certificate, hex (the registry shows it)
        self.certificate_pem = ""  # ours, as a receiver's registry record carries it
        self.ca_certificate: x509.Certificate | None = None  # records are checked against it
        self._key: ec.EllipticCurvePrivateKey | None = None
        self.expires_at = 0.0  # our certificate's notAfter, seconds since the epoch
        self.load()

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        # Peers are named by their certificate's common name, not by the
        # address they are reached at (senders are configured by address).
        context.check_hostname = False
        return context

    def load(self) -> None:
        """(Re)read the files; a bad set leaves the loaded one in force."""
        self.files.check()
        trial = self._context(ssl.PROTOCOL_TLS_CLIENT)
        try:
            trial.load_verify_locations(str(self.files.ca))
            trial.load_cert_chain(str(self.files.cert), str(self.files.key))
            own = x509.load_pem_x509_certificate(self.files.cert.read_bytes())
            key = serialization.load_pem_private_key(self.files.key.read_bytes(), None)
        except (ssl.SSLError, OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot load the credentials in {self.files.directory}: {exc}",
                              hint="reissue them with `kvctl keys issue`") from exc
        _check_validity(own, self.files.cert, "certificate")
        try:
            ca = x509.load_pem_x509_certificate(self.files.ca.read_bytes())
        except ValueError as exc:
            raise ConfigError(f"cannot read {self.files.ca}: {exc}",
                              hint="copy the cluster's ca.crt there again") from exc
        _check_validity(ca, self.files.ca, "cluster CA certificate")
        names = own.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        own_name = str(names[0].value) if names else ""
        if own_name != self.name:
            raise ConfigError(
                f"the certificate in {self.files.cert} is for {own_name!r}, "
                f"but this daemon is named {self.name!r}",
                hint=f"issue one for it: kvctl keys issue {self.name} --role ROLE")
        for context in (self.server, self.client):
            context.load_verify_locations(str(self.files.ca))
            context.load_cert_chain(str(self.files.cert), str(self.files.key))
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{self.files.key} is not an elliptic-curve key",
                              hint="reissue the credentials with `kvctl keys issue`")
        self.own_name = own_name
        self.fingerprint = own.fingerprint(hashes.SHA256()).hex()
        self.certificate_pem = own.public_bytes(serialization.Encoding.PEM).decode()
        self.ca_certificate = ca
        self._key = key
        expires = _utc(own.not_valid_after)
        self.expires_at = expires.timestamp()
        left = expires - datetime.datetime.now(datetime.UTC)
        if left < EXPIRY_WARNING:
            log.warning("credentials loaded, close to expiry", directory=str(
                self.files.directory), name=own_name, expires=expires.isoformat(),
                days_left=round(left.total_seconds() / 86400, 1),
                hint=f"reissue with `kvctl keys issue {own_name}` and send SIGHUP")
        else:
            log.info("credentials loaded", directory=str(self.files.directory), name=own_name,
                     expires=expires.isoformat())

    def sign(self, data: bytes) -> bytes:
        """ECDSA (SHA-256) over ``data`` with this node's key: its registry record."""
        assert self._key is not None, "credentials are loaded in __init__"
        return self._key.sign(data, ec.ECDSA(hashes.SHA256()))

    def reload(self) -> bool:
        try:
            self.load()
        except ConfigError as exc:
            log.error("credentials not reloaded; the loaded ones stay in force",
                      error=exc.message, hint=exc.hint)
            return False
        return True
