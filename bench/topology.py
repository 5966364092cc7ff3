#!/usr/bin/env python3
"""Several hosts on one machine: a network namespace per host on one switch, links shaped
with `tc tbf`, folders hidden from chosen hosts, per-link byte counters. Needs root.

    hosts = [HostSpec(name="oracle"), HostSpec(name="ps0", rate="1gbit", hide_data=(data,))]
    with Topology(hosts) as net:
        ps = net["ps0"].popen([sys.executable, "launch.py", ...], env=...)
        before = net.snapshot()
        ...
        traffic = net.snapshot() - before      # bytes each host sent and received
    # here every process started on a host is stopped and every namespace and link is gone

What it builds, named after one prefix per topology (default ``bp<pid>n<k>``, so that runs
in parallel never collide): a namespace ``<prefix>-switch`` holding a bridge, and per host a
namespace ``<prefix>-<host>`` with loopback up and one veth to the bridge, addressed from
`subnet` in the order the hosts are given. Both ends of every veth are created inside their
namespaces, so this machine's own network gets no interface, address or route, and two
topologies (even with the same subnet) cannot reach each other, nor can this machine reach
them. A host with a `rate` has a tbf at that rate on both ends of its veth: egress inside
the host shapes what it sends, egress on the bridge side what it receives.

Counters are read on the bridge side of each veth (one `ip -s link` for all links, so a
snapshot is one moment): what the port received is what its host sent, what it sent the
host received. They count what passed the tbf, Ethernet header included, as the kernel
passes it: a TCP segmentation-offload packet counts its headers once, where tbf (like a
wire) charges them for every MTU-sized segment: bulk TCP at MTU 1500 counts about
1448 / 1514 = 0.956 of what the tbf charged (0.993 at MTU 9000).

Hiding (`hide_data`): a process started on such a host gets its own mount namespace with a
read-only empty tmpfs over each hidden folder, and runs without CAP_SYS_ADMIN (it cannot
unmount the cover) and CAP_SYS_PTRACE (it cannot reach the folder through another process's
/proc/PID/root). Any path into the folder finds it empty. It hides the folder from a role
that reads its files; it is not a sandbox against a process set on getting in (as root it can
still read the raw block device).

Cleanup: on leaving the `with` block, also on an exception, KeyboardInterrupt, or SIGTERM or
SIGHUP (turned into `Terminated` while the block runs, in the main thread), every process
started on a host gets SIGTERM and, after a grace, SIGKILL; any other process still in a
namespace is killed; then every namespace goes, and its veth ends with it. A run killed with
SIGKILL leaves its namespaces: ``python bench/topology.py --cleanup`` removes those of every
default prefix whose process is gone (``--prefix P``: exactly those of prefix P).

    python bench/topology.py --cleanup [--prefix P]

`bench/linkrate.py` measures what the links carry (and what tbf holds on this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import orjson

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.errors import BagpipeError, ConfigError  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_SUBNET = "10.200.0.0/24"
STOP_GRACE_S = 10.0
TBF_LATENCY = "50ms"  # how long a packet may wait in a tbf before it is dropped
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,11}")  # leaves room for h<index> in 15-char interface names
_HOST = re.compile(r"[a-z][a-z0-9_]{0,31}")
_DEFAULT_PREFIX = re.compile(r"bp(\d+)n\d+")
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmg]?)bit")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_SWITCH = "switch"
_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The mount step of a hidden host, run by `sh` between `unshare --mount` and the command. A
# constant: the folders and the command come as arguments ("$@"), never spliced into it.
_HIDE_SCRIPT = """
while [ "$1" != -- ]; do
    mount -t tmpfs -o ro,nosuid,nodev,noexec,size=4k,mode=0500 bagpipe-hidden "$1" || exit 125
    shift
done
shift
exec setpriv --inh-caps=-all --bounding-set=-sys_admin,-sys_ptrace -- "$@"
"""


class TopologyError(BagpipeError):
    """A command that builds or removes a topology failed; `command` and `stderr` say how."""

    code = "topology"


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived inside a `Topology` block (a BaseException, like
    KeyboardInterrupt, so that no `except Exception` swallows it on its way out)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate: ``10gbit``, ``100mbit``, ``500kbit``."""
    m = _RATE.fullmatch(text.strip().lower())
    if not m:
        raise ConfigError("rate", f"must look like 10gbit, 100mbit or 500kbit, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def tbf_burst_bytes(rate_bps: int) -> int:
    """A tbf bucket of 10 ms at the rate (tbf needs at least rate / HZ bytes to reach the
    rate) and at least 64 KiB, the largest segment veth passes in one piece."""
    return max(64 << 10, rate_bps // 8 // 100)


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """A host to build: its name, the rate of its link (None: unshaped), the folders a
    process started on it cannot see."""

    name: str
    rate: str | None = None
    hide_data: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if not _HOST.fullmatch(self.name) or self.name == _SWITCH:
            raise ConfigError("host.name", f"must match {_HOST.pattern} and not be {_SWITCH!r}, "
                                           f"got {self.name!r}")
        if self.rate is not None:
            parse_rate(self.rate)
        for folder in self.hide_data:
            if not Path(folder).is_absolute():
                raise ConfigError(f"{self.name}.hide_data", f"must be absolute paths, got {folder}")


@dataclass(frozen=True, kw_only=True)
class LinkBytes:
    """Bytes through one host's link: `sent` by the host, `received` by it."""

    sent: int
    received: int

    def __sub__(self, earlier: LinkBytes) -> LinkBytes:
        return LinkBytes(sent=self.sent - earlier.sent, received=self.received - earlier.received)


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """What every link carried between two snapshots `seconds` apart, by host."""

    seconds: float
    links: Mapping[str, LinkBytes]


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Every link's counters at one moment (`at`: time.monotonic()); subtract an earlier one
    to get the `Traffic` between them."""

    at: float
    links: Mapping[str, LinkBytes]

    def __sub__(self, earlier: Snapshot) -> Traffic:
        return Traffic(seconds=self.at - earlier.at,
                       links={h: b - earlier.links[h] for h, b in self.links.items()})


class _Processes:
    """The processes started on one topology's hosts, each the leader of its own session,
    so that stopping it reaches whatever it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _started: hosts may start processes from threads
        self._started: list[subprocess.Popen[Any]] = []

    def add(self, process: subprocess.Popen[Any]) -> None:
        with self._lock:
            self._started.append(process)

    def stop_all(self, grace_s: float) -> None:
        with self._lock:
            started = list(self._started)
        stop_processes(started, grace_s)


def stop_processes(processes: Sequence[subprocess.Popen[Any]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group of each live process (started by `Host.popen`, in order),
    then SIGKILL the groups of those still alive after `grace_s`."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in live:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in %.0f s: killing it", process.pid, grace_s)
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()


@dataclass(frozen=True, kw_only=True, eq=False)
class Host:
    """One built host: where its processes run and how the others reach it."""

    name: str
    namespace: str
    interface: str  # its end of the link, inside the namespace (e.g. for GLOO_SOCKET_IFNAME)
    address: str
    rate_bps: int | None
    hide_data: tuple[Path, ...]
    _processes: _Processes

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argument list that runs `argv` on this host: inside its namespace, with its
        hidden folders covered."""
        enter = ["ip", "netns", "exec", self.namespace]
        if not self.hide_data:
            return [*enter, *argv]
        return [*enter, "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _HIDE_SCRIPT,
                "hide", *(str(f) for f in self.hide_data), "--", *argv]

    def set_link(self, *, up: bool) -> None:
        """Take this host's link down (a cut cable: packets are dropped, connections are not
        told) or bring it back up."""
        _run("ip", "-n", self.namespace, "link", "set", self.interface, "up" if up else "down")

    def block(self, other: Host) -> None:
        """Drop everything this host sends to `other` (a blackhole route in this host's
        namespace), while its link, and every other peer, stay up: with `other.block(self)`
        too, a partition between the two. (tc's drop action is not in this kernel.)"""
        _run("ip", "-n", self.namespace, "route", "add", "blackhole", f"{other.address}/32")

    def unblock(self, other: Host) -> None:
        _run("ip", "-n", self.namespace, "route", "del", "blackhole", f"{other.address}/32")

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on this host. `env` is its whole environment (None: this process's).
        It leads a session of its own, gets SIGTERM if the thread that started it dies, and
        is stopped when the topology closes."""
        process = subprocess.Popen(
            self.command(argv), env=None if env is None else dict(env), cwd=cwd,
            stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True, preexec_fn=_die_with_parent,
        )
        self._processes.add(process)
        return process

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        capture_output: bool = False,
        check: bool = False,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run `argv` on this host to its end, like `subprocess.run`; on a timeout or any
        exception its process group is killed before the exception goes on."""
        pipe = subprocess.PIPE if capture_output else None
        process = self.popen(argv, env=env, cwd=cwd, stdout=pipe, stderr=pipe)
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
            raise
        done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        if check:
            done.check_returncode()
        return done


class Topology:
    """Builds the hosts on entering the `with` block and removes all of it on leaving; see
    the module's docstring. `prefix` names everything (default: a free ``bp<pid>n<k>``)."""

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        *,
        prefix: str | None = None,
        subnet: str = DEFAULT_SUBNET,
        mtu: int = 1500,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        names = [h.name for h in hosts]
        if len(set(names)) != len(names):
            raise ConfigError("hosts", f"names must differ, got {names}")
        self._addresses = list(ipaddress.ip_network(subnet).hosts())
        if len(hosts) > min(len(self._addresses), 99):
            raise ConfigError("hosts", f"{len(hosts)} hosts: at most 99 and at most {subnet} holds")
        if prefix is not None and not _PREFIX.fullmatch(prefix):
            raise ConfigError("prefix", f"must match {_PREFIX.pattern}, got {prefix!r}")
        self.specs = tuple(hosts)
        self.prefix = prefix
        self.prefixlen = ipaddress.ip_network(subnet).prefixlen
        self.mtu = mtu
        self.stop_grace_s = stop_grace_s
        self.hosts: dict[str, Host] = {}
        self._processes = _Processes()
        self._namespaces: list[str] = []  # created so far, the switch first
        self._old_handlers: dict[int, Any] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Topology:
        self._trap_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            self.close()
        except TopologyError:
            if exc is None:
                raise
            log.exception("while leaving after %r", exc)  # the error that got us here goes on

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge and the bridge's end of every link."""
        assert self.prefix is not None, "built topologies only"
        return f"{self.prefix}-{_SWITCH}"

    def snapshot(self) -> Snapshot:
        """Every host link's byte counters now (one `ip` call: one moment for all links)."""
        out = _run("ip", "-n", self.switch, "-j", "-s", "link", "show", "master", self._bridge)
        at = time.monotonic()
        ports = {link["ifname"]: link["stats64"] for link in orjson.loads(out)}
        links = {}
        for i, name in enumerate(h.name for h in self.specs):
            stats = ports[self._port(i)]
            links[name] = LinkBytes(sent=stats["rx"]["bytes"], received=stats["tx"]["bytes"])
        return Snapshot(at=at, links=links)

    def close(self) -> None:
        """Stop every process started on a host, then remove every namespace (and with them
        the links); SIGINT, SIGTERM and SIGHUP arriving meanwhile are raised once this is
        done. Raises TopologyError naming what could not be removed."""
        try:
            with _signals_deferred():
                try:
                    self._processes.stop_all(self.stop_grace_s)
                finally:
                    left = remove_namespaces(reversed(self._namespaces))
                    self._namespaces.clear()
        finally:
            self._restore_signals()  # also when a signal held back is raised on leaving
        if left:
            raise TopologyError(f"could not remove {', '.join(left)}; try `python bench/topology.py "
                                f"--cleanup --prefix {self.prefix}`", left=left)

    @property
    def _bridge(self) -> str:
        return f"{self.prefix}br"

    def _port(self, index: int) -> str:
        return f"{self.prefix}s{index}"

    def _build(self) -> None:
        if self.prefix is None:
            self.prefix = _free_prefix()
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", self._bridge, "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", self._bridge, "up")
        for i, spec in enumerate(self.specs):
            self.hosts[spec.name] = self._add_host(i, spec)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def _add_host(self, index: int, spec: HostSpec) -> Host:
        namespace, interface, port = f"{self.prefix}-{spec.name}", f"{self.prefix}h{index}", self._port(index)
        address = str(self._addresses[index])
        mtu = str(self.mtu)
        self._add_namespace(namespace)
        # Both ends are born in their namespaces: nothing ever appears in this machine's own.
        _run("ip", "link", "add", interface, "netns", namespace, "mtu", mtu, "type", "veth",
             "peer", "name", port, "netns", self.switch, "mtu", mtu)
        _run("ip", "-n", self.switch, "link", "set", port, "master", self._bridge, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/{self.prefixlen}", "dev", interface)
        _run("ip", "-n", namespace, "link", "set", interface, "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        rate = None if spec.rate is None else parse_rate(spec.rate)
        if rate is not None:
            for where, device in ((namespace, interface), (self.switch, port)):
                _run("tc", "-n", where, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate}bit",
                     "burst", str(tbf_burst_bytes(rate)), "latency", TBF_LATENCY)
        return Host(name=spec.name, namespace=namespace, interface=interface, address=address,
                    rate_bps=rate, hide_data=tuple(Path(f) for f in spec.hide_data), _processes=self._processes)

    def _trap_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; its own stay as they are
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, _raise_terminated)

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP that arrive inside are raised on leaving, so that a second
    Ctrl-C cannot cut a cleanup short. Main thread only (elsewhere Python runs no handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    old = {s: signal.signal(s, lambda signum, _: arrived.append(signum)) for s in _DEFERRED}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
        for signum in arrived:
            signal.raise_signal(signum)


def remove_namespaces(names: Iterator[str] | Sequence[str]) -> list[str]:
    """Kill every process in each namespace, then delete it; the names that are left."""
    left = []
    for name in names:
        for pid in _pids_in(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _pids_in(name) and time.monotonic() < deadline:
            time.sleep(0.05)  # a namespace lives on, with its links, while a process holds it
        try:
            _run("ip", "netns", "del", name)
        except TopologyError as exc:
            log.error("%s", exc)
            left.append(name)
    return left


def cleanup(prefix: str | None = None) -> list[str]:
    """Remove the namespaces of prefix `prefix`, or (None) those of every default prefix
    ``bp<pid>n<k>`` whose process is gone; the names removed."""
    chosen = [n for n in _namespaces() if _owner_gone(n.partition("-")[0], prefix)]
    left = remove_namespaces(chosen)
    if left:
        raise TopologyError(f"could not remove {', '.join(left)}", left=left)
    return chosen


def _owner_gone(name_prefix: str, prefix: str | None) -> bool:
    if prefix is not None:
        return name_prefix == prefix
    m = _DEFAULT_PREFIX.fullmatch(name_prefix)
    if not m:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _namespaces() -> list[str]:
    out = _run("ip", "-j", "netns", "list")
    return [entry["name"] for entry in orjson.loads(out or b"[]")]


def _pids_in(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _free_prefix() -> str:
    taken = {n.partition("-")[0] for n in _namespaces()}
    k = 0
    while f"bp{os.getpid()}n{k}" in taken:
        k += 1
    return f"bp{os.getpid()}n{k}"


def _run(*argv: str) -> bytes:
    done = subprocess.run(argv, capture_output=True)
    if done.returncode != 0:
        stderr = done.stderr.decode(errors="replace").strip()
        raise TopologyError(f"`{' '.join(argv)}` failed: {stderr}", command=list(argv), stderr=stderr)
    return done.stdout


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the thread that started it dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG



def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cleanup", action="store_true", required=True,
                        help="remove the namespaces of killed runs (every bp<pid>n<k> whose process is gone)")
    parser.add_argument("--prefix", help="remove exactly this prefix's namespaces, its process alive or not")
    args = parser.parse_args(argv)
    removed = cleanup(args.prefix)
    print("removed: " + (", ".join(removed) if removed else "nothing"))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
