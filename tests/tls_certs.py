"""Certificates the TLS tests make for themselves: a CA, and leaf certificates it signs.

EC P-256 keys (made in milliseconds); every leaf is valid for 127.0.0.1 and localhost, for
both server and client use, so one identity per process works as in docs/security.md.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Identity:
    """Paths of one PEM certificate and its key."""

    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    """A CA file and identities it signed, plus one from an unrelated CA."""

    ca: str
    server: Identity
    client: Identity
    stranger: Identity  # signed by another CA: must be refused
    stranger_ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _ca(directory: Path, label: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(f"{label} CA"))
            .issuer_name(_name(f"{label} CA")).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    path = directory / f"{label}-ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, str(path)


def _leaf(directory: Path, name: str, ca_key, ca_cert) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return Identity(str(cert_path), str(key_path))


def make_pki(directory: Path) -> Pki:
    """Write a CA, a server and a client identity it signed, and a stranger's, into
    ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert, ca_path = _ca(directory, "cluster")
    other_key, other_cert, other_path = _ca(directory, "other")
    return Pki(ca=ca_path, server=_leaf(directory, "server", ca_key, ca_cert),
               client=_leaf(directory, "client", ca_key, ca_cert),
               stranger=_leaf(directory, "stranger", other_key, other_cert),
               stranger_ca=other_path)
