"""HTTP/2 (h2c, or over TLS) and HTTP/1.1 transport shared by every role (docs/design.md#transport).

Servers serve a `Router` of handlers; clients share one interface (`Client`), so the data
plane is chosen by name in the cluster spec (`connect_client`). With `[cluster.tls]`, every
server and client is given the process's `Tls` (`common.transport.tls`). Run services on uvloop with
`run` (or `new_event_loop` as an `asyncio.Runner` loop factory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

import uvloop

from common.transport.h2client import H2Client
from common.transport.h2server import H2Server
from common.transport.http import (
    DEFAULT_MAX_BODY_BYTES,
    Body,
    Client,
    ClientResponse,
    Handler,
    Request,
    Response,
    Router,
    StreamResponse,
    Then,
)
from common.transport.http1 import Http1Client, Http1Server
from common.transport.limits import ConnectionLimits
from common.transport.stream import MessageReader, encode_message, read_messages
from common.transport.tls import Tls, load_tls

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "Body",
    "Client",
    "ClientResponse",
    "ConnectionLimits",
    "H2Client",
    "H2Server",
    "Handler",
    "Http1Client",
    "Http1Server",
    "MessageReader",
    "Request",
    "Response",
    "Router",
    "StreamResponse",
    "Then",
    "Tls",
    "connect_client",
    "encode_message",
    "load_tls",
    "new_event_loop",
    "read_messages",
    "run",
]

T = TypeVar("T")
TransportKind = Literal["h2", "http1"]


def connect_client(
    kind: TransportKind, host: str, port: int, token: str | None, timeout: float = 30.0,
    tls: Tls | None = None,
) -> Client:
    """A client for `kind` (over TLS with `tls`); it connects lazily, on its first request."""
    if kind == "h2":
        return H2Client(host, port, token=token, timeout=timeout, tls=tls)
    if kind == "http1":
        return Http1Client(host, port, token=token, timeout=timeout, tls=tls)
    raise ValueError(f"unknown transport {kind!r} (expected 'h2' or 'http1')")


def new_event_loop() -> uvloop.Loop:
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh uvloop event loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
