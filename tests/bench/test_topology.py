"""bench/topology.py: hosts as network namespaces on one machine (and bench/linkrate.py's
counting of what a shaped link carries).

The pure parts (rates, buckets, counters, command lines) run everywhere. The rest builds real
namespaces, links and tbf qdiscs, so it is `slow` and needs root and `ip netns`: without them
it is skipped, saying which is missing (a machine capability, not a failure of the code).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.linkrate import measure
from bench.topology import HostSpec, LinkBytes, Snapshot, Topology, cleanup, parse_rate, tbf_burst_bytes
from common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PORT = 5301


def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "`ip netns` is not available here"
    return None


needs_namespaces = pytest.mark.skipif(_namespaces_unavailable() is not None,
                                      reason=_namespaces_unavailable() or "")


# --- pure -------------------------------------------------------------------------------

def test_rates_read_like_tc() -> None:
    assert parse_rate("10gbit") == 10 * 10**9
    assert parse_rate("100Mbit") == 100 * 10**6
    assert parse_rate("1.5kbit") == 1500
    with pytest.raises(ConfigError, match="rate"):
        parse_rate("1gbps")


def test_the_bucket_holds_ten_ms_and_at_least_a_segment() -> None:
    assert tbf_burst_bytes(parse_rate("20mbit")) == 64 << 10
    assert tbf_burst_bytes(parse_rate("10gbit")) == 12_500_000


def test_host_specs_refuse_bad_names_rates_and_relative_folders() -> None:
    for bad in ({"name": "switch"}, {"name": "a-b"}, {"name": "a", "rate": "fast"},
                {"name": "a", "hide_data": (Path("data"),)}):
        with pytest.raises(ConfigError):
            HostSpec(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="differ"):
        Topology([HostSpec(name="a"), HostSpec(name="a")])


def test_snapshots_subtract_into_traffic_per_host() -> None:
    before = Snapshot(at=1.0, links={"a": LinkBytes(sent=10, received=5)})
    after = Snapshot(at=3.5, links={"a": LinkBytes(sent=110, received=7)})
    traffic = after - before
    assert traffic.seconds == 2.5 and traffic.links == {"a": LinkBytes(sent=100, received=2)}


# --- real namespaces --------------------------------------------------------------------

def _ours(prefix: str) -> tuple[list[str], list[str]]:
    """Namespaces and links of this machine's own namespace named after `prefix`."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return ([n for n in namespaces.split() if n.startswith(f"{prefix}-")],
            [line for line in links.splitlines() if prefix in line])


CONNECT = textwrap.dedent("""
    import socket, sys, time
    deadline = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < deadline:
        try:
            socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()
            sys.exit(0)
        except OSError:
            time.sleep(0.05)
    sys.exit(1)
""")


def _connects(net: Topology, host: str, address: str, within_s: float) -> bool:
    return net[host].run([sys.executable, "-c", CONNECT, address, str(PORT), str(within_s)]).returncode == 0


@pytest.mark.slow
@needs_namespaces
def test_hosts_on_one_switch_reach_each_other_and_no_other_switch() -> None:
    with Topology([HostSpec(name="a"), HostSpec(name="b")]) as net, Topology([HostSpec(name="c")]) as other:
        net["b"].popen([sys.executable, str(ROOT / "bench" / "linkrate.py"), "--sink", str(PORT)])
        assert net["a"].address != net["b"].address
        assert _connects(net, "a", net["b"].address, within_s=10)
        # c has a's very address, on a switch of its own: b's address leads nowhere from there.
        assert other["c"].address == net["a"].address
        assert not _connects(other, "c", net["b"].address, within_s=2)


@pytest.mark.slow
@needs_namespaces
def test_a_shaped_link_carries_its_rate_in_each_direction() -> None:
    """Not a timing test: the upper bound is what a token bucket guarantees (over any window
    at most rate x window + one bucket passes), counted in bytes on the link; the lower bound
    only says the machine can carry 20 Mbit/s at all, hence its generous 0.5. One direction
    at a time: with both saturated, each flow's ACKs queue behind the other's data in the
    tbf (up to its 50 ms latency), and a flow can fall to a quarter of the rate."""
    rate = parse_rate("20mbit")
    with Topology([HostSpec(name="a", rate="20mbit"), HostSpec(name="b")]) as net:
        out = measure(net, [("a", "b")], window_s=2.0)
        into = measure(net, [("b", "a")], window_s=2.0)
    for counted, traffic in ((out.links["a"].sent, out), (into.links["a"].received, into)):
        limit = rate / 8 * traffic.seconds
        assert 0.5 * limit <= counted <= 1.02 * limit + tbf_burst_bytes(rate), (counted, limit)


HIDDEN_READ = textwrap.dedent("""
    import os, sys
    folder, outside = sys.argv[1], sys.argv[2]  # outside: a process that sees the folder
    print(sorted(os.listdir(folder)))
    for path in (folder + "/secret", f"/proc/{outside}/root{folder}/secret"):
        try:
            print(open(path).read())
        except OSError as exc:
            print(type(exc).__name__)
""")


@pytest.mark.slow
@needs_namespaces
@pytest.mark.skipif(shutil.which("setpriv") is None or shutil.which("unshare") is None,
                    reason="hiding needs util-linux's unshare and setpriv")
def test_hidden_data_is_unreadable_on_its_hosts_and_readable_elsewhere(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "secret").write_text("rows")
    hosts = [HostSpec(name="oracle"), HostSpec(name="ps0", hide_data=(data,))]
    with Topology(hosts) as net:
        read = [sys.executable, "-c", HIDDEN_READ, str(data), str(os.getpid())]
        seen = {h: net[h].run(read, capture_output=True, check=True).stdout.decode().split("\n")[:3]
                for h in ("oracle", "ps0")}
        unmount = net["ps0"].run(["umount", str(data)], capture_output=True)
    assert seen["oracle"] == ["['secret']", "rows", "rows"]
    assert seen["ps0"] == ["[]", "FileNotFoundError", "PermissionError"]
    assert unmount.returncode != 0  # the cover stays: no CAP_SYS_ADMIN on a hidden host
    assert (data / "secret").read_text() == "rows"  # hidden there, not here


@pytest.mark.slow
@needs_namespaces
def test_nothing_is_left_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="body"):
        with Topology([HostSpec(name="a", rate="1gbit"), HostSpec(name="b")]) as net:
            sleeper = net["a"].popen(["sleep", "600"])
            prefix = net.prefix
            assert prefix is not None and _ours(prefix)[0]
            raise RuntimeError("body")
    assert sleeper.poll() is not None
    assert _ours(prefix) == ([], [])


# argv: the repository, then "wait" (the body waits) or "leave" (the body ends at once, and
# leaving waits for a process that ignores SIGTERM: the grace of 3 s, then SIGKILL).
BUILDER = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from bench.topology import HostSpec, Terminated, Topology
    try:
        with Topology([HostSpec(name="a", rate="100mbit"), HostSpec(name="b")], stop_grace_s=3) as net:
            stubborn = net["a"].popen(["sh", "-c", "trap '' TERM; echo up; exec sleep 600"], stdout=subprocess.PIPE)
            stubborn.stdout.readline()  # SIGTERM is ignored from here on
            print(net.prefix, flush=True)
            if sys.argv[2] == "wait":
                time.sleep(600)
    except Terminated as exc:
        sys.exit(128 + exc.signum)
""")


def _interruptible() -> None:
    # A test run in the background of a shell inherits SIGINT ignored, and so would the
    # builder: Ctrl-C reaches a foreground process, which is what these tests mean.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_builder(body: str = "wait") -> tuple[subprocess.Popen[str], str]:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(ROOT), body], stdout=subprocess.PIPE, text=True,
                               preexec_fn=_interruptible)
    assert builder.stdout is not None
    prefix = builder.stdout.readline().strip()
    assert prefix and _ours(prefix)[0], "the topology was not built"
    return builder, prefix


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_nothing_is_left_after_a_signal(signum: int) -> None:
    builder, prefix = _start_builder()
    builder.send_signal(signum)
    code = builder.wait(60)
    # An uncaught KeyboardInterrupt ends Python by SIGINT; Terminated is caught: 128 + 15.
    assert code == (-signum if signum == signal.SIGINT else 128 + signum)
    assert _ours(prefix) == ([], [])


@pytest.mark.slow
@needs_namespaces
def test_a_ctrl_c_during_the_cleanup_waits_for_its_end() -> None:
    builder, prefix = _start_builder("leave")
    started = time.monotonic()
    time.sleep(0.5)  # inside the 3 s grace of the process that ignores SIGTERM
    builder.send_signal(signal.SIGINT)
    assert builder.wait(60) == -signal.SIGINT  # raised once the cleanup is done, not before
    assert time.monotonic() - started > 2.5
    assert _ours(prefix) == ([], [])


@pytest.mark.slow
@needs_namespaces
def test_cleanup_removes_what_a_killed_run_left() -> None:
    builder, prefix = _start_builder()
    builder.kill()
    builder.wait()
    left = _ours(prefix)[0]
    assert len(left) == 3, "SIGKILL leaves the namespaces (switch, a, b)"
    assert set(left) <= set(cleanup())  # every default prefix whose process is gone
    assert _ours(prefix) == ([], [])
