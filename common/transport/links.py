"""A link that goes down surfaces as a lost connection, within seconds.

A TCP connection whose link is cut keeps its unacknowledged data in the kernel, which
retransmits it with exponential backoff: after a 60 s outage the next retransmission may come
40 s after the link is back (at about 51 and 102 s from the first loss, from a 200 ms
timeout). A request on such a connection would wait for that, and fail as timed out, although
the peer was reachable again long before. So each client socket, HTTP/2's and HTTP/1.1's,
carries `TCP_USER_TIMEOUT`: data left unacknowledged (or a connect left unanswered) for
`DEAD_LINK_S` makes the kernel drop the connection. Callers see a lost connection, which
they retry on a new one within their reconnect budget (`common.transport.retry`), and a new
connection gets through as soon as the link does.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

#: Long beside any healthy acknowledgement, even on a loaded machine or a shaped link (an
#: ACK comes from the peer's kernel, not its program); short beside the outages a job rides out.
DEAD_LINK_S = 10.0


def watch_link(sock: socket.socket, dead_after_s: float = DEAD_LINK_S) -> None:
    """Drop `sock`'s connection once sent data (or its SYN) has gone unacknowledged for
    `dead_after_s` (Linux; elsewhere the kernel's own limits apply)."""
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after_s * 1000))


def watched_socket(addr_info: tuple[Any, ...], dead_after_s: float = DEAD_LINK_S) -> socket.socket:
    """A new TCP socket for one `getaddrinfo` result, under `watch_link` (also aiohttp's
    `socket_factory`, for the HTTP/1.1 client)."""
    family, kind, proto = addr_info[:3]
    sock = socket.socket(family, kind, proto)
    try:
        watch_link(sock, dead_after_s)
    except BaseException:
        sock.close()
        raise
    return sock


async def open_socket(host: str, port: int, dead_after_s: float = DEAD_LINK_S) -> socket.socket:
    """A connected, non-blocking TCP socket to `host:port` under `watch_link`, trying each
    address `host` resolves to in turn; the first address's OSError if none connects."""
    loop = asyncio.get_running_loop()
    errors: list[OSError] = []
    for addr_info in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = watched_socket(addr_info, dead_after_s)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, addr_info[4])
            return sock
        except OSError as exc:
            sock.close()
            errors.append(exc)
        except BaseException:
            sock.close()
            raise
    raise errors[0] if errors else OSError(f"{host} resolves to no address")
