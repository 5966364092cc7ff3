#!/usr/bin/env python3
"""What a PS write-back costs while fetches wait for versions, indexed (`ps.waiting`) and
as before it (every waiting fetch's whole key array re-checked on every write-back).

A shard of 1 M rows; W fetches of K rows each wait for version 1 of their rows, of which
1/16 are still behind (the rest are there already: a fetch waits for the few rows another
trainer has yet to write back); write-backs of B rows then bring every row behind to version
1 in a random order, each followed by one of B rows nobody waits for (most write-backs, in
a run), each followed by the wake-up check. Prints µs per write-back (the check alone) for
both; the results hold the medians and their spread over the alternating rounds.

    python bench/ps_waiting.py --quick

`--smoke`: one small case (4 fetches of 256 rows, write-backs of 64), one round.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from ps.waiting import WaitingFetches  # noqa: E402

NAME = "ps_waiting"
ROWS = 1 << 20


BEHIND = 16  # one row in BEHIND of a waiting fetch is behind


def _scenario(waiting: int, keys: int, batch: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The waiting fetches' keys, the write-backs, and the rows at version 1 from the start."""
    rng = np.random.default_rng(seed)
    fetches = [rng.choice(ROWS, keys, replace=False) for _ in range(waiting)]
    fetched = np.unique(np.concatenate(fetches))
    touched = rng.choice(fetched, max(1, len(fetched) // BEHIND), replace=False)
    there = np.setdiff1d(fetched, touched)
    order = rng.permutation(touched)
    others = rng.permutation(np.setdiff1d(np.arange(ROWS), fetched))
    writes = []
    for k, i in enumerate(range(0, len(order), batch)):
        writes += [order[i : i + batch], others[k * batch : (k + 1) * batch]]
    return fetches, writes, there


def indexed(fetches: list[np.ndarray], writes: list[np.ndarray], there: np.ndarray) -> tuple[float, int]:
    """Seconds spent in the wake-up checks, and how many fetches woke."""
    versions = np.zeros(ROWS, dtype=np.int64)
    versions[there] = 1
    index = WaitingFetches(ROWS)
    for keys in fetches:
        index.wait(keys, np.ones(len(keys), dtype=np.int64), versions)
    spent, woke = 0.0, 0
    for rows in writes:
        versions[rows] = 1
        started = time.perf_counter()
        woke += len(index.written(rows, versions))
        spent += time.perf_counter() - started
    return spent, woke


def rechecked(fetches: list[np.ndarray], writes: list[np.ndarray], there: np.ndarray) -> tuple[float, int]:
    """The same with the check it replaced: each waiting fetch's rows, all of them, again."""
    versions = np.zeros(ROWS, dtype=np.int64)
    versions[there] = 1
    waiting = {i: (keys, np.ones(len(keys), dtype=np.int64)) for i, keys in enumerate(fetches)}
    spent, woke = 0.0, 0
    for rows in writes:
        versions[rows] = 1
        started = time.perf_counter()
        for i, (keys, need) in list(waiting.items()):
            if (versions[keys] >= need).all():
                del waiting[i]
                woke += 1
        spent += time.perf_counter() - started
    return spent, woke


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--rounds", type=int, help="alternating rounds; medians are printed (default 3; 1 with --smoke)")
    add_result_options(parser, NAME, "one small case, one round")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.smoke else 3)
    if args.smoke:
        cases = [(4, 256, 64)]
    else:
        cases = [(16, 2048, 256), (64, 2048, 256)] if args.quick else [(16, 2048, 256), (64, 2048, 256), (256, 2048, 1024)]
    print(f"{'waiting':>8} {'keys':>6} {'write rows':>10} | {'indexed µs':>11} {'rechecked µs':>13} {'ratio':>6}")
    results = []
    for waiting, keys, batch in cases:
        fetches, writes, there = _scenario(waiting, keys, batch)
        times: dict[str, list[float]] = {"indexed": [], "rechecked": []}
        for _ in range(rounds):  # alternating, so drift on a shared machine hits both
            for name, run in (("indexed", indexed), ("rechecked", rechecked)):
                spent, woke = run(fetches, writes, there)
                assert woke == waiting, f"{name} woke {woke} of {waiting}"
                times[name].append(spent / len(writes) * 1e6)
        med = {k: float(np.median(v)) for k, v in times.items()}
        spread = {k: [round(min(v), 1), round(max(v), 1)] for k, v in times.items()}
        results.append({"waiting": waiting, "keys": keys, "write_rows": batch, "writes": len(writes),
                        "indexed_us": med["indexed"], "rechecked_us": med["rechecked"], "spread_us": spread})
        print(f"{waiting:>8} {keys:>6} {batch:>10} | {med['indexed']:>11.1f} {med['rechecked']:>13.1f} "
              f"{med['rechecked'] / med['indexed']:>5.1f}x", flush=True)
    config = config_of(args, rounds=rounds, rows=ROWS, behind=BEHIND, cases=cases)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"cases": results}, headline=headline(results), smoke=args.smoke)
    return 0


def headline(results: list[dict]) -> Table:
    """Per case: µs per write-back of the indexed check and of the re-check, medians and spread."""
    columns = ("waiting", "keys", "write rows", "indexed µs", "spread", "rechecked µs", "spread", "ratio")
    return Table(columns, tuple((r["waiting"], r["keys"], r["write_rows"], r["indexed_us"],
                                 "–".join(map(str, r["spread_us"]["indexed"])), r["rechecked_us"],
                                 "–".join(map(str, r["spread_us"]["rechecked"])), r["rechecked_us"] / r["indexed_us"])
                                for r in results))


if __name__ == "__main__":
    sys.exit(main())
