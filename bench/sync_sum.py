"""What the exact embedding-gradient sum costs: `Collectives.sum_rows` (rank-ordered: an
all-gather and a fold above two trainers) against a plain ring all-reduce, over gloo between
real trainer processes on loopback, for the buffer sizes a sync list has.

    python -m bench.sync_sum [--trainers 4] [--rows 512 4096] [--dim 16] [--rounds 30] [--json out.json]

Prints, per buffer size, the median time of each and the bytes each trainer receives.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import orjson
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.collectives import Collectives


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
            out[rows] = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(args.trainers, _free_port(), args.rows, args.dim, args.rounds, out), nprocs=args.trainers)
    t, rows_bytes = args.trainers, 4 * args.dim
    print(f"{t} trainers, dim {args.dim}, median of {args.rounds} alternating rounds (ms)")
    print(f"{'rows':>8} {'all_reduce':>11} {'sum_rows':>9} {'ratio':>6} {'recv all_reduce':>16} {'recv sum_rows':>14}")
    result = []
    for rows in args.rows:
        ms = out[rows]
        ring = 2 * (t - 1) / t * rows * rows_bytes
        gathered = (t - 1) * rows * rows_bytes if t > 2 else ring
        print(f"{rows:>8} {ms['all_reduce']:>11.3f} {ms['sum_rows']:>9.3f} {ms['sum_rows'] / ms['all_reduce']:>5.2f}x "
              f"{ring / 1024:>13.1f} KiB {gathered / 1024:>11.1f} KiB")
        result.append({"rows": rows, **ms, "recv_bytes_all_reduce": ring, "recv_bytes_sum_rows": gathered})
    if args.json:
        args.json.write_bytes(orjson.dumps({"trainers": t, "dim": args.dim, "rounds": args.rounds, "sizes": result}))


if __name__ == "__main__":
    main()
