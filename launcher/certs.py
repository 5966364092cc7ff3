"""Throw-away TLS material for a local cluster (`launch.py SPEC --tls`), tests and benchmarks:
a CA made for one run and one certificate signed by it that every role presents, as server
and as client.

Made with the `cryptography` package, in process: no `openssl` binary needed, nothing
parsed from a tool's output. Keys are ECDSA P-256 (fast handshakes) and written with mode
0600; the CA's key is never written, so nothing outside this run can be signed by its CA.
The certificate names 127.0.0.1, ::1, localhost, this machine's name and the hosts given.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.spec import ClusterSpec, TlsSection

#: How long the certificates are valid: a run (restarts included) ends long before.
VALID = datetime.timedelta(days=30)
#: Hosts a listener may be given that are no peer's name for it.
_WILDCARDS = {"0.0.0.0", "::", ""}


def spec_hosts(spec: ClusterSpec) -> set[str]:
    """Every host the spec's roles listen on (a certificate must name each one clients dial)."""
    hosts = {spec.oracle.address.host, spec.trainers.metrics_address.host, *(a.host for a in spec.ps.addresses)}
    return hosts - _WILDCARDS


def make_certificates(folder: Path, hosts: Iterable[str] = (), *, mutual: bool = False) -> TlsSection:
    """Write `ca.pem`, `node.pem` and `node.key` into `folder` (replacing what is there) and
    return the `[cluster.tls]` section naming them. `node.pem` is valid for server and
    client use, for the loopback names, this machine's name and `hosts`."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"bagpipe throw-away CA {now:%Y-%m-%d %H:%M:%S}")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    node = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bagpipe role")]), ca_name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    section = TlsSection(cert=folder / "node.pem", key=folder / "node.key", ca=folder / "ca.pem", mutual=mutual,
                         origin="--tls")
    section.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    section.cert.write_bytes(node.public_bytes(serialization.Encoding.PEM))
    write_key(section.key, key)
    return section


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """`key` as unencrypted PKCS#8 PEM, created with mode 0600 (never readable by others,
    not even for a moment)."""
    path.unlink(missing_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of the hosts differ a little
        .not_valid_after(now + VALID)
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """Subject alternative names: IP addresses as such, the rest as DNS names."""
    names: dict[str, x509.GeneralName] = {}
    for host in ["127.0.0.1", "::1", "localhost", socket.gethostname(), *hosts]:
        host = host.strip("[]")
        if not host or host in _WILDCARDS or host in names:
            continue
        try:
            names[host] = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            names[host] = x509.DNSName(host)
    return list(names.values())
