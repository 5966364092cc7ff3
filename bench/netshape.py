"""A rate-limited link for the PS processes: their own network namespace, a veth pair to
the host side, and `tc tbf` at the given rate on both ends (DESIGN §12). Needs root.

`netem` (delay) does not exist on this kernel, so only the rate is shaped; loopback latency
stays. Everything is removed on exit, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator

from launcher.cluster import PsHost

NAMESPACE = "bagpipe-ps"
HOST_SIDE, NS_SIDE = "bp-host0", "bp-ps0"
# Link-local addresses on a point-to-point veth inside our own namespace: nothing else on
# any network is ever addressed.
HOST_IP, NS_IP = "169.254.77.1", "169.254.77.2"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _burst_bytes(rate: str) -> int:
    """10 ms at `rate` (tbf needs a bucket of at least rate / HZ), and at least 64 KiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--shaped: rate must look like 1gbit, 500mbit or 100kbit, got {rate!r}")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return max(64 << 10, int(bits / 8 / 100))


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
