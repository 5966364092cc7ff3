"""TLS for every server and client of a cluster (`[cluster.tls]`).

`Tls.load` reads a role's certificate, key and CA once, at start-up, and gives the contexts
every server and client of the process is built with: a server context per protocol (ALPN
`h2` on the HTTP/2 port, `http/1.1` on the HTTP/1.1 one) and one client context, which
checks the server's certificate and name against the CA and presents the role's own
certificate. With `mutual`, servers accept only clients whose certificate the CA signed.

A TLS server accepts through a `TlsListener`, which looks at a connection's first bytes
before any TLS: a TLS ClientHello (a handshake record, 0x16) is handed to the event loop's
TLS transport; plaintext HTTP gets a short answer saying the port speaks TLS, in the
framing the peer speaks (an HTTP/1.1 400 with the error JSON, or an HTTP/2 GOAWAY
INADEQUATE_SECURITY), with one log line and no traceback. The application protocol is made
only once the handshake is done, so the connection limits of `H2Server` and `Http1Server`
apply to TLS connections as they are. A plaintext server answers a ClientHello likewise
(`NOT_TLS_ANSWER`), which a TLS client reads as "wrong version number" (`connect_error`).

Hot path: the event loop's TLS transport (uvloop's, or asyncio's) encrypts what a protocol
writes into a memory BIO and sends that, and decrypts what it reads into fresh bytes: one
copy more on each side than plaintext, besides the cipher itself. Nothing here adds another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from common.errors import BagpipeError, ConfigError, TlsError, Unavailable
from common.ratelog import RateLimitedLogs
from common.spec import TlsSection
from common.transport.limits import LINGER_S, ConnectionLimits

logger = logging.getLogger(__name__)

#: ALPN protocol of each transport kind.
ALPN = {"h2": "h2", "http1": "http/1.1"}
#: The first byte of a TLS handshake record: every ClientHello starts with it.
HANDSHAKE_RECORD = 0x16
#: What a TLS port tells a peer that speaks plaintext to it.
TLS_REQUIRED = ("this port speaks TLS only: connect with TLS (https) and the job's CA "
                "([cluster.tls], or --tls-ca, --tls-cert and --tls-key)")
#: What a mutual-TLS port tells a peer that presented no certificate.
CERTIFICATE_REQUIRED = ("this server accepts only clients with a certificate signed by its CA "
                        "(mutual TLS): this client presented none")
#: How OpenSSL reports a handshake answered by a server that does not speak TLS.
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE",
                              "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL"})
_INADEQUATE_SECURITY = 0xC
_NOT_TLS_BODY = b"This port does not speak TLS: connect without it (http://), or to a server that has [cluster.tls].\n"
#: A plaintext server's answer to a ClientHello (the peer's TLS stack reports it as "wrong
#: version number", the usual sign of TLS spoken to a plaintext port).
NOT_TLS_ANSWER = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
                  b"connection: close\r\n\r\n%s" % (len(_NOT_TLS_BODY), _NOT_TLS_BODY))


@dataclass(frozen=True, eq=False)
class Tls:
    """A process's TLS contexts, made once by `load` and passed to every server and client."""

    client: ssl.SSLContext
    servers: dict[str, ssl.SSLContext]  # by transport kind (`ALPN`)
    section: TlsSection  # what it was loaded from

    @property
    def mutual(self) -> bool:
        return self.section.mutual

    def server(self, kind: str) -> ssl.SSLContext:
        """The context of a server of `kind` ("h2" or "http1")."""
        return self.servers[kind]

    def following(self, job: TlsSection | None) -> Tls:
        """The TLS of a role joined to a job whose spec's `[cluster.tls]` is `job`: its own
        files (the job's name files on the oracle's machine), mutual if the job's is."""
        if job is None or not job.mutual or self.mutual:
            return self
        return Tls.load(dataclasses.replace(self.section, mutual=True))

    @classmethod
    def load(cls, section: TlsSection) -> Tls:
        """Read the section's files and check them: ConfigError naming the field of a file
        that is missing, unreadable or not what it should be, of a key that does not match
        its certificate, and of a certificate that its CA did not sign (or that has expired)."""
        for name, kind in (("cert", "CERTIFICATE"), ("key", "PRIVATE KEY"), ("ca", "CERTIFICATE")):
            _check_pem(getattr(section, name), section.field_name(name), kind)
        _warn_if_readable_by_others(section.key, section.field_name("key"))
        servers = {kind: _server_context(section, alpn) for kind, alpn in ALPN.items()}
        client = _client_context(section)
        _check_signed(servers["h2"], section)
        return cls(client=client, servers=servers, section=section)


def load_tls(section: TlsSection | None) -> Tls | None:
    """`Tls.load`, or None without TLS."""
    return None if section is None else Tls.load(section)


def _check_pem(path: Path, field: str, kind: str) -> None:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(field, f"no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"ENCRYPTED PRIVATE KEY" in text or b"Proc-Type: 4,ENCRYPTED" in text:
        raise ConfigError(field, f"{path} is encrypted: give an unencrypted key, readable by its owner only")
    if f"-----BEGIN {kind}".encode() not in text and not (kind == "PRIVATE KEY" and b"PRIVATE KEY-----" in text):
        raise ConfigError(field, f"{path} holds no PEM {kind.lower()}")


def _warn_if_readable_by_others(path: Path, field: str) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning("%s: %s can be read by others (mode %04o): chmod 600 it", field, path, mode)


def _base_context(purpose: int, section: TlsSection) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2 needs 1.2 at least (RFC 9113 §9.2)
    try:
        context.load_verify_locations(cafile=section.ca)
    except ssl.SSLError as exc:
        raise ConfigError(section.field_name("ca"), f"{section.ca}: not a CA certificate OpenSSL can load: "
                                                    f"{exc.reason or exc}") from None
    try:
        context.load_cert_chain(section.cert, section.key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(section.field_name("key"),
                              f"{section.key} is not the key of {section.cert}") from None
        raise ConfigError(section.field_name("cert"), f"{section.cert} with {section.key}: "
                                                      f"{exc.reason or exc}") from None
    return context


def _server_context(section: TlsSection, alpn: str) -> ssl.SSLContext:
    context = _base_context(ssl.PROTOCOL_TLS_SERVER, section)
    context.set_alpn_protocols([alpn])
    if section.mutual:
        # A certificate the client presents must verify (else the handshake fails); one
        # that presents none is refused after the handshake with an answer saying so
        # (`TlsListener`), which the TLS alert of CERT_REQUIRED would not give it.
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def _client_context(section: TlsSection) -> ssl.SSLContext:
    context = _base_context(ssl.PROTOCOL_TLS_CLIENT, section)  # checks certificates and names
    context.set_alpn_protocols(["h2", "http/1.1"])  # each server offers one: it picks its own
    return context


def _check_signed(server: ssl.SSLContext, section: TlsSection) -> None:
    """A handshake in memory between this role's server context and a client trusting only
    the CA: the role's certificate must verify against it (its name is not checked here)."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.load_verify_locations(cafile=section.ca)
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = [client.wrap_bio(to_client, to_server, server_side=False),
            server.wrap_bio(to_server, to_client, server_side=True)]
    for _ in range(8):  # a TLS 1.3 handshake takes two round trips
        done = 0
        for end in ends:
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as exc:
                raise ConfigError(section.field_name("cert"), f"{section.cert} does not verify against "
                                                              f"{section.ca}: {exc.verify_message}") from None
            except ssl.SSLError:
                return  # not about the certificate: the handshakes with peers will say
        if done == 2:
            return


# -- what a TLS server sends instead of TLS, and what a client makes of it ----------------
def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload) << 8 | kind) + bytes([flags]) + struct.pack(">I", stream_id) + payload


def h2_refusal(message: str) -> bytes:
    """An HTTP/2 server's whole answer to a connection it refuses: its SETTINGS, then GOAWAY
    INADEQUATE_SECURITY carrying `message` (which `H2Client` raises as a `TlsError`)."""
    goaway = struct.pack(">II", 0, _INADEQUATE_SECURITY) + message.encode()
    return _frame(0x4, 0, 0, b"") + _frame(0x7, 0, 0, goaway)


def http1_refusal(message: str) -> bytes:
    """An HTTP/1.1 400 with the error JSON of a `TlsError` (`Http1Client` raises it)."""
    body = orjson.dumps(TlsError(message).to_json())
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(body), body))


def refusal(kind: str, message: str) -> bytes:
    return h2_refusal(message) if kind == "h2" else http1_refusal(message)


def is_inadequate_security(error_code: int) -> bool:
    return error_code == _INADEQUATE_SECURITY


def connect_error(peer: str, exc: BaseException) -> BagpipeError:
    """What a failed connection (or TLS handshake) to `peer` is: a `TlsError` when only a
    change of configuration mends it, `Unavailable` (retried) otherwise."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsError(f"the certificate of {peer} does not verify against this role's CA "
                        f"({exc.verify_message}): it must be signed by cluster.tls.ca and name the "
                        "host this role connects to", peer=peer)
    if isinstance(exc, ssl.SSLError):
        if exc.reason in _NOT_TLS_REASONS:
            return TlsError(f"{peer} does not speak TLS (the handshake got {exc.reason}): it runs without "
                            "[cluster.tls], or this is not its port", peer=peer)
        return TlsError(f"the TLS handshake with {peer} failed: {exc.reason or exc}", peer=peer)
    if isinstance(exc, ConnectionError | TimeoutError) and "handshake" in str(exc).lower():
        return Unavailable(f"the TLS handshake with {peer} was cut short ({exc or type(exc).__name__}): "
                           "is it a TLS port, and does it accept this role's certificate?", peer=peer)
    return Unavailable(f"cannot connect to {peer}: {exc}", peer=peer)


def check_alpn(transport: asyncio.BaseTransport, peer: str, wanted: str) -> None:
    """TlsError unless the TLS connection `transport` agreed on protocol `wanted`."""
    ssl_object = transport.get_extra_info("ssl_object")
    agreed = None if ssl_object is None else ssl_object.selected_alpn_protocol()
    if agreed != wanted:
        raise TlsError(f"{peer} does not speak {wanted} over TLS (ALPN agreed {agreed!r}): is this its "
                       "HTTP/1.1 port?", peer=peer)


# -- the listener ----------------------------------------------------------------------------
class TlsListener:
    """What `loop.create_server` is to a plaintext server, for a TLS one: it listens, sorts
    each connection by its first bytes (`_first_bytes`) and hands the TLS ones, once their
    handshake is done, to a protocol made by `factory`. `sockets`, `close` and `wait_closed`
    are those of `asyncio.Server`.

    Connections not yet handed over (first bytes awaited, handshake going on) have the
    shorter of `limits.auth_timeout_s` and `idle_timeout_s` from their accept to finish (one
    is both idle and without the token), and at most
    `limits.max_unauthenticated_connections` are held: one more closes the oldest, so that a
    flood of silent or slow handshakes costs a bounded number of descriptors.
    """

    def __init__(
        self, factory: Callable[[], asyncio.BaseProtocol], tls: Tls, kind: str, limits: ConnectionLimits,
        logs: RateLimitedLogs,
    ) -> None:
        self._factory, self._tls, self._kind, self._limits, self._logs = factory, tls, kind, limits, logs
        self._context = tls.server(kind)
        self._deadline_s = min(limits.auth_timeout_s, limits.idle_timeout_s)
        self.sockets: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._closed = False

    async def start(self, host: str, port: int, *, backlog: int, sock: socket.socket | None = None) -> None:
        """Listen on `sock`, or on every address of `host` at `port` (OSError if it cannot)."""
        self.sockets = [sock] if sock is not None else await _listen(host, port, backlog)
        loop = asyncio.get_running_loop()
        for listening in self.sockets:
            listening.setblocking(False)
            self._accepting.append(loop.create_task(self._accept(listening)))

    def close(self) -> None:
        """Stop accepting and drop the connections not handed over yet; those handed over
        are the server's to close."""
        self._closed = True
        for task in self._accepting:
            task.cancel()
        for listening in self.sockets:
            listening.close()
        for conn in list(self._pending):
            self._drop(conn)

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._accepting, return_exceptions=True)

    async def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                conn, _ = await loop.sock_accept(listening)
            except OSError as exc:  # out of descriptors, say: wait rather than spin
                self._logs["accept"].warning("accepting a connection failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._arrived(conn)

    def _arrived(self, conn: socket.socket) -> None:
        if len(self._pending) >= self._limits.max_unauthenticated_connections:
            oldest = next(iter(self._pending))
            self._logs["max_unauthenticated_connections"].info(
                "closed a connection from %s to make room: its TLS handshake was not done "
                "(max_unauthenticated_connections)", self._pending[oldest].peer)
            self._drop(oldest)
        loop = asyncio.get_running_loop()
        pending = self._pending[conn] = _Pending(peer=_peer(conn), deadline=loop.time() + self._deadline_s)
        pending.timer = loop.call_at(pending.deadline, self._expired, conn)
        loop.add_reader(conn.fileno(), self._first_bytes, conn)
        pending.reading = True

    def _expired(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is not None:
            self._logs["auth_timeout_s"].info(
                "closed the connection from %s: no TLS handshake within %gs (auth_timeout_s, idle_timeout_s)",
                pending.peer, self._deadline_s)
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        pending = self._pending.pop(conn, None)
        if pending is None:
            return
        pending.stop_reading(conn)
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.handshake is not None:
            pending.handshake.cancel()  # closes the socket with its transport
        else:
            conn.close()

    def _first_bytes(self, conn: socket.socket) -> None:
        """Sort a connection by its first bytes, peeked at (left for the TLS transport)."""
        try:
            head = conn.recv(16, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        pending = self._pending[conn]
        pending.stop_reading(conn)
        if head[:1] == bytes([HANDSHAKE_RECORD]):
            pending.handshake = asyncio.get_running_loop().create_task(self._handshake(conn, pending))
            return
        del self._pending[conn]
        if pending.timer is not None:
            pending.timer.cancel()
        if not head:  # a port probe, or a peer gone at once
            conn.close()
        elif head[:1].isupper():  # a request line, or HTTP/2's preface: PRI * HTTP/2.0
            self._logs["plaintext"].warning(
                "refused a plaintext connection from %s on a TLS port: answered that it speaks TLS only",
                pending.peer)
            answer = h2_refusal(TLS_REQUIRED) if head.startswith(b"PRI ") else http1_refusal(TLS_REQUIRED)
            asyncio.get_running_loop().create_task(_refuse(conn, answer))
        else:
            self._logs["not_tls"].warning("dropped a connection from %s: not TLS (first bytes %r)",
                                          pending.peer, head)
            conn.close()

    async def _handshake(self, conn: socket.socket, pending: _Pending) -> None:
        loop = asyncio.get_running_loop()
        holder = _Handshaking()
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: holder, conn, ssl=self._context,
                ssl_handshake_timeout=max(0.1, pending.deadline - loop.time()), ssl_shutdown_timeout=LINGER_S,
            )
        except ssl.SSLError as exc:  # the peer's certificate, its protocol versions, not TLS at all
            self._logs["handshake"].warning("TLS handshake with %s failed: %s", pending.peer, exc.reason or exc)
            return
        except (OSError, asyncio.TimeoutError) as exc:  # the peer left, or took too long
            self._logs["handshake_cut"].info("TLS handshake with %s cut short: %s", pending.peer,
                                             str(exc) or type(exc).__name__)
            return
        finally:
            if self._pending.get(conn) is pending:
                del self._pending[conn]
                if pending.timer is not None:
                    pending.timer.cancel()
        if holder.lost:
            return
        if self._tls.mutual and not transport.get_extra_info("peercert"):
            self._logs["no_client_certificate"].warning(
                "refused a TLS connection from %s: no client certificate (mutual TLS)", pending.peer)
            transport.write(refusal(self._kind, CERTIFICATE_REQUIRED))
            transport.close()
            return
        holder.hand_over(transport, self._factory())


@dataclass(eq=False)
class _Pending:
    """A connection accepted and not handed over yet."""

    peer: str
    deadline: float
    timer: asyncio.TimerHandle | None = None
    handshake: asyncio.Task[None] | None = None
    reading: bool = False

    def stop_reading(self, conn: socket.socket) -> None:
        if self.reading:
            self.reading = False
            asyncio.get_running_loop().remove_reader(conn.fileno())


class _Handshaking(asyncio.Protocol):
    """The protocol of a TLS connection until its application protocol takes over: what
    arrives meanwhile (the client's first request can come with its last handshake message)
    is kept and handed over."""

    def __init__(self) -> None:
        self.early: list[bytes] = []
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.early.append(data)

    def eof_received(self) -> None:
        self.eof = True  # a TLS transport closes after its peer's close_notify whatever we say

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def hand_over(self, transport: asyncio.BaseTransport, app: asyncio.BaseProtocol) -> None:
        transport.set_protocol(app)
        app.connection_made(transport)
        if self.early and isinstance(app, asyncio.Protocol):
            app.data_received(b"".join(self.early))
        if self.eof and isinstance(app, asyncio.Protocol):
            # The TLS transport is closing already (after the peer's close_notify), and
            # asyncio's must not be closed twice: a second close() unhooks it from its SSL
            # protocol, and what asks it anything then fails. The app closes it as it would.
            app.eof_received()


class _Refusing(asyncio.Protocol):
    """A plaintext connection to a TLS port: `answer` sent, the peer's bytes dropped until it
    closes (at most `LINGER_S`), so that its unread request does not make the kernel reset
    the connection before the answer is read."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer: asyncio.Transport = transport  # type: ignore[assignment]
        writer.write(self._answer)
        if writer.can_write_eof():
            writer.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, writer.close)
        self._transport = writer

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self._transport.close()
        return True


async def _refuse(conn: socket.socket, answer: bytes) -> None:
    try:
        await asyncio.get_running_loop().connect_accepted_socket(lambda: _Refusing(answer), conn)
    except OSError:
        conn.close()


async def _listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address of `host` (as `loop.create_server` makes them)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _peer(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername())
    except OSError:
        return "?"
