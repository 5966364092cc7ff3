"""Process plumbing shared by the long-running roles: logging, the ready file, stopping.

A role started by the launcher writes a small JSON "ready file" once its servers listen, so
the launcher learns the ports chosen for port 0 without parsing logs; SIGTERM and SIGINT
stop the servers in order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson

from common.files import write_atomically
from common.transport import H2Server, Http1Server, Router

log = logging.getLogger(__name__)


def configure_logging(role: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("BAGPIPE_LOG", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def write_ready_file(path: Path | None, info: dict[str, Any]) -> None:
    """Publish `info` atomically: the launcher never reads half a file."""
    if path is None:
        return
    write_atomically(path, orjson.dumps(info))


def make_server(transport: str, router: Router, *, host: str, port: int, token: str, max_body_bytes: int) -> H2Server | Http1Server:
    cls = H2Server if transport == "h2" else Http1Server
    return cls(router, host=host, port=port, token=token, max_body_bytes=max_body_bytes)


async def wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stop signal received")
