"""Addresses a role chooses before its servers start: where it listens, and how its peers
on another machine reach it."""

from __future__ import annotations

import asyncio
import errno
import socket

from common.errors import Unavailable
from common.spec import Endpoint


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`: where peers on that network reach us
    (not the loopback address the hostname may resolve to). No packet is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as exc:
            raise Unavailable(f"no route to {host}: {exc}") from None
        return probe.getsockname()[0]


async def serve_address(bind: Endpoint | None, coordinator: Endpoint) -> Endpoint:
    """Where a role serves: `bind` when given, else its address towards the coordinator
    (port 0: any free one)."""
    if bind is not None:
        return bind
    return Endpoint(host=await asyncio.to_thread(address_towards, coordinator.host), port=0)


def listen_on(address: Endpoint) -> socket.socket:
    """A socket listening on `address` (port 0: a free one, `getsockname` says which), for a
    role that must name where it serves before its servers start: what connects meanwhile
    waits in the kernel's backlog. Unavailable naming the address if it cannot listen."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    try:
        return socket.create_server((address.host, address.port), family=family, backlog=1024)
    except OSError as exc:
        hint = ": another process listens there" if exc.errno == errno.EADDRINUSE else ""
        raise Unavailable(f"cannot listen on {address}: {exc.strerror or exc}{hint}",
                          address=str(address)) from None


def free_port(host: str) -> int:
    """A port free on `host` now (for a role that must name its port before it listens)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
