"""What the exact embedding-gradient sum costs: `Collectives.sum_rows` (rank-ordered above two
trainers: each chunk sent to its rank, folded there in rank order and sent to every rank,
`trainer.collectives.OrderedSum`) against gloo's ring all-reduce, and against what it replaced
(every buffer gathered and folded), over real trainer processes on loopback, for the buffer
sizes a sync list has.

    python bench/sync_sum.py [--trainers 3 4 8] [--rows 512 4096 32768] [--dim 16] [--rounds 20]

Prints, per trainer count and buffer size, the median time of each (rounds alternate between
them), `sum_rows`'s time over the all-reduce's as the ratio of the medians and as the median
of the ratios within a round (each round times the methods one after another, so the
machine's drift between rounds cancels), and the bytes each trainer receives, computed from
each algorithm (the most any rank receives): a ring all-reduce 2 (T - 1) / T of the buffer,
`sum_rows` (T - 1) chunks of it twice, gather-and-fold T - 1 whole buffers. The results add
the spread (min, max) over the rounds. `--smoke`: 3 trainers, 64 rows, 2 rounds.
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
from common.runtime import tune_malloc  # noqa: E402
from trainer.collectives import Collectives, calm_gloo_loops  # noqa: E402

NAME = "sync_sum"
METHODS = ("all_reduce", "sum_rows", "gather_fold")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, sizes: list[int], dim: int, rounds: int, out: dict) -> None:
    torch.set_num_threads(1)
    tune_malloc()  # as every role does (launch.py): a sum's fresh result reuses freed memory
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    calm_gloo_loops()  # as a trainer does
    comm = Collectives(world_size=world, rank=rank, group=dist.group.WORLD)
    for rows in sizes:
        timings: dict[str, list[float]] = {name: [] for name in METHODS}
        for r in range(rounds * len(METHODS)):  # alternate them, round by round
            name = METHODS[r % len(METHODS)]
            buf = torch.randn(rows, dim)
            comm.barrier()
            start = time.perf_counter()
            if name == "all_reduce":
                comm.group.allreduce([buf]).wait()
            elif name == "sum_rows":
                comm.sum_rows(buf).wait()
            else:
                _gather_fold(comm, buf)
            timings[name].append(time.perf_counter() - start)
        if rank == 0:
            # each round times the methods one after another: the ratio within a round is
            # what the machine's drift (a third from minute to minute here) disturbs least
            pairs = [s / a for s, a in zip(timings["sum_rows"], timings["all_reduce"], strict=True)]
            out[rows] = {k: statistics.median(v) * 1e3 for k, v in timings.items()} | {
                f"{k}_range": [min(v) * 1e3, max(v) * 1e3] for k, v in timings.items()} | {
                "ratio_of_rounds": statistics.median(pairs), "ratio_of_rounds_quartiles": _quartiles(pairs)}
    dist.destroy_process_group()


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def _gather_fold(comm: Collectives, buf: torch.Tensor) -> torch.Tensor:
    """The sum `sum_rows` made before: every trainer's buffer gathered, added in rank order."""
    parts = [torch.empty_like(buf) for _ in range(comm.world_size)]
    comm.group.allgather([parts], [buf]).wait()
    total = parts[0]
    for part in parts[1:]:
        total.add_(part)
    return total


def received_bytes(method: str, trainers: int, rows: int, row_bytes: int) -> float:
    """The bytes the busiest trainer receives in one sum, from the algorithm."""
    n, t = rows * row_bytes, trainers
    if method == "all_reduce" or t <= 2:  # at T = 2 sum_rows exchanges the buffer: the same bytes
        return 2 * (t - 1) / t * n
    if method == "gather_fold":
        return (t - 1) * n
    chunk = -(-rows * (row_bytes // 4) // t) * 4  # ordered_sum cuts the flat buffer of floats
    return 2 * (t - 1) * chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, nargs="+", help="trainer counts, one after another "
                        "(default 3 4 8; 3 with --smoke)")
    parser.add_argument("--rows", type=int, nargs="+", help="buffer rows (default 512 4096 32768; 64 with --smoke)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 20; 2 with --smoke)")
    add_result_options(parser, NAME, "3 trainers, 64 rows, 2 rounds")
    args = parser.parse_args()
    counts = args.trainers or ([3] if args.smoke else [3, 4, 8])
    sizes = args.rows or ([64] if args.smoke else [512, 4096, 32768])
    rounds = args.rounds or (2 if args.smoke else 20)
    row_bytes = 4 * args.dim
    result = []
    for t in counts:
        out = mp.Manager().dict()
        mp.spawn(_rank, args=(t, _free_port(), sizes, args.dim, rounds, out), nprocs=t)
        print(f"{t} trainers, dim {args.dim}, median of {rounds} alternating rounds (ms); KiB received")
        print(f"{'rows':>8} {'all_reduce':>11} {'sum_rows':>9} {'gather_fold':>12} {'ratio':>6} {'by round':>9} "
              f"{'recv all_reduce':>16} {'recv sum_rows':>14} {'recv gather':>12}")
        for rows in sizes:
            ms = out[rows]
            recv = {m: received_bytes(m, t, rows, row_bytes) for m in METHODS}
            print(f"{rows:>8} {ms['all_reduce']:>11.3f} {ms['sum_rows']:>9.3f} {ms['gather_fold']:>12.3f} "
                  f"{ms['sum_rows'] / ms['all_reduce']:>5.2f}x {ms['ratio_of_rounds']:>8.2f}x "
                  f"{recv['all_reduce'] / 1024:>16.1f} {recv['sum_rows'] / 1024:>14.1f} "
                  f"{recv['gather_fold'] / 1024:>12.1f}")
            result.append({"trainers": t, "rows": rows, **ms, **{f"recv_bytes_{m}": recv[m] for m in METHODS}})
    config = config_of(args, trainers=counts, rows=sizes, rounds=rounds)
    figures = {
        "dim": args.dim, "rounds": rounds, "sizes": result,
        # T -> bytes received by sum_rows / a ring all-reduce's, at the largest buffer
        "sync_bytes_ratio": {str(r["trainers"]): r["recv_bytes_sum_rows"] / r["recv_bytes_all_reduce"]
                             for r in result if r["rows"] == max(sizes)},
        "sync_time_ratio": {str(r["trainers"]): r["sum_rows"] / r["all_reduce"]
                            for r in result if r["rows"] == max(sizes)},
        # the median over rounds of sum_rows / all_reduce timed in the same round
        "sync_time_ratio_of_rounds": {str(r["trainers"]): r["ratio_of_rounds"]
                                      for r in result if r["rows"] == max(sizes)},
    }
    write_results(results_path(NAME, args.json, args.smoke), bench=NAME, config=config, figures=figures,
                  headline=headline(result), smoke=args.smoke)


def headline(result: list[dict]) -> Table:
    """Per trainer count and buffer size: median ms of each (the spread of sum_rows), the
    ratio to the all-reduce, the KiB each receives."""
    columns = ("trainers", "rows", "all_reduce ms", "sum_rows ms", "spread", "gather_fold ms", "ratio",
               "ratio by round", "quartiles", "recv KiB all_reduce", "recv KiB sum_rows", "recv KiB gather_fold")
    return Table(columns, tuple(
        (r["trainers"], r["rows"], r["all_reduce"], r["sum_rows"], _spread(r["sum_rows_range"]), r["gather_fold"],
         r["sum_rows"] / r["all_reduce"], r["ratio_of_rounds"], _spread(r["ratio_of_rounds_quartiles"]),
         r["recv_bytes_all_reduce"] / 1024, r["recv_bytes_sum_rows"] / 1024,
         r["recv_bytes_gather_fold"] / 1024) for r in result))


def _spread(low_high: list[float]) -> str:
    return f"{low_high[0]:.3f}–{low_high[1]:.3f}"


if __name__ == "__main__":
    main()
