"""Certificates for `cachetier up --tls`: a CA of the run and one server certificate it signs.

Everything `up` starts listens on loopback, so one certificate (SAN `127.0.0.1` and `localhost`)
serves the service link, Redis (`tls-port`) and mosquitto; every client verifies it against the
run's CA (`tls/ca.pem`), which a user gives their own clients the same way
(`tls://HOST:PORT?ca=PATH`, `rediss://...?ssl_ca_certs=PATH`, `mqtts://HOST:PORT?ca=PATH`).
Keys are ECDSA P-256, written 0600 (`cachetier.private_files`); the CA's key is not kept.
Clients authenticate with their credentials, not certificates.
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

from cachetier.private_files import write_private

_VALID = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def generate(directory: Path) -> TlsFiles:
    """A new CA and a loopback server certificate in `directory`."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("cachetier run CA"))
          .issuer_name(_name("cachetier run CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALID)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)  # client too: cluster nodes dial each other's bus
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(pem))
    cert_path = directory / "server.pem"
    cert_path.write_bytes(cert.public_bytes(pem))
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    key_path = write_private(directory / "server.key", key_pem)
    return TlsFiles(ca_path, cert_path, key_path)
