"""A throw-away certificate authority for tests of TLS and mutual TLS (common/auth.py).

    ca = TestCA(tmp_path / "pki")
    server = ca.issue("server", ips=["127.0.0.1"], dns=["localhost"])   # -> Issued(cert, key) paths
    client = ca.issue("client")
    other = TestCA(tmp_path / "other")                                  # a CA nobody trusts

Real X.509 (the ``cryptography`` package, ECDSA P-256, SHA-256), valid from a minute ago for a day;
files are written 0600 like real keys. Leaves carry both serverAuth and clientAuth, so one
certificate serves a node as server and as client, as pegaflow-server uses it.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    cert: str  # PEM certificate path
    key: str  # PEM private key path (unencrypted PKCS#8)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: pathlib.Path, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(path)


class TestCA:
    __test__ = False  # not a pytest test class

    def __init__(self, directory: str | os.PathLike, name: str = "pegaflow test CA") -> None:
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._not_before = now - datetime.timedelta(minutes=1)
        self._not_after = now + datetime.timedelta(days=1)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = _write(self.dir / "ca.pem", self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, ips: Sequence[str] = (), dns: Sequence[str] = ()) -> Issued:
        """A leaf certificate for ``name`` naming ``ips`` and ``dns`` (and ``name``) in its SAN."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(name)] + [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return Issued(
            cert=_write(self.dir / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(self.dir / f"{name}.key", key_pem),
        )


def write_token_file(path: str | os.PathLike, *tokens: str) -> str:
    """A token file (one token per line, 0600) as --auth-token-file reads it; returns its path."""
    return _write(pathlib.Path(path), "".join(t + "\n" for t in tokens).encode())
