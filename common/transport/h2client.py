"""HTTP/2 client, cleartext (h2c) or over TLS: one long-lived multiplexed connection per
peer, lazily opened, replaced after GOAWAY or connection loss."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import h2.errors
import h2.events
import h2.exceptions

from common.errors import BagpipeError, TimedOut, TlsError, Unavailable
from common.transport.h2base import H2Protocol, StreamGone, Waiters
from common.transport.http import (
    Body,
    Client,
    ClientResponse,
    auth_headers,
    body_length,
    body_parts,
    raise_for_answer,
)
from common.transport.links import open_socket
from common.transport.tls import ALPN, Tls, check_alpn, connect_error, is_inadequate_security

logger = logging.getLogger(__name__)


class _Inbound:
    """The response side of one stream: filled by the reader, drained by the caller."""

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming
        self.headers: dict[str, str] | None = None
        self.ended = False
        self.error: BaseException | None = None
        self._chunks: deque[tuple[bytes, int]] = deque()  # (data, flow-controlled length)
        self._changed = Waiters()

    def on_headers(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self._changed.wake()

    def on_data(self, data: bytes, flow_controlled: int) -> None:
        self._chunks.append((data, flow_controlled))
        self._changed.wake()

    def on_end(self) -> None:
        self.ended = True
        self._changed.wake()

    def on_error(self, error: BaseException) -> None:
        if not self.ended:
            self.error = error
            self._changed.wake()

    async def complete(self) -> tuple[dict[str, str], bytes]:
        """The headers and whole body of a response, once it has ended."""
        while not self.ended:
            if self.error is not None:
                raise self.error
            await self._changed.wait()
        assert self.headers is not None  # h2 ends no stream before its response headers
        return self.headers, b"".join(chunk for chunk, _ in self._chunks)

    async def response_headers(self) -> dict[str, str]:
        while self.headers is None:
            if self.error is not None:
                raise self.error
            await self._changed.wait()
        return self.headers

    async def next(self) -> tuple[bytes, int] | None:
        """The next received chunk, or None at the end of the body."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.ended:
                return None
            await self._changed.wait()
        return self._chunks.popleft()


class _ClientProtocol(H2Protocol):
    def __init__(self, peer: str, *, tls: bool = False) -> None:
        super().__init__(client_side=True)
        self.peer = peer
        self.tls = tls
        self.streams: dict[int, _Inbound] = {}
        self.draining = False  # no new streams here: GOAWAY seen or stream ids used up
        self._settings_seen = False
        self._slots = Waiters()

    @property
    def usable(self) -> bool:
        return self.error is None and not self.draining

    async def ready(self) -> None:
        """Wait for the server's SETTINGS, so its stream limit is known before we open any."""
        while not self._settings_seen:
            if self.error is not None:
                raise self.error
            await self.windows_changed.wait()

    # -- events from the reader -------------------------------------------------------
    def handle_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            if inbound := self.streams.get(event.stream_id):
                inbound.on_headers(dict(event.headers or []))
        elif isinstance(event, h2.events.DataReceived):
            self._data_received(event)
        elif isinstance(event, h2.events.StreamEnded):
            if inbound := self._finished(event.stream_id):
                inbound.on_end()
        elif isinstance(event, h2.events.StreamReset):
            if inbound := self._finished(event.stream_id):
                code = h2.errors.ErrorCodes(event.error_code).name
                inbound.on_error(Unavailable(f"{self.peer} reset the stream ({code})"))
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self._settings_seen = True
            self._slots.wake()
        elif isinstance(event, h2.events.ConnectionTerminated):
            # h2 allows no frame after GOAWAY, so nothing in flight can complete here.
            self.draining = True
            self._fail(self._goaway_error(event))
            self.close()

    def _goaway_error(self, event: h2.events.ConnectionTerminated) -> BagpipeError:
        code = event.error_code if event.error_code is not None else 0
        if is_inadequate_security(code):  # a TLS port refusing plaintext, or no client certificate
            said = (event.additional_data or b"").decode(errors="replace")
            return TlsError(f"{self.peer}: {said}", peer=self.peer)
        return Unavailable(f"{self.peer} closed the connection (GOAWAY {h2.errors.ErrorCodes(code).name})")

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError) and "CERTIFICATE" in str(exc.reason) + str(exc):
            self._fail(TlsError(f"{self.peer} ended the TLS connection: {exc.reason or exc}", peer=self.peer))
        elif self.tls and not self._settings_seen:
            self._fail(Unavailable(
                f"{self.peer} closed the TLS connection before its first frame ({exc or 'closed'}): a server "
                "with mutual TLS does so when its CA did not sign this role's certificate"))
        else:
            super().connection_lost(exc)

    def _data_received(self, event: h2.events.DataReceived) -> None:
        stream_id, size = event.stream_id, event.flow_controlled_length
        inbound = self.streams.get(stream_id)
        if inbound is not None and inbound.streaming:
            # Connection credit now, stream credit as the consumer takes the chunk: a slow
            # stream holds back its own producer without starving the other streams.
            if size:
                self.conn.increment_flow_control_window(size)
        else:
            self.conn.acknowledge_received_data(size, stream_id)
        if inbound is not None:
            inbound.on_data(event.data or b"", size)

    def _finished(self, stream_id: int) -> _Inbound | None:
        inbound = self.streams.pop(stream_id, None)
        self._slots.wake()
        if self.draining and not self.streams:
            self.close()
        return inbound

    def connection_failed(self, error: BaseException) -> None:
        streams, self.streams = self.streams, {}
        for inbound in streams.values():
            inbound.on_error(error)
        self._slots.wake()

    # -- what callers do --------------------------------------------------------------
    async def open_stream(
        self, headers: list[tuple[str, str]], parts: Sequence[bytes | memoryview], length: int,
        *, streaming: bool,
    ) -> tuple[int, _Inbound, bool]:
        """Open a stream with `headers`, and with the body too if it `fits_now`: the stream,
        its response side and whether the body went (else `send_request_body` sends it)."""
        while self.conn.open_outbound_streams >= self.conn.remote_settings.max_concurrent_streams:
            if self.error is not None:
                raise self.error
            await self._slots.wait()
        if self.error is not None:
            raise self.error
        # No await from here to send_headers: no other caller can take this stream id.
        try:
            stream_id = self.conn.get_next_available_stream_id()
        except h2.exceptions.NoAvailableStreamIDError:
            self.draining = True
            raise
        inbound = self.streams[stream_id] = _Inbound(streaming=streaming)
        self.conn.send_headers(stream_id, headers, end_stream=length == 0)
        body_sent = length == 0 or self.fits_now(stream_id, length)
        if length and body_sent:
            self.send_small_body(stream_id, parts)
        if body_sent:
            self.flush_soon()  # one write for every request opened in this turn
        else:
            self.flush()
        return stream_id, inbound, body_sent

    async def send_request_body(
        self, stream_id: int, inbound: _Inbound, parts: Sequence[bytes | memoryview]
    ) -> None:
        try:
            await self.send_body(stream_id, parts, end_stream=True)
        except StreamGone:
            # A server may answer early (e.g. 413) and reset the upload: keep its answer.
            if inbound.ended and inbound.headers is not None:
                return
            raise inbound.error or Unavailable(f"{self.peer} closed the stream") from None

    def return_credit(self, stream_id: int, size: int) -> None:
        stream = self.conn.streams.get(stream_id)
        if size and stream is not None and stream.open:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.increment_flow_control_window(size, stream_id=stream_id)
            self.flush()

    def cancel(self, stream_id: int) -> None:
        """Abandon a stream (timeout, caller gone): RST_STREAM, the connection lives on."""
        if self.streams.pop(stream_id, None) is None:
            return
        self._slots.wake()
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self.flush()


class H2Client(Client):
    """Client for one peer over one HTTP/2 connection (h2c, or TLS with `tls`), opened on
    first use.

    After GOAWAY or a lost connection, in-flight requests fail with Unavailable and the next
    request opens a new connection. Requests are never retried: callers know which are
    idempotent. What only a change of configuration mends (TLS spoken to a plaintext port or
    the other way round, a certificate that does not verify) is a `TlsError`.
    """

    def __init__(
        self, host: str, port: int, *, token: str | None = None, timeout: float = 30.0,
        tls: Tls | None = None,
    ) -> None:
        self._host, self._port, self._timeout = host, port, timeout
        self._tls = tls
        self._scheme = "http" if tls is None else "https"
        self._peer = f"{host}:{port}"
        self._auth = auth_headers(token)
        self._protocol: _ClientProtocol | None = None
        self._connect_lock = asyncio.Lock()  # guards: opening a new self._protocol

    async def _connection(self) -> _ClientProtocol:
        proto = self._protocol
        if proto is not None and proto.usable:
            return proto
        async with self._connect_lock:
            proto = self._protocol
            if proto is not None and proto.usable:
                return proto
            loop = asyncio.get_running_loop()
            secure = {} if self._tls is None else {
                "ssl": self._tls.client, "server_hostname": self._host,
                "ssl_handshake_timeout": self._timeout,
            }
            try:
                # a socket of our own, so that a link that goes down surfaces as a lost
                # connection within seconds (common.transport.links)
                sock = await open_socket(self._host, self._port)
                transport, proto = await loop.create_connection(
                    lambda: _ClientProtocol(self._peer, tls=self._tls is not None), sock=sock, **secure,
                )
            except OSError as exc:  # ssl.SSLError is one
                raise connect_error(self._peer, exc) from exc
            if self._tls is not None:
                try:
                    check_alpn(transport, self._peer, ALPN["h2"])
                except TlsError:
                    transport.close()
                    raise
            await proto.ready()
            self._protocol = proto
            return proto

    def _headers(
        self, method: str, path: str, length: int, extra: dict[str, str] | None
    ) -> list[tuple[str, str]]:
        headers = [(":method", method), (":scheme", self._scheme), (":authority", self._peer)]
        headers.append((":path", path))
        if length:
            headers.append(("content-length", str(length)))
        # The caller's headers win over the client's own (e.g. another token).
        merged = {**self._auth, **{k.lower(): v for k, v in (extra or {}).items()}}
        headers += merged.items()
        return headers

    async def _open(
        self, method: str, path: str, body: Body, extra: dict[str, str] | None, *, streaming: bool
    ) -> tuple[_ClientProtocol, int, _Inbound]:
        parts = body_parts(body)
        length = body_length(parts)
        headers = self._headers(method, path, length, extra)
        proto = await self._connection()
        try:
            stream_id, inbound, body_sent = await proto.open_stream(
                headers, parts, length, streaming=streaming
            )
        except h2.exceptions.NoAvailableStreamIDError:
            proto = await self._connection()  # the exhausted one is draining: a fresh one
            stream_id, inbound, body_sent = await proto.open_stream(
                headers, parts, length, streaming=streaming
            )
        if not body_sent:
            try:
                await proto.send_request_body(stream_id, inbound, parts)
            except BaseException:
                proto.cancel(stream_id)
                raise
        return proto, stream_id, inbound

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> ClientResponse:
        limit = self._timeout if timeout is None else timeout
        async with _Deadline(limit, f"{method} {path} to {self._peer}"):
            proto, stream_id, inbound = await self._open(
                method, path, body, headers, streaming=False
            )
            try:
                answer, data = await inbound.complete()
            except BaseException:
                proto.cancel(stream_id)
                raise
        return _client_response(answer, data)

    async def stream(
        self,
        method: str,
        path: str,
        *,
        body: Body = b"",
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[bytes]:
        limit = self._timeout if timeout is None else timeout
        what = f"{method} {path} to {self._peer}"
        async with _Deadline(limit, what):
            proto, stream_id, inbound = await self._open(
                method, path, body, headers, streaming=True
            )
        try:
            async with _Deadline(limit, what):
                answer = await inbound.response_headers()
            status = int(answer.get(":status", "0"))
            while True:
                async with _Deadline(limit, what):
                    item = await inbound.next()
                if item is None:
                    break
                data, size = item
                proto.return_credit(stream_id, size)
                if not 200 <= status < 300:
                    raise_for_answer(status, data + await _rest(inbound))
                yield data
            raise_for_answer(status, b"")
        finally:
            proto.cancel(stream_id)

    async def close(self) -> None:
        proto, self._protocol = self._protocol, None
        if proto is not None:
            proto.close()


async def _rest(inbound: _Inbound) -> bytes:
    chunks = []
    while (item := await inbound.next()) is not None:
        chunks.append(item[0])
    return b"".join(chunks)


def _client_response(headers: dict[str, str], body: bytes) -> ClientResponse:
    status = int(headers.get(":status", "0"))
    plain = {k: v for k, v in headers.items() if not k.startswith(":")}
    return ClientResponse(status=status, headers=plain, body=body)


class _Deadline:
    """`asyncio.timeout` that raises our TimedOut (a class: one is entered per request, and
    a generator-based context manager costs more than the timeout itself)."""

    def __init__(self, seconds: float, what: str) -> None:
        self._seconds, self._what = seconds, what
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            seconds = self._seconds
            raise TimedOut(f"{self._what} timed out after {seconds}s", timeout=seconds) from None
