"""Faults to inject into a run across network-namespace hosts (`bench/topology.py`), each
fired once the trainers have finished a given iteration: a host's link down for a while,
trainers cut from each other while every other link stays up, and (at build time) one
host's link slowed. Used by `bench/cluster.py --fault` and the link tests.

    link-down:HOST:AFTER:SECONDS   HOST's link down for SECONDS after iteration AFTER
    partition:HOST,HOST...:AFTER   those hosts cannot reach each other from AFTER on
    slow-link:HOST:RATE            HOST's link shaped to RATE (tc rate: 1mbit) from the start
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.topology import HostSpec, Topology, parse_rate
from common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LinkDown:
    host: str
    after: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Partition:
    hosts: tuple[str, ...]
    after: int


@dataclass(frozen=True, kw_only=True)
class SlowLink:
    host: str
    rate: str


Fault = LinkDown | Partition | SlowLink


def parse_fault(text: str, hosts: Sequence[str]) -> Fault:
    """One `--fault` value (the module's docstring lists the forms); ConfigError naming it."""
    kind, _, rest = text.partition(":")
    parts = rest.split(":")
    try:
        if kind == "link-down" and len(parts) == 3:
            fault: Fault = LinkDown(host=parts[0], after=int(parts[1]), seconds=float(parts[2]))
        elif kind == "partition" and len(parts) == 2:
            fault = Partition(hosts=tuple(parts[0].split(",")), after=int(parts[1]))
        elif kind == "slow-link" and len(parts) == 2:
            parse_rate(parts[1])
            fault = SlowLink(host=parts[0], rate=parts[1])
        else:
            raise ValueError("not one of link-down:HOST:AFTER:SECONDS, partition:HOST,HOST:AFTER, slow-link:HOST:RATE")
    except (ValueError, ConfigError) as exc:
        raise ConfigError("--fault", f"{text!r}: {exc}") from None
    named = fault.hosts if isinstance(fault, Partition) else (fault.host,)
    if unknown := [h for h in named if h not in hosts]:
        raise ConfigError("--fault", f"{text!r}: no host {unknown[0]!r} (hosts: {', '.join(hosts)})")
    if isinstance(fault, Partition) and len(set(fault.hosts)) < 2:
        raise ConfigError("--fault", f"{text!r}: a partition needs two hosts or more")
    return fault


def shaped(hosts: Sequence[HostSpec], faults: Sequence[Fault]) -> list[HostSpec]:
    """`hosts` with the slow links of `faults` in place of their rates."""
    slow = {f.host: f.rate for f in faults if isinstance(f, SlowLink)}
    return [HostSpec(name=h.name, rate=slow.get(h.name, h.rate), hide_data=h.hide_data) for h in hosts]


class FaultInjector:
    """Fires the timed faults of `faults` as the run goes: call `poll(done)` with the
    iterations every trainer has finished, often (a link comes back up at the first poll
    after its time). `heal()` undoes what is still in force."""

    def __init__(self, net: Topology, faults: Sequence[Fault]) -> None:
        self.net = net
        self.pending = [f for f in faults if not isinstance(f, SlowLink)]
        self._down: dict[str, float] = {}  # host -> when its link comes back up
        self._blocked: list[tuple[str, str]] = []
        self.fired: list[tuple[Fault, float]] = []  # each fault and when it fired

    def poll(self, done: int) -> None:
        now = time.monotonic()
        for fault in [f for f in self.pending if done >= f.after]:
            self.pending.remove(fault)
            self._fire(fault, now)
        self._bring_up(due=now)

    def heal(self) -> None:
        self._bring_up(due=math.inf)
        while self._blocked:
            source, target = self._blocked.pop()
            self.net[source].unblock(self.net[target])

    def _bring_up(self, *, due: float) -> None:
        """Bring back every link whose outage ends by `due`."""
        for host in [h for h, until in self._down.items() if until <= due]:
            self.net[host].set_link(up=True)
            del self._down[host]

    def _fire(self, fault: Fault, now: float) -> None:
        if isinstance(fault, LinkDown):
            self.net[fault.host].set_link(up=False)
            self._down[fault.host] = now + fault.seconds
        elif isinstance(fault, Partition):
            for source, target in itertools.permutations(fault.hosts, 2):
                self.net[source].block(self.net[target])
                self._blocked.append((source, target))
        self.fired.append((fault, now))
