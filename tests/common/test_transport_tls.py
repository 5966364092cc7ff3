"""TLS on both transports, over real sockets on 127.0.0.1 with certificates made for the
session (`tests/tls_fixtures.py`): round trips, ALPN, plaintext and TLS spoken to the wrong
port (a clear error at both ends, one log line, no traceback), mutual TLS, the checks of the
files at start-up, and the bounds on connections whose handshake is not done."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from common.errors import ConfigError, TlsError, Unavailable
from common.spec import TlsSection
from common.transport import Client, ConnectionLimits, H2Server, Http1Server, Tls, connect_client
from tests.common.transport_fixtures import BOUNDED, TOKEN, Service, make_server, read_until_closed
from tests.tls_fixtures import TlsFiles

KINDS = ["h2", "http1"]


@contextlib.asynccontextmanager
async def serving(kind: str, tls: Tls | None, limits: ConnectionLimits = ConnectionLimits()) -> AsyncIterator[H2Server | Http1Server]:
    server = make_server(kind, Service().router(), limits=limits, tls=tls)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def client_of(kind: str, port: int, tls: Tls | None) -> AsyncIterator[Client]:
    client = connect_client(kind, "127.0.0.1", port, TOKEN, 5.0, tls=tls)  # type: ignore[arg-type]
    try:
        yield client
    finally:
        await client.close()


def client_only(files: TlsFiles, *, cert: TlsSection | None) -> Tls:
    """A `Tls` whose client presents `cert`'s certificate (None: none), for clients only."""
    return Tls(client=files.client_context(cert=cert), servers={}, section=files.section)


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(BOUNDED):
        while not condition():
            await asyncio.sleep(0.01)


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [0, 100_000, 16 * 1024 * 1024])
async def test_tls_round_trip(tls_files: TlsFiles, kind: str, size: int) -> None:
    tls = tls_files.tls()
    body = bytes(range(256)) * (size // 256)
    async with serving(kind, tls) as server, client_of(kind, server.port, tls) as client:
        assert await client.call("POST", "/echo", body=body) == body
        chunks = [c async for c in client.stream("GET", "/messages?n=20")]
        assert b"".join(chunks).count(b"message") == sum(range(1, 21))


@pytest.mark.parametrize(("kind", "alpn"), [("h2", "h2"), ("http1", "http/1.1")])
async def test_each_tls_port_agrees_on_its_protocol_by_alpn(tls_files: TlsFiles, kind: str, alpn: str) -> None:
    async with serving(kind, tls_files.tls()) as server:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls_files.client_context(),
                                                  server_hostname="localhost")
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == alpn
        writer.close()


async def test_an_h2_client_on_the_tls_http1_port_says_it_is_not_http2(tls_files: TlsFiles) -> None:
    tls = tls_files.tls()
    async with serving("http1", tls) as server, client_of("h2", server.port, tls) as client:
        with pytest.raises(TlsError, match="does not speak h2 over TLS"):
            await client.call("GET", "/v1/health")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_plaintext_client_on_a_tls_port_is_told_it_speaks_tls(
    tls_files: TlsFiles, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(kind, tls_files.tls()) as server:
        async with client_of(kind, server.port, None) as plain:
            with pytest.raises(TlsError, match="this port speaks TLS only"):
                await plain.call("GET", "/v1/health")
        # Any HTTP/1.1 client (curl http://) reads it too: a 400 with the error JSON.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await read_until_closed(reader)
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and orjson.loads(body)["error"] == "tls"
    assert len(lines(caplog, "plaintext connection")) == 2
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tls_client_on_a_plaintext_port_is_told_it_does_not_speak_tls(
    tls_files: TlsFiles, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(kind, None) as server, client_of(kind, server.port, tls_files.tls()) as client:
        with pytest.raises(TlsError, match="does not speak TLS"):
            await client.call("GET", "/v1/health")
    assert len(lines(caplog, "TLS handshake from")) == 1
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("kind", KINDS)
async def test_mutual_tls_serves_clients_with_a_certificate_of_its_ca(tls_files: TlsFiles, kind: str) -> None:
    tls = tls_files.tls(mutual=True)
    async with serving(kind, tls) as server, client_of(kind, server.port, tls) as client:
        assert await client.call("POST", "/echo", body=b"signed") == b"signed"


@pytest.mark.parametrize("kind", KINDS)
async def test_mutual_tls_refuses_a_client_without_a_certificate_saying_so(
    tls_files: TlsFiles, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(kind, tls_files.tls(mutual=True)) as server:
        async with client_of(kind, server.port, client_only(tls_files, cert=None)) as client:
            with pytest.raises(TlsError, match="mutual TLS.*presented none"):
                await client.call("GET", "/v1/health")  # public routes too
    assert len(lines(caplog, "no client certificate")) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_mutual_tls_refuses_a_certificate_another_ca_signed(
    tls_files: TlsFiles, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = client_only(tls_files, cert=tls_files.stranger)
    async with serving(kind, tls_files.tls(mutual=True)) as server, client_of(kind, server.port, stranger) as client:
        with pytest.raises((Unavailable, TlsError)):
            await client.call("GET", "/v1/health")
    assert lines(caplog, "TLS handshake with")
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tls_client_refuses_a_server_its_ca_did_not_sign(tls_files: TlsFiles, kind: str) -> None:
    async with serving(kind, Tls.load(tls_files.stranger)) as server:
        async with client_of(kind, server.port, tls_files.tls()) as client:
            with pytest.raises(TlsError, match="does not verify against this role's CA"):
                await client.call("GET", "/v1/health")


async def test_a_tls_client_checks_the_name_it_dials(tls_files: TlsFiles) -> None:
    """The certificate names 127.0.0.1, ::1, localhost and this host: not another name."""
    tls = tls_files.tls()
    async with serving("h2", tls) as server:
        client = connect_client("h2", "127.0.0.1.nip.invalid", server.port, TOKEN, 2.0, tls=tls)
        with pytest.raises((TlsError, Unavailable)):  # the name does not even resolve
            await client.call("GET", "/v1/health")
        await client.close()
        context = tls_files.client_context()
        with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
            await asyncio.open_connection("127.0.0.1", server.port, ssl=context, server_hostname="example.com")


async def test_a_tls_port_closes_connections_that_never_start_their_handshake(tls_files: TlsFiles) -> None:
    """A connection with no handshake is idle and has not shown the token: it goes after the
    shorter of idle_timeout_s and auth_timeout_s; a port probe (connect, close) is quiet."""
    limits = ConnectionLimits(auth_timeout_s=0.3)
    async with serving("h2", tls_files.tls(), limits) as server:
        started = asyncio.get_running_loop().time()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await read_until_closed(reader) == b""
        assert 0.3 <= asyncio.get_running_loop().time() - started < BOUNDED
        writer.close()


async def test_a_tls_port_holds_a_bounded_number_of_unfinished_handshakes(
    tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    tls = tls_files.tls()
    async with serving("h2", tls, ConnectionLimits(max_unauthenticated_connections=3)) as server:
        first_reader, first = await asyncio.open_connection("127.0.0.1", server.port)
        silent = [(await asyncio.open_connection("127.0.0.1", server.port))[1] for _ in range(3)]
        assert await read_until_closed(first_reader) == b""  # the oldest made room
        async with client_of("h2", server.port, tls) as client:
            assert await client.call("POST", "/echo", body=b"in") == b"in"
        for writer in [first, *silent]:
            writer.close()
    assert lines(caplog, "max_unauthenticated_connections")


@pytest.mark.parametrize("kind", KINDS)
async def test_tls_connection_limits_still_apply_after_the_handshake(tls_files: TlsFiles, kind: str) -> None:
    """Over TLS a connection that never shows the token goes at its deadline, as in clear."""
    tls = tls_files.tls()
    async with serving(kind, tls, ConnectionLimits(auth_timeout_s=0.3)) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=tls_files.client_context(),
                                                      server_hostname="127.0.0.1")
        await until(lambda: server.connection_count == 1)  # the server's side of the handshake ends later
        with contextlib.suppress(ConnectionError):
            await read_until_closed(reader)
        writer.close()
        await until(lambda: server.connection_count == 0)


# -- the files, checked at start-up ---------------------------------------------------------
def _copy(section: TlsSection, folder: Path) -> TlsSection:
    for path in (section.cert, section.key, section.ca):
        shutil.copy(path, folder / path.name)
    return TlsSection(cert=folder / section.cert.name, key=folder / section.key.name, ca=folder / section.ca.name)


def test_tls_files_are_checked_at_start_up_naming_the_field(tls_files: TlsFiles, tmp_path: Path) -> None:
    good = _copy(tls_files.section, tmp_path)
    Tls.load(good)
    (tmp_path / "empty.pem").write_text("")
    (tmp_path / "encrypted.key").write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nxx\n-----END ENCRYPTED PRIVATE KEY-----\n")
    cases = [
        (dataclasses.replace(good, cert=tmp_path / "missing.pem"), "cluster.tls.cert: no such file"),
        (dataclasses.replace(good, ca=tmp_path), "cluster.tls.ca: cannot read"),
        (dataclasses.replace(good, key=tmp_path / "empty.pem"), "cluster.tls.key: .* holds no PEM private key"),
        (dataclasses.replace(good, key=tmp_path / "encrypted.key"), "cluster.tls.key: .* is encrypted"),
        (dataclasses.replace(good, ca=good.key), "cluster.tls.ca: .* holds no PEM certificate"),
        (dataclasses.replace(good, key=tls_files.stranger.key), "cluster.tls.key: .* is not the key of"),
        (dataclasses.replace(good, cert=tls_files.stranger.cert, key=tls_files.stranger.key),
         "cluster.tls.cert: .* does not verify against"),
        (dataclasses.replace(good, cert=tmp_path / "missing.pem", origin="--tls"), "--tls-cert: no such file"),
    ]
    for section, message in cases:
        with pytest.raises(ConfigError, match=message):
            Tls.load(section)


def test_a_tls_key_readable_by_others_is_warned_about(tls_files: TlsFiles, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    section = _copy(tls_files.section, tmp_path)
    os.chmod(section.key, 0o644)
    Tls.load(section)
    assert lines(caplog, "can be read by others")
    os.chmod(section.key, 0o600)
    caplog.clear()
    Tls.load(section)
    assert not lines(caplog, "can be read by others")


def test_generated_tls_keys_are_private_and_certificates_name_the_hosts(tmp_path: Path) -> None:
    from launcher.certs import make_certificates

    section = make_certificates(tmp_path, ["10.1.2.3", "ps-host.example"], mutual=True)
    assert section.mutual and oct(section.key.stat().st_mode & 0o777) == "0o600"
    text = subprocess.run(["openssl", "x509", "-in", str(section.cert), "-noout", "-text"],
                          capture_output=True, text=True).stdout if shutil.which("openssl") else ""
    if text:
        for name in ("IP Address:127.0.0.1", "DNS:localhost", "IP Address:10.1.2.3", "DNS:ps-host.example",
                     "TLS Web Server Authentication", "TLS Web Client Authentication"):
            assert name in text
    Tls.load(section)


# -- interop: curl over TLS ------------------------------------------------------------------
def _curl_speaks_http2_over_tls() -> str | None:
    if shutil.which("curl") is None:
        return "needs curl"
    features = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout
    if "HTTP2" not in features or "SSL" not in features:
        return "curl lacks HTTP/2 or TLS (curl --version lists neither HTTP2 nor SSL)"
    return None


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_curl_fetches_health_from_a_real_ps_over_tls_http2(tls_files: TlsFiles, tmp_path: Path,
                                                                mutual: bool) -> None:
    if reason := _curl_speaks_http2_over_tls():
        pytest.skip(reason)
    from ps.service import PsService
    from tests.ps.conftest import make_service

    service: PsService = make_service(0, 1, tmp_path)
    files = tls_files.mutual if mutual else tls_files.section
    server = H2Server(service.router(), token=TOKEN, tls=Tls.load(files))
    await server.start()
    try:
        cert = ["--cert", str(files.cert), "--key", str(files.key)] if mutual else []
        for host in ("127.0.0.1", "localhost"):
            curl = await asyncio.create_subprocess_exec(
                "curl", "--silent", "--show-error", "--http2", "--cacert", str(files.ca), *cert,
                "--write-out", "\n%{http_version} %{http_code}", f"https://{host}:{server.port}/v1/health",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(curl.communicate(), BOUNDED)
            assert curl.returncode == 0, err.decode()
            body, _, status = out.decode().rpartition("\n")
            assert status == "2 200" and orjson.loads(body)["role"] == "ps"
            auth = await asyncio.create_subprocess_exec(
                "curl", "--silent", "--http2", "--cacert", str(files.ca), *cert, "-H", f"authorization: Bearer {TOKEN}",
                "--write-out", "%{http_code}", "-o", "/dev/null", f"https://{host}:{server.port}/v1/status",
                stdout=subprocess.PIPE)
            assert (await asyncio.wait_for(auth.communicate(), BOUNDED))[0] == b"200"
    finally:
        await server.stop()
