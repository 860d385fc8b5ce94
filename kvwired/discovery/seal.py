"""Signed registry records: a receiver seals its record, a sender checks it.

With TLS on, a receiver's record carries its node certificate and an ECDSA
signature by its node key over every other field (``Member.signed_body``).
A sender believes a record only if that certificate was issued by the
cluster's CA, names the receiver the record is for, is a receiver's
(``serverAuth``), is within its validity window, matches the record's
``identity``, and signs the record. So whoever can write to etcd but holds
no receiver's key cannot move a receiver, advertise a pool it does not
have, or take it out of ``auto``: the record is refused, counted, and the
member stays as last believed. No I/O: the credentials are handed in.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..trust import Trust
from .membership import Member, RecordCheck

REASONS = ("unsigned", "bad_certificate", "not_from_ca", "wrong_name", "not_a_receiver",
           "expired", "bad_signature", "undecodable")


def seal(member: Member, trust: Trust) -> Member:
    """``member`` with this node's certificate and its signature."""
    unsigned = dataclasses.replace(member, certificate=trust.certificate_pem, signature="")
    signature = base64.b64encode(trust.sign(unsigned.signed_body())).decode()
    return dataclasses.replace(unsigned, signature=signature)


def checker(trust: Trust) -> RecordCheck:
    """A check of records against ``trust``'s cluster CA (read at each call, so a
    reloaded CA is used at once)."""
    def check(member: Member) -> tuple[str, str] | None:
        assert trust.ca_certificate is not None, "credentials are loaded in Trust()"
        return check_record(member, trust.ca_certificate)
    return check


def check_record(member: Member, ca: x509.Certificate,
                 now: datetime.datetime | None = None) -> tuple[str, str] | None:
    """None if ``member`` is sealed by a receiver of ``ca``'s cluster under its
    own name; else (reason, what is wrong)."""
    if not member.certificate or not member.signature:
        return "unsigned", "the record carries no certificate and signature"
    try:
        certificate = x509.load_pem_x509_certificate(member.certificate.encode())
        signature = base64.b64decode(member.signature, validate=True)
    except (ValueError, binascii.Error) as exc:
        return "bad_certificate", f"its certificate or signature does not decode: {exc}"
    if certificate.fingerprint(hashes.SHA256()).hex() != member.identity:
        return "bad_certificate", "its identity is not its certificate's SHA-256"
    if certificate.issuer != ca.subject or not _signed_by(certificate, ca):
        return "not_from_ca", "its certificate was not issued by this cluster's CA"
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    certified = str(names[0].value) if names else ""
    if certified != member.name:
        return "wrong_name", f"its certificate is {certified!r}'s, not {member.name!r}'s"
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = x509.ExtendedKeyUsage([])
    if ExtendedKeyUsageOID.SERVER_AUTH not in usages:
        return "not_a_receiver", "its certificate is not a receiver's (no serverAuth)"
    moment = now or datetime.datetime.now(datetime.UTC)
    # cryptography 38 (Debian 12's) gives naive datetimes that mean UTC.
    if not (certificate.not_valid_before.replace(tzinfo=datetime.UTC) <= moment
            <= certificate.not_valid_after.replace(tzinfo=datetime.UTC)):
        return "expired", "its certificate is outside its validity window"
    public = certificate.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        return "bad_certificate", "its certificate's key is not an elliptic-curve key"
    try:
        public.verify(signature, member.signed_body(), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return "bad_signature", "its signature does not match its fields"
    return None


def _signed_by(certificate: x509.Certificate, ca: x509.Certificate) -> bool:
    public = ca.public_key()
    hash_algorithm = certificate.signature_hash_algorithm
    if not isinstance(public, ec.EllipticCurvePublicKey) or hash_algorithm is None:
        return False
    try:
        public.verify(certificate.signature, certificate.tbs_certificate_bytes,
                      ec.ECDSA(hash_algorithm))
    except InvalidSignature:
        return False
    return True
