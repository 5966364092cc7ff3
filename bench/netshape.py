"""A rate-limited link for the PS processes: their own network namespace, a veth pair to
the host side, and `tc tbf` at the given rate on both ends (docs/design.md#benchmarks). Needs root.

`netem` (delay) does not exist on this kernel, so only the rate is shaped; loopback latency
stays. Everything is removed on exit, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

from bench.topology import parse_rate, tbf_burst_bytes
from common.errors import ConfigError
from launcher.cluster import PsHost

NAMESPACE = "bagpipe-ps"
HOST_SIDE, NS_SIDE = "bp-host0", "bp-ps0"
# Link-local addresses on a point-to-point veth inside our own namespace: nothing else on
# any network is ever addressed.
HOST_IP, NS_IP = "169.254.77.1", "169.254.77.2"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _burst_bytes(rate: str) -> int:
    try:
        return tbf_burst_bytes(parse_rate(rate))
    except ConfigError as exc:
        raise SystemExit(f"--shaped: {exc}") from None


def _cleanup() -> None:
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)
    subprocess.run(["ip", "link", "del", HOST_SIDE], capture_output=True)


@contextlib.contextmanager
def shaped_ps_host(rate: str) -> Iterator[PsHost]:
    """PS processes started through the yielded `PsHost` sit behind a `rate` link."""
    if os.geteuid() != 0:
        raise SystemExit("--shaped needs root (ip netns, veth and tc); run without it or as root")
    burst = _burst_bytes(rate)
    _cleanup()  # leftovers of an earlier run that was killed
    try:
        _run("ip", "netns", "add", NAMESPACE)
        _run("ip", "link", "add", HOST_SIDE, "type", "veth", "peer", "name", NS_SIDE)
        _run("ip", "link", "set", NS_SIDE, "netns", NAMESPACE)
        _run("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_SIDE)
        _run("ip", "link", "set", HOST_SIDE, "up")
        inside = ("ip", "netns", "exec", NAMESPACE)
        _run(*inside, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_SIDE)
        _run(*inside, "ip", "link", "set", NS_SIDE, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        for side in ((), inside):
            dev = HOST_SIDE if not side else NS_SIDE
            _run(*side, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", str(burst), "latency", "50ms")
        yield PsHost(command_prefix=inside, address=NS_IP)
    finally:
        _cleanup()
