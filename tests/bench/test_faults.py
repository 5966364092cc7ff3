"""bench/faults.py: what `--fault` accepts, and what it refuses naming the value (the
faults themselves are exercised by tests/test_across_hosts.py, where root)."""

from __future__ import annotations

import pytest

from bench.faults import LinkDown, Partition, SlowLink, parse_fault, shaped
from bench.topology import HostSpec
from common.errors import ConfigError

HOSTS = ("oracle", "ps0", "ps1", "tr0", "tr1")


def test_each_form_reads_as_its_fault() -> None:
    assert parse_fault("link-down:ps1:40:10", HOSTS) == LinkDown(host="ps1", after=40, seconds=10.0)
    assert parse_fault("partition:tr0,tr1:20", HOSTS) == Partition(hosts=("tr0", "tr1"), after=20)
    assert parse_fault("slow-link:ps0:1mbit", HOSTS) == SlowLink(host="ps0", rate="1mbit")


@pytest.mark.parametrize(("text", "says"), [
    ("link-down:ps1:40", "not one of"),
    ("link-down:ps1:forty:10", "not one of|invalid literal"),
    ("cut:ps1:40:10", "not one of"),
    ("link-down:ps9:40:10", "no host 'ps9'"),
    ("partition:tr0:20", "two hosts or more"),
    ("partition:tr0,tr0:20", "two hosts or more"),
    ("slow-link:ps0:fast", "rate"),
])
def test_a_bad_fault_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=rf"--fault: '{text}': .*({says})"):
        parse_fault(text, HOSTS)


def test_a_slow_link_replaces_its_hosts_rate_only() -> None:
    hosts = [HostSpec(name="ps0", rate="1gbit"), HostSpec(name="ps1", rate="1gbit")]
    assert [h.rate for h in shaped(hosts, [SlowLink(host="ps1", rate="1mbit")])] == ["1gbit", "1mbit"]
