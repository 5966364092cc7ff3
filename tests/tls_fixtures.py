"""Throw-away TLS material for the tests (the `tls_files` fixture of tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass
from pathlib import Path

from common.spec import TlsSection
from common.transport import Tls
from launcher.certs import make_certificates


@dataclass(frozen=True)
class TlsFiles:
    """`section` for every role, `mutual` the same with client certificates required, and
    `stranger` the material of another CA (a peer the cluster's CA never signed)."""

    section: TlsSection
    mutual: TlsSection
    stranger: TlsSection

    def tls(self, *, mutual: bool = False) -> Tls:
        return Tls.load(self.mutual if mutual else self.section)

    def client_context(self, *, cert: TlsSection | None = None) -> ssl.SSLContext:
        """A client context trusting the cluster's CA that presents `cert`'s certificate
        (None: none)."""
        context = ssl.create_default_context(cafile=self.section.ca)
        if cert is not None:
            context.load_cert_chain(cert.cert, cert.key)
        context.set_alpn_protocols(["h2", "http/1.1"])
        return context


def make_tls_files(folder: Path) -> TlsFiles:
    section = make_certificates(folder / "cluster")
    stranger = make_certificates(folder / "stranger")
    return TlsFiles(section=section, mutual=dataclasses.replace(section, mutual=True), stranger=stranger)
