"""Certificates for TLS tests, made with `cryptography`: a CA, a server certificate for 127.0.0.1 and
localhost, and client certificates (one from the same CA, one from a CA the server does not trust)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _build(subject: str, key, issuer: tuple[x509.Name, object] | None, *, ca: bool = False,
           server: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def authority(name: str) -> tuple[Pem, x509.Name, object]:
    key = _key()
    cert = _build(name, key, None, ca=True)
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)), cert.subject, key


def issue(ca: tuple[Pem, x509.Name, object], subject: str, *, server: bool = False) -> Pem:
    _, ca_name, ca_key = ca
    key = _key()
    cert = _build(subject, key, (ca_name, ca_key), server=server)
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def write(folder: Path, name: str, pem: Pem) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    cert.write_bytes(pem.cert)
    key.write_bytes(pem.key)
    return cert, key
