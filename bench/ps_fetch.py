#!/usr/bin/env python3
"""PS fetch throughput over HTTP/2 and HTTP/1.1, beside in-process `np.take` of the same rows.

A real PS shard runs in its own process (both protocols on two ports); this process fetches
random rows with N requests in flight for batch sizes 1 … 65,536 and d = 16 and 64, and
prints rows/s and MB/s (MB = 10^6 bytes of row payload). `--json` writes every figure plus
the headline keys `http2_MBps`, `http1_MBps`, `inproc_MBps` (16,384 rows × d 64, 8 in flight).

    python bench/ps_fetch.py --quick --json runs/bench/ps_fetch.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import write_json  # noqa: E402
from common.keys import TableLayout  # noqa: E402
from common.spec import Endpoint  # noqa: E402
from common.transport import H2Server, Http1Server, run  # noqa: E402
from ps.client import PsClient  # noqa: E402
from ps.service import PsService  # noqa: E402
from ps.store import ShardConfig, ShardStore  # noqa: E402

TOKEN = "bench"
TABLE_ROWS = 1 << 20
HEADLINE = (16384, 64)


def _serve(dim: int, ports: mp.Queue, stop: mp.Event) -> None:
    async def main() -> None:
        config = ShardConfig(shard=0, num_shards=1, layout=TableLayout((TABLE_ROWS,)), dim=dim, state_width=0)
        store = ShardStore(config)
        store.gather(np.arange(TABLE_ROWS))  # initialise every row: measure steady state
        service = PsService(store, checkpoint_dir=Path("/nonexistent"), fetch_timeout_s=60)
        servers = [
            H2Server(service.router(), port=0, token=TOKEN, max_body_bytes=1 << 30),
            Http1Server(service.router(), port=0, token=TOKEN, max_body_bytes=1 << 30),
        ]
        for server in servers:
            await server.start()
        ports.put([s.port for s in servers])
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for server in servers:
            await server.stop()

    run(main())


async def _fetch_rate(port: int, transport: str, dim: int, batch: int, in_flight: int, seconds: float) -> float:
    """Row-payload bytes per second fetched by `in_flight` concurrent loops."""
    client = PsClient([Endpoint(host="127.0.0.1", port=port)], token=TOKEN, dim=dim, state_width=0,
                      transport=transport, timeout_s=120)
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, TABLE_ROWS, batch, dtype=np.int64) for _ in range(in_flight)]
    try:
        await asyncio.gather(*(client.fetch(k) for k in keys))  # warm the connection
        done = 0
        deadline = time.perf_counter() + seconds

        async def loop(k: np.ndarray) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await client.fetch(k)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in keys))
        elapsed = time.perf_counter() - started
    finally:
        await client.close()
    return done * batch * dim * 4 / elapsed


def _take_rate(dim: int, batch: int, seconds: float) -> float:
    table = np.random.default_rng(0).random((TABLE_ROWS, dim), dtype=np.float32)
    keys = np.random.default_rng(1).integers(0, TABLE_ROWS, batch)
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or done < 3:
        np.take(table, keys, axis=0)
        done += 1
    return done * batch * dim * 4 / elapsed


def measure(dims: list[int], batches: list[int], in_flight: int, seconds: float) -> list[dict]:
    rows = []
    ctx = mp.get_context("spawn")
    for dim in dims:
        ports, stop = ctx.Queue(), ctx.Event()
        server = ctx.Process(target=_serve, args=(dim, ports, stop), daemon=True)
        server.start()
        h2_port, http1_port = ports.get(timeout=120)
        try:
            for batch in batches:
                h2 = run(_fetch_rate(h2_port, "h2", dim, batch, in_flight, seconds))
                http1 = run(_fetch_rate(http1_port, "http1", dim, batch, in_flight, seconds))
                take = _take_rate(dim, batch, seconds)
                rows.append({"dim": dim, "rows": batch, "in_flight": in_flight,
                             "http2_MBps": h2 / 1e6, "http1_MBps": http1 / 1e6, "inproc_MBps": take / 1e6})
                _print_row(rows[-1])
        finally:
            stop.set()
            server.join(30)
    return rows


def _print_row(r: dict) -> None:
    rows_per_s = {k: r[k] * 1e6 / (r["dim"] * 4) for k in ("http2_MBps", "http1_MBps", "inproc_MBps")}
    print(f"{r['dim']:>4} {r['rows']:>7,} | {r['http2_MBps']:>9.1f} {rows_per_s['http2_MBps']:>12,.0f} | "
          f"{r['http1_MBps']:>9.1f} {rows_per_s['http1_MBps']:>12,.0f} | {r['inproc_MBps']:>9.1f} "
          f"{rows_per_s['inproc_MBps']:>13,.0f} | {r['http2_MBps'] / r['http1_MBps']:>5.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter runs (under a minute)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--in-flight", type=int, default=8)
    args = parser.parse_args()
    if args.quick:
        batches, seconds = [1, 256, 4096, 16384, 65536], 0.6
    else:
        batches, seconds = [1, 16, 256, 1024, 4096, 16384, 65536], 2.0
    print(f"PS fetch, {args.in_flight} requests in flight, MB/s of row payload (1 shard, own process)")
    print(f"{'d':>4} {'rows':>7} | {'h2 MB/s':>9} {'h2 rows/s':>12} | {'h1 MB/s':>9} {'h1 rows/s':>12} | "
          f"{'take MB/s':>9} {'take rows/s':>13} | h2/h1")
    table = measure([16, 64], batches, args.in_flight, seconds)
    head = next(r for r in table if (r["rows"], r["dim"]) == HEADLINE)
    result = {
        "http2_MBps": head["http2_MBps"], "http1_MBps": head["http1_MBps"], "inproc_MBps": head["inproc_MBps"],
        "http2_over_http1": head["http2_MBps"] / head["http1_MBps"], "table": table,
    }
    print(f"\n16,384 x 64 rows, {args.in_flight} in flight: HTTP/2 {result['http2_MBps']:.0f} MB/s, "
          f"HTTP/1.1 {result['http1_MBps']:.0f} MB/s ({result['http2_over_http1']:.2f}x), "
          f"np.take {result['inproc_MBps']:.0f} MB/s")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
