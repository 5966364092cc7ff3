"""A dead link surfaces as a lost connection within seconds (common/transport/links.py).

The end-to-end case, a PS link cut for 60 s that the job rides out, is
`tests/test_across_hosts.py::test_a_run_across_hosts_is_bit_identical_and_survives_a_cut_ps_link[60s]`
(nightly; before the client's sockets carried TCP_USER_TIMEOUT it failed: a write-back
timed out 20 s after the link was back, waiting for TCP's retransmission backoff).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time

import pytest

from common.transport.links import DEAD_LINK_S, open_socket
from tests.common.transport_fixtures import BOUNDED, Service, make_client, make_server

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")


async def test_a_connection_whose_peer_takes_nothing_is_dropped_after_the_dead_link_time() -> None:
    """Sent data that no one acknowledges taking (here: a peer that never reads, so its
    window stays shut) ends the connection with ETIMEDOUT once `dead_after_s` has passed,
    where without the option the kernel would probe for many minutes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sock = await open_socket("127.0.0.1", listener.getsockname()[1], dead_after_s=1.0)
        peer, _ = listener.accept()  # never reads
        with sock, peer:
            with pytest.raises(BlockingIOError):
                while True:  # until both ends' buffers are full
                    sock.send(b"x" * 65536)
            started = time.monotonic()
            with pytest.raises(OSError) as dropped:  # a read waits for the connection's end
                await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), BOUNDED)
            assert dropped.value.errno == errno.ETIMEDOUT, "the connection outlived its dead link time"
            assert time.monotonic() - started >= 0.5


@pytest.mark.parametrize("kind", ["h2", "http1"])
async def test_each_clients_connections_watch_their_link(kind: str) -> None:
    service = Service()
    server = make_server(kind, service.router())
    await server.start()
    client = make_client(kind, server.port)
    try:
        assert await client.call("POST", "/echo", body=b"ok") == b"ok"
        (sock,) = _client_sockets(server.port)
        with sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(DEAD_LINK_S * 1000)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        await client.close()
        await server.stop()


def _client_sockets(port: int) -> list[socket.socket]:
    """This process's TCP sockets connected to `port` on 127.0.0.1 (duplicates: the same
    connections, options included), whoever made them."""
    found = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            peer = sock.getpeername() if sock.type == socket.SOCK_STREAM else None
        except OSError:
            peer = None
        if peer == ("127.0.0.1", port):
            found.append(sock)
        else:
            sock.close()
    return found


async def test_a_name_resolves_and_a_closed_port_is_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sock = await open_socket("localhost", port)
        sock.close()
    with pytest.raises(ConnectionRefusedError):
        await open_socket("127.0.0.1", port)  # the listener is closed now
