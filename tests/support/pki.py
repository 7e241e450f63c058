"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1, a client
certificate and a client certificate from a rogue CA, generated at run time (nothing
secret is stored in the repository). Files: ca, server, client, rogue-client (.pem/.key).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _issue(
    subject: str, issuer_key: ec.EllipticCurvePrivateKey | None, issuer: x509.Name | None,
    *, ca: bool = False, ip: str | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))])
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(issuer_key or key, hashes.SHA256())


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca = _issue("test CA", None, None, ca=True)
    _write(root / "ca", ca_key, ca)
    _write(root / "server", *_issue("127.0.0.1", ca_key, ca.subject, ip="127.0.0.1"))
    _write(root / "client", *_issue("trainer", ca_key, ca.subject))
    rogue_key, rogue = _issue("rogue CA", None, None, ca=True)
    _write(root / "rogue-client", *_issue("intruder", rogue_key, rogue.subject))
    return root
