"""Waiting until a descriptor is ready, with poll(2): select(2) refuses a descriptor numbered
1024 or above, which a process with many connections and files open hands out (a trainer of a
large job, a long-lived test worker)."""

from __future__ import annotations

import select
from typing import Any


def ready(fd: Any, events: int, timeout_s: float) -> bool:
    """Whether `fd` (a descriptor or an object with `fileno()`) becomes ready for `events`
    (`select.POLLIN`, `select.POLLOUT`) within `timeout_s`."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(timeout_s * 1000))
