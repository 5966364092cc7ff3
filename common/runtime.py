"""Process plumbing shared by the long-running roles: logging, the file-descriptor limit,
malloc's reuse of large blocks, the cores a trainer keeps to, the ready file, the servers'
limits, stopping, and starting again as a fresh process (an elastic job's next term).

A role started by the launcher writes a small JSON "ready file" once its servers listen, so
the launcher learns the ports chosen for port 0 without parsing logs; SIGTERM and SIGINT
stop the servers in order.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, NoReturn

import orjson

from common.files import write_atomically
from common.spec import ClusterSection, Endpoint, TrainersSection
from common.transport import ConnectionLimits, H2Server, Http1Server, Router, Tls

log = logging.getLogger(__name__)


def configure_logging(role: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("BAGPIPE_LOG", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def raise_file_limit() -> int:
    """Raise this process's open-file limit (RLIMIT_NOFILE) to its hard limit and return it.

    Every connection is a file descriptor: at the usual soft limit of 1,024 a server whose
    `max_connections` is 1,024 would run out before its cap, and then refuse every client
    without a word. Raising the soft limit needs no privilege.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
            return soft
    log.info("open-file limit %d", hard)
    return hard


#: glibc's malloc serves blocks up to this size from its heap, reusing freed ones (`tune_malloc`).
MALLOC_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's upper bound on 64-bit
#: Free memory at the top of the heap that glibc keeps rather than handing back to the kernel.
MALLOC_TRIM_THRESHOLD = 64 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def tune_malloc() -> bool:
    """Let glibc's malloc reuse large freed blocks rather than map fresh pages for each one;
    whether it applied (False where the C library has no `mallopt`).

    By default glibc maps every block above its threshold (128 KiB at first, raised by
    frees up to 32 MiB, with the heap trimmed above twice that) afresh and unmaps it when
    freed, so a buffer of a fetch's rows costs a page fault per 4 KiB each time it is made:
    on a PS shard answering 1 MB fetches that was half its CPU (bench/ps_fetch.py: 0.71
    against 0.35 us per row served), on a trainer 1,700 faults a second. With fixed
    thresholds the heap keeps up to `MALLOC_TRIM_THRESHOLD` of freed memory for the next
    block instead (docs/design.md#transport)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) & mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def trainer_cpus(available: Iterable[int], trainers: int, threads: int, rank: int) -> tuple[int, ...] | None:
    """The cores trainer `rank` of `trainers` on one machine keeps to: the `available` cores
    split into that many contiguous shares, sizes differing by one at most; None when the
    cores cannot give each trainer `threads` of its own.

    A pinned trainer keeps its caches and is not moved onto the core where the other one
    runs; the PS shards and the oracle still go wherever a core is free. On a small machine
    shared by every role this is worth several percent (docs/benchmarks.md#e2e, where
    TorchRec's ranks are pinned the same way).
    """
    cpus = sorted(available)
    if not 0 <= rank < trainers or len(cpus) < trainers * threads:
        return None
    share, extra = divmod(len(cpus), trainers)
    start = rank * share + min(rank, extra)
    return tuple(cpus[start : start + share + (rank < extra)])


def pinned_cpus(trainers: TrainersSection, rank: int) -> tuple[int, ...] | None:
    """The cores trainer `rank` of a local cluster keeps to (`trainer_cpus` over this
    process's cores), or None: `pin_cpus` is off or the cores do not go round."""
    if not trainers.pin_cpus:
        return None
    return trainer_cpus(os.sched_getaffinity(0), trainers.count, trainers.threads, rank)


def parse_cpus(text: str) -> tuple[int, ...]:
    """Cores as the launcher passes them (`--cpus 0,1,2`); ValueError naming a bad one."""
    cpus = []
    for part in text.split(","):
        if not part.strip().isdigit():
            raise ValueError(f"{part!r} is not a core number (expected e.g. 0,1,2)")
        cpus.append(int(part))
    return tuple(cpus)


def pin_process(cpus: Iterable[int]) -> None:
    """Keep every thread of this process, and the threads it starts later, to `cpus`."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def write_ready_file(path: Path | None, info: dict[str, Any]) -> None:
    """Publish `info` atomically: the launcher never reads half a file."""
    if path is None:
        return
    write_atomically(path, orjson.dumps(info))


def connection_limits(cluster: ClusterSection) -> ConnectionLimits:
    """The servers' limits as the spec's `[cluster]` section sets them."""
    return ConnectionLimits(
        idle_timeout_s=cluster.idle_timeout_s,
        max_connections=cluster.max_connections,
        max_concurrent_streams=cluster.max_concurrent_streams,
        max_resets=cluster.max_resets,
        reset_window_s=cluster.reset_window_s,
        unauthenticated_rate=cluster.unauthenticated_rate,
        unauthenticated_burst=cluster.unauthenticated_burst,
        auth_timeout_s=cluster.auth_timeout_s,
        max_unauthenticated_connections=cluster.max_unauthenticated_connections,
    )


def make_server(
    transport: str,
    router: Router,
    *,
    host: str,
    port: int,
    token: str,
    max_body_bytes: int,
    limits: ConnectionLimits = ConnectionLimits(),
    sock: socket.socket | None = None,
    tls: Tls | None = None,
) -> H2Server | Http1Server:
    cls = H2Server if transport == "h2" else Http1Server
    return cls(
        router, host=host, port=port, token=token, max_body_bytes=max_body_bytes, limits=limits,
        sock=sock, tls=tls,
    )


def make_servers(
    cluster: ClusterSection, router: Router, address: Endpoint, *, token: str, admin_port: int | None,
    sock: socket.socket | None = None, tls: Tls | None = None,
) -> list[H2Server | Http1Server]:
    """A service's servers (not started): `router` on `address` in the spec's transport
    (on `sock`, when it already listens there) and, when that is h2, the same routes over
    HTTP/1.1 for tools that speak only that (Prometheus, browsers) on `admin_port`: by
    default the address's port + 1, or any free port when that is 0. The last server is the
    HTTP/1.1 one. With `tls` (the process's, `common.transport.tls`) both speak TLS only."""
    limits = connection_limits(cluster)
    servers = [
        make_server(cluster.transport, router, host=address.host, port=address.port,
                    token=token, max_body_bytes=cluster.max_body_bytes, limits=limits, sock=sock, tls=tls)
    ]
    if cluster.transport == "h2":
        if admin_port is None:
            admin_port = address.port + 1 if address.port else 0
        servers.append(make_server("http1", router, host=address.host, port=admin_port,
                                   token=token, max_body_bytes=cluster.max_body_bytes, limits=limits, tls=tls))
    return servers


async def wait_for_stop_signal() -> signal.Signals:
    """The first SIGTERM or SIGINT from now on: which one."""
    received: list[signal.Signals] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (received.append(s), stop.set()))
    await stop.wait()
    log.info("stop signal received (%s)", received[0].name)
    return received[0]


async def first_of(*awaitables: Awaitable[Any]) -> None:
    """Wait until one of `awaitables` ends, cancel the others; its exception, if any, is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    for task in done:
        task.result()


#: Where a trainer restarted for an elastic job's next term finds the term it left and its
#: index there ("TERM:INDEX"): its place in the next term goes by them.
LEFT_TERM_ENV = "BAGPIPE_LEFT_TERM"
#: Flags a role started again for the next term leaves out, and whether each takes a value:
#: the coordinator says where the next term resumes and which index a trainer has (a PS
#: shard gives its own index again).
NEXT_TERM_DROPS = {"--resume": False, "--rejoin": False, "--fresh": False, "--first-iteration": True,
                   "--index": True}


def restart_process(*, drop: Mapping[str, bool], add: Iterable[str] = (), env: Mapping[str, str]) -> NoReturn:
    """Replace this process by a fresh start of its own command line (`sys.argv`), without
    the flags of `drop` (True: with the value that follows), with `add` after it and `env`
    added to its environment. The pid stays,
    so whatever waits for the process (the launcher, a scheduler) sees it go on; every thread
    and socket of the old one is gone, as after a kill, and the new one starts from scratch."""
    argv, skip = [], False
    for arg in sys.argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif name in drop:
            skip = drop[name] and "=" not in arg
        else:
            argv.append(arg)
    argv += add
    log.warning("starting again: %s", " ".join(argv))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **env})
