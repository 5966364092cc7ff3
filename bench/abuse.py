#!/usr/bin/env python3
"""PS fetch latency while a hostile peer abuses the same server, over HTTP/2 and HTTP/1.1.

A real PS shard runs in its own process (both protocols on two ports, production connection
limits unless told otherwise); an attacker runs in a third. For each protocol and each abuse
this process fetches rows with one authenticated client in a loop and reports fetch p50/p99
and the server's RSS before, at its peak and after. The abuses:

* ``idle``: none (the baseline);
* ``rapid_reset``: HEADERS + RST_STREAM floods on unauthenticated connections (HTTP/2 only);
* ``held_connections``: idle connections up to the server's cap, and some past it;
* ``unauth_bodies``: unauthenticated 15 MiB uploads (40 streams a connection on HTTP/2);
  ``bytes_written`` counts what the attacker's sockets accepted, not what the server read;
* ``health_flood``: public health requests from many concurrent loops;
* ``continuation``: header blocks that never end, HEADERS without END_HEADERS then
  CONTINUATION frames of 1 MiB, on unauthenticated connections (HTTP/2 only);
* ``idle_connections``: bare TCP connections up to the server's cap and past it, each
  sending one byte a second (the start of a request that never completes), reopened as the
  server closes them.

Besides the fetch loop (one client connected before the attack, as a trainer connects at
start-up), a newcomer connects every `NEWCOMER_EVERY_S` and makes one authenticated request:
``newcomers`` counts those served, ``refused`` those that were not (a restarted shard or
trainer must always get back in).

With `--tls` the server speaks TLS only (throw-away certificates, `launcher.certs`) and
every peer, the attacker's included, speaks inside TLS sessions: each connection the
attacks open then costs a handshake.

    python bench/abuse.py --quick
    python bench/abuse.py --quick --tls

`--smoke`: 0.2 s per scenario against a server capped at 16 connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import itertools
import queue
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import numpy as np
from hyperframe.frame import ContinuationFrame, HeadersFrame

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from common.errors import BagpipeError  # noqa: E402
from common.keys import TableLayout  # noqa: E402
from common.spec import Endpoint, TlsSection  # noqa: E402
from common.transport import ConnectionLimits, H2Server, Http1Server, Tls, connect_client, run  # noqa: E402
from ps.client import PsClient  # noqa: E402
from ps.service import PsService  # noqa: E402
from ps.store import ShardConfig, ShardStore  # noqa: E402

NAME = "abuse"
TOKEN = "bench"
TABLE_ROWS = 1 << 16
DIM = 16
FETCH_ROWS = 256
UPLOAD = 15 * 1024 * 1024
ABUSES = ("idle", "rapid_reset", "held_connections", "unauth_bodies", "health_flood", "continuation",
          "idle_connections")
H2_ONLY = ("rapid_reset", "continuation")
NEWCOMER_EVERY_S = 0.1


@dataclass(frozen=True)
class Target:
    """The server as every peer here reaches it: its port, in clear or (with `tls_files`)
    over TLS, each process loading the files once."""

    port: int
    tls_files: TlsSection | None = None

    def tls(self) -> Tls | None:
        if self.tls_files is None:
            return None
        if self.tls_files not in _LOADED:
            _LOADED[self.tls_files] = Tls.load(self.tls_files)
        return _LOADED[self.tls_files]

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw connection: TCP, or a TLS session with its handshake done."""
        tls = self.tls()
        if tls is None:
            return await asyncio.open_connection("127.0.0.1", self.port)
        return await asyncio.open_connection("127.0.0.1", self.port, ssl=tls.client, server_hostname="127.0.0.1")

    def client(self, kind: str, token: str | None, **kw: Any) -> Any:
        return connect_client(kind, "127.0.0.1", self.port, token, tls=self.tls(), **kw)  # type: ignore[arg-type]


_LOADED: dict[TlsSection, Tls] = {}


@dataclass(kw_only=True)
class Row:
    protocol: str
    abuse: str
    fetches: int
    p50_ms: float
    p99_ms: float
    rss_before_mb: float
    rss_peak_mb: float
    rss_after_mb: float
    newcomers: int = 0  # fresh authenticated connections served during the scenario
    newcomers_refused: int = 0  # ... and those that were not
    attack: dict[str, int] = field(default_factory=dict)
    tls: bool = False


# -- the server -----------------------------------------------------------------------------
def _serve(limits: dict[str, Any], ports: mp.Queue, stop: Event, cpus: set[int] | None,
           tls_files: TlsSection | None = None) -> None:
    _pin(cpus)

    async def main() -> None:
        config = ShardConfig(shard=0, num_shards=1, layout=TableLayout((TABLE_ROWS,)), dim=DIM,
                             state_width=0)
        store = ShardStore(config)
        store.gather(np.arange(TABLE_ROWS))  # every row initialised: steady-state RSS
        service = PsService(store, checkpoint_dir=Path("/nonexistent"), fetch_timeout_s=60)
        kw = {"token": TOKEN, "max_body_bytes": 64 << 20, "limits": ConnectionLimits(**limits),
              "tls": Target(0, tls_files).tls()}
        servers = [H2Server(service.router(), **kw), Http1Server(service.router(), **kw)]
        for server in servers:
            await server.start()
        ports.put({"h2": servers[0].port, "http1": servers[1].port})
        await asyncio.to_thread(stop.wait)
        for server in servers:
            await server.stop()

    run(main())


def _pin(cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(the attacker's CPUs, the server's and fetching client's): the last CPU for the
    attacker, as a remote attacker has a machine of its own, so that the figures show what
    the abuse costs the server rather than what the attacker's own work takes from it.
    None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    return None if len(cpus) < 2 else ({cpus[-1]}, set(cpus[:-1]))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# -- the attacker ---------------------------------------------------------------------------
def _h2_headers(path: str, method: str = "POST", length: int | None = None) -> list[tuple[str, str]]:
    headers = [(":method", method), (":path", path), (":scheme", "http"), (":authority", "ps")]
    return headers if length is None else [*headers, ("content-length", str(length))]


class _Peer:
    """One raw h2c connection: `pump` sends what h2 queued; a reader task feeds h2 and
    notices answers, GOAWAY and the server hanging up."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.writer = writer
        self.gone = asyncio.Event()
        self.goaway = False
        self.refused = 0  # answers with a 4xx status
        self.changed = asyncio.Event()
        self.conn.initiate_connection()
        self._reading = asyncio.create_task(self._read(reader))

    @classmethod
    async def open(cls, target: Target) -> _Peer:
        peer = cls(*await target.open())
        await peer.pump()
        return peer

    async def pump(self) -> None:
        if data := self.conn.data_to_send():
            self.writer.write(data)
            await self.writer.drain()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
            while data := await reader.read(1 << 16):
                for event in self.conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                            event.stream_id)
                    if isinstance(event, h2.events.ResponseReceived):
                        self.refused += dict(event.headers or [])[b":status"].startswith(b"4")
                    self.goaway |= isinstance(event, h2.events.ConnectionTerminated)
                self.changed.set()
                await self.pump()
        self.gone.set()
        self.changed.set()

    def close(self) -> None:
        self._reading.cancel()
        self.writer.close()


async def _rapid_reset(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event) -> None:
    ready.set()
    while True:
        peer = await _Peer.open(target)
        try:
            # Sending stops with an error once the server has hung up or sent GOAWAY.
            with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
                while not peer.gone.is_set():
                    for _ in range(100):
                        stream_id = peer.conn.get_next_available_stream_id()
                        peer.conn.send_headers(stream_id, _h2_headers("/v1/fetch", length=64))
                        peer.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                    await peer.pump()
                    counts["streams_reset"] += 100
                    await asyncio.sleep(0)
            await peer.gone.wait()
            counts["goaway"] += peer.goaway
        finally:
            peer.close()


async def _held_connections(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event,
                            *, count: int) -> None:
    preface = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    preface.initiate_connection()
    first_bytes = preface.data_to_send() if kind == "h2" else b""
    held: list[asyncio.StreamWriter] = []

    async def hold() -> None:
        reader, writer = await target.open()
        held.append(writer)
        writer.write(first_bytes)
        counts["opened"] += 1
        with contextlib.suppress(OSError):
            while await reader.read(1 << 16):
                pass
        counts["closed_by_server"] += 1

    tasks = [asyncio.create_task(hold()) for _ in range(count)]
    try:
        while counts["opened"] < count:
            await asyncio.sleep(0.01)
        ready.set()
        await asyncio.Future()  # hold until cancelled
    finally:
        for task in tasks:
            task.cancel()
        for writer in held:
            writer.close()


async def _unauth_bodies(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event) -> None:
    ready.set()
    upload = _unauth_h2_upload if kind == "h2" else _unauth_http1_upload
    await asyncio.gather(*(upload(target, counts) for _ in range(2)))


async def _unauth_h2_upload(target: Target, counts: dict[str, int]) -> None:
    chunk = bytes(1 << 20)
    while True:
        peer = await _Peer.open(target)
        counts["connections"] += 1
        try:
            streams = []
            for _ in range(40):
                stream_id = peer.conn.get_next_available_stream_id()
                peer.conn.send_headers(stream_id, _h2_headers("/v1/fetch", length=UPLOAD))
                streams.append(stream_id)
            with contextlib.suppress(OSError):
                await peer.pump()
                # Send what the windows allow until every stream is refused or done.
                while streams and not peer.gone.is_set():
                    for stream_id in list(streams):
                        with contextlib.suppress(h2.exceptions.ProtocolError):
                            size = min(peer.conn.local_flow_control_window(stream_id),
                                       peer.conn.max_outbound_frame_size)
                            if size > 0:
                                peer.conn.send_data(stream_id, chunk[:size])
                                counts["bytes_written"] += size
                                continue
                        if peer.conn.streams.get(stream_id) is None or peer.conn.streams[stream_id].closed:
                            streams.remove(stream_id)
                    await peer.pump()
                    peer.changed.clear()
                    if streams:
                        # Not asyncio.wait_for: in 3.11 it can swallow the attack's cancellation.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.5):
                                await peer.changed.wait()
        finally:
            counts["uploads_refused"] += peer.refused
            peer.close()


async def _unauth_http1_upload(target: Target, counts: dict[str, int]) -> None:
    """Uploads that read the answer while sending, as curl and aiohttp do."""
    chunk = bytes(1 << 20)
    head = f"POST /v1/fetch HTTP/1.1\r\nhost: ps\r\ncontent-length: {UPLOAD}\r\n\r\n".encode()

    async def status(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            line = await reader.readline()
            counts["uploads_refused"] += line.startswith(b"HTTP/1.1 4")

    while True:
        reader, writer = await target.open()
        counts["connections"] += 1
        answer = asyncio.create_task(status(reader))
        try:
            with contextlib.suppress(OSError):
                writer.write(head)
                for _ in range(UPLOAD // len(chunk)):
                    if answer.done():
                        break
                    writer.write(chunk)
                    await writer.drain()
                    counts["bytes_written"] += len(chunk)
            await answer
        finally:
            answer.cancel()
            writer.close()


async def _health_flood(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event) -> None:
    clients = [target.client(kind, None) for _ in range(4)]

    async def flood(client: Any) -> None:
        while True:
            await client.request("GET", "/v1/health")
            counts["health_requests"] += 1

    ready.set()
    try:
        await asyncio.gather(*(flood(c) for c in clients for _ in range(8)))
    finally:
        for client in clients:
            await client.close()


async def _continuation(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event) -> None:
    """Header blocks of 64 MiB that never end, from 8 connections at a time."""
    ready.set()
    await asyncio.gather(*(_endless_header_block(target, counts) for _ in range(8)))


async def _endless_header_block(target: Target, counts: dict[str, int]) -> None:
    headers = HeadersFrame(1, data=bytes(1024)).serialize()  # no END_HEADERS
    continuation = ContinuationFrame(1, data=bytes(1 << 20)).serialize()
    while True:
        peer = await _Peer.open(target)
        counts["connections"] += 1
        try:
            with contextlib.suppress(OSError):
                peer.writer.write(headers)
                for _ in range(63):
                    if peer.gone.is_set():
                        break
                    peer.writer.write(continuation)
                    await peer.writer.drain()
                    counts["bytes_written"] += len(continuation)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await peer.gone.wait()
            counts["goaway"] += peer.goaway
        finally:
            peer.close()


async def _idle_connections(target: Target, kind: str, counts: dict[str, int], ready: asyncio.Event,
                            *, count: int) -> None:
    """`count` bare connections, each sending one byte a second of a request it never
    finishes; one the server closes is opened again a second later (at once, the attacker
    would be flooding the server with connections, another attack)."""
    if kind == "h2":
        trickle = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    else:
        trickle = b"GET /v1/health HTTP/1.1\r\nhost: ps\r\nx-pad: " + b"x" * 4096
    opened = asyncio.Event()

    async def hold() -> None:
        while True:
            reader, writer = await target.open()
            counts["opened"] += 1
            if counts["opened"] >= count:
                opened.set()
            try:
                with contextlib.suppress(OSError):
                    for byte in itertools.cycle(trickle):
                        if reader.at_eof() or await _closed_within(reader, 1.0):
                            break
                        writer.write(bytes([byte]))
                counts["closed_by_server"] += 1
            finally:
                writer.close()
            await asyncio.sleep(1.0)  # the attacker's pace

    tasks = [asyncio.create_task(hold()) for _ in range(count)]
    try:
        await opened.wait()
        ready.set()
        await asyncio.Future()  # hold until cancelled
    finally:
        for task in tasks:
            task.cancel()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closed the connection within `seconds` (what it sent is dropped)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(1 << 16):
                pass
            return True
    except TimeoutError:
        return False


Attack = Callable[[Target, str, dict[str, int], asyncio.Event], Awaitable[None]]


def _attack(abuse: str, kind: str, target: Target, held: int, ready: Event, stop: Event, results: mp.Queue) -> None:
    attacks: dict[str, Attack] = {
        "rapid_reset": _rapid_reset,
        "held_connections": lambda *a: _held_connections(*a, count=held),
        "unauth_bodies": _unauth_bodies,
        "health_flood": _health_flood,
        "continuation": _continuation,
        "idle_connections": lambda *a: _idle_connections(*a, count=held),
    }

    async def main() -> dict[str, int]:
        counts = _Counts()
        started = asyncio.Event()
        task = asyncio.create_task(attacks[abuse](target, kind, counts, started))
        await asyncio.wait([task, asyncio.create_task(started.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        ready.set()
        await asyncio.to_thread(stop.wait)
        # Cancel until it ends: Python 3.11's asyncio.wait_for (in the upload loop) can swallow
        # a cancellation that lands as its inner wait completes, and the attack goes on.
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=1)
        return dict(counts)

    results.put(run(main()))


class _Counts(dict[str, int]):
    def __missing__(self, key: str) -> int:
        return 0


# -- the measurement ------------------------------------------------------------------------
async def _fetch_loop(kind: str, target: Target, seconds: float, pid: int,
                      start_attack: Callable[[], None]) -> tuple[list[float], float, dict[str, int]]:
    """Fetch latencies (seconds) of one authenticated client for `seconds`, the peak server
    RSS seen meanwhile and how the newcomers fared (`_newcomers`). The client connects
    before the attack starts, as a trainer connects at start-up."""
    client = PsClient([Endpoint(host="127.0.0.1", port=target.port)], token=TOKEN, dim=DIM,
                      state_width=0, transport=kind, timeout_s=30, retries=2, tls=target.tls())  # type: ignore[arg-type]
    keys = np.random.default_rng(0).integers(0, TABLE_ROWS, FETCH_ROWS, dtype=np.int64)
    latencies: list[float] = []
    newcomers = _Counts()
    try:
        await client.fetch(keys)
        await asyncio.to_thread(start_attack)
        peak = _rss_mb(pid)
        deadline = time.perf_counter() + seconds
        arriving = asyncio.create_task(_newcomers(kind, target, newcomers))
        try:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await client.fetch(keys)
                latencies.append(time.perf_counter() - started)
                if len(latencies) % 20 == 0:
                    peak = max(peak, _rss_mb(pid))
        finally:
            arriving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await arriving
    finally:
        await client.close()
    return latencies, max(peak, _rss_mb(pid)), newcomers


async def _newcomers(kind: str, target: Target, counts: dict[str, int]) -> None:
    """A fresh client every `NEWCOMER_EVERY_S`, one authenticated request each, no retry."""
    while True:
        client = target.client(kind, TOKEN, timeout=5)
        try:
            await client.call("GET", "/v1/status")
            counts["served"] += 1
        except BagpipeError:
            counts["refused"] += 1
        finally:
            await client.close()
        await asyncio.sleep(NEWCOMER_EVERY_S)  # the pace of the newcomers


def measure(*, seconds: float, limits: ConnectionLimits, held_extra: int = 16,
            abuses: tuple[str, ...] = ABUSES, report: Callable[[Row], None] | None = None,
            isolate: bool = True, tls_files: TlsSection | None = None) -> list[Row]:
    """Every (protocol, abuse) pair against one server process; `report` sees each row.
    `held_connections` opens `held_extra` more than the server's cap. With `isolate`, the
    attacker runs on CPUs of its own (`split_cpus`). With `tls_files`, the server and every
    peer speak TLS."""
    ctx = mp.get_context("spawn")
    split = split_cpus() if isolate else None
    attacker_cpus, server_cpus = split or (None, None)
    ports_queue, stop_server = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(asdict(limits), ports_queue, stop_server, server_cpus, tls_files),
                         daemon=True)
    server.start()
    # One attacker process for every scenario, each attack in turn: a fresh interpreter per
    # scenario cost about 0.8 CPU-seconds each, twelve times a run.
    attacker = _Attacker(ctx, attacker_cpus)
    rows = []
    own_cpus = os.sched_getaffinity(0)
    _pin(server_cpus)  # the fetching client
    try:
        ports = ports_queue.get(timeout=120)
        assert server.pid is not None
        for kind in ("h2", "http1"):
            for abuse in abuses:
                if abuse in H2_ONLY and kind == "http1":
                    continue
                rows.append(_scenario(attacker, kind, abuse, Target(ports[kind], tls_files), server.pid, seconds,
                                      limits.max_connections + held_extra))
                if report is not None:
                    report(rows[-1])
    finally:
        os.sched_setaffinity(0, own_cpus)
        attacker.close()
        stop_server.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    return rows


class _Attacker:
    """A process that runs one attack at a time (`_attacks`): `start` one, `finish` it to get
    its counts."""

    def __init__(self, ctx: Any, cpus: set[int] | None) -> None:
        self._commands, self._results = ctx.Queue(), ctx.Queue()
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._process = ctx.Process(target=_attacks, args=(self._commands, self._ready, self._stop, self._results, cpus),
                                    daemon=True)
        self._process.start()

    def start(self, abuse: str, kind: str, target: Target, held: int) -> None:
        self._ready.clear()
        self._stop.clear()
        self._commands.put((abuse, kind, target, held))
        if not self._ready.wait(120):
            raise RuntimeError(f"the {abuse} attacker did not start")

    def finish(self, abuse: str) -> dict[str, int]:
        self._stop.set()
        try:
            outcome = self._results.get(timeout=60)
        except queue.Empty:
            self._process.kill()
            raise RuntimeError(f"the {abuse} attacker did not stop within 60 s") from None
        if isinstance(outcome, str):
            raise RuntimeError(f"the {abuse} attacker failed: {outcome}")
        return outcome

    def close(self) -> None:
        self._commands.put(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


def _attacks(commands: mp.Queue, ready: Event, stop: Event, results: mp.Queue, cpus: set[int] | None) -> None:
    _pin(cpus)
    while (command := commands.get()) is not None:
        try:
            _attack(*command, ready, stop, results)
        except Exception as exc:  # reported to the scenario that waits for it
            ready.set()
            results.put(f"{type(exc).__name__}: {exc}")


def _scenario(attacker: _Attacker, kind: str, abuse: str, target: Target, pid: int, seconds: float,
              held: int) -> Row:
    before = _rss_mb(pid)
    started = []

    def start_attack() -> None:
        if abuse != "idle":
            attacker.start(abuse, kind, target, held)
            started.append(True)

    try:
        latencies, peak, newcomers = run(_fetch_loop(kind, target, seconds, pid, start_attack))
    finally:
        counts = attacker.finish(abuse) if started else {}
    ms = np.array(latencies) * 1e3
    return Row(protocol=kind, abuse=abuse, fetches=len(latencies),
               p50_ms=float(np.percentile(ms, 50)), p99_ms=float(np.percentile(ms, 99)),
               rss_before_mb=before, rss_peak_mb=peak, rss_after_mb=_rss_mb(pid),
               newcomers=newcomers["served"], newcomers_refused=newcomers["refused"], attack=counts,
               tls=target.tls_files is not None)


def _protocol(r: Row) -> str:
    return f"{r.protocol} TLS" if r.tls else r.protocol


def _print_row(r: Row) -> None:
    attack = ", ".join(f"{k} {v:,}" for k, v in sorted(r.attack.items()))
    print(f"{_protocol(r):>9} {r.abuse:<16} | {r.fetches:>7,} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} | "
          f"{r.rss_before_mb:>7.0f} {r.rss_peak_mb:>7.0f} {r.rss_after_mb:>7.0f} | "
          f"{r.newcomers:>5} {r.newcomers_refused:>7} | {attack}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (under a minute)")
    parser.add_argument("--seconds", type=float, help="fetch loop per scenario (default 10, quick 2, smoke 0.2)")
    parser.add_argument("--shared-cpus", action="store_true",
                        help="let the attacker share the server's CPUs (default: the last CPU is its own)")
    parser.add_argument("--tls", action="store_true", help="the server and every peer over TLS")
    parser.add_argument("--max-connections", type=int,
                        help=f"the server's connection cap (default {ConnectionLimits().max_connections}, "
                             "16 with --smoke; held_connections opens 16 more)")
    add_result_options(parser, NAME, "0.2 s per scenario, 16 connections at most")
    args = parser.parse_args()
    seconds = args.seconds or (0.2 if args.smoke else 2.0 if args.quick else 10.0)
    cap = args.max_connections or (16 if args.smoke else ConnectionLimits().max_connections)
    limits = ConnectionLimits(max_connections=cap)
    split = None if args.shared_cpus else split_cpus()
    if split is not None:
        print(f"attacker on CPU {sorted(split[0])}, server and fetching client on CPUs {sorted(split[1])}")
    print(f"PS fetch of {FETCH_ROWS} rows x d {DIM}, one client, {seconds:g} s per scenario; "
          f"server RSS in MB; limits {limits}")
    print(f"{'proto':>9} {'abuse':<16} | {'fetches':>7} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'before':>7} {'peak':>7} {'after':>7} | {'new':>5} {'refused':>7} | attacker")
    with tempfile.TemporaryDirectory(prefix="abuse-tls-") as folder:
        tls_files = None
        if args.tls:
            from launcher.certs import make_certificates

            tls_files = make_certificates(Path(folder))
        rows = measure(seconds=seconds, limits=limits, report=_print_row, isolate=not args.shared_cpus,
                       tls_files=tls_files)
    config = config_of(args, seconds=seconds, limits=asdict(limits), fetch_rows=FETCH_ROWS, dim=DIM)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"rows": [asdict(r) for r in rows]}, headline=headline(rows), smoke=args.smoke)
    return 0


def headline(rows: list[Row]) -> Table:
    """Per protocol and abuse: fetches made, their p50 and p99, the server's RSS, and the
    authenticated newcomers served and refused meanwhile."""
    columns = ("protocol", "abuse", "fetches", "p50 ms", "p99 ms", "RSS before MB", "RSS peak MB", "RSS after MB",
               "newcomers", "refused")
    return Table(columns, tuple((_protocol(r), r.abuse, r.fetches, r.p50_ms, r.p99_ms, r.rss_before_mb,
                                 r.rss_peak_mb, r.rss_after_mb, r.newcomers, r.newcomers_refused) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
