"""What the exact embedding-gradient sum costs: `Collectives.sum_rows` (rank-ordered: an
all-gather and a fold above two trainers) against a plain ring all-reduce, over gloo between
real trainer processes on loopback, for the buffer sizes a sync list has.

    python bench/sync_sum.py [--trainers 4] [--rows 512 4096] [--dim 16] [--rounds 30]

Prints, per buffer size, the median time of each and the bytes each trainer receives; the
results add the spread (min, max) over the rounds. `--smoke`: 3 trainers (the all-gather
path), 64 rows, 2 rounds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import Table, add_result_options, config_of, results_path, write_results  # noqa: E402
from trainer.collectives import Collectives  # noqa: E402

NAME = "sync_sum"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, sizes: list[int], dim: int, rounds: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    comm = Collectives(world_size=world, rank=rank, group=dist.group.WORLD)
    for rows in sizes:
        timings: dict[str, list[float]] = {"all_reduce": [], "sum_rows": []}
        for r in range(rounds * 2):  # alternate the two, round by round
            name = "all_reduce" if r % 2 == 0 else "sum_rows"
            buf = torch.randn(rows, dim)
            comm.barrier()
            start = time.perf_counter()
            if name == "all_reduce":
                comm.all_reduce(buf).wait()
            else:
                comm.sum_rows(buf).wait()
            timings[name].append(time.perf_counter() - start)
        if rank == 0:
            out[rows] = {k: statistics.median(v) * 1e3 for k, v in timings.items()} | {
                f"{k}_range": [min(v) * 1e3, max(v) * 1e3] for k, v in timings.items()}
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, help="trainer processes (default 4; 3 with --smoke)")
    parser.add_argument("--rows", type=int, nargs="+", help="buffer rows (default 512 4096; 64 with --smoke)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 30; 2 with --smoke)")
    add_result_options(parser, NAME, "3 trainers, 64 rows, 2 rounds")
    args = parser.parse_args()
    t = args.trainers or (3 if args.smoke else 4)
    sizes = args.rows or ([64] if args.smoke else [512, 4096])
    rounds = args.rounds or (2 if args.smoke else 30)
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(t, _free_port(), sizes, args.dim, rounds, out), nprocs=t)
    rows_bytes = 4 * args.dim
    print(f"{t} trainers, dim {args.dim}, median of {rounds} alternating rounds (ms)")
    print(f"{'rows':>8} {'all_reduce':>11} {'sum_rows':>9} {'ratio':>6} {'recv all_reduce':>16} {'recv sum_rows':>14}")
    result = []
    for rows in sizes:
        ms = out[rows]
        ring = 2 * (t - 1) / t * rows * rows_bytes
        gathered = (t - 1) * rows * rows_bytes if t > 2 else ring
        print(f"{rows:>8} {ms['all_reduce']:>11.3f} {ms['sum_rows']:>9.3f} {ms['sum_rows'] / ms['all_reduce']:>5.2f}x "
              f"{ring / 1024:>13.1f} KiB {gathered / 1024:>11.1f} KiB")
        result.append({"rows": rows, **ms, "recv_bytes_all_reduce": ring, "recv_bytes_sum_rows": gathered})
    config = config_of(args, trainers=t, rows=sizes, rounds=rounds)
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config,
                  figures={"trainers": t, "dim": args.dim, "rounds": rounds, "sizes": result},
                  headline=headline(t, result), smoke=args.smoke)


def headline(trainers: int, result: list[dict]) -> Table:
    """Per buffer size: median ms of each (and their spread), the ratio, the bytes received."""
    columns = ("trainers", "rows", "all_reduce ms", "spread", "sum_rows ms", "spread", "ratio",
               "recv KiB all_reduce", "recv KiB sum_rows")
    return Table(columns, tuple(
        (trainers, r["rows"], r["all_reduce"], _spread(r["all_reduce_range"]), r["sum_rows"],
         _spread(r["sum_rows_range"]), r["sum_rows"] / r["all_reduce"], r["recv_bytes_all_reduce"] / 1024,
         r["recv_bytes_sum_rows"] / 1024) for r in result))


def _spread(low_high: list[float]) -> str:
    return f"{low_high[0]:.3f}–{low_high[1]:.3f}"


if __name__ == "__main__":
    main()
