#!/usr/bin/env python3
"""PS fetch throughput over HTTP/2 and HTTP/1.1, beside in-process `np.take` of the same rows.

A real PS shard runs in its own process (both protocols on two ports); this process fetches
random rows with N requests in flight for batch sizes 1 … 65,536 and d = 16 and 64, and
prints rows/s and MB/s (MB = 10^6 bytes of row payload). `--json` writes every figure plus
the headline keys `http2_MBps`, `http1_MBps`, `inproc_MBps` (16,384 rows × d 64, 8 in flight).

The small-request section measures the shard's request rate: fetches of 4 keys (d 64), 16
in flight in all, from `--clients` client processes, in rounds of HTTP/2 and HTTP/1.1 under
two loads. `psclient`: `PsClient.fetch` loops (one connection per process), what a trainer
runs; its clients spend about as much CPU per request as the shard, so on a small machine
they, not the shard, set the rate. `raw` (`bench.fetch_load`): the same requests sent as
prepared bytes, answers counted by their framing, about 10 us of client CPU each: the
shard sets the rate. Each round counts the fetches answered and the shard process's CPU
time (from /proc) over the same window. The headline, `small_http2_rps` and
`small_http2_capacity_rps` (and http1's), is the raw load's: the rate reached, and
`1 / (shard CPU per request)`, what the shard serves with a core to itself (it rarely has
one on a shared machine: the rate reached is then lower). Per load and protocol:
`small_http2_raw_rps`, `..._server_us_per_req`, `..._client_us_per_req` (what `PsClient`
costs a trainer, under `psclient`), each with its range over the rounds.

Last, the same small fetches in-process (`measure_protocol`): one connection of a real
`H2Server` fed the prepared bytes, 1 and 8 fetches to a read, and the PS handler alone on
one such request. No socket, event loop or other process takes part, so it is the shard's
Python cost per request, steady from run to run where the rates above are not
(`protocol_h2_us_per_req`, `..._1`, `protocol_handler_us_per_req`).

Then fetches over S shards (`--shards`, default 1 2 4 8): one `PsClient` fetches the same
batches (4 in flight of 16,384 random keys, d 64) from a table of 2^19 rows split by key % S
over S shard processes, every S's shards up at once and the rounds alternating over S. Per
S: the client process's CPU time and the shards' (from /proc) per fetched row
(`client_cpu_us_per_row`, `shards_cpu_us_per_row`, keyed by S) and each one's flatness, max /
min over S (`client_cpu_flatness`, `shards_cpu_flatness`). The client's per-shard work is
numpy (a stable split, a gather and a scatter per shard); what grows with S is each request's
fixed cost in the pure-Python HTTP/2 stack (a stream opened, headers coded both ways, a few
frames parsed, whatever their size): S requests of 16,384 / S rows instead of one.

With `--tls` the shard also serves both protocols over TLS (throw-away certificates,
`launcher.certs`) and every measurement runs over TLS too, alternating with plaintext in
the same run: `tls_http2_MBps`, `tls_http1_MBps`, `small_tls_http2_rps` and so on; and the headline
case five times more, in clear then over TLS, for the ratios (`tls_http2_ratio`: the
median of the rounds' TLS / plaintext MB/s, with its range), with the CPU seconds per GB
the client and the shard spent (`cpu_s_per_GB`) and what TLS must cost (`tls_costs`: the
cipher alone, and TLS through memory BIOs as the event loop runs it): hence the best ratio
this machine allows while client and shard share its cores (`tls_http2_ratio_bound_aead`,
`..._memory_bio`).

    python bench/ps_fetch.py --quick
    python bench/ps_fetch.py --small-only --rounds 5
    python bench/ps_fetch.py --tls

`--smoke`: a shard of 65,536 rows, batches of 1 and 16,384 rows, 0.05 s windows (0.5 s for
the small fetches, 0.2 s over 1 and 2 shards), one round.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from bench.fetch_load import FetchLoad, Fetches, H2Requests  # noqa: E402
from common.keys import TableLayout  # noqa: E402
from common.runtime import tune_malloc  # noqa: E402
from common.spec import Endpoint, TlsSection  # noqa: E402
from common.transport import H2Server, Http1Server, Tls, run  # noqa: E402
from common.transport.http import Request, start_handler  # noqa: E402
from ps.client import PsClient  # noqa: E402
from ps.protocol import FETCH, INCARNATION_HEADER  # noqa: E402
from ps.service import PsService  # noqa: E402
from ps.store import ShardConfig, ShardStore  # noqa: E402

NAME = "ps_fetch"
TOKEN = "bench"
TABLE_ROWS = 1 << 20
SMOKE_ROWS = 1 << 16
HEADLINE = (16384, 64)
SMALL_KEYS, SMALL_DIM, SMALL_IN_FLIGHT = 4, 64, 16
#: Fetches over S shards: one table of this many rows split by key % S; batches of
#: SHARD_BATCH keys of d SHARD_DIM, SHARD_IN_FLIGHT of them in flight.
SHARD_TABLE_ROWS, SHARD_BATCH, SHARD_DIM, SHARD_IN_FLIGHT = 1 << 19, 16384, 64, 4
TRANSPORTS = {"h2": "http2", "http1": "http1"}  # client transport name → figure prefix
LOADS = ("psclient", "raw")  # PsClient.fetch loops; prepared requests (bench.fetch_load)
#: Ports the shard serves: (transport, over TLS), in the order `_serve` reports them.
PORTS = (("h2", False), ("http1", False), ("h2", True), ("http1", True))
_TLS: dict[TlsSection, Tls] = {}  # each process loads the files once


def _tls(files: TlsSection | None) -> Tls | None:
    if files is None:
        return None
    if files not in _TLS:
        _TLS[files] = Tls.load(files)
    return _TLS[files]


def _prefix(transport: str, tls: bool) -> str:
    """A figure's prefix: `http2`, `http1`, `tls_http2`, `tls_http1`."""
    return ("tls_" if tls else "") + TRANSPORTS[transport]


def _service(dim: int, rows: int = TABLE_ROWS, shard: int = 0, num_shards: int = 1) -> PsService:
    """Shard `shard` of `num_shards` over a table of `rows` rows of `dim`, every row it owns
    initialised (steady state)."""
    config = ShardConfig(shard=shard, num_shards=num_shards, layout=TableLayout((rows,)), dim=dim, state_width=0)
    store = ShardStore(config)
    store.gather(np.arange(store.num_rows))
    return PsService(store, checkpoint_dir=Path("/nonexistent"), fetch_timeout_s=60)


def _serve(dim: int, rows: int, ports: mp.Queue, stop: mp.Event, tls_files: TlsSection | None = None,
           shard: int = 0, num_shards: int = 1) -> None:
    """The shard: HTTP/2 and HTTP/1.1 ports, and the same over TLS with `tls_files` (`PORTS`)."""
    tune_malloc()  # as every role does (launch.py)

    async def main() -> None:
        service = _service(dim, rows, shard, num_shards)
        tls = _tls(tls_files)
        servers = [
            (H2Server if kind == "h2" else Http1Server)(service.router(), port=0, token=TOKEN, max_body_bytes=1 << 30,
                                                        tls=tls if secure else None)
            for kind, secure in PORTS if tls is not None or not secure
        ]
        for server in servers:
            await server.start()
        ports.put([s.port for s in servers])
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for server in servers:
            await server.stop()

    run(main())


async def _fetch_rate(
    port: int, transport: str, dim: int, batch: int, in_flight: int, seconds: float, rows: int,
    tls_files: TlsSection | None = None,
) -> tuple[float, float]:
    """Row-payload bytes per second fetched by `in_flight` concurrent loops from a shard of
    `rows`, and the GB of them."""
    client = PsClient([Endpoint(host="127.0.0.1", port=port)], token=TOKEN, dim=dim, state_width=0,
                      transport=transport, timeout_s=120, tls=_tls(tls_files))
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, rows, batch, dtype=np.int64) for _ in range(in_flight)]
    try:
        await asyncio.gather(*(client.fetch(k) for k in keys))  # warm the connection
        started = time.perf_counter()
        done = await _fetch_loops(client, keys, started + seconds)
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    payload = done * batch * dim * 4
    return payload / elapsed, payload / 1e9


async def _fetch_loops(client: PsClient, keys: list[np.ndarray], deadline: float) -> int:
    """`client.fetch` loops, one per batch of `keys`, until `deadline` (`time.perf_counter`):
    the fetches done."""
    done = 0

    async def loop(k: np.ndarray) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await client.fetch(k)
            done += 1

    await asyncio.gather(*(loop(k) for k in keys))
    return done


def _take_rate(dim: int, batch: int, seconds: float, rows: int) -> float:
    table = np.random.default_rng(0).random((rows, dim), dtype=np.float32)
    keys = np.random.default_rng(1).integers(0, rows, batch)
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or done < 3:
        np.take(table, keys, axis=0)
        done += 1
    return done * batch * dim * 4 / elapsed


def measure(dims: list[int], batches: list[int], in_flight: int, seconds: float,
            table_rows: int = TABLE_ROWS, tls_files: TlsSection | None = None) -> list[dict]:
    """Per d and batch size: MB/s over each protocol (each also over TLS with `tls_files`,
    right after its plaintext run) and of `np.take`."""
    rows = []
    ctx = mp.get_context("spawn")
    for dim in dims:
        ports, stop = ctx.Queue(), ctx.Event()
        server = ctx.Process(target=_serve, args=(dim, table_rows, ports, stop, tls_files), daemon=True)
        server.start()
        port = dict(zip(PORTS, ports.get(timeout=120)))
        try:
            for batch in batches:
                row: dict = {"dim": dim, "rows": batch, "in_flight": in_flight}
                for (transport, secure), number in port.items():
                    rate, _ = run(_fetch_rate(number, transport, dim, batch, in_flight, seconds, table_rows,
                                              tls_files if secure else None))
                    row[f"{_prefix(transport, secure)}_MBps"] = rate / 1e6
                row["inproc_MBps"] = _take_rate(dim, batch, seconds, table_rows) / 1e6
                rows.append(row)
                _print_row(rows[-1])
        finally:
            stop.set()
            server.join(30)
    return rows


def measure_tls_ratio(rounds: int, in_flight: int, seconds: float, table_rows: int,
                      tls_files: TlsSection) -> dict:
    """The headline case (`HEADLINE`) over each protocol in clear then over TLS, `rounds`
    times against one shard: per round the TLS / plaintext ratio of MB/s, so that a machine
    whose load changes from second to second moves both sides of each ratio alike; and the
    CPU seconds per GB of row payload the client (this process) and the shard spent."""
    dim, batch = HEADLINE[1], HEADLINE[0]
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(dim, table_rows, ports, stop, tls_files), daemon=True)
    server.start()
    port = dict(zip(PORTS, ports.get(timeout=120)))
    ratios: dict[str, list[float]] = {name: [] for name in TRANSPORTS.values()}
    cpu: dict[str, list[float]] = {}  # "<prefix>_<side>" -> CPU s per GB, one per round

    def fetch(transport: str, secure: bool) -> float:
        server_cpu, client_cpu = _server_cpu_s(server.pid), time.process_time()
        rate, gb = run(_fetch_rate(port[(transport, secure)], transport, dim, batch, in_flight, seconds,
                                   table_rows, tls_files if secure else None))
        prefix = _prefix(transport, secure)
        cpu.setdefault(f"{prefix}_client", []).append((time.process_time() - client_cpu) / gb)
        cpu.setdefault(f"{prefix}_server", []).append((_server_cpu_s(server.pid) - server_cpu) / gb)
        return rate

    try:
        for i in range(rounds):
            for transport, name in TRANSPORTS.items():
                plain, tls = (fetch(transport, secure) for secure in (False, True))
                ratios[name].append(tls / plain)
                print(f"{i:>5} {name:>6}: {plain / 1e6:7.1f} MB/s in clear, {tls / 1e6:7.1f} over TLS: "
                      f"{tls / plain:.2f}", flush=True)
    finally:
        stop.set()
        server.join(30)
    out: dict[str, Any] = {}
    for name, values in ratios.items():
        out[f"tls_{name}_ratio"] = statistics.median(values)
        out[f"tls_{name}_ratio_range"] = [min(values), max(values)]
    out["cpu_s_per_GB"] = {key: statistics.median(values) for key, values in cpu.items()}
    return out | tls_costs(tls_files, out["cpu_s_per_GB"])


#: Bytes the TLS cost measurements push through each side.
_CIPHER_BYTES = 256 << 20
#: What the cipher alone is timed on at a time: large enough that Python's cost per call
#: (a few us) is lost in the cipher's, where TLS seals records of 16 KiB from C.
_AEAD_CHUNK = 256 << 10


def tls_costs(tls_files: TlsSection, cpu_s_per_GB: dict[str, float]) -> dict[str, Any]:
    """What TLS must cost per GB on this machine, beside what it did cost (`cpu_s_per_GB`).

    `aead`: the cipher alone (`cryptography`'s AES-256-GCM, the suite TLS 1.3 agrees on here,
    sealing then opening). `memory_bio`: a TLS 1.3 connection between two
    `ssl.SSLObject`s in this process, the way the event loop's TLS transport runs one (written
    into memory BIOs, read out into new bytes): encrypting on one side, decrypting on the
    other. Client and shard share this machine's cores and keep them busy, so the TLS /
    plaintext ratio cannot exceed plaintext CPU / (plaintext CPU + what TLS adds on both
    sides): `tls_http2_ratio_bound_aead` with the cipher alone (no copies at all),
    `..._memory_bio` with the event loop's way of running it."""
    aead = _aead_s_per_GB()
    bio = _memory_bio_s_per_GB(_tls(tls_files))  # the process's one load of the files
    out: dict[str, Any] = {"tls_aead_s_per_GB": aead, "tls_memory_bio_s_per_GB": bio}
    for name in TRANSPORTS.values():
        plain = cpu_s_per_GB[f"{name}_client"] + cpu_s_per_GB[f"{name}_server"]
        tls = cpu_s_per_GB[f"tls_{name}_client"] + cpu_s_per_GB[f"tls_{name}_server"]
        out[f"tls_{name}_added_cpu_s_per_GB"] = tls - plain
        out[f"tls_{name}_ratio_bound_aead"] = plain / (plain + aead["seal"] + aead["open"])
        out[f"tls_{name}_ratio_bound_memory_bio"] = plain / (plain + bio["encrypt"] + bio["decrypt"])
    return out


def _aead_s_per_GB() -> dict[str, float]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher, nonce = AESGCM(AESGCM.generate_key(bit_length=256)), bytes(12)
    record = bytes(_AEAD_CHUNK)
    sealed = cipher.encrypt(nonce, record, None)
    count = _CIPHER_BYTES // _AEAD_CHUNK
    started = time.process_time()
    for _ in range(count):
        cipher.encrypt(nonce, record, None)
    middle = time.process_time()
    for _ in range(count):
        cipher.decrypt(nonce, sealed, None)
    ended = time.process_time()
    return {"seal": (middle - started) / (_CIPHER_BYTES / 1e9), "open": (ended - middle) / (_CIPHER_BYTES / 1e9)}


def _memory_bio_s_per_GB(tls: Tls) -> dict[str, float]:
    to_server, to_client, to_client_wire = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = tls.server("h2").wrap_bio(to_server, to_client, server_side=True)
    client = tls.client.wrap_bio(to_client_wire, to_server, server_hostname="localhost")
    for _ in range(8):  # the handshake, to and fro
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        to_client_wire.write(to_client.read())
    payload = memoryview(bytes(4 << 20))
    encrypt = decrypt = 0.0
    for _ in range(_CIPHER_BYTES // len(payload)):
        started = time.process_time()
        server.write(payload)  # an answer of 4 MiB, as a shard's transport is handed one
        wire = memoryview(to_client.read())
        middle = time.process_time()
        for at in range(0, len(wire), 256 << 10):  # the socket's reads, 256 KiB at a time
            to_client_wire.write(wire[at:at + (256 << 10)])
            while True:
                try:
                    client.read(1 << 20)
                except ssl.SSLWantReadError:
                    break
        encrypt, decrypt = encrypt + middle - started, decrypt + time.process_time() - middle
    gb = _CIPHER_BYTES / 1e9
    return {"encrypt": encrypt / gb, "decrypt": decrypt / gb}


def _server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _PsClientLoad:
    """`PsClient.fetch` loops, one per fetch in flight: what a trainer's fetches cost."""

    def __init__(self, client: PsClient, keys: list[np.ndarray]) -> None:
        self._client, self._keys = client, keys

    async def run(self, stop: float) -> tuple[int, int]:
        """Fetches answered before `stop`, (right, wrong): a wrong answer raises instead."""
        counts = await asyncio.gather(*(self._loop(k, stop) for k in self._keys))
        return sum(counts), 0

    async def _loop(self, keys: np.ndarray, stop: float) -> int:
        done = 0
        while True:  # one fetch at least: `run(0.0)` warms up
            await self._client.fetch(keys)
            if time.perf_counter() >= stop:
                return done
            done += 1

    def close(self) -> None:
        pass  # the client is closed by its owner


async def _start_load(
    load: str, client: PsClient, port: int, transport: str, keys: list[np.ndarray], tls: Tls | None
) -> _PsClientLoad | FetchLoad:
    if load == "psclient":
        return _PsClientLoad(client, keys)
    (status,) = await client.status()
    fetches = Fetches.of_keys(keys, dim=SMALL_DIM, state_width=0, host="127.0.0.1", port=port,
                              token=TOKEN, incarnation=status.incarnation)
    return await FetchLoad.connect(transport, fetches, len(keys), None if tls is None else tls.client)


async def _count_fetches(
    load: str, port: int, transport: str, in_flight: int, rows: int, tls_files: TlsSection | None,
    jobs: mp.Queue, answers: mp.Queue,
) -> None:
    """Connect and warm up, say so on `answers`, then take the window (start, stop) from
    `jobs` (`time.perf_counter`, the same clock in every process here) and answer with the
    fetches of SMALL_KEYS keys answered in it, `in_flight` at a time, right and wrong, and
    the CPU seconds this process spent meanwhile."""
    tls = _tls(tls_files)
    client = PsClient([Endpoint(host="127.0.0.1", port=port)], token=TOKEN, dim=SMALL_DIM,
                      state_width=0, transport=transport, timeout_s=120, tls=tls)
    rng = np.random.default_rng(port + in_flight)
    keys = [rng.integers(0, rows, SMALL_KEYS, dtype=np.int64) for _ in range(in_flight)]
    try:
        fetches = await _start_load(load, client, port, transport, keys, tls)
        try:
            await fetches.run(0.0)
            answers.put("warm")
            start, stop = jobs.get()  # blocks the loop, which has nothing else to do meanwhile
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            cpu = time.process_time()
            right, wrong = await fetches.run(stop)
            cpu = time.process_time() - cpu
        finally:
            fetches.close()
    finally:
        await client.close()
    answers.put((right, wrong, cpu))


def _fetch_client(jobs: mp.Queue, answers: mp.Queue) -> None:
    """A client process: runs `_count_fetches` for each job until it gets None."""
    tune_malloc()
    while (job := jobs.get()) is not None:
        run(_count_fetches(*job, jobs, answers))


def _small_round(
    server_pid: int, port: int, transport: str, load: str, clients: list[tuple[mp.Queue, mp.Queue]],
    seconds: float, rows: int, tls_files: TlsSection | None = None,
) -> dict:
    """One round of small fetches from every client process (over TLS with `tls_files`);
    the rate and the CPU spent."""
    share = SMALL_IN_FLIGHT // len(clients)
    for jobs, _ in clients:
        jobs.put((load, port, transport, share, rows, tls_files))
    for _, answers in clients:
        answers.get(timeout=120)  # connected and warm
    start = time.perf_counter() + 0.1
    stop = start + seconds
    for jobs, _ in clients:
        jobs.put((start, stop))
    time.sleep(start - time.perf_counter())
    cpu = _server_cpu_s(server_pid)
    time.sleep(max(0.0, stop - time.perf_counter()))
    cpu = _server_cpu_s(server_pid) - cpu
    counted = [answers.get(timeout=120) for _, answers in clients]
    done, wrong = sum(c[0] for c in counted), sum(c[1] for c in counted)
    if wrong or not done:
        raise RuntimeError(f"{transport} {load}: {done} fetches answered right, {wrong} wrong")
    client_cpu = sum(c[2] for c in counted)
    return {"transport": transport, "tls": tls_files is not None, "load": load, "rps": done / seconds,
            # /proc counts in ticks: a window too short for one reads as 0, never divided by
            "server_us_per_req": max(cpu, 1e-3) / done * 1e6, "server_busy": cpu / seconds,
            "client_us_per_req": client_cpu / done * 1e6}


def measure_small(clients: int, rounds: int, seconds: float, rows: int = TABLE_ROWS,
                  tls_files: TlsSection | None = None) -> dict:
    """Rounds of every protocol (each also over TLS with `tls_files`, right after it in
    clear) under every load against one shard of `rows`; every round, the medians."""
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(SMALL_DIM, rows, ports, stop, tls_files), daemon=True)
    server.start()
    port = dict(zip(PORTS, ports.get(timeout=120)))
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(clients)]
    procs = [ctx.Process(target=_fetch_client, args=q, daemon=True) for q in queues]
    for p in procs:
        p.start()
    try:
        measured = []
        for i in range(rounds):
            for (transport, secure), number in port.items():
                for load in LOADS:
                    measured.append(_small_round(server.pid, number, transport, load, queues, seconds, rows,
                                                 tls_files if secure else None))
                    _print_small_round(i, measured[-1])
    finally:
        for jobs, _ in queues:
            jobs.put(None)
        for p in procs:
            p.join(30)
        stop.set()
        server.join(30)
    return _small_summary(measured)


@dataclass(frozen=True)
class ShardRound:
    """One window of `PsClient.fetch` loops against S shards: rows fetched, and the CPU
    seconds the client process and the S shard processes spent on them."""

    shards: int
    rows: int
    client_cpu_s: float
    shards_cpu_s: float


@contextmanager
def _shard_set(ctx: Any, num_shards: int, rows: int) -> Iterator[tuple[list[int], list[int]]]:
    """S shard processes over one table of `rows` rows (key % S): their HTTP/2 ports and pids."""
    stop = ctx.Event()
    queues = [ctx.Queue() for _ in range(num_shards)]  # one each: the client lists the shards in order
    procs = [ctx.Process(target=_serve, args=(SHARD_DIM, rows, q, stop, None, s, num_shards), daemon=True)
             for s, q in enumerate(queues)]
    for proc in procs:
        proc.start()
    try:
        ports = [q.get(timeout=120)[0] for q in queues]  # each shard's plaintext HTTP/2 port (`PORTS`)
        yield ports, [proc.pid for proc in procs]
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)


async def _shard_round(ports: list[int], pids: list[int], keys: list[np.ndarray], seconds: float) -> ShardRound:
    """`PsClient.fetch` loops, one per batch of `keys`, for `seconds` against shards at `ports`."""
    client = PsClient([Endpoint(host="127.0.0.1", port=port) for port in ports], token=TOKEN, dim=SHARD_DIM,
                      state_width=0, transport="h2", timeout_s=120)
    try:
        await asyncio.gather(*(client.fetch(k) for k in keys))  # connect and warm up
        # The client is this process's only work meanwhile: its CPU time is the client's.
        shards_cpu, client_cpu = sum(map(_server_cpu_s, pids)), time.process_time()
        done = await _fetch_loops(client, keys, time.perf_counter() + seconds)
        client_cpu = time.process_time() - client_cpu
        shards_cpu = sum(map(_server_cpu_s, pids)) - shards_cpu
    finally:
        await client.close()
    return ShardRound(len(ports), done * len(keys[0]), client_cpu, shards_cpu)


def measure_shards(counts: list[int], rounds: int, seconds: float, rows: int = SHARD_TABLE_ROWS) -> dict:
    """One `PsClient` fetching the same batches of `SHARD_BATCH` random keys (d `SHARD_DIM`,
    `SHARD_IN_FLIGHT` in flight) from S shards, for each S of `counts`: the client's and the
    shards' CPU per fetched row. Every S's shards run throughout; the rounds alternate over S
    (reversed every other round) so that the machine's load moves each S alike. The figures
    are the medians over the rounds, and the flatness ratios max / min over S."""
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, rows, SHARD_BATCH, dtype=np.int64) for _ in range(SHARD_IN_FLIGHT)]
    with ExitStack() as stack:
        sets = {s: stack.enter_context(_shard_set(ctx, s, rows)) for s in counts}
        measured: list[ShardRound] = []
        for i in range(rounds):
            for s in counts if i % 2 == 0 else counts[::-1]:
                measured.append(run(_shard_round(*sets[s], keys, seconds)))
                _print_shard_round(i, measured[-1])
    return _shard_summary(measured, counts)


def _shard_summary(measured: list[ShardRound], counts: list[int]) -> dict:
    """Per S (keys as strings, for JSON): median microseconds of CPU per fetched row, client
    and shards, their ranges over the rounds; and each one's flatness, max / min over S."""
    out: dict[str, Any] = {"shard_counts": counts, "shard_batch": SHARD_BATCH, "shard_dim": SHARD_DIM,
                           "shard_in_flight": SHARD_IN_FLIGHT,
                           "shard_rounds": [asdict(r) for r in measured]}
    for side in ("client", "shards"):
        medians, ranges = {}, {}
        for s in counts:
            us = [getattr(r, f"{side}_cpu_s") / r.rows * 1e6 for r in measured if r.shards == s]
            medians[str(s)], ranges[str(s)] = statistics.median(us), [min(us), max(us)]
        out[f"{side}_cpu_us_per_row"] = medians
        out[f"{side}_cpu_us_per_row_range"] = ranges
        out[f"{side}_cpu_flatness"] = max(medians.values()) / min(medians.values())
    return out


def _print_shard_round(i: int, r: ShardRound) -> None:
    print(f"{i:>5} {r.shards:>6} | {r.rows:>10,} | {r.client_cpu_s / r.rows * 1e6:>10.3f} "
          f"{r.shards_cpu_s / r.rows * 1e6:>10.3f}", flush=True)


def _print_shard_summary(s: dict) -> None:
    rounds = len(s["shard_rounds"]) // len(s["shard_counts"])
    print(f"\nCPU per fetched row over S shards, median of {rounds} rounds (range), us:")
    for count in map(str, s["shard_counts"]):
        (c_lo, c_hi), (s_lo, s_hi) = s["client_cpu_us_per_row_range"][count], s["shards_cpu_us_per_row_range"][count]
        print(f"  S = {count:>2}: client {s['client_cpu_us_per_row'][count]:.3f} ({c_lo:.3f}-{c_hi:.3f}), "
              f"shards {s['shards_cpu_us_per_row'][count]:.3f} ({s_lo:.3f}-{s_hi:.3f})")
    print(f"  flatness (max / min over S): client {s['client_cpu_flatness']:.2f}, "
          f"shards {s['shards_cpu_flatness']:.2f}")


def shards_table(figures: dict) -> Table:
    """Per S: CPU microseconds per fetched row, client and shards, with the flatness row."""
    rows: list[tuple[object, ...]] = [
        (s, figures["client_cpu_us_per_row"][str(s)], figures["shards_cpu_us_per_row"][str(s)])
        for s in figures["shard_counts"]]
    rows.append(("max / min", figures["client_cpu_flatness"], figures["shards_cpu_flatness"]))
    return Table(("shards S", "client CPU us/row", "shards' CPU us/row"), tuple(rows))


class _Sink:
    """The transport of a connection driven in-process: what the shard writes is counted."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("in-process", 0) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def measure_protocol(rounds: int, requests: int = 12_000, rows: int = TABLE_ROWS) -> dict:
    """The shard's Python cost per small fetch without sockets or an event loop's I/O: one
    h2c connection of a real `H2Server` fed `requests` prepared fetches (`bench.fetch_load`)
    1 and 8 to a read, and the PS handler alone (decode, check, gather, encode) called on
    the same request; median microseconds per request over `rounds`."""
    return run(_protocol(rounds, requests, rows))


async def _protocol(rounds: int, requests: int, rows: int) -> dict:
    service = _service(SMALL_DIM, rows)
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, rows, SMALL_KEYS, dtype=np.int64) for _ in range(SMALL_IN_FLIGHT)]
    fetches = Fetches.of_keys(keys, dim=SMALL_DIM, state_width=0, host="127.0.0.1", port=0, token=TOKEN,
                              incarnation=service.incarnation)
    server = H2Server(service.router(), token=TOKEN)
    connection, sink, sent = server.connection(), _Sink(), H2Requests(fetches)
    connection.connection_made(sink)  # type: ignore[arg-type]
    connection.data_received(H2Requests.preface())
    out: dict[str, list[float]] = {"protocol_h2_us_per_req_1": [], "protocol_h2_us_per_req": [],
                                   "protocol_handler_us_per_req": []}
    route = service.router().resolve("POST", FETCH.path)
    request = Request(method="POST", path=FETCH.path, query={}, body=fetches.bodies[0],
                      headers={INCARNATION_HEADER: service.incarnation})
    for _ in range(rounds):
        for per_read, key in ((1, "protocol_h2_us_per_req_1"), (8, "protocol_h2_us_per_req")):
            reads = [sent.next(per_read)[0] for _ in range(requests // per_read)]
            answered = service.metrics.value("requests_total", {"op": "fetch"})
            started = time.perf_counter()
            for data in reads:
                connection.data_received(data)
            out[key].append((time.perf_counter() - started) / requests * 1e6)
            if service.metrics.value("requests_total", {"op": "fetch"}) - answered != requests:
                raise RuntimeError("the in-process shard did not answer every fetch at once")
        started = time.perf_counter()
        for _ in range(requests):
            answer = start_handler(route, request)
        out["protocol_handler_us_per_req"].append((time.perf_counter() - started) / requests * 1e6)
        if getattr(answer, "status", None) != 200:
            raise RuntimeError(f"the PS handler answered {answer!r}")
    return {key: statistics.median(v) for key, v in out.items()} | {f"{k}_range": [min(v), max(v)] for k, v in out.items()}


def _print_protocol(p: dict, rounds: int) -> None:
    print(f"\nIn-process, no sockets ({SMALL_KEYS}-key fetches to one h2c connection, median of {rounds} rounds):")
    for key, what in (("protocol_h2_us_per_req_1", "h2 server, 1 fetch a read"),
                      ("protocol_h2_us_per_req", "h2 server, 8 fetches a read"),
                      ("protocol_handler_us_per_req", "PS handler alone")):
        lo, hi = p[f"{key}_range"]
        print(f"  {what:<28} {p[key]:6.1f} us/req ({lo:.1f}-{hi:.1f})")


def _small_summary(measured: list[dict]) -> dict:
    """Medians and ranges per protocol and load (`small_http2_raw_rps`, ...); the headline
    `small_http2_rps` and `small_http2_capacity_rps` (and http1's) are the light load's."""
    out: dict = {"small_keys": SMALL_KEYS, "small_dim": SMALL_DIM,
                 "small_in_flight": SMALL_IN_FLIGHT, "small_rounds": measured}
    for transport, secure in PORTS:
        name = _prefix(transport, secure)
        for load in LOADS:
            mine = [r for r in measured if (r["transport"], r["tls"], r["load"]) == (transport, secure, load)]
            if not mine:
                continue
            rps = [r["rps"] for r in mine]
            us = [r["server_us_per_req"] for r in mine]
            key = f"small_{name}_{load}"
            out[f"{key}_rps"] = statistics.median(rps)
            out[f"{key}_rps_range"] = [min(rps), max(rps)]
            out[f"{key}_server_us_per_req"] = statistics.median(us)
            out[f"{key}_server_us_range"] = [min(us), max(us)]
            out[f"{key}_capacity_rps"] = 1e6 / statistics.median(us)
            out[f"{key}_client_us_per_req"] = statistics.median(r["client_us_per_req"] for r in mine)
        if mine:
            out[f"small_{name}_rps"] = out[f"small_{name}_raw_rps"]
            out[f"small_{name}_capacity_rps"] = out[f"small_{name}_raw_capacity_rps"]
        if secure and mine:
            plain = TRANSPORTS[transport]
            out[f"small_{name}_ratio"] = out[f"small_{name}_rps"] / out[f"small_{plain}_rps"]
            out[f"small_{name}_capacity_ratio"] = out[f"small_{name}_capacity_rps"] / out[f"small_{plain}_capacity_rps"]
    return out


def _print_small_round(i: int, r: dict) -> None:
    proto = ("tls " if r["tls"] else "") + r["transport"]
    print(f"{i:>5} {proto:>10} {r['load']:>8} | {r['rps']:>9,.0f} | {r['server_us_per_req']:>9.1f} "
          f"{1e6 / r['server_us_per_req']:>12,.0f} {r['server_busy']:>6.0%} | "
          f"{r['client_us_per_req']:>9.1f}", flush=True)


def _print_small_summary(s: dict, clients: int) -> None:
    protocols = {(r["transport"], r["tls"]) for r in s["small_rounds"]}
    rounds = len(s["small_rounds"]) // (len(protocols) * len(LOADS))
    print(f"\n{SMALL_KEYS}-key fetches, {SMALL_IN_FLIGHT} in flight from {clients} client processes, "
          f"median of {rounds} rounds (range):")
    for transport, secure in PORTS:
        if (transport, secure) not in protocols:
            continue
        name = _prefix(transport, secure)
        for load in LOADS:
            key = f"small_{name}_{load}"
            lo, hi = s[f"{key}_rps_range"]
            us_lo, us_hi = s[f"{key}_server_us_range"]
            print(f"  {name:>9} {load:>8}: {s[f'{key}_rps']:>7,.0f} req/s reached ({lo:,.0f}-{hi:,.0f}); "
                  f"shard CPU {s[f'{key}_server_us_per_req']:.1f} us/req ({us_lo:.1f}-{us_hi:.1f}) = "
                  f"{s[f'{key}_capacity_rps']:,.0f} req/s per shard core; "
                  f"client CPU {s[f'{key}_client_us_per_req']:.1f} us/req")


def _print_row(r: dict) -> None:
    rows_per_s = {k: r[k] * 1e6 / (r["dim"] * 4) for k in ("http2_MBps", "http1_MBps", "inproc_MBps")}
    tls = ""
    if "tls_http2_MBps" in r:
        tls = (f" | {r['tls_http2_MBps']:>9.1f} {r['tls_http2_MBps'] / r['http2_MBps']:>5.2f} "
               f"{r['tls_http1_MBps']:>9.1f} {r['tls_http1_MBps'] / r['http1_MBps']:>5.2f}")
    print(f"{r['dim']:>4} {r['rows']:>7,} | {r['http2_MBps']:>9.1f} {rows_per_s['http2_MBps']:>12,.0f} | "
          f"{r['http1_MBps']:>9.1f} {rows_per_s['http1_MBps']:>12,.0f} | {r['inproc_MBps']:>9.1f} "
          f"{rows_per_s['inproc_MBps']:>13,.0f} | {r['http2_MBps'] / r['http1_MBps']:>5.2f}{tls}", flush=True)


def main() -> int:
    tune_malloc()  # this process is the client, tuned as a trainer is (launch.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter runs (under a minute)")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--small-only", action="store_true", help="only the small-request section")
    parser.add_argument("--clients", type=int, default=2, help="client processes for small fetches")
    parser.add_argument("--rounds", type=int, help="rounds of small fetches per protocol (default 3; 1 with --smoke)")
    parser.add_argument("--shards", type=int, nargs="+",
                        help="shard counts S of the fetches over S shards (default 1 2 4 8; 1 2 with --smoke)")
    parser.add_argument("--tls", action="store_true",
                        help="also over TLS (throw-away certificates), alternating with plaintext")
    add_result_options(parser, NAME, f"a shard of {SMOKE_ROWS:,} rows, two batch sizes, 0.05 s windows, one round")
    args = parser.parse_args()
    if args.clients < 1 or SMALL_IN_FLIGHT % args.clients:
        parser.error(f"--clients must divide the {SMALL_IN_FLIGHT} small fetches in flight")
    rounds = args.rounds or (1 if args.smoke else 3)
    table_rows, requests = (SMOKE_ROWS, 400) if args.smoke else (TABLE_ROWS, 12_000)
    shard_rows = SMOKE_ROWS if args.smoke else SHARD_TABLE_ROWS
    if args.smoke:
        # The small fetches' window opens 0.1 s after the client processes are told: on a
        # loaded machine a much shorter one may close before a client got to run at all.
        batches, seconds, small_seconds, shard_seconds = [1, HEADLINE[0]], 0.05, 0.5, 0.2
    elif args.quick:
        batches, seconds, small_seconds, shard_seconds = [1, 256, 4096, 16384, 65536], 0.6, 1.2, 1.5
    else:
        batches, seconds, small_seconds, shard_seconds = [1, 16, 256, 1024, 4096, 16384, 65536], 2.0, 4.0, 3.0
    with tempfile.TemporaryDirectory(prefix="ps_fetch-tls-") as folder:
        tls_files = _tls_files(Path(folder)) if args.tls else None
        result = {} if args.small_only else _large(batches, args.in_flight, seconds, table_rows, tls_files)
        print(f"\nSmall fetches: {SMALL_KEYS} keys x d {SMALL_DIM}, {SMALL_IN_FLIGHT} in flight, "
              f"{args.clients} client processes; shard CPU from /proc")
        print(f"{'round':>5} {'proto':>10} {'load':>8} | {'req/s':>9} | {'shard':>9} {'req/s/core':>12} "
              f"{'busy':>6} | {'client':>9}")
        print(f"{'':>5} {'':>10} {'':>8} | {'reached':>9} | {'us/req':>9} {'capacity':>12} {'':>6} | "
              f"{'us/req':>9}")
        small = measure_small(args.clients, rounds, small_seconds, table_rows, tls_files)
    _print_small_summary(small, args.clients)
    protocol = measure_protocol(rounds, requests, table_rows)
    _print_protocol(protocol, rounds)
    counts = args.shards or ([1, 2] if args.smoke else [1, 2, 4, 8])
    print(f"\nFetches over S shards: {SHARD_IN_FLIGHT} x {SHARD_BATCH:,} keys x d {SHARD_DIM} in flight from one "
          f"PsClient, table of {shard_rows:,} rows split by key % S; CPU us per fetched row")
    print(f"{'round':>5} {'S':>6} | {'rows':>10} | {'client':>10} {'shards':>10}")
    shards = measure_shards(counts, rounds, shard_seconds, shard_rows)
    _print_shard_summary(shards)
    config = config_of(args, rounds=rounds, table_rows=table_rows, batches=batches, seconds=seconds,
                       small_seconds=small_seconds, protocol_requests=requests, shard_counts=counts,
                       shard_seconds=shard_seconds, shard_table_rows=shard_rows)
    figures = {**result, **small, **protocol, **shards}
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures=figures,
                  headline=headline(figures), smoke=args.smoke,
                  tables={"CPU per fetched row over S shards (one PsClient; median of the rounds)":
                          shards_table(figures)})
    return 0


def _tls_files(folder: Path) -> TlsSection:
    from launcher.certs import make_certificates

    return make_certificates(folder)


def headline(figures: dict) -> Table:
    """The headline figures: large fetches (16,384 x d 64) in MB/s, when measured; small
    fetches in requests per second reached and per shard core, raw load; the shard's
    in-process cost per request. With TLS measured, the same over TLS and TLS / plaintext."""
    rows: list[tuple[object, ...]] = []
    tls = "small_tls_http2_rps" in figures
    if "http2_MBps" in figures:
        rows += [("16,384 rows x d 64, 8 in flight", "MB/s", figures["http2_MBps"], figures["http1_MBps"],
                  figures["inproc_MBps"])]
        if tls:
            rows += [("16,384 rows x d 64, 8 in flight, TLS", "MB/s", figures["tls_http2_MBps"],
                      figures["tls_http1_MBps"], None),
                     ("16,384 rows x d 64: TLS / plaintext (median of 5 rounds)", "ratio",
                      figures["tls_http2_ratio"], figures["tls_http1_ratio"], None),
                     ("  TLS's added CPU, client + shard", "s/GB", figures["tls_http2_added_cpu_s_per_GB"],
                      figures["tls_http1_added_cpu_s_per_GB"], None),
                     ("  the ratio's bound: the cipher alone, no copies", "ratio",
                      figures["tls_http2_ratio_bound_aead"], figures["tls_http1_ratio_bound_aead"], None),
                     ("  the ratio's bound: TLS through memory BIOs", "ratio",
                      figures["tls_http2_ratio_bound_memory_bio"], figures["tls_http1_ratio_bound_memory_bio"],
                      None)]
    if tls:
        rows += [(f"{SMALL_KEYS}-key fetches over TLS, reached", "req/s", figures["small_tls_http2_rps"],
                  figures["small_tls_http1_rps"], None),
                 (f"{SMALL_KEYS}-key fetches reached: TLS / plaintext", "ratio", figures["small_tls_http2_ratio"],
                  figures["small_tls_http1_ratio"], None)]
    rows += [(f"{SMALL_KEYS}-key fetches, reached", "req/s", figures["small_http2_rps"], figures["small_http1_rps"], None),
             (f"{SMALL_KEYS}-key fetches, per shard core", "req/s", figures["small_http2_capacity_rps"],
              figures["small_http1_capacity_rps"], None),
             ("in-process, 8 fetches a read", "us/req", figures["protocol_h2_us_per_req"], None,
              figures["protocol_handler_us_per_req"])]  # fmt: skip
    return Table(("what", "unit", "HTTP/2", "HTTP/1.1", "in-process (np.take; PS handler)"), tuple(rows))


def _large(batches: list[int], in_flight: int, seconds: float, table_rows: int = TABLE_ROWS,
           tls_files: TlsSection | None = None) -> dict:
    """The table of batch sizes and its headline figures."""
    print(f"PS fetch, {in_flight} requests in flight, MB/s of row payload (1 shard, own process)")
    tls = "" if tls_files is None else f" | {'tls h2':>9} {'/h2':>5} {'tls h1':>9} {'/h1':>5}"
    print(f"{'d':>4} {'rows':>7} | {'h2 MB/s':>9} {'h2 rows/s':>12} | {'h1 MB/s':>9} {'h1 rows/s':>12} | "
          f"{'take MB/s':>9} {'take rows/s':>13} | h2/h1{tls}")
    table = measure([16, 64], batches, in_flight, seconds, table_rows, tls_files)
    head = next(r for r in table if (r["rows"], r["dim"]) == HEADLINE)
    result = {
        "http2_MBps": head["http2_MBps"], "http1_MBps": head["http1_MBps"], "inproc_MBps": head["inproc_MBps"],
        "http2_over_http1": head["http2_MBps"] / head["http1_MBps"], "table": table,
    }
    if tls_files is not None:
        for name in ("http2", "http1"):
            result[f"tls_{name}_MBps"] = head[f"tls_{name}_MBps"]
        rounds = 1 if seconds < 0.1 else 5
        print(f"\n16,384 x 64 rows, {in_flight} in flight, in clear then over TLS, {rounds} rounds:")
        result |= measure_tls_ratio(rounds, in_flight, seconds, table_rows, tls_files)
    print(f"\n16,384 x 64 rows, {in_flight} in flight: HTTP/2 {result['http2_MBps']:.0f} MB/s, "
          f"HTTP/1.1 {result['http1_MBps']:.0f} MB/s ({result['http2_over_http1']:.2f}x), "
          f"np.take {result['inproc_MBps']:.0f} MB/s")
    return result


if __name__ == "__main__":
    sys.exit(main())
